"""The engine benchmark's smoke mode runs end to end in-process and prints every part; bad flags are refused."""
import pytest
import torch

from spectr_gbv.decoding.precision import cpu_name
from spectr_gbv.tools.bench_engine import main


@pytest.fixture
def restore_threads():
    """--tiny sets one torch thread for the whole process: give the other tests theirs back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_tiny_run_prints_machine_limits_costs_and_batches(capsys, restore_threads):
    main(["--tiny", "--prompts", "1", "--batch-prompts", "4", "--max-new-tokens", "6", "--block-length", "2",
          "--max-drafts", "2", "--repeats", "2", "--dtype", "float64"])  # returns: exit status 0
    out = capsys.readouterr().out
    assert out.startswith(f"machine: {cpu_name()}, AMX-BF16: ")
    assert "AVX512-BF16: " in out and f"torch {torch.__version__}" in out and "float64" in out
    for heading in ["Greedy (T=0)", "ar / generate() tokens/s", "Sampling (T=1): speedup vs the cost-model limit",
                    "limit", "share", "ar itself runs at", "Bare forwards", "Batch throughput",
                    "rows/pass", "ar tok/s", "vs ar"]:
        assert heading in out
    assert "gbv K=2 L=2" in out and "same tokens as B=1" in out
    # the greedy table's hooks count every model's passes: the engine's token K=1 and assisted generation run up to
    # L = 2 drafter passes per target call (fewer where fewer tokens can be kept), ar and generate() none
    greedy = {row["method"]: row for row in table_rows(out[:out.index("Sampling (T=1)")])}
    assert 1 <= float(greedy["token K=1 L=2"]["drafter fwds"]) <= 2
    assert 1 <= float(greedy["transformers assisted, L=2"]["drafter fwds"]) <= 2
    assert greedy["ar"]["drafter fwds"] == greedy["transformers generate()"]["drafter fwds"] == "0.00"
    # B = 1, 2, 4 on 4 prompts (not 8), in chunks and refilled (B = 1 in chunks only); float64, so every B and mode
    # emits the tokens of B = 1; a refilled pass holds at least the rows a chunked one does, on average
    batch = {(row["mode"], row["B"]): row for row in table_rows(out[out.index("Batch throughput"):])}
    assert list(batch) == [("chunks", "1"), ("chunks", "2"), ("refill", "2"), ("chunks", "4"), ("refill", "4")]
    assert all(row["same tokens as B=1"] == "yes" for row in batch.values())
    for B in ("2", "4"):
        assert float(batch["refill", B]["rows/pass"]) >= float(batch["chunks", B]["rows/pass"])


def table_rows(text: str) -> list[dict[str, str]]:
    """The body rows of the first rich table in text, by column heading."""
    def cells(line, bar):
        return [cell.strip() for cell in line.strip(bar).split(bar)]
    lines = text.splitlines()
    heading = cells(next(line for line in lines if line.startswith("┃")), "┃")
    return [dict(zip(heading, cells(line, "│"))) for line in lines if line.startswith("│")]


@pytest.mark.parametrize("flag, named", [(["--drafter-quantize", "int8"], "float32, drafter int8"),
                                         (["--linear-kernel", "onednn"], "float32, linear layers on onednn"),
                                         (["--linear-kernel", "onednn", "--drafter-dtype", "bfloat16",
                                           "--drafter-quantize", "int8"],
                                          "float32, linear layers on onednn, drafter bfloat16 int8"),
                                         (["--linear-kernel", "onednn", "--drafter-quantize", "int8_dynamic"],
                                          "float32, linear layers on onednn, drafter int8_dynamic")])
def test_other_linear_layers_are_named_with_the_machine(flag, named, capsys, restore_threads):
    main(["--tiny", "--prompts", "1", "--batch-prompts", "1", "--max-new-tokens", "4", "--block-length", "2",
          "--max-drafts", "1", "--repeats", "1", *flag])
    assert capsys.readouterr().out.splitlines()[0].endswith(named)


@pytest.mark.parametrize("flag", [["--max-new-tokens", "0"], ["--block-length", "-1"], ["--repeats", "0"],
                                  ["--dtype", "int4"], ["--batch-prompts", "0"], ["--prompts", "99"],
                                  ["--dtype", "bfloat16", "--linear-kernel", "onednn"],
                                  ["--drafter-dtype", "float64", "--drafter-quantize", "int8"],
                                  ["--batch-sizes", "2", "4"], ["--batch-sizes", "1", "0"]])
def test_bad_flag_values_exit_nonzero(flag, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--tiny", *flag])
    assert exit_.value.code != 0
    assert "error" in capsys.readouterr().err


def test_batch_only_prints_the_batch_part_alone(capsys, restore_threads):
    main(["--tiny", "--batch-only", "--batch-sizes", "1", "2", "--batch-prompts", "3", "--max-new-tokens", "4",
          "--block-length", "2", "--repeats", "1"])
    out = capsys.readouterr().out
    assert "Batch throughput" in out and "Greedy (T=0)" not in out and "Sampling (T=1)" not in out
    assert [(row["mode"], row["B"]) for row in table_rows(out[out.index("Batch throughput"):])] == [
        ("chunks", "1"), ("chunks", "2"), ("refill", "2")]

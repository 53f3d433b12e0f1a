"""The report gathers every summary.json below a folder into one table (Markdown, CSV) and draws the plots."""
import csv
import dataclasses
import json

import pytest

from spectr_gbv.experiment.metrics import COUNTERS, RECORD_TIMES, aggregate
from spectr_gbv.tools.report import main, refresh_page

BLOCK_LENGTHS = (2, 4)


def write_summary(folder, verifier, num_drafts, block_length, baseline=True, datasets=("mtbench", "gsm8k"),
                  temperature=1.0, limit=None):
    counts = [0.0] * len(COUNTERS)
    values = {"prompts": 4, "new_tokens": 40 + 5 * num_drafts, "target_calls": 20, "total_time": 2.0,
              "new_tokens_sq": 450, "target_calls_sq": 100, "new_x_calls": 210, "ar_new_tokens": 40 * baseline,
              "ar_time": 3.0 * baseline, "draft_time": 0.8, "target_time": 1.0, "verify_time": 0.1,
              "target_positions": 5.0 * (block_length + 7)}
    for key, value in values.items():
        counts[COUNTERS.index(key)] = value
    metrics = aggregate(counts, [5.0, 3] + [1] * (block_length - 1))  # block_length + 7 iterations
    if limit is not None:  # as the module adds it with baseline=true
        metrics.update(speed_limit=limit, speed_limit_share=metrics["speedup"] / limit)
    folder.mkdir(parents=True, exist_ok=True)
    summary = {"verifier": verifier, "num_drafts": num_drafts, "block_length": block_length, "temperature": temperature,
               "max_new_tokens": 16, "model": "tiny", "drafter": "tiny'", "machine": "a CPU, 2 torch threads",
               "metrics": {**{name: metrics for name in datasets}, "overall": metrics}}
    (folder / "summary.json").write_text(json.dumps(summary))


def test_the_records_times_are_the_engines():
    from spectr_gbv.decoding.engine import DecodeRecord

    assert {f.name for f in dataclasses.fields(DecodeRecord) if f.name.endswith("_time")} == set(RECORD_TIMES)


@pytest.fixture
def sweep(tmp_path):
    job = 0
    for verifier in ("gbv", "spectr"):
        for num_drafts in (1, 2, 3):
            for block_length in BLOCK_LENGTHS:
                write_summary(tmp_path / str(job), verifier, num_drafts, block_length)
                job += 1
    return tmp_path


def test_report_table_and_plots(sweep, capsys):
    main([str(sweep)])
    rows = list(csv.DictReader((sweep / "report.csv").open()))
    assert len(rows) == 12 * 3  # every job: per dataset, then overall
    assert [row["job"] for row in rows[:9:3]] == ["0", "1", "2"] and rows[-1]["job"] == "11"  # numeric order
    assert [row["dataset"] for row in rows[:3]] == ["mtbench", "gsm8k", "overall"]
    first = rows[0]
    assert first["verifier"] == "gbv" and first["num_drafts"] == "1" and float(first["speedup"]) > 1
    markdown = (sweep / "report.md").read_text()
    assert markdown == capsys.readouterr().out
    by_dataset, long_table = markdown.split("\n\n")
    assert by_dataset.startswith("| method | mtbench BE | gsm8k BE | mean BE | mtbench speedup | gsm8k speedup |")
    assert by_dataset.count("\n") == 2 + 12 - 1 and "| gbv K=1 L=2 | " in by_dataset  # a row per job
    efficiency, error = float(rows[0]["block_efficiency"]), float(rows[0]["block_efficiency_se"])
    mean_cell = f"| {efficiency:.2f} ({error / 2**0.5:.2f}) |"  # two datasets with equal errors
    assert by_dataset.splitlines()[2].count(mean_cell) == 1
    assert long_table.count("\n") == 2 + len(rows)
    for name in ("block_efficiency_vs_num_drafts", "block_efficiency_vs_block_length", "speedup_vs_num_drafts"):
        assert (sweep / f"{name}.png").read_bytes()[:4] == b"\x89PNG"


def test_report_of_one_run_without_baseline(tmp_path, capsys):
    write_summary(tmp_path, "token", 1, 4, baseline=False, datasets=["nq"])
    main([str(tmp_path)])
    table = capsys.readouterr().out
    assert "| . | nq | token | 1 | 4 |" in table and "overall" not in table  # one dataset: no repeated row
    assert not list(tmp_path.glob("*.png"))  # one point is no curve


def test_report_plots_block_efficiency_against_temperature(tmp_path):
    for job, temperature in enumerate((0.0, 0.4, 1.0)):
        write_summary(tmp_path / str(job), "gbv", 3, 8, temperature=temperature)
    main([str(tmp_path)])
    assert (tmp_path / "block_efficiency_vs_temperature.png").read_bytes()[:4] == b"\x89PNG"
    assert not (tmp_path / "block_efficiency_vs_num_drafts.png").exists()


def test_speed_table_puts_each_speedup_beside_its_limit(tmp_path, capsys):
    write_summary(tmp_path / "0", "token", 1, 4, datasets=["nq"])  # no limit measured: not in the speed table
    for job, k in enumerate((1, 3), start=1):
        write_summary(tmp_path / str(job), "gbv", k, 4, limit=2.5)
    main([str(tmp_path)])
    lines = capsys.readouterr().out.splitlines()
    assert "Measured on a CPU, 2 torch threads:" in lines  # every speed figure names its machine
    header = lines.index("| method | prompts | tokens/s | ar tokens/s | speedup | block eff. | trie positions | "
                         "limit | share | draft % | target % | verify % |")
    # 45 new tokens / 2 s = 22.50 tokens/s against ar's 40 / 3 s: 1.69x, 67% of 2.5x; 5 positions per iteration
    assert lines[header + 2] == "| gbv K=1 L=4 | 4 | 22.50 | 13.33 | 1.69x | 2.25 | 5.0 | 2.50x | 68% | 40 | 50 | 5 |"
    assert lines[header + 3].startswith("| gbv K=3 L=4 | 4 | 27.50 | 13.33 | 2.06x | ") and not lines[header + 4]
    assert (tmp_path / "speedup_vs_limit.png").read_bytes()[:4] == b"\x89PNG"


def test_a_page_quoting_the_report_gets_its_rows_refreshed_and_keeps_its_prose(tmp_path):
    printed = ("| method | mtbench BE |\n|---|---|\n| gbv K=1 | 2.50 |\n| gbv K=3 | 3.10 |\n| spectr K=3 | 3.00 |\n\n"
               "| paired | setting | overall |\n|---|---|---|\n| a - b | L=2 | +0.1 |\n| a - b | L=4 | +0.3 |\n")
    page = tmp_path / "results.md"
    page.write_text("Prose 2.40.\n\n| method | mtbench BE |\n|---|---|\n| spectr K=3 | 2.90 |\n| gbv K=1 | 2.40 |\n\n"
                    "| paired | setting | overall |\n|---|---|---|\n| a - b | L=4 | +0.2 |\n\n"
                    "| method | other |\n|---|---|\n| gbv K=1 | 9 |\n")
    assert refresh_page(page, printed) == 3
    # the page's own rows and order; a table with another header (another part's) is left alone, and so is prose
    assert page.read_text() == ("Prose 2.40.\n\n| method | mtbench BE |\n|---|---|\n| spectr K=3 | 3.00 |\n"
                                "| gbv K=1 | 2.50 |\n\n| paired | setting | overall |\n|---|---|---|\n"
                                "| a - b | L=4 | +0.3 |\n\n| method | other |\n|---|---|\n| gbv K=1 | 9 |\n")
    assert refresh_page(page, printed) == 0


def test_a_paired_row_is_refreshed_only_by_the_same_setting(tmp_path):
    printed = "| paired | setting | overall |\n|---|---|---|\n| a - b | L=4 | +0.3 |\n| c - d | L=4 | +0.1 |\n"
    page = tmp_path / "results.md"
    quoted = "| paired | setting | overall |\n|---|---|---|\n| a - b | L=8 | +0.2 |\n"  # another part's setting
    page.write_text(quoted)
    assert refresh_page(page, printed) == 0 and page.read_text() == quoted


def test_a_table_marked_with_its_part_is_refreshed_only_by_that_part(tmp_path):
    printed = "| method | mtbench BE |\n|---|---|\n| gbv K=3 L=8 | 5.62 |\n"  # the speed part's row of the same name
    page = tmp_path / "results.md"
    quoted = "<!-- report: main -->\n| method | mtbench BE |\n|---|---|\n| gbv K=3 L=8 | 4.97 |\n"
    page.write_text(quoted)
    assert refresh_page(page, printed, "speed") == 0 and page.read_text() == quoted
    assert refresh_page(page, printed, "main") == 1 and "| gbv K=3 L=8 | 5.62 |" in page.read_text()


def test_report_of_an_empty_folder_is_one_error(tmp_path):
    with pytest.raises(SystemExit, match="no summary.json or real audit below it"):
        main([str(tmp_path)])


def test_greedy_agreement_counts_prompts_with_ar_tokens(tmp_path, capsys):
    for job, verifier, outputs in [("0", "ar", [[1, 2], [3, 4]]), ("1", "gbv", [[1, 2], [3, 5]])]:
        write_summary(tmp_path / job, verifier, 1, 4, baseline=False, datasets=["tiny"], temperature=0)
        records = [{"dataset": "tiny", "prompt_id": i, "output_ids": ids} for i, ids in enumerate(outputs)]
        (tmp_path / job / "predictions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    main([str(tmp_path)])
    assert "| gbv K=1 | 1 / 2 |" in capsys.readouterr().out


def test_paired_differences_resolve_an_ordering_with_a_seeded_interval(tmp_path, capsys):
    # gbv K=3 emits one more token per call than spectr on every prompt: resolved. Against gbv K=1 it gains
    # +1 or -1 in turn: the interval holds 0.
    for job, (verifier, k) in enumerate([("gbv", 3), ("spectr", 3), ("gbv", 1)]):
        write_summary(tmp_path / str(job), verifier, k, 8, datasets=["mtbench", "gsm8k"])
        new = {("gbv", 3): lambda i: 50, ("spectr", 3): lambda i: 40, ("gbv", 1): lambda i: 40 + 20 * (i % 4 < 2)}
        records = [{"dataset": ("mtbench", "gsm8k")[i % 2], "prompt_id": i // 2, "new_tokens": new[verifier, k](i),
                    "target_calls": 10} for i in range(12)]
        (tmp_path / str(job) / "predictions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    main([str(tmp_path)])
    out = capsys.readouterr().out
    spectr_row = next(line for line in out.splitlines() if line.startswith("| gbv K=3 - spectr K=3 "))
    assert "| L=8 T=1.0 | +1.00 [+1.00, +1.00] | +1.00 [+1.00, +1.00] | +1.00 [+1.00, +1.00] |" in spectr_row
    assert spectr_row.endswith("| gbv K=3 higher: resolved (12 prompts) |")
    assert "unresolved, the interval holds 0 (12 prompts)" in next(
        line for line in out.splitlines() if line.startswith("| gbv K=3 - gbv K=1 "))
    assert (tmp_path / "paired_differences.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "block_efficiency_by_dataset.png").read_bytes()[:4] == b"\x89PNG"


def test_paired_bootstrap_is_seeded_and_covers_the_mean():
    from spectr_gbv.experiment.metrics import paired_difference

    a = {("d", i): float(i % 5) for i in range(50)} | {("e", i): 1.0 for i in range(10)}
    b = {key: 0.0 for key in a} | {("d", 99): 3.0}  # unpaired prompts are left out
    first, again = paired_difference(a, b), paired_difference(a, b)
    assert first == again and first["overall"]["prompts"] == 60
    assert {key: first["e"][key] for key in ("prompts", "contexts", "mean", "low", "high")} == {
        "prompts": 10, "contexts": 10, "mean": 1.0, "low": 1.0, "high": 1.0}
    assert first["d"]["low"] < first["d"]["mean"] == 2.0 < first["d"]["high"]
    assert first["overall"]["low"] < (100 + 10) / 60 < first["overall"]["high"]


def test_jobs_at_several_temperatures_keep_a_row_each(tmp_path, capsys):
    for job, temperature in enumerate((0.0, 0.4)):
        write_summary(tmp_path / str(job), "gbv", 3, 8, temperature=temperature)
    main([str(tmp_path)])
    out = capsys.readouterr().out
    assert "| gbv K=3 L=8 temperature=0.0 | " in out and "| gbv K=3 L=8 temperature=0.4 | " in out



"""run.py end to end, as a user runs it (subprocesses, tiny models): files, multirun + W&B offline, DDP on CPU equal
to one process, a killed job resumed, and one line for each bad input."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import ROOT, TINY
from spectr_gbv.decoding.gguf_packages import DEFAULT_PAIR

# Greedy target with a sampling drafter: outputs are deterministic, acceptance is neither 0 nor 1.
GREEDY = ["temperature=0", "draft_temperature=1", "num_drafts=2", "block_length=3", "limit=5"]


def run_py(*args: str, env: dict | None = None, background: bool = False, stderr: Path | None = None):
    """Run run.py on tiny models; in the background, its stderr goes to the file `stderr` (or nowhere)."""
    flags = [arg for arg in args if arg.startswith("-")]  # e.g. -m: Hydra wants flags before the overrides
    command = [sys.executable, "run.py", *flags, *TINY, *[arg for arg in args if arg not in flags]]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    if background:
        errors = stderr.open("w") if stderr else subprocess.DEVNULL
        # SIGINT at its default, so Python turns it into KeyboardInterrupt even when these tests run in a shell's
        # background job, which starts with SIGINT ignored (and an ignored signal stays ignored across exec)
        return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=errors,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def signal_after_records(process, predictions: Path, count: int, signum: int) -> None:
    """Send signum to a background run.py once predictions holds `count` records (or the run has ended)."""
    while process.poll() is None and not (predictions.exists() and predictions.read_text().count("\n") >= count):
        time.sleep(0.02)
    process.send_signal(signum)


def records(folder: Path) -> dict:
    lines = (folder / "predictions.jsonl").read_text().splitlines()
    found = {(r["dataset"], r["prompt_id"]): r for r in map(json.loads, lines)}
    assert len(found) == len(lines), "a prompt was recorded twice"
    return found


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    folder = tmp_path_factory.mktemp("single")
    done = run_py(*GREEDY, "baseline=true", f"hydra.run.dir={folder}")
    assert done.returncode == 0, done.stderr[-3000:]
    return folder


def test_run_writes_predictions_and_summary(single):
    found = records(single)
    assert sorted(found) == [("tiny", index) for index in range(5)]
    record = found[("tiny", 0)]
    assert record["prompt"] == "The quick brown fox" and record["new_tokens"] == len(record["output_ids"]) <= 8
    assert {"output", "target_calls", "accepted_lengths", "times", "baseline"} <= set(record)
    summary = json.loads((single / "summary.json").read_text())
    assert summary["verifier"] == "gbv" and summary["num_drafts"] == 2 and summary["world_size"] == 1
    overall = summary["metrics"]["overall"]
    assert overall == {**summary["metrics"]["tiny"], **overall}  # one dataset: overall equals it
    assert overall["prompts"] == 5 and overall["new_tokens"] == sum(r["new_tokens"] for r in found.values())
    assert overall["block_efficiency"] == overall["new_tokens"] / overall["target_calls"]
    assert 1 < overall["block_efficiency"] < 4  # the drafter is right sometimes, not always
    assert len(overall["acceptance_by_position"]) == 3 and len(overall["accepted_length_histogram"]) == 4
    assert overall["speedup"] > 0 and overall["ar_tokens_per_s"] > 0
    # baseline=true: the speedup's cost-model limit, from bare passes over the trie size the run scored
    assert 1 <= overall["trie_positions"] <= 1 + 2 * 3
    assert overall["trie_positions"] == sum(r["target_positions"] for r in found.values()) / sum(
        len(r["accepted_lengths"]) for r in found.values())
    assert overall["speed_limit"] > 0
    assert overall["speed_limit_share"] == overall["speedup"] / overall["speed_limit"]
    assert summary["machine"].endswith(", float32") and "torch threads" in summary["machine"]
    assert (single / ".hydra" / "config.yaml").exists() and (single / "csv" / "metrics.csv").exists() is False


def test_a_run_ends_with_a_short_summary(tmp_path):
    """...and names the precision dtype auto chose and why, as do its header, summary.json and W&B's config."""
    done = run_py("limit=2", "logger=wandb", "model.dtype=auto", "drafter.dtype=auto", f"hydra.run.dir={tmp_path}",
                  env={"WANDB_DIR": str(tmp_path), "WANDB_MODE": "offline"})
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    chosen = summary["precision"]["model"]
    assert chosen == summary["precision"]["drafter"] and chosen["reason"].startswith("auto")
    assert (chosen["dtype"], chosen["linear_kernel"]) == (summary["model_config"]["dtype"],
                                                          summary["model_config"]["linear_kernel"])
    kernel = f" on {chosen['linear_kernel']}" if chosen["linear_kernel"] else ""
    assert f"model and drafter: {chosen['dtype']}{kernel} ({chosen['reason']})" in done.stdout
    header = done.stdout.split("Testing")[0]
    assert "precision" in header and "reason: " in header and chosen["reason"][:20] in header
    [wandb_run] = (tmp_path / "wandb").glob("offline-run-*/*.wandb")
    assert json.dumps(chosen["reason"]).encode() in wandb_run.read_bytes()  # the config W&B logged
    lines = done.stdout.strip().splitlines()
    assert lines[-3:-1] == [f"records: {tmp_path / 'predictions.jsonl'}", f"summary: {tmp_path / 'summary.json'}"]
    assert lines[-1].startswith(f"W&B run: {tmp_path / 'wandb'}/offline-run-")
    table = "\n".join(lines[-12:])
    assert "block" in table and "± " in table and "tokens/s" in table
    assert "Tip" not in done.stderr + done.stdout and "LeafSpec" not in done.stderr  # third-party noise
    assert "tip:" not in done.stdout  # no quantized drafter to suggest for a tiny model
    assert "test_metric" not in done.stdout.lower() and "DataLoader 0" not in done.stdout  # Lightning's raw table


def test_the_quantized_drafter_tip_is_for_real_models_only(monkeypatch):
    from spectr_gbv.experiment import callbacks

    monkeypatch.setattr(callbacks, "this_cpu", lambda: "AVX512-BF16")  # a class where an int8 drafter paid
    real = {"_target_": "spectr_gbv.decoding.gguf_packages.packaged", "device": "cpu", "quantize": None}
    assert callbacks.drafter_tip(real).startswith("tip: on CPUs of class AVX512-BF16, drafter.dtype=bfloat16")
    assert callbacks.drafter_tip({**real, "_target_": callbacks.TINY_LOADER}) is None


def test_ddp_on_cpu_equals_one_process(single, tmp_path):
    done = run_py(*GREEDY, "baseline=true", "trainer=ddp_cpu", "trainer.devices=2", f"hydra.run.dir={tmp_path}")
    assert done.returncode == 0, done.stderr[-3000:]
    one, two = records(single), records(tmp_path)
    assert one.keys() == two.keys()  # each prompt decoded exactly once, shards merged into one file
    for key in one:
        assert one[key]["output_ids"] == two[key]["output_ids"]
        assert one[key]["accepted_lengths"] == two[key]["accepted_lengths"]
    assert not list(tmp_path.glob("predictions.rank*.jsonl"))
    metrics = [json.loads((folder / "summary.json").read_text())["metrics"]["overall"] for folder in (single, tmp_path)]
    for key in ("prompts", "new_tokens", "target_calls", "block_efficiency", "block_efficiency_se",
                "accepted_length_histogram", "acceptance_by_position", "trie_positions"):
        assert metrics[0][key] == metrics[1][key], key
    assert metrics[1]["speed_limit"] > 0  # measured by rank 0, broadcast to rank 1
    assert json.loads((tmp_path / "summary.json").read_text())["world_size"] == 2


@pytest.mark.parametrize("temperature", [0, 1])
def test_outputs_depend_neither_on_the_batch_size_nor_the_processes(temperature, tmp_path):
    """In float64 a prompt's tokens (and its verifier's decisions) are the same at batch_size 1, 2 and 4, and over two
    DDP processes on gloo. Rows outlive a step: at batch_size 2 or 4 a prompt of the next step takes the row of one
    that finished; with baseline=true `ar` decodes alike and each record waits for both."""
    job = [f"temperature={temperature}", "draft_temperature=1", "num_drafts=3", "block_length=3", "limit=6",
           "model.dtype=float64", "drafter.dtype=float64"]
    ways = {"one at a time": ["batch_size=1"], "two at a time with a baseline": ["batch_size=2", "baseline=true"],
            "four together": ["batch_size=4"],
            "four together on two processes": ["batch_size=4", "trainer=ddp_cpu", "trainer.devices=2"]}
    outputs = {}
    for way, extra in ways.items():
        folder = tmp_path / way.replace(" ", "_")
        done = run_py(*job, *extra, f"hydra.run.dir={folder}")
        assert done.returncode == 0, done.stderr[-3000:]
        found = records(folder)
        outputs[way] = {key: [record[field] for field in ("output_ids", "accepted_lengths", "draft_indices")]
                        for key, record in found.items()}
        assert all(("baseline" in record) == ("baseline=true" in extra) for record in found.values())
    assert len(outputs["one at a time"]) == 6
    for way in ways:
        assert outputs[way] == outputs["one at a time"], way


def test_multirun_with_wandb_offline(tmp_path):
    sweep = tmp_path / "my-sweep"
    done = run_py("-m", "limit=2", "verifier=gbv,token", "num_drafts=1", "block_length=2,4", "logger=wandb",
                  f"hydra.sweep.dir={sweep}", env={"WANDB_DIR": str(tmp_path), "WANDB_MODE": "offline"})
    assert done.returncode == 0, done.stderr[-3000:]
    jobs = sorted(path.parent for path in sweep.glob("*/summary.json"))
    assert [job.name for job in jobs] == ["0", "1", "2", "3"]
    seen = {(s["verifier"], s["block_length"]) for s in (json.loads((j / "summary.json").read_text()) for j in jobs)}
    assert seen == {("gbv", 2), ("gbv", 4), ("token", 2), ("token", 4)}
    for job in jobs:  # each job is its own offline W&B run, holding config, metrics, histogram and table
        [run] = (job / "wandb").glob("offline-run-*/run-*.wandb")
        data = run.read_bytes()
        for needle in (b"overall/block_efficiency", b"overall/accepted_length_histogram", b"num_drafts",
                       b"my-sweep"):  # the group: the sweep folder's name
            assert needle in data, needle
        assert list(run.parent.glob("files/media/table/predictions_*.table.json"))


def test_a_sweep_runs_through_the_submitit_launcher(tmp_path):
    """The cluster path: the same launcher plugin as SLURM (hydra/launcher=submitit_slurm), as local processes."""
    sweep = tmp_path / "sweep"
    done = run_py("-m", "hydra/launcher=submitit_local", "seed=0,1", "limit=2", f"hydra.sweep.dir={sweep}")
    assert done.returncode == 0, done.stderr[-3000:]
    summaries = [json.loads((sweep / job / "summary.json").read_text()) for job in ("0", "1")]
    assert [summary["seed"] for summary in summaries] == [0, 1]
    assert all(summary["metrics"]["overall"]["prompts"] == 2 for summary in summaries)


@pytest.mark.parametrize("batch_size", [1, 3])
def test_killed_job_keeps_its_records_and_resumes(batch_size, tmp_path):
    job = ["limit=6", "max_new_tokens=32", f"batch_size={batch_size}", f"hydra.run.dir={tmp_path}"]
    process = run_py(*job, background=True)
    predictions = tmp_path / "predictions.jsonl"
    signal_after_records(process, predictions, 2, signal.SIGKILL)
    process.wait()
    assert not (tmp_path / "summary.json").exists(), "the job finished before it could be killed"
    kept = predictions.read_text()
    assert 2 <= kept.count("\n") < 6

    done = run_py(*job)
    assert done.returncode == 0, done.stderr[-3000:]
    assert predictions.read_text().startswith(kept)  # nothing recorded is lost or decoded again
    assert sorted(records(tmp_path)) == [("tiny", index) for index in range(6)]
    assert json.loads((tmp_path / "summary.json").read_text())["metrics"]["overall"]["prompts"] == 6


@pytest.mark.parametrize("elsewhere", ["another CPU", None])  # None: a record from before records named machines
def test_a_job_resumed_on_another_machine_says_its_times_are_mixed(elsewhere, tmp_path):
    assert run_py("limit=1", f"hydra.run.dir={tmp_path}").returncode == 0
    predictions = tmp_path / "predictions.jsonl"
    record = json.loads(predictions.read_text())
    here = record.pop("machine")
    assert here == json.loads((tmp_path / "summary.json").read_text())["machine"]
    if elsewhere is not None:
        record["machine"] = elsewhere  # as if decoded elsewhere
    predictions.write_text(json.dumps(record) + "\n")
    done = run_py("limit=2", f"hydra.run.dir={tmp_path}")
    assert done.returncode == 0, done.stderr[-3000:]
    machines = json.loads((tmp_path / "summary.json").read_text())["machine"]
    assert machines.startswith("mixed: ")
    assert set(machines.removeprefix("mixed: ").split(" | ")) == {here, elsewhere or "machine not recorded"}


@pytest.mark.parametrize("signum, sweep", [(signal.SIGTERM, False), (signal.SIGINT, False), (signal.SIGTERM, True)])
def test_a_signal_stops_a_run_promptly_keeping_its_records(signum, sweep, tmp_path):
    """SIGTERM (a cluster's preemption) and SIGINT (Ctrl-C) end a run or a sweep within 10 s with a non-zero
    status; every record written is kept, and the same command resumes."""
    folder = tmp_path / ("sweep/0" if sweep else "job")
    where = [f"hydra.sweep.dir={tmp_path / 'sweep'}", "-m", "seed=0,1"] if sweep else [f"hydra.run.dir={folder}"]
    job = ["limit=6", "max_new_tokens=128", "batch_size=2", *where]
    process = run_py(*job, background=True, stderr=tmp_path / "stderr.txt")
    predictions = folder / "predictions.jsonl"
    signal_after_records(process, predictions, 1, signum)
    sent = time.monotonic()
    process.wait(timeout=30)
    assert time.monotonic() - sent < 10 and process.returncode != 0
    assert not (folder / "summary.json").exists(), "the job finished before the signal"
    kept = predictions.read_text()
    assert 1 <= kept.count("\n") < 6 and "Traceback" not in (tmp_path / "stderr.txt").read_text()
    if signum == signal.SIGTERM:
        assert (tmp_path / "stderr.txt").read_text().strip().splitlines()[-1].startswith("error: stopped by SIGTERM")
    done = run_py(*job)
    assert done.returncode == 0, done.stderr[-3000:]
    assert predictions.read_text().startswith(kept) and len(records(folder)) == 6


def test_a_folder_with_another_jobs_records_is_refused_and_kept(tmp_path):
    assert run_py("verifier=gbv", "limit=1", f"hydra.run.dir={tmp_path}").returncode == 0
    kept = (tmp_path / "predictions.jsonl").read_text()
    done = run_py("verifier=spectr", "limit=2", f"hydra.run.dir={tmp_path}")
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1] == (f"error: output_dir={tmp_path}: holds records of another job "
                                                     "(verifier=gbv there, spectr now); give this job a new folder")
    assert (tmp_path / "predictions.jsonl").read_text() == kept
    assert run_py("verifier=gbv", "limit=2", f"hydra.run.dir={tmp_path}").returncode == 0  # more prompts: resumed
    assert sorted(records(tmp_path)) == [("tiny", 0), ("tiny", 1)]


@pytest.mark.parametrize("override, line", [
    ("num_drafts=0", "error: num_drafts=0: must be >= 1"),
    ("num_drafts=many", "error: num_drafts=many: Value 'many' of type 'str' could not be converted to Integer"),
    ("verifier=nope", "error: verifier=nope: choose one of ar, bv, custom, gbv, multipath, nss, specinfer, spectr, "
                      "spectr_gbv, spectr_gbv_paper, token"),
    ("model.path=/no/such/dir", "error: model.path=/no/such/dir: no such file or directory"),
    ("dataset.tiny.texts=[ok,' ']", "error: dataset=tiny: prompt 1 is empty"),
])
def test_bad_input_is_one_line(override, line, tmp_path):
    extra = ["model=hf"] if override.startswith("model.path") else []
    done = run_py(*extra, override, f"hydra.run.dir={tmp_path}")
    assert done.returncode != 0
    assert done.stderr.strip().splitlines()[-1].startswith(line)
    assert "Traceback" not in done.stderr
    if not override.startswith("dataset"):  # the rest fail before Lightning starts: nothing else is printed
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr


# A researcher's verifiers, in a module outside the package (docs/custom_verifiers.md)
WITH_EXAMPLES = {"PYTHONPATH": os.pathsep.join([str(ROOT / "examples"), os.environ.get("PYTHONPATH", "")])}
CUSTOM = ["my_verifiers:SpeculativeSampling", "my_verifiers:BiasedSpeculativeSampling"]


def test_custom_verifiers_run_in_a_sweep_under_their_spec(tmp_path):
    done = run_py("-m", "verifier=custom", f"verifier.target={','.join(CUSTOM)}", "num_drafts=1", "block_length=2",
                  f"hydra.sweep.dir={tmp_path}", env=WITH_EXAMPLES)
    assert done.returncode == 0, done.stderr[-3000:]
    summaries = [json.loads((tmp_path / job / "summary.json").read_text()) for job in ("0", "1")]
    assert [summary["verifier"] for summary in summaries] == CUSTOM
    for job, summary in zip(("0", "1"), summaries):
        assert sorted(records(tmp_path / job)) == [("tiny", 0), ("tiny", 1)]
        assert summary["metrics"]["overall"]["block_efficiency"] >= 1


@pytest.mark.parametrize("target, line", [
    (None, "error: verifier.target=None: required with verifier=custom: module.path:ClassName"),
    ("no_such_module:Rule", "error: verifier.target=no_such_module:Rule: module no_such_module does not import"),
])
def test_a_custom_verifier_without_a_loadable_target_is_one_line(target, line, tmp_path):
    done = run_py("verifier=custom", *([f"verifier.target={target}"] if target else []), f"hydra.run.dir={tmp_path}")
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and done.stderr.startswith(line), done.stderr


@pytest.mark.parametrize("overrides, env, line", [
    pytest.param(["trainer=gpu"], {}, "error: trainer.accelerator=cuda: no CUDA device here (or torch is a CPU "
                 "build); use trainer=cpu or trainer=ddp_cpu",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")),
    (["block_length=100000"], {}, "error: block_length=100000: must be <= max_new_tokens (8)"),
    # HF_HUB_OFFLINE makes the hub refuse at once; without network it refuses after its retries (about 30 s)
    (["model=hf", "model.path=someorg/somemodel"], {"HF_HUB_OFFLINE": "1"},
     "error: model.path=someorg/somemodel: not a local folder or .gguf file, and the hub could not give it"),
    (["model=hf", "model.path=gpt2"], {"HF_HUB_OFFLINE": "1"},  # a hub id without an owner: the loader's word too
     "error: model.path=gpt2: not a local folder or .gguf file, and the hub could not give it"),
    (["logger=wandb", "logger.mode=online"], {},
     "error: logger.mode=online: W&B cannot start online (No API key configured."),
])
def test_environment_mistakes_are_one_line(overrides, env, line, tmp_path):
    env = {**env, "HOME": str(tmp_path), "WANDB_DIR": str(tmp_path)}  # no ~/.netrc: no W&B login
    done = run_py(*overrides, f"hydra.run.dir={tmp_path / 'job'}", env=env)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith(line), done.stderr[-2000:]
    assert not (tmp_path / "job" / "predictions.jsonl").exists()


@pytest.mark.slow
def test_default_real_pair_at_temperature_zero_equals_ar(tmp_path):
    """The default Qwen pair (`make models`) through the chat template; greedy gbv emits exactly ar's tokens."""
    outputs = {}
    for verifier in ("gbv", "ar"):
        folder = tmp_path / verifier
        done = subprocess.run(
            [sys.executable, "run.py", f"verifier={verifier}", "temperature=0", "draft_temperature=1", "limit=2",
             "max_new_tokens=16", "model.dtype=float32", "drafter.dtype=float32", "logger=none",
             f"hydra.run.dir={folder}"], cwd=ROOT, capture_output=True, text=True, timeout=1800)
        assert done.returncode == 0, done.stderr[-3000:]
        outputs[verifier] = {key: record["output_ids"] for key, record in records(folder).items()}
    assert outputs["gbv"] == outputs["ar"]
    summary = json.loads((tmp_path / "gbv" / "summary.json").read_text())
    assert summary["model"] == DEFAULT_PAIR[0] and summary["metrics"]["overall"]["block_efficiency"] > 1


def test_local_ddp_inside_a_sweep_is_refused(tmp_path):
    done = run_py("-m", "seed=1,2", "trainer=ddp_cpu", f"hydra.sweep.dir={tmp_path}")
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("error: trainer.devices=2: must be 1 inside a -m sweep")


def test_torn_last_line_is_decoded_again_and_shards_merge(tmp_path):
    """A kill in the middle of a write (possible on some filesystems) loses only that prompt; rank files merge."""
    from spectr_gbv.experiment.records import merge_rank_files, open_for_append, read_records, records_in

    main, shard = tmp_path / "predictions.jsonl", tmp_path / "predictions.rank1.jsonl"
    main.write_text('{"dataset": "d", "prompt_id": 0}\n{"dataset": "d", "prom')
    shard.write_text('{"dataset": "d", "prompt_id": 1}\n{"dataset": "d", "prompt_id": 0}\n')
    descriptor = open_for_append(main)
    os.write(descriptor, b'{"dataset": "d", "prompt_id": 2}\n')
    os.close(descriptor)
    assert sorted(read_records(tmp_path)) == [("d", 0), ("d", 1), ("d", 2)]
    merge_rank_files(tmp_path)
    assert not shard.exists() and list(records_in(main)) == [("d", 0), ("d", 2), ("d", 1)]


def test_a_setting_added_since_resumes_at_null_and_refuses_otherwise(tmp_path):
    from spectr_gbv.errors import ConfigError
    from spectr_gbv.experiment.records import claim_folder

    before = {"verifier": "gbv", "drafter_config": {"name": "d", "dtype": "bfloat16"}}
    claim_folder(tmp_path, before)  # a folder written before drafter.quantize existed
    claim_folder(tmp_path, {**before, "drafter_config": {"name": "d", "dtype": "bfloat16", "quantize": None}})
    with pytest.raises(ConfigError, match="holds records of another job"):
        claim_folder(tmp_path, {**before, "drafter_config": {"name": "d", "dtype": "bfloat16", "quantize": "int8"}})

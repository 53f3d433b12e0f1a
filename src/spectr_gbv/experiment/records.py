"""The job's files in its output folder: crash-safe, resumable, one writer per file. Torch-free, so the report reads
records without importing the models.

  job.json                  the job's knobs, written before the first prompt (claim_folder)
  predictions.jsonl         one JSON record per prompt, appended and flushed as soon as it is decoded. Under DDP
                            rank r > 0 appends to predictions.rank<r>.jsonl instead (no two processes share a file);
                            at the end rank 0 moves those records into predictions.jsonl and deletes the shards.
  summary.json              the knobs and the aggregates, written by rank 0 when every prompt is done.
On start every rank reads all predictions*.jsonl files; a prompt already recorded is counted, not decoded again.
"""
import json
import os
from pathlib import Path

from spectr_gbv.errors import ConfigError

GROWABLE = ("limit", "datasets")  # knobs a resumed job may change: records are per (dataset, prompt)


def claim_folder(folder: Path, knobs: dict) -> None:
    """Refuse a folder whose records came from another job, then mark it as this job's. Resuming counts recorded
    prompts as decoded, so records of another verifier or temperature would silently enter this job's numbers; a
    rerun may only ask for more prompts or datasets."""
    for name in ("job.json", "summary.json"):  # summary.json: folders written before job.json existed
        path = folder / name
        earlier = json.loads(path.read_text()) if path.exists() else {}
        for key, value in knobs.items():
            if key not in GROWABLE and key in earlier and not same_setting(earlier[key], value):
                raise ConfigError("output_dir", str(folder), f"holds records of another job ({key}={earlier[key]} "
                                  f"there, {value} now); give this job a new folder")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "job.json").write_text(json.dumps(knobs, indent=2) + "\n")


def same_setting(earlier, now) -> bool:
    """Equal, where a key that only one side has counts as equal when it is null there: a setting added to the
    project later (e.g. a model's `quantize`) defaults to null, the behaviour before it existed, so folders written
    before it still resume."""
    if isinstance(earlier, dict) and isinstance(now, dict):
        return all(same_setting(earlier.get(key), now.get(key)) for key in earlier.keys() | now.keys())
    return earlier == now


def predictions_file(folder: Path, rank: int) -> Path:
    return folder / ("predictions.jsonl" if rank == 0 else f"predictions.rank{rank}.jsonl")


def open_for_append(path: Path) -> int:
    """An O_APPEND descriptor; a torn last line (a kill during a write on an odd filesystem) is ended first so
    the next record starts on its own line."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    if path.stat().st_size and not path.read_bytes().endswith(b"\n"):
        os.write(fd, b"\n")
    return fd


def append_record(fd: int, record: dict) -> None:
    os.write(fd, (json.dumps(record) + "\n").encode())  # one write: a kill cannot split a record


def read_records(folder: Path) -> dict[tuple[str, int], dict]:
    """Every complete record in the folder's predictions*.jsonl, keyed by (dataset, prompt_id)."""
    records = {}
    for path in sorted(folder.glob("predictions*.jsonl")):
        records.update(records_in(path))
    return records


def records_in(path: Path) -> dict[tuple[str, int], dict]:
    records = {}
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a torn line: that prompt is decoded again
            continue
        records[(record["dataset"], record["prompt_id"])] = record
    return records


def merge_rank_files(folder: Path) -> None:
    """Append the other ranks' records to predictions.jsonl (skipping any already there), then drop their files."""
    main = folder / "predictions.jsonl"
    present = set(records_in(main))
    with main.open("a") as out:
        for shard in sorted(folder.glob("predictions.rank*.jsonl")):
            for key, record in records_in(shard).items():
                if key not in present:
                    out.write(json.dumps(record) + "\n")
            out.flush()
            os.fsync(out.fileno())
            shard.unlink()


def write_summary(folder: Path, summary: dict) -> None:
    (folder / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")

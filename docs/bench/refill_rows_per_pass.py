"""Rows per target pass of a job's decode at slots B, in chunks of B prompts (rows leave as they finish; the engine
before continuous batching) and refilled (a waiting prompt takes a finished row's place), computed from its records.

A prompt's iterations do not depend on its batch (docs/algorithms.md §11, item 9), so a job's records fix both
schedules exactly: in chunks, a chunk runs as many passes as its longest prompt; refilled, prompts join in the data
loader's order as rows free up. Machine-independent; the wall time a pass costs is bench_engine's.

    PYTHONPATH=src python docs/bench/refill_rows_per_pass.py docs/study/main/k3/4 [more job folders] [--slots 2 4 8]
"""
import argparse
import heapq
import json
from pathlib import Path

from spectr_gbv.experiment.records import read_records


def iterations_in_order(job: Path) -> list[int]:
    """Target passes per prompt (its iterations), in the data loader's order: datasets as configured, then prompt."""
    datasets = list(json.loads((job / "summary.json").read_text())["datasets"])
    records = read_records(job).values()
    ordered = sorted(records, key=lambda r: (datasets.index(r["dataset"]), r["prompt_id"]))
    return [record["target_calls"] for record in ordered]


def passes_in_chunks(iterations: list[int], slots: int) -> int:
    return sum(max(iterations[i:i + slots]) for i in range(0, len(iterations), slots))


def passes_refilled(iterations: list[int], slots: int) -> int:
    free_at = [0] * min(slots, len(iterations))  # the pass after which each row is free
    for count in iterations:
        heapq.heappush(free_at, heapq.heappop(free_at) + count)
    return max(free_at)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("jobs", nargs="+", type=Path, help="job folders (predictions.jsonl and summary.json)")
    parser.add_argument("--slots", type=int, nargs="+", default=[2, 4, 8])
    args = parser.parse_args()
    print("| job | prompts | B | chunks: passes | rows/pass | refill: passes | rows/pass | passes saved |")
    print("|---|---|---|---|---|---|---|---|")
    for job in args.jobs:
        iterations = iterations_in_order(job)
        for slots in args.slots:
            chunks, refilled = passes_in_chunks(iterations, slots), passes_refilled(iterations, slots)
            print(f"| {job} | {len(iterations)} | {slots} | {chunks} | {sum(iterations) / chunks:.2f} | {refilled} | "
                  f"{sum(iterations) / refilled:.2f} | {1 - refilled / chunks:.0%} |")


if __name__ == "__main__":
    main()

"""The evaluation as a LightningModule: its test loop decodes each prompt with the engine, appends the record to
predictions.jsonl at once, and at the end reduces the counters over ranks into summary.json and the loggers.

Files in the job's output folder (crash-safe, resumable):
  predictions.jsonl         one JSON record per prompt, appended and flushed as soon as it is decoded. Under DDP
                            rank r > 0 appends to predictions.rank<r>.jsonl instead (no two processes share a file);
                            at the end rank 0 moves those records into predictions.jsonl and deletes the shards.
  summary.json              the knobs and the aggregates, written by rank 0 when every prompt is done.
  job.json                  the knobs, written before the first prompt (see claim_folder).
On start every rank reads all predictions*.jsonl files; a prompt already recorded is counted, not decoded again.
"""
import json
import math
import os
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.utilities.exceptions import SIGTERMException

from spectr_gbv.errors import ConfigError
from spectr_gbv.decoding.engine import DecodeRecord, SpeculativeEngine, Stopped
from spectr_gbv.decoding.models import LoadedModel
from spectr_gbv.decoding.sampling import Sampling

# Per-dataset sums; every aggregate is a function of sums, so a sum over ranks gives the one-process result.
COUNTERS = ("prompts", "new_tokens", "target_calls", "new_tokens_sq", "target_calls_sq", "new_x_calls",
            "draft_time", "target_time", "verify_time", "total_time", "ar_new_tokens", "ar_time")
TIMES = ("draft_time", "target_time", "verify_time", "total_time")
GROWABLE = ("limit", "datasets")  # knobs a resumed job may change: records are per (dataset, prompt)


class SpeculativeEvaluation(LightningModule):
    def __init__(self, load_target: Callable[[], LoadedModel], load_drafter: Callable[[], LoadedModel],
                 verifier: str, num_drafts: int, block_length: int, sampling: Sampling, max_new_tokens: int,
                 seed: int, baseline: bool, output_dir: str, knobs: dict):
        super().__init__()
        self.load_target, self.load_drafter = load_target, load_drafter
        self.verifier, self.num_drafts, self.block_length = verifier, num_drafts, block_length
        self.sampling, self.max_new_tokens, self.seed, self.baseline = sampling, max_new_tokens, seed, baseline
        self.output_dir = Path(output_dir)
        self.knobs = knobs  # written verbatim into summary.json
        self.summary: dict = {}

    # ---- setup: models, engines, what earlier attempts already recorded -------------------------------------
    def setup(self, stage: str) -> None:
        if self.trainer.strategy.root_device.type == "cpu" and self.trainer.num_devices > 1:
            # N processes on one machine: split the cores as torchrun does, or their thread pools thrash
            torch.set_num_threads(max(1, os.cpu_count() // self.trainer.num_devices))
        self.target = self.load_target()
        drafter = None
        if self.verifier != "ar":  # plain decoding needs no drafter: do not load one
            drafter = self.load_drafter()  # the engine refuses one with another tokenizer
        self.drafter_name = drafter.name if drafter else None
        self.engine = SpeculativeEngine(self.target, drafter, self.verifier, self.num_drafts, self.block_length,
                                        self.sampling)
        self.ar_engine = SpeculativeEngine(self.target, None, "ar", sampling=self.sampling) if self.baseline else None
        self.recorded = read_records(self.output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        name = "predictions.jsonl" if self.global_rank == 0 else f"predictions.rank{self.global_rank}.jsonl"
        self.predictions = open_for_append(self.output_dir / name)

    def on_test_epoch_start(self) -> None:
        self.names = self.trainer.datamodule.names
        self.counts = torch.zeros(len(self.names), len(COUNTERS), dtype=torch.float64, device=self.device)
        self.histogram = torch.zeros(len(self.names), self.block_length + 1, dtype=torch.float64, device=self.device)

    # ---- the loop: decode the batch's prompts not recorded yet together, record each as it ends, count all -----
    def test_step(self, batch: list[dict], batch_idx: int) -> None:
        todo = [prompt for prompt in batch if (prompt["dataset"], prompt["prompt_id"]) not in self.recorded]
        if todo:
            try:
                self.decode(todo)
            except Stopped as stopped:  # every finished prompt is recorded; the rest are decoded again on resume
                raise SIGTERMException() from stopped
        for prompt in batch:
            self.count(self.recorded[(prompt["dataset"], prompt["prompt_id"])])

    def decode(self, prompts: list[dict]) -> None:
        """Decode the prompts as one batch; each record is appended to the predictions file as its prompt ends."""
        prompt_ids = [self.prompt_ids(prompt["prompt"]) for prompt in prompts]
        baseline = None
        if self.ar_engine is not None:  # same prompts, same seeds, same batch: the speedup compares like with like
            baseline = self.ar_engine.generate_batch(prompt_ids, self.max_new_tokens, self.generators(prompts),
                                                     should_stop=self.stop_requested)

        def write(index: int, out: DecodeRecord) -> None:
            prompt = prompts[index]
            record = {**prompt, "output": self.target.tokenizer.decode(out.output_ids, skip_special_tokens=True),
                      **decode_record_fields(out)}
            if baseline is not None:
                record["baseline"] = {"new_tokens": baseline[index].new_tokens,
                                      "total_time": baseline[index].total_time}
            os.write(self.predictions, (json.dumps(record) + "\n").encode())  # one write: a kill cannot split it
            self.recorded[(prompt["dataset"], prompt["prompt_id"])] = record

        self.engine.generate_batch(prompt_ids, self.max_new_tokens, self.generators(prompts), on_finish=write,
                                   should_stop=self.stop_requested)

    def stop_requested(self) -> bool:
        """Lightning's SIGTERM handler only flags the trainer and its loop checks between batches, which can take
        minutes: the engine checks the flag between iterations instead."""
        return self.trainer.received_sigterm

    def prompt_ids(self, prompt: str) -> list[int]:
        """Token ids of the prompt, through the target's chat template when it has one (tiny models: plain)."""
        tokenizer = self.target.tokenizer
        if tokenizer.chat_template is None:
            return tokenizer.encode(prompt, add_special_tokens=False)
        return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False)

    def generators(self, prompts: list[dict]) -> list[torch.Generator]:
        """One generator per prompt, seeded by (seed, dataset, prompt id): outputs depend neither on how prompts
        are sharded over ranks nor on which prompts share a batch."""
        keys = [f"{self.seed}/{prompt['dataset']}/{prompt['prompt_id']}".encode() for prompt in prompts]
        return [torch.Generator(device=self.target.model.device).manual_seed(zlib.crc32(key)) for key in keys]

    def count(self, record: dict) -> None:
        row = self.names.index(record["dataset"])
        new, calls = record["new_tokens"], record["target_calls"]
        baseline = record.get("baseline", {"new_tokens": 0, "total_time": 0.0})
        values = {"prompts": 1, "new_tokens": new, "target_calls": calls, "new_tokens_sq": new * new,
                  "target_calls_sq": calls * calls, "new_x_calls": new * calls,
                  **{key: record["times"][key] for key in TIMES},
                  "ar_new_tokens": baseline["new_tokens"], "ar_time": baseline["total_time"]}
        self.counts[row] += torch.tensor([values[key] for key in COUNTERS], dtype=torch.float64, device=self.device)
        for accepted in record["accepted_lengths"]:
            self.histogram[row, accepted] += 1

    # ---- the end: reduce over ranks, summarise, write, log --------------------------------------------------
    def on_test_epoch_end(self) -> None:
        # Ranks may have decoded different numbers of prompts; these all-reduces are the only collectives.
        counts = self.trainer.strategy.reduce(self.counts, reduce_op="sum").cpu()
        histogram = self.trainer.strategy.reduce(self.histogram, reduce_op="sum").cpu()
        metrics = {name: aggregate(counts[i], histogram[i]) for i, name in enumerate(self.names)}
        metrics["overall"] = aggregate(counts.sum(0), histogram.sum(0))
        self.summary = {**self.knobs, "model": self.target.name, "drafter": self.drafter_name,
                        "world_size": self.trainer.world_size, "metrics": metrics}
        # Already reduced, so every rank logs the same values; sync_dist (a mean of equal values) is Lightning's
        # documented way to log epoch-level values under DDP.
        self.log_dict(scalars(metrics), sync_dist=True)
        if self.trainer.is_global_zero:
            merge_rank_files(self.output_dir)
            (self.output_dir / "summary.json").write_text(json.dumps(self.summary, indent=2) + "\n")
            for logger in self.loggers:
                if isinstance(logger, WandbLogger):
                    log_to_wandb(logger, metrics["overall"], self.output_dir)

    def teardown(self, stage: str) -> None:
        if hasattr(self, "predictions"):
            os.close(self.predictions)


def claim_folder(folder: Path, knobs: dict) -> None:
    """Refuse a folder whose records came from another job, then mark it as this job's. Resuming counts recorded
    prompts as decoded, so records of another verifier or temperature would silently enter this job's numbers; a
    rerun may only ask for more prompts or datasets."""
    for name in ("job.json", "summary.json"):  # summary.json: folders written before job.json existed
        path = folder / name
        earlier = json.loads(path.read_text()) if path.exists() else {}
        for key, value in knobs.items():
            if key not in GROWABLE and key in earlier and earlier[key] != value:
                raise ConfigError("output_dir", str(folder), f"holds records of another job ({key}={earlier[key]} "
                                  f"there, {value} now); give this job a new folder")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "job.json").write_text(json.dumps(knobs, indent=2) + "\n")


def decode_record_fields(out: DecodeRecord) -> dict:
    return {"output_ids": out.output_ids, "new_tokens": out.new_tokens, "target_calls": out.target_calls,
            "accepted_lengths": out.accepted_lengths, "draft_indices": out.draft_indices,
            "target_positions": out.target_positions,
            "times": {key: getattr(out, key) for key in (*TIMES, "prefill_time")}}


def scalars(metrics: dict) -> dict[str, float]:
    """Flat scalar metrics for the loggers: `<dataset>/<name>`, acceptance by position as acceptance_at_<i>."""
    flat = {}
    for name, values in metrics.items():
        for key, value in values.items():
            if key == "acceptance_by_position":
                flat.update({f"{name}/acceptance_at_{i}": rate for i, rate in enumerate(value, start=1)})
            elif isinstance(value, (int, float)):
                flat[f"{name}/{key}"] = value
    return flat


def aggregate(counts: torch.Tensor, histogram: torch.Tensor) -> dict:
    """Aggregates of one dataset (or all) from its summed counters."""
    c = dict(zip(COUNTERS, counts.tolist()))
    n, new, calls = c["prompts"], c["new_tokens"], c["target_calls"]
    efficiency = new / calls if calls else float("nan")
    # Standard error of the ratio estimator new/calls over prompts (delta method), from sums only.
    squares = c["new_tokens_sq"] - 2 * efficiency * c["new_x_calls"] + efficiency**2 * c["target_calls_sq"]
    se = math.sqrt(max(squares, 0.0) / (n * (n - 1))) / (calls / n) if n > 1 else float("nan")
    iterations = histogram.sum().item()
    lengths = torch.arange(len(histogram), dtype=torch.float64)
    at_least = histogram.flip(0).cumsum(0).flip(0)  # at_least[i] = iterations accepting >= i tokens
    tokens_per_s = new / c["total_time"] if c["total_time"] else float("nan")
    result = {
        "prompts": int(n), "new_tokens": int(new), "target_calls": int(calls),
        "block_efficiency": efficiency, "block_efficiency_se": se,
        "mean_accepted_length": (histogram @ lengths).item() / iterations if iterations else float("nan"),
        "acceptance_by_position": (at_least[1:] / iterations).tolist() if iterations else [],
        "accepted_length_histogram": [int(x) for x in histogram.tolist()],
        "tokens_per_s": tokens_per_s,
        **{key: c[key] for key in TIMES},
    }
    if c["ar_time"]:
        result["ar_tokens_per_s"] = c["ar_new_tokens"] / c["ar_time"]
        result["speedup"] = tokens_per_s / result["ar_tokens_per_s"]
    return result


def open_for_append(path: Path) -> int:
    """An O_APPEND descriptor; a torn last line (a kill during a write on an odd filesystem) is ended first so
    the next record starts on its own line."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    if path.stat().st_size and not path.read_bytes().endswith(b"\n"):
        os.write(fd, b"\n")
    return fd


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


def log_to_wandb(logger: WandbLogger, overall: dict, folder: Path) -> None:
    """What scalars cannot show: the acceptance-length histogram and a table of the predictions."""
    import wandb

    counts = np.array(overall["accepted_length_histogram"])
    edges = np.arange(len(counts) + 1) - 0.5  # one bin per accepted length 0..L
    logger.experiment.log({"overall/accepted_length_histogram": wandb.Histogram(np_histogram=(counts, edges))})
    columns = ["dataset", "prompt_id", "prompt", "output", "new_tokens", "target_calls", "block_efficiency"]
    rows = [[r["dataset"], r["prompt_id"], r["prompt"], r["output"], r["new_tokens"], r["target_calls"],
             r["new_tokens"] / r["target_calls"]] for r in records_in(folder / "predictions.jsonl").values()]
    logger.log_table(key="predictions", columns=columns, data=rows)


def print_summary(summary: dict, folder: Path, wandb_dir: str | None) -> None:
    """What a person reads at the end of a run: per dataset, the block efficiency with its standard error, the mean
    accepted length, tokens/s and the speedup when measured; then where the files are."""
    from rich.console import Console
    from rich.table import Table

    title = (f"{summary['verifier']}, K={summary['num_drafts']}, L={summary['block_length']}, "
             f"T={summary['temperature']}, {summary['model']} <- {summary['drafter']}")
    table = Table(title=title, title_justify="left")
    for column in ("dataset", "prompts", "block efficiency", "mean accepted", "tokens/s", "speedup vs ar"):
        table.add_column(column, justify="left" if column == "dataset" else "right")
    metrics = summary["metrics"]
    for name, m in metrics.items():
        if name == "overall" and len(metrics) == 2:  # one dataset: its row is the overall one
            continue
        se = f" ± {m['block_efficiency_se']:.2f}" if m["prompts"] > 1 else ""
        speedup = f"{m['speedup']:.2f}x" if "speedup" in m else "-"
        table.add_row(name, str(m["prompts"]), f"{m['block_efficiency']:.2f}{se}",
                      f"{m['mean_accepted_length']:.2f}", f"{m['tokens_per_s']:.2f}", speedup)
    Console().print(table)
    print(f"records: {folder / 'predictions.jsonl'}\nsummary: {folder / 'summary.json'}")  # paths unwrapped
    if wandb_dir is not None:
        print(f"W&B run: {wandb_dir}")

"""What a run does besides decoding, as Lightning callbacks listed in conf/trainer/default.yaml: the CPU thread
split of multi-process runs, the end-of-run summary on the console, and the W&B extras (a histogram and a
predictions table) when a W&B logger is configured."""
import os
from pathlib import Path

import torch

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.utilities import rank_zero_only

from spectr_gbv.decoding.precision import CPU_CLASSES, this_cpu
from spectr_gbv.decoding.tiny import tiny
from spectr_gbv.experiment.records import records_in

TINY_LOADER = f"{tiny.__module__}.{tiny.__name__}"  # conf/model/tiny.yaml's _target_


class SplitCpuThreads(Callback):
    """N processes on one machine's CPU: each takes its share of the cores, as torchrun does, or their thread pools
    thrash. Before the models load (the module's setup runs after the callbacks')."""

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if trainer.strategy.root_device.type == "cpu" and trainer.num_devices > 1:
            torch.set_num_threads(max(1, os.cpu_count() // trainer.num_devices))


class RunSummary(Callback):
    """What a person reads at the end of a run: each model's precision and why, and a quantized drafter where one
    made speculation faster on this class of CPU; per dataset, the block efficiency with its standard error, the mean
    accepted length, tokens/s and the speedup when measured (with its cost-model limit), an arena job's comparison;
    then where the records, summary and W&B run are.
    Printed at teardown, after the progress bar (listed before it) has closed its live display."""

    @rank_zero_only
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        from rich.console import Console
        from rich.table import Table

        if not pl_module.summary:  # the run did not finish
            return
        summary, folder = pl_module.summary, Path(pl_module.hparams.output_dir)
        title = (f"{summary['verifier']}, K={summary['num_drafts']}, L={summary['block_length']}, "
                 f"T={summary['temperature']}, {summary['model']} <- {summary['drafter']}")
        table = Table(title=title, title_justify="left")
        for column in ("dataset", "prompts", "block efficiency", "mean accepted", "tokens/s", "speedup vs ar (limit)"):
            table.add_column(column, justify="left" if column == "dataset" else "right")
        metrics = summary["metrics"]
        for name, m in metrics.items():
            if name == "overall" and len(metrics) == 2:  # one dataset: its row is the overall one
                continue
            se = f" ± {m['block_efficiency_se']:.2f}" if m["prompts"] > 1 else ""
            speedup = f"{m['speedup']:.2f}x" if "speedup" in m else "-"
            if "speed_limit" in m:
                speedup += f" ({m['speed_limit']:.2f}x)"
            table.add_row(name, str(m["prompts"]), f"{m['block_efficiency']:.2f}{se}",
                          f"{m['mean_accepted_length']:.2f}", f"{m['tokens_per_s']:.2f}", speedup)
        for line in precision_lines(summary):
            print(line)
        if summary["drafter"] is not None and (tip := drafter_tip(pl_module.hparams.drafter_config)):
            print(tip)
        Console().print(table)
        if "arena" in summary:
            Console().print(arena_table(summary["arena"]))
        print(f"records: {folder / 'predictions.jsonl'}\nsummary: {folder / 'summary.json'}")  # paths unwrapped
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                print(f"W&B run: {Path(logger.experiment.dir).parent}")


def precision_lines(summary: dict) -> list[str]:
    """Each model's dtype, linear kernel and why, one line for both models where they agree."""
    sides: dict[str, list[str]] = {}
    for side, precision in (summary["precision"] or {}).items():
        if summary[side] is not None:  # no drafter under `ar`
            kernel = f" on {precision['linear_kernel']}" if precision["linear_kernel"] else ""
            sides.setdefault(f"{precision['dtype']}{kernel} ({precision['reason']})", []).append(side)
    return [f"{' and '.join(names)}: {text}" for text, names in sides.items()]


def drafter_tip(drafter: dict) -> str | None:
    """The quantized drafter that made speculation faster on this class of CPU (CPU_CLASSES), for a CPU drafter that
    is not quantized; opt-in, since it moves the drafter's laws and so the block efficiency."""
    cpu = this_cpu()
    paid = CPU_CLASSES[cpu]
    real = drafter["_target_"] != TINY_LOADER  # a tiny model has no quantized drafter worth a tip
    if not real or drafter["device"] != "cpu" or drafter.get("quantize") or paid.drafter_quantize is None:
        return None
    return (f"tip: on CPUs of class {cpu}, drafter.dtype={paid.dtype} drafter.quantize={paid.drafter_quantize} made "
            "speculation faster at batch_size=1 (docs/performance.md); it moves the drafter's laws, and so the block "
            "efficiency")


def arena_table(arena: dict):
    """The verifier arena over all its contexts (mode=arena), narrow enough for a terminal: E[tau] given the drafts
    per verifier@k (~: a mean of replicas; `fresh`: a stateful rule from a fresh state, without a verdict), the
    difference against the reference at the same k with its 95% interval over prompts (symmetric: mean +- half) and
    its verdict, alpha*, and the ms per context that scoring it took. summary.json and the report have the rest."""
    from rich.markup import escape
    from rich.table import Table

    overall = arena["datasets"]["overall"]
    decode = overall["decode"]
    scoring = decode.get("scoring_ms_per_context")
    cost = "" if scoring is None else (f"; scoring {scoring:.0f} ms per context, the decode "
                                       f"{decode['ms_per_iteration']:.0f} ms per iteration")
    table = Table(title=f"arena: {decode['prompts']} prompts, {decode['iterations']} contexts, against "
                        f"{arena['reference']}@k, equivalent within ±{arena['delta']}{cost}", title_justify="left")
    for column in ("verifier@k", "E[tau]", "vs ref@k [95%]", "verdict", "alpha*", "ms"):
        first = column == "verifier@k"  # whole names: a cut one can hide which rule a row is
        table.add_column(escape(column), justify="left" if first else "right", no_wrap=first)
    for name, row in overall["verifiers"].items():
        found = row["difference"]
        half = "n/a" if found is None or found["low"] is None else f"{(found['high'] - found['low']) / 2:.3f}"
        difference = "" if found is None else f"{found['mean']:+.3f} ±{half}"
        needed = "" if row["prompts_needed"] is None else f" ({row['prompts_needed']:,})"
        table.add_row(name + ("" if row["exact"] else " ~"), f"{row['expected_accepted']:.3f}", difference,
                      (row["verdict"] or "") + needed, f"{row['alpha_star']:.3f}", f"{row['ms_per_context']:.1f}")
    return table


class WandbExtras(Callback):
    """What scalars cannot show, for each W&B logger: the acceptance-length histogram and a predictions table."""

    @rank_zero_only
    def on_test_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                log_extras(logger, pl_module.summary["metrics"]["overall"], Path(pl_module.hparams.output_dir))


def log_extras(logger: WandbLogger, overall: dict, folder: Path) -> None:
    import numpy as np
    import wandb

    counts = np.array(overall["accepted_length_histogram"])
    edges = np.arange(len(counts) + 1) - 0.5  # one bin per accepted length 0..L
    logger.experiment.log({"overall/accepted_length_histogram": wandb.Histogram(np_histogram=(counts, edges))})
    columns = ["dataset", "prompt_id", "prompt", "output", "new_tokens", "target_calls", "block_efficiency"]
    rows = [[r["dataset"], r["prompt_id"], r["prompt"], r["output"], r["new_tokens"], r["target_calls"],
             r["new_tokens"] / r["target_calls"]] for r in records_in(folder / "predictions.jsonl").values()]
    logger.log_table(key="predictions", columns=columns, data=rows)

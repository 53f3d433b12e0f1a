"""The evaluation as a LightningModule: its test loop decodes each batch of prompts with the engine, appends each
prompt's record as it finishes (records.py), counts it, and at the end reduces the counts over ranks into the
aggregates (metrics.py), summary.json and the loggers.

Built from the `module` node of conf/config.yaml; its arguments are the job's settings, saved as hyperparameters, so
job.json and summary.json hold exactly what the module was given.
"""
import dataclasses
import os
import zlib
from pathlib import Path

import torch
from hydra.utils import instantiate
from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.utilities.exceptions import SIGTERMException

from spectr_gbv.decoding.costs import BareCosts
from spectr_gbv.decoding.engine import DecodeRecord, IterationHook, SpeculativeEngine, Stopped
from spectr_gbv.decoding.precision import machine
from spectr_gbv.decoding.sampling import Sampling
from spectr_gbv.experiment import records
from spectr_gbv.experiment.config import Knobs
from spectr_gbv.experiment.metrics import COUNTERS, RECORD_TIMES, aggregate, counters, scalars

COST_REPEATS = 5  # timed bare forwards per model and width for the speed limit (their median counts)
UNRECORDED_MACHINE = "machine not recorded"  # of records written before records named their machine


class SpeculativeEvaluation(LightningModule):
    def __init__(self, verifier: str, knobs: Knobs, model_config: dict, drafter_config: dict, output_dir: str,
                 precision: dict | None):
        """model_config, drafter_config: nodes that instantiate to a loader of a LoadedModel (conf/model/); precision:
        each model's dtype, linear kernel and why (config.settle_precision), for summary.json."""
        super().__init__()
        self.save_hyperparameters(logger=False)  # run.py logs the whole config instead
        self.knobs = knobs
        self.sampling = Sampling(temperature=knobs.temperature, top_k=knobs.top_k, top_p=knobs.top_p,
                                 draft_temperature=knobs.draft_temperature)
        self.output_dir = Path(output_dir)  # where, not what: not part of the job
        self.summary: dict = {}

    def job(self, datamodule: LightningDataModule) -> dict:
        """The settings that make this job's records what they are (job.json, the head of summary.json)."""
        hp = self.hparams
        return {"verifier": hp.verifier, **dataclasses.asdict(self.knobs), "model_config": hp.model_config,
                "drafter_config": hp.drafter_config, "datasets": datamodule.hparams.datasets}

    # ---- setup: models, engines, what earlier attempts already recorded -------------------------------------
    def setup(self, stage: str) -> None:
        hp, knobs = self.hparams, self.knobs
        self.target = instantiate(hp.model_config)()
        drafter = None
        if hp.verifier != "ar":  # plain decoding needs no drafter: do not load one
            drafter = instantiate(hp.drafter_config)()  # the engine refuses one with another tokenizer
        self.drafter = drafter
        self.engine = SpeculativeEngine(self.target, drafter, hp.verifier, knobs.num_drafts, knobs.block_length,
                                        self.sampling)
        self.ar_engine = SpeculativeEngine(self.target, None, "ar", sampling=self.sampling) if knobs.baseline else None
        self.machine = machine(str(self.target.model.dtype).removeprefix("torch."))  # where this run's times are
        self.recorded = records.read_records(self.output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.predictions = records.open_for_append(records.predictions_file(self.output_dir, self.global_rank))

    def on_test_epoch_start(self) -> None:
        self.names = self.trainer.datamodule.names
        self.counts = torch.zeros(len(self.names), len(COUNTERS), dtype=torch.float64, device=self.device)
        self.histogram = torch.zeros(len(self.names), self.knobs.block_length + 1, dtype=torch.float64,
                                     device=self.device)

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
        prompt_ids = [self.target.encode_prompt(prompt["prompt"]) for prompt in prompts]
        max_new_tokens = self.knobs.max_new_tokens
        baseline = None
        if self.ar_engine is not None:  # same prompts, same seeds, same batch: the speedup compares like with like
            baseline = self.ar_engine.generate_batch(prompt_ids, max_new_tokens, self.generators(prompts),
                                                     should_stop=self.stop_requested)

        def write(index: int, out: DecodeRecord) -> None:
            prompt = prompts[index]
            record = {**prompt, "output": self.target.tokenizer.decode(out.output_ids, skip_special_tokens=True),
                      **record_fields(out), "machine": self.machine, **self.extra_fields(prompt)}
            if baseline is not None:
                record["baseline"] = {"new_tokens": baseline[index].new_tokens,
                                      "total_time": baseline[index].total_time}
            records.append_record(self.predictions, record)
            self.recorded[(prompt["dataset"], prompt["prompt_id"])] = record

        self.engine.generate_batch(prompt_ids, max_new_tokens, self.generators(prompts), on_finish=write,
                                   should_stop=self.stop_requested, on_iteration=self.iteration_hook(prompts))

    def iteration_hook(self, prompts: list[dict]) -> IterationHook | None:
        """What watches each verification of these prompts (the verifier arena's, experiment/arena.py); none here."""
        return None

    def extra_fields(self, prompt: dict) -> dict:
        """What a finished prompt's record holds besides the decode's fields (the arena's contexts); none here."""
        return {}

    def stop_requested(self) -> bool:
        """Lightning's SIGTERM handler only flags the trainer and its loop checks between batches, which can take
        minutes: the engine checks the flag between iterations instead."""
        return self.trainer.received_sigterm

    def generators(self, prompts: list[dict]) -> list[torch.Generator]:
        """One generator per prompt, seeded by (seed, dataset, prompt id): outputs depend neither on how prompts
        are sharded over ranks nor on which prompts share a batch."""
        keys = [f"{self.knobs.seed}/{prompt['dataset']}/{prompt['prompt_id']}".encode() for prompt in prompts]
        return [torch.Generator(device=self.target.model.device).manual_seed(zlib.crc32(key)) for key in keys]

    def count(self, record: dict) -> None:
        row = self.names.index(record["dataset"])
        self.counts[row] += torch.tensor(counters(record), dtype=torch.float64, device=self.device)
        for accepted in record["accepted_lengths"]:
            self.histogram[row, accepted] += 1

    # ---- the end: reduce over ranks, summarise, write, log --------------------------------------------------
    def on_test_epoch_end(self) -> None:
        # Ranks may have decoded different numbers of prompts; these all-reduces are the only collectives.
        counts = self.trainer.strategy.reduce(self.counts, reduce_op="sum").cpu().tolist()
        histogram = self.trainer.strategy.reduce(self.histogram, reduce_op="sum").cpu().tolist()
        metrics = {name: aggregate(counts[i], histogram[i]) for i, name in enumerate(self.names)}
        metrics["overall"] = aggregate([sum(column) for column in zip(*counts)],
                                       [sum(column) for column in zip(*histogram)])
        if self.knobs.baseline and self.drafter is not None:
            self.add_speed_limits(metrics)
        self.summary = {**self.job(self.trainer.datamodule), "model": self.target.name,
                        "drafter": self.drafter.name if self.drafter else None,
                        "precision": self.hparams.precision,
                        "world_size": self.trainer.world_size,
                        "machine": self.machines(),
                        "metrics": metrics}
        # Already reduced, so every rank logs the same values; sync_dist (a mean of equal values) is Lightning's
        # documented way to log epoch-level values under DDP.
        self.log_dict(scalars(metrics), sync_dist=True)
        if self.trainer.is_global_zero:
            records.merge_rank_files(self.output_dir)
            records.write_summary(self.output_dir, self.summary)

    def machines(self) -> str:
        """Where the job's times were measured: this run's machine, or, when a rerun on another machine resumed the
        job, "mixed: " and each of them (its tokens/s and speedups then mix machines). Records written before records
        named their machine may come from any machine: they count as one of their own, UNRECORDED_MACHINE."""
        found = sorted({record.get("machine", UNRECORDED_MACHINE) for record in self.recorded.values()}
                       | {self.machine})
        return found[0] if len(found) == 1 else "mixed: " + " | ".join(found)

    def add_speed_limits(self, metrics: dict) -> None:
        """Each speedup beside its cost-model limit and their ratio, the share (decoding/costs.py): bare forward
        times measured by rank 0 after decoding, on the same machine and threads as the speedup, over a cache holding
        the job's first prompt. The speedup counts the prefill, the limit does not."""
        limits = None
        if self.trainer.is_global_zero:
            context = self.target.encode_prompt(self.trainer.datamodule.records[0]["prompt"])
            costs = BareCosts(self.target, self.drafter, context, COST_REPEATS)
            limits = {name: costs.limit(m["block_efficiency"], round(m["trie_positions"]), self.knobs.num_drafts,
                                        self.knobs.block_length) for name, m in metrics.items()}
        for name, limit in self.trainer.strategy.broadcast(limits, src=0).items():
            metrics[name].update(speed_limit=limit, speed_limit_share=metrics[name]["speedup"] / limit)

    def teardown(self, stage: str) -> None:
        if hasattr(self, "predictions"):
            os.close(self.predictions)


def record_fields(out: DecodeRecord) -> dict:
    return {"output_ids": out.output_ids, "new_tokens": out.new_tokens, "target_calls": out.target_calls,
            "accepted_lengths": out.accepted_lengths, "draft_indices": out.draft_indices,
            "target_positions": out.target_positions,
            "times": {key: getattr(out, key) for key in RECORD_TIMES}}

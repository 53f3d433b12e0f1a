"""The evaluation as a LightningModule: each test step queues its batch's prompts not recorded yet to the engine's
decoder and decodes until each of them holds a row; rows outlive a step (continuous batching: a prompt takes the row
of one that finished at the next iteration, so passes stay full). Each record is appended as its prompt finishes
(records.py) and counted; the end of the epoch decodes the rows left, then reduces the counts over ranks into the
aggregates (metrics.py), summary.json and the loggers.

Built from the `module` node of conf/config.yaml; its arguments are the job's settings, saved as hyperparameters, so
job.json and summary.json hold exactly what the module was given.
"""
import dataclasses
import os
import zlib
from functools import partial
from pathlib import Path

import torch
from hydra.utils import instantiate
from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.utilities.exceptions import SIGTERMException

from spectr_gbv.decoding.costs import BareCosts
from spectr_gbv.decoding.engine import DecodeRecord, IterationHook, SpeculativeEngine, Stopped
from spectr_gbv.decoding.precision import keep_freed_memory, machine
from spectr_gbv.decoding.sampling import Sampling
from spectr_gbv.experiment import records
from spectr_gbv.errors import ModelUnavailable
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
        keep_freed_memory()
        self.target = load("model", hp.model_config)
        drafter = None
        if hp.verifier != "ar":  # plain decoding needs no drafter: do not load one
            drafter = load("drafter", hp.drafter_config)  # the engine refuses one with another tokenizer
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
        # Continuous batching: the decoders' rows outlive a step, so a prompt takes the row of one that finished at
        # the next iteration instead of waiting for its whole batch to end. With baseline=true, `ar` decodes the same
        # prompts with the same seeds and the same slots, refilled alike, and a record is written once both parts are
        # done: the speedup then compares speculation with plain decoding under the same batching.
        self.decoding: dict[int, dict] = {}  # the prompts queued or decoding, by their index in the decoders
        self.parts: dict[int, dict[str, DecodeRecord]] = {}  # the parts finished so far of those prompts
        slots, max_new_tokens = self.knobs.batch_size, self.knobs.max_new_tokens
        self.decoders = {"decode": self.engine.decoder(slots, max_new_tokens, partial(self.finish, "decode"),
                                                       self.stop_requested, self.iteration_hook(self.decoding))}
        if self.ar_engine is not None:
            self.decoders["baseline"] = self.ar_engine.decoder(slots, max_new_tokens, partial(self.finish, "baseline"),
                                                               self.stop_requested)

    # ---- the loop: queue the batch's prompts not recorded yet, decode until each holds a row, record each as it ends
    def test_step(self, batch: list[dict], batch_idx: int) -> None:
        for prompt in batch:
            record = self.recorded.get((prompt["dataset"], prompt["prompt_id"]))
            if record is not None:
                self.count(record)
            else:
                self.queue(prompt)
        self.decode(until_admitted=True)  # rows of earlier steps decode beside the new ones, and go on next step

    def queue(self, prompt: dict) -> None:
        prompt_ids = self.target.encode_prompt(prompt["prompt"])
        for decoder in self.decoders.values():  # the same index in each: they are given the same prompts in order
            index = decoder.add(prompt_ids, self.generator(prompt))
        self.decoding[index] = prompt

    def decode(self, until_admitted: bool) -> None:
        try:
            for decoder in self.decoders.values():
                decoder.run(until_admitted)
        except Stopped as stopped:  # every finished prompt is recorded; the rest are decoded again on resume
            raise SIGTERMException() from stopped

    def finish(self, part: str, index: int, out: DecodeRecord) -> None:
        """A decoder's on_finish: prompt `index`'s part is done; once all its parts are, its record is written."""
        parts = self.parts.setdefault(index, {})
        parts[part] = out
        if len(parts) == len(self.decoders):
            del self.parts[index]
            self.write(self.decoding.pop(index), parts["decode"], parts.get("baseline"))

    def write(self, prompt: dict, out: DecodeRecord, baseline: DecodeRecord | None) -> None:
        """Append the prompt's record to the predictions file and count it."""
        record = {**prompt, "output": self.target.tokenizer.decode(out.output_ids, skip_special_tokens=True),
                  **record_fields(out), "machine": self.machine, **self.extra_fields(prompt)}
        if baseline is not None:
            record["baseline"] = {"new_tokens": baseline.new_tokens, "total_time": baseline.total_time}
        records.append_record(self.predictions, record)
        self.recorded[(prompt["dataset"], prompt["prompt_id"])] = record
        self.count(record)

    def iteration_hook(self, prompts: dict[int, dict]) -> IterationHook | None:
        """What watches each verification (the verifier arena's, experiment/arena.py); none here. prompts: those
        decoding, by the index the hook is given, filled as prompts join."""
        return None

    def extra_fields(self, prompt: dict) -> dict:
        """What a finished prompt's record holds besides the decode's fields (the arena's contexts); none here."""
        return {}

    def summary_sections(self) -> dict:
        """What summary.json holds besides the metrics, from the merged records (the arena's comparison); none
        here. Rank 0 only, before the one write of summary.json."""
        return {}

    def stop_requested(self) -> bool:
        """Lightning's SIGTERM handler only flags the trainer and its loop checks between batches, which can take
        minutes: the engine checks the flag between iterations instead."""
        return self.trainer.received_sigterm

    def generator(self, prompt: dict) -> torch.Generator:
        """The prompt's generator, seeded by (seed, dataset, prompt id): outputs depend neither on how prompts are
        sharded over ranks nor on which prompts share a pass."""
        key = f"{self.knobs.seed}/{prompt['dataset']}/{prompt['prompt_id']}".encode()
        return torch.Generator(device=self.target.model.device).manual_seed(zlib.crc32(key))

    def count(self, record: dict) -> None:
        row = self.names.index(record["dataset"])
        self.counts[row] += torch.tensor(counters(record), dtype=torch.float64, device=self.device)
        for accepted in record["accepted_lengths"]:
            self.histogram[row, accepted] += 1

    # ---- the end: reduce over ranks, summarise, write, log --------------------------------------------------
    def on_test_epoch_end(self) -> None:
        self.decode(until_admitted=False)  # the rows still decoding: every prompt is counted before the reduce
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
            self.summary.update(self.summary_sections())
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


def load(side: str, config: dict):
    """The model of conf's `side` (model, drafter); a model the hub cannot give names the key to change."""
    try:
        return instantiate(config)()
    except ModelUnavailable as error:
        raise ModelUnavailable(f"{side}.{error}") from error


def record_fields(out: DecodeRecord) -> dict:
    return {"output_ids": out.output_ids, "new_tokens": out.new_tokens, "target_calls": out.target_calls,
            "accepted_lengths": out.accepted_lengths, "draft_indices": out.draft_indices,
            "target_positions": out.target_positions,
            "times": {key: getattr(out, key) for key in RECORD_TIMES}}

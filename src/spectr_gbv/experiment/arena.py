"""The verifier arena (mode=arena): every verifier scored on identical drafts.

A reference verifier (the `verifier` knob) decodes each prompt losslessly, so the contexts it passes through follow
the target's law. At each of its iterations (a *context*) every verifier in `verifiers` gets the same drafts, the
drafter's laws q and the target's laws p over their trie, each from a fresh state (state=None); only the reference's
own stateful decision moves the text on, so the arena costs no model pass beyond the decode. The K drafts are i.i.d.,
so their first k are k i.i.d. drafts: each multi-draft verifier is scored at every k <= K on the first k, a
single-draft one on the first draft only.

Per context and verifier@k the record holds E[tau | drafts], exact where the verifier gives its accepted_law()
(spectr_gbv.verifiers.base), else the mean of `replicas` calls with generators seeded by (seed, dataset, prompt,
iteration, verifier@k) and its standard error; the first-token acceptance P(tau >= 1) beside the optimal-transport
bound alpha*(p, q, k) at the root; and the call's milliseconds. Contexts are appended to their prompt's record as it
finishes (records.py), so a killed job resumes like any other. Paired over contexts, differences between verifiers
carry neither the drafts' noise nor the texts' divergence that separate end-to-end runs have.
"""
import hashlib
import time
import zlib
from collections.abc import Mapping

import numpy as np
import torch
from lightning.pytorch.loggers import WandbLogger
from torch import Tensor

from spectr_gbv.decoding.engine import IterationHook
from spectr_gbv.experiment import records
from spectr_gbv.experiment.config import arena_verifiers, check_replicas
from spectr_gbv.experiment.metrics import paired_difference
from spectr_gbv.experiment.module import SpeculativeEvaluation
from spectr_gbv.verifiers import ALIASES, build_verifier, optimal_acceptance

TABLE = ("verifier", "contexts", "expected_accepted", "expected_accepted_se", "difference", "difference_low",
         "difference_high", "first_token_acceptance", "alpha_star", "ms_per_call")


def draft_digest(tokens: Tensor) -> str:
    """A short fingerprint of one context's drafts [K, L]: equal digests, equal drafts."""
    return hashlib.blake2b(tokens.cpu().numpy().astype(np.int64).tobytes(), digest_size=8).hexdigest()


def label(name: str, k: int) -> str:
    return f"{name}@{k}"


def num_drafts_of(verifier_at_k: str) -> int:
    return int(verifier_at_k.rpartition("@")[2])


class Arena:
    """Scores verifiers on the drafts of a reference decode; collects each prompt's contexts until it finishes."""

    def __init__(self, names: list[str], num_drafts: int, replicas: int, seed: int):
        self.verifiers = {name: build_verifier(name) for name in names}
        self.entries = [(label(name, k), verifier, k) for name, verifier in self.verifiers.items()
                        for k in range(1, (num_drafts if verifier.max_drafts is None else 1) + 1)]
        self.num_drafts, self.replicas, self.seed = num_drafts, replicas, seed
        self.contexts: dict[tuple[str, int], list[dict]] = {}

    def watch(self, prompts: Mapping[int, dict] | list[dict]) -> IterationHook:
        """The engine's on_iteration for prompt records by the engine's prompt indices (a list, or a dict its owner
        fills as prompts join the decode): scores each row's context, keeps it under its prompt."""
        def on_iteration(indices: list[int], tokens: Tensor, q: Tensor, p: Tensor, out) -> None:
            keys = [(prompts[i]["dataset"], prompts[i]["prompt_id"]) for i in indices]
            iterations = [len(self.contexts.setdefault(key, [])) for key in keys]
            seeds = [f"{self.seed}/{dataset}/{prompt_id}/{iteration}"
                     for (dataset, prompt_id), iteration in zip(keys, iterations)]
            for key, iteration, context in zip(keys, iterations, self.score(tokens, q, p, seeds)):
                self.contexts[key].append({"iteration": iteration, **context})
        return on_iteration

    def finished(self, prompt: dict) -> list[dict]:
        """A finished prompt's contexts, forgotten here (they go into its record)."""
        return self.contexts.pop((prompt["dataset"], prompt["prompt_id"]), [])

    def score(self, tokens: Tensor, q: Tensor, p: Tensor, seeds: list[str]) -> list[dict]:
        """One context per row of a verification's inputs (tokens [B, K, L], q, p as the verifiers take them);
        seeds [B] name the rows' replica generators."""
        B = tokens.shape[0]
        root_p, root_q = p[:, 0, 0], q[:, 0, 0]  # every draft starts at the root
        alpha = torch.stack([optimal_acceptance(root_p, root_q, k) for k in range(1, self.num_drafts + 1)], -1)
        contexts = [{"drafts": draft_digest(tokens[b]), "alpha_star": alpha[b].tolist(), "verifiers": {}}
                    for b in range(B)]
        for name, verifier, k in self.entries:
            generators = [torch.Generator(device=tokens.device).manual_seed(zlib.crc32(f"{seed}/{name}".encode()))
                          for seed in seeds]
            scores = self.score_one(verifier, tokens[:, :k], q[:, :k], p[:, :k], generators)
            for context, values in zip(contexts, scores):
                context["verifiers"][name] = values
        return contexts

    def score_one(self, verifier, tokens: Tensor, q: Tensor, p: Tensor, generators) -> list[dict]:
        """E[tau], its standard error (None: exact), P(tau >= 1) and the milliseconds per call (a row's share of
        the batch's call, as the engine charges time) of one verifier on the rows' first k drafts."""
        law = verifier.accepted_law(tokens, q, p)
        calls = 1 if law is not None else self.replicas  # an exact verifier is called once, to time it
        accepted, seconds = [], 0.0
        for _ in range(calls):
            started = time.perf_counter()
            accepted.append(verifier(tokens, q, p, generator=generators, state=None).num_accepted.tolist())
            seconds += time.perf_counter() - started  # tolist() waits for the device
        ms = 1000 * seconds / calls / tokens.shape[0]
        if law is not None:
            law = law.double()
            expected = (law * torch.arange(law.shape[-1], dtype=law.dtype, device=law.device)).sum(-1).tolist()
            first = (1 - law[:, 0]).tolist()
            return [{"expected_accepted": e, "se": None, "first_token_acceptance": f, "ms": ms}
                    for e, f in zip(expected, first)]
        taus = np.array(accepted, dtype=np.float64)  # [replicas, B]
        se = taus.std(0, ddof=1) / np.sqrt(calls) if calls > 1 else np.full(taus.shape[1], np.nan)
        return [{"expected_accepted": float(taus[:, b].mean()), "se": float(se[b]),
                 "first_token_acceptance": float((taus[:, b] >= 1).mean()), "ms": ms} for b in range(taus.shape[1])]


class ArenaEvaluation(SpeculativeEvaluation):
    """The evaluation's decode of the reference verifier, with the arena watching every iteration: each prompt's
    record gains `arena`, its contexts; summary.json gains `arena`, the comparison (summarise())."""

    def __init__(self, verifiers: list[str] | None, replicas: int, **evaluation):
        # Resolved before save_hyperparameters reads this frame: job.json names the verifiers actually scored, so a
        # folder is not resumed with another list (e.g. after a verifier was added to the registry).
        verifiers = arena_verifiers(verifiers, evaluation["verifier"])
        check_replicas(replicas)
        super().__init__(**evaluation)
        self.arena = Arena(verifiers, self.knobs.num_drafts, replicas, self.knobs.seed)

    def job(self, datamodule) -> dict:
        return {**super().job(datamodule), "verifiers": self.hparams.verifiers, "replicas": self.hparams.replicas}

    def setup(self, stage: str) -> None:
        super().setup(stage)
        # an evaluation's records of this folder have no contexts: those prompts are decoded again
        self.recorded = {key: record for key, record in self.recorded.items() if "arena" in record}

    def iteration_hook(self, prompts: dict[int, dict]) -> IterationHook:
        return self.arena.watch(prompts)

    def extra_fields(self, prompt: dict) -> dict:
        return {"arena": self.arena.finished(prompt)}

    def on_test_epoch_end(self) -> None:
        super().on_test_epoch_end()  # reduces, merges the ranks' records and writes summary.json
        if not self.trainer.is_global_zero:
            return
        wanted = {(prompt["dataset"], prompt["prompt_id"]) for prompt in self.trainer.datamodule.records}
        merged = records.records_in(self.output_dir / "predictions.jsonl")
        self.summary["arena"] = summarise({key: merged[key] for key in wanted}, self.hparams.verifier,
                                          list(self.arena.verifiers), self.names)
        records.write_summary(self.output_dir, self.summary)
        for logger in self.loggers:
            if isinstance(logger, WandbLogger):
                logger.log_table(key="arena", columns=["dataset", *TABLE], data=table_rows(self.summary["arena"]))


def summarise(recorded: dict[tuple[str, int], dict], reference: str, names: list[str], datasets: list[str]) -> dict:
    """Per dataset and overall, for each verifier@k: the mean over contexts of E[tau] with its standard error, the
    paired difference against the reference at the same k (95% bootstrap interval over contexts, keyed by
    (dataset, prompt_id, iteration)), the mean first-token acceptance beside the mean alpha*, the ms per call; and
    the reference decode's own cost. Contexts of one prompt are correlated: the standard errors treat them as
    independent, the bootstrap resamples contexts."""
    reference = ALIASES.get(reference, reference)
    contexts = {(dataset, prompt_id, context["iteration"]): context
                for (dataset, prompt_id), record in recorded.items() for context in record["arena"]}
    labels = list(dict.fromkeys(name for context in contexts.values() for name in context["verifiers"]))
    values = {name: {key: c["verifiers"][name] for key, c in contexts.items() if name in c["verifiers"]}
              for name in labels}
    expected = {name: {key: v["expected_accepted"] for key, v in found.items()} for name, found in values.items()}
    differences = {name: paired_difference(expected[name], expected[label(reference, num_drafts_of(name))])
                   for name in labels if name.partition("@")[0] != reference
                   and label(reference, num_drafts_of(name)) in expected}
    by_dataset = {}
    for dataset in [*datasets, "overall"]:
        inside = lambda key: dataset == "overall" or key[0] == dataset  # noqa: E731
        rows = {}
        for name in labels:
            found = [(key, v) for key, v in values[name].items() if inside(key)]
            if not found:
                continue
            e = np.array([v["expected_accepted"] for _, v in found])
            k = num_drafts_of(name)
            rows[name] = {"contexts": len(found), "exact": all(v["se"] is None for _, v in found),
                          "expected_accepted": float(e.mean()),
                          "expected_accepted_se": float(e.std(ddof=1) / np.sqrt(len(e))) if len(e) > 1 else None,
                          "difference": differences.get(name, {}).get(dataset),
                          "first_token_acceptance": float(np.mean([v["first_token_acceptance"] for _, v in found])),
                          "alpha_star": float(np.mean([contexts[key]["alpha_star"][k - 1] for key, _ in found])),
                          "ms_per_call": float(np.mean([v["ms"] for _, v in found]))}
        decoded = [record for key, record in recorded.items() if inside(key)]
        if rows:
            by_dataset[dataset] = {"decode": decode_cost(decoded), "verifiers": rows}
    return {"reference": reference, "verifiers": names, "datasets": by_dataset}


def decode_cost(decoded: list[dict]) -> dict:
    """The reference decode's own cost per iteration, beside which the verifiers' ms per call read: its time
    (drafting, the target's pass, its verifier and bookkeeping; the first iteration's prefill included) and its
    verifier's share (later iterations: the first one's is inside the prefill)."""
    iterations = sum(record["target_calls"] for record in decoded)
    later = iterations - len(decoded)
    total = sum(record["times"]["total_time"] for record in decoded)
    verify = sum(record["times"]["verify_time"] for record in decoded)
    return {"prompts": len(decoded), "iterations": iterations,
            "block_efficiency": sum(record["new_tokens"] for record in decoded) / iterations,
            "ms_per_iteration": 1000 * total / iterations,
            "verify_ms_per_iteration": 1000 * verify / later if later else None}


def table_rows(arena: dict) -> list[list]:
    """The summary's arena section as rows of TABLE, after the dataset (for W&B and the report)."""
    rows = []
    for dataset, found in arena["datasets"].items():
        for name, row in found["verifiers"].items():
            difference = row["difference"] or {}
            rows.append([dataset, name, row["contexts"], row["expected_accepted"], row["expected_accepted_se"],
                         difference.get("mean"), difference.get("low"), difference.get("high"),
                         row["first_token_acceptance"], row["alpha_star"], row["ms_per_call"]])
    return rows

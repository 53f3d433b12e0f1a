"""The verifier arena (mode=arena): every verifier scored on identical drafts.

A reference verifier (the `verifier` knob) decodes each prompt losslessly, so the contexts it passes through follow
the target's law. At each of its iterations (a *context*) every verifier in `verifiers` gets the same drafts, the
drafter's laws q and the target's laws p over their trie; only the reference's own decision moves the text on, so the
arena costs no model pass beyond the decode. The K drafts are i.i.d., so their first k are k i.i.d. drafts: each
multi-draft verifier is scored at every k <= K on the first k, a single-draft one on the first draft only.

State. A rule whose losslessness needs the state it carries into later iterations (`carries_state`: gbv's target
modification) is a different rule from a fresh state, so it is scored at k = K only: as `name@K` with the state
the reference decode carries when it is the reference (its real state), and as `name@K fresh` from a fresh state,
for information (the state's cost) and never for a verdict. Stateless rules have no state to carry.

Per context and verifier@k the record holds E[tau | drafts (, state)], exact where the verifier gives its
accepted_law() (spectr_gbv.verifiers.base), else the mean of `replicas` calls (replicate_accepted(), which shares
their work where the rule allows) with generators seeded by (seed, dataset, prompt, iteration, label) and its
standard error (the prompt-level bootstrap of summarise() resamples these means, so replica noise is inside every
interval); the first-token acceptance P(tau >= 1) beside the optimal-transport
bound alpha*(p, q, k) at the root; what scoring it cost; and, once per context, the reference's realised tau and the
whole scoring's cost. Contexts are appended to their prompt's record as it finishes (records.py), so a killed job
resumes like any other.
"""
import hashlib
import time
import zlib
from collections.abc import Mapping
from itertools import combinations

import numpy as np
import torch
from lightning.pytorch.loggers import WandbLogger
from torch import Tensor

from spectr_gbv.decoding.engine import IterationHook
from spectr_gbv.experiment import records
from spectr_gbv.experiment.config import arena_verifiers, check_arena_knobs
from spectr_gbv.experiment.metrics import paired_difference, verdict
from spectr_gbv.experiment.module import SpeculativeEvaluation
from spectr_gbv.verifiers import ALIASES, VERIFIERS, build_verifier, optimal_acceptance

TABLE = ("verifier", "state", "prompts", "contexts", "expected_accepted", "expected_accepted_se", "design_effect",
         "difference", "difference_low", "difference_high", "verdict", "prompts_needed", "first_token_acceptance",
         "alpha_star", "ms_per_context")
FRESH = " fresh"  # the label suffix of a stateful rule scored from a fresh state


def draft_digest(tokens: Tensor) -> str:
    """A short fingerprint of one context's drafts [K, L]: equal digests, equal drafts."""
    return hashlib.blake2b(tokens.cpu().numpy().astype(np.int64).tobytes(), digest_size=8).hexdigest()


def label(name: str, k: int, fresh: bool = False) -> str:
    return f"{name}@{k}{FRESH if fresh else ''}"


def num_drafts_of(verifier_at_k: str) -> int:
    return int(verifier_at_k.removesuffix(FRESH).rpartition("@")[2])


def is_fresh(verifier_at_k: str) -> bool:
    return verifier_at_k.endswith(FRESH)


class Arena:
    """Scores verifiers on the drafts of a reference decode; collects each prompt's contexts until it finishes."""

    def __init__(self, names: list[str], num_drafts: int, replicas: int, seed: int, reference: str | None = None):
        self.verifiers = {name: build_verifier(name) for name in names}
        reference = ALIASES.get(reference, reference)
        self.entries = []  # (label, verifier, k, scored with the carried state)
        for name, verifier in self.verifiers.items():
            if verifier.carries_state:
                if name == reference:
                    self.entries.append((label(name, num_drafts), verifier, num_drafts, True))
                self.entries.append((label(name, num_drafts, fresh=True), verifier, num_drafts, False))
                continue
            for k in range(1, (num_drafts if verifier.max_drafts is None else 1) + 1):
                self.entries.append((label(name, k), verifier, k, False))
        self.num_drafts, self.replicas, self.seed = num_drafts, replicas, seed
        self.contexts: dict[tuple[str, int], list[dict]] = {}

    def watch(self, prompts: Mapping[int, dict] | list[dict]) -> IterationHook:
        """The engine's on_iteration for prompt records by the engine's prompt indices (a list, or a dict its owner
        fills as prompts join the decode): scores each row's context, keeps it under its prompt."""
        def on_iteration(indices: list[int], tokens: Tensor, q: Tensor, p: Tensor, out, state) -> None:
            keys = [(prompts[i]["dataset"], prompts[i]["prompt_id"]) for i in indices]
            iterations = [len(self.contexts.setdefault(key, [])) for key in keys]
            seeds = [f"{self.seed}/{dataset}/{prompt_id}/{iteration}"
                     for (dataset, prompt_id), iteration in zip(keys, iterations)]
            scored = self.score(tokens, q, p, seeds, state, out.num_accepted.tolist())
            for key, iteration, context in zip(keys, iterations, scored):
                self.contexts[key].append({"iteration": iteration, **context})
        return on_iteration

    def finished(self, prompt: dict) -> list[dict]:
        """A finished prompt's contexts, forgotten here (they go into its record)."""
        return self.contexts.pop((prompt["dataset"], prompt["prompt_id"]), [])

    def score(self, tokens: Tensor, q: Tensor, p: Tensor, seeds: list[str], state=None,
              accepted: list[int] | None = None) -> list[dict]:
        """One context per row of a verification's inputs (tokens [B, K, L], q, p as the verifiers take them);
        seeds [B] name the rows' replica generators; state: what the reference was called with (for the entries
        scored with it); accepted: the reference's realised tau per row."""
        started = time.perf_counter()
        B = tokens.shape[0]
        root_p, root_q = p[:, 0, 0], q[:, 0, 0]  # every draft starts at the root
        alpha = optimal_acceptance(root_p, root_q, list(range(1, self.num_drafts + 1)))
        contexts = [{"drafts": draft_digest(tokens[b]), "alpha_star": alpha[b].tolist(), "verifiers": {}}
                    for b in range(B)]
        for name, verifier, k, carried in self.entries:
            generators = [torch.Generator(device=tokens.device).manual_seed(zlib.crc32(f"{seed}/{name}".encode()))
                          for seed in seeds]
            scores = self.score_one(verifier, tokens[:, :k], q[:, :k], p[:, :k], generators,
                                    state if carried else None)
            for context, values in zip(contexts, scores):
                context["verifiers"][name] = {**values, "state": state_label(verifier, carried)}
        ms = 1000 * (time.perf_counter() - started) / B
        for b, context in enumerate(contexts):
            context.update(scoring_ms=ms, **({} if accepted is None else {"accepted": accepted[b]}))
        return contexts

    def score_one(self, verifier, tokens: Tensor, q: Tensor, p: Tensor, generators, state) -> list[dict]:
        """E[tau], its standard error (None: exact), P(tau >= 1) and the milliseconds per context it took (a row's
        share of the batch's calls) of one verifier on the rows' first k drafts, with `state` for a stateful one."""
        started = time.perf_counter()
        with_state = {"state": state} if verifier.carries_state else {}
        law = verifier.accepted_law(tokens, q, p, **with_state)
        if law is not None:
            law = law.double()
            expected = (law * torch.arange(law.shape[-1], dtype=law.dtype, device=law.device)).sum(-1).tolist()
            first = (1 - law[:, 0]).tolist()  # tolist() waits for the device
            ms = 1000 * (time.perf_counter() - started) / tokens.shape[0]
            return [{"expected_accepted": e, "se": None, "first_token_acceptance": f, "ms": ms}
                    for e, f in zip(expected, first)]
        taus = verifier.replicate_accepted(tokens, q, p, generators, self.replicas, state).double().numpy()
        ms = 1000 * (time.perf_counter() - started) / tokens.shape[0]
        se = taus.std(0, ddof=1) / np.sqrt(self.replicas) if self.replicas > 1 else np.full(taus.shape[1], np.nan)
        return [{"expected_accepted": float(taus[:, b].mean()), "se": float(se[b]),
                 "first_token_acceptance": float((taus[:, b] >= 1).mean()), "ms": ms} for b in range(taus.shape[1])]


def state_label(verifier, carried: bool) -> str:
    """How a score treats the verifier's state: `carried` (the decode's real state), `fresh`, or `none` (a
    stateless rule, for which the two are one)."""
    return "carried" if carried else "fresh" if verifier.carries_state else "none"


class ArenaEvaluation(SpeculativeEvaluation):
    """The evaluation's decode of the reference verifier, with the arena watching every iteration: each prompt's
    record gains `arena`, its contexts; summary.json gains `arena`, the comparison (summarise())."""

    def __init__(self, verifiers: list[str] | None, replicas: int, delta: float, **evaluation):
        # Resolved before save_hyperparameters reads this frame: job.json names the verifiers actually scored, so a
        # folder is not resumed with another list (e.g. after a verifier was added to the registry).
        verifiers = arena_verifiers(verifiers, evaluation["verifier"])
        check_arena_knobs(replicas, delta)
        super().__init__(**evaluation)
        self.arena = Arena(verifiers, self.knobs.num_drafts, replicas, self.knobs.seed, evaluation["verifier"])

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

    def summary_sections(self) -> dict:
        wanted = {(prompt["dataset"], prompt["prompt_id"]) for prompt in self.trainer.datamodule.records}
        merged = records.records_in(self.output_dir / "predictions.jsonl")
        arena = summarise({key: merged[key] for key in wanted}, self.hparams.verifier, list(self.arena.verifiers),
                          self.names, self.hparams.delta)
        for logger in self.loggers:
            if isinstance(logger, WandbLogger):
                logger.log_table(key="arena", columns=["dataset", *TABLE], data=table_rows(arena))
                logger.log_table(key="arena_verdicts", columns=list(PAIR_TABLE), data=pair_rows(arena))
        return {"arena": arena}


def summarise(recorded: dict[tuple[str, int], dict], reference: str, names: list[str], datasets: list[str],
              delta: float) -> dict:
    """The comparison, every interval from the prompt-level bootstrap of metrics.paired_difference (the prompt is the
    sampling unit: contexts of one prompt share its text). Per dataset and overall, for each verifier@k: E[tau]
    (its mean over contexts) with its interval and design effect, the difference against the reference at the same
    k with its verdict (metrics.verdict, +-delta), the mean first-token acceptance beside the mean alpha*, the ms
    per context; the reference decode's cost beside the scoring's. Then `pairs`: every two verdict-bearing rules at
    equal k; `state_cost`: a stateful rule carried minus fresh; `consistency`: the reference's realised tau minus
    its own E[tau] (0 within the interval, or the scoring is not the decode's law)."""
    reference = ALIASES.get(reference, reference)
    contexts = {(dataset, prompt_id, context["iteration"]): context
                for (dataset, prompt_id), record in recorded.items() for context in record["arena"]}
    expected: dict[str, dict] = {}
    values: dict[str, dict] = {}
    for key, context in contexts.items():
        for name, value in context["verifiers"].items():
            name = name + FRESH if scored_fresh_before_states(name, value) else name
            values.setdefault(name, {})[key] = value
            expected.setdefault(name, {})[key] = value["expected_accepted"]
    with_verdicts = [name for name in expected if not is_fresh(name)]
    differences = {name: paired_difference(expected[name], expected[label(reference, num_drafts_of(name))])
                   for name in with_verdicts if name.partition("@")[0] != reference
                   and label(reference, num_drafts_of(name)) in expected}
    by_dataset = {}
    for dataset in [*datasets, "overall"]:
        inside = lambda key: dataset == "overall" or key[0] == dataset  # noqa: E731
        rows = {}
        for name, found in values.items():
            keys = [key for key in found if inside(key)]
            if keys:
                rows[name] = verifier_row(name, {key: found[key] for key in keys}, contexts,
                                          differences.get(name, {}).get(dataset), delta)
        decoded = [record for key, record in recorded.items() if inside(key)]
        if rows:
            scoring = [contexts[key].get("scoring_ms") for key in contexts if inside(key)]
            cost = decode_cost(decoded)
            if None not in scoring:
                cost["scoring_ms_per_context"] = float(np.mean(scoring))
                cost["scoring_share"] = cost["scoring_ms_per_context"] / cost["ms_per_iteration"]
            by_dataset[dataset] = {"decode": cost, "verifiers": rows}
    return {"reference": reference, "verifiers": names, "delta": delta, "datasets": by_dataset,
            "pairs": pairs(expected, with_verdicts, delta), "state_cost": state_costs(expected),
            "consistency": consistency(contexts, expected, reference)}


def scored_fresh_before_states(name: str, value: dict) -> bool:
    """Records written before the arena carried states hold every stateful rule's scores from a fresh state."""
    verifier = VERIFIERS.get(name.rpartition("@")[0])
    return "state" not in value and verifier is not None and verifier.carries_state


def verifier_row(name: str, found: dict, contexts: dict, difference: dict | None, delta: float) -> dict:
    """One verifier@k's row over the contexts `found` (key -> its score there)."""
    mean = paired_difference({key: v["expected_accepted"] for key, v in found.items()})["overall"]
    k = num_drafts_of(name)
    states = {v.get("state", "fresh" if is_fresh(name) else "none") for v in found.values()}
    row = {"prompts": mean["prompts"], "contexts": mean["contexts"], "state": "/".join(sorted(states)),
           "exact": all(v["se"] is None for v in found.values()),
           "expected_accepted": mean["mean"], "expected_accepted_se": mean["se"],
           "expected_accepted_low": mean["low"], "expected_accepted_high": mean["high"],
           "design_effect": mean["design_effect"], "difference": difference, "verdict": None,
           "prompts_needed": None,
           "first_token_acceptance": float(np.mean([v["first_token_acceptance"] for v in found.values()])),
           "alpha_star": float(np.mean([contexts[key]["alpha_star"][k - 1] for key in found])),
           "ms_per_context": float(np.mean([v["ms"] for v in found.values()]))}
    if difference is not None:
        row.update(verdict(difference, delta))
    return row


def pairs(expected: dict[str, dict], names: list[str], delta: float) -> list[dict]:
    """Every two rules scored with verdicts at the same k, in label order: a - b per dataset and overall."""
    found = []
    for a, b in combinations(names, 2):
        if num_drafts_of(a) != num_drafts_of(b):
            continue
        differences = paired_difference(expected[a], expected[b])
        found.append({"a": a, "b": b, "k": num_drafts_of(a),
                      "datasets": {dataset: {**d, **verdict(d, delta)} for dataset, d in differences.items()}})
    return found


def state_costs(expected: dict[str, dict]) -> dict[str, dict]:
    """A stateful rule's score with its carried state minus from a fresh state, on the same contexts."""
    return {name: paired_difference(expected[name], expected[name + FRESH])
            for name in expected if not is_fresh(name) and name + FRESH in expected}


def consistency(contexts: dict, expected: dict[str, dict], reference: str) -> dict | None:
    """The reference decode's realised tau minus the arena's E[tau] of the reference on the same contexts: both are
    the law of the decode's own verifications, so the interval must hold 0."""
    realised = {key: context["accepted"] for key, context in contexts.items() if "accepted" in context}
    scored = [name for name in expected if name.partition("@")[0] == reference and not is_fresh(name)]
    if not realised or not scored:
        return None
    name = max(scored, key=num_drafts_of)  # the decode's own k
    differences = paired_difference(realised, expected[name])
    overall = differences["overall"]
    holds = overall["low"] is not None and overall["low"] <= 0 <= overall["high"]
    return {"verifier": name, "holds": holds, "datasets": differences}


def decode_cost(decoded: list[dict]) -> dict:
    """The reference decode's own cost per iteration, beside which the verifiers' ms per context read: its time
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
            rows.append([dataset, name, row["state"], row["prompts"], row["contexts"], row["expected_accepted"],
                         row["expected_accepted_se"], row["design_effect"], difference.get("mean"),
                         difference.get("low"), difference.get("high"), row["verdict"], row["prompts_needed"],
                         row["first_token_acceptance"], row["alpha_star"], row["ms_per_context"]])
    return rows


PAIR_TABLE = ("dataset", "a", "b", "k", "prompts", "difference", "low", "high", "verdict", "prompts_needed")


def pair_rows(arena: dict) -> list[list]:
    """The summary's pairs as rows of PAIR_TABLE (for W&B)."""
    return [[dataset, pair["a"], pair["b"], pair["k"], d["prompts"], d["mean"], d["low"], d["high"], d["verdict"],
             d["prompts_needed"]] for pair in arena["pairs"] for dataset, d in pair["datasets"].items()]

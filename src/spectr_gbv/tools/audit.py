"""Exact audit of every verifier: `python -m spectr_gbv.tools.audit`.

For the three anchors of docs/algorithms.md §12 and one random context-dependent instance with zeros (top-k-like),
prints each verifier's exact mean accepted length E[tau] of one iteration and its share of the bound sum_t alpha*_t
for its number of drafts (no lossless verifier can beat it), the exact error of the law of the next L+1 tokens (gbv
continues with its target modification), and the paper's claimed optimum C_L(K). Everything comes from the
enumeration in verifiers/reference.py.

`--real [--json PATH]` audits every verifier at K = 1, 2, 3 (single-draft rules at K=1 only) on instances built from
the real pair (DEFAULT_PAIR of decoding/models.py: the Qwen2.5-Coder 1.5B target and 0.5B drafter, bfloat16
forward, laws in float64 from the logits at temperature 1). Contexts: the first 4 prompts of each of the five datasets
(conf/dataset/*.yaml), each through the target's chat template and then 8 of the target's greedy tokens, so that the
tree starts inside an answer. At each context a tree of depth L=2: the support after every prefix is the target's
top m=6 tokens there, and p and q are both renormalised over it, so an instance is a pair of context-dependent laws
on an m-token vocabulary (the JSON gives the untruncated mass the supports hold). m=6, not 8: the enumeration visits
m^(L K) draft tuples, and at m=8, K=3 gbv alone takes one to two minutes per instance (m=6: about 10 s).
"""

import argparse
import copy
import json
import logging
import time
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import numpy as np
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf
from rich.console import Console
from rich.table import Table
from rich.text import Text

from spectr_gbv.decoding.engine import eos_ids
from spectr_gbv.decoding.models import DEFAULT_PAIR, LoadedModel, check_same_tokenizer, packaged, tiny
from spectr_gbv.decoding.sampling import warp
from spectr_gbv.tools.report import audit_table
from spectr_gbv.verifiers import VERIFIERS, verifier_names
from spectr_gbv.verifiers.reference import (
    ANCHORS,
    RandModel,
    TableModel,
    anchor,
    bound_sum,
    claimed_C,
    expected_accepted,
    law_error,
)

log = logging.getLogger(__name__)

ANCHOR_NOTES = {"A": " (BV paper toy example)"}


def shown(dist) -> str:
    """'1/3,2/3' or '.5,.3,.2': one decimal where that is exact, else a fraction, as docs/algorithms.md §12 does."""
    return ",".join(f"{x:.1f}".lstrip("0") if round(x, 1) == x else str(Fraction(x).limit_denominator(10))
                    for x in dist)


def anchor_title(name: str) -> str:
    p, q, L, K = ANCHORS[name]
    return f"{name}: p=({shown(p)}) q=({shown(q)}) L={L} K={K}{ANCHOR_NOTES.get(name, '')}"


INSTANCES = {  # title: (target p, drafter q, L, K)
    **{anchor_title(name): anchor(name) for name in ANCHORS},
    "random: V=3, context-dependent, zeros in p and q, L=2 K=3": (
        RandModel(3, seed=8, zero_prob=0.25), RandModel(3, seed=9, zero_prob=0.25), 2, 3),
}


def rows(K):
    """(verifier, number of drafts): single-draft rules and gbv at K=1, then every multi-draft rule at K."""
    single = [(name, 1) for name in verifier_names(multi_draft=False)] + [("gbv", 1)]
    return single + [(name, K) for name in verifier_names(multi_draft=True)]


def instance_table(title, p, q, L, K):
    table = Table(title=title, title_justify="left", caption_justify="left")
    for column in ("verifier", "K", "lossless", "E[tau]", "of bound", "block eff.", "law error"):
        table.add_column(Text(column), justify="left" if column == "verifier" else "right")
    bounds = {k: bound_sum(p, q, L, k) for k in (1, K)}  # the rows use one draft or K
    for name, k in rows(K):
        accepted = expected_accepted(name, p, q, L, k)
        table.add_row(name, str(k), "yes" if VERIFIERS[name].lossless else "NO", f"{accepted:.6f}",
                      f"{accepted / bounds[k]:.1%}", f"{accepted + 1:.6f}", f"{law_error(name, p, q, L, k):.1e}")
    table.caption = Text(f"bound sum_t alpha*_t = {bounds[K]:.6f}   "
                         f"paper's claimed C_L(K) = {claimed_C(p, q, L, K):.6f}")
    return table


# --- the real pair (--real) --------------------------------------------------------------------------------------
DATASET_CONF = Path(__file__).resolve().parents[3] / "conf" / "dataset"
DATASETS = tuple(OmegaConf.load(DATASET_CONF / "all.yaml").defaults)  # the five, as dataset=all lists them
PAIRS = {  # --models: the real pair, or tiny random models for the tests (hidden flag)
    "qwen": lambda: tuple(packaged(name) for name in DEFAULT_PAIR),
    "tiny": lambda: (tiny(seed=0), tiny(seed=0, perturb=0.5)),
}
SUPPORT, DEPTH, PROMPTS, GREEDY_TOKENS, DRAFTS = 6, 2, 4, 8, (1, 2, 3)
SUPPORT_RULE = "the target's top-m tokens after each prefix; p and q both renormalised over them"


def law(logits: torch.Tensor) -> np.ndarray:
    """float64 next-token laws from (bfloat16) logits, through the engine's warp at temperature 1."""
    return warp(logits.double(), temperature=1.0).cpu().numpy()


class NextTokenLaws:
    """One model's laws after a context and short paths below it: the context's KV cache is computed once, and the
    paths of one length are scored in one batched forward over copies of it."""

    def __init__(self, loaded: LoadedModel, context: list[int]):
        self.model, self.context, self.cache = loaded.model, [], None
        self.feed(context)

    @torch.no_grad()
    def feed(self, tokens: list[int]) -> None:
        """Append tokens to the context; `last` is the law after them."""
        out = self.model(input_ids=torch.tensor([tokens], device=self.model.device), cache=self.cache,
                         use_cache=True, logits_to_keep=1)
        self.cache, self.context, self.last = out.cache, self.context + list(tokens), law(out.logits[0, -1])

    @torch.no_grad()
    def after(self, paths: list[tuple[int, ...]]) -> np.ndarray:
        """[len(paths), V]: the law after the context + each path (paths of one length)."""
        if not paths[0]:
            return self.last[None]
        cache = copy.deepcopy(self.cache)  # the forward appends to it; the context's cache serves every level
        cache.batch_repeat_interleave(len(paths))
        out = self.model(input_ids=torch.tensor(paths, device=self.model.device), cache=cache, use_cache=True,
                         logits_to_keep=1)
        return law(out.logits[:, -1])


def extend_greedily(laws: NextTokenLaws, count: int, stop: set[int]) -> None:
    """The target's greedy continuation, stopped before an end token: the tree must start inside the answer."""
    for _ in range(count):
        token = int(laws.last.argmax())
        if token in stop:
            return
        laws.feed([token])


@dataclass
class RealInstance:
    """Target p and drafter q as TableModels on an m-token vocabulary: local token i after a prefix is the target's
    i-th most likely token there. `mass` holds the untruncated mass of the supports under p and q, at the root and
    averaged over the tree's nodes."""
    context: list[int]
    p: TableModel
    q: TableModel
    depth: int
    mass: dict[str, float]


def build_instance(target: LoadedModel, drafter: LoadedModel, prompt: list[int], support: int, depth: int,
                   greedy: int) -> RealInstance:
    target_laws = NextTokenLaws(target, prompt)
    extend_greedily(target_laws, greedy, eos_ids(target))
    drafter_laws = NextTokenLaws(drafter, target_laws.context)
    p_table, q_table, masses = {}, {}, []
    level = {(): ()}  # local prefix -> its token ids after the context
    for d in range(depth + 1):
        paths = list(level.values())
        children = {}
        for (local, ids), p_full, q_full in zip(level.items(), target_laws.after(paths), drafter_laws.after(paths)):
            top = np.argsort(-p_full, kind="stable")[:support]
            p_mass, q_mass = p_full[top].sum(), q_full[top].sum()
            p_table[local], q_table[local] = p_full[top] / p_mass, q_full[top] / q_mass
            masses.append((p_mass, q_mass))
            if d < depth:
                children.update({local + (i,): ids + (int(token),) for i, token in enumerate(top)})
        level = children
    p_mass, q_mass = np.array(masses).T
    return RealInstance(target_laws.context, TableModel(p_table), TableModel(q_table), depth,
                        {"p_root": float(p_mass[0]), "q_root": float(q_mass[0]),
                         "p_mean": float(p_mass.mean()), "q_mean": float(q_mass.mean())})


def build_instances(target: LoadedModel, drafter: LoadedModel, prompts: list[list[int]], support: int = SUPPORT,
                    depth: int = DEPTH, greedy: int = GREEDY_TOKENS) -> list[RealInstance]:
    """One exact instance per prompt (token ids): `greedy` target-greedy tokens in, a tree of depth `depth` with the
    target's top-`support` tokens after every prefix, p and q renormalised over them."""
    check_same_tokenizer(target, drafter)
    return [build_instance(target, drafter, prompt, support, depth, greedy) for prompt in prompts]


def real_rows(drafts):
    """(verifier, K): single-draft rules at K=1 only, every other rule (gbv included) at each K."""
    return [(name, k) for k in drafts for name in verifier_names() if k == 1 or VERIFIERS[name].max_drafts is None]


def audit_instance(instance: RealInstance, drafts) -> dict:
    """{(verifier, K): (E[tau], law error, bound sum_t alpha*_t)} of one instance."""
    p, q, L = instance.p, instance.q, instance.depth
    bounds = {k: bound_sum(p, q, L, k) for k in drafts}
    return {(name, k): (expected_accepted(name, p, q, L, k), float(law_error(name, p, q, L, k)), bounds[k])
            for name, k in real_rows(drafts)}


def summarise(audits: list[dict], drafts) -> list[dict]:
    """Per verifier and K: the means over the instances, and the per-instance values in their order."""
    results = []
    for name, k in real_rows(drafts):
        accepted, errors, bounds = (list(values) for values in zip(*(audit[name, k] for audit in audits)))
        results.append({
            "verifier": name, "K": k, "lossless": VERIFIERS[name].lossless,
            "mean_expected_accepted": float(np.mean(accepted)),
            "mean_share_of_bound": float(np.mean(np.divide(accepted, bounds))),
            "mean_law_error": float(np.mean(errors)), "max_law_error": float(max(errors)),
            "expected_accepted": accepted, "law_error": errors, "bound": bounds,
        })
    return results


def dataset_prompts(count: int) -> list[tuple[str, int, str]]:
    """(dataset, index, text) of the first `count` prompts of each dataset, loaded as its conf/dataset file says."""
    return [(name, index, text) for name in DATASETS
            for index, text in enumerate(instantiate(OmegaConf.load(DATASET_CONF / f"{name}.yaml")[name],
                                                     name=name, limit=count))]


def audit_real(models: str, support: int, depth: int, prompts: int) -> dict:
    """The settings, the instances' contexts and the results, as --json writes them."""
    target, drafter = PAIRS[models]()
    check_same_tokenizer(target, drafter)
    sources = dataset_prompts(prompts)
    contexts, audits = [], []
    for dataset, index, text in sources:
        start = time.perf_counter()
        prompt = target.encode_prompt(text)
        instance = build_instance(target, drafter, prompt, support, depth, GREEDY_TOKENS)
        audits.append(audit_instance(instance, DRAFTS))
        contexts.append({"dataset": dataset, "prompt_index": index, "prompt_tokens": len(prompt),
                         "continuation": target.tokenizer.decode(instance.context[len(prompt):]),
                         "support_mass": instance.mass})
        log.info("%s #%d audited in %.0f s (%d/%d)", dataset, index, time.perf_counter() - start, len(audits),
                 len(sources))
    settings = {"target": target.name, "drafter": drafter.name,
                "dtype": str(target.model.dtype).removeprefix("torch."), "temperature": 1.0,
                "support": support, "depth": depth, "drafts": list(DRAFTS), "greedy_tokens": GREEDY_TOKENS,
                "prompts_per_dataset": prompts, "support_rule": SUPPORT_RULE, "contexts": contexts}
    return {"settings": settings, "results": summarise(audits, DRAFTS)}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m spectr_gbv.tools.audit", description=__doc__.splitlines()[0])
    parser.add_argument("--real", action="store_true", help="audit on exact instances built from the real pair")
    parser.add_argument("--json", metavar="PATH", help="with --real: write the settings and results there")
    parser.add_argument("--support", type=int, default=SUPPORT, metavar="M",
                        help="with --real: tokens per node (default %(default)s)")
    parser.add_argument("--depth", type=int, default=DEPTH, metavar="L",
                        help="with --real: draft length (default %(default)s)")
    parser.add_argument("--prompts", type=int, default=PROMPTS, metavar="N",
                        help="with --real: prompts per dataset (default %(default)s)")
    parser.add_argument("--models", choices=PAIRS, default="qwen", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    changed = [f"--{key}" for key in ("json", "support", "depth", "prompts", "models")
               if getattr(args, key) != parser.get_default(key)]
    if changed and not args.real:
        parser.error(f"{', '.join(changed)}: only with --real")
    for key, low in {"support": 2, "depth": 1, "prompts": 1}.items():
        if getattr(args, key) < low:
            parser.error(f"--{key}={getattr(args, key)} is not allowed; use at least {low}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    console = Console(width=100)  # the widest table, even when piped (rich assumes 80 columns then)
    if args.real:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
        report = audit_real(args.models, args.support, args.depth, args.prompts)
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
        print(audit_table(report), end="")  # Markdown, as the report prints it from the JSON
        return
    console.print(Text("Exact audit (enumeration, float64). E[tau]: mean accepted draft tokens of one iteration; "
                       "of bound: E[tau] / sum_t alpha*_t with that K, which no lossless verifier can exceed; "
                       "law error: max |law of the next L+1 tokens - target law|."))
    for title, (p, q, L, K) in INSTANCES.items():
        console.print(instance_table(title, p, q, L, K))


if __name__ == "__main__":
    main()

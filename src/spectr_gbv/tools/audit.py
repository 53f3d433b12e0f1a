"""Exact audit of every verifier: `python -m spectr_gbv.tools.audit`.

For the three anchors of docs/algorithms.md §12 and one random context-dependent instance with zeros (top-k-like),
prints each verifier's exact mean accepted length E[tau] of one iteration and its share of the bound sum_t alpha*_t
for its number of drafts (no lossless verifier can beat it), the exact error of the law of the next L+1 tokens (gbv
continues with its target modification), and the paper's claimed optimum C_L(K). Everything comes from the
enumeration in verifiers/reference.py.

`--real [--json PATH]` audits every verifier at K = 1, 2, 3 (single-draft rules at K=1 only) on instances built from
the real pair (DEFAULT_PAIR of decoding/gguf_packages.py: the Qwen2.5-Coder 1.5B target and 0.5B drafter, bfloat16
forward, laws in float64 from the logits at temperature 1). Contexts: the first 4 prompts of each of the five datasets
(conf/dataset/*.yaml), each through the target's chat template and then 8 of the target's greedy tokens, so that the
tree starts inside an answer. At each context a tree of depth L=2: the support after every prefix is the target's
top m=6 tokens there, and p and q are both renormalised over it, so an instance is a pair of context-dependent laws
on an m-token vocabulary (the JSON gives the untruncated mass the supports hold). m=6, not 8: the enumeration visits
m^(L K) draft tuples: at K=3 that is 8^6, 5.6x the 6^6 of m=6, for each of 20 instances and every verifier.

`--verifier module.path:ClassName` (repeatable; built-in names work too) audits a verifier as a black box, since
its kernel cannot be enumerated: chi-square tests of whole generated streams against the target's law on the anchors
and on random context-dependent instances with zeros in p and q, greedy identity at temperature 0, and the mean
accepted length on the anchors with its standard error; with the class's optional exact hook (`exact_outcomes`,
docs/custom_verifiers.md) also the exact E[tau] and law error. It ends in a verdict, "lossless (min p = ...)" or
"NOT lossless: ... at instance ...", and exits with status 1 when a rule that claims lossless gets the second.
"""

import argparse
import copy
import json
import logging
import sys
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
from spectr_gbv.decoding.gguf_packages import DEFAULT_PAIR, packaged
from spectr_gbv.decoding.models import LoadedModel, check_same_tokenizer
from spectr_gbv.decoding.sampling import warp
from spectr_gbv.decoding.tiny import tiny
from spectr_gbv.errors import ConfigError
from spectr_gbv.tools.report import audit_table
from spectr_gbv.verifiers import VERIFIERS, Verifier, verifier_class, verifier_names
from spectr_gbv.verifiers.reference import (
    ANCHORS,
    RandModel,
    TableModel,
    anchor,
    bound_sum,
    claimed_C,
    exact_law,
    expected_accepted,
    law_error,
)
from spectr_gbv.verifiers.streams import ToyModel, generate_streams, law_p_value

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
    "qwen": lambda: tuple(packaged(name, dtype="bfloat16") for name in DEFAULT_PAIR),  # the study's, on every machine
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


# --- a researcher's verifier (--verifier): its law tested by the streams it generates ----------------------------
FAMILY_ALPHA = 1e-3  # chance that a lossless rule is called NOT lossless, split over the stream tests (Bonferroni)
STREAM_ROWS = 20_000  # streams per instance: the published rule's bias and a residual replaced by p fail far below
GREEDY_ROWS, GREEDY_TOKENS_OUT = 2_000, 5
EXACT_TOLERANCE = 1e-9  # float64 enumeration rounds at about 1e-16; a hook written another way may round more


def toy_anchor(name):
    p, q, L, K = ANCHORS[name]
    models = ToyModel(len(p), 0, const=p), ToyModel(len(q), 0, const=q)
    return f"{name}: p=({shown(p)}) q=({shown(q)})", (*models, L, K)


def toy_random(vocab, seed, L, K):
    """Context-dependent target and drafter (the law depends on the last two tokens) with zeros in both, as top-k /
    top-p truncation makes them."""
    return (f"random: V={vocab}, seed {seed}",
            (ToyModel(vocab, seed, zero_prob=0.2), ToyModel(vocab, seed + 100, zero_prob=0.15), L, K))


RANDOM = [(3, 1, 2, 3), (3, 7, 3, 2), (4, 3, 2, 2), (3, 11, 1, 4)]  # (V, seed, L, K): several K and L
STREAM_INSTANCES = dict(  # title: (target, drafter, L, K); fixed seeds, so the verdict is reproducible
    [toy_anchor(name) for name in ANCHORS] + [toy_random(vocab, seed, L, K) for vocab, seed, L, K in RANDOM])
GREEDY_TITLE = "greedy: V=4, one-hot target"  # temperature 0
GREEDY_INSTANCE = (ToyModel(4, 5, one_hot=True), ToyModel(4, 105, zero_prob=0.15), 4, 3)


@dataclass
class StreamCheck:
    """One instance's evidence: the chi-square p-value of the first max(3, L + 1) tokens of STREAM_ROWS streams
    against the target's law, the first iteration's mean accepted count with its standard error, and, with an exact
    law, the exact E[tau] and law error of one iteration (None without one)."""
    title: str
    K: int
    L: int
    p_value: float
    accepted: float
    standard_error: float
    exact_accepted: float | None
    law_error: float | None


def drafts_for(cls: type[Verifier], K: int) -> int:
    return K if cls.max_drafts is None else min(K, cls.max_drafts)


def stream_check(spec: str, title: str, seed: int) -> StreamCheck:
    target, drafter, L, K = STREAM_INSTANCES[title]
    cls = verifier_class(spec)
    K, tokens = drafts_for(cls, K), max(3, L + 1)  # L + 1: the first iteration's recovered or bonus token too
    samples, accepted = generate_streams(cls(), target, drafter, rows=STREAM_ROWS, num_drafts=K, block_length=L,
                                         num_tokens=tokens, seed=seed)
    exact = exact_law(spec) is not None
    return StreamCheck(title, K, L, law_p_value(samples, target.law(tokens)), accepted.mean().item(),
                       accepted.std().item() / STREAM_ROWS ** 0.5,
                       expected_accepted(spec, target.cond, drafter.cond, L, K) if exact else None,
                       float(law_error(spec, target.cond, drafter.cond, L, K)) if exact else None)


def greedy_misses(spec: str) -> int:
    """Rows whose tokens are not the one-hot target's greedy tokens (every lossless rule must emit them)."""
    target, drafter, L, K = GREEDY_INSTANCE
    cls = verifier_class(spec)
    samples, _ = generate_streams(cls(), target, drafter, rows=GREEDY_ROWS, num_drafts=drafts_for(cls, K),
                                  block_length=L, num_tokens=GREEDY_TOKENS_OUT, seed=2)
    (greedy, _), = [(seq, prob) for seq, prob in target.law(GREEDY_TOKENS_OUT).items() if prob > 0]
    return int((samples != torch.tensor(greedy)).any(-1).sum())


def verdict(checks: list[StreamCheck], misses: int) -> tuple[bool, str]:
    """(lossless?, the verdict with its evidence). Each stream test runs at FAMILY_ALPHA / their number, so a lossless
    rule passes all of them with probability >= 1 - FAMILY_ALPHA; greedy misses and exact errors are not chance."""
    threshold = FAMILY_ALPHA / len(checks)
    worst = min(checks, key=lambda check: check.p_value)
    if worst.p_value < threshold:
        return False, f"NOT lossless: p = {worst.p_value:.2e} < {threshold:.1e} at instance {worst.title}"
    if misses:
        return False, (f"NOT lossless: p = 0 at instance {GREEDY_TITLE}: {misses} of {GREEDY_ROWS} rows leave the "
                       "target's greedy tokens")
    wrong = [check for check in checks if check.law_error is not None and check.law_error > EXACT_TOLERANCE]
    if wrong:
        return False, f"NOT lossless: exact law error {wrong[0].law_error:.1e} at instance {wrong[0].title}"
    return True, (f"lossless (min p = {worst.p_value:.3g} at instance {worst.title}; each test at "
                  f"{threshold:.1e} = {FAMILY_ALPHA:g} / {len(checks)})")


def custom_table(spec: str, checks: list[StreamCheck], misses: int) -> Table:
    cls = verifier_class(spec)
    table = Table(title=f"{spec}: claims lossless: {'yes' if cls.lossless else 'NO'}; drafts: "
                        f"{cls.max_drafts or 'any K'}", title_justify="left", caption_justify="left")
    for column in ("instance", "K", "L", "stream p", "E[tau] ± s.e.", "exact E[tau]", "law error"):
        table.add_column(Text(column), justify="left" if column == "instance" else "right", no_wrap=True)
    for check in checks:
        table.add_row(check.title, str(check.K), str(check.L), f"{check.p_value:.3g}",
                      f"{check.accepted:.4f} ± {check.standard_error:.4f}",
                      "-" if check.exact_accepted is None else f"{check.exact_accepted:.6f}",
                      "-" if check.law_error is None else f"{check.law_error:.1e}")
    table.add_row(GREEDY_TITLE, str(drafts_for(cls, GREEDY_INSTANCE[3])), str(GREEDY_INSTANCE[2]),
                  "0" if misses else "-", f"{GREEDY_ROWS - misses}/{GREEDY_ROWS} greedy", "-", "-")
    return table


def audit_custom(spec: str, console: Console) -> bool:
    """Print the evidence and the verdict on one verifier; False when it claims lossless and is found not to be."""
    checks = [stream_check(spec, title, seed) for seed, title in enumerate(STREAM_INSTANCES)]
    misses = greedy_misses(spec)
    lossless, line = verdict(checks, misses)
    table = custom_table(spec, checks, misses)
    table.caption = Text(f"stream p: chi-square p-value of the first max(3, L+1) tokens of {STREAM_ROWS} "
                         "streams against the target's law. random: context-dependent toy models with zeros in p "
                         "and q. greedy: a one-hot target (temperature 0). E[tau]: the first iteration's mean accepted "
                         "count. exact: from verifiers/reference.py for a built-in, from the class's exact_outcomes "
                         "for yours, if it gives one.")
    console.print(table)
    console.print(Text(f"verdict on {spec}: {line}", style="bold" if lossless else "bold red"))
    return lossless or not verifier_class(spec).lossless


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
    parser.add_argument("--verifier", action="append", metavar="SPEC",
                        help="audit this verifier's streams instead: module.path:ClassName or a built-in name "
                             "(repeat for several)")
    args = parser.parse_args(argv)
    if args.verifier and args.real:
        parser.error("--verifier: not with --real")
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
    if args.verifier:
        try:
            for spec in args.verifier:  # every spec before any audit: a typo must not wait for the others
                verifier_class(spec, "--verifier")
        except ConfigError as error:
            sys.exit(f"error: {error}")
        claims_hold = [audit_custom(spec, console) for spec in args.verifier]
        if not all(claims_hold):
            sys.exit(1)
        return
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

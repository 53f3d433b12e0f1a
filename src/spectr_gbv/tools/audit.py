"""Exact audit of every verifier: `python -m spectr_gbv.tools.audit`.

For the three anchors of docs/algorithms.md §12 and one random context-dependent instance with zeros (top-k-like),
prints each verifier's exact mean accepted length E[tau] of one iteration and its share of the bound sum_t alpha*_t
for its number of drafts (no lossless verifier can beat it), the exact error of the law of the next L+1 tokens (gbv
continues with its target modification), and the paper's claimed optimum C_L(K). Everything comes from the
enumeration in verifiers/reference.py.
"""

import argparse
from fractions import Fraction

from rich.console import Console
from rich.table import Table
from rich.text import Text

from spectr_gbv.verifiers.reference import (
    ANCHORS,
    LOSSLESS,
    SINGLE_DRAFT,
    VERIFIERS,
    RandModel,
    anchor,
    bound_sum,
    claimed_C,
    expected_accepted,
    law_error,
)

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
    single = [(name, 1) for name in SINGLE_DRAFT] + [("gbv", 1)]
    return single + [(name, K) for name in VERIFIERS if name not in SINGLE_DRAFT]


def instance_table(title, p, q, L, K):
    table = Table(title=title, title_justify="left", caption_justify="left")
    for column in ("verifier", "K", "lossless", "E[tau]", "of bound", "block eff.", "law error"):
        table.add_column(Text(column), justify="left" if column == "verifier" else "right")
    bounds = {k: bound_sum(p, q, L, k) for k in (1, K)}  # the rows use one draft or K
    for name, k in rows(K):
        accepted = expected_accepted(name, p, q, L, k)
        table.add_row(name, str(k), "yes" if name in LOSSLESS else "NO", f"{accepted:.6f}",
                      f"{accepted / bounds[k]:.1%}", f"{accepted + 1:.6f}", f"{law_error(name, p, q, L, k):.1e}")
    table.caption = Text(f"bound sum_t alpha*_t = {bounds[K]:.6f}   "
                         f"paper's claimed C_L(K) = {claimed_C(p, q, L, K):.6f}")
    return table


def main(argv: list[str] | None = None) -> None:
    argparse.ArgumentParser(prog="python -m spectr_gbv.tools.audit", description=__doc__.splitlines()[0]).parse_args(argv)
    console = Console(width=100)  # the widest table, even when piped (rich assumes 80 columns then)
    console.print(Text("Exact audit (enumeration, float64). E[tau]: mean accepted draft tokens of one iteration; "
                       "of bound: E[tau] / sum_t alpha*_t with that K, which no lossless verifier can exceed; "
                       "law error: max |law of the next L+1 tokens - target law|."))
    for title, (p, q, L, K) in INSTANCES.items():
        console.print(instance_table(title, p, q, L, K))


if __name__ == "__main__":
    main()

"""Verifier benchmark: `python -m spectr_gbv.tools.bench` (part of `make bench`).

Times one call of every verifier, side by side in one run, and reports it as a ratio to one softmax over a tensor of
the call's target_probs size (the machine's noise cancels in the ratio), in two regimes:
  - decoding: B = 1, K = 4, L = 8, V = 151,936 (the Qwen vocabulary), float32, LLM-like distributions;
  - statistical tests: B = 10,000, K = 3, L = 3, V = 3.
gbv is timed twice: on a fresh sequence, and with the pending target modification of a previous call in force.
"""
from __future__ import annotations

import argparse

import torch
from torch.utils.benchmark import Timer

from spectr_gbv.decoding.precision import machine
from spectr_gbv.verifiers import VERIFIERS, build_verifier, verifier_names

NAMES = verifier_names()


def llm_like_call(B: int, K: int, L: int, V: int, seed: int = 0):
    """Peaked target logits and a drafter whose logits are a noisy copy, so acceptance is neither 0 nor 1.
    Distributions depend on the position only, so drafts that share a prefix see the same rows, as in a real trie."""
    g = torch.Generator().manual_seed(seed)
    logits = 3 * torch.randn(B, 1, L + 1, V, generator=g)
    p = logits.softmax(-1).expand(B, K, L + 1, V).contiguous()
    q = (logits[:, :, :L] + torch.randn(B, 1, L, V, generator=g)).softmax(-1).expand(B, K, L, V).contiguous()
    x = torch.multinomial(q.reshape(-1, V), 1, generator=g).reshape(B, K, L)
    return x, q, p


def median_seconds(fn, min_run_time: float) -> float:
    return Timer(stmt="fn()", globals={"fn": fn}).blocked_autorange(min_run_time=min_run_time).median


def bench_regime(B: int, K: int, L: int, V: int, min_run_time: float) -> list[tuple[str, float, float]]:
    rows = []
    for name in NAMES:
        k = 1 if VERIFIERS[name].max_drafts == 1 else K
        x, q, p = llm_like_call(B, k, L, V)
        verifier, g = build_verifier(name), torch.Generator().manual_seed(0)
        logits = p.log()
        softmax = median_seconds(lambda: logits.softmax(-1), min_run_time)
        seconds = median_seconds(lambda: verifier(x, q, p, generator=g), min_run_time)
        rows.append((name if k == K else f"{name} (K=1)", seconds, seconds / softmax))
        if name == "gbv":
            state = pending_state(verifier, x, q, p)
            seconds = median_seconds(lambda: verifier(x, q, p, generator=g, state=state), min_run_time)
            rows.append(("gbv, modification pending", seconds, seconds / softmax))
    return rows


def pending_state(verifier, x, q, p):
    """A state with pending levels (from a call that stopped early in the block)."""
    for seed in range(100):
        out = verifier(x, q, p, generator=torch.Generator().manual_seed(seed))
        if out.state is not None:
            return out.state
    raise RuntimeError("no call left a pending modification")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m spectr_gbv.tools.bench", description=__doc__.splitlines()[0])
    parser.add_argument("--min-run-time", type=float, default=1.0, help="seconds of timing per measurement")
    args = parser.parse_args(argv)
    print(f"machine: {machine('float32')}")
    for B, K, L, V in [(1, 4, 8, 151_936), (10_000, 3, 3, 3)]:
        print(f"\nB={B} K={K} L={L} V={V} float32: one call, and its ratio to one softmax of target_probs' size")
        print(f"{'verifier':28s} {'ms/call':>10s} {'x softmax':>10s}")
        for name, seconds, ratio in bench_regime(B, K, L, V, args.min_run_time):
            print(f"{name:28s} {1e3 * seconds:10.2f} {ratio:10.1f}")


if __name__ == "__main__":
    main()

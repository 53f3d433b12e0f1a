"""Arena scoring benchmark: `python -m spectr_gbv.tools.bench_arena` (part of `make bench`).

What mode=arena spends per context beside the decode, verifier@k by verifier@k, on the setting the arena issue sizes
(B = 8 contexts a call, K = 4 drafts, L = 4, V = 151,936, float32 probabilities as sampling.warp gives them whatever
the models' dtype), with every registered verifier and `replicas` calls for those without a closed-form law. Inputs are
bench.llm_like_call's. Each figure is the median over the repeats after one warm-up: on a shared machine a single
pass can take several times the median. `--summary` puts the total beside a real arena job's decode cost per context.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

from spectr_gbv.decoding.precision import keep_freed_memory, machine
from spectr_gbv.experiment.arena import Arena
from spectr_gbv.tools.bench import llm_like_call
from spectr_gbv.verifiers import verifier_names


def bench(B: int, K: int, L: int, V: int, replicas: int, repeats: int) -> tuple[dict[str, float], float]:
    """Median ms per context of each verifier@k, and of the whole scoring (the OT bound alpha* included)."""
    tokens, q, p = llm_like_call(B, K, L, V)
    arena = Arena(verifier_names(), K, replicas, seed=0, reference="gbv")
    seeds = [f"bench/{b}" for b in range(B)]
    per_label, totals = {}, []
    for repeat in range(repeats + 1):
        started = time.perf_counter()
        context = arena.score(tokens, q, p, seeds)[0]
        if repeat:  # the first pass is the warm-up
            totals.append(1000 * (time.perf_counter() - started) / B)
            for name, values in context["verifiers"].items():
                per_label.setdefault(name, []).append(values["ms"])
    return {name: statistics.median(ms) for name, ms in per_label.items()}, statistics.median(totals)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m spectr_gbv.tools.bench_arena", description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--replicas", type=int, default=16, help="as mode=arena's knob (its default)")
    parser.add_argument("--system-allocator", action="store_true",
                        help="leave glibc's mmap of large blocks on (run.py turns it off: decoding.precision)")
    parser.add_argument("--summary", help="an arena job's summary.json: the total beside its decode's ms per context")
    args = parser.parse_args(argv)
    allocator = "glibc default" if args.system_allocator or not keep_freed_memory() else "freed memory kept"
    B, K, L, V = 8, 4, 4, 151_936
    print(f"machine: {machine('float32')}; allocator: {allocator}")
    print(f"B={B} K={K} L={L} V={V} replicas={args.replicas}: median ms per context over {args.repeats} repeats")
    per_label, total = bench(B, K, L, V, args.replicas, args.repeats)
    for name, ms in per_label.items():
        print(f"{name:28s} {ms:9.1f}")
    print(f"{'scoring, all':28s} {total:9.1f}")
    if args.summary:
        with open(args.summary) as file:
            decode = json.load(file)["arena"]["datasets"]["overall"]["decode"]
        print(f"decode: {decode['ms_per_iteration']:.1f} ms per context ({args.summary}); "
              f"scoring / decode = {total / decode['ms_per_iteration']:.2f}")


if __name__ == "__main__":
    main()

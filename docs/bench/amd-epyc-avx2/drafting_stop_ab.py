"""A/B behind drafting_stop_ab.txt: token K=1 L=4 at T=0 with the engine before d4fb2ff (it drafts L tokens always)
and after it (it stops drafting at max_new_tokens and after a drafted EOS), beside transformers' assisted generation
drafting L=4 with the same drafter; float32 pair on oneDNN, one process, methods in turn prompt by prompt, twice (the
second round in reverse order); forward passes counted and timed by bench_engine.clocked.

The engine before the change is its engine.py at --old-commit (read with `git show`), imported beside the current
modules, so run it from the repository. Any further bench_engine flag is passed on (e.g. --tiny).

    PYTHONPATH=src python docs/bench/amd-epyc-avx2/drafting_stop_ab.py [--old-commit c02d010] [--tiny]
"""
import argparse
import importlib.util
import subprocess
import tempfile
from collections import Counter
from pathlib import Path

import torch

from spectr_gbv.decoding.engine import SpeculativeEngine
from spectr_gbv.decoding.sampling import Sampling
from spectr_gbv.tools.bench_engine import PROMPTS, clocked, load_pair, pair_settings, parse_args, transformers_method


def old_engine(commit: str):
    source = subprocess.run(["git", "show", f"{commit}:src/spectr_gbv/decoding/engine.py"], capture_output=True,
                            text=True, check=True).stdout
    path = Path(tempfile.mkdtemp()) / "engine_old.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("engine_old", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old-commit", default="c02d010", help="the engine before the change")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=32, help="new tokens per prompt")
    args, bench_flags = parser.parse_known_args(argv)
    old = old_engine(args.old_commit)
    bench = parse_args(["--dtype", "float32", "--linear-kernel", "onednn"] + bench_flags)
    target, drafter = load_pair(bench.tiny, *pair_settings(bench))
    for model in (target, drafter):  # page the memory-mapped embeddings in before timing anything
        model.model.get_input_embeddings().weight.sum()
    prompts = [target.encode_prompt(t) for t in PROMPTS[:args.prompts]]

    def engine(cls):
        e = cls(target, drafter, "token", 1, 4, Sampling(0.0))
        return lambda prompt, seed: e.generate(prompt, args.tokens, torch.Generator().manual_seed(seed))

    methods = {"assisted": transformers_method(target, args.tokens, drafter, 4), "token new": engine(SpeculativeEngine),
               "token old": engine(old.SpeculativeEngine)}
    for run in methods.values():  # warm-up
        run(prompts[0], 0)
    totals = {name: Counter() for name in methods}
    outputs = {name: [] for name in methods}
    models = {"target": target.model, "drafter": drafter.model}
    for rep in range(2):
        for i, prompt in enumerate(prompts):
            for name in list(methods) if rep == 0 else list(reversed(methods)):
                passes, seconds = Counter(), Counter()
                with clocked(models, passes, seconds):
                    r = methods[name](prompt, i)
                totals[name].update(tokens=r.new_tokens, calls=r.target_calls, total=r.total_time,
                                    dpass=passes["drafter"], dsec=seconds["drafter"], tsec=seconds["target"])
                outputs[name].append(r.output_ids)
                print(rep, i, name, r.new_tokens, r.target_calls, passes["drafter"], f"{r.total_time:.2f}s", flush=True)
    for name, t in totals.items():
        c = t["calls"]
        print(f"{name:10s} tok/s {t['tokens'] / t['total']:.3f} block eff {t['tokens'] / c:.2f} "
              f"drafter passes/call {t['dpass'] / c:.2f} ms/call total {1e3 * t['total'] / c:.1f} "
              f"target {1e3 * t['tsec'] / c:.1f} drafter {1e3 * t['dsec'] / c:.1f} "
              f"outside {1e3 * (t['total'] - t['tsec'] - t['dsec']) / c:.1f}")
    rate = {name: t["tokens"] / t["total"] for name, t in totals.items()}
    print(f"token new / assisted {rate['token new'] / rate['assisted']:.3f}  "
          f"token old / assisted {rate['token old'] / rate['assisted']:.3f}  "
          f"new / old {rate['token new'] / rate['token old']:.3f}")
    print("same tokens new/assisted:", outputs["token new"] == outputs["assisted"],
          " new/old:", outputs["token new"] == outputs["token old"])


if __name__ == "__main__":
    main()

"""A/B behind skip_hidden_ab.txt: the engine with and without skipping hidden positions in the position-wise modules
(decoding/cache.py: only_where; 'padded' swaps it for a no-op), gbv K=3 L=4 T=1 and ar on the bench's 8 prompts x 32
tokens at B=8, float32 pair on oneDNN, one process, two rounds in the order packed, padded, padded, packed.
'prefill' is the largest record's prefill_time.

    PYTHONPATH=src python docs/bench/amd-epyc-avx2/skip_hidden_ab.py [--tiny]
"""
import argparse
import contextlib
import time

import torch

import spectr_gbv.decoding.cache as cache_module
from spectr_gbv.decoding.precision import machine
from spectr_gbv.decoding.engine import SpeculativeEngine
from spectr_gbv.decoding.sampling import Sampling
from spectr_gbv.tools.bench_engine import PROMPTS, load_pair


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny random models: a smoke test in seconds")
    parser.add_argument("--tokens", type=int, default=32, help="new tokens per prompt")
    args = parser.parse_args(argv)
    only_where = {"packed": cache_module.only_where, "padded": lambda keep, modules: contextlib.nullcontext()}
    print("machine:", machine("float32"), ", linear layers on onednn", flush=True)
    onednn = {"dtype": "float32", "linear_kernel": "onednn"}
    target, drafter = load_pair(args.tiny, onednn, onednn)
    prompts = [target.encode_prompt(t) for t in PROMPTS[:8]]
    for model in (target, drafter):  # page the memory-mapped embeddings in before timing anything
        model.model.get_input_embeddings().weight.sum()
    engines = {"gbv K=3": SpeculativeEngine(target, drafter, "gbv", 3, 4, Sampling(1.0)),
               "ar": SpeculativeEngine(target, None, "ar", 1, 4, Sampling(1.0))}
    engines["gbv K=3"].generate_batch(prompts[:2], 2, [torch.Generator().manual_seed(i) for i in range(2)])
    results = {}
    for rnd in range(2):
        for name in ("packed", "padded", "padded", "packed"):
            cache_module.only_where = only_where[name]
            for method, engine in engines.items():
                start = time.perf_counter()
                generators = [torch.Generator().manual_seed(i) for i in range(8)]
                records = engine.generate_batch(prompts, args.tokens, generators)
                wall = time.perf_counter() - start
                tokens = sum(len(r.output_ids) for r in records)
                prefill = max(r.prefill_time for r in records)
                results.setdefault((method, name), []).append((wall, tokens, [r.output_ids for r in records]))
                print(f"round {rnd} {method} {name}: {wall:.1f} s, {tokens / wall:.2f} tok/s, prefill {prefill:.2f} s",
                      flush=True)
    cache_module.only_where = only_where["packed"]
    for method in engines:
        a, b = results[(method, "packed")], results[(method, "padded")]
        rate_a = sum(n for _, n, _ in a) / sum(w for w, _, _ in a)
        rate_b = sum(n for _, n, _ in b) / sum(w for w, _, _ in b)
        print(f"{method} B=8: packed {rate_a:.2f} tok/s, padded {rate_b:.2f} tok/s, ratio {rate_a / rate_b:.2f}x; "
              f"same tokens: {a[0][2] == b[0][2]}")


if __name__ == "__main__":
    main()

"""A/B behind dtype_onednn_vs_bf16.txt: which setting decodes fastest on this CPU, the Qwen pair in bfloat16 (torch's
own kernels) or in float32 with linear_kernel=onednn, side by side in one process (both pairs loaded), T=1, the
methods interleaved prompt by prompt (the dtype order flipped for the second prompt), seed = prompt index.
'after the prefill': without the first iteration, which reads the prompt.

    PYTHONPATH=src python docs/bench/amd-epyc-avx2/dtype_onednn_vs_bf16.py [--tiny]
"""
import argparse
import time
import warnings

import torch

from spectr_gbv.decoding.precision import machine
from spectr_gbv.decoding.engine import SpeculativeEngine
from spectr_gbv.decoding.sampling import Sampling
from spectr_gbv.tools.bench_engine import PROMPTS, load_pair

METHODS = [("ar", 1), ("gbv", 1), ("gbv", 2), ("gbv", 3)]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny random models: a smoke test in seconds")
    parser.add_argument("--tokens", type=int, default=32, help="new tokens per prompt")
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    print(machine("bfloat16 vs float32 on onednn"), flush=True)
    bf16, onednn = {"dtype": "bfloat16"}, {"dtype": "float32", "linear_kernel": "onednn"}
    pairs = {"bf16": load_pair(args.tiny, bf16, bf16), "fp32-onednn": load_pair(args.tiny, onednn, onednn)}
    for pair in pairs.values():  # page the memory-mapped embeddings in before timing anything
        for model in pair:
            model.model.get_input_embeddings().weight.sum()
    prompts = [pairs["bf16"][0].encode_prompt(p) for p in PROMPTS[:2]]
    for pair in pairs.values():  # warm-up
        SpeculativeEngine(*pair, "gbv", 3, 4, Sampling(1.0)).generate(prompts[0], 2, torch.Generator().manual_seed(0))
    totals = {}  # (setting, method) -> tokens, wall, target calls, tokens after the prefill, seconds after it
    for i, order in enumerate((("bf16", "fp32-onednn"), ("fp32-onednn", "bf16"))):
        for verifier, K in METHODS:
            for setting in order:
                target, drafter = pairs[setting]
                engine = SpeculativeEngine(target, None if verifier == "ar" else drafter, verifier, K, 4, Sampling(1.0))
                start = time.perf_counter()
                r = engine.generate(prompts[i], args.tokens, torch.Generator().manual_seed(i))
                wall = time.perf_counter() - start
                x = totals.setdefault((setting, (verifier, K)), [0, 0.0, 0, 0, 0.0])
                x[0] += r.new_tokens
                x[1] += wall
                x[2] += r.target_calls
                x[3] += r.new_tokens - r.prefill_tokens
                x[4] += r.total_time - r.prefill_time
                print(f"prompt {i} {setting:12s} {verifier} K={K}: {r.new_tokens} tokens in {wall:6.2f} s "
                      f"(prefill {r.prefill_time:5.2f} s), {r.target_calls} target calls", flush=True)
    b = totals[("bf16", ("ar", 1))]
    base, base_after = b[0] / b[1], b[3] / b[4]
    for setting in pairs:
        for verifier, K in METHODS:
            x = totals[(setting, (verifier, K))]
            print(f"{setting:12s} {verifier} K={K}: {x[0] / x[1]:.2f} tok/s, block efficiency {x[0] / x[2]:.2f}, "
                  f"{x[0] / x[1] / base:.2f}x bfloat16 ar; after the prefill {x[3] / x[4]:.2f} tok/s, "
                  f"{x[3] / x[4] / base_after:.2f}x bfloat16 ar's", flush=True)


if __name__ == "__main__":
    main()

"""A/B behind linear_kernel_ab.txt: the float32 Qwen pair on torch's own linear (MKL's sgemm, 'mkl') against
linear_kernel=onednn, side by side in one process (both pairs loaded).

part `engine` (default): bare forwards (costs.forward_seconds, median of 3 after a warm-up, over a cache of the first
bench prompt) in the order mkl, onednn, onednn, mkl; the engine at T=1 (ar, gbv K=1..3 L=4) on 2 bench prompts, the
kernels in ABBA order by prompt, seed = prompt index; gbv K=3 L=4 T=1 at B=8 on 8 prompts, in the order mkl, onednn,
onednn, mkl. part `matmul`: one [8960 x 1536] float32 weight (Qwen2.5-1.5B's MLP gate/up), best of 5 x 20 calls, ms,
for M rows: F.linear (MKL), mkldnn_linear on a plain oneDNN weight, _linear_pointwise on a weight reordered once (what
OneDNNLinear calls), and the largest difference of the last from F.linear.

    PYTHONPATH=src python docs/bench/amd-epyc-avx2/linear_kernel_ab.py [--part matmul] [--tiny]
"""
import argparse
import time

import torch
import torch.nn.functional as F

from spectr_gbv.decoding.costs import forward_seconds
from spectr_gbv.decoding.precision import machine
from spectr_gbv.decoding.engine import SpeculativeEngine
from spectr_gbv.decoding.sampling import Sampling
from spectr_gbv.tools.bench_engine import PROMPTS, load_pair

NAMES = {None: "mkl", "onednn": "onednn"}
METHODS = [("ar", 1), ("gbv", 1), ("gbv", 2), ("gbv", 3)]
SHAPES = [("target", 1, 1), ("target", 5, 1), ("target", 9, 1), ("target", 13, 1), ("target", 5, 8),
          ("target", 13, 8), ("drafter", 1, 1), ("drafter", 3, 1), ("drafter", 3, 8)]  # side, width, rows


def engine_ab(args):
    print(machine("float32"), "; torch's linear (mkl) vs linear_kernel=onednn", flush=True)
    pairs = {k: load_pair(args.tiny, {"dtype": "float32", "linear_kernel": k}, {"dtype": "float32", "linear_kernel": k})
             for k in NAMES}
    for pair in pairs.values():  # page the memory-mapped embeddings in before timing anything
        for model in pair:
            model.model.get_input_embeddings().weight.sum()
    prompts = [pairs[None][0].encode_prompt(p) for p in PROMPTS[:8]]
    context = prompts[0]
    print("context", len(context), flush=True)
    for rnd, order in enumerate(((None, "onednn"), ("onednn", None))):
        for k in order:
            for side, width, rows in SHAPES:
                model = pairs[k][0 if side == "target" else 1].model
                ms = forward_seconds(model, context, width, 3, rows) * 1e3
                print(f"round {rnd} {NAMES[k]:7s} {side:8s} rows={rows} width {width:2d}: {ms:8.1f} ms", flush=True)

    totals = {(k, m): [0, 0.0, 0, []] for k in pairs for m in METHODS}  # tokens, wall, target calls, outputs
    for i in range(2):
        for k in ((None, "onednn") if i == 0 else ("onednn", None)):
            for verifier, K in METHODS:
                target, drafter = pairs[k]
                engine = SpeculativeEngine(target, None if verifier == "ar" else drafter, verifier, K, 4, Sampling(1.0))
                start = time.perf_counter()
                r = engine.generate(prompts[i], args.tokens, torch.Generator().manual_seed(i))
                wall = time.perf_counter() - start
                x = totals[(k, (verifier, K))]
                x[0] += r.new_tokens
                x[1] += wall
                x[2] += r.target_calls
                x[3].append(r.output_ids)
                print(f"prompt {i} {NAMES[k]:7s} {verifier} K={K}: {r.new_tokens} tokens in {wall:6.2f} s, "
                      f"{r.target_calls} target calls", flush=True)
    for m in METHODS:
        a, b = totals[(None, m)], totals[("onednn", m)]
        ar_a, ar_b = totals[(None, METHODS[0])], totals[("onednn", METHODS[0])]
        print(f"{m[0]} K={m[1]}: mkl {a[0] / a[1]:.2f} tok/s (BE {a[0] / a[2]:.2f}, "
              f"{a[0] / a[1] / (ar_a[0] / ar_a[1]):.2f}x its ar), "
              f"onednn {b[0] / b[1]:.2f} tok/s (BE {b[0] / b[2]:.2f}, "
              f"{b[0] / b[1] / (ar_b[0] / ar_b[1]):.2f}x its ar); onednn/mkl {b[0] / b[1] / (a[0] / a[1]):.2f}; "
              f"same tokens {a[3] == b[3]}", flush=True)

    batch = {k: [0, 0.0] for k in pairs}
    for k in (None, "onednn", "onednn", None):
        engine = SpeculativeEngine(*pairs[k], "gbv", 3, 4, Sampling(1.0))
        start = time.perf_counter()
        records = engine.generate_batch(prompts, args.tokens, [torch.Generator().manual_seed(i) for i in range(8)])
        wall = time.perf_counter() - start
        n = sum(r.new_tokens for r in records)
        batch[k][0] += n
        batch[k][1] += wall
        print(f"B=8 {NAMES[k]:7s}: {n} tokens in {wall:6.2f} s, {n / wall:.2f} tok/s", flush=True)
    mkl, onednn = batch[None][0] / batch[None][1], batch["onednn"][0] / batch["onednn"][1]
    print(f"B=8 gbv K=3: mkl {mkl:.2f} tok/s, onednn {onednn:.2f} tok/s, ratio {onednn / mkl:.2f}")


def matmul(args):
    torch.manual_seed(0)
    weight = torch.randn(8960, 1536)
    plain = weight.to_mkldnn()
    reordered = torch.ops.mkldnn._reorder_linear_weight(weight, None)

    def best_ms(f, n=20):
        f()
        f()
        best = 1e9
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(n):
                f()
            best = min(best, (time.perf_counter() - start) / n)
        return best * 1e3

    print("M rows | F.linear (MKL sgemm) | mkldnn_linear, plain oneDNN weight | _linear_pointwise, reordered once "
          "| max |difference|")
    for M in (1, 5, 13, 40, 104):
        x = torch.randn(M, 1536)
        pointwise = lambda: torch.ops.mkldnn._linear_pointwise(x, reordered, None, "none", [None], "")  # noqa: E731
        times = [best_ms(lambda: F.linear(x, weight)),
                 best_ms(lambda: torch._C._nn.mkldnn_linear(x.to_mkldnn(), plain, None).to_dense()), best_ms(pointwise)]
        print(M, " ".join(f"{t:.2f}" for t in times), (pointwise() - F.linear(x, weight)).abs().max().item())


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["engine", "matmul"], default="engine")
    parser.add_argument("--tiny", action="store_true", help="tiny random models: a smoke test in seconds")
    parser.add_argument("--tokens", type=int, default=32, help="new tokens per prompt")
    args = parser.parse_args(argv)
    (engine_ab if args.part == "engine" else matmul)(args)


if __name__ == "__main__":
    main()

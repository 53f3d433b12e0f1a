"""A/B behind drafter_int8_dynamic_ab.txt: the float32 target on oneDNN with three 0.5B drafters loaded in one
process: float32 on oneDNN; every linear layer in int8 weights and int8 activations scaled per position at run time
(fbgemm's dynamic linear, `Dyn` below, the layer that became drafter.quantize=int8_dynamic); the same with down_proj
left on oneDNN float32.

part `engine` (default): ar and gbv K=1/2/3 L=4 T=1 prompt by prompt in turn (B=1), then gbv K=3 at B=8 beside ar,
there and back. part `variants`: for six choices of the layers in int8, the drafter's mean total variation against
torch's own float32 drafter over the last 16 positions of four prompts, and its bare 1- and 3-position steps.

    PYTHONPATH=src python docs/bench/amd-epyc-avx2/drafter_int8_dynamic_ab.py [--part variants] [--tiny]
"""
import argparse
import time
import warnings

import torch

from spectr_gbv.decoding.costs import forward_seconds
from spectr_gbv.decoding.precision import machine
from spectr_gbv.decoding.engine import SpeculativeEngine
from spectr_gbv.decoding.gguf_packages import packaged
from spectr_gbv.decoding.linear import OneDNNLinear
from spectr_gbv.decoding.tiny import tiny
from spectr_gbv.decoding.sampling import Sampling
from spectr_gbv.tools.bench_engine import PROMPTS


class Dyn(torch.nn.Module):
    """int8 weights (one scale per output channel) and int8 activations, each position scaled by its own largest
    magnitude; the appended row spanning [-1, 1] fixes the kernel's one input range to that."""

    def __init__(self, linear, reduce_range):
        super().__init__()
        w = linear.weight.detach().float()
        scales = (w.abs().amax(1) / 127).clamp_min(torch.finfo(torch.float32).tiny).double()
        qw = torch.quantize_per_channel(w, scales, torch.zeros(len(scales), dtype=torch.long), 0, torch.qint8)
        self.packed = torch.ops.quantized.linear_prepack(qw, None)
        self.register_buffer("weight", qw.int_repr())
        self.bias, self.rr = linear.bias, reduce_range

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        m = flat.abs().amax(-1, keepdim=True).clamp_min(1e-30)
        fix = flat.new_zeros(1, flat.shape[1])
        fix[0, 0], fix[0, 1] = 1, -1
        y = torch.ops.quantized.linear_dynamic(torch.cat([flat / m, fix]), self.packed, self.rr)[:-1] * m
        y = y.view(*x.shape[:-1], -1)
        return y if self.bias is None else y + self.bias


def swap(model, pick):
    """Replace every nn.Linear by pick(its attribute name, it)."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, torch.nn.Linear):
                setattr(module, name, pick(name, child))
    return model


def load(args, target=False, **settings):
    if args.tiny:
        return tiny(seed=0, perturb=0.0 if target else 0.2, **settings)
    return packaged("qwen2.5-coder-1.5b-instruct" if target else "qwen2.5-coder-0.5b-instruct", **settings)


def engine_ab(args):
    print("machine:", machine("float32"), ", linear layers on onednn", flush=True)
    target = load(args, True, dtype="float32", linear_kernel="onednn")
    drafters = {"fp32-onednn": load(args, dtype="float32", linear_kernel="onednn")}
    drafters["dyn8-all"] = load(args, dtype="float32")
    swap(drafters["dyn8-all"].model, lambda n, c: Dyn(c, True))
    drafters["dyn8-but-down"] = load(args, dtype="float32")
    swap(drafters["dyn8-but-down"].model, lambda n, c: OneDNNLinear(c) if n == "down_proj" else Dyn(c, True))
    prompts = [target.encode_prompt(t) for t in PROMPTS[:args.batch]]
    for model in (target, *drafters.values()):  # page the memory-mapped embeddings in before timing anything
        model.model.get_input_embeddings().weight.sum()
    drafters_ab(target, drafters, prompts, args)


def drafters_ab(target, drafters, prompts, args):
    """ar and gbv K=1/2/3 L=4 T=1 with each drafter, prompt by prompt in turn (B=1), then gbv K=3 and ar at B=8,
    there and back (also run by drafter_int8_ab.py)."""
    engines = {"ar": SpeculativeEngine(target, None, "ar", sampling=Sampling(1.0))}
    for name, drafter in drafters.items():
        for K in (1, 2, 3):
            engines[f"gbv K={K} {name}"] = SpeculativeEngine(target, drafter, "gbv", K, 4, Sampling(1.0))
    for engine in engines.values():  # warm-up
        engine.generate_batch(prompts[:2], 2, [torch.Generator().manual_seed(i) for i in range(2)])
    totals = {}
    for i, prompt in enumerate(prompts[:args.prompts]):
        for name, engine in engines.items():
            record = engine.generate(prompt, args.tokens, torch.Generator().manual_seed(i))
            tokens, wall, calls, draft = totals.get(name, (0, 0.0, 0, 0.0))
            totals[name] = (tokens + record.new_tokens, wall + record.total_time, calls + record.target_calls,
                            draft + record.draft_time)
            print(f"prompt {i} {name}: {record.new_tokens / record.total_time:.2f} tok/s, "
                  f"block eff. {record.new_tokens / record.target_calls:.2f}", flush=True)
    ar_rate = totals["ar"][0] / totals["ar"][1]
    for name, (tokens, wall, calls, draft) in totals.items():
        print(f"B=1 {name}: {tokens / wall:.2f} tok/s, {tokens / wall / ar_rate:.2f}x ar, "
              f"block eff. {tokens / calls:.2f}, draft s per call {draft / calls:.3f}", flush=True)
    batch = {"ar": engines["ar"], **{f"gbv K=3 {name}": engines[f"gbv K=3 {name}"] for name in drafters}}
    results = {}
    for rnd, order in enumerate((list(batch), list(batch)[::-1])):
        for name in order:
            start = time.perf_counter()
            generators = [torch.Generator().manual_seed(i) for i in range(len(prompts))]
            records = batch[name].generate_batch(prompts, args.tokens, generators)
            wall = time.perf_counter() - start
            tokens = sum(r.new_tokens for r in records)
            results.setdefault(name, []).append((tokens, wall))
            print(f"round {rnd} B={len(prompts)} {name}: {tokens / wall:.2f} tok/s", flush=True)
    ar_batch = sum(t for t, _ in results["ar"]) / sum(w for _, w in results["ar"])
    for name, runs in results.items():
        rate = sum(t for t, _ in runs) / sum(w for _, w in runs)
        print(f"B={len(prompts)} {name}: {rate:.2f} tok/s, {rate / ar_batch:.2f}x ar at B={len(prompts)}", flush=True)


def variants(args):
    mlp_head = ("gate_proj", "up_proj", "down_proj", "lm_head")
    choices = {
        "all rr": lambda n, c: Dyn(c, True),
        "all no-rr": lambda n, c: Dyn(c, False),
        "all but down rr": lambda n, c: OneDNNLinear(c) if n == "down_proj" else Dyn(c, True),
        "mlp+head rr": lambda n, c: Dyn(c, True) if n in mlp_head else OneDNNLinear(c),
        "gate/up+head rr": lambda n, c: Dyn(c, True) if n in ("gate_proj", "up_proj", "lm_head") else OneDNNLinear(c),
        "head only rr": lambda n, c: Dyn(c, True) if n == "lm_head" else OneDNNLinear(c),
    }
    ref = load(args, dtype="float32")
    context = ref.encode_prompt(PROMPTS[0])
    ids = [torch.tensor([ref.encode_prompt(t)]) for t in PROMPTS[:4]]
    with torch.inference_mode():
        laws = [ref.model(i).logits[0, -16:].double().softmax(-1) for i in ids]
    for name, pick in choices.items():
        model = swap(load(args, dtype="float32").model, pick)
        model.get_input_embeddings().weight.sum()
        with torch.inference_mode():
            tv = [0.5 * (p - model(i).logits[0, -16:].double().softmax(-1)).abs().sum(-1).mean().item()
                  for p, i in zip(laws, ids)]
        one, three = forward_seconds(model, context, 1, 5), forward_seconds(model, context, 3, 5)
        print(f"{name:18s} TV {' '.join(f'{t:.3f}' for t in tv)}  1 pos {one * 1e3:.0f} ms  3 pos {three * 1e3:.0f} ms",
              flush=True)


def arguments(description: str, parts: list[str], argv=None):
    """The flags of the drafter A/B scripts (this one and drafter_int8_ab.py)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--part", choices=parts, default=parts[0])
    parser.add_argument("--tiny", action="store_true", help="tiny random models: a smoke test in seconds")
    parser.add_argument("--prompts", type=int, default=4, help="prompts decoded one at a time (B=1)")
    parser.add_argument("--batch", type=int, default=8, help="prompts of the batch part")
    parser.add_argument("--tokens", type=int, default=32, help="new tokens per prompt")
    return parser.parse_args(argv)


def main(argv=None):
    args = arguments(__doc__.splitlines()[0], ["engine", "variants"], argv)
    warnings.simplefilter("ignore")
    torch.backends.quantized.engine = "fbgemm"
    (engine_ab if args.part == "engine" else variants)(args)


if __name__ == "__main__":
    main()

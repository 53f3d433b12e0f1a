"""A/B behind drafter_int8_ab.txt: the float32 target on oneDNN with two 0.5B drafters loaded in one process, float32
on oneDNN and int8 weights with bfloat16 activations (drafter.dtype=bfloat16 drafter.quantize=int8).

part `engine` (default): ar and gbv K=1/2/3 L=4 T=1, prompt by prompt in turn (B=1), then gbv K=3 and ar at B=8,
there and back. part `steps`: bare drafter steps of the float32, int8-with-float32-activations and int8-with-bfloat16-
activations drafters, interleaved.

    PYTHONPATH=src python docs/bench/amd-epyc-avx2/drafter_int8_ab.py [--part steps] [--tiny]
"""
import time

import torch

from spectr_gbv.decoding.precision import machine
from spectr_gbv.decoding.gguf_packages import packaged
from spectr_gbv.decoding.tiny import tiny
from spectr_gbv.tools.bench_engine import PROMPTS, load_pair

from drafter_int8_dynamic_ab import arguments, drafters_ab  # the same engine A/B loop, beside this script

DRAFTER = "qwen2.5-coder-0.5b-instruct"


def engine_ab(args):
    print("machine:", machine("float32"), ", linear layers on onednn", flush=True)
    onednn = {"dtype": "float32", "linear_kernel": "onednn"}
    target, fp32 = load_pair(args.tiny, onednn, {"dtype": "float32", "quantize": None, "linear_kernel": "onednn"})
    _, int8 = load_pair(args.tiny, onednn, {"dtype": "bfloat16", "quantize": "int8", "linear_kernel": None})
    del _  # the target loaded twice: dropped at once
    prompts = [target.encode_prompt(t) for t in PROMPTS[:args.batch]]
    for model in (target, fp32, int8):  # page the memory-mapped embeddings in before timing anything
        model.model.get_input_embeddings().weight.sum()
    drafters = {"fp32-onednn": fp32, "int8-bf16": int8}
    drafters_ab(target, drafters, prompts, args)


def steps(args):
    """Median of the last 5 of 6 one-position steps per row over a cache of 41 random tokens."""
    torch.manual_seed(0)
    settings = {"fp32 onednn": {"dtype": "float32", "linear_kernel": "onednn"},
                "int8 fp32-act": {"dtype": "float32", "quantize": "int8"},
                "int8 bf16-act": {"dtype": "bfloat16", "quantize": "int8"}}
    variants = {name: tiny(seed=0, perturb=0.2, **kw) if args.tiny else packaged(DRAFTER, **kw)
                for name, kw in settings.items()}
    vocab = min(30000, variants["fp32 onednn"].model.config.vocab_size)
    prompt = torch.randint(0, vocab, (1, 41))

    @torch.no_grad()
    def step_ms(model, rows):
        cache = model(prompt.expand(rows, -1), use_cache=True).past_key_values
        new = torch.randint(0, vocab, (rows, 1))
        seconds = []
        for _ in range(6):
            start = time.perf_counter()
            model(new, cache=cache, use_cache=True)
            seconds.append(time.perf_counter() - start)
            cache.crop(-1)
        return sorted(seconds[1:])[2] * 1e3

    for rnd in range(2):
        for rows in (1, 3):
            for name, loaded in variants.items():
                print(f"round {rnd} rows {rows} {name}: {step_ms(loaded.model, rows):.1f} ms", flush=True)


def main(argv=None):
    args = arguments(__doc__.splitlines()[0], ["engine", "steps"], argv)
    (engine_ab if args.part == "engine" else steps)(args)


if __name__ == "__main__":
    main()

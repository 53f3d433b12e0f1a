"""Engine benchmark: `python -m spectr_gbv.bench_engine [--tiny]` (part of `make bench`).

Side by side in one run, on the same prompts, on the Qwen2.5-Coder pair in bfloat16 (or tiny random models):
  - greedy (T = 0), where every method emits the same tokens: transformers' generate() vs the engine's `ar`, and
    transformers' assisted generation (same drafter, L drafted tokens per call) vs `token` with K = 1;
  - sampling (T = 1): `ar`, `token` K = 1 and `gbv` K = 1..4 (drafter at T = 1 too).
Speedups are ratios to `ar` at the same temperature, measured in this run. Target calls of transformers' runs are
counted with a forward hook, so their block efficiency is measured the same way as the engine's.
"""
import argparse
import time
from dataclasses import dataclass

import torch
from rich.console import Console
from rich.table import Table
from transformers import GenerationConfig

from spectr_gbv.engine import DecodeRecord, SpeculativeEngine
from spectr_gbv.models import LoadedModel, packaged, tiny
from spectr_gbv.sampling import Sampling

PROMPTS = [
    "Write a Python function that checks whether a number is prime.",
    "Explain what a hash map is and give a short example in Python.",
    "Write a SQL query that returns the ten most recent orders with their customer names.",
]


@dataclass
class Row:
    method: str
    temperature: float
    records: list[DecodeRecord]

    def total(self, key: str) -> float:
        return sum(getattr(record, key) for record in self.records)

    @property
    def tokens_per_second(self) -> float:
        return self.total("new_tokens") / self.total("total_time")

    @property
    def block_efficiency(self) -> float:
        return self.total("new_tokens") / self.total("target_calls")


def load_pair(use_tiny: bool) -> tuple[LoadedModel, LoadedModel]:
    if use_tiny:
        return tiny(seed=0), tiny(seed=0, perturb=0.2)
    return packaged("qwen2.5-coder-1.5b-instruct"), packaged("qwen2.5-coder-0.5b-instruct")


def encode(target: LoadedModel, text: str) -> list[int]:
    if target.tokenizer.chat_template is None:  # the tiny byte-level tokenizer
        return target.tokenizer(text, add_special_tokens=False).input_ids
    messages = [{"role": "user", "content": text}]
    return target.tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]


def engine_method(target, drafter, verifier, max_new_tokens, temperature, num_drafts=1, block_length=4):
    """prompt -> DecodeRecord, one generator for the method's whole run."""
    engine = SpeculativeEngine(target, None if verifier == "ar" else drafter, verifier, num_drafts, block_length,
                               Sampling(temperature))
    generator = torch.Generator().manual_seed(0)
    return lambda prompt: engine.generate(prompt, max_new_tokens, generator)


def transformers_method(target, max_new_tokens, assistant=None, block_length=4):
    """prompt -> DecodeRecord by greedy generate(), or assisted generation drafting block_length tokens per call."""
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False,
                              eos_token_id=sorted(SpeculativeEngine(target, None, "ar").eos_ids),
                              pad_token_id=target.tokenizer.pad_token_id)
    if assistant is not None:  # a fixed draft length: no heuristic schedule, no early stop on low confidence
        assistant.model.generation_config.num_assistant_tokens = block_length
        assistant.model.generation_config.num_assistant_tokens_schedule = "constant"
        assistant.model.generation_config.assistant_confidence_threshold = 0.0

    def decode(prompt: list[int]) -> DecodeRecord:
        calls = []  # target forward passes, counted by a hook: block efficiency measured as the engine's
        hook = target.model.register_forward_hook(lambda *_: calls.append(1))
        try:
            start = time.perf_counter()
            output = target.model.generate(torch.tensor([prompt], device=target.model.device), generation_config=config,
                                           assistant_model=None if assistant is None else assistant.model)
            elapsed = time.perf_counter() - start
        finally:
            hook.remove()
        new = output[0, len(prompt):].tolist()
        return DecodeRecord(output_ids=new, new_tokens=len(new), target_calls=len(calls), total_time=elapsed)

    return decode


def benchmark(target, drafter, prompts, max_new_tokens, block_length, max_drafts, console) -> list[Row]:
    L, n = block_length, max_new_tokens
    methods = [
        ("transformers generate()", 0.0, transformers_method(target, n)),
        ("ar", 0.0, engine_method(target, drafter, "ar", n, 0.0)),
        (f"transformers assisted, L={L}", 0.0, transformers_method(target, n, drafter, L)),
        (f"token K=1 L={L}", 0.0, engine_method(target, drafter, "token", n, 0.0, 1, L)),
        ("ar", 1.0, engine_method(target, drafter, "ar", n, 1.0)),
        (f"token K=1 L={L}", 1.0, engine_method(target, drafter, "token", n, 1.0, 1, L)),
    ] + [(f"gbv K={K} L={L}", 1.0, engine_method(target, drafter, "gbv", n, 1.0, K, L))
         for K in range(1, max_drafts + 1)]
    rows = [Row(method, temperature, []) for method, temperature, _ in methods]
    # Prompt by prompt, every method in turn: a busy spell of other processes on the machine then slows all
    # methods alike instead of the few that happened to run during it.
    for i, prompt in enumerate(prompts):
        for row, (_, _, decode) in zip(rows, methods):
            row.records.append(decode(prompt))
            console.log(f"prompt {i + 1}/{len(prompts)}, {row.method} at T={row.temperature:g}: "
                        f"{row.records[-1].new_tokens / row.records[-1].total_time:.2f} tokens/s")
    return rows


def report(rows: list[Row], title: str, console: Console) -> None:
    baseline = {row.temperature: row for row in rows if row.method == "ar"}
    table = Table(title=title)
    for column in ["method", "T", "tokens", "tok/s", "speedup vs ar", "block eff.", "s/target call", "draft s",
                   "target s", "verify s", "total s"]:
        table.add_column(column, justify="left" if column == "method" else "right")
    for row in rows:
        speedup = row.tokens_per_second / baseline[row.temperature].tokens_per_second
        split = ["-"] * 3 if row.method.startswith("transformers") else [
            f"{row.total(key):.2f}" for key in ("draft_time", "target_time", "verify_time")]
        table.add_row(row.method, f"{row.temperature:g}", str(int(row.total("new_tokens"))),
                      f"{row.tokens_per_second:.2f}", f"{speedup:.2f}x", f"{row.block_efficiency:.2f}",
                      f"{row.total('total_time') / row.total('target_calls'):.3f}", *split,
                      f"{row.total('total_time'):.2f}")
    console.print(table)
    generate, ar, assisted, token = rows[:4]
    console.print(f"ar / generate() tokens/s: {ar.tokens_per_second / generate.tokens_per_second:.2f} "
                  f"(same tokens: {same_outputs(ar, generate)}); token K=1 / assisted tokens/s: "
                  f"{token.tokens_per_second / assisted.tokens_per_second:.2f} (block efficiency "
                  f"{token.block_efficiency:.2f} vs {assisted.block_efficiency:.2f}; same tokens: "
                  f"{same_outputs(token, assisted)}, as ar: {same_outputs(token, ar)})")


def same_outputs(a: Row, b: Row) -> bool:
    """Greedy outputs agree exactly in float32/float64; in bfloat16 a pass over L+1 positions rounds differently
    from a pass over one, so a near-tie can flip and the texts part."""
    return [r.output_ids for r in a.records] == [r.output_ids for r in b.records]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny random models (seconds, for smoke tests)")
    parser.add_argument("--prompts", type=int, default=2, choices=range(1, len(PROMPTS) + 1))
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--block-length", type=int, default=4)
    parser.add_argument("--max-drafts", type=int, default=4)
    args = parser.parse_args(argv)
    for key in ("max_new_tokens", "block_length", "max_drafts"):
        if getattr(args, key) < 1:
            parser.error(f"--{key.replace('_', '-')}={getattr(args, key)} is not allowed: must be >= 1")
    if args.tiny:  # tiny models are all per-op overhead: a second thread only adds synchronisation
        torch.set_num_threads(1)
    target, drafter = load_pair(args.tiny)
    prompts = [encode(target, text) for text in PROMPTS[:args.prompts]]
    engine_method(target, drafter, "token", 2, 0.0)(prompts[0])  # warm-up: first calls pay one-time costs
    transformers_method(target, 2, drafter)(prompts[0])
    console = Console(width=150)  # a wide table, also when piped to a file
    rows = benchmark(target, drafter, prompts, args.max_new_tokens, args.block_length, args.max_drafts, console)
    report(rows, f"{target.name} <- {drafter.name}, {len(prompts)} prompts x {args.max_new_tokens} new tokens, "
                 f"{torch.get_num_threads()} threads", console)


if __name__ == "__main__":
    main()

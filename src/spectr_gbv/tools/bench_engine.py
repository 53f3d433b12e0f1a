"""Engine benchmark: `python -m spectr_gbv.tools.bench_engine [--tiny] [--dtype float32]` (part of `make bench`).

Where the time goes, and how far from the limit, side by side in one run on the Qwen2.5-Coder pair (or tiny random
models), after one line naming the machine (CPU, its bf16 matrix units, threads, torch, dtype):
  - greedy (T = 0), where every method emits the same tokens: transformers' generate() vs the engine's `ar`, and
    transformers' assisted generation (same drafter, L drafted tokens per call) vs `token` with K = 1;
  - sampling (T = 1): `ar` and `gbv` K = 1..max_drafts, each against the cost-model limit of its speedup
    (decoding/costs.py), with the bare passes in one row over a KV cache holding the first prompt, timed in this run;
  - batch throughput: `gbv` K = 3 at T = 1 on N prompts (16 by default), at most B per pass, B = 1, 2, 4, 8 (those
    <= N), before and after continuous batching: "chunks" decodes B prompts at a time (rows leave as they finish, so
    the pass empties), "refill" decodes all N with B slots (a waiting prompt takes a finished row's place). Each
    against the ratio to B = 1 that bare passes over the rows each pass held allow, and against `ar` at the same B
    and mode; every B and mode runs twice, there and back.
Speedups are ratios to `ar` at the same temperature, measured in this run. Methods run prompt by prompt, in turn, so
noise from other processes hits all alike. Prompt i always draws from a generator seeded i. Every method's forward
passes of each model are counted and timed by forward hooks, the same clock for the engine and transformers: their
block efficiencies are measured alike, and the greedy part shows what each spends per target call inside the models'
forwards and outside them.
"""
import argparse
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from rich.console import Console
from rich.table import Table
from transformers import GenerationConfig

from spectr_gbv.decoding.costs import BareCosts
from spectr_gbv.decoding.engine import DecodeRecord, SpeculativeEngine
from spectr_gbv.decoding.gguf_packages import DEFAULT_PAIR, packaged
from spectr_gbv.decoding.linear import LINEAR_KERNELS, QUANTIZE, check_linear_layers
from spectr_gbv.decoding.models import LoadedModel
from spectr_gbv.decoding.precision import DTYPES, machine
from spectr_gbv.decoding.sampling import Sampling
from spectr_gbv.decoding.tiny import tiny
from spectr_gbv.errors import ConfigError

PROMPTS = [
    "Write a Python function that checks whether a number is prime.",
    "Explain what a hash map is and give a short example in Python.",
    "Write a SQL query that returns the ten most recent orders with their customer names.",
    "Why is the sky blue? Answer in two sentences.",
    "Write a bash one-liner that counts the lines of every .py file in a folder.",
    "What is the difference between a process and a thread?",
    "Write a JavaScript function that reverses a string.",
    "Give three tips for writing readable code.",
    "Write a Python class for a stack with push, pop and peek.",
    "What does the HTTP status code 404 mean?",
    "Write a Python function that merges two sorted lists.",
    "Explain recursion to a beginner in three sentences.",
    "Write a regular expression that matches an email address, and explain it.",
    "What are the advantages of unit tests?",
    "Write a C function that returns the length of a string.",
    "Summarise what git rebase does.",
]
BATCH_DRAFTS = 3  # K of the batch part: several drafts, so each row's trie is a real tree
BATCH_SIZES = (1, 2, 4, 8)
WIDTH = 180  # of the console: wide tables, also when piped to a file


# --- methods: prompt, seed -> DecodeRecord ---------------------------------------------------------------------------

class Totals:
    """Sums over a run's records (`self.records`), and what the tables derive from them."""
    records: list[DecodeRecord]

    def total(self, key: str) -> float:
        return sum(getattr(record, key) for record in self.records)

    @property
    def block_efficiency(self) -> float:
        return self.total("new_tokens") / self.total("target_calls")

    @property
    def decode_calls(self) -> float:
        """Target calls after the prefills: every prompt's first call reads it (and emits its first tokens)."""
        return self.total("target_calls") - len(self.records)

    @property
    def decode_tokens(self) -> float:
        """Tokens emitted after the prefills."""
        return self.total("new_tokens") - self.total("prefill_tokens")

    @property
    def trie_positions(self) -> int:
        """Positions of the mean target pass besides the prompt (1 + distinct trie nodes), rounded."""
        return max(1, round(self.total("target_positions") / self.total("target_calls")))


@dataclass
class Row(Totals):
    method: str
    temperature: float
    records: list[DecodeRecord]
    num_drafts: int = 0  # 0: not a gbv row, no cost-model limit
    passes: Counter = field(default_factory=Counter)  # forward passes of "target" and "drafter", over all records
    pass_seconds: Counter = field(default_factory=Counter)  # and the seconds spent inside them

    def per_call_ms(self, key: str) -> float:
        return 1e3 * self.total(key) / self.total("target_calls")

    def pass_ms_per_call(self, model: str) -> float:
        return 1e3 * self.pass_seconds[model] / self.total("target_calls")

    @property
    def tokens_per_second(self) -> float:
        return self.total("new_tokens") / self.total("total_time")

    @property
    def decode_tokens_per_second(self) -> float:
        """Tokens/s after the prefill (the first iteration, or `ar`'s first call, and the tokens it emits)."""
        return self.decode_tokens / (self.total("total_time") - self.total("prefill_time"))


def load_pair(use_tiny: bool, target_settings: dict, drafter_settings: dict) -> tuple[LoadedModel, LoadedModel]:
    """The pair, each model loaded with its settings (dtype, quantize, linear_kernel)."""
    if use_tiny:
        return tiny(seed=0, **target_settings), tiny(seed=0, perturb=0.2, **drafter_settings)
    target, drafter = DEFAULT_PAIR
    return packaged(target, **target_settings), packaged(drafter, **drafter_settings)


def pair_settings(args: argparse.Namespace) -> tuple[dict, dict]:
    """The models' settings from the flags: the linear kernel goes to each model it can run (float32, not int8)."""
    drafter_dtype = args.drafter_dtype or args.dtype
    drafter_kernel = args.linear_kernel if drafter_dtype == "float32" and not args.drafter_quantize else None
    return ({"dtype": args.dtype, "linear_kernel": args.linear_kernel},
            {"dtype": drafter_dtype, "quantize": args.drafter_quantize, "linear_kernel": drafter_kernel})


def describe_pair(target: dict, drafter: dict) -> str:
    """What follows the machine's dtype in the header: the target's linear kernel, then the drafter's settings
    where they differ from the target's (e.g. ", linear layers on onednn, drafter bfloat16 int8")."""
    kernel = f", linear layers on {target['linear_kernel']}" if target["linear_kernel"] else ""
    differs = [part for part in (drafter["dtype"] if drafter["dtype"] != target["dtype"] else None,
                                 drafter["quantize"]) if part]
    return kernel + (f", drafter {' '.join(differs)}" if differs else "")


def engine_method(target, drafter, verifier, max_new_tokens, temperature, num_drafts=1, block_length=4):
    engine = SpeculativeEngine(target, None if verifier == "ar" else drafter, verifier, num_drafts, block_length,
                               Sampling(temperature))
    return lambda prompt, seed: engine.generate(prompt, max_new_tokens, torch.Generator().manual_seed(seed))


@contextmanager
def clocked(models: dict[str, torch.nn.Module], passes: Counter, seconds: Counter) -> Iterator[None]:
    """Within it, every forward pass of each model is counted into passes[name] and timed into seconds[name]."""
    started = {}

    def start(name):
        return lambda *_: started.__setitem__(name, time.perf_counter())

    def stop(name):
        def add(*_):
            passes[name] += 1
            seconds[name] += time.perf_counter() - started[name]
        return add

    hooks = [hook for name, model in models.items() for hook in (model.register_forward_pre_hook(start(name)),
                                                                  model.register_forward_hook(stop(name)))]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()


def transformers_method(target, max_new_tokens, assistant=None, block_length=4):
    """Greedy generate(), or assisted generation drafting block_length tokens per call."""
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False,
                              eos_token_id=sorted(SpeculativeEngine(target, None, "ar").eos_ids),
                              pad_token_id=target.tokenizer.pad_token_id)
    if assistant is not None:  # a fixed draft length: no heuristic schedule, no early stop on low confidence
        assistant.model.generation_config.num_assistant_tokens = block_length
        assistant.model.generation_config.num_assistant_tokens_schedule = "constant"
        assistant.model.generation_config.assistant_confidence_threshold = 0.0

    def decode(prompt: list[int], seed: int) -> DecodeRecord:
        calls = Counter()  # target forward passes: block efficiency measured as the engine's
        with clocked({"target": target.model}, calls, Counter()):
            start = time.perf_counter()
            output = target.model.generate(torch.tensor([prompt], device=target.model.device), generation_config=config,
                                           assistant_model=None if assistant is None else assistant.model)
            elapsed = time.perf_counter() - start
        new = output[0, len(prompt):].tolist()
        return DecodeRecord(output_ids=new, new_tokens=len(new), target_calls=calls["target"], total_time=elapsed)

    return decode


def benchmark(target, drafter, prompts, max_new_tokens, block_length, max_drafts, console) -> list[Row]:
    L, n = block_length, max_new_tokens
    methods = [
        (Row("transformers generate()", 0.0, []), transformers_method(target, n)),
        (Row("ar", 0.0, []), engine_method(target, drafter, "ar", n, 0.0)),
        (Row(f"transformers assisted, L={L}", 0.0, []), transformers_method(target, n, drafter, L)),
        (Row(f"token K=1 L={L}", 0.0, []), engine_method(target, drafter, "token", n, 0.0, 1, L)),
        (Row("ar", 1.0, []), engine_method(target, drafter, "ar", n, 1.0)),
    ] + [(Row(f"gbv K={K} L={L}", 1.0, [], K), engine_method(target, drafter, "gbv", n, 1.0, K, L))
         for K in range(1, max_drafts + 1)]
    # Prompt by prompt, every method in turn: a busy spell of other processes on the machine then slows all
    # methods alike instead of the few that happened to run during it.
    models = {"target": target.model, "drafter": drafter.model}
    for i, prompt in enumerate(prompts):
        for row, decode in methods:
            with clocked(models, row.passes, row.pass_seconds):
                row.records.append(decode(prompt, i))
            console.log(f"prompt {i + 1}/{len(prompts)}, {row.method} at T={row.temperature:g}: "
                        f"{row.records[-1].new_tokens / row.records[-1].total_time:.2f} tokens/s")
    return [row for row, _ in methods]


def same_outputs(a: list[DecodeRecord], b: list[DecodeRecord]) -> bool:
    """Outputs of the same draws agree in float32/float64; in bfloat16 a pass over more positions or rows rounds
    differently from a pass over fewer, so a near-tie can flip and the texts part."""
    return [r.output_ids for r in a] == [r.output_ids for r in b]


def yes(flag: bool) -> str:
    return "yes" if flag else "no"


# --- the cost model ------------------------------------------------------------------------------------------------

def limit(costs: BareCosts, row: Row, block_length: int) -> float:
    """The speedup over `ar` if each iteration cost only its bare passes (the target over the trie size the run
    actually scored, on average) and `ar` only its bare step."""
    if row.num_drafts == 0:
        return 1.0
    return costs.limit(row.block_efficiency, row.trie_positions, row.num_drafts, block_length)


# --- batch throughput ----------------------------------------------------------------------------------------------

MODES = ("chunks", "refill")  # generate_batch on B prompts at a time (rows leave, the pass empties), or one decode
# over all prompts with slots=B (a waiting prompt takes a finished row's place: continuous batching)


@dataclass
class BatchRun(Totals):
    mode: str
    batch_size: int
    records: list[DecodeRecord]
    rows: list[int]  # the rows of every target pass (gbv runs: counted by the engine's iteration hook)
    wall: float

    def count_pass(self, indices: list[int], *_) -> None:
        """The engine's on_iteration: one target pass over these rows."""
        self.rows.append(len(indices))

    @property
    def tokens_per_second(self) -> float:
        return self.total("new_tokens") / self.wall

    @property
    def decode_tokens_per_second(self) -> float:
        """Tokens/s after the prefills (each prompt's first iteration and the tokens it emits)."""
        return self.decode_tokens / (self.wall - self.total("prefill_time"))

    def bare_tokens_per_second(self, costs: BareCosts, block_length: int) -> float:
        """Tokens/s if every pass cost only its bare forwards over the rows it held (at the run's mean trie size)."""
        seconds = sum(costs.iteration(self.trie_positions, BATCH_DRAFTS, block_length, rows) for rows in self.rows)
        return self.total("new_tokens") / seconds


def batch_throughput(target, drafter, prompts, max_new_tokens, block_length, batch_sizes,
                     console) -> tuple[list[BatchRun], list[BatchRun]]:
    """All prompts at each B of batch_sizes (1 first: every ratio is to it; those <= N) in each mode, with `gbv`
    K=3 and with `ar` (does speculation still pay when batching alone fills the passes?), prompt i always with the
    generator seeded i: the same draws at every B and in both modes, so outputs differ only by rounding (padding
    changes the shapes of the matmuls). B = 1 runs in chunks only: refilling one slot is the same decode. Each
    (B, mode) runs twice, in the order there and back (1, 2 chunks, 2 refill, ..., 8 refill, 8 refill, 8 chunks, ...,
    1), the two methods in turn: a steady drift of the machine's speed over the part then weighs on every B, mode and
    method alike (B = 1 alone takes minutes, and its speed moved by a third between runs on one machine). Returns
    the gbv runs and the ar runs, in that order."""
    engines = {"gbv": SpeculativeEngine(target, drafter, "gbv", BATCH_DRAFTS, block_length, Sampling(1.0)),
               "ar": SpeculativeEngine(target, None, "ar", sampling=Sampling(1.0))}
    settings = [(mode, B) for B in batch_sizes if B <= len(prompts) for mode in MODES if B > 1 or mode == "chunks"]
    runs = {(name, *setting): BatchRun(*setting, [], [], 0.0) for name in engines for setting in settings}
    for mode, B in settings + settings[::-1]:
        for name, engine in engines.items():
            run = runs[name, mode, B]
            chunk_size = B if mode == "chunks" else len(prompts)
            start = time.perf_counter()
            for first in range(0, len(prompts), chunk_size):
                chunk = range(first, min(first + chunk_size, len(prompts)))
                run.records += engine.generate_batch([prompts[i] for i in chunk], max_new_tokens,
                                                     [torch.Generator().manual_seed(i) for i in chunk],
                                                     on_iteration=run.count_pass, slots=B)
            run.wall += time.perf_counter() - start
            console.log(f"batch B={B} {mode}, {name}: {run.tokens_per_second:.2f} tokens/s so far")
    return [runs["gbv", *setting] for setting in settings], [runs["ar", *setting] for setting in settings]


# --- tables --------------------------------------------------------------------------------------------------------

def new_table(title: str, columns: list[str]) -> Table:
    """A table at least as wide as its title's lines, so the machine line in the title is not wrapped."""
    table = Table(title=title, title_justify="left", min_width=min(WIDTH, max(map(len, title.splitlines()))))
    for i, column in enumerate(columns):
        table.add_column(column, justify="left" if i == 0 else "right")
    return table


def report_greedy(rows: list[Row], title: str, console: Console) -> None:
    generate, ar, assisted, token = rows
    table = new_table(f"Greedy (T=0): the engine vs transformers; per target call, the models' forward passes (timed "
                      f"by hooks alike for all) and the time outside them\n{title}",
                      ["method", "tokens", "tok/s", "speedup vs ar", "block eff.", "ms/target call",
                       "target fwd ms", "drafter fwds", "drafter fwd ms", "outside ms", "total s"])
    for row in rows:
        calls = row.total("target_calls")
        inside = row.pass_ms_per_call("target") + row.pass_ms_per_call("drafter")
        table.add_row(row.method, str(int(row.total("new_tokens"))), f"{row.tokens_per_second:.2f}",
                      f"{row.tokens_per_second / ar.tokens_per_second:.2f}x", f"{row.block_efficiency:.2f}",
                      f"{row.per_call_ms('total_time'):.1f}", f"{row.pass_ms_per_call('target'):.1f}",
                      f"{row.passes['drafter'] / calls:.2f}", f"{row.pass_ms_per_call('drafter'):.1f}",
                      f"{row.per_call_ms('total_time') - inside:.1f}", f"{row.total('total_time'):.2f}")
    console.print(table)
    console.print(f"ar / generate() tokens/s: {ar.tokens_per_second / generate.tokens_per_second:.2f} "
                  f"(same tokens: {yes(same_outputs(ar.records, generate.records))}); token K=1 / assisted tokens/s: "
                  f"{token.tokens_per_second / assisted.tokens_per_second:.2f} (block efficiency "
                  f"{token.block_efficiency:.2f} vs {assisted.block_efficiency:.2f}; same tokens: "
                  f"{yes(same_outputs(token.records, assisted.records))}, "
                  f"as ar: {yes(same_outputs(token.records, ar.records))})")


def report_sampling(rows: list[Row], costs: BareCosts, block_length: int, title: str, console: Console) -> None:
    ar = rows[0]
    table = new_table(f"Sampling (T=1): speedup vs the cost-model limit\n{title}",
                      ["method", "tokens", "tok/s", "speedup vs ar", "after prefill", "block eff.", "trie pos.",
                       "limit", "share", "total s"])
    for row in rows:
        speedup = row.decode_tokens_per_second / ar.decode_tokens_per_second
        table.add_row(row.method, str(int(row.total("new_tokens"))), f"{row.tokens_per_second:.2f}",
                      f"{row.tokens_per_second / ar.tokens_per_second:.2f}x", f"{speedup:.2f}x",
                      f"{row.block_efficiency:.2f}", str(row.trie_positions),
                      f"{limit(costs, row, block_length):.2f}x", f"{speedup / limit(costs, row, block_length):.0%}",
                      f"{row.total('total_time'):.2f}")
    console.print(table)
    # The share is relative to ar, which has overheads of its own: say how far ar is from its bare step.
    console.print(f"Share: the speedup after the prefill over its limit. ar itself runs at "
                  f"{ar.decode_tokens_per_second * costs.target(1):.0%} of its bare limit 1 / t_ar = "
                  f"{1 / costs.target(1):.2f} tokens/s after the prefill")


def report_costs(rows: list[Row], costs: BareCosts, block_length: int, context_length: int, repeats: int,
                 title: str, console: Console) -> None:
    """Bare passes next to what the engine spends per iteration on each side after the prefill, so the gap between
    share and 100% can be pinned on the target side, the drafter or the rest."""
    L = block_length
    table = new_table(f"Bare forwards in one row over a cache of {context_length} prompt tokens (median of {repeats}; "
                      f"drafter: L={L} steps of K positions) vs the engine's ms per iteration at T=1 after the "
                      f"prefill\n{title}",
                      ["method", "target pos.", "target bare ms", "target engine ms", "draft pos.", "draft bare ms",
                       "draft engine ms", "verify ms", "other ms"])
    for row in rows:
        K = row.num_drafts
        calls = row.decode_calls
        engine = {key: 1e3 * row.total(key) / calls for key in ("target_time", "draft_time", "verify_time")}
        engine["total_time"] = 1e3 * (row.total("total_time") - row.total("prefill_time")) / calls
        other = 2 * engine["total_time"] - sum(engine.values())  # bookkeeping: cache keep/compact, emitting tokens
        drafter = ["-", "-", "-"] if K == 0 else [
            str(K), f"{1e3 * L * costs.drafter(K):.1f}", f"{engine['draft_time']:.1f}"]
        table.add_row(row.method, str(row.trie_positions), f"{1e3 * costs.target(row.trie_positions):.1f}",
                      f"{engine['target_time']:.1f}", *drafter, f"{engine['verify_time']:.1f}", f"{other:.1f}")
    console.print(table)


def report_batch(runs: list[BatchRun], ar_runs: list[BatchRun], costs: BareCosts, block_length: int, title: str,
                 console: Console) -> None:
    base = runs[0]
    table = new_table(f"Batch throughput: gbv K={BATCH_DRAFTS} at T=1, at most B prompts per pass, in chunks of B "
                      f"(rows leave as they finish) or refilled (a waiting prompt takes a finished row's place)\n"
                      f"{title}",
                      ["mode", "B", "tokens", "wall s", "tok/s", "vs B=1", "after prefill", "limit", "share",
                       "rows/pass", "block eff.", "draft %", "target %", "verify %", "ar tok/s", "vs ar",
                       "same tokens as B=1"])
    base_bare = base.bare_tokens_per_second(costs, block_length)
    for run, ar in zip(runs, ar_runs):
        after_prefill = run.decode_tokens_per_second / base.decode_tokens_per_second
        limit = run.bare_tokens_per_second(costs, block_length) / base_bare
        table.add_row(run.mode, str(run.batch_size), str(int(run.total("new_tokens"))), f"{run.wall:.2f}",
                      f"{run.tokens_per_second:.2f}", f"{run.tokens_per_second / base.tokens_per_second:.2f}x",
                      f"{after_prefill:.2f}x", f"{limit:.2f}x", f"{after_prefill / limit:.0%}",
                      f"{sum(run.rows) / len(run.rows):.1f}", f"{run.block_efficiency:.2f}",
                      *[f"{run.total(key) / run.wall:.0%}" for key in ("draft_time", "target_time", "verify_time")],
                      f"{ar.tokens_per_second:.2f}", f"{run.tokens_per_second / ar.tokens_per_second:.2f}x",
                      yes(same_outputs(run.records, base.records)))
    console.print(table)
    console.print("vs B=1 and after prefill: tokens/s over B=1's, with and without the prefills. Limit: the same ratio "
                  "if every pass cost only its bare forwards over the rows it held (rows/pass is their mean: in chunks "
                  "a pass empties as rows finish, refilled it stays at B until the last prompts). Share: after "
                  "prefill / limit. ar tok/s: `ar` at the same B and mode on the same prompts, in turn with gbv; vs "
                  "ar: gbv's tokens/s over it.")


# --- command line --------------------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m spectr_gbv.tools.bench_engine",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny random models (seconds, for smoke tests)")
    parser.add_argument("--dtype", choices=list(DTYPES), default=None,
                        help="model dtype (default: bfloat16, tiny: float32); without AMX or AVX512-BF16, float32 "
                             "can be faster")
    parser.add_argument("--prompts", type=int, default=2, choices=range(1, len(PROMPTS) + 1),
                        help="prompts of the greedy and sampling parts")
    parser.add_argument("--batch-prompts", type=int, default=16, choices=range(1, len(PROMPTS) + 1),
                        help="prompts N of the batch part (more than B, so that refill has prompts to admit)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=list(BATCH_SIZES),
                        help="B of the batch part, 1 first (every ratio is to B = 1)")
    parser.add_argument("--batch-only", action="store_true",
                        help="only the batch part (with the bare passes its limits need)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--block-length", type=int, default=4)
    parser.add_argument("--max-drafts", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5, help="timed repetitions of each bare forward")
    parser.add_argument("--drafter-dtype", choices=list(DTYPES), default=None,
                        help="the drafter's dtype (default: --dtype), e.g. bfloat16 for int8 weights with bfloat16 "
                             "activations beside a float32 target")
    parser.add_argument("--drafter-quantize", choices=[name for name in QUANTIZE if name], default=None,
                        help="the drafter's linear layers in int8: its weights, or with int8_dynamic its weights and "
                             "activations (the engine and transformers' assisted generation both draft with it)")
    parser.add_argument("--linear-kernel", choices=[name for name in LINEAR_KERNELS if name], default=None,
                        help="linear layers on oneDNN: the target's (needs --dtype float32) and the drafter's when "
                             "it is float32 without --drafter-quantize (transformers' methods use the same models)")
    args = parser.parse_args(argv)
    for key in ("max_new_tokens", "block_length", "max_drafts", "repeats"):
        if getattr(args, key) < 1:
            parser.error(f"--{key.replace('_', '-')}={getattr(args, key)} is not allowed: must be >= 1")
    if args.batch_sizes[0] != 1 or min(args.batch_sizes) < 1:
        parser.error(f"--batch-sizes={' '.join(map(str, args.batch_sizes))} is not allowed: 1 first, each >= 1")
    args.dtype = args.dtype or ("float32" if args.tiny else "bfloat16")
    for key, settings in zip(("model.", "drafter."), pair_settings(args)):  # run.py's keys name the models
        try:
            check_linear_layers(key, settings.get("quantize"), settings["linear_kernel"], settings["dtype"], "cpu")
        except ConfigError as error:
            parser.error(str(error))
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.tiny:  # tiny models are all per-op overhead: a second thread only adds synchronisation
        torch.set_num_threads(1)
    console = Console(width=WIDTH)
    target_settings, drafter_settings = pair_settings(args)
    about = machine(args.dtype) + describe_pair(target_settings, drafter_settings)
    console.print(f"machine: {about}")
    target, drafter = load_pair(args.tiny, target_settings, drafter_settings)
    texts = PROMPTS[:max(args.prompts, args.batch_prompts)]
    encoded = [target.encode_prompt(text) for text in texts]
    prompts, batch_prompts = encoded[:args.prompts], encoded[:args.batch_prompts]
    L, n = args.block_length, args.max_new_tokens
    # Warm-up: first calls pay one-time costs (a batch of several drafts, and transformers' assisted path). The
    # weights are memory-mapped and a pass reads one input-embedding row per token: read them all once, or the
    # first method to meet a token pays for loading its row from disk, and the comparison is skewed against it.
    for model in (target, drafter):
        model.model.get_input_embeddings().weight.sum()
    warm = encoded[:2]
    SpeculativeEngine(target, drafter, "gbv", args.max_drafts, L).generate_batch(
        warm, 2, [torch.Generator().manual_seed(i) for i in range(len(warm))])
    transformers_method(target, 2, drafter, L)(prompts[0], 0)

    costs = BareCosts(target, drafter, prompts[0], args.repeats)
    rows = [] if args.batch_only else benchmark(target, drafter, prompts, n, L, args.max_drafts, console)
    runs, ar_runs = batch_throughput(target, drafter, batch_prompts, n, L, args.batch_sizes, console)

    pair = f"{target.name} <- {drafter.name}"
    title = f"{pair}, {len(prompts)} prompts x {n} new tokens\n{about}"
    if rows:
        report_greedy(rows[:4], title, console)
        report_sampling(rows[4:], costs, L, title, console)
        report_costs(rows[4:], costs, L, len(prompts[0]), args.repeats, f"{pair}\n{about}", console)
    report_batch(runs, ar_runs, costs, L,
                 f"{pair}, {len(batch_prompts)} prompts x {n} new tokens, twice at each B and mode\n{about}",
                 console)


if __name__ == "__main__":
    main()

"""The cost model of a speculative iteration, shared by `make bench` and the runs' summaries (baseline=true):

    limit = block efficiency x t_ar / (t_target(n) + L x t_draft(K)),

the speedup over `ar` if each iteration cost only its bare passes: t_ar a bare target forward of 1 new position,
t_target(n) of the n positions the target scores per iteration (1 + the distinct trie nodes), t_draft(K) a bare
drafter forward of K positions (each drafter step feeds at most K). The share speedup / limit is what the engine keeps
of what its passes alone allow. Over B prompts per pass the same bare passes over B rows bound the throughput of a
batch (`make bench`). Timings hold only for the machine they were measured on: `machine` names it, and
`emulated_bfloat16` tells the engine when bfloat16 runs on a CPU without its units.
"""
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

import torch
from transformers import DynamicCache, PreTrainedModel

from spectr_gbv.decoding.models import LoadedModel


@torch.inference_mode()
def forward_seconds(model, context: list[int], width: int, repeats: int, rows: int = 1) -> float:
    """Median seconds of a bare forward of `width` new positions in each of `rows` rows over a cache holding
    `context` in every row: the pass alone, without the engine's masks, warping, sampling and cache bookkeeping."""
    cache = DynamicCache(config=model.config)
    model(input_ids=torch.tensor([context] * rows, device=model.device), cache=cache, use_cache=True)
    inputs = torch.tensor([context[-1:] * width] * rows, device=model.device)  # the ids do not change the cost
    seconds = []
    for _ in range(1 + repeats):  # the first is a warm-up: the first call of a shape pays one-time costs
        start = time.perf_counter()
        model(input_ids=inputs, cache=cache, use_cache=True)
        seconds.append(time.perf_counter() - start)
        cache.crop(-width)  # back to the context, so every repetition sees the same one (-n: drop the last n)
    return statistics.median(seconds[1:])


class BareCosts:
    """Bare forward seconds over a cache holding `context`, measured once per model, rows and width and kept."""

    def __init__(self, target: LoadedModel, drafter: LoadedModel, context: list[int], repeats: int):
        self.models, self.context, self.repeats = (target, drafter), context, repeats
        self.seconds: dict[tuple[int, int, int], float] = {}

    def _bare(self, side: int, width: int, rows: int) -> float:
        if (side, width, rows) not in self.seconds:
            self.seconds[(side, width, rows)] = forward_seconds(self.models[side].model, self.context, width,
                                                                self.repeats, rows)
        return self.seconds[(side, width, rows)]

    def target(self, width: int, rows: int = 1) -> float:
        return self._bare(0, width, rows)

    def drafter(self, width: int, rows: int = 1) -> float:
        return self._bare(1, width, rows)

    def iteration(self, trie_positions: int, num_drafts: int, block_length: int, rows: int = 1) -> float:
        """Bare seconds of one iteration over `rows` prompts: a target pass over each row's trie and L drafter
        steps of K positions per row."""
        return self.target(trie_positions, rows) + block_length * self.drafter(num_drafts, rows)

    def limit(self, block_efficiency: float, trie_positions: int, num_drafts: int, block_length: int) -> float:
        """The speedup over `ar` that bare passes allow at this block efficiency and trie size."""
        return block_efficiency * self.target(1) / self.iteration(trie_positions, num_drafts, block_length)


def machine(dtype: str) -> str:
    """What the numbers were measured on: the CPU, its bfloat16 units, threads, torch and dtype."""
    units = ", ".join(f"{name}: {value}" for name, value in bfloat16_units().items())
    return (f"{cpu_name()}, {units}, {torch.get_num_threads()} torch threads of {os.cpu_count()} CPUs, "
            f"torch {torch.__version__}, {dtype}")


def bfloat16_units() -> dict[str, str]:
    """yes, no or unknown (no /proc/cpuinfo) for each CPU unit that runs bfloat16 matmuls at speed."""
    flags = cpu_flags()
    return {name: "unknown" if flags is None else ("yes" if set(needed) <= flags else "no")
            for name, needed in [("AMX-BF16", ["amx_tile", "amx_bf16"]), ("AVX512-BF16", ["avx512_bf16"])]}


def emulated_bfloat16(model: PreTrainedModel) -> bool:
    """True for a model with bfloat16 linear weights on a CPU known to lack both units (x86 CPUs before AVX512-BF16):
    there its matmuls are emulated at the same FLOP rate whatever their rows, so a pass over n positions or rows costs
    about n passes over one, and float32 can be faster (docs/performance.md, AVX2 only). int8 weights
    (quantize=int8) run on their own kernel, bfloat16 activations or not."""
    weights = model.get_output_embeddings().weight
    return weights.device.type == "cpu" and weights.dtype == torch.bfloat16 and set(bfloat16_units().values()) == {"no"}


def cpu_name() -> str:
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):  # no lscpu (not Linux)
        lscpu = ""
    names = [line.split(":", 1)[1].strip() for line in lscpu.splitlines() if line.startswith("Model name")]
    return (names[0] if names else "") or platform.processor() or "unknown CPU"


def cpu_flags() -> set[str] | None:
    """The first CPU's flags in /proc/cpuinfo, None where there is none (not Linux)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return None
    flags = [line.split(":", 1)[1].split() for line in lines if line.startswith("flags")]
    return set(flags[0]) if flags else None

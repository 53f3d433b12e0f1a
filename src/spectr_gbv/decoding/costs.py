"""The cost model of a speculative iteration, shared by `make bench` and the runs' summaries (baseline=true):

    limit = block efficiency x t_ar / (t_target(n) + L x t_draft(K)),

the speedup over `ar` if each iteration cost only its bare passes: t_ar a bare target forward of 1 new position,
t_target(n) of the n positions the target scores per iteration (1 + the distinct trie nodes), t_draft(K) a bare
drafter forward of K positions (each drafter step feeds at most K). The share speedup / limit is what the engine keeps
of what its passes alone allow. Over B prompts per pass the same bare passes over B rows bound the throughput of a
batch (`make bench`). Timings hold only for the machine they were measured on: precision.machine names it.
"""
import statistics
import time

import torch
from transformers import DynamicCache

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


"""Sampling settings and the logits -> probabilities warp shared by drafter and target.

Every verifier is lossless with respect to the *warped* target distribution, so drafter and target must go
through exactly this function (docs/algorithms.md §1.3): logits / T -> top-k mask -> top-p mask -> renormalise.
"""
from dataclasses import dataclass

import torch
from torch import Tensor

from spectr_gbv.errors import ConfigError


@dataclass(frozen=True)
class Sampling:
    temperature: float = 1.0  # 0 = greedy: an exact one-hot of the argmax
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    # The drafter's temperature (None -> temperature). With several drafts at temperature 0 give a positive one,
    # or all K greedy drafts are identical and multi-draft gains nothing.
    draft_temperature: float | None = None

    def __post_init__(self):
        """The one range check of these settings (the run's config check builds a Sampling to run it)."""
        for key, ok, allowed in [
            ("temperature", self.temperature >= 0, "must be >= 0 (0 = greedy)"),
            ("top_k", self.top_k >= 0, "must be >= 0 (0 = off)"),
            ("top_p", 0 < self.top_p <= 1, "must be in (0, 1] (1 = off)"),
            ("draft_temperature", self.draft_temperature is None or self.draft_temperature >= 0,
             "must be >= 0, or null for the target's temperature"),
        ]:
            if not ok:
                raise ConfigError(key, getattr(self, key), allowed)

    @property
    def drafter_temperature(self) -> float:
        return self.temperature if self.draft_temperature is None else self.draft_temperature


def warp(logits: Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> Tensor:
    """Next-token probabilities [..., V] from logits [..., V], in float32 or wider (float64 stays float64)."""
    wide = torch.promote_types(logits.dtype, torch.float32)
    if temperature == 0:  # greedy: exact one-hot, no division by zero
        return torch.zeros(logits.shape, dtype=wide, device=logits.device).scatter_(
            -1, logits.argmax(-1, keepdim=True), 1.0)
    # One pass over [rows, V] fewer when it changes nothing: at T = 1 there is nothing to divide (x / 1 is x), and
    # the division happens in place on the widened copy (the same values as logits.float() / T).
    logits = logits.to(wide, copy=True)
    if temperature != 1:
        logits.div_(temperature)
    if 0 < top_k < logits.shape[-1]:
        kth_largest = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    probs = logits.softmax(-1)
    if top_p < 1:
        sorted_probs, order = probs.sort(-1, descending=True)
        # keep a token while the mass strictly before it is < top_p: the smallest set reaching top_p
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        drop_sorted = mass_before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)  # back to vocabulary order
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs

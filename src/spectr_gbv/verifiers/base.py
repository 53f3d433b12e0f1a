"""What every verifier shares: the call contract, input checks, and the few tensor steps they all use.

Shapes: B independent sequences, K draft blocks of L tokens each, vocabulary V.
  draft_tokens  int64 [B, K, L]
  draft_probs   float [B, K, L, V]    q(. | context, first i tokens of draft k): what token i was sampled from
  target_probs  float [B, K, L+1, V]  p(. | context, first i tokens of draft k), i = L is the bonus distribution

Randomness: one torch.Generator for the whole batch, or a list of B generators, one per row. With a list, row b's
uniforms come from generator b alone and every verifier draws a number per row fixed by K and L, so a row's output
does not depend on which other rows share the batch. Every acceptance test is strict (u < h): torch.rand returns
exactly 0 about once in 2^24 float32 draws, and h = 0 (a token the target gives no mass) must never pass.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from spectr_gbv.errors import ConfigError

Generators = torch.Generator | list[torch.Generator] | None  # one for the batch, or one per row


@dataclass
class VerifierOutput:
    """Row b emits its accepted tokens draft_tokens[b, draft_index[b], :num_accepted[b]], then next_token[b]."""

    num_accepted: Tensor  # int64 [B], 0..L: how many draft tokens were accepted
    draft_index: Tensor  # int64 [B], 0..K-1: the draft they come from
    next_token: Tensor  # int64 [B]: the recovered token after a rejection, or the bonus token when all L were accepted
    # thread into the next call for the same rows (None for verifiers that keep none): a dataclass of per-row
    # tensors, an all-zero row being a fresh row's (the engine adds joining prompts' rows so)
    state: Any = None


class Verifier:
    """The call contract. A researcher's own rule subclasses it in their own module and implements verify(); it then
    runs wherever a built-in does, named "module.path:ClassName" (docs/custom_verifiers.md, which also documents the
    optional exact hook `exact_outcomes` that the audit reads)."""

    name: ClassVar[str]
    lossless: ClassVar[bool] = True
    max_drafts: ClassVar[int | None] = None  # 1 for single-draft verifiers, None for any K
    # True where losslessness needs the state carried into later calls (gbv's target modification, docs/algorithms.md
    # §4.2): a score from a fresh state then measures another rule, so the arena scores it with the carried state
    carries_state: ClassVar[bool] = False

    def __call__(self, draft_tokens: Tensor, draft_probs: Tensor, target_probs: Tensor,
                 generator: Generators = None, state: Any = None) -> VerifierOutput:
        check_inputs(draft_tokens, draft_probs, target_probs)
        self.check_num_drafts(draft_tokens.shape[1])
        return self.verify(draft_tokens, draft_probs, target_probs, generator, state)

    @classmethod
    def check_num_drafts(cls, num_drafts: int) -> None:
        """The one check of K against the verifier, shared by the call, the engine and the run's config."""
        if cls.max_drafts is None or num_drafts <= cls.max_drafts:
            return
        from spectr_gbv.verifiers import verifier_names  # not at the top: the package imports this module first

        # lossless ones only: suggesting the published, biased rule would be bad advice
        multi_draft = verifier_names(lossless=True, multi_draft=True)
        raise ConfigError("num_drafts", num_drafts, f"verifier {cls.name} takes at most {cls.max_drafts} draft(s); "
                          f"for more, use a multi-draft verifier ({', '.join(multi_draft)})")

    def verify(self, draft_tokens: Tensor, draft_probs: Tensor, target_probs: Tensor, generator: Generators,
               state: Any) -> VerifierOutput:
        raise NotImplementedError

    def accepted_law(self, draft_tokens: Tensor, draft_probs: Tensor, target_probs: Tensor) -> Tensor | None:
        """The law of tau given these drafts, P(num_accepted = i), i = 0..L [B, L+1], with the verifier's uniforms
        integrated out: E[tau | drafts] and the first-token acceptance P(tau >= 1) without sampling noise. A rule that
        carries_state takes `state=` too (what its previous call returned for these rows; None: fresh). None where no
        closed form is written; the verifier arena then averages replicas of calls (spectr_gbv.experiment.arena)."""
        return None

    def replicate_accepted(self, draft_tokens: Tensor, draft_probs: Tensor, target_probs: Tensor,
                           generator: Generators, replicas: int, state: Any = None) -> Tensor:
        """num_accepted of `replicas` independent calls on the same inputs [replicas, B]: what the arena averages
        where accepted_law() has no closed form. A rule whose uniforms meet the inputs only through thresholds it
        computes first overrides this to compute them once (spectr_gbv_paper)."""
        return torch.stack([self(draft_tokens, draft_probs, target_probs, generator=generator, state=state).num_accepted
                            for _ in range(replicas)])


def check_inputs(draft_tokens: Tensor, draft_probs: Tensor, target_probs: Tensor) -> None:
    """Reject what would silently give wrong laws; zeros (top-k / top-p truncation) are legal."""
    if draft_tokens.dtype != torch.int64 or draft_tokens.dim() != 3:
        raise ValueError(f"draft_tokens must be int64 [B, K, L], got {draft_tokens.dtype} {tuple(draft_tokens.shape)}")
    B, K, L = draft_tokens.shape
    if K < 1 or L < 1:
        raise ValueError(f"draft_tokens must have K >= 1 drafts and L >= 1 tokens, got shape {(B, K, L)}")
    V = draft_probs.shape[-1]
    expected = {"draft_probs": (draft_probs, (B, K, L, V)), "target_probs": (target_probs, (B, K, L + 1, V))}
    for name, (probs, shape) in expected.items():
        if tuple(probs.shape) != shape:
            raise ValueError(f"{name} must have shape {shape} for draft_tokens {(B, K, L)}, got {tuple(probs.shape)}")
        if probs.dtype not in (torch.float32, torch.float64):
            raise ValueError(f"{name} must be float32 or float64, got {probs.dtype}")
        _check_distributions(name, probs)
    if draft_tokens.min() < 0 or draft_tokens.max() >= V:
        raise ValueError(f"draft_tokens must lie in [0, {V}), got values in "
                         f"[{int(draft_tokens.min())}, {int(draft_tokens.max())}]")
    if (draft_probs.gather(-1, draft_tokens.unsqueeze(-1)) <= 0).any():
        raise ValueError("draft_probs gives zero probability to a drafted token: drafts must be sampled from "
                         "draft_probs")


def _check_distributions(name: str, probs: Tensor) -> None:
    # Two passes over the tensor: the sum catches NaN and inf too, the min catches negative entries.
    sums = probs.sum(-1)
    tol = 64 * max(probs.shape[-1] ** 0.5, 16) * torch.finfo(probs.dtype).eps
    if not torch.isfinite(sums).all():
        raise ValueError(f"{name} contains NaN or inf")
    if probs.amin() < 0:
        raise ValueError(f"{name} contains negative entries")
    worst = (sums - 1).abs().max().item()
    if worst > tol:
        raise ValueError(f"{name} rows must sum to 1 (tolerance {tol:.1e} for {probs.dtype}), worst is off by "
                         f"{worst:.2e}")


# ---- steps shared by the verifiers -----------------------------------------------------------------------------

def uniforms(shape, like: Tensor, generator: Generators) -> Tensor:
    """U[0, 1) draws of `shape` in like's dtype and device. With a list of generators, shape[0] must be its length
    and slice b comes from generator b alone."""
    if generator is None or isinstance(generator, torch.Generator):
        return torch.rand(shape, generator=generator, dtype=like.dtype, device=like.device)
    shape = tuple(shape)
    if not shape or shape[0] != len(generator):
        raise ValueError(f"a list of generators needs one per row (batch size B) or a single generator: "
                         f"got {len(generator)} generators for draws of shape {shape}")
    return torch.stack([torch.rand(shape[1:], generator=g, dtype=like.dtype, device=like.device) for g in generator])


CDF_BLOCK = 1024  # tokens per block of sample()'s two-level inverse CDF: ~sqrt(V) keeps both levels small


def sample(probs: Tensor, generator: Generators, block: int = CDF_BLOCK) -> Tensor:
    """One categorical draw per row of probs [..., V] (rows need not be normalised) by inverting its float64 CDF in
    two levels: first the block of `block` tokens where u falls, from the blocks' sums, then the token inside it.
    Only the sums and one block per row are ever widened to float64, so a row costs about 2 sqrt(V) float64 steps
    instead of V: a whole-row float64 cumsum, or torch.multinomial, was most of sampling's cost (docs/performance.md).
    The same draw as one CDF over the whole row, up to float64 rounding (docs/algorithms.md §11). With a list of
    generators, probs[b] takes its prod(probs.shape[1:-1]) draws from generator b."""
    V = probs.shape[-1]
    flat, block = probs.reshape(-1, V), min(block, V)
    whole = V // block * block
    sums = flat[:, :whole].unflatten(1, (-1, block)).sum(-1, dtype=torch.float64)  # [rows, blocks]
    if whole < V:
        sums = torch.cat([sums, flat[:, whole:].sum(-1, keepdim=True, dtype=torch.float64)], 1)
    cdf = sums.cumsum(-1)
    u = uniforms(probs.shape[:-1], cdf, generator).reshape(-1, 1) * cdf[:, -1:]
    chosen = invert_cdf(cdf, sums, u)
    columns = chosen * block + torch.arange(block, device=flat.device)
    inside = flat.gather(1, columns.clamp(max=V - 1)).double().masked_fill_(columns >= V, 0.0)
    u = u - torch.where(chosen > 0, cdf.gather(1, (chosen - 1).clamp_min(0)), 0.0)  # u's offset into the block
    return (chosen * block + invert_cdf(inside.cumsum(-1), inside, u)).reshape(probs.shape[:-1])


def invert_cdf(cdf: Tensor, weights: Tensor, u: Tensor) -> Tensor:
    """The first index whose cdf [rows, N] exceeds u [rows, 1], never one of zero weight: u rounded up to the
    total falls on the last positive weight."""
    index = torch.searchsorted(cdf, u, right=True)
    last_positive = weights.shape[-1] - 1 - (weights > 0).flip(-1).byte().argmax(-1, keepdim=True)
    return torch.minimum(index, last_positive)


def normalise(residual: Tensor, fallback: Tensor) -> Tensor:
    """residual / its sum; rows that sum to 0 have zero probability of being used in exact arithmetic
    (a rejection implies positive residual mass), so they fall back to a valid distribution instead of NaN."""
    total = residual.sum(-1, keepdim=True)
    return torch.where(total > 0, residual / total.clamp_min(torch.finfo(residual.dtype).tiny), fallback)


def token_probs(probs: Tensor, tokens: Tensor) -> Tensor:
    """probs[..., i, tokens[..., i]] for the first tokens.shape[-1] positions."""
    return probs[..., : tokens.shape[-1], :].gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def same_prefix(tokens: Tensor) -> Tensor:
    """[B, K, K, L] bool for drafts tokens [B, K, L]: [b, k, j, i] says drafts k and j agree on their first i + 1
    tokens, i.e. share the trie's node at depth i. Summed over i: their common prefix lengths."""
    return (tokens[:, :, None] == tokens[:, None]).long().cumprod(-1).bool()


def last_success(h: Tensor, u: Tensor) -> Tensor:
    """The accepted count max{i >= 1 : u_i < h_i} (strict, see above), 0 if none; h, u [B, L] hold positions 1..L."""
    positions = torch.arange(1, h.shape[-1] + 1, device=h.device)
    return ((u < h) * positions).amax(-1)


def last_success_law(h: Tensor) -> Tensor:
    """The law of last_success(h, u) over uniform u [B, L+1]: P(tau = i) = h_i prod_{j>i} (1 - h_j),
    P(tau = 0) = prod_j (1 - h_j)."""
    none_from = (1 - h).flip(-1).cumprod(-1).flip(-1)  # [:, i]: no success at positions i+1..L
    none_above = torch.cat([none_from[:, 1:], torch.ones_like(h[:, :1])], -1)
    return torch.cat([none_from[:, :1], h * none_above], -1)


def pick(x: Tensor, index: Tensor) -> Tensor:
    """x[b, index[b]] for x [B, N, ...] and index [B]."""
    view = index.view(-1, *([1] * (x.dim() - 1))).expand(-1, 1, *x.shape[2:])
    return x.gather(1, view).squeeze(1)

"""Token-level multi-draft verifiers on the draft trie (docs/algorithms.md §5-7): walk down from the root; at each
node a node solver turns p, q and the next tokens of the drafts through the node into one token distributed as p;
descend if it is a child (even when it came from the residual), else it is the recovered token."""
from __future__ import annotations

import torch
from torch import Tensor

from .base import Verifier, VerifierOutput, normalise, pick, sample, uniforms

# Bisection steps for rho*, lossless at any count: the returned upper end is always valid (docs/algorithms.md §11,
# note 6). The bracket [1, k] stops moving once it spans adjacent floats, (k - 1) / 2^steps <= their spacing at 1:
# after 23 + log2(k - 1) steps in float32, so 40 reach float32's fixed point for any k <= 2^17 + 1. In float64 they
# stop within (k - 1) 2^-40 ~ 1e-12 (k - 1) of rho*: its fixed point, 52 + log2(k - 1) steps, would cost a third more
# sums over the vocabulary for an acceptance gain of that size (the exact reference goes there: 64 steps).
RHO_BISECTION_STEPS = 40


def first_alive(alive: Tensor) -> Tensor:
    """Lowest-index draft through the current node: every node's distributions are read from that one row."""
    return alive.long().argmax(-1)


class TreeVerifier(Verifier):
    def verify(self, draft_tokens, draft_probs, target_probs, generator, state):
        B, K, L = draft_tokens.shape
        alive = torch.ones(B, K, dtype=torch.bool, device=draft_tokens.device)
        descending = torch.ones(B, dtype=torch.bool, device=draft_tokens.device)
        accepted = torch.zeros(B, dtype=torch.long, device=draft_tokens.device)
        recovered = torch.zeros_like(accepted)
        for d in range(L):
            row = first_alive(alive)
            children = draft_tokens[:, :, d]
            y = self.choose(pick(target_probs[:, :, d], row), pick(draft_probs[:, :, d], row), children, alive,
                            generator)
            through_y = alive & (children == y[:, None])
            stop = descending & ~through_y.any(-1)
            recovered = torch.where(stop, y, recovered)
            descending &= ~stop
            alive = torch.where(descending[:, None], through_y, alive)
            accepted += descending
        row = first_alive(alive)
        bonus = sample(pick(target_probs[:, :, L], row), generator)
        return VerifierOutput(accepted, row, torch.where(descending, bonus, recovered))

    def choose(self, p: Tensor, q: Tensor, children: Tensor, alive: Tensor, generator) -> Tensor:
        """p, q [B, V] at the node; children [B, K] next draft tokens (valid where alive). Returns a token ~ p."""
        raise NotImplementedError


class NaiveVerifier(TreeVerifier):
    """NSS: sample from the target and descend if it happens to be a child."""

    name = "nss"

    def choose(self, p, q, children, alive, generator):
        return sample(p, generator)


class SpecInferVerifier(TreeVerifier):
    """SpecInfer multi-step speculative sampling (recursive rejection, drafts with replacement)."""

    name = "specinfer"

    def choose(self, p, q, children, alive, generator):
        u = uniforms(children.shape, p, generator)
        chosen = torch.full_like(children[:, 0], -1)
        current = p
        for j in range(children.shape[1]):
            c = children[:, j:j + 1]
            undecided = alive[:, j] & (chosen < 0)
            accept = undecided & (u[:, j] * q.gather(-1, c).squeeze(-1) < current.gather(-1, c).squeeze(-1))
            chosen = torch.where(accept, children[:, j], chosen)
            rejected = (undecided & ~accept)[:, None]
            current = torch.where(rejected, normalise((current - q).clamp_min(0), current), current)
        return torch.where(chosen >= 0, chosen, sample(current, generator))


def kseq_rho(p: Tensor, q: Tensor, k: Tensor) -> Tensor:
    """Smallest rho in [1, k] with 1 - (1 - beta(rho))^k <= rho beta(rho), by bisection; the upper end is always
    on the valid side, so the residual stays non-negative whatever the number of steps."""
    lo, hi = torch.ones_like(k), k.clone()
    for _ in range(RHO_BISECTION_STEPS):
        mid = (lo + hi) / 2
        beta = torch.minimum(q, p / mid[:, None]).sum(-1)
        too_small = 1 - (1 - beta) ** k >= mid * beta
        lo, hi = torch.where(too_small, mid, lo), torch.where(too_small, hi, mid)
    return hi


class SpecTrVerifier(TreeVerifier):
    """SpecTr K-SEQ: accept candidate j with probability min(1, p/(rho* q)), else sample the K-SEQ residual."""

    name = "spectr"

    def choose(self, p, q, children, alive, generator):
        k = alive.sum(-1).to(p.dtype)
        rho = kseq_rho(p, q, k)
        capped = torch.minimum(q, p / rho[:, None])
        beta = capped.sum(-1)
        u = uniforms(children.shape, p, generator)
        ratio = p.gather(-1, children) / (rho[:, None] * q.gather(-1, children))
        accepted = alive & (u < ratio)
        first = accepted.long().argmax(-1)
        scale = torch.where(beta > 0, (1 - (1 - beta) ** k) / beta.clamp_min(torch.finfo(p.dtype).tiny), 0.0)
        residual = normalise((p - capped * scale[:, None]).clamp_min(0), p)
        return torch.where(accepted.any(-1), children.gather(-1, first[:, None]).squeeze(-1),
                           sample(residual, generator))

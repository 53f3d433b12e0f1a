"""`gbv`: the project's lossless SpecTr-GBV. Greedy block verification (spec 4) for one draft, RGBV (spec 8.5) for K.

The target block Y is coupled with each draft in turn by the greedy block coupling, which attains the largest
possible agreement at every depth at once. Each coupling reveals how far Y agrees with that draft and leaves Y with a
new conditional law: a *residual level* on top of the previous one,

    M_new(. | v) = point mass on the anchor token             while v is shorter than the anchor
                 = norm((M(. | v) - lambda(v) q(. | v))_+)    after it, lambda(v) = S(v) / M(v),

with S, M the draft and current-target joint masses of v since the block start. The correction token comes from the
final law, and the levels stay in force for the rest of the block window: the next iteration verifies against them
(the "target modification"; without it the stream is biased). Pending levels are this verifier's state.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .base import Verifier, VerifierOutput, last_success, normalise, pick, sample, token_probs, uniforms

MAX_LOG_RATIO = 80.0  # exp(80) is finite in float32; larger ratios only occur on zero-mass nodes


@dataclass
class PendingLevels:
    """Residual levels still in force after a call, one column per level (oldest first)."""

    log_s: Tensor  # [B, N] log draft joint mass from the level's block start to the last emitted token
    log_m: Tensor  # [B, N] log joint mass of the level's input measure over the same tokens
    remaining: Tensor  # int64 [B, N] positions of the next block it still covers (0: expired)


@dataclass
class Level:
    log_s0: Tensor  # [B] masses accumulated before this block (0 for levels made in this block)
    log_m0: Tensor  # [B]
    anchor_len: Tensor  # [B] positions below it are a point mass on the anchor's tokens
    end: Tensor  # [B] positions at or beyond it are untouched
    anchor: Tensor  # [B, L] the anchor's tokens


def cumulative_log(cond: Tensor, x: Tensor) -> Tensor:
    """log joint mass of the prefixes x^0..x^L under conditionals cond [B, L, V]: [B, L+1]."""
    log_cond = cond.gather(-1, x.unsqueeze(-1)).squeeze(-1).log()
    return torch.cat([torch.zeros_like(log_cond[:, :1]), log_cond.cumsum(-1)], -1)


def apply_levels(cond: Tensor, q: Tensor, x: Tensor, log_s: Tensor, levels: list[Level], node: Tensor | None = None):
    """Stack residual levels on the conditionals cond [B, L, V] along path x [B, L] (q [B, L, V] its draft
    conditionals, log_s [B, L+1] its log draft joint masses). Returns the final conditionals, each level's input
    log joint masses along x [n][B, L+1] and, when node [B] is given, each level's input conditional there [n][B, V]."""
    L = x.shape[1]
    position = torch.arange(L, device=x.device)
    input_log_joint, input_at_node = [], []
    for level in levels:
        log_m = cumulative_log(cond, x)
        input_log_joint.append(log_m)
        if node is not None:
            input_at_node.append(pick(cond, node))
        log_lambda = level.log_s0[:, None] + log_s[:, :L] - level.log_m0[:, None] - log_m[:, :L]
        lam = log_lambda.clamp(max=MAX_LOG_RATIO).exp()
        residual = normalise((cond - lam[..., None] * q).clamp_min(0), cond)
        point_mass = torch.zeros_like(cond).scatter_(-1, level.anchor.unsqueeze(-1), 1.0)
        updated = torch.where((position < level.anchor_len[:, None])[..., None], point_mass, residual)
        cond = torch.where((position < level.end[:, None])[..., None], updated, cond)
    return cond, input_log_joint, input_at_node


def greedy_acceptance(cond: Tensor, q: Tensor, x: Tensor, log_s: Tensor) -> Tensor:
    """h_1..h_L of the greedy block coupling of path x against the target conditionals cond (spec 4.2)."""
    L = x.shape[1]
    rho = (cumulative_log(cond, x) - log_s)[:, 1:].clamp(max=MAX_LOG_RATIO).exp()  # joint ratio, not clamped at 1
    mu = torch.minimum(q[:, 1:L], rho[:, : L - 1, None] * cond[:, 1:L]).sum(-1)
    gap = 1 - mu
    h_inner = torch.where(gap > 0, (rho[:, : L - 1].clamp(max=1) - mu) / gap.clamp_min(torch.finfo(gap.dtype).tiny),
                          torch.ones_like(mu))
    return torch.cat([h_inner.clamp(0, 1), rho[:, L - 1:].clamp(max=1)], -1)


class GreedyBlockVerifier(Verifier):
    name = "gbv"

    def verify(self, tokens, q, p, generator, state):
        B, K, L = tokens.shape
        log_s = torch.cat([torch.zeros_like(q[:, :, :1, 0]), token_probs(q, tokens).log().cumsum(-1)], -1)
        levels = pending_to_levels(state, tokens)
        u = uniforms((B, K, L), q, generator)
        done = torch.zeros(B, dtype=torch.bool, device=q.device)
        best_len = torch.zeros(B, dtype=torch.long, device=q.device)
        best_draft = torch.zeros_like(best_len)
        for k in range(K):
            cond, _, _ = apply_levels(p[:, k, :L], q[:, k], tokens[:, k], log_s[:, k], levels)
            t = last_success(greedy_acceptance(cond, q[:, k], tokens[:, k], log_s[:, k]), u[:, k])
            full = ~done & (t == L)
            longer = ~done & (t > best_len)  # t is automatically consistent with the known prefix of Y
            best_len = torch.where(longer, t, best_len)
            best_draft = torch.where(longer, k, best_draft)
            done |= full
            levels.append(Level(torch.zeros_like(log_s[:, 0, 0]), torch.zeros_like(log_s[:, 0, 0]), t,
                                torch.where(done, 0, L), tokens[:, k]))

        # Replay every level along the best path to get the correction law and each level's input there.
        x, log_s_best = pick(tokens, best_draft), pick(log_s, best_draft)
        node = best_len.clamp(max=L - 1)
        cond, input_log_joint, input_at_node = apply_levels(
            pick(p, best_draft)[:, :L], pick(q, best_draft), x, log_s_best, levels, node)
        bonus = pick(p, best_draft)[:, L]
        next_token = sample(torch.where(done[:, None], bonus, pick(cond, node)), generator)

        emitted = best_len + 1
        log_q_y = pick(pick(q, best_draft), node).gather(-1, next_token[:, None]).squeeze(-1).log()
        log_s_new = log_s_best.gather(-1, node[:, None]).squeeze(-1) + log_q_y
        pending = PendingLevels(
            log_s=torch.stack([lv.log_s0 + log_s_new for lv in levels], -1),
            log_m=torch.stack([lv.log_m0 + lm.gather(-1, node[:, None]).squeeze(-1)
                               + at.gather(-1, next_token[:, None]).squeeze(-1).log()
                               for lv, lm, at in zip(levels, input_log_joint, input_at_node)], -1),
            remaining=torch.stack([torch.where(done, 0, (lv.end - emitted).clamp_min(0)) for lv in levels], -1),
        )
        return VerifierOutput(best_len, best_draft, next_token, compact(pending))


def pending_to_levels(state: PendingLevels | None, tokens: Tensor) -> list[Level]:
    if state is None:
        return []
    if not isinstance(state, PendingLevels) or state.remaining.shape[0] != tokens.shape[0]:
        raise ValueError("state must be the PendingLevels returned by the previous gbv call for the same rows")
    zero = torch.zeros_like(tokens[:, 0, 0])
    return [Level(state.log_s[:, n], state.log_m[:, n], zero, state.remaining[:, n], tokens[:, 0])
            for n in range(state.remaining.shape[1])]


def compact(pending: PendingLevels) -> PendingLevels | None:
    """Drop levels that have expired in every row."""
    live = (pending.remaining > 0).any(0)
    if not live.any():
        return None
    return PendingLevels(pending.log_s[:, live], pending.log_m[:, live], pending.remaining[:, live])

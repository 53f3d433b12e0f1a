"""`gbv`: the project's lossless SpecTr-GBV (docs/algorithms.md §4): greedy block verification for one draft, RGBV
for K.

The target block Y is coupled with each draft in turn by the greedy block coupling, which attains the largest
possible agreement at every depth at once. Each coupling reveals how far Y agrees with that draft and leaves Y with a
new conditional law: a *residual level* on top of the previous one,

    M_new(. | v) = point mass on the anchor token             while v is shorter than the anchor
                 = norm((M(. | v) - lambda(v) q(. | v))_+)    after it, lambda(v) = S(v) / M(v),

with S, M the draft and current-target joint masses of v since the block start. The recovered token comes from the
final law, and the levels stay in force for the rest of the block window: the next iteration verifies against them
(the "target modification"; without it the stream is biased). Pending levels are this verifier's state
(docs/algorithms.md §4.4).
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
    """log joint mass of the prefixes x^0..x^n under conditionals cond [B, n, V]: [B, n+1]."""
    log_cond = cond.gather(-1, x.unsqueeze(-1)).squeeze(-1).log()
    return torch.cat([torch.zeros_like(log_cond[:, :1]), log_cond.cumsum(-1)], -1)


def apply_levels(cond: Tensor, q: Tensor, x: Tensor, log_s: Tensor, levels: list[Level], node: Tensor | None = None):
    """Stack residual levels on the conditionals cond [B, n, V] at the first n nodes of path x [B, n] (q [B, n, V]
    its draft conditionals, log_s [B, n+1] its log draft joint masses). Returns the final conditionals, each level's
    input log joint masses along x [levels][B, n+1] and, when node [B] is given, each level's input conditional
    there [levels][B, V]."""
    input_log_joint, input_at_node = [], []
    for level in levels:
        log_m = cumulative_log(cond, x)
        input_log_joint.append(log_m)
        if node is not None:
            input_at_node.append(pick(cond, node))
        span = min(x.shape[1], int(level.end.max()))  # the level leaves the nodes beyond its window alone
        if span > 0:
            cond = torch.cat([apply_level(level, cond[:, :span], q[:, :span], log_s[:, :span] - log_m[:, :span]),
                              cond[:, span:]], 1)
    return cond, input_log_joint, input_at_node


def apply_level(level: Level, cond: Tensor, q: Tensor, log_s_over_m: Tensor) -> Tensor:
    """One residual level on the nodes of cond [B, n, V]: a point mass below the anchor, the residual from it on.
    Each part is computed only on the nodes where some row needs it (this is the verifier's hot loop)."""
    n = cond.shape[1]
    below, above = int(level.anchor_len.min().clamp(max=n)), int(level.anchor_len.max().clamp(max=n))
    lam = ((level.log_s0 - level.log_m0)[:, None] + log_s_over_m[:, below:]).clamp(max=MAX_LOG_RATIO).exp()
    residual = normalise((cond[:, below:] - lam[..., None] * q[:, below:]).clamp_min(0), cond[:, below:])
    point_mass = torch.zeros_like(cond[:, :above]).scatter_(-1, level.anchor[:, :above, None], 1.0)
    mixed = torch.arange(below, above, device=cond.device) < level.anchor_len[:, None]
    updated = torch.cat([point_mass[:, :below],
                         torch.where(mixed[..., None], point_mass[:, below:], residual[:, : above - below]),
                         residual[:, above - below:]], 1)
    if (level.end >= n).all():
        return updated
    return torch.where((torch.arange(n, device=cond.device) < level.end[:, None])[..., None], updated, cond)


def greedy_acceptance(cond: Tensor, q: Tensor, x: Tensor, log_s: Tensor, block_length: int) -> Tensor:
    """h_1..h_L [B, L] of the greedy block coupling of path x against the target conditionals cond
    (docs/algorithms.md §4.1), given at the first n nodes only: beyond them the path has zero mass under the target,
    so h = 0 there."""
    n = x.shape[1]
    rho = (cumulative_log(cond, x) - log_s)[:, 1:].clamp(max=MAX_LOG_RATIO).exp()  # joint ratio, not clamped at 1
    mu = torch.minimum(q[:, 1:n], rho[:, : n - 1, None] * cond[:, 1:n]).sum(-1)
    gap = 1 - mu
    h_inner = torch.where(gap > 0, (rho[:, : n - 1].clamp(max=1) - mu) / gap.clamp_min(torch.finfo(gap.dtype).tiny),
                          torch.ones_like(mu))
    last = rho[:, n - 1:].clamp(max=1) if n == block_length else torch.zeros_like(rho[:, :1])
    return torch.cat([h_inner.clamp(0, 1), last, rho.new_zeros(rho.shape[0], block_length - n)], -1)


class GreedyBlockVerifier(Verifier):
    name = "gbv"

    def verify(self, draft_tokens, draft_probs, target_probs, generator, state):
        tokens, q, p = draft_tokens, draft_probs, target_probs  # §4's letters, so the level algebra reads as there
        B, K, L = tokens.shape
        log_s = torch.cat([torch.zeros_like(q[:, :, :1, 0]), token_probs(q, tokens).log().cumsum(-1)], -1)
        common = (tokens[:, :, None] == tokens[:, None]).long().cumprod(-1).sum(-1)  # [B, K, K] common prefix lengths
        levels = pending_to_levels(state, tokens)
        u = uniforms((B, K, L), q, generator)
        done = torch.zeros(B, dtype=torch.bool, device=q.device)
        accepted = torch.zeros(B, dtype=torch.long, device=q.device)  # the longest agreement so far
        draft_index = torch.zeros_like(accepted)
        anchors = []
        for k in range(K):
            if done.all():
                break
            n = live_nodes(common[:, k], anchors, done, L)
            cond, _, _ = apply_levels(p[:, k, :n], q[:, k, :n], tokens[:, k, :n], log_s[:, k, : n + 1], levels)
            h = greedy_acceptance(cond, q[:, k, :n], tokens[:, k, :n], log_s[:, k, : n + 1], L)
            accepted_k = last_success(h, u[:, k])  # t_k of §4.3: always consistent with the known prefix of Y
            longer = ~done & (accepted_k > accepted)
            accepted = torch.where(longer, accepted_k, accepted)
            draft_index = torch.where(longer, k, draft_index)
            done |= accepted_k == L
            anchors.append((k, accepted_k))
            levels.append(Level(torch.zeros_like(log_s[:, 0, 0]), torch.zeros_like(log_s[:, 0, 0]), accepted_k,
                                torch.where(done, 0, L), tokens[:, k]))

        bonus = pick(p, draft_index)[:, L]
        if done.all():
            return VerifierOutput(accepted, draft_index, sample(bonus, generator), None)
        # Replay every level along the best path to get the recovered token's law and each level's input there.
        node = torch.where(done, 0, accepted)
        n = int(node.max()) + 1
        x, q_best, log_s_best = pick(tokens, draft_index)[:, :n], pick(q, draft_index)[:, :n], pick(log_s, draft_index)
        cond, input_log_joint, input_at_node = apply_levels(
            pick(p, draft_index)[:, :n], q_best, x, log_s_best[:, : n + 1], levels, node)
        next_token = sample(torch.where(done[:, None], bonus, pick(cond, node)), generator)

        # The levels stay in force after the emitted tokens: accumulate their masses along best + next_token.
        at = lambda values, i: values.gather(-1, i[:, None]).squeeze(-1)  # noqa: E731
        log_s_new = at(log_s_best, node) + at(pick(q_best, node), next_token).log()
        emitted = accepted + 1
        pending = PendingLevels(
            log_s=torch.stack([lv.log_s0 + log_s_new for lv in levels], -1),
            log_m=torch.stack([lv.log_m0 + at(lm, node) + at(cm, next_token).log()
                               for lv, lm, cm in zip(levels, input_log_joint, input_at_node)], -1),
            remaining=torch.stack([torch.where(done, 0, (lv.end - emitted).clamp_min(0)) for lv in levels], -1),
        )
        return VerifierOutput(accepted, draft_index, next_token, compact(pending))


def live_nodes(common: Tensor, anchors: list[tuple[int, Tensor]], done: Tensor, block_length: int) -> int:
    """How many leading nodes of a draft can carry target mass: an earlier draft j that had accepted_j tokens
    accepted revealed that Y starts with them, so a draft that leaves them after c < accepted_j common tokens has
    zero mass from depth c + 1 on. Computing only those nodes is what keeps later drafts cheap."""
    limit = torch.full_like(common[:, 0], block_length)
    for j, accepted_j in anchors:
        limit = torch.where(common[:, j] < accepted_j, torch.minimum(limit, common[:, j] + 1), limit)
    return max(1, int(limit.masked_fill(done, 0).max()))


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

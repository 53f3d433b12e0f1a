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

import math
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from .base import (Verifier, VerifierOutput, check_inputs, last_success, last_success_law, pick, same_prefix, sample,
                   token_probs, uniforms)

MAX_LOG_RATIO = 80.0  # exp(80) is finite in float32; larger ratios only occur on zero-mass nodes
ALL_ROWS = slice(None)  # the index for every row: what it selects is a view, not a copy


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

    def of_rows(self, rows: slice | Tensor) -> Level:
        return Level(self.log_s0[rows], self.log_m0[rows], self.anchor_len[rows], self.end[rows], self.anchor[rows])


class Scratch:
    """Memory for the full-V intermediates of one call, reused by every draft and level: on a CPU a fresh tensor
    above glibc's mmap threshold (32 MB, e.g. [8, 7, 151_936] float32) is fresh pages, each faulted in on first touch,
    while the arithmetic on it is a few passes; reused memory is faulted in once."""

    COND, DRAFT, BEFORE, WORK = range(4)  # the law being built, its draft conditionals, a level's input, temporaries

    def __init__(self, like: Tensor, numel: int):
        self.memory = like.new_empty(4, numel)

    def __call__(self, slot: int, *shape: int) -> Tensor:
        return self.memory[slot, : math.prod(shape)].view(shape)


def rows_where(mask: Tensor) -> slice | Tensor:
    """The rows where mask [R] holds, as an index: ALL_ROWS when it holds in every row. A lone row of a batch is
    computed with a second one: PyTorch splits a full-V sum that has a single output across threads, which rounds
    differently, and a row's results must not depend on which rows are computed with it."""
    if bool(mask.all()):
        return ALL_ROWS
    if int(mask.sum()) == 1:
        mask = mask.clone()
        mask[int((~mask).nonzero()[0])] = True
    return mask.nonzero().squeeze(1)


def index_into(x: Tensor, indices: list[Tensor], out: Tensor) -> Tensor:
    """x[indices] written into out, by one indexing kernel (index_select copies row by row)."""
    return torch.ops.aten.index.Tensor_out(x, indices, out=out)


def copy_rows(x: Tensor, rows: slice | Tensor, out: Tensor) -> Tensor:
    """x[rows] written into out."""
    return out.copy_(x) if rows is ALL_ROWS else index_into(x, [rows], out)


def read_rows(x: Tensor, rows: slice | Tensor, out: Tensor) -> Tensor:
    """x[rows] to read from: x itself for ALL_ROWS, else a copy in out."""
    return x if rows is ALL_ROWS else copy_rows(x, rows, out)


def cumulative_log(cond: Tensor, x: Tensor) -> Tensor:
    """log joint mass of the prefixes x^0..x^n under conditionals cond [B, n, V]: [B, n+1]."""
    log_cond = cond.gather(-1, x.unsqueeze(-1)).squeeze(-1).log()
    return torch.cat([torch.zeros_like(log_cond[:, :1]), log_cond.cumsum(-1)], -1)


def apply_levels_(cond: Tensor, q: Tensor, x: Tensor, log_s: Tensor, levels: list[Level], scratch: Scratch,
                  reach: Tensor, node: Tensor | None = None):
    """Stack residual levels, in place, on the conditionals cond [R, n, V] at the first n nodes of path x [R, n]
    (q [R, n, V] its draft conditionals, log_s [R, n+1] its log draft joint masses, levels given for these rows), on
    the first reach [R] nodes of each row: the caller's results do not depend on the nodes beyond, left as they are.
    Returns each level's input log joint masses along x [levels][R, n+1] and, when node [R] is given, each level's
    input conditional there [levels][R, V]."""
    input_log_joint, input_at_node = [], []
    for level in levels:
        log_m = cumulative_log(cond, x)
        input_log_joint.append(log_m)
        if node is not None:
            input_at_node.append(pick(cond, node))
        level = replace(level, end=level.end.clamp(max=reach))
        span = min(x.shape[1], int(level.end.max()))  # the level leaves the nodes beyond its window alone
        if span > 0:
            apply_level_(level, cond[:, :span], q[:, :span], log_s[:, :span] - log_m[:, :span], scratch)
    return input_log_joint, input_at_node


def apply_level_(level: Level, cond: Tensor, q: Tensor, log_s_over_m: Tensor, scratch: Scratch) -> None:
    """One residual level on cond [R, n, V], in place, at the nodes i < end of each row (its window): a point mass on
    the anchor's token below anchor_len, the residual from there on. This is the verifier's hot loop: when every row's
    window covers all n nodes the residual is computed on the block of nodes from the shortest anchor on, else only
    at the (row, node) pairs inside the windows. A level leaves a row alone where its end is 0 (expired, or made
    after that row was done, docs/algorithms.md §4.3-4.4) and the windows of inherited levels differ from row to row,
    so whole [R, n, V] blocks would cost B x levels x n x V where the windows hold far fewer (row, node) pairs."""
    n = cond.shape[1]
    nodes = torch.arange(n, device=cond.device)
    in_window, anchored = nodes < level.end[:, None], nodes < level.anchor_len[:, None]
    log_ratio0 = level.log_s0 - level.log_m0
    if bool((level.end >= n).all()):
        below = int(level.anchor_len.min().clamp(max=n))
        lam = ratio(log_ratio0[:, None] + log_s_over_m[:, below:])
        residual_block_(cond[:, below:], q[:, below:], lam, scratch)
    else:
        row, node = (in_window & ~anchored).nonzero(as_tuple=True)
        if row.numel() > 0:
            residual_pairs_(cond, q, row, node, ratio(log_ratio0[row] + log_s_over_m[row, node]), scratch)
    row, node = (in_window & anchored).nonzero(as_tuple=True)
    cond[row, node] = 0.0
    cond[row, node, level.anchor[row, node]] = 1.0


def ratio(log_ratio: Tensor) -> Tensor:
    """lambda = S / M from its log."""
    return log_ratio.clamp(max=MAX_LOG_RATIO).exp()


def residual_block_(cond: Tensor, q: Tensor, lam: Tensor, scratch: Scratch) -> None:
    """cond = norm((cond - lam q)_+) in place on a block of nodes cond [R, m, V] (q [R, m, V], lam [R, m])."""
    residual = scratch(Scratch.WORK, *cond.shape)
    normalise_into(cond, residual, positive_part(cond, q, lam, residual), cond)


def residual_pairs_(cond: Tensor, q: Tensor, row: Tensor, node: Tensor, lam: Tensor, scratch: Scratch) -> None:
    """cond[row, node] = norm((cond - lam q)_+)[row, node] in place at the pairs listed (cond, q [R, n, V], lam [P])."""
    if row.numel() == 1 and cond.shape[0] > 1:  # a lone pair is computed twice: see rows_where
        row, node, lam = row.repeat(2), node.repeat(2), lam.repeat(2)
    shape = (row.numel(), cond.shape[-1])
    before = index_into(cond, [row, node], scratch(Scratch.BEFORE, *shape))
    residual = index_into(q, [row, node], scratch(Scratch.WORK, *shape))
    cond[row, node] = normalise_into(residual, residual, positive_part(before, residual, lam, residual), before)


def positive_part(cond: Tensor, q: Tensor, lam: Tensor, out: Tensor) -> Tensor:
    """out = (cond - lam q)_+ (q may be out itself); returns its sums over V."""
    torch.mul(lam[..., None], q, out=out)
    torch.sub(cond, out, out=out).clamp_min_(0)
    return out.sum(-1, keepdim=True)


def normalise_into(out: Tensor, residual: Tensor, total: Tensor, fallback: Tensor) -> Tensor:
    """out = base.normalise(residual, fallback) with the same results, given residual's sums over V."""
    scale = total.clamp_min(torch.finfo(total.dtype).tiny)
    if bool((total > 0).all()):
        return torch.div(residual, scale, out=out)
    return torch.where(total > 0, residual.div_(scale), fallback, out=out)


def greedy_acceptance(cond: Tensor, q: Tensor, x: Tensor, log_s: Tensor, block_length: int,
                      work: Tensor | None = None) -> Tensor:
    """h_1..h_L [B, L] of the greedy block coupling of path x against the target conditionals cond
    (docs/algorithms.md §4.1), given at the first n nodes only: beyond them the path has zero mass under the target,
    so h = 0 there. work, if given, is memory [B, n-1, V] for the full-V intermediate."""
    n = x.shape[1]
    rho = (cumulative_log(cond, x) - log_s)[:, 1:].clamp(max=MAX_LOG_RATIO).exp()  # joint ratio, not clamped at 1
    scaled = torch.mul(rho[:, : n - 1, None], cond[:, 1:n], out=work)
    mu = torch.minimum(q[:, 1:n], scaled, out=scaled).sum(-1)
    gap = 1 - mu
    h_inner = torch.where(gap > 0, (rho[:, : n - 1].clamp(max=1) - mu) / gap.clamp_min(torch.finfo(gap.dtype).tiny),
                          torch.ones_like(mu))
    last = rho[:, n - 1:].clamp(max=1) if n == block_length else torch.zeros_like(rho[:, :1])
    return torch.cat([h_inner.clamp(0, 1), last, rho.new_zeros(rho.shape[0], block_length - n)], -1)


def draft_agreement(rows: slice | Tensor, p: Tensor, q: Tensor, x: Tensor, log_s: Tensor, u: Tensor, live: Tensor,
                    levels: list[Level], scratch: Scratch) -> Tensor:
    """t_k of §4.3 on the rows `rows` of one draft: how far Y agrees with it, coupled with Y's current law (p [B, n, V]
    the target and q [B, n, V] the draft conditionals at its first n nodes, x [B, n] its tokens, log_s [B, n+1] their
    log draft joint masses, u [B, L] its uniforms, live [B] its live nodes). Always consistent with the known prefix
    of Y."""
    h = draft_acceptance(rows, p, q, x, log_s, u.shape[-1], live[rows], [level.of_rows(rows) for level in levels],
                         scratch)
    return last_success(h, u[rows])


def draft_acceptance(rows: slice | Tensor, p: Tensor, q: Tensor, x: Tensor, log_s: Tensor, block_length: int,
                     live: Tensor, levels: list[Level], scratch: Scratch) -> Tensor:
    """h_1..h_L [R, L] of one draft's coupling with Y's current law on the rows `rows` of p, q, x, log_s (as in
    draft_agreement; live [R] and the levels given for those rows, which may repeat). The levels are computed on the
    live nodes only: beyond them the path has zero mass (a point mass of an earlier level excludes it), so h = 0 there
    whatever the conditionals."""
    x, log_s = x[rows], log_s[rows]
    (R, n), V = x.shape, p.shape[-1]
    memory = scratch(Scratch.COND, R, n, V)
    cond = copy_rows(p, rows, memory) if levels else read_rows(p, rows, memory)  # the levels are written into it
    q = read_rows(q, rows, scratch(Scratch.DRAFT, R, n, V))
    apply_levels_(cond, q, x, log_s, levels, scratch, reach=live)
    return greedy_acceptance(cond, q, x, log_s, block_length, scratch(Scratch.WORK, R, n - 1, V))


class GreedyBlockVerifier(Verifier):
    name = "gbv"
    carries_state = True  # the pending levels (§4.2, §4.4)

    def verify(self, draft_tokens, draft_probs, target_probs, generator, state):
        tokens, q, p = draft_tokens, draft_probs, target_probs  # §4's letters, so the level algebra reads as there
        B, K, L = tokens.shape
        log_s = torch.cat([torch.zeros_like(q[:, :, :1, 0]), token_probs(q, tokens).log().cumsum(-1)], -1)
        common = same_prefix(tokens).sum(-1)  # [B, K, K] common prefix lengths
        levels = pending_to_levels(state, tokens)
        u = uniforms((B, K, L), q, generator)
        scratch = Scratch(q, B * L * q.shape[-1])
        done = torch.zeros(B, dtype=torch.bool, device=q.device)
        accepted = torch.zeros(B, dtype=torch.long, device=q.device)  # the longest agreement so far
        draft_index = torch.zeros_like(accepted)
        anchors = []
        for k in range(K):
            if done.all():
                break
            live = live_nodes(common[:, k], anchors, L)
            n = max(1, int(live.masked_fill(done, 0).max()))
            # Rows already done use none of the later drafts: only the rows still going are computed. Their accepted_k
            # is set to 0, which nothing reads: `longer`, live_nodes and the new level's end all mask done rows.
            going = rows_where(~done)
            accepted_k = torch.zeros_like(accepted)
            accepted_k[going] = draft_agreement(going, p[:, k, :n], q[:, k, :n], tokens[:, k, :n], log_s[:, k, : n + 1],
                                                u[:, k], live, levels, scratch)
            accepted_k.masked_fill_(done, 0)
            longer = ~done & (accepted_k > accepted)
            accepted = torch.where(longer, accepted_k, accepted)
            draft_index = torch.where(longer, k, draft_index)
            done |= accepted_k == L
            anchors.append((k, accepted_k))
            levels.append(Level(torch.zeros_like(log_s[:, 0, 0]), torch.zeros_like(log_s[:, 0, 0]), accepted_k,
                                torch.where(done, 0, L), tokens[:, k]))

        bonus = pick(p[:, :, L], draft_index)
        if done.all():
            return VerifierOutput(accepted, draft_index, sample(bonus, generator), None)
        # Replay every level along the best path to get the recovered token's law and each level's input there.
        node = torch.where(done, 0, accepted)
        n, V = int(node.max()) + 1, q.shape[-1]
        best = torch.arange(B, device=q.device) * K + draft_index  # the best drafts' rows in [B * K, ...]
        x, log_s_best = pick(tokens, draft_index)[:, :n], pick(log_s, draft_index)
        cond = copy_rows(p[:, :, :n].flatten(0, 1), best, scratch(Scratch.COND, B, n, V))
        q_best = copy_rows(q[:, :, :n].flatten(0, 1), best, scratch(Scratch.DRAFT, B, n, V))
        input_log_joint, input_at_node = apply_levels_(cond, q_best, x, log_s_best[:, : n + 1], levels, scratch,
                                                       reach=node + 1, node=node)
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

    def replicate_accepted(self, draft_tokens, draft_probs, target_probs, generator, replicas, state=None):
        """num_accepted of `replicas` calls, with their work shared: draft k is coupled with Y's law given the
        agreements t_1..t_{k-1} of the drafts before it (§4.3), so the replicas of a row that share those share
        draft k's h, computed once per distinct history; each replica draws only its t_k. tau is the longest
        agreement, so the recovered token's replay is not needed."""
        check_inputs(draft_tokens, draft_probs, target_probs)
        tokens, q, p = draft_tokens, draft_probs, target_probs
        (B, K, L), V = tokens.shape, q.shape[-1]
        log_s = torch.cat([torch.zeros_like(q[:, :, :1, 0]), token_probs(q, tokens).log().cumsum(-1)], -1)
        common = same_prefix(tokens).sum(-1)
        carried = pending_to_levels(state, tokens)
        u = uniforms((B, replicas, K, L), q, generator).flatten(0, 1)  # [B * replicas, K, L]
        row = torch.arange(B, device=q.device).repeat_interleave(replicas)
        accepted, done, history = torch.zeros_like(row), torch.zeros_like(row, dtype=torch.bool), []
        for k in range(K):
            going = (~done).nonzero().squeeze(1)
            if going.numel() == 0:
                break
            groups, group_of = torch.stack([row, *history], -1)[going].unique(dim=0, return_inverse=True)
            rows, agreements = groups[:, 0], groups[:, 1:]
            zero, full = torch.zeros_like(rows, dtype=log_s.dtype), torch.full_like(rows, L)
            levels = [level.of_rows(rows) for level in carried] + [
                Level(zero, zero, agreements[:, j], full, tokens[rows, j]) for j in range(k)]
            live = live_nodes(common[rows, k], [(j, agreements[:, j]) for j in range(k)], L)
            n = max(1, int(live.max()))
            h = draft_acceptance(rows, p[:, k, :n], q[:, k, :n], tokens[:, k, :n], log_s[:, k, : n + 1], L, live,
                                 levels, Scratch(q, rows.numel() * L * V))
            t_k = torch.zeros_like(row)
            t_k[going] = last_success(h[group_of], u[going, k])
            accepted = torch.maximum(accepted, t_k)
            done |= t_k == L
            history.append(t_k)
        return accepted.view(B, replicas).T

    def accepted_law(self, draft_tokens, draft_probs, target_probs, state=None):
        """One draft: the greedy coupling's own h (§4.1) against the target with the state's pending levels in force
        (§4.4; none from a fresh state), as verify() computes it for its first draft, whose t_1 is tau. Several:
        None, RGBV's chain of residual levels has no closed form written here."""
        if draft_tokens.shape[1] > 1:
            return None
        x, q, L = draft_tokens[:, 0], draft_probs[:, 0], draft_tokens.shape[-1]
        log_s = torch.cat([torch.zeros_like(q[:, :1, 0]), token_probs(q, x).log().cumsum(-1)], -1)
        cond, levels = target_probs[:, 0, :L], pending_to_levels(state, draft_tokens)
        if levels:
            cond = cond.clone()  # the levels are written into it
            apply_levels_(cond, q, x, log_s, levels, Scratch(q, x.shape[0] * L * q.shape[-1]),
                          reach=torch.full_like(x[:, 0], L))
        return last_success_law(greedy_acceptance(cond, q, x, log_s, L))


def live_nodes(common: Tensor, anchors: list[tuple[int, Tensor]], block_length: int) -> Tensor:
    """How many leading nodes of a draft can carry target mass, per row: an earlier draft j that had accepted_j tokens
    accepted revealed that Y starts with them, so a draft that leaves them after c < accepted_j common tokens has
    zero mass from depth c + 1 on. Computing only those nodes is what keeps later drafts cheap."""
    limit = torch.full_like(common[:, 0], block_length)
    for j, accepted_j in anchors:
        limit = torch.where(common[:, j] < accepted_j, torch.minimum(limit, common[:, j] + 1), limit)
    return limit


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

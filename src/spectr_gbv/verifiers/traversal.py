"""Traversal verification (Weng et al., NeurIPS 2025, arXiv:2505.12398; docs/algorithms.md §14): test the draft
trie's nodes from the leaves up against sequence-level weights, in depth-first order with children in order of first
appearance among the drafts. That order is what makes it lossless on K i.i.d. drafts (§14): each next child of a node
is then a draw from the node's draft law without the children already deleted."""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from .base import Verifier, VerifierOutput, check_inputs, normalise, sample, uniforms


@dataclass
class Test:
    """The node every row tests at one step of its traversal, had all its earlier tests failed."""

    depth: Tensor  # int64 [B], 0..L; depth 0 is the root, tested last, whose weight is exactly 1
    weight: Tensor  # [B] the probability of accepting the node
    row: Tensor  # int64 [B] the lowest-index draft through the node
    target: Tensor  # [B, V] what follows an accepted node: the bonus law at depth L, else the node's residual
    live: Tensor  # bool [B] False once the row has tested its root


def trie_order(x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The draft trie of x [B, K, L], its leaves in the order the traversal visits them. Returns
    node_rows [B, K, L+1]: the lowest-index draft through draft k's depth-d node (its distributions are read there);
    order [B, K]: the distinct drafts in depth-first order, children by first appearance, duplicates last;
    leaves [B]: the number of distinct drafts; branch [B, K]: the depth of the deepest node leaf i shares with
    leaf i+1, 0 after the last leaf."""
    B, K, L = x.shape
    same = (x[:, :, None] == x[:, None]).long().cumprod(-1)  # [B, K, K, L]: drafts j and k agree on d+1 tokens
    owner = same.argmax(1)  # [B, K, L]: the first draft through each node
    node_rows = torch.cat([torch.zeros_like(owner[..., :1]), owner], -1)
    order = torch.arange(K, device=x.device).expand(B, K)
    for d in reversed(range(L)):  # stable sorts from the last key: lexicographic in (owner at depth 1, 2, ...)
        order = order.gather(1, owner[:, :, d].gather(1, order).argsort(dim=-1, stable=True))
    duplicate = owner[..., -1] != torch.arange(K, device=x.device)
    order = order.gather(1, duplicate.gather(1, order).long().argsort(dim=-1, stable=True))
    leaves = (~duplicate).sum(-1)
    batch = torch.arange(B, device=x.device)[:, None]
    branch = same.sum(-1)[batch, order, order.roll(-1, 1)]
    branch = torch.where(torch.arange(K, device=x.device) + 1 < leaves[:, None], branch, 0)
    return node_rows, order, leaves, branch


def child_weight(weight: Tensor, p: Tensor, q: Tensor) -> Tensor:
    """min(1, w p / q) without dividing when it is 1 (q > 0 for every drafted token)."""
    wp = weight * p
    return torch.where(wp < q, wp / q, torch.ones_like(wp))


def traversal_tests(x: Tensor, q: Tensor, p: Tensor) -> Iterator[Test]:
    """Every row's tests in traversal order, each row's state updated as if each test failed: a row's outcome is its
    first passed test. The state is kept only along the current leaf's path (depths 0..L-1): a node's target and
    draft laws differ from the inputs only once it has lost a child, and then its subtree's later nodes are fresh."""
    B, K, L = x.shape
    device, V = x.device, q.shape[-1]
    node_rows, order, leaves, branch = trie_order(x)
    batch, depths = torch.arange(B, device=device), torch.arange(L, device=device)
    drafted = (batch[:, None, None], node_rows[..., :L], depths, x)
    p_drafted, q_drafted = p[drafted], q[drafted]  # [B, K, L]: each draft token's p and q, read from its node's row
    changed = torch.zeros(B, L + 1, dtype=torch.bool, device=device)  # depth L never loses a child
    target_now, draft_now = torch.zeros(B, L, V, dtype=p.dtype, device=device), torch.zeros_like(q[:, 0])
    weight = torch.ones(B, L + 1, dtype=p.dtype, device=device)
    position = torch.zeros(B, dtype=torch.long, device=device)
    depth = torch.full((B,), L, dtype=torch.long, device=device)
    live = torch.ones(B, dtype=torch.bool, device=device)

    def law_at(given: Tensor, now: Tensor, rows: Tensor, d: Tensor) -> Tensor:
        """[B, V] the current law of the depth-d node of each row's path."""
        return torch.where(changed[batch, d, None], now[batch, d.clamp(max=L - 1)], given[batch, rows[batch, d], d])

    def descend(start: Tensor, moving: Tensor) -> None:
        """Weights of the new leaf's path below depth `start`, w_{d+1} = min(1, w_d p / q), from its current laws."""
        leaf = order[batch, position]
        tokens = x[batch, leaf, :, None]
        p_path = torch.where(changed[:, :L], target_now.gather(-1, tokens).squeeze(-1), p_drafted[batch, leaf])
        q_path = torch.where(changed[:, :L], draft_now.gather(-1, tokens).squeeze(-1), q_drafted[batch, leaf])
        for d in range(L):
            step = moving & (d >= start)
            weight[:, d + 1] = torch.where(step, child_weight(weight[:, d], p_path[:, d], q_path[:, d]),
                                           weight[:, d + 1])

    descend(torch.zeros_like(depth), live)
    for _ in range(K * L + 1):  # one test per node, the root's last
        leaf = order[batch, position]
        rows = node_rows[batch, leaf]  # [B, L+1]
        yield Test(depth, weight[batch, depth], rows[batch, depth], law_at(p, target_now, rows, depth), live)
        # the failed node is deleted: its parent's target becomes the weighted residual, its draft law loses the token
        parent = (depth - 1).clamp_min(0)
        rejected = live & (depth > 0)
        w = weight[batch, parent]
        target, draft = law_at(p, target_now, rows, parent), law_at(q, draft_now, rows, parent)
        excess = (w[:, None] * target - draft).clamp_min(0)
        total = excess.sum(-1)
        denominator = total + (1 - w)  # 1 - w first: at the root, total / total = 1 exactly
        token = x[batch, leaf, parent, None]
        target_now[batch, parent] = torch.where(rejected[:, None], normalise(excess, target), target_now[batch, parent])
        draft_now[batch, parent] = torch.where(rejected[:, None], normalise(draft.scatter(-1, token, 0.0), draft),
                                               draft_now[batch, parent])
        weight[batch, parent] = torch.where(rejected & (denominator > 0), total / denominator,
                                            torch.where(rejected, 1.0, w))
        changed[batch, parent] |= rejected
        # next: the parent if it has no child left, the next leaf if it branches off here, the root after the last
        moving = rejected & (parent == branch[batch, position]) & (position < leaves - 1)
        live = live & (depth > 0)
        depth = torch.where(moving, L, torch.where(rejected, parent, depth))
        position = position + moving
        changed &= ~(moving[:, None] & (torch.arange(L + 1, device=device) > parent[:, None]))
        descend(parent, moving)


class TraversalVerifier(Verifier):
    """Weng et al.: the first node whose test passes, leaves first, emits its path and a token of its law."""

    name = "traversal"

    def verify(self, draft_tokens, draft_probs, target_probs, generator, state):
        B, K, L = draft_tokens.shape
        u = uniforms((B, K, L), target_probs, generator)  # one per node: (its lowest-index draft, its depth - 1)
        batch = torch.arange(B, device=draft_tokens.device)
        accepted = torch.full((B,), -1, dtype=torch.long, device=draft_tokens.device)
        draft_index = torch.zeros_like(accepted)
        law = None
        for test in traversal_tests(draft_tokens, draft_probs, target_probs):
            first = test.live & (accepted < 0) & (u[batch, test.row, (test.depth - 1).clamp_min(0)] < test.weight)
            accepted = torch.where(first, test.depth, accepted)
            draft_index = torch.where(first, test.row, draft_index)
            law = test.target if law is None else torch.where(first[:, None], test.target, law)
            if (accepted >= 0).all():
                break
        return VerifierOutput(accepted, draft_index, sample(law, generator))

    def expected_accepted(self, draft_tokens: Tensor, draft_probs: Tensor, target_probs: Tensor) -> Tensor:
        """E[num_accepted] [B] float64 given the drafts: test t is reached if every earlier one failed."""
        check_inputs(draft_tokens, draft_probs, target_probs)
        reach = torch.ones(draft_tokens.shape[0], dtype=torch.float64, device=draft_tokens.device)
        mean = torch.zeros_like(reach)
        for test in traversal_tests(draft_tokens, draft_probs, target_probs):
            w = test.weight.double() * test.live
            mean += reach * w * test.depth
            reach = reach * (1 - w)
        return mean

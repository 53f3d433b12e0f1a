"""Traversal verification (Weng et al., NeurIPS 2025, arXiv:2505.12398; docs/algorithms.md §14): test the draft
trie's nodes from the leaves up against sequence-level weights, in depth-first order with children in order of first
appearance among the drafts. That order is what makes it lossless on K i.i.d. drafts (§14): each next child of a node
is then a draw from the node's draft law without the children already deleted."""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from .base import Verifier, VerifierOutput, check_inputs, normalise, pick, sample, uniforms


@dataclass
class NodeTest:
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
    shared = same.sum(-1).gather(1, order[..., None].expand(B, K, K))  # [B, K, K]: prefix length leaf i shares
    branch = shared.gather(2, order.roll(-1, 1)[..., None]).squeeze(-1)
    branch = torch.where(torch.arange(K, device=x.device) + 1 < leaves[:, None], branch, 0)
    return node_rows, order, leaves, branch


def child_weight(weight: Tensor, p: Tensor, q: Tensor) -> Tensor:
    """min(1, w p / q) without dividing when it is 1 (q > 0 for every drafted token)."""
    wp = weight * p
    return torch.where(wp < q, wp / q, torch.ones_like(wp))


def put(x: Tensor, index: Tensor, value: Tensor) -> None:
    """x[b, index[b]] = value[b] in place for x [B, N, ...]: pick's inverse (gathers and scatters, not advanced
    indexing, which is an order of magnitude slower on CPU)."""
    view = index.view(-1, *([1] * (x.dim() - 1))).expand(-1, 1, *x.shape[2:])
    x.scatter_(1, view, value.unsqueeze(1))


def traversal_tests(x: Tensor, q: Tensor, p: Tensor) -> Iterator[NodeTest]:
    """Every row's tests in traversal order, each row's state updated as if each test failed: a row's outcome is its
    first passed test. The state is kept only along the current leaf's path (depths 0..L-1): a node's target and
    draft laws differ from the inputs only once it has lost a child, and then its subtree's later nodes are fresh."""
    B, K, L = x.shape
    device, V = x.device, q.shape[-1]
    node_rows, order, leaves, branch = trie_order(x)
    depths = torch.arange(L, device=device)
    p_nodes, q_nodes = p.flatten(1, 2), q.flatten(1, 2)  # [B, K (L+1), V], [B, K L, V]: (draft, depth) rows

    def drafted(probs: Tensor, stride: int) -> Tensor:
        """[B, K, L] each draft token's probability, read from its node's row."""
        flat = ((node_rows[..., :L] * stride + depths) * V + x).flatten(1)
        return probs.reshape(B, -1).gather(1, flat).view(B, K, L)

    p_drafted, q_drafted = drafted(p, L + 1), drafted(q, L)
    changed = torch.zeros(B, L + 1, dtype=torch.bool, device=device)  # depth L never loses a child
    target_now, draft_now = torch.zeros(B, L, V, dtype=p.dtype, device=device), torch.zeros_like(q[:, 0])
    weight = torch.ones(B, L + 1, dtype=p.dtype, device=device)
    position = torch.zeros(B, dtype=torch.long, device=device)
    depth = torch.full((B,), L, dtype=torch.long, device=device)
    live = torch.ones(B, dtype=torch.bool, device=device)

    def law_at(given: Tensor, stride: int, now: Tensor, rows: Tensor, d: Tensor) -> Tensor:
        """[B, V] the current law of the depth-d node of each row's path."""
        return torch.where(pick(changed, d)[:, None], pick(now, d.clamp(max=L - 1)),
                           pick(given, pick(rows, d) * stride + d))

    def descend(start: Tensor, moving: Tensor) -> None:
        """Weights of the new leaf's path below depth `start`, w_{d+1} = min(1, w_d p / q), from its current laws."""
        leaf = pick(order, position)
        tokens = pick(x, leaf)[..., None]
        p_path = torch.where(changed[:, :L], target_now.gather(-1, tokens).squeeze(-1), pick(p_drafted, leaf))
        q_path = torch.where(changed[:, :L], draft_now.gather(-1, tokens).squeeze(-1), pick(q_drafted, leaf))
        for d in range(L):
            step = moving & (d >= start)
            weight[:, d + 1] = torch.where(step, child_weight(weight[:, d], p_path[:, d], q_path[:, d]),
                                           weight[:, d + 1])

    descend(torch.zeros_like(depth), live)
    for _ in range(K * L + 1):  # one test per node, the root's last
        leaf = pick(order, position)
        rows = pick(node_rows, leaf)  # [B, L+1]
        yield NodeTest(depth, pick(weight, depth), pick(rows, depth),
                       law_at(p_nodes, L + 1, target_now, rows, depth), live)
        # the failed node is deleted: its parent's target becomes the weighted residual, its draft law loses the token
        parent = (depth - 1).clamp_min(0)
        rejected = live & (depth > 0)
        w = pick(weight, parent)
        target = law_at(p_nodes, L + 1, target_now, rows, parent)
        draft = law_at(q_nodes, L, draft_now, rows, parent)
        excess = (w[:, None] * target - draft).clamp_min(0)
        total = excess.sum(-1)
        denominator = total + (1 - w)  # 1 - w first: at the root, total / total = 1 exactly
        token = pick(pick(x, leaf), parent)[:, None]
        put(target_now, parent, torch.where(rejected[:, None], normalise(excess, target), pick(target_now, parent)))
        put(draft_now, parent, torch.where(rejected[:, None], normalise(draft.scatter(-1, token, 0.0), draft),
                                           pick(draft_now, parent)))
        put(weight, parent, torch.where(rejected & (denominator > 0), total / denominator,
                                        torch.where(rejected, 1.0, w)))
        put(changed, parent, pick(changed, parent) | rejected)
        # next: the parent if it has no child left, the next leaf if it branches off here, the root after the last
        moving = rejected & (parent == pick(branch, position)) & (position < leaves - 1)
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
        accepted = torch.full((B,), -1, dtype=torch.long, device=draft_tokens.device)
        draft_index = torch.zeros_like(accepted)
        law = None
        for test in traversal_tests(draft_tokens, draft_probs, target_probs):
            u_node = pick(pick(u, test.row), (test.depth - 1).clamp_min(0))  # the root passes whatever u
            first = test.live & (accepted < 0) & (u_node < test.weight)
            accepted = torch.where(first, test.depth, accepted)
            draft_index = torch.where(first, test.row, draft_index)
            law = test.target if law is None else torch.where(first[:, None], test.target, law)
            if (accepted >= 0).all():  # most rows pass within a few tests: skip the rest of the trie
                break
        return VerifierOutput(accepted, draft_index, sample(law, generator))

    def accepted_law(self, draft_tokens: Tensor, draft_probs: Tensor, target_probs: Tensor) -> Tensor:
        """P(num_accepted = i), i = 0..L [B, L+1] float64, given the drafts: the order of the tests is fixed by the
        trie, and test t decides the outcome when every earlier one failed."""
        check_inputs(draft_tokens, draft_probs, target_probs)
        B, _, L = draft_tokens.shape
        reach = torch.ones(B, dtype=torch.float64, device=draft_tokens.device)
        law = torch.zeros(B, L + 1, dtype=torch.float64, device=draft_tokens.device)
        for test in traversal_tests(draft_tokens, draft_probs, target_probs):
            w = test.weight.double() * test.live
            law.scatter_add_(1, test.depth[:, None], (reach * w)[:, None])
            reach = reach * (1 - w)
            if not reach.any():  # a test of weight 1 passed in every row: the later ones add nothing
                break
        return law

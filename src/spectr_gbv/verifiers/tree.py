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

    def node_law(self, p: Tensor, q: Tensor, children: Tensor, alive: Tensor) -> Tensor:
        """The law of choose()'s token [B, V], its uniforms integrated out (same arguments)."""
        raise NotImplementedError

    def accepted_law(self, draft_tokens, draft_probs, target_probs):
        """Forward over the trie: P(tau >= d + 1) is the mass of reaching a node at depth d and choosing one of its
        children, the reach of a child that of its parent times the parent's node law there. Each node's law is
        computed once, for the draft that names it (the lowest-index one through it, whose row verify() reads)."""
        B, K, L = draft_tokens.shape
        common = (draft_tokens[:, :, None] == draft_tokens[:, None]).long().cumprod(-1).sum(-1)  # [B, K, K]
        drafts = torch.arange(K, device=draft_tokens.device)
        earlier = drafts[None, :] < drafts[:, None]  # [j, j']: j' < j
        reach = torch.ones_like(draft_probs[:, :, 0, 0])  # [B, K]: of the node draft k is at
        at_least = []
        for d in range(L):
            alive = common >= d  # [B, K, K]: the drafts through draft k's node at depth d
            row = first_alive(alive)  # [B, K]: the draft that names draft k's node
            names_node = row == drafts
            nodes = names_node.flatten().nonzero().squeeze(1)  # in [B * K]
            children = draft_tokens[:, :, d]
            node_children = children.repeat_interleave(K, 0)[nodes]  # [N, K]
            law = self.node_law(target_probs[:, :, d].flatten(0, 1)[nodes], draft_probs[:, :, d].flatten(0, 1)[nodes],
                                node_children, alive.flatten(0, 1)[nodes])
            at_node_child = reach.new_zeros(B * K, K)
            at_node_child[nodes] = law.gather(-1, node_children)
            # node k's law at j's child [B, K, K], read from the draft that names node k
            at_child = at_node_child.view(B, K, K).gather(1, row[..., None].expand(-1, -1, K))
            same_token = children[:, :, None] == children[:, None, :]  # [B, j, j']
            repeated = (alive[:, :, None, :] & same_token[:, None] & earlier).any(-1)  # j's child came earlier
            child_mass = (at_child * (alive & ~repeated)).sum(-1)
            at_least.append((reach * child_mass * names_node).sum(-1))  # count each node once
            reach = reach * at_child.diagonal(dim1=1, dim2=2)
        at_least = torch.stack([torch.ones_like(at_least[0]), *at_least, torch.zeros_like(at_least[0])], -1)
        return at_least[:, :-1] - at_least[:, 1:]


class NaiveVerifier(TreeVerifier):
    """NSS: sample from the target and descend if it happens to be a child."""

    name = "nss"

    def choose(self, p, q, children, alive, generator):
        return sample(p, generator)

    def node_law(self, p, q, children, alive):
        return p


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

    def node_law(self, p, q, children, alive):
        law, reach, current = torch.zeros_like(p), torch.ones_like(p[:, 0]), p
        for j in range(children.shape[1]):
            c = children[:, j:j + 1]
            accept = (current.gather(-1, c) / q.gather(-1, c)).squeeze(-1).clamp(max=1)
            accept = torch.where(alive[:, j], accept, 0.0)  # q(c) may be 0 where draft j is elsewhere
            law.scatter_add_(-1, c, (reach * accept)[:, None])
            reach = reach * (1 - accept)
            current = torch.where(alive[:, j:j + 1], normalise((current - q).clamp_min(0), current), current)
        return law + reach[:, None] * current


def kseq_rho(p: Tensor, q: Tensor, k: Tensor) -> Tensor:
    """Smallest rho in [1, k] with 1 - (1 - beta(rho))^k <= rho beta(rho), by bisection; the upper end is always
    on the valid side, so the residual stays non-negative whatever the number of steps. A node with one draft through
    it has the bracket [1, 1]: only the others are bisected, each a pass over the vocabulary per step."""
    rho = k.clone()
    several = (k > 1).nonzero().squeeze(1)
    if several.numel() == 0:
        return rho
    p, q, k = p[several], q[several], k[several]
    lo, hi = torch.ones_like(k), k.clone()
    for _ in range(RHO_BISECTION_STEPS):
        mid = (lo + hi) / 2
        beta = torch.minimum(q, p / mid[:, None]).sum(-1)
        too_small = 1 - (1 - beta) ** k >= mid * beta
        lo, hi = torch.where(too_small, mid, lo), torch.where(too_small, hi, mid)
    return rho.index_put_((several,), hi)


class SpecTrVerifier(TreeVerifier):
    """SpecTr K-SEQ: accept candidate j with probability min(1, p/(rho* q)), else sample the K-SEQ residual."""

    name = "spectr"

    def choose(self, p, q, children, alive, generator):
        ratio, residual = kseq_node(p, q, children, alive)
        accepted = alive & (uniforms(children.shape, p, generator) < ratio)
        first = accepted.long().argmax(-1)
        return torch.where(accepted.any(-1), children.gather(-1, first[:, None]).squeeze(-1),
                           sample(residual, generator))

    def node_law(self, p, q, children, alive):
        ratio, residual = kseq_node(p, q, children, alive)
        accept = torch.where(alive, ratio.clamp(max=1), 0.0)
        passed_over = torch.cat([torch.ones_like(accept[:, :1]), (1 - accept).cumprod(-1)], -1)  # all before j reject
        law = torch.zeros_like(p).scatter_add_(-1, children, passed_over[:, :-1] * accept)
        return law + passed_over[:, -1:] * residual


def kseq_node(p: Tensor, q: Tensor, children: Tensor, alive: Tensor) -> tuple[Tensor, Tensor]:
    """K-SEQ at a node (§5.2): each candidate's acceptance ratio p/(rho* q) [B, K] (accepted while u < ratio) and
    the residual law after every candidate is rejected [B, V]."""
    k = alive.sum(-1).to(p.dtype)
    rho = kseq_rho(p, q, k)
    capped = torch.minimum(q, p / rho[:, None])
    beta = capped.sum(-1)
    ratio = p.gather(-1, children) / (rho[:, None] * q.gather(-1, children))
    scale = torch.where(beta > 0, (1 - (1 - beta) ** k) / beta.clamp_min(torch.finfo(p.dtype).tiny), 0.0)
    return ratio, normalise((p - capped * scale[:, None]).clamp_min(0), p)

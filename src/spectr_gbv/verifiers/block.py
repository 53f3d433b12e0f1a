"""Single-path verifiers: token-level speculative sampling (docs/algorithms.md §2), block verification (§3), and
Thomas and Pal's greedy multi-path block verification (§8), which is block verification of the best of the K paths
against that path's exact ("skewed") draft law."""
from __future__ import annotations

import torch
from torch import Tensor

from .base import (Verifier, VerifierOutput, last_success, last_success_law, normalise, pick, sample, token_probs,
                   uniforms)


def recovered_or_bonus(p: Tensor, q: Tensor, accepted: Tensor, weight: Tensor, generator) -> Tensor:
    """next_token: the bonus ~ p(.|x^L) when accepted = L, else the recovered token ~ norm((w p - q)_+) at
    x^accepted, w = weight (BV's w_tau, docs/algorithms.md §3). p [B, L+1, V], q [B, L, V], accepted and weight [B]."""
    L = q.shape[1]
    p_node = pick(p, accepted)
    q_node = pick(q, accepted.clamp(max=L - 1))
    residual = normalise((weight[:, None] * p_node - q_node).clamp_min(0), p_node)
    return sample(torch.where((accepted == L)[:, None], p_node, residual), generator)


class TokenVerifier(Verifier):
    """Leviathan et al. / Chen et al.: accept token i with probability min(1, p/q), stop at the first rejection."""

    name = "token"
    max_drafts = 1

    def verify(self, draft_tokens, draft_probs, target_probs, generator, state):
        x, q, p = draft_tokens[:, 0], draft_probs[:, 0], target_probs[:, 0]  # the single draft, in §2's letters
        passes = uniforms(x.shape, q, generator) < token_probs(p, x) / token_probs(q, x)
        accepted = passes.long().cumprod(-1).sum(-1)  # up to the first rejection
        next_token = recovered_or_bonus(p, q, accepted, torch.ones_like(p[:, 0, 0]), generator)
        return VerifierOutput(accepted, torch.zeros_like(accepted), next_token)

    def accepted_law(self, draft_tokens, draft_probs, target_probs):
        """P(tau >= i) = prod_{j<=i} min(1, p_j/q_j): the differences of its reach."""
        x, q, p = draft_tokens[:, 0], draft_probs[:, 0], target_probs[:, 0]
        reach = (token_probs(p, x) / token_probs(q, x)).clamp(max=1).cumprod(-1)
        reach = torch.cat([torch.ones_like(reach[:, :1]), reach, torch.zeros_like(reach[:, :1])], -1)
        return reach[:, :-1] - reach[:, 1:]


def bv_acceptance(x: Tensor, q: Tensor, p: Tensor) -> tuple[Tensor, Tensor]:
    """Block verification's h_1..h_L [B, L] and weights w_0..w_L [B, L+1] (docs/algorithms.md §3), weights in
    log space."""
    log_ratio = token_probs(p, x).log() - token_probs(q, x).log()
    log_w = [torch.zeros_like(log_ratio[:, 0])]
    for i in range(x.shape[1]):
        log_w.append((log_w[-1] + log_ratio[:, i]).clamp(max=0))
    w = torch.stack(log_w, -1).exp()
    L = x.shape[1]
    excess = (w[:, 1:L, None] * p[:, 1:L] - q[:, 1:L]).clamp_min(0).sum(-1)
    denominator = excess + 1 - w[:, 1:L]
    h_inner = torch.where(denominator > 0, excess / denominator.clamp_min(torch.finfo(w.dtype).tiny),
                          torch.ones_like(excess))
    return torch.cat([h_inner, w[:, L:]], -1), w


def block_verify(x: Tensor, q: Tensor, p: Tensor, generator) -> tuple[Tensor, Tensor]:
    """Block verification of one path: x [B, L], q [B, L, V], p [B, L+1, V] -> (accepted, next_token)."""
    h, w = bv_acceptance(x, q, p)
    accepted = last_success(h, uniforms(h.shape, h, generator))
    return accepted, recovered_or_bonus(p, q, accepted, pick(w, accepted), generator)


class BlockVerifier(Verifier):
    """Sun et al. (ICLR 2025): accept the longest sub-block that survives a backward pass of tests."""

    name = "bv"
    max_drafts = 1

    def verify(self, draft_tokens, draft_probs, target_probs, generator, state):
        accepted, next_token = block_verify(draft_tokens[:, 0], draft_probs[:, 0], target_probs[:, 0], generator)
        return VerifierOutput(accepted, torch.zeros_like(accepted), next_token)

    def accepted_law(self, draft_tokens, draft_probs, target_probs):
        return last_success_law(bv_acceptance(draft_tokens[:, 0], draft_probs[:, 0], target_probs[:, 0])[0])


def best_path(tokens: Tensor, q: Tensor, p: Tensor) -> tuple[Tensor, Tensor]:
    """Walk the draft trie from the root, stepping to the child with the largest key (min(1, p/q), token id).
    Returns the index of a draft equal to the selected path [B] and, per depth, the lowest-index draft through the
    selected node [B, L]: every distribution of a node is read from that one row, so selection and skew agree."""
    B, K, L = tokens.shape
    alive = torch.ones(B, K, dtype=torch.bool, device=tokens.device)
    node_rows = []
    for d in range(L):
        row = alive.long().argmax(-1)
        node_rows.append(row)
        candidates = tokens[:, :, d]
        key = ratio_key(pick(p[:, :, d], row), pick(q[:, :, d], row)).gather(-1, candidates)
        key = key.masked_fill(~alive, -2.0)
        ties = key == key.amax(-1, keepdim=True)
        chosen = candidates.masked_fill(~ties, -1).amax(-1)
        alive &= candidates == chosen[:, None]
    return alive.long().argmax(-1), torch.stack(node_rows, -1)


def ratio_key(p: Tensor, q: Tensor) -> Tensor:
    """min(1, p/q) per token; tokens the drafter cannot produce rank last (-1)."""
    return torch.where(q > 0, (p / q.clamp_min(torch.finfo(q.dtype).tiny)).clamp(max=1), torch.full_like(q, -1.0))


def skewed_draft(x: Tensor, q_nodes: Tensor, p_nodes: Tensor, num_drafts: int) -> Tensor:
    """Exact law of the lexicographic maximum of K i.i.d. paths along the selected path x (docs/algorithms.md
    §8, step 3). Keeps the masses below / on the path normalised (a + s = 1) so nothing under- or overflows with
    depth. One path is its own maximum: its law is q itself."""
    if num_drafts == 1:
        return q_nodes
    B, L, V = q_nodes.shape
    below_mass = torch.zeros(B, dtype=q_nodes.dtype, device=q_nodes.device)  # a = A_v / D
    path_mass = torch.ones_like(below_mass)  # s = x_v / D
    skewed = []
    for d in range(L):
        qn = q_nodes[:, d]
        order = ratio_key(p_nodes[:, d], qn).argsort(dim=-1, stable=True)  # ascending key, ties by token id
        q_sorted = qn.gather(-1, order)
        below = torch.empty_like(qn).scatter_(-1, order, q_sorted.cumsum(-1) - q_sorted)  # F^-(c)
        u = below_mass[:, None] + path_mass[:, None] * below
        w = path_mass[:, None] * qn
        numerator = sum((u + w) ** j * u ** (num_drafts - 1 - j) for j in range(num_drafts))
        denominator = sum(below_mass ** j for j in range(num_drafts))
        skewed.append(qn * numerator / denominator[:, None])
        c = x[:, d:d + 1]
        below_mass = below_mass + path_mass * below.gather(-1, c).squeeze(-1)
        path_mass = path_mass * qn.gather(-1, c).squeeze(-1)
        total = below_mass + path_mass
        below_mass, path_mass = below_mass / total, path_mass / total
    return torch.stack(skewed, 1)


class MultiPathVerifier(Verifier):
    """Thomas and Pal: select the best of the K paths, then block-verify it against its skewed draft law.
    Selection and skew use the same strict key (ratio, token id): the reference code's mismatch is biased."""

    name = "multipath"

    def verify(self, draft_tokens, draft_probs, target_probs, generator, state):
        selected, x, q_skewed, p_nodes = self.selected_path(draft_tokens, draft_probs, target_probs)
        accepted, next_token = block_verify(x, q_skewed, p_nodes, generator)
        return VerifierOutput(accepted, selected, next_token)

    def accepted_law(self, draft_tokens, draft_probs, target_probs):
        _, x, q_skewed, p_nodes = self.selected_path(draft_tokens, draft_probs, target_probs)
        return last_success_law(bv_acceptance(x, q_skewed, p_nodes)[0])

    @staticmethod
    def selected_path(draft_tokens, draft_probs, target_probs) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The draft index of the best path [B], its tokens [B, L], its skewed draft law [B, L, V] and the target
        along it [B, L+1, V]: what block verification then runs on."""
        B, K, L = draft_tokens.shape
        selected, node_rows = best_path(draft_tokens, draft_probs, target_probs)
        x = pick(draft_tokens, selected)
        rows, positions = torch.arange(B)[:, None], torch.arange(L, device=draft_tokens.device)
        q_nodes = draft_probs[rows, node_rows, positions]
        p_nodes = torch.cat([target_probs[rows, node_rows, positions], pick(target_probs, selected)[:, L:]], 1)
        return selected, x, skewed_draft(x, q_nodes, p_nodes, K), p_nodes

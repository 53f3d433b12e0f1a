"""`spectr_gbv_paper`: the SpecTr-GBV acceptance rule as published (docs/algorithms.md §9), kept to reproduce the
paper's numbers.

NOT lossless at temperature > 0: for K >= 2 its output law differs from the target's even for one token, and it
omits the target modification that greedy block verification needs across iterations (docs/algorithms.md §9.2; law
error 0.02 to 0.04 on the anchors, §9.3). At temperature 0 it reduces to the longest match with the greedy path,
which is exact. Use `gbv` for anything that needs exactness.

Notation (docs/algorithms.md §9.1): S, B the draft and target joint masses of a sub-block (`draft_mass`,
`target_mass`), a = min(1, S/B), f = 1 - (1 - a)^K, G = B f (`gain`), sigma = 1 - (1 - S)^K.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .base import (Verifier, VerifierOutput, check_inputs, normalise, pick, same_prefix, sample, token_probs,
                   uniforms)

DENOMINATOR_GUARD = 1e-20  # as in the published code
MAX_RATIO = 1e30  # S/B beyond this already makes every a = 1; keeps the ratio finite in float32
# Floor under the float64 target mass B in S/B: where B = 0 (the target excludes a drafted token, e.g. by top-k) the
# ratio stays finite, S / MASS_FLOOR <= 1e300 as S <= 1, and a float64 underflow of both masses gives 0, not 0/0.
# Such nodes have G = B f ~ 0 whatever the floor. Not finfo(float64).tiny: that would move the masses in
# (tiny, 1e-300) off the floor and change this rule's results there.
MASS_FLOOR = 1e-300


class PaperSpecTrGBVVerifier(Verifier):
    name = "spectr_gbv_paper"
    lossless = False

    def verify(self, draft_tokens, draft_probs, target_probs, generator, state):
        tokens, q, p = draft_tokens, draft_probs, target_probs  # §9's letters, so the formulas read as there
        B, K, L = tokens.shape
        tests = acceptance_tests(tokens, q, p)
        accepted, draft_index, done = walk(tests, uniforms((B, K, L), q, generator), uniforms((B, K), q, generator))
        # the recovered token, from the G-residual at the accepted sub-block "acc": p(c) (1 - a(acc c))^K
        p_node = pick(pick(p, draft_index), accepted)
        q_node = pick(pick(q, draft_index), accepted.clamp(max=L - 1))
        ratio = pick(tests.mass_ratio, draft_index).gather(-1, accepted[:, None]).clamp(max=MAX_RATIO)
        residual = p_node - child_coverage(p_node, q_node, ratio.to(q.dtype), K)
        next_token = sample(torch.where(done[:, None], p_node, normalise(residual.clamp_min(0), p_node)), generator)
        return VerifierOutput(accepted, draft_index, next_token)

    def replicate_accepted(self, draft_tokens, draft_probs, target_probs, generator, replicas, state=None):
        """The vocabulary-wide work is in the thresholds, which do not depend on the uniforms: computed once, then
        only the walk over the K x L tests is replicated."""
        check_inputs(draft_tokens, draft_probs, target_probs)
        B, K, L = draft_tokens.shape
        tests = acceptance_tests(draft_tokens, draft_probs, target_probs)
        return torch.stack([walk(tests, uniforms((B, K, L), draft_probs, generator),
                                 uniforms((B, K), draft_probs, generator))[0] for _ in range(replicas)])


@dataclass
class AcceptanceTests:
    """The rule's thresholds (§9.1) for every draft: h of its sub-blocks x^1..x^{L-1} [B, K, L-1] and of its full
    block [B, K], which drafts agree on which prefixes, and S/B per node [B, K, L+1] for the recovered token."""
    h_sub: Tensor
    h_full: Tensor
    agree: Tensor
    mass_ratio: Tensor


def acceptance_tests(tokens: Tensor, q: Tensor, p: Tensor) -> AcceptanceTests:
    K, L = tokens.shape[1:]
    # Joint masses of whole blocks underflow float32: keep them (scalars per node) in float64, and do the
    # vocabulary-wide work in the inputs' dtype with the per-node ratio S/B factored out.
    one = torch.ones_like(q[:, :, :1, 0], dtype=torch.float64)
    draft_mass = torch.cat([one, token_probs(q, tokens).double().cumprod(-1)], -1)  # S [B, K, L+1]
    target_mass = torch.cat([one, token_probs(p, tokens).double().cumprod(-1)], -1)  # B [B, K, L+1]
    mass_ratio = draft_mass / target_mass.clamp_min(MASS_FLOOR)  # S/B
    sigma = 1 - (1 - draft_mass) ** K
    gain = target_mass * coverage(mass_ratio, K)
    # h of every sub-block u = x^i, i = 1..L-1, of every draft at once: [G(u) - sum_c G(uc)] / [sigma(u) - ...]
    ratio = mass_ratio[:, :, 1:L, None].clamp(max=MAX_RATIO).to(q.dtype)
    children = target_mass[:, :, 1:L] * child_coverage(p[:, :, 1:L], q[:, :, 1:L], ratio, K).sum(-1).double()
    h_sub = ((gain[:, :, 1:L] - children) / (sigma[:, :, 1:L] - children + DENOMINATOR_GUARD)).clamp(0, 1)
    h_full = (gain[:, :, L] / (sigma[:, :, L] + DENOMINATOR_GUARD)).clamp(0, 1)
    return AcceptanceTests(h_sub, h_full, same_prefix(tokens), mass_ratio)


def walk(tests: AcceptanceTests, u_sub: Tensor, u_full: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The published code's order of tests on uniforms u_sub [B, K, L] (column 0 unused) and u_full [B, K]: the
    accepted count [B], the selected draft [B], and whether a full block was accepted [B]."""
    B, K, L = u_sub.shape
    agree = tests.agree  # [b, k, j, i]: drafts k and j agree on their first i + 1 tokens
    accepted = torch.zeros(B, dtype=torch.long, device=u_sub.device)
    draft_index, done = torch.zeros_like(accepted), torch.zeros(B, dtype=torch.bool, device=u_sub.device)
    rejected = torch.zeros(B, K, L, dtype=torch.bool, device=u_sub.device)  # the published code's "seen" set
    for k in range(K):
        start = accepted.clone()  # the range of sub-blocks is fixed when draft k starts
        for i in range(1, L):
            seen = (rejected[:, :k, i] & agree[:, k, :k, i - 1]).any(-1)
            tested = ~done & (i > start) & ~seen
            accept = tested & (u_sub[:, k, i] < tests.h_sub[:, k, i - 1])
            accepted, draft_index = torch.where(accept, i, accepted), torch.where(accept, k, draft_index)
            rejected[:, k, i] = tested & ~accept
        full = ~done & (u_full[:, k] < tests.h_full[:, k])
        accepted, draft_index = torch.where(full, L, accepted), torch.where(full, k, draft_index)
        done |= full
    return accepted, draft_index, done


def coverage(ratio, K):
    """f = 1 - (1 - a)^K with a = min(1, S/B): the chance that some of K drafts covers the target's mass."""
    return 1 - (1 - ratio.clamp(max=1)) ** K


def child_coverage(p, q, ratio, K):
    """G(u c) / B(u) = p(c) f(a(u c)) for every child c, with a(u c) = min(1, (S(u) / B(u)) q(c) / p(c))."""
    a = torch.where(p > 0, ratio * q / p.clamp_min(torch.finfo(p.dtype).tiny), torch.ones_like(p))
    return p * coverage(a, K)

"""A researcher's own verifiers, outside the package (docs/custom_verifiers.md):

    PYTHONPATH=examples python run.py verifier=custom verifier.target=my_verifiers:SpeculativeSampling num_drafts=1
    PYTHONPATH=examples python -m spectr_gbv.tools.audit --verifier my_verifiers:SpeculativeSampling

SpeculativeSampling is token-level speculative sampling (Leviathan et al. 2023; Chen et al. 2023), written from
scratch: accept draft token x_i while u_i < p(x_i) / q(x_i), then emit a token from norm((p - q)_+) at the first
rejection, or from the target's bonus distribution when all L were accepted. BiasedSpeculativeSampling samples the
rejected position from p instead of the residual: a classic mistake, kept as the negative control that the audit
must catch.
"""
import torch

from spectr_gbv.verifiers import Verifier, VerifierOutput
from spectr_gbv.verifiers.base import normalise, sample, token_probs, uniforms


class SpeculativeSampling(Verifier):
    name = "speculative_sampling"  # shown in messages; a run records the spec (my_verifiers:SpeculativeSampling)
    lossless = True  # the claim the audit tests
    max_drafts = 1  # one draft block (K = 1)

    @staticmethod
    def residual(p, q):
        """The law of the token emitted at a rejection (torch or numpy rows)."""
        return (p - q).clip(min=0)

    def verify(self, draft_tokens, draft_probs, target_probs, generator, state):
        x, q, p = draft_tokens[:, 0], draft_probs[:, 0], target_probs[:, 0]  # [B, L], [B, L, V], [B, L+1, V]
        B, L = x.shape
        u = uniforms((B, L), p, generator)  # B x L draws from each row's generator, whatever is accepted
        rejected = u >= token_probs(p, x) / token_probs(q, x)  # strict acceptance: u < p/q
        accepted = torch.where(rejected.any(-1), rejected.int().argmax(-1), L)  # tokens before the first rejection
        rows = torch.arange(B)
        at = p[rows, accepted]  # target law at the rejected position, or the bonus distribution after all L
        q_at = q[rows, accepted.clamp(max=L - 1)]  # unused where all L were accepted
        law = torch.where((accepted == L)[:, None], at, normalise(self.residual(at, q_at), at))
        return VerifierOutput(accepted, torch.zeros_like(accepted), sample(law, generator))

    @classmethod
    def exact_outcomes(cls, p, q, drafts):
        """Optional: the exact law of one iteration, [(probability, emitted tokens, continuation)], p and q
        callables prefix -> law (spectr_gbv.verifiers.reference); the audit then reports the exact law error too."""
        (x,), outs, reach = drafts, [], 1.0
        for i, token in enumerate(x):
            pv, qv = p(x[:i]), q(x[:i])
            accept = min(1.0, pv[token] / qv[token])
            residual = cls.residual(pv, qv)
            residual = residual / residual.sum() if residual.sum() > 0 else pv
            outs += [(reach * (1 - accept) * r, x[:i] + (c,), p) for c, r in enumerate(residual) if r > 0]
            reach *= accept
        return outs + [(reach * pc, x + (c,), p) for c, pc in enumerate(p(x)) if pc > 0]


class BiasedSpeculativeSampling(SpeculativeSampling):
    name = "biased_speculative_sampling"  # claims lossless (inherited) and is not: the audit says NOT lossless

    @staticmethod
    def residual(p, q):
        return p

"""Verifiers: pure tensor functions that decide what a target model accepts from K draft blocks.

    from spectr_gbv.verifiers import build_verifier
    out = build_verifier("gbv")(draft_tokens, draft_probs, target_probs, generator=g, state=None)

Glossary (vLLM's rejection-sampler vocabulary; docs/algorithms.md §1 has the math):
    draft             one of the K i.i.d. blocks of L tokens the drafter samples from q (`draft_probs`).
    iteration         one drafter block of K drafts, one target pass over them (`target_probs`), one verifier call.
    accepted          the leading tokens of one draft that the iteration emits: `num_accepted` of them, 0..L, from
                      draft `draft_index`. docs/algorithms.md calls the count tau (tau = accepted).
    recovered token   the token emitted after a rejection, sampled from a residual distribution, not from q
                      (the papers' "correction").
    bonus token       the token emitted after all L tokens were accepted, sampled from the target p(. | x^L).
                      Every iteration ends with exactly one of the two: `next_token`.
    block efficiency  tokens emitted per target call: accepted + 1 per iteration on average, E[tau] + 1.
    lossless          the emitted stream has exactly the target's sampling law, whatever the drafter; a property of
                      the law, not of single samples (`Verifier.lossless`; `spectr_gbv_paper` is not).
"""
from .base import Verifier, VerifierOutput
from .block import BlockVerifier, MultiPathVerifier, TokenVerifier
from .bound import optimal_acceptance
from .greedy import GreedyBlockVerifier, PendingLevels
from .paper import PaperSpecTrGBVVerifier
from .tree import NaiveVerifier, SpecInferVerifier, SpecTrVerifier

VERIFIERS: dict[str, type[Verifier]] = {cls.name: cls for cls in (
    TokenVerifier, BlockVerifier, GreedyBlockVerifier, SpecTrVerifier, SpecInferVerifier, NaiveVerifier,
    MultiPathVerifier, PaperSpecTrGBVVerifier)}
VERIFIERS["spectr_gbv"] = GreedyBlockVerifier  # the project's lossless SpecTr-GBV is gbv


def build_verifier(name: str) -> Verifier:
    if name not in VERIFIERS:
        raise ValueError(f"unknown verifier {name!r}; valid names: {', '.join(VERIFIERS)}")
    return VERIFIERS[name]()


__all__ = ["VERIFIERS", "build_verifier", "optimal_acceptance", "Verifier", "VerifierOutput", "PendingLevels"]

"""Verifiers: pure tensor functions that decide what a target model accepts from K draft blocks.

    from spectr_gbv.verifiers import build_verifier
    out = build_verifier("gbv")(draft_tokens, draft_probs, target_probs, generator=g, state=None)
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

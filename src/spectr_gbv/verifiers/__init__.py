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

The registry below is the one place that says which verifiers exist, under which names, whether they claim to be
lossless and how many drafts they take: configs, the engine, the reference, the audit, the benches and the tests read
it. A researcher's own verifier is named by where it lives, "module.path:ClassName" (see `verifier_class`).
"""
import importlib

from spectr_gbv.errors import ConfigError

from .base import Verifier, VerifierOutput
from .block import BlockVerifier, MultiPathVerifier, TokenVerifier
from .bound import optimal_acceptance
from .greedy import GreedyBlockVerifier, PendingLevels
from .paper import PaperSpecTrGBVVerifier
from .traversal import TraversalVerifier
from .tree import NaiveVerifier, SpecInferVerifier, SpecTrVerifier

VERIFIERS: dict[str, type[Verifier]] = {cls.name: cls for cls in (
    TokenVerifier, BlockVerifier, GreedyBlockVerifier, SpecTrVerifier, SpecInferVerifier, NaiveVerifier,
    MultiPathVerifier, PaperSpecTrGBVVerifier, TraversalVerifier)}
ALIASES = {"spectr_gbv": "gbv"}  # the project's lossless SpecTr-GBV is gbv
CHOICES = (*VERIFIERS, *ALIASES)  # every built-in name a user may type


def verifier_names(lossless: bool | None = None, multi_draft: bool | None = None) -> list[str]:
    """Built-in names (no aliases) in registry order, filtered by what they claim."""
    return [name for name, cls in VERIFIERS.items()
            if (lossless is None or cls.lossless == lossless)
            and (multi_draft is None or (cls.max_drafts is None) == multi_draft)]


def is_custom(spec: str) -> bool:
    """A researcher's verifier is named "module.path:ClassName"; built-in names have no colon."""
    return ":" in spec


def verifier_class(spec: str, key: str = "verifier") -> type[Verifier]:
    """The class a name, an alias or a "module.path:ClassName" stands for. A bad spec raises ConfigError naming
    `key`, the spec and what is allowed."""
    spec = ALIASES.get(spec, spec)
    if spec in VERIFIERS:
        return VERIFIERS[spec]
    if not is_custom(spec):
        raise ConfigError(key, spec, f"unknown verifier; choose one of {', '.join(CHOICES)}, "
                          "or module.path:ClassName for your own")
    module_name, _, class_name = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as error:
        raise ConfigError(key, spec, f"module {module_name} does not import ({type(error).__name__}: {error}); "
                          "give module.path:ClassName of a module on PYTHONPATH") from error
    cls = getattr(module, class_name, None)
    if cls is None:
        raise ConfigError(key, spec, f"module {module_name} has no attribute {class_name!r}")
    if not (isinstance(cls, type) and issubclass(cls, Verifier) and cls.verify is not Verifier.verify):
        raise ConfigError(key, spec, f"{class_name} does not meet the verifier contract: it must be a subclass of "
                          "spectr_gbv.verifiers.Verifier that implements verify()")
    return cls


def build_verifier(spec: str) -> Verifier:
    return verifier_class(spec)()


__all__ = ["VERIFIERS", "ALIASES", "CHOICES", "verifier_names", "verifier_class", "is_custom", "build_verifier",
           "optimal_acceptance", "Verifier", "VerifierOutput", "PendingLevels"]

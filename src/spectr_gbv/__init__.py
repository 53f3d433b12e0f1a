"""spectr-gbv: speculative decoding verifiers (SpecTr-GBV and its baselines), measured exactly.

Layers, each importing only the ones above it in this list:
    verifiers/   pure tensor functions: which draft tokens a target accepts (no models)
    decoding/    sampling, model loading, the KV cache, the draft tree and the engine (no Hydra)
    experiment/  the run's config, prompts, the Lightning module, records, metrics and logging
    tools/       command-line tools: audit, benchmarks, report

The public API, importable from here:
    from spectr_gbv import SpeculativeEngine, Sampling, packaged, tiny, build_verifier, VERIFIERS, optimal_acceptance
Names are imported on first use, so `import spectr_gbv.tools.report` does not pay for torch and transformers.
"""
import importlib

_PUBLIC = {
    "SpeculativeEngine": "spectr_gbv.decoding.engine",
    "DecodeRecord": "spectr_gbv.decoding.engine",
    "Sampling": "spectr_gbv.decoding.sampling",
    "packaged": "spectr_gbv.decoding.gguf_packages",
    "pretrained": "spectr_gbv.decoding.models",
    "tiny": "spectr_gbv.decoding.tiny",
    "build_verifier": "spectr_gbv.verifiers",
    "VERIFIERS": "spectr_gbv.verifiers",
    "optimal_acceptance": "spectr_gbv.verifiers",
}
__all__ = list(_PUBLIC)


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'spectr_gbv' has no attribute {name!r}")
    return getattr(importlib.import_module(_PUBLIC[name]), name)

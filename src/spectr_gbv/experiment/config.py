"""The run configuration: its knobs and schema (types, checked by Hydra while composing), its range checks (one
function, run before anything loads) and the one-line messages a user sees for a bad input.

Each knob is declared once, in `Knobs` below: its type, its default and what it means. conf/config.yaml holds the
config groups' choices and hands the knobs to the module and the data module as one node, ${knobs:}.
"""
import dataclasses
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

import rich
import rich.syntax
import rich.tree
import torch
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.errors import (ConfigCompositionException, InstantiationException, MissingConfigException,
                          OverrideParseException)
from hydra.types import RunMode
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from spectr_gbv.decoding.engine import check_settings
from spectr_gbv.decoding.linear import check_linear_layers
from spectr_gbv.decoding.models import is_hub_id
from spectr_gbv.decoding.precision import resolve_precision
from spectr_gbv.decoding.sampling import Sampling
from spectr_gbv.errors import ConfigError, ModelUnavailable
from spectr_gbv.verifiers import ALIASES, verifier_class, verifier_names


@dataclass
class VerifierConfig:
    name: str = MISSING  # a name of spectr_gbv.verifiers.CHOICES, "ar", or module.path:ClassName
    # verifier=custom: the module.path:ClassName of a researcher's class, which becomes `name`; read by no other option,
    # so that a sweep may run verifier=gbv,custom verifier.target=... side by side
    target: Optional[str] = None


@dataclass
class Knobs:
    """The knobs of a job (python run.py num_drafts=4 ...): the top level of the run config, and what the module and
    the data module get (job.json records them). A new knob is a field here."""
    num_drafts: int = 3  # K i.i.d. drafts per iteration
    block_length: int = 4  # L tokens per draft
    temperature: float = 1.0  # 0 = greedy
    draft_temperature: Optional[float] = None  # None = temperature; give one > 0 for K > 1 at temperature 0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    max_new_tokens: int = 128
    seed: int = 0
    baseline: bool = False  # also decode every prompt with `ar` and report the speedup over it
    limit: Optional[int] = 10  # first N prompts of each dataset; None = all
    batch_size: int = 1  # prompts decoded together per rank; a prompt's tokens do not depend on it


@dataclass
class Config(Knobs):
    # groups: free-form nodes instantiated with hydra.utils.instantiate (their `_target_` defines their keys)
    model: Any = MISSING
    drafter: Any = MISSING
    verifier: VerifierConfig = MISSING
    dataset: dict[str, Any] = MISSING  # dataset name -> loader node
    logger: Any = MISSING  # a Lightning logger node, or None
    trainer: Any = MISSING
    output_dir: str = MISSING
    # set by validate(): each model's dtype, linear kernel and why (dtype auto: this machine's choice)
    precision: Any = None
    # mode=arena only (conf/mode/arena.yaml): the verifiers scored on the reference's drafts, replicas per context
    verifiers: Optional[list[str]] = None
    replicas: Optional[int] = None
    delta: Optional[float] = None  # the equivalence margin of the arena's verdicts, tokens per call
    # the Lightning module and data module, built from the groups and the knobs in conf/config.yaml
    module: Any = MISSING
    data: Any = MISSING


ConfigStore.instance().store(name="base_config", node=Config)


def knobs(_root_: DictConfig) -> Knobs:
    """${knobs:} in conf/config.yaml: the top level's knobs as one Knobs (a structured node, which instantiate's
    `_convert_: object` hands over as the dataclass)."""
    return Knobs(**{field.name: _root_[field.name] for field in dataclasses.fields(Knobs)})


OmegaConf.register_new_resolver("knobs", knobs, replace=True)


def sweep_group() -> Optional[str]:
    """${sweep_group:} in conf/logger/wandb.yaml: inside a -m sweep the sweep folder's name, else None."""
    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return None
    return Path(HydraConfig.get().sweep.dir).name


OmegaConf.register_new_resolver("sweep_group", sweep_group, replace=True)


def multi_draft_verifiers() -> str:
    """${multi_draft_verifiers:} in conf/sweep/: every built-in multi-draft verifier, as a sweep's list of values."""
    return ",".join(verifier_names(multi_draft=True))


OmegaConf.register_new_resolver("multi_draft_verifiers", multi_draft_verifiers, replace=True)


def validate(cfg: DictConfig) -> None:
    """Range checks that types cannot express, before any model loads; raises ConfigError on the first bad knob.
    The sampling settings and the engine's knobs are checked by their own code (one place per rule). Last, each
    model's precision is settled (settle_precision)."""
    Sampling(temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p, draft_temperature=cfg.draft_temperature)
    check_target(cfg.verifier)
    check_settings(cfg.verifier.name, cfg.num_drafts, cfg.block_length, cfg.max_new_tokens)
    checks = [
        ("block_length", cfg.block_length <= cfg.max_new_tokens,
         f"must be <= max_new_tokens ({cfg.max_new_tokens}): a longer draft can never be emitted"),
        ("batch_size", cfg.batch_size >= 1, "must be >= 1"),
        ("limit", cfg.limit is None or cfg.limit >= 1, "must be >= 1, or null for every prompt"),
    ]
    for key, ok, allowed in checks:
        if not ok:
            raise ConfigError(key, cfg[key], allowed)
    validate_mode(cfg)
    for side in ("model", "drafter"):
        check_model_path(side, cfg[side])
    if cfg.trainer.accelerator in ("cuda", "gpu") and not torch.cuda.is_available():
        raise ConfigError("trainer.accelerator", cfg.trainer.accelerator,
                          "no CUDA device here (or torch is a CPU build); use trainer=cpu or trainer=ddp_cpu")
    settle_precision(cfg)


def settle_precision(cfg: DictConfig) -> None:
    """Each model's dtype `auto` replaced by this machine's choice in the config itself, and `precision` set to what
    each model runs in and why: the run's header prints it, summary.json and W&B's config hold it, and job.json holds
    the dtype that ran (a job resumed where auto chooses otherwise is refused: its records are of another dtype)."""
    precision = {}
    for side in ("model", "drafter"):
        node = cfg[side]
        chosen = resolve_precision(f"{side}.", node.dtype, node.get("linear_kernel"), node.get("quantize"), node.device)
        check_linear_layers(f"{side}.", node.get("quantize"), chosen.linear_kernel, chosen.dtype, node.device)
        node.dtype, node.linear_kernel = chosen.dtype, chosen.linear_kernel
        precision[side] = asdict(chosen)
    cfg.precision = precision


def check_target(verifier: DictConfig) -> None:
    """verifier=custom's class must be given and must load; a bad one is named by the key the user typed."""
    if verifier.target is not None:
        verifier_class(verifier.target, "verifier.target")
    elif OmegaConf.is_interpolation(verifier, "name"):  # verifier=custom, whose name is its target, without one
        raise ConfigError("verifier.target", None, "required with verifier=custom: module.path:ClassName of a "
                          "spectr_gbv.verifiers.Verifier subclass in a module on PYTHONPATH")


def validate_mode(cfg: DictConfig) -> None:
    """The arena's knobs (conf/mode/arena.yaml) are checked by the arena's own code; elsewhere they would be
    silently ignored, so they are refused."""
    if HydraConfig.get().runtime.choices.get("mode") == "arena":
        arena_verifiers(cfg.verifiers, cfg.verifier.name)
        check_arena_knobs(cfg.replicas, cfg.delta)
        return
    for key in ("verifiers", "replicas", "delta"):
        if cfg[key] is not None:
            raise ConfigError(key, cfg[key], "only with mode=arena, the verifier arena")


def arena_verifiers(specs: list[str] | None, reference: str) -> list[str]:
    """The verifiers an arena scores, checked (a bad entry is one line naming `verifiers`): every built-in one for
    None, the reference first when the list lacks it (the paired differences are against it), no repeats. The
    reference must be lossless: its contexts then follow the target's law."""
    if reference == "ar" or not verifier_class(reference).lossless:
        raise ConfigError("verifier", reference, "the arena needs a lossless speculative reference decode; choose "
                          f"one of {', '.join(verifier_names(lossless=True))}")
    if specs is not None and len(specs) == 0:
        raise ConfigError("verifiers", "[]", "names no verifier to score: list some, or leave it out (null) for "
                          "every built-in one")
    names = verifier_names() if specs is None else list(specs)
    for spec in names:
        verifier_class(spec, key="verifiers")
    names = [ALIASES.get(spec, spec) for spec in names]
    reference = ALIASES.get(reference, reference)
    return list(dict.fromkeys([reference, *names] if reference not in names else names))


def check_arena_knobs(replicas, delta) -> None:
    if not (isinstance(replicas, int) and replicas >= 1):
        raise ConfigError("replicas", replicas, "must be >= 1: calls averaged per context where a verifier has no "
                          "closed-form accepted_law()")
    if not (isinstance(delta, (int, float)) and delta > 0):
        raise ConfigError("delta", delta, "must be > 0: the margin in tokens per call within which two rules are "
                          "called equivalent")


def check_model_path(side: str, model: DictConfig) -> None:
    """A local model path must exist; a hub id is left to the loader, which says whether the hub gives it."""
    if OmegaConf.is_missing(model, "path"):
        raise ConfigError(f"{side}.path", "???",
                          "required: a model folder, a .gguf file or a hub id (name or owner/name)")
    path = model.get("path")
    if path is None or Path(path).expanduser().exists() or is_hub_id(path):
        return
    raise ConfigError(f"{side}.path", path,
                      "no such file or directory; give a model folder, a .gguf file or a hub id (name or owner/name)")


def error_line(error: Exception) -> Optional[str]:
    """The one line shown for a user's mistake, or None when `error` is a bug (shown with its traceback)."""
    if isinstance(error, (ConfigError, ModelUnavailable)):
        return f"error: {error}"
    if isinstance(error, InstantiationException) and isinstance(error.__cause__, ConfigError):
        return f"error: {error.__cause__}"  # e.g. raised by a dataset loader that instantiate() called
    if isinstance(error, MissingConfigException) and error.options:
        group, _, value = (error.missing_cfg_file or "").rpartition("/")
        return f"error: {group}={value}: choose one of {', '.join(error.options)}"
    if isinstance(error, OverrideParseException):  # malformed command line
        return f"error: {error.override}: {str(error).splitlines()[0]}"
    if isinstance(error, ConfigCompositionException):
        # e.g. "Error merging override num_drafts=abc" caused by "Value 'abc' ... could not be converted to Integer"
        cause = error.__cause__
        detail = str(cause).splitlines()[0] if isinstance(cause, OmegaConfBaseException) else ""
        override = str(error).splitlines()[0].removeprefix("Error merging override ")
        return f"error: {override}: {detail}" if detail else f"error: {override}"
    return None


def print_config_tree(cfg: DictConfig) -> None:
    """The resolved config as a rich tree, one branch per top-level key (lightning-hydra-template style)."""
    tree = rich.tree.Tree("config", guide_style="dim")
    for key, value in cfg.items():
        text = OmegaConf.to_yaml(value, resolve=True) if isinstance(value, DictConfig) else str(value)
        tree.add(str(key)).add(rich.syntax.Syntax(text, "yaml"))
    rich.print(tree)

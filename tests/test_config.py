"""Every option of every config group composes (and, where cheap, instantiates); each bad knob is refused by the
one validation function with a message naming the key, the value and what is allowed."""
import re

import pytest
import torch
from hydra.utils import instantiate
from lightning.pytorch import Trainer
from lightning.pytorch.loggers import Logger
from omegaconf import open_dict
from omegaconf.errors import ValidationError

from conftest import CONF, TINY
from spectr_gbv.decoding import precision
from spectr_gbv.decoding.gguf_packages import DEFAULT_PAIR
from spectr_gbv.decoding.models import LoadedModel, is_hub_id
from spectr_gbv.errors import ConfigError
from spectr_gbv.experiment.config import validate
from spectr_gbv.verifiers import CHOICES, verifier_names

PACKAGED = "spectr_gbv.decoding.gguf_packages.packaged"
MODEL_TARGETS = {"qwen": PACKAGED, "smollm2": PACKAGED, "hf": "spectr_gbv.decoding.models.pretrained",
                 "tiny": "spectr_gbv.decoding.tiny.tiny"}


def options(group: str) -> list[str]:
    return sorted(path.stem for path in (CONF / group).glob("*.yaml"))


def test_defaults_compose_and_validate(make_cfg):
    cfg = make_cfg()
    validate(cfg)
    assert (cfg.model.name, cfg.drafter.name) == DEFAULT_PAIR
    assert cfg.verifier.name == "gbv" and list(cfg.dataset) == ["mtbench"]


@pytest.mark.parametrize("side", ["model", "drafter"])
@pytest.mark.parametrize("option", sorted(MODEL_TARGETS))
def test_model_options(make_cfg, side, option):
    cfg = make_cfg(f"{side}={option}", f"{side}.path=/tmp" if option == "hf" else f"{side}.dtype=float32")
    assert cfg[side]._target_ == MODEL_TARGETS[option]
    assert {"dtype", "device"} <= set(cfg[side])
    if option == "tiny":  # the only model that loads in a test: built from a config, no files
        loaded = instantiate(cfg[side])()
        assert isinstance(loaded, LoadedModel) and loaded.model.device.type == "cpu"


@pytest.mark.parametrize("option", sorted(MODEL_TARGETS))
def test_a_drafter_option_is_its_model_option(make_cfg, option):
    """One set of model configs: conf/drafter/<option> extends conf/model/<option>, changing only what makes it the
    drafter (the smaller Qwen, the perturbed tiny model)."""
    paths = ["model.path=/tmp", "drafter.path=/tmp"] if option == "hf" else []
    cfg = make_cfg(f"model={option}", f"drafter={option}", *paths)
    differ = {key for key in cfg.model.keys() | cfg.drafter.keys() if cfg.model.get(key) != cfg.drafter.get(key)}
    assert differ == {"qwen": {"name"}, "tiny": {"perturb"}}.get(option, set())


def test_every_verifier_has_a_config():
    assert set(options("verifier")) == set(CHOICES) | {"ar", "custom"}  # custom: tests/test_custom_verifiers.py


@pytest.mark.parametrize("option", sorted(set(options("verifier")) - {"custom"}))
def test_verifier_options(make_cfg, option):
    cfg = make_cfg(f"verifier={option}", "num_drafts=1")
    validate(cfg)
    assert cfg.verifier.name == option


def test_dataset_all_is_the_five_real_ones(make_cfg):
    assert list(make_cfg("dataset=all").dataset) == ["mtbench", "humaneval", "gsm8k", "xsum", "nq"]


@pytest.mark.parametrize("option", options("logger"))
def test_logger_options(make_cfg, option):
    node = make_cfg(f"logger={option}").logger
    assert (node is None) == (option == "none")
    if node is not None:
        assert isinstance(instantiate(node), Logger)


@pytest.mark.parametrize("option", options("trainer"))
def test_trainer_options(make_cfg, option):
    cfg = make_cfg(f"trainer={option}")
    assert cfg.trainer.use_distributed_sampler is False  # the data module shards without padding
    if cfg.trainer.accelerator == "cpu":  # GPU trainers cannot be built on this machine
        trainer = instantiate(cfg.trainer, logger=False)
        assert isinstance(trainer, Trainer) and trainer.world_size == cfg.trainer.devices
    assert cfg.model.device == cfg.trainer.accelerator  # models load on the trainer's device type


def test_sweep_preset_composes(make_cfg):
    params = make_cfg("+sweep=drafts_x_block").hydra.sweeper.params
    assert params.num_drafts == "1,2,3,4" and params.block_length == "2,4,8"
    assert params.verifier.split(",") == verifier_names(multi_draft=True)


def test_wandb_sweep_is_the_hydra_preset(make_cfg, capsys):
    import yaml

    from spectr_gbv.tools import wandb_sweep

    wandb_sweep.main(["drafts_x_block", "dataset=all"])
    sweep = yaml.safe_load(capsys.readouterr().out)
    params = make_cfg("+sweep=drafts_x_block").hydra.sweeper.params
    assert {knob: ",".join(map(str, grid["values"])) for knob, grid in sweep["parameters"].items()} == params
    assert sweep["command"][-3:] == ["logger=wandb", "logger.mode=online", "dataset=all"]


@pytest.mark.parametrize("overrides, message", [
    (["num_drafts=0"], "num_drafts=0: must be >= 1"),
    (["block_length=0"], "block_length=0: must be >= 1"),
    (["temperature=-0.5"], "temperature=-0.5: must be >= 0"),
    (["top_p=0"], "top_p=0.0: must be in (0, 1]"),
    (["top_p=1.5"], "top_p=1.5: must be in (0, 1]"),
    (["top_k=-1"], "top_k=-1: must be >= 0"),
    (["max_new_tokens=0"], "max_new_tokens=0: must be >= 1"),
    (["block_length=100000"],
     "block_length=100000: must be <= max_new_tokens (8): a longer draft can never be emitted"),
    (["batch_size=0"], "batch_size=0: must be >= 1"),
    (["limit=0"], "limit=0: must be >= 1"),
    (["verifier=token", "num_drafts=2"], "num_drafts=2: verifier token takes at most 1 draft(s)"),
    (["verifier=bv", "num_drafts=3"], "num_drafts=3: verifier bv takes at most 1 draft(s)"),
    (["model=hf", "model.path=/no/such/model"], "model.path=/no/such/model: no such file or directory"),
    (["drafter=hf", "drafter.path=./missing.gguf"], "drafter.path=./missing.gguf: no such file or directory"),
    (["model=hf"], "model.path=???: required"),
    (["drafter.quantize=int4"], "drafter.quantize=int4: choose null (the weights as loaded), int8 or int8_dynamic"),
    (["model.quantize=int8", "model.dtype=float64"], "model.quantize=int8: needs dtype float32 or bfloat16 (here"),
    (["drafter.linear_kernel=blas"], "drafter.linear_kernel=blas: choose null (torch's own matmul) or onednn"),
    (["model.linear_kernel=onednn", "model.dtype=float64"], "model.linear_kernel=onednn: needs dtype float32"),
    (["model.dtype=half"], "model.dtype=half: choose auto, float32, bfloat16, float16, float64"),
])
def test_bad_knobs_are_refused(make_cfg, overrides, message):
    with pytest.raises(ConfigError, match="^" + re.escape(message)):
        validate(make_cfg(*TINY, *overrides))


@pytest.mark.parametrize("overrides, model, drafter", [
    ([], ("float32", "onednn", "auto"), ("float32", "onednn", "auto")),
    (["model.dtype=bfloat16"], ("bfloat16", None, "given"), ("float32", "onednn", "auto")),  # explicit wins
    (["drafter.quantize=int8_dynamic"], ("float32", "onednn", "auto"), ("float32", None, "auto: float32")),
    (["drafter.dtype=float32"], ("float32", "onednn", "auto"), ("float32", None, "given")),  # torch's own matmul
])
def test_validate_settles_dtype_auto_in_the_config(make_cfg, monkeypatch, overrides, model, drafter):
    """The real models' dtype auto becomes this machine's choice in the config itself (here an x86 CPU without
    bfloat16 units), so the header, job.json, summary.json and W&B hold what ran; `precision` says why."""
    monkeypatch.setattr(precision, "this_cpu", lambda: "x86 without bfloat16 units")
    cfg = make_cfg(*overrides)
    assert cfg.precision is None
    validate(cfg)
    for side, (dtype, kernel, reason) in (("model", model), ("drafter", drafter)):
        assert (cfg[side].dtype, cfg[side].linear_kernel) == (dtype, kernel)
        assert cfg.precision[side].dtype == dtype and cfg.precision[side].reason.startswith(reason)
    assert cfg.module.precision == cfg.precision and cfg.module.model_config.dtype == model[0]


def test_tiny_models_name_their_dtype(make_cfg):
    """Tests' numbers must not move with the machine: the tiny configs say float32 (auto would pick per machine)."""
    cfg = make_cfg(*TINY)
    validate(cfg)
    assert cfg.precision.model.reason == cfg.precision.drafter.reason == "given"
    assert cfg.model.dtype == cfg.drafter.dtype == "float32" and cfg.model.linear_kernel is None


@pytest.mark.parametrize("path, hub_id", [("gpt2", True), ("Qwen/Qwen2.5-0.5B-Instruct", True),
                                          ("owner/name/more", False), ("./gpt2", False), ("/no/such/model", False)])
def test_hub_ids_pass_validation(make_cfg, path, hub_id):
    """A missing local path passes exactly when the loader would ask the hub for it (a name or owner/name); the others
    are refused here, before any model loads."""
    cfg = make_cfg("model=hf", f"model.path={path}")
    assert is_hub_id(path) == hub_id
    if hub_id:
        validate(cfg)
    else:
        with pytest.raises(ConfigError, match=f"^model.path={re.escape(path)}: no such file or directory"):
            validate(cfg)


def test_schema_checks_types(make_cfg):
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException, match="Error merging override num_drafts=two"):
        make_cfg("num_drafts=two")
    cfg = make_cfg()
    with open_dict(cfg), pytest.raises(ValidationError, match="Value 'hot' of type 'str' could not be converted"):
        cfg.temperature = "hot"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message for a machine without CUDA")
@pytest.mark.parametrize("option", ["gpu", "ddp"])
def test_a_gpu_trainer_without_cuda_is_one_line(make_cfg, option):
    with pytest.raises(ConfigError, match="trainer.accelerator=cuda: no CUDA device here .*use trainer=cpu or "
                                          "trainer=ddp_cpu"):
        validate(make_cfg(f"trainer={option}"))

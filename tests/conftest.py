"""Compose-based fixtures (lightning-hydra-template style): configs built exactly as run.py builds them."""
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, open_dict

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
TINY = ["model=tiny", "drafter=tiny", "dataset=tiny", "logger=none", "max_new_tokens=8", "limit=2"]


@pytest.fixture
def make_cfg(tmp_path):
    """make_cfg(*overrides) -> the composed config, with ${hydra:...} resolvable and output_dir = tmp_path."""
    def make(*overrides: str) -> DictConfig:
        GlobalHydra.instance().clear()
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            cfg = compose(config_name="config", overrides=list(overrides), return_hydra_config=True)
        HydraConfig().set_config(cfg)
        with open_dict(cfg):
            cfg.output_dir = str(tmp_path)
        return cfg
    yield make
    GlobalHydra.instance().clear()

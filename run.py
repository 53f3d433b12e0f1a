"""Run one evaluation (or, with -m, a sweep of them): python run.py verifier=gbv num_drafts=4 dataset=all
With mode=arena, every verifier is scored on the drafts of that decode instead (spectr_gbv.experiment.arena).

Composes conf/config.yaml, checks it, then lets Lightning's test loop decode every prompt (see
spectr_gbv.experiment.module).
Each job writes predictions.jsonl and summary.json into its Hydra output folder; rerun with
hydra.run.dir=<that folder> to finish a job that was interrupted.
"""
import functools
import logging
import os
import sys
import warnings
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from spectr_gbv.errors import ConfigError
from spectr_gbv.experiment.config import error_line, print_config_tree, validate


def exit_on_user_error(function):
    """A user's mistake ends as one line and a non-zero status; a bug keeps its traceback. Wraps both the job (so a
    sweep's job ends with its own line) and the command (for mistakes Hydra finds while composing)."""
    @functools.wraps(function)
    def wrapped(*args, **kwargs):
        try:
            return function(*args, **kwargs)
        except Exception as error:
            line = error_line(error)
            if line is None:
                raise
            sys.exit(line)  # SystemExit passes through Hydra's job runner without a report of its own
    return wrapped


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
@exit_on_user_error
def main(cfg: DictConfig) -> float:
    validate(cfg)  # before any model loads
    quiet_third_party()
    from hydra.utils import instantiate
    from lightning.pytorch.utilities import rank_zero_only
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from spectr_gbv.experiment.records import claim_folder

    rank_zero_only(print_config_tree)(cfg)
    module, datamodule = instantiate(cfg.module), instantiate(cfg.data)
    rank_zero_only(claim_folder)(Path(cfg.output_dir), module.job(datamodule))  # other ranks start in test()
    logger = instantiate(cfg.logger) if cfg.logger else False
    trainer = instantiate(cfg.trainer, logger=logger)
    if (HydraConfig.get().mode == RunMode.MULTIRUN and trainer.num_devices > 1
            and not trainer.strategy.cluster_environment.creates_processes_externally):
        # Lightning would start the other processes by re-running this command line: the whole sweep, again
        raise ConfigError("trainer.devices", trainer.num_devices, "must be 1 inside a -m sweep; run multi-process "
                          "jobs one command each, or let a launcher start the processes (submitit, torchrun)")
    if logger:
        start_logger(logger, cfg)
    try:
        trainer.test(module, datamodule=datamodule, verbose=False)  # verbose: Lightning's raw metrics table
    except SIGTERMException:  # Lightning's, a SystemExit with status 0: a stopped job must not look finished
        sys.exit(f"error: stopped by SIGTERM; every finished prompt's record is kept in {cfg.output_dir}: rerun the "
                 f"same command with hydra.run.dir={cfg.output_dir} to resume")
    finally:
        finish_wandb()  # each multirun job is its own W&B run
    return module.summary.get("metrics", {}).get("overall", {}).get("block_efficiency", float("nan"))


def quiet_third_party() -> None:
    """Lightning's advertisement for its cloud logger and a deprecation inside Lightning's own use of torch's pytree
    say nothing about this run; everything else they log stays (it is in run.log too)."""
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)")
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(
        lambda record: not record.getMessage().startswith("💡 Tip"))


def start_logger(logger, cfg: DictConfig) -> None:
    """Log the config; W&B starts its run here, so a missing login is the user's environment, told in one line."""
    try:
        logger.log_hyperparams(OmegaConf.to_container(cfg, resolve=True))
    except Exception as error:
        if type(error).__name__ != "UsageError" or not type(error).__module__.startswith("wandb"):
            raise
        raise ConfigError("logger.mode", cfg.logger.get("mode"), f"W&B cannot start online ({error}); log in with "
                          "`wandb login`, or use logger.mode=offline (the default)") from error


def finish_wandb() -> None:
    """Finish this job's W&B run, if one started."""
    if "wandb" in sys.modules:
        import wandb

        if wandb.run is not None:
            wandb.finish()


if __name__ == "__main__":
    # Let Hydra's exceptions reach us, so that a user's mistake becomes one line instead of Hydra's report.
    os.environ.setdefault("HYDRA_FULL_ERROR", "1")
    exit_on_user_error(main)()

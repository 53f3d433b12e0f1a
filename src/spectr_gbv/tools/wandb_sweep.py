"""A Hydra sweep preset as a W&B sweep, for `wandb agent` users (needs an account):

    python -m spectr_gbv.tools.wandb_sweep drafts_x_block > outputs/sweep.yaml
    wandb sweep outputs/sweep.yaml             # prints the sweep id
    wandb agent <entity>/spectr-gbv/<id>       # on as many machines as you like

The grid is read from conf/sweep/<name>.yaml (its hydra.sweeper.params, resolved as Hydra resolves them), so the two
kinds of sweep cannot drift apart. Each W&B run is
`python run.py <knob>=<value>... logger=wandb logger.mode=online [extra overrides]`.
"""
import argparse
from pathlib import Path

import yaml
from omegaconf import OmegaConf

import spectr_gbv.experiment.config  # noqa: F401  (registers the resolvers the presets use)

SWEEPS = Path(__file__).resolve().parents[3] / "conf" / "sweep"


def wandb_sweep(name: str, extra: list[str]) -> dict:
    grid = OmegaConf.to_container(OmegaConf.load(SWEEPS / f"{name}.yaml").hydra.sweeper.params, resolve=True)
    return {
        "program": "run.py", "project": "spectr-gbv", "method": "grid",
        "metric": {"name": "overall/block_efficiency", "goal": "maximize"},
        "parameters": {knob: {"values": [yaml.safe_load(value) for value in str(values).split(",")]}
                       for knob, values in grid.items()},
        "command": ["${env}", "${interpreter}", "${program}", "${args_no_hyphens}", "logger=wandb",
                    "logger.mode=online", *extra],
    }


def main(argv: list[str] | None = None) -> None:
    presets = sorted(path.stem for path in SWEEPS.glob("*.yaml"))
    parser = argparse.ArgumentParser(prog="python -m spectr_gbv.tools.wandb_sweep", description=__doc__.splitlines()[0])
    parser.add_argument("preset", choices=presets, help="a file of conf/sweep/")
    parser.add_argument("overrides", nargs="*", help="fixed overrides for every run, e.g. dataset=all limit=20")
    args = parser.parse_args(argv)
    print(yaml.safe_dump(wandb_sweep(args.preset, args.overrides), sort_keys=False), end="")


if __name__ == "__main__":
    main()

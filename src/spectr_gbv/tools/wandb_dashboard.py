"""A sweep's W&B workspace, as code (wandb-workspaces):

    python -m spectr_gbv.tools.wandb_dashboard outputs/multirun/2026-01-01_12-00-00         # print its spec
    python -m spectr_gbv.tools.wandb_dashboard outputs/multirun/2026-01-01_12-00-00 --save  # save it as a view
    python -m spectr_gbv.tools.wandb_dashboard 2026-01-01_12-00-00 --save --entity me       # a W&B group

A folder is read here, without network: each job below it that logged to W&B (a wandb/*run-* folder) is one run,
with the metrics its summary.json gave the loggers (experiment/metrics.py `scalars`) and the config run.py logged
(.hydra/config.yaml). Anything else is a W&B group (a sweep folder's name, conf/logger/wandb.yaml), looked up in W&B.

The workspace shows exactly those runs, each in its verifier's colour, lighter for longer blocks:
  Block efficiency  against num_drafts, block_length and temperature, one point per run (W&B plots a run's summary
                    against its config as a scatter; workspace panels cannot filter runs, so the report's PNGs,
                    tools/report.py, keep the panel per block length), and every knob at once (parallel coordinates)
  Acceptance        acceptance by position, P(tau >= i), and the accepted-length histogram
  Speed             the speedup over `ar` beside its cost-model limit, when the runs measured it (baseline=true)
  Arena             when the runs logged metrics named "*arena*": per-verifier values, and the paired differences
                    (names holding "paired" or "diff") apart
"""
import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import wandb
import wandb_workspaces.reports.v2 as wr
import wandb_workspaces.workspaces as ws
import yaml
from matplotlib.colors import to_hex, to_rgb
from omegaconf import OmegaConf

from spectr_gbv.errors import ConfigError
from spectr_gbv.experiment.metrics import scalars

LOGGER_CONF = Path(__file__).resolve().parents[3] / "conf" / "logger" / "wandb.yaml"
EFFICIENCY = "overall/block_efficiency"
HISTOGRAM = "overall/accepted_length_histogram"  # a wandb.Histogram, logged by experiment/callbacks.WandbExtras
SPEED = ("overall/speedup", "overall/speed_limit")
KNOBS = ("num_drafts", "block_length", "temperature")
VERIFIER = "verifier.name"
LEGEND = "${config:verifier.name} K=${config:num_drafts} L=${config:block_length} T=${config:temperature}"


@dataclass
class Run:
    id: str
    config: dict  # nested, as W&B holds the config run.py logs
    keys: set[str]  # the metric names it logged

    def get(self, key: str):
        return OmegaConf.select(OmegaConf.create(self.config), key)


def local_runs(folder: Path) -> list[Run]:
    """One Run per job below `folder` that logged to W&B. A resumed job started a W&B run per attempt; the last one
    (the folder names end in <time>-<id>) is the one that finished and logged the metrics."""
    runs = []
    for summary in sorted(folder.rglob("summary.json")):
        job = summary.parent
        attempts = sorted(job.glob("wandb/*run-*"), key=lambda path: path.name.split("-")[-2])
        if attempts:
            metrics = json.loads(summary.read_text())["metrics"]
            config = OmegaConf.to_container(OmegaConf.load(job / ".hydra" / "config.yaml"))
            runs.append(Run(attempts[-1].name.split("-")[-1], config, {*scalars(metrics), HISTOGRAM}))
    return runs


def group_runs(group: str, entity: str | None, project: str) -> list[Run]:
    try:
        api = wandb.Api()
        found = api.runs(f"{entity or api.default_entity}/{project}", filters={"group": group})
        return [Run(run.id, dict(run.config), set(run.summary.keys())) for run in found]
    except wandb.errors.Error as error:
        allowed = f"not a folder here, and W&B cannot look it up as a group: {error}"
        raise ConfigError("source", group, allowed) from error


def find_runs(source: str, entity: str | None, project: str) -> list[Run]:
    folder = Path(source)
    runs = local_runs(folder) if folder.is_dir() else group_runs(source, entity, project)
    if not runs:
        where = "below this folder" if folder.is_dir() else f"in that group of {entity or 'your entity'}/{project}"
        raise ConfigError("source", source, f"no W&B runs {where}; run the sweep with logger=wandb")
    return runs


def workspace(runs: list[Run], name: str, entity: str, project: str) -> ws.Workspace:
    keys = set().union(*(run.keys for run in runs))
    sections = [efficiency_section(), acceptance_section(keys), speed_section(keys), arena_section(keys)]
    return ws.Workspace(
        name=name, entity=entity, project=project, sections=[section for section in sections if section],
        runset_settings=ws.RunsetSettings(filters=[ws.Metric("ID").isin([run.id for run in runs])],
                                          run_settings=run_colors(runs)))


def run_colors(runs: list[Run]) -> dict[str, ws.RunSettings]:
    """A hue per verifier (matplotlib's default cycle, as the report's PNGs), mixed with white the more the longer
    the run's blocks: the scatter points tell both apart, as the report's panel per block length does."""
    verifiers = sorted({str(run.get(VERIFIER)) for run in runs})
    lengths = sorted({run.get("block_length") for run in runs})

    def color(run: Run) -> str:
        hue = to_rgb(f"C{verifiers.index(str(run.get(VERIFIER))) % 10}")
        white = 0.6 * lengths.index(run.get("block_length")) / len(lengths)
        return to_hex([(1 - white) * channel + white for channel in hue])
    return {run.id: ws.RunSettings(color=color(run)) for run in runs}


def section(name: str, panels: list) -> ws.Section:
    return ws.Section(name=name, panels=panels, is_open=True)


def efficiency_section() -> ws.Section:
    against = [wr.ScatterPlot(title=f"block efficiency against {knob}", x=wr.Config(knob),
                              y=wr.SummaryMetric(EFFICIENCY), legend_template=LEGEND) for knob in KNOBS]
    columns = [wr.ParallelCoordinatesPlotColumn(metric) for metric in
               (*(wr.Config(key) for key in (VERIFIER, *KNOBS)), wr.SummaryMetric(EFFICIENCY))]
    return section("Block efficiency", [*against, wr.ParallelCoordinatesPlot(title="every knob", columns=columns)])


def acceptance_section(keys: set[str]) -> ws.Section:
    positions = sorted((key for key in keys if key.startswith("overall/acceptance_at_")),
                       key=lambda key: int(key.rsplit("_", 1)[1]))
    return section("Acceptance", [
        wr.BarPlot(title="acceptance by position, P(tau >= i)", metrics=positions, orientation="v",
                   legend_template=LEGEND),
        wr.LinePlot(title="accepted-length histogram", y=[HISTOGRAM], legend_template=LEGEND)])


def speed_section(keys: set[str]) -> ws.Section | None:
    measured = [key for key in SPEED if key in keys]
    if not measured:
        return None
    return section("Speed", [wr.BarPlot(title="speedup over ar beside its cost-model limit", metrics=measured,
                                        orientation="v", legend_template=LEGEND)])


def arena_section(keys: set[str]) -> ws.Section | None:
    arena = sorted(key for key in keys if "arena" in key)
    paired = [key for key in arena if "paired" in key or "diff" in key]
    groups = {"per verifier": [key for key in arena if key not in paired], "paired differences": paired}
    panels = [wr.BarPlot(title=title, metrics=metrics, orientation="v", legend_template=LEGEND)
              for title, metrics in groups.items() if metrics]
    return section("Arena", panels) if panels else None


def save(view: ws.Workspace, entity: str | None) -> None:
    try:
        view.entity = entity or wandb.Api().default_entity
        view.save()  # W&B prints the view's URL
    except wandb.errors.Error as error:
        raise ConfigError("--save", f"{view.entity or '<default entity>'}/{view.project}",
                          f"W&B cannot save the workspace there: {error}") from error


def main(argv: list[str] | None = None) -> None:
    project = yaml.safe_load(LOGGER_CONF.read_text())["project"]
    parser = argparse.ArgumentParser(prog="python -m spectr_gbv.tools.wandb_dashboard",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("source", help="a sweep folder (read here) or a W&B group (looked up in W&B)")
    parser.add_argument("--save", action="store_true", help="save the workspace to W&B; without it, print its spec")
    parser.add_argument("--entity", help="W&B entity (default: your default entity)")
    parser.add_argument("--project", default=project, help=f"W&B project (default: {project})")
    args = parser.parse_args(argv)
    try:
        runs = find_runs(args.source, args.entity, args.project)
        view = workspace(runs, f"spectr-gbv {Path(args.source).name}", args.entity or "", args.project)
        if args.save:
            save(view, args.entity)
        else:  # the view exactly as save() would send it
            print(json.dumps(view._spec, indent=2))
    except ConfigError as error:
        sys.exit(f"error: {error}")


if __name__ == "__main__":
    main()

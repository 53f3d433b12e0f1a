"""The W&B workspace of a real sweep (tiny models, W&B offline, no network): every panel reads a metric the runs
logged and every axis a config key they have; arena panels appear only with arena metrics; no runs is one line."""
import json
import os
import subprocess
import sys

import pytest
import wandb_workspaces.reports.v2 as wr
from conftest import ROOT, TINY

from spectr_gbv.tools import wandb_dashboard as dashboard

SWEEP = ["limit=1", "max_new_tokens=4", "verifier=gbv,token", "num_drafts=1", "block_length=2,4", "baseline=true",
         "logger=wandb"]


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    root = tmp_path_factory.mktemp("dashboard")
    folder = root / "my-sweep"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_DIR": str(root), "WANDB_MODE": "offline"}
    done = subprocess.run([sys.executable, "run.py", "-m", *TINY, *SWEEP, f"hydra.sweep.dir={folder}"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return folder


def logged(sweep) -> dict[str, bytes]:
    """Each offline W&B run's own record file, by run id: what `wandb sync` would upload."""
    return {path.stem.removeprefix("run-"): path.read_bytes() for path in sweep.glob("*/wandb/offline-run-*/*.wandb")}


def names(panel) -> tuple[set[str], set[str]]:
    """The metrics and the config keys a panel reads."""
    fields = []
    for attribute in ("x", "y", "metrics", "columns"):
        value = getattr(panel, attribute, None)
        fields += value if isinstance(value, list) else [value]
    fields = [field.metric if isinstance(field, wr.ParallelCoordinatesPlotColumn) else field for field in fields]
    metrics = {field.name if isinstance(field, wr.SummaryMetric) else field for field in fields
               if isinstance(field, (str, wr.SummaryMetric))}
    return metrics - {"Step"}, {field.name for field in fields if isinstance(field, wr.Config)}  # Step: W&B's own


def test_every_panel_reads_what_the_runs_logged(sweep):
    runs, files = dashboard.local_runs(sweep), logged(sweep)
    assert sorted(run.id for run in runs) == sorted(files) and len(runs) == 4
    for run in runs:  # the keys read from summary.json are the ones W&B recorded
        assert all(key.encode() in files[run.id] for key in run.keys), run.id
    view = dashboard.workspace(runs, "test", "", "spectr-gbv")
    assert [section.name for section in view.sections] == ["Block efficiency", "Acceptance", "Speed"]
    for section in view.sections:
        for panel in section.panels:
            metrics, configs = names(panel)
            assert metrics or configs, panel
            for metric in metrics:  # acceptance_at_3 and _4: only the runs with L=4 have them
                assert any(metric in run.keys for run in runs), metric
            for key in configs:
                assert all(run.get(key) is not None for run in runs), key
                assert all(key.split(".")[0].encode() in data for data in files.values()), key
    acceptance = view.sections[1].panels[0].metrics
    assert acceptance == [f"overall/acceptance_at_{i}" for i in range(1, 5)]
    assert view.sections[2].panels[0].metrics == ["overall/speedup", "overall/speed_limit"]
    assert len(set(view.runset_settings.run_settings[run.id].color for run in runs)) == 4  # verifier x block length


def test_arena_panels_appear_with_arena_metrics(sweep):
    runs = dashboard.local_runs(sweep)
    runs[0].keys |= {"overall/arena_expected_tau_gbv", "overall/arena_paired_diff_gbv_token"}
    [arena] = [section for section in dashboard.workspace(runs, "test", "", "p").sections if section.name == "Arena"]
    assert [panel.metrics for panel in arena.panels] == [["overall/arena_expected_tau_gbv"],
                                                        ["overall/arena_paired_diff_gbv_token"]]


def test_the_command_prints_the_spec_of_the_sweep(sweep, capsys):
    dashboard.main([str(sweep)])
    spec = json.loads(capsys.readouterr().out)
    assert spec["displayName"] == "spectr-gbv my-sweep" and spec["project"] == "spectr-gbv"
    [runset] = spec["spec"]["section"]["runSets"]
    assert sorted(runset["filters"]["filters"][0]["value"]) == sorted(logged(sweep))


def test_a_folder_without_runs_is_one_line(tmp_path):
    (tmp_path / "job").mkdir()
    (tmp_path / "job" / "summary.json").write_text("{}")  # logged to csv only: no W&B run
    with pytest.raises(SystemExit) as exit_:
        dashboard.main([str(tmp_path)])
    assert exit_.value.code == f"error: source={tmp_path}: no W&B runs below this folder; run the sweep with " \
                               "logger=wandb"

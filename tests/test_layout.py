"""The package's layers: each imports only the layers below it, and the public API is at the package root."""
import ast
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "spectr_gbv"
LAYERS = ["verifiers", "decoding", "experiment", "tools"]  # bottom to top; errors.py sits below them all


def imported_layers(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return {name.split(".")[1] for name in names if name.startswith("spectr_gbv.") and name.count(".") >= 1}


@pytest.mark.parametrize("layer", LAYERS)
def test_imports_point_down(layer):
    above = set(LAYERS[LAYERS.index(layer) + 1:])
    for path in (PACKAGE / layer).glob("*.py"):
        assert not imported_layers(path) & above, f"{path.relative_to(PACKAGE)} imports a layer above its own"


def test_public_api_at_the_package_root():
    from spectr_gbv import VERIFIERS, Sampling, SpeculativeEngine, build_verifier, optimal_acceptance, packaged, tiny

    assert SpeculativeEngine.__module__ == "spectr_gbv.decoding.engine" and "gbv" in VERIFIERS
    assert callable(build_verifier) and callable(optimal_acceptance) and callable(packaged) and callable(tiny)
    assert Sampling().temperature == 1.0


def test_the_report_and_the_records_do_not_import_torch():
    code = "import sys, spectr_gbv.tools.report, spectr_gbv.experiment.metrics; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"


@pytest.mark.parametrize("tool", ["tools.audit", "tools.bench", "tools.bench_engine", "tools.report",
                                  "tools.wandb_sweep", "tools.wandb_dashboard", "decoding.gguf_packages"])
def test_every_command_line_refuses_an_unknown_flag(tool, capsys):
    import importlib

    with pytest.raises(SystemExit) as exit_:
        importlib.import_module(f"spectr_gbv.{tool}").main(["--anything"])
    error = capsys.readouterr().err
    assert exit_.value.code == 2 and error.startswith(f"usage: python -m spectr_gbv.{tool}")


def test_the_readme_stays_a_guide():
    """README.md is the user's guide, not the project's history: measurements live in docs/."""
    assert len((ROOT / "README.md").read_text().splitlines()) <= 300

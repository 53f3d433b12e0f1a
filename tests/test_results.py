"""docs/results.md quotes the report of the committed study runs: every table row in it is a row that
`python -m spectr_gbv.tools.report docs/runs/<part>` prints, so no figure in a table can drift from the runs."""
import shutil

from conftest import ROOT
from spectr_gbv.tools.report import main

RUNS = ROOT / "docs" / "runs"


def test_every_table_row_of_results_is_printed_by_the_report(tmp_path, capsys):
    printed = set()
    for part in sorted(path for path in RUNS.iterdir() if path.is_dir()):
        shutil.copytree(part, tmp_path / part.name)  # the report writes its files beside the summaries
        main([str(tmp_path / part.name)])
        printed.update(capsys.readouterr().out.splitlines())
    results = (ROOT / "docs" / "results.md").read_text().splitlines()
    rows = [line for line in results if line.startswith("| ")]  # headers included; separators start "|---"
    assert rows and not [row for row in rows if row not in printed]

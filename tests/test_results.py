"""The results pages quote the report of the committed study runs: every table row in them is a row that
`python -m spectr_gbv.tools.report <folder>/<part>` prints for one of the page's parts, so no figure in a table can
drift from the runs, and `report --page` finds nothing to refresh."""
import shutil

import pytest

from conftest import ROOT
from spectr_gbv.tools.report import main

PAGES = {"results.md": "study"}  # page under docs/ -> its runs under docs/


@pytest.mark.parametrize("page", PAGES)
def test_every_table_row_of_a_results_page_is_printed_by_the_report(page, tmp_path, capsys):
    """...and is current: refreshing the page from its parts' reports (report --page) changes nothing."""
    current = tmp_path / page
    shutil.copy(ROOT / "docs" / page, current)
    printed = set()
    for part in sorted(path for path in (ROOT / "docs" / PAGES[page]).iterdir() if path.is_dir()):
        shutil.copytree(part, tmp_path / part.name)  # the report writes its files beside the summaries
        main([str(tmp_path / part.name), "--page", str(current)])
        printed.update(capsys.readouterr().out.splitlines())
    results = (ROOT / "docs" / page).read_text().splitlines()
    rows = [line for line in results if line.startswith("| ")]  # headers included; separators start "|---"
    assert rows and not [row for row in rows if row not in printed]
    assert current.read_text() == (ROOT / "docs" / page).read_text()

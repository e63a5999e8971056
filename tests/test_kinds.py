"""Every kind of run reads right: DataParallel on CPU workers, balanced, DDP ranks, a failed run, a script that
built no DataParallel, and imported traces (the real ones in ../shared/traces, and a CPU-only one recorded
here). Each run's pages open without an exception, draw no chart without data, use no DataParallel-only
wording on a run that is not DataParallel, and `dpprof show` / `dpprof export` exit 0 without a traceback."""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import forked
import pytest
from streamlit.testing.v1 import AppTest

import dpprof
from dpprof.cli import main
from dpprof.plaintext import shown_text
from dpprof.trace import import_traces
from recorded import record, record_failed

pytestmark = pytest.mark.slow  # its fixture records a run of every kind, DDP and FSDP under torchrun among them

ROOT = Path(__file__).resolve().parents[1]
APP = ROOT / "app.py"
TRACES = ROOT.parent / "shared" / "traces"
RUN_PAGES = ["overview", "load", "timeline", "advise", "export"]
# Words that only describe DataParallel (one process scattering a batch to replicas and gathering their
# outputs): on a run of another kind they would misdescribe it.
DATAPARALLEL_WORDS = ["DataParallel tax", "parallel_apply", "apply (all devices)", "Nothing is gathered", "replica",
                      "scatter", "gathered outputs", "output device", "CPU workers", "chunk"]


def _cpu_only_trace(path: Path) -> Path:
    """A torch.profiler trace of a CPU-only training loop, recorded here in a fresh process."""
    code = f"""
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile, schedule
m = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10)); opt = torch.optim.SGD(m.parameters(), 0.1)
with profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=0, warmup=1, active=5),
             on_trace_ready=lambda p: p.export_chrome_trace({str(path)!r})) as p:
    for _ in range(6):
        loss = m(torch.randn(16, 32)).sum(); opt.zero_grad(); loss.backward(); opt.step(); p.step()
"""
    forked.run([sys.executable, "-c", code], check=True, capture_output=True, timeout=120)
    return path


@pytest.fixture(scope="module")
def kinds(tmp_path_factory, profiled):
    """One run of each kind the code makes, in one reports directory: name -> (run id, expected kind)."""
    directory = tmp_path_factory.mktemp("kinds")
    runs = {"dataparallel": (record(directory, "dp", workers=2, steps=4, batch_size=16).id, "dataparallel"),
            "balanced": (record(directory, "bal", workers=3, steps=4, batch_size=33, balanced=True).id, "balanced"),
            "failed": (record_failed(directory).id, "dataparallel")}
    profiled(directory, "tutorial-linear", "--ddp", "--nproc", "2", "--steps", "4")  # recorded once a session
    listing = dpprof.list_runs(directory)
    runs["ddp"] = (listing[listing["ranks"] == 2]["id"].iloc[0], "ddp")
    profiled(directory, "tutorial-linear", "--fsdp", "--nproc", "2", "--steps", "4")  # recorded once a session
    listing = dpprof.list_runs(directory)
    runs["fsdp"] = (listing[(listing["ranks"] == 2) & (listing["id"] != runs["ddp"][0])]["id"].iloc[0], "fsdp")
    done = forked.run([sys.executable, "-m", "dpprof", "--reports-dir", str(directory), "run",
                       str(ROOT / "tests" / "scripts" / "no_parallel.py")], capture_output=True, text=True,
                      timeout=120)
    assert done.returncode == 3, done.stderr
    listing = dpprof.list_runs(directory)
    runs["no_parallel"] = (listing[listing["name"] == "no_parallel.py"]["id"].iloc[0], "empty")
    for trace in sorted(TRACES.glob("*.json.gz")):
        runs[trace.name] = (import_traces([trace], directory).id, "trace_gpu")
    cpu_trace = _cpu_only_trace(tmp_path_factory.mktemp("trace") / "cpu_only.pt.trace.json")
    runs["trace_cpu"] = (import_traces([cpu_trace], directory).id, "trace_cpu")
    return SimpleNamespace(dir=directory, runs=runs)


KINDS = ["dataparallel", "balanced", "failed", "ddp", "fsdp", "no_parallel", "trace_cpu",
         *sorted(p.name for p in TRACES.glob("*.json.gz"))]


@pytest.mark.parametrize("name", KINDS)
def test_the_run_model_knows_each_kind(kinds, name):
    run_id, kind = kinds.runs[name]
    run = dpprof.load_run(run_id, kinds.dir)
    model = run.model
    assert model.kind == kind
    for table in ("steps", "phases", "memory", "allocator", "comms", "gpu_time"):
        assert "rank" in run.table(table).columns  # the same columns whatever the kind
    if kind == "empty":
        assert "built no DataParallel" in model.empty_reason
    else:
        assert model.devices and set(model.work.phases) <= set(model.phases)
        assert model.dataparallel == (kind in ("dataparallel", "balanced"))


def _chart_data(at: AppTest) -> list[dict]:
    return [json.loads(c.proto.spec) for c in at.get("plotly_chart")]


def _numbers(values) -> list[float]:
    if isinstance(values, dict):  # plotly's packed arrays: {"dtype": ..., "bdata": ...}
        import base64

        import numpy as np

        return np.frombuffer(base64.b64decode(values["bdata"]), dtype=values["dtype"]).tolist()
    return [v for v in values if isinstance(v, (int, float))]


def _empty_traces(figures: list[dict]) -> list[str]:
    """Traces (or subplot panels) that draw nothing: no number but zero and no label saying why."""
    empty = []
    for fig in figures:
        title = (fig["layout"].get("title") or {}).get("text", "")
        for trace in fig["data"]:
            values = [v for key in ("x", "y") for v in _numbers(trace.get(key) or [])]
            labelled = any(str(t).strip() for t in (trace.get("text") or []))
            if not any(v == v and v != 0 for v in values) and not labelled:
                empty.append(f"{title}: {trace.get('name')}")
    return empty


def _page_text(at: AppTest) -> str:
    parts = [shown_text(e.value) for kind in ("markdown", "caption", "info", "warning", "error", "success", "subheader",
                                               "title")
             for e in at.get(kind) if isinstance(getattr(e, "value", None), str)]
    parts += [shown_text(str(m.label)) + " " + str(m.value) for m in at.get("metric")]
    return "\n".join(parts)


@pytest.mark.parametrize("page", RUN_PAGES)
@pytest.mark.parametrize("name", KINDS)
def test_every_run_page_reads_right_for_every_kind(kinds, monkeypatch, name, page):
    monkeypatch.setenv("DPPROF_REPORTS", str(kinds.dir))
    run_id, kind = kinds.runs[name]
    at = AppTest.from_file(str(APP), default_timeout=90)
    at.query_params["run"] = run_id
    at.run()
    assert not at.exception, [e.message for e in at.exception]
    at.switch_page(f"app_pages/{page}.py").run()
    assert not at.exception, [e.message for e in at.exception]
    assert at.sidebar.selectbox[0].value == run_id
    assert not _empty_traces(_chart_data(at)), _empty_traces(_chart_data(at))
    # the charts' words too: their titles, trace names (a legend) and category labels (an axis)
    words = [str(f.get("layout", {}).get("title", {}).get("text", "")) for f in _chart_data(at)]
    words += [str(t.get("name", "")) for f in _chart_data(at) for t in f.get("data", [])]
    words += [str(x) for f in _chart_data(at) for t in f.get("data", []) for x in (t.get("x") or [])
              if isinstance(t.get("x"), list) and isinstance(x, str)]
    text = _page_text(at) + "\n" + "\n".join(words)
    if kind not in ("dataparallel", "balanced"):
        if kind == "fsdp":  # FSDP's own collective, not DataParallel's scatter
            text = re.sub(r"reduce[-_ ]scatter", "", text, flags=re.I)
        said = [w for w in DATAPARALLEL_WORDS if w.lower() in text.lower()]
        assert not said, (said, text)
    if kind == "empty":
        assert "built no DataParallel" in text and not at.get("plotly_chart")
    if kind == "fsdp":  # its own words: no all-reduce, and FSDP as it is written
        assert "all-reduce" not in text.lower() and "fsdp's" not in text, text


@pytest.mark.parametrize("name", KINDS)
def test_show_and_export_read_every_kind(kinds, name, tmp_path, capsys):
    run_id, kind = kinds.runs[name]
    assert main(["--reports-dir", str(kinds.dir), "show", run_id]) == 0
    out = capsys.readouterr()
    # no traceback of dpprof's own (a failed run's stored error may quote its script's)
    assert not re.search(r"^Traceback", out.out + out.err, re.M) and " None" not in out.out and "nan" not in out.out
    if kind == "empty":
        assert "built no DataParallel" in out.out
    elif kind == "ddp":
        assert "per rank (forward + backward compute)" in out.out and "apply" not in out.out
    elif kind.startswith("trace"):
        assert "apply" not in out.out and "chunk" not in out.out
    assert main(["--reports-dir", str(kinds.dir), "export", run_id, "--out", str(tmp_path / "csv")]) == 0
    assert (tmp_path / "csv" / "device_summary.csv").is_file() and (tmp_path / "csv" / "steps.csv").is_file()


def test_an_imported_traces_allocator_peak_is_in_show_and_the_device_summary(kinds, tmp_path, capsys):
    run_id, _ = kinds.runs["resnet50-1gpu-tb-sample.pt.trace.json.gz"]
    import pandas as pd

    run = dpprof.load_run(run_id, kinds.dir)
    peak = run.allocator["peak_allocated_bytes"].max()
    assert main(["--reports-dir", str(kinds.dir), "export", run_id, "--out", str(tmp_path)]) == 0
    summary = pd.read_csv(tmp_path / "device_summary.csv").set_index("device")
    assert summary.loc["cuda:0", "peak_allocated_bytes"] == peak
    main(["--reports-dir", str(kinds.dir), "show", run_id])
    shown = "peak allocated (GiB)" if peak >= 2**30 else "peak allocated (MiB)"
    out = capsys.readouterr().out
    assert shown in out and f"{peak / (2**30 if peak >= 2**30 else 2**20):,.2f}" in out


def test_a_run_with_no_steps_is_no_figure_in_compare_and_its_timeline_is_not_waiting(kinds, monkeypatch):
    """Compare against a run that recorded nothing makes up no share of its step; its Timeline does not say "yet"."""
    from dpprof.views.compare import compare

    empty, _ = kinds.runs["no_parallel"]
    recorded, _ = kinds.runs["dataparallel"]
    said = " ".join(compare([dpprof.load_run(i, kinds.dir) for i in (recorded, empty)]).differences)
    assert "% of" not in said and "points" not in said, said
    monkeypatch.setenv("DPPROF_REPORTS", str(kinds.dir))
    at = AppTest.from_file(str(APP), default_timeout=90)
    at.query_params["run"] = empty
    at.run()
    at.switch_page("app_pages/timeline.py").run()
    shown = _page_text(at)
    assert "The run recorded no steps" in shown and "yet" not in shown


@pytest.mark.parametrize("name", KINDS)
def test_reading_a_run_changes_none_of_its_tables(kinds, name):
    """Every view reads a run's tables from one cache (StoredRun.table), shared by the pages of a session: a view or a
    rule that wrote into a frame it read would change what every later page shows. After the Overview, the load,
    the timeline, the findings, the export's tables and the detail pages, each table is still what a fresh read of
    the file gives."""
    import pandas as pd

    from dpprof.findings import run_findings, tables_of
    from dpprof.store.schema import TABLES
    from dpprof.views import kernels, memory, operators
    from dpprof.views.export import export_tables
    from dpprof.views.load import load
    from dpprof.views.overview import overview
    from dpprof.views.timeline import default_timeline_range, timeline

    run_id, _ = kinds.runs[name]
    run = dpprof.load_run(run_id, kinds.dir)
    overview(run), load(run), run_findings(run, fresh=True), tables_of(run, last_steps=3), export_tables(run)
    timeline(run, *default_timeline_range(run))
    for page, view in ((operators.operators_page, operators), (kernels.kernels_page, kernels),
                       (memory.memory_page, memory)):
        for pick in view.picks(run)[:2]:
            page(run, pick)
    fresh = dpprof.load_run(run_id, kinds.dir)
    for table in TABLES:
        pd.testing.assert_frame_equal(run.table(table), fresh.table(table), obj=table)

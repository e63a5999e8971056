"""The dashboard on imported torch.profiler traces (streamlit AppTest): every page of each shared trace's
run opens with no exception and no empty chart, and the Runs page imports a trace file of the reports
directory on a click."""
from __future__ import annotations

import json
import os
import shutil
import sys
import threading
import time
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

import dpprof
from dpprof.plaintext import shown_text
from dpprof.trace import import_traces, pending_traces

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
        assert shown_text(at.title[0].value) == job
    if page == "load":  # the trace's Distributed view: each GPU's step by what it ran
        assert "GPU time per device (from the trace)" in [shown_text(s.value) for s in at.subheader]


RESNET_JOB, RANKS_JOB = "resnet50 (1 GPU, 2021 format, memory)", "ddp 128 ranks (ranks 0 and 1)"


def _opened(imported, monkeypatch, job: str) -> AppTest:
    """The dashboard on the imported ``job`` (its Overview)."""
    directory, ids = imported
    monkeypatch.setenv("DPPROF_REPORTS", str(directory))
    at = AppTest.from_file(str(APP), default_timeout=90)
    at.session_state[common.RUN_KEY] = ids[job]
    at.run()
    return at


@pytest.mark.parametrize("page,other,by,by_value,search,term,table", [
    ("operators", "kernels", "ops_by", "shape", "ops_search", "conv", 0),
    ("kernels", "operators", "k_by", "operator", "k_search", "gemm", -1),
])
def test_the_search_and_grouping_outlive_a_visit_to_another_page(imported, monkeypatch, page, other, by, by_value,
                                                                  search, term, table):
    at = _opened(imported, monkeypatch, RESNET_JOB)
    at.switch_page(f"app_pages/{page}.py").run()
    at.radio(key=by).set_value(by_value)
    at.text_input(key=search).input(term).run()
    rows = len(at.dataframe[table].value)
    at.switch_page(f"app_pages/{other}.py").run()
    at.switch_page(f"app_pages/{page}.py").run()
    assert not at.exception, [e.message for e in at.exception]
    assert at.radio(key=by).value == by_value and at.text_input(key=search).value == term
    assert len(at.dataframe[table].value) == rows


@pytest.mark.parametrize("page,key,job,chosen,elsewhere", [
    ("operators", "ops_pick", RANKS_JOB, "rank 1", "cuda:0"),
    ("kernels", "k_pick", RANKS_JOB, "rank 1", "cuda:0"),
    ("memory", "mem_pick", RESNET_JOB, "cuda:0", None),  # the only job with [memory] events
])
def test_the_rank_or_device_chosen_outlives_another_page(imported, monkeypatch, page, key, job, chosen, elsewhere):
    """A rank or device chosen, then Overview and back: still chosen, its rows shown (Streamlit drops the state of a
    widget not drawn: 'all devices' again). On a run without that rank the picker shows one it has."""
    at = _opened(imported, monkeypatch, job)
    at.switch_page(f"app_pages/{page}.py").run()
    box = at.selectbox(key=key)
    box.select_index(box.options.index(chosen)).run()
    shown = [d.value.to_csv() for d in at.dataframe]
    at.switch_page("app_pages/overview.py").run()
    at.switch_page(f"app_pages/{page}.py").run()
    assert not at.exception, [e.message for e in at.exception]
    assert at.selectbox(key=key).value.label() == chosen
    assert [d.value.to_csv() for d in at.dataframe] == shown
    if elsewhere:
        at.session_state[common.RUN_KEY] = imported[1][RESNET_JOB]
        at.run()
        assert not at.exception, [e.message for e in at.exception]
        assert at.selectbox(key=key).value.label() == elsewhere


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
    assert "Imported run" in "\n".join(shown_text(s.value) for s in at.success)
    at.run()
    runs = at.dataframe[0].value
    assert runs["workload"].tolist() == ["job"] and runs["devices"].tolist() == ["rank:0"]  # the file's job
    assert not any("traces to import" in shown_text(s.value) for s in at.subheader)  # imported: no longer listed


def _runs_page(monkeypatch, directory: Path, rows: list[int] | None = None) -> AppTest:
    """The Runs page on ``directory``, with these rows of the trace listing selected."""
    monkeypatch.setenv("DPPROF_REPORTS", str(directory))
    at = AppTest.from_file(str(APP), default_timeout=90)
    at.run()
    at.switch_page("app_pages/runs.py").run()
    if rows is not None:
        at.session_state["traces_table"] = {"selection": {"rows": rows, "columns": [], "cells": []}}
        at.run()
    assert not at.exception, [e.message for e in at.exception]
    return at


def _copy(name: str, directory: Path, age_s: float) -> None:
    """A shared trace dropped into the reports directory, modified age_s ago (the listing is oldest first)."""
    path = directory / name
    shutil.copyfile(TRACES / name, path)
    when = time.time() - age_s
    os.utime(path, (when, when))


def test_import_takes_the_files_selected_when_it_was_pressed_though_the_listing_changed(tmp_path, monkeypatch):
    _copy("resnet50-1gpu-tb-sample.pt.trace.json.gz", tmp_path, age_s=200)
    _copy("ddp-2ranks-rank0-nccl.json.gz", tmp_path, age_s=100)
    at = _runs_page(monkeypatch, tmp_path, rows=[1])  # the second row: the DDP rank
    assert at.dataframe[-1].value["file"].tolist()[1] == "ddp-2ranks-rank0-nccl.json.gz"
    _copy("ddp-128ranks-rank0-sampled.json.gz", tmp_path, age_s=300)  # dropped in before the click: now first
    at.button(key="import_traces").click().run()
    assert not at.exception, [e.message for e in at.exception]
    assert "Imported run" in "\n".join(shown_text(s.value) for s in at.success)
    [run_id] = dpprof.list_runs(tmp_path)["id"]
    assert dpprof.load_run(run_id, tmp_path).meta["workload_args"]["trace_file"] == "ddp-2ranks-rank0-nccl.json.gz"
    assert sorted(pending_traces(tmp_path)["file"]) == ["ddp-128ranks-rank0-sampled.json.gz",
                                                        "resnet50-1gpu-tb-sample.pt.trace.json.gz"]
    assert at.button(key="import_traces").disabled  # the selection went with the listing it was made in


def test_a_second_press_on_a_trace_imported_meanwhile_says_which_run_it_is(tmp_path, monkeypatch):
    _copy("ddp-2ranks-rank0-nccl.json.gz", tmp_path, age_s=100)
    first, second = (_runs_page(monkeypatch, tmp_path, rows=[0]) for _ in range(2))  # two tabs, the same row
    first.button(key="import_traces").click().run()
    [run_id] = dpprof.list_runs(tmp_path)["id"]
    second.button(key="import_traces").click().run()  # pressed before that tab saw the import
    assert not second.exception, [e.message for e in second.exception]
    assert (f"ddp-2ranks-rank0-nccl.json.gz is already imported as run {run_id}"
            in "\n".join(shown_text(w.value) for w in second.warning))
    assert dpprof.list_runs(tmp_path)["id"].tolist() == [run_id]  # no second run
    assert second.session_state[common.RUN_KEY] == run_id


def test_the_import_button_is_disabled_while_an_import_is_under_way(tmp_path, monkeypatch):
    _copy("ddp-2ranks-rank0-nccl.json.gz", tmp_path, age_s=100)
    with common.import_lock():  # another tab's import
        at = _runs_page(monkeypatch, tmp_path, rows=[0])
        assert at.button(key="import_traces").disabled
    at.run()
    assert not at.button(key="import_traces").disabled


@pytest.fixture
def tabs_at_once(monkeypatch):
    """AppTest runs concurrently in threads, as two browser tabs run on one server. AppTest keeps its mock
    Runtime in one class attribute, set when a run starts and cleared when it ends, so the first run to end
    would clear it under the other (``Runtime hasn't been created!`` at the other's end); here it is cleared
    only when the last run in flight ends. And Python 3.11's ``ast.parse`` keeps its recursion depth in shared
    state, so two threads compiling the page at once can fail with "AST constructor recursion depth mismatch":
    Streamlit's parse of the script (``magic.add_magic``) runs one thread at a time here."""
    from streamlit.runtime import Runtime
    from streamlit.runtime.scriptrunner import magic
    from streamlit.testing.v1 import app_test

    parse_lock = threading.Lock()
    add_magic = magic.add_magic

    def add_magic_alone(*args, **kwargs):
        with parse_lock:
            return add_magic(*args, **kwargs)

    monkeypatch.setattr(magic, "add_magic", add_magic_alone)

    in_flight = [0]
    guard = threading.Lock()

    class Shared(type):
        def __setattr__(cls, name, value):
            if name != "_instance":
                return super().__setattr__(name, value)
            with guard:
                in_flight[0] += 1 if value is not None else -1
                if value is not None or in_flight[0] == 0:
                    Runtime._instance = value

    class SharedRuntime(Runtime, metaclass=Shared):
        pass

    monkeypatch.setattr(app_test, "Runtime", SharedRuntime)


def test_two_tabs_pressing_import_at_once_make_one_run(tmp_path, monkeypatch, tabs_at_once):
    _copy("ddp-2ranks-rank0-nccl.json.gz", tmp_path, age_s=100)
    tabs = [_runs_page(monkeypatch, tmp_path, rows=[0]) for _ in range(2)]
    for at in tabs:
        at.button(key="import_traces").click()
    presses = [threading.Thread(target=at.run) for at in tabs]
    for press in presses:
        press.start()
    for press in presses:
        press.join(120)
    assert not any(press.is_alive() for press in presses)
    assert not any(at.exception for at in tabs), [e.message for at in tabs for e in at.exception]
    [run_id] = dpprof.list_runs(tmp_path)["id"]  # the second import waited for the first, then found its run
    said = sorted(shown_text(m.value) for at in tabs for m in [*at.success, *at.warning])
    assert said == [f"Imported run {run_id}: 3 steps on rank:0.",
                    f"Nothing imported: ddp-2ranks-rank0-nccl.json.gz is already imported as run {run_id}."]


# A trace file's name is the default run name and is shown in the messages: markdown and an image in it stay text.
HOSTILE_FILE = "**bad** [y](javascript:alert(1)) ![t](https:198.51.100.7) :red[z] $a$.pt.trace.json"


@pytest.mark.parametrize("content", [
    b'{"schemaVersion": 1, "traceEvents": [',  # cut off mid-file
    b'{"schemaVersion": 1}',  # no events at all
    b'{"traceEvents": [{"ph": "X", "name": "a\\nb", "ts": 1, "dur": 2}]}\n' + b"\x00" * 8,  # a NUL after the JSON
])
def test_a_refused_trace_is_one_line_of_text_on_the_runs_page(tmp_path, monkeypatch, content):
    from markdown_it import MarkdownIt

    from dpprof.trace import TraceError

    (tmp_path / HOSTILE_FILE).write_bytes(content)
    with pytest.raises(TraceError) as refused:  # what `dpprof import` says for the file, in one line
        import_traces([tmp_path / HOSTILE_FILE], tmp_path / "elsewhere")
    at = _runs_page(monkeypatch, tmp_path, rows=[0])
    at.button(key="import_traces").click().run()
    assert not at.exception, [e.message for e in at.exception]
    [error] = at.error
    assert "\n" not in error.value
    assert shown_text(error.value) == f"Not imported: {' '.join(str(refused.value).split())}"
    assert HOSTILE_FILE in shown_text(error.value)
    tokens = MarkdownIt("commonmark").parse(error.value)[1].children
    assert {t.type for t in tokens} == {"text"}  # no link, image, emphasis or HTML from the file's name
    assert dpprof.list_runs(tmp_path).empty and (tmp_path / HOSTILE_FILE).read_bytes() == content

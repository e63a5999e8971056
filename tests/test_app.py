"""The dashboard (app.py and app_pages/) under streamlit's AppTest, on runs the CPU backend records.

Every page, the empty state, a running run, unreadable files, starting a run in a background process,
and choosing runs only from the listing.
"""
from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import signal
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from streamlit.testing.v1 import AppTest

import dpprof
from dpprof.plaintext import shown_text
from dpprof.units import bytes_unit, mib
from dpprof.views import overview
from dpprof.views.text import run_label
from dpprof.report import summary_of
from dpprof.store.reader import TABLES
from recorded import BUS, RunningRun, record, record_with_gpu_samples

ROOT = Path(__file__).resolve().parents[1]
APP = ROOT / "app.py"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from app_pages import common  # noqa: E402  (the same module object the app's pages use)

PAGES = ["runs", "overview", "load", "timeline", "advise", "compare", "devices", "new_run", "export"]


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """Two runs (2 devices plain, 3 devices balanced), a file that is no run and a truncated run file."""
    directory = tmp_path_factory.mktemp("reports")
    plain = record(directory, "plain", workers=2, steps=6, batch_size=32)
    balanced = record(directory, "balanced", workers=3, steps=6, batch_size=33, balanced=True)
    (directory / "notes.txt").write_text("not a run")
    (directory / "truncated.sqlite").write_bytes(plain.path.read_bytes()[:2048])
    return SimpleNamespace(dir=directory, plain=plain, balanced=balanced)


@pytest.fixture
def reports_with_runs(recorded, monkeypatch):
    monkeypatch.setenv("DPPROF_REPORTS", str(recorded.dir))
    return recorded


def _app() -> AppTest:
    at = AppTest.from_file(str(APP), default_timeout=60)
    at.run()
    assert not at.exception, at.exception
    return at


def _page(at: AppTest, page: str) -> AppTest:
    at.switch_page(f"app_pages/{page}.py").run()
    assert not at.exception, [e.message for e in at.exception]
    return at


def _charts(at: AppTest) -> int:
    return len(at.get("plotly_chart"))


def _texts(elements) -> str:
    """What the elements show: names and sentences are sent escaped (dpprof.plaintext), read here as shown."""
    return "\n".join(shown_text(e.value) for e in elements)


@pytest.mark.parametrize("page", PAGES)
def test_every_page_runs_on_recorded_runs(reports_with_runs, page):
    at = _page(_app(), page)
    assert at.title, page


def test_the_advisors_memory_per_worker_outlives_another_page_and_another_run(reports_with_runs, monkeypatch):
    """The memory per CPU worker is the machine's: given once, it stays after Overview and on the other run (Streamlit
    drops the state of a widget not drawn: 0, no memory, again)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(reports_with_runs.dir / "no-calibration"))
    at = _page(_app(), "advise")
    at.number_input(key="advise-memory").set_value(4.0).run()
    _page(_page(at, "overview"), "advise")
    assert at.number_input(key="advise-memory").value == 4.0
    at.sidebar.selectbox[0].set_value(reports_with_runs.plain.id).run()
    assert not at.exception, [e.message for e in at.exception]
    assert at.number_input(key="advise-memory").value == 4.0


def test_it_opens_on_the_newest_run(reports_with_runs):
    at = _app()
    assert shown_text(at.title[0].value) == "balanced"  # Overview of the run recorded last
    said = _texts(at.markdown)
    assert ":violet-badge[balanced]" in said  # marked in its header
    assert "Nothing is gathered" in said and "Scatter, replicate and gather" not in said
    assert at.sidebar.selectbox[0].value == reports_with_runs.balanced.id


def test_runs_lists_every_run_and_every_unreadable_file_with_its_reason(reports_with_runs):
    at = _page(_app(), "runs")
    listed = at.dataframe[0].value
    assert listed["name"].tolist() == ["balanced", "plain"]
    assert listed["status"].tolist() == ["finished", "finished"] and listed["steps"].tolist() == [6, 6]
    unreadable = at.dataframe[-1].value.set_index("file")["reason"]
    assert unreadable["notes.txt"] == "not a dpprof run: not an SQLite file"
    assert unreadable["truncated.sqlite"].startswith("corrupt or truncated")
    assert "⬇ runs.csv" in [b.label for b in at.download_button]


def test_a_run_opens_from_the_runs_table(reports_with_runs):
    at = _page(_app(), "runs")
    assert at.button(key="open_run").disabled
    at.session_state["runs_table"] = {"selection": {"rows": [1], "columns": [], "cells": []}}
    at.run()
    at.button(key="open_run").click().run()
    assert shown_text(at.title[0].value) == "plain" and at.sidebar.selectbox[0].value == reports_with_runs.plain.id


def test_overview_shows_step_time_phases_tax_and_findings(reports_with_runs):
    at = _app()
    at.sidebar.selectbox[0].select(reports_with_runs.plain.id).run()
    assert shown_text(at.title[0].value) == "plain"
    data = overview.overview(reports_with_runs.plain)
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["Steps"] == "6" and metrics["Median step"] == f"{data.stats['median_step_ms']:.2f} ms"
    assert metrics["DataParallel tax"] == f"{data.tax_pct:.1f}%"
    assert _charts(at) == 4  # each device at a glance, step time, phase breakdown, phase shares
    totals = at.dataframe[0].value
    assert totals["phase"].tolist() == data.totals["phase"].tolist()
    assert [s.value for s in at.subheader] == ["The DataParallel tax", "Findings"]
    assert "Worst first; from all 6 steps." in _texts(at.caption)
    for f in data.findings.table.itertuples():  # each finding with its evidence and advice
        assert f.title in _texts([*at.error, *at.warning, *at.info])


def test_overview_opens_on_each_device_with_the_worst_named_and_numbers_that_match_show(reports_with_runs, capsys):
    from dpprof.cli import main
    from dpprof.report import summary_of

    run = reports_with_runs.balanced  # the newest: the run the dashboard opens on
    at = _app()
    glance = overview.overview(run).glance
    summary = summary_of(run)
    # the glance's work is each device's median apply per step with the first step left out: the definition the
    # straggler finding uses (one imbalance on the page); its memory is dpprof show's per-device summary
    phases = run.phases[(run.phases["phase"] == "apply") & (run.phases["step"] > run.steps["step"].min())]
    medians = phases.groupby(["step", "device"])["duration_ms"].sum().unstack().median()
    assert glance.devices.set_index("device")["work_ms"].round(9).tolist() == medians.round(9).tolist()
    assert glance.devices.set_index("device")["peak_bytes"].tolist() == summary["peak_held_bytes"].tolist()
    slowest = medians.idxmax()
    ratio = medians[slowest] / medians.drop(slowest).median()
    assert glance.slowest == slowest and glance.time_ratio == pytest.approx(ratio)
    metrics = {m.label: m.value for m in at.metric}
    said = _texts(at.markdown)
    if glance.time_uneven:  # a headline only where the others' wait clears the findings' floors
        assert metrics["Slowest device"] == slowest and metrics["Apply imbalance"] == f"{ratio:.2f}x"
        assert f"{slowest} is the slowest" in said
    else:
        assert "Apply imbalance" not in metrics and "No straggler: the slowest device" in said
    assert ("Most memory" in metrics) == glance.memory_uneven
    first = json.loads(at.get("plotly_chart")[0].proto.spec)  # the first chart on the page: each device
    titles = [a["text"] for a in first["layout"]["annotations"]]
    assert titles[0] == "apply per step (ms, median)" and titles[1].startswith(f"memory ({bytes_unit(summary['peak_held_bytes'].max())[0]}, peak held")
    # one median: the steps table's, the dashboard's and dpprof show's
    median = dpprof.load_run(run.path).steps["duration_ms"].median()
    assert metrics["Median step"] == f"{median:.2f} ms"
    # one samples/s: what the steps past the first trained a second of the time from the first step's end to the last's
    steps = dpprof.load_run(run.path).steps.sort_values("step")
    ends = steps["start_ms"] + steps["duration_ms"]
    rate = steps["batch_size"].iloc[1:].sum() / (ends.iloc[-1] - ends.iloc[0]) * 1e3
    assert metrics["Samples/s"] == f"{rate:,.0f}"
    assert main(["show", run.id]) == 0
    out = capsys.readouterr().out
    assert f"median {median:.2f} ms" in out and f"\n  {rate:,.0f} samples/s: " in out


def test_an_idle_device_shows_as_zero_labelled_idle(reports):
    idle = record(reports, "idle", workers=2, steps=3, batch_size=1, workload="tutorial-linear")
    glance = overview.overview(idle).glance
    assert glance.idle == ["cpu:1"]
    assert glance.devices.set_index("device").loc["cpu:1", ["work_ms", "peak_bytes"]].tolist() == [0.0, 0.0]
    at = _app()
    assert "cpu:1 got no chunk in any step: idle" in _texts(at.markdown)
    assert '"idle"' in at.get("plotly_chart")[0].proto.spec
    at = _page(at, "load")
    assert all('idle: no chunk' in c.proto.spec for c in at.get("plotly_chart")), "apply, memory and chunks"
    assert "cpu:1 got no chunk in any step: idle, drawn at zero." in _texts(at.caption)
    assert at.dataframe[2].value["chunk size"].tolist() == [1]  # the chunk table: no row without a chunk


def test_a_one_step_run_says_why_the_first_screen_has_no_work_per_device(reports):
    one = record(reports, "one", workers=2, steps=1, batch_size=8, workload="tutorial-linear")
    glance = overview.overview(one).glance
    assert glance.devices["work_ms"].isna().all()  # the medians leave the first step out: none is left
    at = _app()
    said = _texts(at.markdown)
    assert ("No apply per device to compare: the medians leave out the first step (its one-time costs), and the "
            "run has 1 step.") in said
    assert "Memory: " in said  # what it does have is still said


def test_per_gpu_load_draws_what_the_run_has_and_says_what_it_has_not(reports_with_runs):
    at = _page(_app(), "load")  # the balanced run: 3 CPU workers
    assert _charts(at) == 3  # apply distributions, memory, chunk sizes; no GPU chart
    said = _texts(at.info)
    assert "CPU workers have no CUDA caching allocator" in said
    assert "This run used CPU workers: there are no GPUs to sample." in said
    apply = at.dataframe[0].value
    assert apply["device"].tolist() == ["cpu:0", "cpu:1", "cpu:2"] and apply["steps"].tolist() == [6, 6, 6]
    assert "apply mean (ms)" in apply.columns and "apply_mean_ms" not in apply.columns  # words and units
    memory = at.dataframe[1].value
    held = summary_of(reports_with_runs.balanced)["peak_held_bytes"]
    unit, scale = bytes_unit(float(held.max()))  # the unit the column reads best in (KiB for a model this small)
    assert memory[f"peak held ({unit})"].tolist() == (held * scale).round(2).tolist()
    at.segmented_control(key="apply_kind").set_value("violin").run()
    assert not at.exception and _charts(at) == 3
    at = _page(_page(at, "overview"), "load")  # the choice outlives a visit to another page
    assert at.segmented_control(key="apply_kind").value == "violin"


def test_per_gpu_load_draws_gpu_samples_where_they_were_recorded(reports, fake_gpus):
    import fake_pynvml

    fake_gpus([fake_pynvml.gpu(BUS[0]), fake_pynvml.gpu(BUS[1], util=30)])
    record_with_gpu_samples(reports)
    at = _page(_app(), "load")
    assert _charts(at) == 4  # and the GPUs over time
    assert "no GPUs to sample" not in _texts(at.info)
    assert set(at.dataframe[-1].value["device"]) == {"cuda:0", "cuda:1"}


def test_timeline_shows_the_chosen_range_of_steps(reports_with_runs):
    at = _page(_app(), "timeline")
    run = reports_with_runs.balanced
    shown = at.dataframe[0].value
    assert sorted(set(shown["step"])) == [1, 2, 3, 4, 5]  # the last five steps
    at.number_input[0].set_value(0)
    at.slider(key="tl_count").set_value(2).run()
    shown = at.dataframe[0].value
    assert len(shown) == len(run.phases[run.phases["step"] <= 1]) and _charts(at) == 1
    at.number_input[0].set_value(99).run()  # past the end: said, and clamped
    assert "This run's steps are 0–5" in _texts(at.warning)


def test_timeline_opens_each_run_on_its_own_last_steps(reports_with_runs):
    """The step chosen on one run's Timeline is that run's: another run opened after it shows its own last steps,
    not the steps from the step chosen before, and the first run shows its chosen step again when opened again."""
    at = _page(_app(), "timeline")
    plain, balanced = reports_with_runs.plain, reports_with_runs.balanced
    assert at.session_state[common.RUN_KEY] == balanced.id
    at.number_input[0].set_value(0).run()
    assert sorted(set(at.dataframe[0].value["step"])) == [0, 1, 2, 3, 4]
    at.selectbox(key=common.PICKER_KEY).select(plain.id).run()
    assert not at.exception and not at.warning
    assert sorted(set(at.dataframe[0].value["step"])) == [1, 2, 3, 4, 5]  # plain's last five, not from step 0
    # and back: the step chosen on balanced is kept (its widget was not drawn meanwhile), as after another page
    at.selectbox(key=common.PICKER_KEY).select(balanced.id).run()
    assert sorted(set(at.dataframe[0].value["step"])) == [0, 1, 2, 3, 4]
    at = _page(_page(at, "overview"), "timeline")
    assert sorted(set(at.dataframe[0].value["step"])) == [0, 1, 2, 3, 4] and at.number_input[0].value == 0


def test_timeline_keeps_the_steps_to_show_after_another_page(reports_with_runs):
    """'Steps to show' set to 2, then Overview and back: still 2 steps (Streamlit drops the state of a widget not
    drawn: the default five again)."""
    at = _page(_app(), "timeline")
    at.slider(key="tl_count").set_value(2).run()
    assert sorted(set(at.dataframe[0].value["step"])) == [1, 2]
    at = _page(_page(at, "overview"), "timeline")
    assert at.slider(key="tl_count").value == 2 and sorted(set(at.dataframe[0].value["step"])) == [1, 2]
    # "Every step the same width" (off for two steps) turned on is kept too (it read off again)
    assert at.toggle(key="tl_equal_False").value is False
    at.toggle(key="tl_equal_False").set_value(True).run()
    at = _page(_page(at, "overview"), "timeline")
    assert at.toggle(key="tl_equal_False").value is True
    # a run not opened on the Timeline yet opens on its own last steps, as many as are to be shown
    at.selectbox(key=common.PICKER_KEY).select(reports_with_runs.plain.id).run()
    assert sorted(set(at.dataframe[0].value["step"])) == [4, 5]


def test_compare_sets_runs_side_by_side_and_states_the_differences(reports_with_runs):
    at = _page(_app(), "compare")
    plain, balanced = reports_with_runs.plain, reports_with_runs.balanced
    at.multiselect[0].set_value([plain.id, balanced.id]).run()
    assert not at.exception and _charts(at) == 3
    said = _texts(at.markdown)
    a, b = run_label(plain.meta), run_label(balanced.meta)
    assert f"{b} is DataParallel, balanced (DataParallelModel + DataParallelCriterion) on 3 CPU workers" in said
    assert "Median step:" in said and "DataParallel tax" in said
    # the balanced run gathers nothing (no output device): memory is compared by the fullest device
    held = lambda r: summary_of(r)["peak_held_bytes"]  # noqa: E731
    assert (f"The fullest device holds {mib(held(balanced).max())} in {b} ({held(balanced).idxmax()}), "
            f"{mib(held(plain).max())} in {a} ({held(plain).idxmax()}, the output device)") in said
    summary = at.dataframe[0].value
    assert summary.loc["balanced", b] == "yes" and summary.loc["balanced", a] == "no"
    assert "fullest device peak (MiB)" in summary.index and summary.loc["memory", a].startswith("peak held") and "nan" not in summary.to_string()
    at.multiselect[0].set_value([plain.id]).run()
    assert "Choose two or more runs" in _texts(at.info) and _charts(at) == 0


def test_compare_from_the_runs_table_takes_the_older_run_as_baseline(reports_with_runs):
    at = _page(_app(), "runs")
    at.session_state["runs_table"] = {"selection": {"rows": [0, 1], "columns": [], "cells": []}}
    at.run()
    at.button(key="compare_runs").click().run()
    assert shown_text(at.title[0].value) == "Compare runs"
    assert at.multiselect[0].value == [reports_with_runs.plain.id, reports_with_runs.balanced.id]


def test_devices_shows_this_machine_and_the_preflight_check(reports_with_runs):
    at = _page(_app(), "devices")
    if torch.cuda.is_available():  # a GPU machine (bench/cuda_checks.sh runs this suite there too): its GPUs
        n = torch.cuda.device_count()
        assert torch.cuda.get_device_name(0) in at.dataframe[0].value.astype(str).to_string()
        assert f"No findings: {n} device(s) at batch size 30 look balanced." in _texts(at.success)
        assert _charts(at) == 1
        return
    assert "No CUDA GPU is visible here" in _texts(at.info)
    assert "No findings: 2 device(s) at batch size 30 look balanced." in _texts(at.success)
    at.number_input(key="dev_workers").set_value(4)
    at.number_input(key="dev_batch").set_value(5).run()
    assert "1 of 4 devices will idle at batch size 5" in _texts([*at.error, *at.warning])
    assert _charts(at) == 1


def test_export_offers_every_table_and_the_whole_run(reports_with_runs):
    at = _page(_app(), "export")
    labels = [b.label for b in at.download_button]
    assert labels[0] == "⬇ The whole run (zip of CSVs)"
    assert "⬇ Trace for Perfetto (.json.gz)" in labels
    assert any("The trace holds" in c and "ui.perfetto.dev" in c for c in map(shown_text, (c.value for c in at.caption)))
    assert {f"⬇ {t}.csv" for t in (*TABLES, "run", "device_summary", "phase_totals")} <= set(labels)


def test_the_empty_state_says_what_to_do_and_records_a_demo_run(reports, monkeypatch):
    monkeypatch.setitem(common.DEMO_ARGS, "steps", 3)
    monkeypatch.setitem(common.DEMO_ARGS, "workload", "tutorial-linear")
    at = _app()
    assert shown_text(at.title[0].value) == "Runs" and at.subheader[0].value == "No runs yet"
    assert "python -m dpprof profile cifar-lenet --steps 30 --devices cpu:2" in _texts(at.code)
    for page in ("overview", "load", "timeline", "export"):
        assert "No runs yet" in _texts(_page(at, page).info), page
    _page(at, "runs")
    at.button(key="demo").click().run()
    pid = at.session_state["watch"]
    assert pid != os.getpid()
    _wait_for_exit(pid)
    at.run()
    assert f"Process {pid} finished" in _texts(at.success)
    runs = dpprof.list_runs()
    assert runs["name"].tolist() == ["demo"] and runs["status"].tolist() == ["finished"]
    assert at.session_state[common.RUN_KEY] == runs.loc[0, "id"]  # the page follows the new run



def test_a_run_file_set_as_the_reports_directory_is_said_not_offered_a_demo_run(recorded, monkeypatch):
    """DPPROF_REPORTS naming a run's file: the Runs page says it is a file, not "No runs yet" with a demo button."""
    monkeypatch.setenv("DPPROF_REPORTS", str(recorded.plain.path))
    at = _app()
    assert shown_text(at.title[0].value) == "Runs" and not at.subheader
    assert f"the reports directory {recorded.plain.path} is an existing file, not a directory" in _texts(at.error)
    assert "demo" not in [b.key for b in at.button]

def test_the_demo_button_starts_one_run_however_often_it_is_pressed(reports, monkeypatch):
    monkeypatch.setitem(common.DEMO_ARGS, "steps", 100_000)
    monkeypatch.setitem(common.DEMO_ARGS, "workload", "tutorial-linear")
    first, second = _app(), _app()  # two tabs on the empty Runs page, the button enabled in both
    assert not second.button(key="demo").disabled
    first.button(key="demo").click().run()
    pid = first.session_state["watch"]
    os.kill(pid, signal.SIGSTOP)  # held before its run file appears, so both tabs stay on the empty page
    try:
        assert not first.exception and first.button(key="demo").disabled
        assert f"Process {pid} is running" in _texts(first.info)
        second.button(key="demo").click().run()  # sent before this tab drew the button disabled
        assert not second.exception and second.button(key="demo").disabled
        assert "started" not in second.session_state and common.running_processes() == [pid]
    finally:
        common.stop_run(pid)  # never leave it running, whatever failed above
        os.kill(pid, signal.SIGCONT)
    _wait_for_exit(pid, timeout=60)


def _wait_for_exit(pid: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while common.process_status(pid)[0] == "running":
        assert time.monotonic() < deadline, common.log_tail(pid)
        time.sleep(0.2)


def test_new_run_starts_a_background_process_whose_run_appears(reports):
    at = _page(_app(), "new_run")
    at.selectbox(key="nr_workload").select("tutorial-linear")
    at.number_input(key="nr_workers").set_value(3)
    at.number_input(key="nr_steps").set_value(4).run()  # Enter in a field: a rerun, never a start
    at.text_input(key="nr_name").input("from the page").run()
    assert not at.exception and "watch" not in at.session_state and not common.running_processes()
    at.button(key="nr_start").click().run()
    assert not at.exception
    pid = at.session_state["watch"]
    started = common.processes()[pid]
    cmd, run_id = started.cmd, started.run_id
    assert cmd[1:3] == ["-m", "dpprof"] and cmd[5:] == ["profile", "tutorial-linear", "--devices", "cpu:3",
                                                           "--steps", "4", "--name", "from the page",
                                                           "--run-id", run_id, "--quiet"]
    _wait_for_exit(pid)
    at.run()
    assert "finished" in _texts(at.success)
    assert dpprof.list_runs()["id"].tolist() == [run_id]  # the run id given before the start
    run = dpprof.load_run(dpprof.list_runs().loc[0, "id"])
    assert run.meta["name"] == "from the page" and run.meta["devices"] == ["cpu:0", "cpu:1", "cpu:2"]
    assert run.meta["pid"] == pid and len(run.steps) == 4
    assert at.dataframe[0].value["pid"].tolist() == [pid]
    _page(at, "overview")
    assert shown_text(at.title[0].value) == "from the page"


def _wait_for(condition, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.3)


def test_new_run_asks_before_a_second_start_shows_progress_and_stops_with_sigterm(reports):
    at = _page(_app(), "new_run")
    at.selectbox(key="nr_workload").select("tutorial-linear")
    at.number_input(key="nr_steps").set_value(100_000)
    at.checkbox(key="nr_balanced").check()
    at.button(key="nr_start").click().run()
    pid = at.session_state["watch"]
    assert common.processes()[pid].cmd[5:10] == ["profile", "tutorial-linear", "--devices", "cpu:2", "--balanced"]
    try:
        _wait_for(lambda: (r := common.run_of_process(pid)) is not None and r["steps"] >= 3, "3 steps on disk")
        at.run()
        assert not at.exception
        # a second start needs an explicit confirmation
        assert at.button(key="nr_start").disabled
        assert f"nr_confirm_{pid}" in [c.key for c in at.checkbox]
        assert re.search(r"step \d+ of 100,000 · [\d.]+ steps/s", _texts(at.markdown)), _texts(at.markdown)
        at.button(key=f"stop-{pid}").click().run()
        _wait_for(lambda: common.process_status(pid)[0] != "running", "the process to end", timeout=30)
    finally:
        common.stop_run(pid)  # never leave it running, whatever failed above
    assert common.process_status(pid)[0] == "exited" and common.processes()[pid].stopped
    row = common.run_of_process(pid)
    run = dpprof.load_run(row["path"])
    assert len(run.steps) >= 3 and run.meta["pid"] == pid  # the steps recorded before the stop are kept
    assert dpprof.list_runs().loc[0, "status"] == "interrupted"  # SIGTERM: flushed, marked, ended by the signal
    at.run()
    assert f"Process {pid} was stopped (SIGTERM" in _texts(at.warning)
    assert not at.button(key="nr_start").disabled


def test_a_running_run_says_so_and_its_pages_refresh(reports):
    with RunningRun(reports, name="live"):
        at = _app()
        assert shown_text(at.title[0].value) == "live"
        assert "Recording: this page re-reads the run every 2 s." in _texts(at.caption)
        steps = {m.label: m.value for m in at.metric}["Steps"]
        assert int(steps) >= 5
        for page in ("load", "timeline", "export"):
            assert "Recording" in _texts(_page(at, page).caption), page
        assert _page(at, "timeline").toggle(key="tl_follow").value  # following the newest steps
        runs_page = _page(at, "runs")
        assert runs_page.dataframe[0].value["status"].tolist() == ["running"]
        assert "A run is recording: this list refreshes every 2 s." in _texts(runs_page.caption)
        time.sleep(1.2)
        _page(at, "overview")
        assert int({m.label: m.value for m in at.metric}["Steps"]) > int(steps)  # re-read, not cached
    time.sleep(0.1)
    at.run()
    assert shown_text(at.title[0].value) == "live" and "Recording" not in _texts(at.caption)


def test_a_run_is_chosen_from_the_listing_never_from_what_the_browser_sends(reports_with_runs):
    at = AppTest.from_file(str(APP), default_timeout=60)
    at.query_params["run"] = str(reports_with_runs.plain.path)  # a path, not an id of the listing
    at.run()
    assert shown_text(at.title[0].value) == "balanced"  # ignored: the newest run
    at = AppTest.from_file(str(APP), default_timeout=60)
    at.query_params["run"] = reports_with_runs.plain.id  # an id of the listing: a bookmark
    at.run()
    assert shown_text(at.title[0].value) == "plain"
    at.session_state[common.RUN_KEY] = "/etc/passwd"
    at.run()
    assert shown_text(at.title[0].value) == "plain"  # back to the listed run the URL names
    assert at.session_state[common.RUN_KEY] == reports_with_runs.plain.id


def test_a_run_file_that_disappears_is_dropped_from_the_listing(reports, recorded):
    reports.mkdir(exist_ok=True)
    for run in (recorded.plain, recorded.balanced):
        shutil.copy(run.path, reports / run.path.name)
    at = _app()
    assert shown_text(at.title[0].value) == "balanced"
    (reports / recorded.balanced.path.name).unlink()
    at.run()
    assert not at.exception and shown_text(at.title[0].value) == "plain"
    assert at.sidebar.selectbox[0].options == [run_label(r, status=True) for _, r in dpprof.list_runs().iterrows()]


def test_devices_lists_gpus_and_checks_them_when_there_are_some(reports, fake_gpus):
    import fake_pynvml

    fake_gpus([fake_pynvml.gpu(BUS[0]), fake_pynvml.gpu(BUS[1], name="NVIDIA A100 80GB", total=80 * 2**30)])
    at = _page(_app(), "devices")
    inventory = at.dataframe[0].value
    assert inventory["device"].tolist() == ["cuda:0", "cuda:1"]
    assert inventory["name"].tolist() == ["NVIDIA A100-SXM4-40GB", "NVIDIA A100 80GB"]
    assert "NVML is available" in _texts(at.caption)
    assert at.multiselect[0].value == [0, 1]
    assert "cuda:0 has 50% of the total memory of cuda:1" in _texts(at.error)  # torch's 75% rule


@pytest.fixture(scope="module")
def ddp_reports(tmp_path_factory, profiled):
    """A two-rank DistributedDataParallel run (gloo on loopback), recorded by `dpprof profile --ddp` called in this
    process (it starts torchrun's ranks, as from a shell), once a session: the pages need the run, not another
    interpreter starting."""
    directory = tmp_path_factory.mktemp("ddp-reports")
    profiled(directory, "tutorial-linear", "--ddp", "--nproc", "2", "--steps", "4")
    return directory


@pytest.mark.slow
@pytest.mark.parametrize("page", ["overview", "load", "timeline", "export"])
def test_a_multi_rank_run_shows_ranks_where_devices_are_shown(ddp_reports, monkeypatch, page):
    monkeypatch.setenv("DPPROF_REPORTS", str(ddp_reports))
    at = _page(_app(), page)
    shown = "\n".join(shown_text(str(e.value)) for kind in ("markdown", "caption", "dataframe", "table")
                      for e in at.get(kind))
    assert "rank:0" in shown and "rank:1" in shown, page


def test_a_failed_run_is_not_opened_first_shows_its_error_as_code_and_gives_no_findings(reports, capsys):
    from recorded import record_failed

    finished = record(reports, "finished", workers=2, steps=4, batch_size=16, workload="tutorial-linear")
    failed = record_failed(reports)  # the newest run, failed in its second step
    assert failed.meta["status"] == "failed" and len(failed.steps) == 2  # the failing step is recorded too
    at = _app()
    assert shown_text(at.title[0].value) == "finished"  # the newest run that finished
    at.sidebar.selectbox[0].select(failed.id).run()
    assert shown_text(at.title[0].value) == "failed"
    assert "The run failed:" in _texts(at.warning)
    error = _texts(at.code)
    assert "shape mismatch in the second step" in error and "\n" in error  # its lines kept
    assert not at.error and "No findings from 2 steps: they need at least 3" in _texts(at.info)
    # dpprof show says the same (views.text.status_sentence): the sentence, then the error's every line, indented
    from dpprof.cli import main

    capsys.readouterr()
    assert main(["--reports-dir", str(reports), "show", failed.id]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith("status failed") and lines[1] == "The run failed:"
    assert "\n".join(line[2:] for line in lines[2:2 + error.count("\n") + 1]) == error.rstrip("\n")
    # Compare opens on the open (failed) run and the newest finished run of its workload, or says what it needs
    compare = _page(at, "compare")
    assert compare.multiselect[0].value == [] and "needs a second finished run" in _texts(compare.info)
    at.sidebar.selectbox[0].select(finished.id).run()
    second = record(reports, "second", workers=2, steps=4, batch_size=16, workload="tutorial-linear")
    at = _page(_app(), "compare")  # a new session: the newest finished run is open
    assert at.multiselect[0].value == [finished.id, second.id]  # the older first, as the baseline
    assert _charts(at) == 3


# A run named with markdown: bold, a javascript: link, an image on an unroutable address (TEST-NET-2), raw HTML,
# Streamlit's colour directive and LaTeX. Every page shows the characters; none becomes an element.
HOSTILE_NAME = ("**x** [y](javascript:alert(1)) beacon ![t](http://198.51.100.7/p.png?who=viewer) "
                "<img src=http://198.51.100.7/i.png> :red[z] $a$ www.example.com")
_MARKUP = {"link_open", "image", "html_inline", "html_block", "em_open"}


def _markup_in(at: AppTest) -> list[tuple[str, str]]:
    """Elements whose markdown (as CommonMark parses it) holds a link, an image, HTML, emphasis, or bold around
    part of the name: (element kind, its markdown)."""
    from markdown_it import MarkdownIt

    md = MarkdownIt("commonmark")
    sources = [(kind, e.value) for kind in ("title", "header", "subheader", "markdown", "caption", "info", "warning",
                                            "error", "success") for e in at.get(kind)]
    sources += [("metric", m.label) for m in at.metric] + [("expander", e.label) for e in at.expander]
    found = []
    for kind, source in sources:
        tokens = [t for block in md.parse(str(source)) for t in (block.children or [])]
        bold = [b.content for a, b in itertools.pairwise(tokens) if a.type == "strong_open"]
        if _MARKUP & {t.type for t in tokens} or any(part in ("x", "z") for part in bold):
            found.append((kind, source))
    return found


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    directory = tmp_path_factory.mktemp("hostile-reports")
    first = record(directory, HOSTILE_NAME, workers=2, steps=4, batch_size=16, workload="tutorial-linear")
    second = record(directory, HOSTILE_NAME + " again", workers=3, steps=4, batch_size=16, workload="tutorial-linear")
    return SimpleNamespace(dir=directory, first=first, second=second)


@pytest.mark.parametrize("page", PAGES)
def test_a_run_named_with_markdown_shows_its_name_as_text_on_every_page(hostile, monkeypatch, page):
    monkeypatch.setenv("DPPROF_REPORTS", str(hostile.dir))
    at = _app()
    at.session_state[common.COMPARE_KEY] = [hostile.first.id, hostile.second.id]
    at = _page(at, page)
    assert not _markup_in(at), _markup_in(at)
    if page in ("overview", "load", "timeline", "advise", "export"):  # a run's page: its name is the title
        assert shown_text(at.title[0].value) == HOSTILE_NAME + " again"
    picker = at.sidebar.selectbox[0]  # options are plain text: the label as it is
    assert run_label(hostile.first.meta, status=True) in picker.options
    if page == "compare":
        shown = _texts(at.caption) + _texts(at.markdown)
        assert f"Against the baseline, {run_label(hostile.first.meta)}." in shown

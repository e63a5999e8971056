"""Deep capture (dpprof.capture): a window of a recorded run's steps profiled with torch.profiler, given at the start
(``dpprof.record(capture="A:B")``, ``dpprof profile --capture``, ``dpprof run --capture``) or asked of a running run
(``dpprof capture RUN --steps N``). Every run here is recorded by the CPU backend on real worker threads."""
from __future__ import annotations

import gzip
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

import forked
import pytest
import torch
from cpu_traces import _free_port

import dpprof
from dpprof.capture import CaptureError, parse_capture
from dpprof.capture.request import CaptureAnswer, ask, wait_for_answer
from dpprof.capture.session import NO_CAPTURE, TRAINING_THREAD_DEVICE
from dpprof.cli import main
from dpprof.launch import Profile, ProfileError
from dpprof.parallel.workers import worker_native_ids
from dpprof.store.detail_rows import Capture, captures, memory_peaks
from dpprof.store.files import CAPTURE_TRACE, capture_request_name
from dpprof.store.reader import RunFileError, list_runs
from dpprof.trace import import_traces, pending_traces, trace_files
from dpprof.workloads import build_workload, train
from recorded import RunningRun

ROOT = Path(__file__).resolve().parents[1]
STEP_NAME = re.compile(r"^ProfilerStep#(\d+)$")
ANSWER_TIMEOUT_S = 240  # a loaded 2-core machine: the capture waits for a step boundary, then stores its trace


def _events(trace: Path) -> list[dict]:
    with gzip.open(trace, "rt") as f:
        return [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]


def _steps_in(events: list[dict]) -> dict[int, tuple[float, float]]:
    """The trace's ProfilerStep#N ranges: step -> (start us, end us)."""
    out = {}
    for e in events:
        m = STEP_NAME.match(e["name"])
        if m:
            out[int(m.group(1))] = (e["ts"], e["ts"] + e["dur"])
    return out


def _captures(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if CAPTURE_TRACE.match(p.name))


@pytest.fixture(scope="module")
def captured(tmp_path_factory):
    """cifar-lenet on 2 CPU workers, 6 steps, steps 2 and 3 captured: (the Run, its raw trace)."""
    directory = tmp_path_factory.mktemp("captured")
    run = train(build_workload("cifar-lenet", 32), dpprof.cpu_devices(2), 6, name="captured",
                reports_dir=str(directory), capture="2:4")
    traces = _captures(directory)
    assert [t.name for t in traces] == [f"{run.id}.capture-2-4.pt.trace.json.gz"]
    return run, traces[0]


def test_the_window_is_the_steps_asked_and_nothing_else(captured):
    run, trace = captured
    events = _events(trace)
    steps = _steps_in(events)
    assert sorted(steps) == [2, 3]
    # every operator the profiler saw, on every thread, lies inside the window's step ranges
    start, end = min(s for s, _ in steps.values()), max(e for _, e in steps.values())
    ops = [e for e in events if e.get("cat") == "cpu_op"]
    assert ops and all(start <= e["ts"] and e["ts"] + e["dur"] <= end for e in ops)
    # the profiler is off after the window: the steps after it cost what they cost without a capture
    assert not torch.autograd.profiler._is_profiler_enabled
    assert run.capture_edge == NO_CAPTURE
    [done] = run.capture.captured
    assert (done.first_step, done.end_step, done.error) == (2, 4, None)
    notes = dpprof.load_run(run.path).table("notes")
    assert any("captured steps 2 to 3" in m for m in notes["message"])


def test_each_worker_threads_ops_are_in_the_trace_under_its_own_thread(captured):
    """torch.profiler sees the CPU workers' threads (started before it): each worker's replica ran aten ops."""
    run, trace = captured
    by_tid = defaultdict(set)
    for e in _events(trace):
        if e.get("cat") == "cpu_op":
            by_tid[e["tid"]].add(e["name"])
    workers = {f"cpu:{index}": tid for tid, index in worker_native_ids().items()}
    for device in ("cpu:0", "cpu:1"):
        names = by_tid[workers[device]]
        assert "aten::conv2d" in names and "aten::linear" in names, (device, sorted(names)[:20])


def test_the_run_stores_each_workers_operators_under_its_device(captured):
    """The window's operators are in the run per device: each worker's from its own thread, counted as the raw
    trace counts them; the training thread's (scatter, gather, loss, backward, optimizer) under its own label."""
    run, trace = captured
    ops = dpprof.load_run(run.path).operators()
    assert {"cpu:0", "cpu:1", TRAINING_THREAD_DEVICE} <= set(ops["device"])
    device_of_tid = {tid: f"cpu:{index}" for tid, index in worker_native_ids().items()}
    calls: dict[tuple[str, str], int] = defaultdict(int)
    host_ms: dict[tuple[str, str], float] = defaultdict(float)
    for e in _events(trace):
        if e.get("cat") == "cpu_op":
            key = (device_of_tid.get(e["tid"], TRAINING_THREAD_DEVICE), e["name"])
            calls[key] += 1
            host_ms[key] += e["dur"] / 1e3
    for device in ("cpu:0", "cpu:1"):
        mine = ops[ops["device"] == device].set_index("name")
        assert mine.index.str.startswith("aten::").all() and "aten::conv2d" in mine.index
        for name in ("aten::conv2d", "aten::linear", "aten::relu"):
            assert mine.loc[name, "calls"] == calls[(device, name)] > 0
            assert mine.loc[name, "host_total_ms"] == pytest.approx(host_ms[(device, name)], rel=1e-9)
    # backward runs on the training thread (CPU autograd): none of it is counted as a worker's
    workers_ops = set(ops[ops["device"].isin(["cpu:0", "cpu:1"])]["name"])
    assert not any("Backward" in name for name in workers_ops)
    assert any("Backward" in name for name in ops[ops["device"] == TRAINING_THREAD_DEVICE]["name"])


def test_the_raw_trace_imports_and_is_never_taken_for_a_run(captured, tmp_path):
    run, trace = captured
    directory = trace.parent
    # the listing shows the run, not its trace; a directory import and the dashboard's pending traces leave it out
    assert list(list_runs(directory)["id"]) == [run.id]
    assert pending_traces(directory).empty
    with pytest.raises(Exception, match="no .json or .json.gz trace files"):
        trace_files([directory])
    # named alone, it is a trace like any other: its two steps import as a run of their own
    imported = import_traces([trace], tmp_path / "imported")
    assert imported.steps == 2
    assert main(["--reports-dir", str(tmp_path / "cli"), "import", "--quiet", str(trace)]) == 0


def test_a_window_past_the_end_stops_at_the_last_step_or_never_starts(tmp_path, capsys):
    """A window the run ended before says that nothing was captured and which window would be, there and in ops
    (it said 'the run ended after 5 steps, before the window began', and ops to ask for a --capture A:B)."""
    net = dpprof.DataParallel(torch.nn.Linear(8, 2), device_ids=dpprof.cpu_devices(2))
    for window, held in (("3:10", "3-5"), ("7:9", None)):
        directory = tmp_path / window.replace(":", "-")
        with dpprof.record(reports_dir=str(directory), capture=window) as run:
            for _ in range(5):
                with run.step():
                    net(torch.randn(8, 8)).sum().backward()
        names = [p.name for p in _captures(directory)]
        notes = " ".join(dpprof.load_run(run.path).table("notes")["message"])
        if held:
            assert names == [f"{run.id}.capture-{held}.pt.trace.json.gz"]
            assert sorted(_steps_in(_events(directory / names[0]))) == [3, 4]
            assert "captured steps 3 to 4 with torch.profiler (of the window 3:10: the run ended after 5 steps)" in notes
        else:
            said = ("capture 7:9: the run ended after 5 steps, before the window began, so nothing was captured: give "
                    "a window that ends by step 5, such as 3:5 (its last 2 steps)")
            assert names == [] and said in notes
            capsys.readouterr()
            assert main(["--reports-dir", str(directory), "ops", run.id]) == 1
            assert f"no operator data: {said}" in capsys.readouterr().err
        assert not torch.autograd.profiler._is_profiler_enabled


def test_a_run_that_fails_as_its_window_begins_raises_its_own_error_and_stops_the_profiler(tmp_path, monkeypatch):
    """An error after the profiler started and before the window's first step did (here in marking that step) is the
    one the user sees, not the capture's; the profiler is stopped and the run file says the run failed."""
    from dpprof.capture.session import CaptureSession

    def fail(self, index):
        raise RuntimeError("failed while the window began")

    monkeypatch.setattr(CaptureSession, "_mark", fail)
    net = dpprof.DataParallel(torch.nn.Linear(8, 2), device_ids=dpprof.cpu_devices(2))
    with pytest.raises(RuntimeError, match="failed while the window began"):
        with dpprof.record(reports_dir=str(tmp_path), capture="0:2") as run:
            with run.step():
                net(torch.randn(8, 8)).sum().backward()
    assert not torch.autograd.profiler._is_profiler_enabled
    meta = dpprof.load_run(run.path).meta
    assert meta["status"] == "failed" and "failed while the window began" in meta["error"]


def test_dpprof_run_captures_the_implicit_steps_of_an_unchanged_script(tmp_path):
    """A script's steps end at optimizer.step() (2 batches each here): the window is steps 1 and 2."""
    done = forked.run([sys.executable, "-m", "dpprof", "--reports-dir", str(tmp_path), "run", "--cpu-workers", "2",
                       "--capture", "1:3", str(ROOT / "tests" / "scripts" / "train_accum.py"), "--batches", "8"],
                      capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    [trace] = _captures(tmp_path)
    events = _events(trace)
    assert sorted(_steps_in(events)) == [1, 2]
    assert sum(e["name"] == "aten::linear" for e in events) >= 2 * 2 * 2  # 2 steps x 2 batches x 2 workers


def test_each_ranks_capture_stores_its_memory_over_time_memory_events_and_modules_as_its_raw_trace_has_them(
        tmp_path, capsys):
    """A DDP rank trains on the thread that starts the profiler: its capture has torch's [memory] events and Python's
    calls with module ids (a DataParallel run's, profiling every thread, has neither). Two gloo ranks of
    ``dpprof.ddp_worker`` (as torchrun starts them: RANK, WORLD_SIZE, MASTER_*), steps 1 and 2 captured; each rank's
    stored memory curve, memory events and modules are those of its raw trace."""
    for out in forked.run_ranks(2, ["-m", "dpprof.ddp_worker", "tutorial-linear", "--steps", "4", "--capture", "1:3",
                                    "--reports-dir", str(tmp_path), "--run-id", "ranks"],
                                env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}):
        assert out.returncode == 0, out.stderr[-3000:]
    run = dpprof.load_run("ranks", tmp_path)
    timeline, events, modules = run.memory_timeline(), run.memory_events(), run.modules()
    for r in (0, 1):
        [trace] = tmp_path.glob(f"ranks.rank{r}.capture-1-3.pt.trace.json.gz")
        with gzip.open(trace, "rt") as f:
            raw = json.load(f)["traceEvents"]
        memory = [e["args"] for e in raw if e.get("name") == "[memory]"]
        assert memory  # allocations and frees, each with the running totals
        ours = timeline[timeline["rank"] == r]
        assert int(ours["allocated_bytes"].max()) == max(m["Total Allocated"] for m in memory)
        assert len(events[events["rank"] == r]) == sum(m["Bytes"] > 0 for m in memory)  # one row per allocation
        named = {e["name"].removeprefix("nn.Module: ") for e in raw
                 if e.get("cat") == "python_function" and "Python module id" in e.get("args", {})}
        assert set(modules[modules["rank"] == r]["module"]) == named
        assert {"DistributedDataParallel_0", "Linear_0"} <= named
    # the capture's times are the run's clock, as its steps' are ("ms into the run" on the Memory page and in the
    # findings, the Timeline's lanes beside the phases): the peak falls in its step, every reading in the window
    steps, peaks = run.steps, memory_peaks(run)
    for r in (0, 1):
        mine = steps[steps["rank"] == r].set_index("step")
        peak = peaks[peaks["rank"] == r].iloc[0]
        window_ms = (mine.loc[1, "start_ms"] - 5.0, mine.loc[2, "start_ms"] + mine.loc[2, "duration_ms"] + 5.0)
        assert window_ms[0] <= peak["peak_t_ms"] <= window_ms[1], (r, peak["peak_t_ms"], window_ms)
        for t_ms in (timeline[timeline["rank"] == r]["t_ms"], events[events["rank"] == r]["alloc_t_ms"]):
            assert window_ms[0] <= t_ms.min() and t_ms.max() <= window_ms[1], (r, t_ms.min(), t_ms.max(), window_ms)
    # every thread of a rank on CPU is its rank's device, rank:N, as its phases are (not the cpu:0 or host of a
    # DataParallel process's threads)
    for table in ("operators", "memory_timeline", "modules"):
        stored = run.query(f"SELECT DISTINCT device FROM {table}")  # the query adds each file's rank
        assert sorted(zip(stored["rank"], stored["device"])) == [(0, "rank:0"), (1, "rank:1")], table
    capsys.readouterr()
    assert main(["--reports-dir", str(tmp_path), "ops", "ranks", "--device", "rank:1", "--json"]) == 0
    assert {o["rank"] for o in json.loads(capsys.readouterr().out)["operators"]} == {1}
    assert main(["--reports-dir", str(tmp_path), "ops", "ranks", "--rank", "1", "--vs", "rank:0"]) == 0
    sentence = capsys.readouterr().out.splitlines()[0]
    assert sentence.startswith("rank 1 is ") and " than rank 0 in " in sentence and "over 2 steps" in sentence, sentence


def test_a_dataparallel_capture_profiles_every_thread_and_has_no_memory_events(captured):
    """torch 2.13's all-threads profiling reports no [memory] events: the run says so instead of a curve."""
    run, trace = captured
    with gzip.open(trace, "rt") as f:
        raw = json.load(f)["traceEvents"]
    assert not [e for e in raw if e.get("name") == "[memory]"]
    stored = dpprof.load_run(run.path)
    assert stored.memory_timeline().empty and stored.memory_events().empty


BAD_WINDOWS = [
    ("4:2", "steps A:B need 0 <= A < B"),
    ("3:3", "steps A:B need 0 <= A < B"),
    ("x", "expected A:B, steps A to B-1 such as 10:15"),
    ("-1:3", "steps A:B need 0 <= A < B"),  # a negative step named as one, not as a malformed window
    ("2", "expected A:B, steps A to B-1 such as 10:15"),
    ("\uff11:\uff12", "expected A:B, steps A to B-1 such as 10:15"),  # full-width digits: \\d took them for 1:2
    ("0:1001", "1,001 steps, at most 1,000 in one window (a longer trace opens in no viewer)"),
]


@pytest.mark.parametrize("text,said", BAD_WINDOWS)
def test_a_bad_window_is_one_line_and_records_nothing(text, said, reports, capsys):
    with pytest.raises(CaptureError, match=re.escape(said)) as err:
        dpprof.record(capture=text).__enter__()
    assert "\n" not in str(err.value)
    with pytest.raises(ProfileError, match=re.escape(f"--capture {text}: {said}")):
        Profile(steps=2000, capture=text)
    with pytest.raises(SystemExit) as exit_:
        main(["profile", "--steps", "2000", "--quiet", f"--capture={text}"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"dpprof profile: error: --capture {text}: {said}"
    assert not reports.exists() or not any(reports.iterdir())  # no run file, no trace


def test_a_window_beyond_the_profiles_steps_and_a_range_object_are_refused():
    with pytest.raises(ProfileError, match=r"--capture 2:9: the profile runs 6 steps \(0 to 5\); the window must end by 6"):
        Profile(steps=6, capture="2:9")
    with pytest.raises(CaptureError, match=r'give the window as text "A:B"'):
        parse_capture(range(2, 4))  # type: ignore[arg-type]


def test_the_profile_says_its_window_in_its_command_and_reads_it_back():
    from dpprof.cli import build_parser

    profile = Profile(workload="tutorial-linear", steps=6, capture="2:4")
    assert profile.argv()[-2:] == ["--capture", "2:4"]
    assert Profile.from_args(build_parser().parse_args(profile.argv())) == profile
    assert "--capture 2:4" in profile.command()


def test_a_running_run_captures_on_request_at_a_step_boundary(reports, capsys):
    with RunningRun(reports) as live:
        run = dpprof.load_run(live.path)
        code = main(["capture", run.id, "--steps", "3", "--timeout", str(ANSWER_TIMEOUT_S), "--quiet"])
        out = capsys.readouterr()
        assert code == 0, out.err
        m = re.search(r"captured steps (\d+) to (\d+) of run", out.out)
        assert m, out.out
        first, last = int(m.group(1)), int(m.group(2))
        assert last - first == 2 and first >= 5  # the next steps after the request, not steps already recorded
        [trace] = _captures(reports)
        assert trace.name == f"{run.id}.capture-{first}-{last + 1}.pt.trace.json.gz" and trace.name in out.out
        assert sorted(_steps_in(_events(trace))) == [first, first + 1, first + 2]
        assert not (reports / capture_request_name(run.id)).exists()  # the request is gone once answered
        # a second request while the run goes on: captured too, later steps
        answer = wait_for_answer(ask(dpprof.load_run(live.path), 1), ANSWER_TIMEOUT_S)
        assert answer.error is None and answer.first_step > last and answer.end_step == answer.first_step + 1
    # the run keeps both captures' tables, each the operators of its own raw trace; the latest is read by default
    stored = dpprof.load_run(live.path)
    second = reports / answer.trace
    assert captures(stored) == [Capture(first, last + 1, (trace.name,)),
                                Capture(answer.first_step, answer.end_step, (second.name,))]
    for window, raw in ((first, trace), (answer.first_step, second), (None, second)):
        stored.capture = window
        ops = [e for e in _events(raw) if e.get("cat") == "cpu_op" and not STEP_NAME.match(e["name"])]
        assert stored.operators()["calls"].sum() == len(ops), window
    assert main(["ops", run.id, "--capture", str(first)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"capture of steps {first} to {last}; the run's other capture starts at step "
                          f"{answer.first_step} (--capture A)"), out
    assert main(["ops", run.id, "--capture", "999999"]) == 1
    assert capsys.readouterr().err.strip() == (f"dpprof: run {run.id} has no capture starting at step 999999: its "
                                               f"captures start at steps {first}, {answer.first_step}")
    # ended now: a request is one line, and nothing is written
    code = main(["capture", run.id, "--steps", "2"])
    err = capsys.readouterr().err.strip()
    assert code == 1 and err == (f"dpprof: run {run.id} is finished, not running: only a run being recorded can "
                                 "capture (use --capture A:B when starting one)")
    assert not (reports / capture_request_name(run.id)).exists()


def test_a_second_request_while_one_is_pending_is_refused_and_the_first_is_answered(reports, capsys):
    """Two askers at once: the second is told in one line that a request is pending (it used to replace the first,
    whose asker then waited out its timeout); a request whose asker is gone is withdrawn by the next one."""
    with RunningRun(reports) as live:
        run = dpprof.load_run(live.path)
        first = ask(run, 2)
        with pytest.raises(CaptureError, match=rf"run {run.id} has a capture request pending already \(asked by "
                                               rf"process {os.getpid()} on "):
            ask(run, 2)
        assert main(["capture", run.id, "--steps", "2", "--quiet"]) == 1
        assert "has a capture request pending already" in capsys.readouterr().err
        answer = wait_for_answer(first, ANSWER_TIMEOUT_S)
        assert answer.error is None and answer.end_step == answer.first_step + 2
        assert not (reports / capture_request_name(run.id)).exists()
        # an asker that died with its request on disk: the next ask withdraws it
        gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
        request = reports / capture_request_name(run.id)
        request.write_text(json.dumps({"request": "0" * 32, "steps": 1, "first_step": None, "pid": int(gone.stdout),
                                       "host": socket.gethostname(), "asked_at": "2026-01-01T00:00:00+00:00"}))
        again = wait_for_answer(ask(run, 1), ANSWER_TIMEOUT_S)
        assert again.error is None and again.first_step >= answer.end_step


def test_a_request_while_the_runs_own_window_waits_ahead_says_so(reports):
    """A run started with --capture 100000:100002: a request before then is answered with that window, not 'a
    capture is under way' (nothing is recording)."""
    with RunningRun(reports, capture="100000:100002") as live:
        answer = wait_for_answer(ask(dpprof.load_run(live.path), 2), ANSWER_TIMEOUT_S)
    assert answer.error == ("this run captures steps 100000 to 100001 (its --capture 100000:100002), which begin "
                            "later: one capture at a time; ask again once it is stored")


def test_a_capture_the_run_ends_inside_says_how_many_of_the_steps_asked_it_holds(reports, capsys):
    said: list[int] = []
    with RunningRun(reports) as live:
        asker = threading.Thread(target=lambda: said.append(main(["capture", live.run.id, "--steps", "1000",
                                                                   "--quiet"])))
        asker.start()
        deadline = time.monotonic() + 120
        while live.run.capture._profiler is None:  # the window began: the run now stops inside it
            assert time.monotonic() < deadline, "the capture never began"
            time.sleep(0.05)
        time.sleep(0.3)
    asker.join(120)
    out = capsys.readouterr().out
    m = re.search(r"captured steps (\d+) to (\d+) of run \S+ \((\d+) of the 1,000 steps asked: the run stopped "
                  r"stepping\): ", out)
    assert said == [0] and m, out
    assert int(m.group(3)) == int(m.group(2)) - int(m.group(1)) + 1 < 1000


def test_a_capture_whose_trace_name_is_taken_says_so_in_plain_words_and_fails_the_command(reports, caplog):
    """The run file of an earlier run of the same id removed, its capture's raw trace left: the new run's capture is
    not stored (never over another's file), said without an exception's repr; the run is kept, and the command,
    which did not do what it was asked, exits 1."""
    argv = ["--reports-dir", str(reports), "profile", "tutorial-linear", "--devices", "cpu:2", "--steps", "4",
            "--capture", "1:3", "--run-id", "same", "--quiet"]
    assert main(argv) == 0
    (reports / "same.sqlite").unlink()
    with caplog.at_level("WARNING", logger="dpprof"):
        assert main(argv) == 1
    said = [r.getMessage() for r in caplog.records if "not stored" in r.getMessage()]
    assert said == ["dpprof: capture of steps 1 to 2 not stored: same.capture-1-3.pt.trace.json.gz is there "
                    "already (never replaced)"]
    assert len(dpprof.load_run("same", reports).steps) == 4  # the run itself is kept whole


@pytest.mark.slow
def test_a_ddp_capture_not_stored_on_its_ranks_is_said_per_rank_and_fails_the_command(reports, capsys):
    """The same on 2 gloo ranks: each rank's capture is not stored, the ranks' own warnings are not shown by the
    launcher, so dpprof profile says each rank's line from the run's notes and exits 1."""
    argv = ["--reports-dir", str(reports), "profile", "tutorial-linear", "--ddp", "--nproc", "2", "--steps", "4",
            "--capture", "1:3", "--run-id", "same", "--quiet"]
    assert main(argv) == 0
    for rank in (0, 1):
        (reports / f"same.rank{rank}.sqlite").unlink()
    capsys.readouterr()
    assert main(argv) == 1
    err = capsys.readouterr().err.splitlines()
    assert [line for line in err if "not stored" in line] == [
        f"dpprof: rank {rank}: capture of steps 1 to 2 not stored: same.rank{rank}.capture-1-3.pt.trace.json.gz is "
        "there already (never replaced)" for rank in (0, 1)]
    assert len(dpprof.load_run("same", reports).steps) == 8  # both ranks' 4 steps kept


@pytest.mark.parametrize("timeout", ["-5", "0", "nan", "inf", "soon"])
def test_a_capture_timeout_that_is_no_time_is_a_usage_error(timeout, capsys):
    with pytest.raises(SystemExit) as done:
        main(["capture", "any", "--timeout", timeout])
    assert done.value.code == 2 and f"{timeout!r} is not a number of seconds over 0" in capsys.readouterr().err


def test_a_distributed_run_captures_the_same_steps_on_every_rank_on_request(tmp_path):
    """Two gloo ranks of dpprof.ddp_worker recording (rank 0 delayed 50 ms a step): a request names a step ahead of
    every rank's, each rank profiles the same window from it and answers, and the asker gets both traces."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": "2",
           "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    ranks = [forked.Popen([sys.executable, "-m", "dpprof.ddp_worker", "tutorial-linear", "--steps", "100000",
                           "--delay-rank", "0:50", "--reports-dir", str(tmp_path), "--run-id", "live"],
                          env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=forked.DEVNULL,
                          stderr=forked.PIPE, text=True) for r in (0, 1)]
    try:
        deadline = time.monotonic() + ANSWER_TIMEOUT_S
        while True:  # both ranks' files on disk, with a few steps each
            try:
                run = dpprof.load_run("live", tmp_path)
                if len(run.paths) == 2 and run.steps.groupby("rank")["step"].max().min() >= 3:
                    break
            except RunFileError:
                pass
            assert time.monotonic() < deadline and all(r.poll() is None for r in ranks), "the ranks never stepped"
            time.sleep(0.2)
        asked = ask(run, 2)
        assert asked.ranks == (0, 1) and asked.first_step > int(run.steps["step"].max()) + 1
        try:
            answer = wait_for_answer(asked, ANSWER_TIMEOUT_S)
        except CaptureError as err:
            answer = CaptureAnswer(request="", error=str(err))
    finally:
        for rank in ranks:
            rank.kill()
        said = [rank.communicate(timeout=60)[1] for rank in ranks]
    if answer.error is not None:  # the ranks' own words on why they ended, and their runs' errors and notes
        ended = dpprof.load_run("live", tmp_path)
        raise AssertionError(f"{answer.error}; ranks said {said}; the run's error: {ended.meta.get('error')}; "
                             f"notes: {ended.notes.to_dict('records')}")
    first = asked.first_step
    assert answer.error is None and (answer.first_step, answer.end_step) == (first, first + 2)
    assert answer.traces == tuple(f"live.rank{r}.capture-{first}-{first + 2}.pt.trace.json.gz" for r in (0, 1))
    for name in answer.traces:
        assert sorted(_steps_in(_events(tmp_path / name))) == [first, first + 1]
    assert not list(tmp_path.glob(".live*capture-*.json"))  # the request and both answers are gone once read


PROFILER_TURN_S = 0.5  # the profiler's start and stop made this slow: far over a step of the model below


@pytest.mark.parametrize("wrap", ["ddp", "fsdp2"])
def test_a_rank_steps_clock_holds_neither_the_profilers_start_nor_its_stop(wrap, tmp_path, monkeypatch):
    """A DDP or FSDP step's data part runs from the step before's end to its forward, and the profiler starts and
    stops as a step is made, at its forward: steps 2 and 4 held the start and the stop (the stop, 56 ms on the
    training thread, was 60 ms of the data part of a 2-rank run's evaluation step of 4 ms). They begin after them now."""
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    from dpprof.capture.session import CaptureSession
    from dpprof.instrument import instrument

    def slowed(original):
        def turn(self, *args):
            original(self, *args)
            time.sleep(PROFILER_TURN_S)

        return turn

    for name in ("_start", "_stop"):
        monkeypatch.setattr(CaptureSession, name, slowed(getattr(CaptureSession, name)))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with instrument(reports_dir=str(tmp_path), capture="2:4") as run:
            net = nn.Linear(4, 2)
            model = nn.parallel.DistributedDataParallel(net) if wrap == "ddp" else fully_shard(net)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for _ in range(6):
                model(torch.randn(8, 4)).sum().backward()
                opt.step()
                opt.zero_grad()
    finally:
        dist.destroy_process_group()
    frames = run.frames()
    steps = frames["steps"].set_index("step")
    assert steps.index.tolist() == list(range(6)) and [c.first_step for c in run.capture.captured] == [2]
    assert (steps["duration_ms"] < 1e3 * PROFILER_TURN_S).all(), steps
    gaps = steps["start_ms"].iloc[1:].to_numpy() - (steps["start_ms"] + steps["duration_ms"]).iloc[:-1].to_numpy()
    assert (gaps[[1, 3]] >= 1e3 * PROFILER_TURN_S).all(), gaps  # before steps 2 and 4: the start and the stop


def test_an_imported_run_or_an_unknown_one_is_refused_in_one_line(captured, tmp_path, capsys):
    _, trace = captured
    imported = import_traces([trace], tmp_path / "imported")
    assert main(["--reports-dir", str(tmp_path / "imported"), "capture", imported.id]) == 1
    err = capsys.readouterr().err.strip()
    assert err == (f"dpprof: run {imported.id} was imported from a trace, not recorded by dpprof: there is no "
                   "recording to capture from")
    assert main(["--reports-dir", str(tmp_path / "imported"), "capture", "no-such-run"]) == 1
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_the_training_thread_has_a_device_of_its_own():
    """Scatter, gather, the loss and CPU autograd's backward run on the training thread: not cpu:0's work."""
    assert TRAINING_THREAD_DEVICE not in {f"cpu:{i}" for i in range(64)}


def test_the_running_run_page_asks_for_a_capture_and_says_when_it_is_stored(reports):
    from streamlit.testing.v1 import AppTest

    with RunningRun(reports) as live:
        run_id = dpprof.load_run(live.path).id
        at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=60)
        at.run()
        at.number_input(key=f"capture-{run_id}-steps").set_value(2)
        at.button(key=f"capture-{run_id}-ask").click().run()
        assert not at.exception, [e.message for e in at.exception]
        assert any("Asked for 2 steps" in c.value for c in at.caption)
        deadline = time.monotonic() + ANSWER_TIMEOUT_S
        while not any(t.value.startswith("Captured steps") for t in at.text) and time.monotonic() < deadline:
            time.sleep(1)
            at.run()
        [said] = [t.value for t in at.text if t.value.startswith("Captured steps")]
        [trace] = _captures(reports)
        assert said.endswith(f"raw trace {trace.name}")
    assert dpprof.load_run(run_id).operators()["device"].isin(["cpu:0", "cpu:1"]).any()


def test_ops_vs_speaks_of_the_captures_steps_not_the_runs(captured, capsys):
    """`dpprof ops RUN --device cpu:1 --vs cpu:0` compares the capture's operators: its 2 steps, not the run's 6."""
    run, _ = captured
    assert main(["ops", str(run.path), "--device", "cpu:1", "--vs", "cpu:0"]) == 0
    sentence = capsys.readouterr().out.splitlines()[0]
    assert "over 2 steps" in sentence and "over 6 steps" not in sentence, sentence


@pytest.mark.parametrize("command", ["ops", "kernels", "memory"])
def test_a_device_or_rank_the_capture_does_not_hold_is_said_not_read_as_nothing(captured, capsys, command):
    """`--device cpu:7` or `--rank 5` of a run on 2 CPU workers: one line naming what the capture holds and exit 1,
    never an empty table, "no kernels in this run" or "no [memory] events" with exit 0."""
    run, _ = captured
    held = ", ".join(sorted(["cpu:0", "cpu:1", TRAINING_THREAD_DEVICE]))
    for flags, said in ((["--device", "cpu:7"], f"has no device cpu:7 in its capture of steps 2 to 3: its operator, "
                                                f"kernel and memory tables name {held}"),
                        (["--rank", "5"], "has no rank 5: it holds rank 0")):
        assert main([command, str(run.path), *flags]) == 1
        out = capsys.readouterr()
        assert out.out == "" and out.err.strip() == f"dpprof: run {run.id} {said}"
    assert main([command, str(run.path), "--device", "cpu:1", "--rank", "0"]) == 0  # what it holds still reads
    assert "has no" not in capsys.readouterr().err


def test_ops_vs_the_same_device_is_a_usage_error_and_another_runs_steps_are_said(captured, tmp_path, capsys):
    """`--device cpu:1 --vs cpu:1` compares nothing: a usage error (it printed "cpu:1 is 0.0 ms faster than cpu:1").
    Against another run whose capture holds 1 step to this one's 2, its totals are scaled to this one's 2 steps, said
    so (the sentence gave no count, then both counts with the totals left over different steps)."""
    run, _ = captured
    with pytest.raises(SystemExit) as exit_:
        main(["ops", str(run.path), "--device", "cpu:1", "--vs", "cpu:1"])
    assert exit_.value.code == 2
    assert "--vs cpu:1 names the device the run's side already is" in capsys.readouterr().err
    one = train(build_workload("cifar-lenet", 32), dpprof.cpu_devices(2), 3, name="one step", reports_dir=str(tmp_path),
                capture="1:2")
    notes = dpprof.load_run(one.path).notes["message"]
    assert any(m.startswith("captured step 1 with torch.profiler") for m in notes)  # not "steps 1 to 1"
    assert main(["--reports-dir", str(tmp_path), "ops", str(run.path), "--vs", one.id]) == 0
    sentence = capsys.readouterr().out.splitlines()[0]
    assert "self time over 2 steps (one step's totals scaled from 1 step)" in sentence, sentence


def test_ops_vs_the_run_itself_is_a_usage_error(captured, capsys):
    """`dpprof ops RUN --vs RUN` (the run named again, by its id) printed "captured is 0.0 ms faster than captured"
    and a table of zeros, as `--vs` of the same device did before it was refused: it is a usage error too, naming what
    to compare instead; a rank or device of the run against the whole of it still compares."""
    run, _ = captured
    reports = str(Path(run.path).parent)
    with pytest.raises(SystemExit) as exit_:
        main(["--reports-dir", reports, "ops", str(run.path), "--vs", run.id])
    assert exit_.value.code == 2
    assert f"--vs {run.id} names the run itself" in capsys.readouterr().err
    assert main(["--reports-dir", reports, "ops", str(run.path), "--device", "cpu:1", "--vs", run.id]) == 0
    assert capsys.readouterr().out.startswith("cpu:1 is ")


def test_ops_vs_a_device_the_capture_does_not_hold_says_so_not_no_run(captured, capsys):
    """`dpprof ops RUN --device cpu:0 --vs cpu:9`: the device is named missing with the devices the capture holds,
    not taken for a run ("no run 'cpu:9'"); a name that is no device is still looked up as a run."""
    run, _ = captured
    held = ", ".join(sorted(["cpu:0", "cpu:1", TRAINING_THREAD_DEVICE]))
    assert main(["ops", str(run.path), "--device", "cpu:0", "--vs", "cpu:9"]) == 1
    out = capsys.readouterr()
    assert out.out == "" and out.err == (f"dpprof: --vs cpu:9: run {run.id} has no device cpu:9 (its operator tables "
                                         f"name {held}) and no run is called so\n")
    assert main(["ops", str(run.path), "--vs", "no-such-run"]) == 1
    assert "no run 'no-such-run'" in capsys.readouterr().err



def test_the_operators_side_by_side_says_which_device_b_is_when_all_are_chosen(captured, monkeypatch):
    """With "all devices" chosen above (the page's default), B is the last device: its label says so rather than
    "the device chosen above"; a device chosen above is B, named so."""
    from streamlit.testing.v1 import AppTest

    from dpprof.views.opdiff import Pick

    run, _ = captured
    monkeypatch.setenv("DPPROF_REPORTS", str(Path(run.path).parent))
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=60)
    at.run()
    at.switch_page("app_pages/operators.py").run()
    assert not at.exception, [e.message for e in at.exception]
    assert at.selectbox(key="ops_pick").value == Pick()
    b = at.selectbox(key="ops_b")
    assert b.value == Pick(None, TRAINING_THREAD_DEVICE)
    assert b.label == "B (explained: the last device, as all are chosen above; choose one there for another)"
    at.selectbox(key="ops_pick").set_value(Pick(None, "cpu:1")).run()
    b = at.selectbox(key="ops_b")
    assert b.value == Pick(None, "cpu:1") and b.label == "B (explained: the device chosen above)"


def test_ops_vs_by_shape_is_refused_not_compared_by_name_without_a_word(captured, capsys):
    """`--vs` compares operators by name: `--by shape` beside it was dropped and the names compared."""
    run, _ = captured
    with pytest.raises(SystemExit) as exited:
        main(["ops", str(run.path), "--device", "cpu:1", "--vs", "cpu:0", "--by", "shape"])
    said = capsys.readouterr()
    assert exited.value.code == 2 and said.out == ""
    assert said.err.splitlines()[-1] == ("dpprof ops: error: --vs compares operators by name: leave out --by shape, "
                                         "or read the shapes without --vs"), said.err

"""Fault injection: when the disk, the directory or a signal fails, nothing committed is lost and the
user reads one true line.

The disk and read-only cases run on a small tmpfs or a read-only mount (root, as in CI); where
mounting is not permitted they fall back to a fake filesystem error at the same place. Every case
adds its row (fault, steps trained, steps kept, status) to ROWS; the last test prints the table the
docs' "Runs on disk and faults" page (docs/runs-on-disk.md) shows and checks that the page says the same statuses.
"""
from __future__ import annotations

import errno
import os
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import forked
import pytest
import torch
from torch import nn

import dpprof
from dpprof.store import detail_rows
from dpprof.store.faults import RecordingError, failure_line
from dpprof.plaintext import shown_text

ROOT = Path(__file__).resolve().parents[1]
ROWS: dict[str, dict] = {}  # fault -> {"trained", "kept", "status", "line"}


def _steps(n: int) -> str:
    """How the lines count steps: "1 step", "21 steps" (the count of steps, not a step's index)."""
    return f"{n} step" if n == 1 else f"{n} steps"


def _row(fault: str, trained: int | str, kept: int | str, status: str, line: str) -> None:
    line = re.sub(r"/\S*/\d{8}-\d{6}-[0-9a-f]{6}\.sqlite", "reports/RUN.sqlite", line)  # this session's paths
    line = re.sub(r"/\S*/(mnt\d+|reports)\b", "reports", line)
    ROWS[fault] = {"trained": trained, "kept": kept, "status": status, "line": line}


def _profile(reports: Path, steps: int, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "dpprof", "--reports-dir", str(reports), "profile", "tutorial-linear",
           "--devices", "cpu:2", "--steps", str(steps), "--batch-size", "8", "--quiet", *extra]
    return forked.run(cmd, capture_output=True, text=True, timeout=300,
                      env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})


def _one_line(stderr: str) -> str:
    lines = [l for l in stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


def _files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir()) if directory.exists() else []


def _fake_full_disk(monkeypatch, after_commits: int) -> None:
    """The writer's commits fail as SQLite fails on a full disk, from commit ``after_commits`` on."""
    from dpprof.store import writer

    real, seen = writer.SqliteSink._write, []

    def write(self, *args, **kwargs):  # whatever the writer passes besides the records and the run's updates
        seen.append(1)
        if len(seen) > after_commits:
            err = sqlite3.OperationalError("database or disk is full")
            err.sqlite_errorcode = 13  # SQLITE_FULL
            raise err
        return real(self, *args, **kwargs)

    monkeypatch.setattr(writer.SqliteSink, "_write", write)


def _linear_steps(run, net, steps: int) -> None:
    for _ in range(steps):
        with run.step():
            net(torch.randn(8, 5)).sum().backward()


# -- the disk ------------------------------------------------------------------------------------

def test_a_disk_full_at_the_start_is_one_line_and_leaves_no_file(mount, monkeypatch, reports, caplog):
    where = mount("40k")  # less than an empty run file
    if where is not None:
        done = _profile(where, 5)
        assert done.returncode == 1
        line = _one_line(done.stderr)
        assert line == f"dpprof: cannot record in {where}: disk full"
        assert _files(where) == []  # not even the hidden file it was being built in
        assert "recorded run" not in done.stdout
    else:
        def full(*args, **kwargs):
            raise OSError(errno.ENOSPC, "No space left on device")
        monkeypatch.setattr("dpprof.store.writer.os.open", full)
        with pytest.raises(RecordingError, match=re.escape(f"cannot record in {reports}: disk full")):
            with dpprof.record(name="full"):
                pass
        line = f"dpprof: cannot record in {reports}: disk full"
        assert _files(reports) == []
    assert dpprof.list_runs(where or reports).empty
    _row("disk full at the start", 5 if where else 0, 0, "no run (no file left)", line)


def test_a_disk_that_fills_mid_run_keeps_every_committed_step_and_says_how_many(mount, monkeypatch, reports):
    where, steps = mount("260k"), 300
    if where is not None:
        done = _profile(where, steps)
        assert done.returncode == 1  # training finished, recording did not
        line = _one_line(done.stderr)
        directory = where
    else:
        _fake_full_disk(monkeypatch, after_commits=2)
        net = dpprof.DataParallel(nn.Linear(5, 2), device_ids=dpprof.cpu_devices(2))
        with dpprof.record(name="fills") as run:
            for i in range(steps):
                _linear_steps(run, net, 1)
                if i % 50 == 0:
                    time.sleep(0.6)  # a few commits go through before the disk "fills"
        assert run.recording_failed
        line, directory = f"dpprof: {run.problem}", reports
    match = re.fullmatch(r"dpprof: disk full after (\d+) steps?: (\d+) steps? kept in (\S+), (\d+) not recorded", line)
    assert match, line
    kept, path = int(match.group(2)), match.group(3)
    assert int(match.group(1)) == kept and kept + int(match.group(4)) == steps and 0 < kept < steps
    stored = dpprof.load_run(path)
    assert stored.meta["status"] == "disk_full"
    # the final line carries the final count of records dropped; where only the line stored when the
    # disk filled fitted, the count is the one at that moment (0 if that commit's records all fitted)
    final = stored.meta["error"] == line.removeprefix("dpprof: ")
    assert stored.meta["dropped_records"] > 0 or not final
    assert stored.meta["devices"] == ["cpu:0", "cpu:1"]
    assert stored.steps["step"].tolist() == list(range(kept))  # every committed step, in order
    # the final line if it still fitted, else the one stored when the disk filled
    assert stored.meta["error"] in (line.removeprefix("dpprof: "),
                                    f"disk full after {_steps(kept)}: the steps after them were not recorded")
    listed = dpprof.list_runs(directory)
    assert listed[["status", "steps"]].values.tolist() == [["disk_full", kept]]
    _row("disk full mid-run", steps, kept, "disk_full", line)


def _fill(path: Path, nbytes: int) -> None:
    """A file of up to ``nbytes`` (less if the disk fills first: a full disk is what the test wants)."""
    with open(path, "wb") as f:
        try:
            f.write(b"\0" * max(nbytes, 0))
            f.flush()
        except OSError as err:
            if err.errno != errno.ENOSPC:
                raise


def test_whatever_room_the_full_disk_leaves_the_run_keeps_its_devices_status_and_steps_together(mount, monkeypatch):
    """A busy machine's writer commits late: the commit that fills the disk carries the run's devices and many
    steps. However little room it leaves (a filler file takes all but 8 to 96 KB), the run file says disk_full,
    names its devices and gives the count of the steps it holds (the records of the failed commit alone would
    take the last room: on main, with 48 KB left, devices [] and status 'running')."""
    from dpprof.store import writer

    where = mount("2m")
    if where is None:
        pytest.skip("mounting a tmpfs is not permitted here: the room a full disk leaves needs a real one")
    monkeypatch.setattr(writer, "FLUSH_INTERVAL_S", 600.0)  # one commit at the end: a writer starved by load
    net = dpprof.DataParallel(nn.Linear(5, 2), device_ids=dpprof.cpu_devices(2))
    for left_kb in range(8, 97, 8):
        reports = where / f"r{left_kb}"
        with dpprof.record(name="fills", reports_dir=str(reports)) as run:
            _linear_steps(run, net, 300)
            _fill(where / "filler", shutil.disk_usage(where).free - left_kb * 1024)
        assert run.recording_failed
        if not os.path.exists(run.path):  # not even its first step fitted: no run, and the line says so
            assert "before the first step was stored: no run file kept" in run.problem, run.problem
            (where / "filler").unlink()
            continue
        stored = dpprof.load_run(run.path)
        kept = len(stored.steps)
        assert (stored.meta["stored_status"], stored.meta["devices"]) == ("disk_full", ["cpu:0", "cpu:1"]), left_kb
        assert re.match(rf"disk full after {_steps(kept)}: ", stored.meta["error"]), (left_kb, kept, stored.meta["error"])
        assert stored.steps["step"].tolist() == list(range(kept))
        (where / "filler").unlink()
        shutil.rmtree(reports)


def test_a_live_recording_folds_its_log_back_once_the_full_disk_has_room_again(mount, monkeypatch):
    """The writer stops writing on a full disk and its write-ahead log is left unfolded; while the run
    goes on, it tries every REFOLD_INTERVAL_S to fold the log back, and does once there is room."""
    from dpprof.store import writer

    where = mount("3m")
    if where is None:
        pytest.skip("mounting a tmpfs is not permitted here: the fold needs a real full disk")
    monkeypatch.setattr(writer, "REFOLD_INTERVAL_S", 3600.0)  # no retry while the disk is full
    net = dpprof.DataParallel(nn.Linear(5, 2), device_ids=dpprof.cpu_devices(2))
    filler = where / "filler"
    with dpprof.record(name="refold", reports_dir=str(where)) as run:
        _linear_steps(run, net, 5)
        assert run.sink.flush()
        with open(filler, "wb") as f:  # take every byte left
            try:
                while True:
                    f.write(b"\0" * 65536)
                    f.flush()
            except OSError as err:
                assert err.errno == errno.ENOSPC
        for _ in range(100):  # steps until a commit fails on the full disk
            _linear_steps(run, net, 20)
            run.sink.flush()
            if run.sink.failure is not None:
                break
        assert run.sink.disk_full and not run.sink.folded
        kept = run.sink.steps_kept
        filler.unlink()
        monkeypatch.setattr(writer, "REFOLD_INTERVAL_S", 0.2)
        deadline = time.monotonic() + 30
        while not run.sink.folded and time.monotonic() < deadline:
            _linear_steps(run, net, 1)  # the run goes on; its commits try the fold
            run.sink.flush()
        assert run.sink.folded  # folded while recording, not at close
        wal = Path(run.path + "-wal")
        assert not wal.exists() or wal.stat().st_size == 0
    stored = dpprof.load_run(run.path)
    assert stored.meta["status"] == "disk_full"
    assert stored.steps["step"].tolist() == list(range(kept))


def test_a_run_cut_short_by_a_full_disk_reads_as_such_and_its_log_folds_back_once_there_is_room(mount):
    """SIGKILL on a full disk leaves the run's write-ahead log beside it: the reader infers disk_full
    from it; with room again, the next recording folds the log back and every step is still there."""
    where = mount("4m")
    if where is None:
        pytest.skip("needs a tmpfs (root)")
    child = forked.Popen([sys.executable, "-c", _CHILD, "none"], stdout=subprocess.PIPE, text=True,
                         env={**os.environ, "DPPROF_REPORTS": str(where), "PYTHONPATH": str(ROOT)})
    try:
        path = Path(child.stdout.readline().strip())
        while int(child.stdout.readline()) < 20:
            pass
        time.sleep(1.2)  # > 2 commit intervals
        child.send_signal(signal.SIGSTOP)  # it writes nothing more: the disk fills, then it is killed
        ballast = where / ".ballast"
        with open(ballast, "wb", buffering=0) as f:  # fill what is left of the disk
            try:
                while True:
                    f.write(b"\0" * 4096)
            except OSError:
                pass
    finally:
        child.kill()
        child.wait()
    wal = path.with_name(path.name + "-wal")
    assert wal.exists() and wal.stat().st_size > 0
    stored = dpprof.load_run(path)
    kept = len(stored.steps)
    assert stored.meta["status"] == "disk_full" and kept >= 20
    ballast.unlink()  # room again
    assert dpprof.load_run(path).meta["status"] == "incomplete"  # the disk is no longer full: killed, as far as it knows
    net = dpprof.DataParallel(nn.Linear(5, 2), device_ids=dpprof.cpu_devices(2))
    with dpprof.record(name="next", reports_dir=where) as run:
        _linear_steps(run, net, 1)
    assert not wal.exists()  # folded back into the run file
    assert len(dpprof.load_run(path).steps) == kept  # with every step it had


def test_a_script_recording_onto_a_full_disk_trains_on_and_is_told_once(mount, monkeypatch, reports, caplog):
    where = mount("260k")
    if where is None:
        _fake_full_disk(monkeypatch, after_commits=1)
    net = dpprof.DataParallel(nn.Linear(5, 2), device_ids=dpprof.cpu_devices(2))
    trained = 0
    with caplog.at_level("WARNING", logger="dpprof"):
        with dpprof.record(name="script", reports_dir=where or reports) as run:
            for i in range(600):
                _linear_steps(run, net, 1)
                trained += 1
                if i in (0, 300):
                    time.sleep(0.6)  # commits before and after the disk fills
    assert trained == 600 and run.status == "finished" and run.recording_failed
    lines = [r.getMessage() for r in caplog.records if r.name == "dpprof"]
    kept = len(dpprof.load_run(run.path).steps)
    assert lines == [f"dpprof: disk full after {_steps(kept)}: {_steps(kept)} kept in {run.path}, {600 - kept} not recorded"]


def _read_only_dir(mount, monkeypatch, fallback: Path) -> Path:
    """A read-only tmpfs; where mounting is not permitted, ``fallback`` with the writer's opens failing
    as on a read-only file system."""
    where = mount("64k", read_only=True)
    if where is None:
        def read_only(*args, **kwargs):
            raise OSError(errno.EROFS, "Read-only file system")
        monkeypatch.setattr("dpprof.store.writer.os.open", read_only)
        where = fallback
    return where


def test_the_dashboard_check_gives_the_line_a_run_would(mount, monkeypatch, reports):
    """The New run page checks the reports directory before it starts `dpprof profile`, and shows this line."""
    from dpprof.store.staging import check_reports_dir

    check_reports_dir(reports)  # a writable directory: made, and nothing left in it
    assert _files(reports) == []
    where = _read_only_dir(mount, monkeypatch, reports)
    with pytest.raises(RecordingError, match=f"^cannot record in {re.escape(str(where))}: read-only file system$"):
        check_reports_dir(where)
    assert _files(where) == []


def test_the_dashboard_shows_that_line_instead_of_starting_a_run(mount, monkeypatch, reports):
    from streamlit.testing.v1 import AppTest

    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from app_pages import common

    where = _read_only_dir(mount, monkeypatch, reports)
    monkeypatch.setenv("DPPROF_REPORTS", str(where))
    started = set(common.processes())
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=60)
    at.run()
    at.button(key="demo").click().run()  # the Runs page's start, with the New run page's start_run
    assert not at.exception, at.exception
    assert [shown_text(e.value) for e in at.error] == [f"dpprof: cannot record in {where}: read-only file system"]
    assert "watch" not in at.session_state and set(common.processes()) == started  # nothing started
    assert _files(where) == []


# -- the directory -------------------------------------------------------------------------------

@pytest.mark.slow
def test_a_read_only_reports_directory_is_one_line_and_leaves_no_file(mount, monkeypatch, reports):
    where = mount("64k", read_only=True)
    if where is not None:
        done = _profile(where, 5)
        assert done.returncode == 1
        line = _one_line(done.stderr)
        assert line == f"dpprof: cannot record in {where}: read-only file system"
        done = _profile(where / "sub", 5)  # a directory it would have to make there
        assert _one_line(done.stderr) == f"dpprof: cannot record in {where / 'sub'}: read-only file system"
        assert _files(where) == []
    else:
        reports.mkdir()

        def read_only(*args, **kwargs):
            raise OSError(errno.EROFS, "Read-only file system")
        monkeypatch.setattr("dpprof.store.writer.os.open", read_only)
        with pytest.raises(RecordingError) as caught:
            with dpprof.record(name="ro"):
                pass
        line = f"dpprof: {caught.value}"
        assert line == f"dpprof: cannot record in {reports}: read-only file system"
        assert _files(reports) == []
    _row("read-only directory", 5 if where else 0, 0, "no run (no file left)", line)


@pytest.mark.parametrize("err, cause", [
    (OSError(errno.EACCES, "Permission denied"), "permission denied"),
    (OSError(errno.EDQUOT, "Disk quota exceeded"), "disk quota exceeded"),
    (OSError(errno.ENOENT, "No such file or directory"), "no such directory"),
])
def test_other_failures_at_the_start_name_the_directory_and_the_cause(err, cause, monkeypatch, reports):
    """Causes a root test cannot provoke on a real mount (root ignores permissions), at the same call."""
    reports.mkdir()

    def fail(*args, **kwargs):
        raise err
    monkeypatch.setattr("dpprof.store.writer.os.open", fail)
    with pytest.raises(RecordingError, match=f"^cannot record in {re.escape(str(reports))}: {cause}$"):
        with dpprof.record(name="x"):
            pass
    assert _files(reports) == []



@pytest.mark.parametrize("where", ["/proc", "/proc/dpprof-reports"])
def test_a_run_in_proc_says_nothing_can_be_made_there_not_no_such_directory(where):
    """/proc is there but takes no file (it answers "no such file or directory"): said as what it is."""
    net = dpprof.DataParallel(nn.Linear(5, 2), device_ids=dpprof.cpu_devices(2))
    with pytest.raises(RecordingError, match=f"^cannot record in {where}: nothing can be made in /proc \\(a proc "
                                             "filesystem\\)$"):
        with dpprof.record(name="x", reports_dir=where) as run:
            with run.step():
                net(torch.randn(8, 5)).sum().backward()
    assert not os.path.lexists("/proc/dpprof-reports")

@pytest.mark.slow
def test_the_cli_says_why_it_cannot_record_without_a_traceback(tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    for reports in (not_a_dir / "reports", not_a_dir):  # under a file, and the file itself
        done = _profile(reports, 3)
        assert done.returncode == 1
        assert _one_line(done.stderr) == f"dpprof: cannot record in {reports}: not a directory"
    assert not_a_dir.read_text() == "x"


def test_a_half_created_run_file_is_never_listed(reports):
    """A run file is built under a hidden name; one left by a process killed while creating it is not a run."""
    run = _record_linear(reports, 2)
    reports.joinpath(f".{Path(run.path).name}.part").write_bytes(Path(run.path).read_bytes()[:4096])
    assert dpprof.list_runs()["id"].tolist() == [run.id]


def _record_linear(reports: Path, steps: int):
    net = dpprof.DataParallel(nn.Linear(5, 2), device_ids=dpprof.cpu_devices(2))
    with dpprof.record(name="linear", reports_dir=reports) as run:
        _linear_steps(run, net, steps)
    return run


def test_a_reports_directory_removed_mid_run_gets_the_whole_run_back(reports, caplog):
    net = dpprof.DataParallel(nn.Linear(5, 2), device_ids=dpprof.cpu_devices(2))
    with caplog.at_level("WARNING", logger="dpprof"):
        with dpprof.record(name="removed") as run:
            _linear_steps(run, net, 10)
            time.sleep(0.7)  # committed
            shutil.rmtree(reports)
            time.sleep(0.7)  # the writer finds its file gone and writes it back
            _linear_steps(run, net, 10)
    lines = [r.getMessage() for r in caplog.records if r.name == "dpprof"]
    line = f"dpprof: {reports} was removed during the run: dpprof wrote the run back to {run.path} (20 steps)"
    assert lines == [line]
    assert not run.recording_failed
    stored = dpprof.load_run(run.id)
    assert stored.meta["status"] == "finished" and stored.steps["step"].tolist() == list(range(20))
    assert line.removeprefix("dpprof: ") in stored.notes["message"].tolist()
    _row("directory removed mid-run", 20, 20, "finished (written back)", line)


def test_a_removed_directory_that_cannot_be_made_again_is_said_to_be_lost(reports, monkeypatch, caplog):
    """Where the directory cannot be made again (here: no permission, faked, since root may do anything)."""
    net = dpprof.DataParallel(nn.Linear(5, 2), device_ids=dpprof.cpu_devices(2))

    def forbidden(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied")
    with caplog.at_level("WARNING", logger="dpprof"):
        with dpprof.record(name="gone") as run:
            _linear_steps(run, net, 5)
            time.sleep(0.7)
            monkeypatch.setattr("dpprof.store.writer.os.makedirs", forbidden)
            shutil.rmtree(reports)
            time.sleep(0.7)
            _linear_steps(run, net, 5)
    assert run.recording_failed and not reports.exists()
    lines = [r.getMessage() for r in caplog.records if r.name == "dpprof"]
    assert lines == [f"dpprof: the run is lost: {reports} was removed during the run and cannot be made again "
                     "(permission denied)"]


# -- signals -------------------------------------------------------------------------------------

_CHILD = r"""
import signal, sys, time, torch, dpprof
signal.signal(signal.SIGINT, signal.default_int_handler)  # a test runner may have started us ignoring it
signal.signal(signal.SIGHUP, signal.SIG_DFL)  # and nohup, SIGHUP (an ignored signal stays ignored while recording)
stop = []
if sys.argv[1] == "own":  # the program's own SIGTERM handler: finish the step, then stop
    signal.signal(signal.SIGTERM, lambda s, f: stop.append(s))
net = dpprof.DataParallel(torch.nn.Linear(5, 2), device_ids=dpprof.cpu_devices(2))
with dpprof.record(name="signalled") as run:
    print(run.path, flush=True)
    i = 0
    while not stop:
        with run.step():
            net(torch.randn(8, 5)).sum().backward()
        print(i, flush=True)
        i += 1
        time.sleep(0.01)
print("went on", i, flush=True)
"""


def _signalled(reports: Path, signum: int, handler: str = "none", after: int = 20):
    child = forked.Popen([sys.executable, "-c", _CHILD, handler], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True,
                         env={**os.environ, "DPPROF_REPORTS": str(reports), "PYTHONPATH": str(ROOT)})
    path = child.stdout.readline().strip()
    last = -1
    while last < after:
        last = int(child.stdout.readline())
    if signum == signal.SIGKILL:
        time.sleep(1.5)  # > 2 commit intervals: step `last` is on disk
    child.send_signal(signum)
    out, err = child.communicate(timeout=120)
    return child.returncode, path, last, out, err


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_and_sighup_flush_mark_the_run_interrupted_and_end_the_process_by_the_signal(signum, reports):
    code, path, last, out, err = _signalled(reports, signum)
    assert code == -signum  # ended by the signal, as a scheduler expects (143 / 129 in a shell)
    assert "went on" not in out
    line = _one_line(err)
    stored = dpprof.load_run(path)
    kept = len(stored.steps)
    name = signal.Signals(signum).name
    assert line == f"dpprof: interrupted by {name} after {_steps(kept)}: {_steps(kept)} kept in {path}"
    assert stored.meta["status"] == "interrupted" and stored.meta["ended_at"]
    assert stored.steps["step"].tolist() == list(range(kept)) and kept >= last + 1
    assert stored.meta["error"] == f"interrupted by {name} after {_steps(kept)}"
    _row(name, kept, kept, "interrupted", line)


def test_a_programs_own_sigterm_handler_is_called_and_decides(reports):
    code, path, last, out, err = _signalled(reports, signal.SIGTERM, handler="own")
    assert code == 0 and "went on" in out  # the program's handler stopped the loop; it ended normally
    trained = int(out.split("went on")[1])
    stored = dpprof.load_run(path)
    assert stored.meta["status"] == "interrupted" and len(stored.steps) == trained
    assert _one_line(err) == f"dpprof: interrupted by SIGTERM after {_steps(trained)}: {_steps(trained)} kept in {path}"


def test_ctrl_c_marks_the_run_interrupted_with_its_steps(reports):
    code, path, last, out, err = _signalled(reports, signal.SIGINT)
    assert code != 0 and "KeyboardInterrupt" in err  # Python's own Ctrl-C exit, unchanged
    stored = dpprof.load_run(path)
    kept = len(stored.steps)
    assert stored.meta["status"] == "interrupted" and kept >= last + 1
    line = f"dpprof: interrupted by SIGINT (Ctrl-C) after {_steps(kept)}: {_steps(kept)} kept in {path}"
    assert err.splitlines()[0] == line
    _row("SIGINT (Ctrl-C)", kept, kept, "interrupted", line)


_CTRL_C_AT_CLOSE = r"""
import os, signal, sys, torch, dpprof
import dpprof.store.writer as writer
signal.signal(signal.SIGINT, signal.default_int_handler)
close = writer.SqliteSink.close

def pressed_then_close(self, *args, **kwargs):  # Ctrl-C as the run file is closing (its capture stored before)
    os.kill(os.getpid(), signal.SIGINT)
    for _ in range(1000):  # Python runs the handler between two bytecodes: here, inside the close
        pass
    return close(self, *args, **kwargs)

writer.SqliteSink.close = pressed_then_close
net = dpprof.DataParallel(torch.nn.Linear(5, 2), device_ids=dpprof.cpu_devices(2))
with dpprof.record(name="ctrl-c at close", capture="2:4") as run:
    print(run.path, flush=True)
    for i in range(6):
        with run.step():
            net(torch.randn(8, 5)).sum().backward()
        if sys.argv[1] == "twice" and i == 4:
            raise KeyboardInterrupt  # the first Ctrl-C, in training: the second comes as the run closes
print("not reached", flush=True)
"""


@pytest.mark.parametrize("when", ["once", "twice"])
def test_ctrl_c_while_the_run_closes_waits_for_the_close(reports, when):
    """A Ctrl-C as the run closes (after training, or a second one after a first stopped training) waits until the
    run is stored whole, its capture too; then Python's KeyboardInterrupt ends the program as it would have."""
    child = subprocess.run([sys.executable, "-c", _CTRL_C_AT_CLOSE, when], capture_output=True, text=True,
                           timeout=240, env={**os.environ, "DPPROF_REPORTS": str(reports), "PYTHONPATH": str(ROOT)})
    assert child.returncode != 0 and "KeyboardInterrupt" in child.stderr and "not reached" not in child.stdout
    stored = dpprof.load_run(child.stdout.splitlines()[0])
    steps = 6 if when == "once" else 5
    assert stored.meta["status"] == ("finished" if when == "once" else "interrupted"), stored.meta["error"]
    assert stored.steps["step"].tolist() == list(range(steps))
    assert detail_rows.detail_missing(stored) is None and len(detail_rows.operators(stored))  # the capture stored


_SIGNAL_AT_START = r"""
import os, signal, sys, torch, dpprof
import dpprof.recording as recording
signal.signal(signal.SIGINT, signal.default_int_handler)  # a test runner may have started us ignoring it
opened = recording.open_sink
signum = getattr(signal, sys.argv[1])

def opened_then_signalled(*args, **kwargs):  # the signal the moment the run's file is made, before the run is whole
    sink = opened(*args, **kwargs)
    os.kill(os.getpid(), signum)
    for _ in range(1000):  # Python runs the handler between two bytecodes: here, inside the start
        pass
    return sink

recording.open_sink = opened_then_signalled
net = dpprof.DataParallel(torch.nn.Linear(5, 2), device_ids=dpprof.cpu_devices(2))
with dpprof.record(name="signalled at start") as run:
    print("trained", flush=True)
    with run.step():
        net(torch.randn(8, 5)).sum().backward()
"""


@pytest.mark.parametrize("name", ["SIGTERM", "SIGINT"])
def test_a_signal_as_the_run_file_is_made_closes_the_run_interrupted(reports, name):
    """SIGTERM (or Ctrl-C) sent the moment the run's file is made, before the run had its signal handlers: the
    signal waits until the run has started, then closes it as interrupted with no step, and ends the process as it
    would have (by the signal; KeyboardInterrupt). Never a run left 'running' that reads incomplete."""
    child = subprocess.run([sys.executable, "-c", _SIGNAL_AT_START, name], capture_output=True, text=True,
                           timeout=240, env={**os.environ, "DPPROF_REPORTS": str(reports), "PYTHONPATH": str(ROOT)})
    signum = getattr(signal, name)
    if signum == signal.SIGTERM:
        assert child.returncode == -signum, child.stderr  # ended by the signal, as without dpprof
    else:
        assert child.returncode != 0 and "KeyboardInterrupt" in child.stderr, child.stderr
    assert "trained" not in child.stdout  # the block never ran
    [path] = reports.glob("*.sqlite")
    stored = dpprof.load_run(path)
    what = "SIGINT (Ctrl-C)" if signum == signal.SIGINT else name
    assert stored.meta["status"] == "interrupted" and stored.meta["ended_at"], stored.meta
    assert stored.meta["error"] == f"interrupted by {what} after 0 steps" and stored.steps.empty
    assert child.stderr.splitlines()[0] == f"dpprof: interrupted by {what} after 0 steps: 0 steps kept in {path}"


def test_sigkill_keeps_every_step_committed_before_it(reports):
    code, path, last, out, err = _signalled(reports, signal.SIGKILL)
    assert code == -signal.SIGKILL and err == ""  # nothing can say anything
    stored = dpprof.load_run(path)
    kept = len(stored.steps)
    assert stored.meta["status"] == "incomplete" and kept >= last + 1
    assert stored.steps["step"].tolist() == list(range(kept))
    _row("SIGKILL", f"{kept}+", kept, "incomplete", "(none: the process is gone)")


def test_a_signal_while_recording_from_another_thread_is_left_to_the_program(reports):
    """Python runs signal handlers in the main thread only: a run recorded elsewhere installs none."""
    import threading
    before = signal.getsignal(signal.SIGTERM)
    seen = []

    def work():
        with dpprof.record(name="thread") as run:
            seen.append(signal.getsignal(signal.SIGTERM))
            _linear_steps(run, dpprof.DataParallel(nn.Linear(5, 2), device_ids=dpprof.cpu_devices(2)), 2)
    t = threading.Thread(target=work)
    t.start()
    t.join(60)
    assert seen == [before] and signal.getsignal(signal.SIGTERM) == before


# -- the table -----------------------------------------------------------------------------------

FAULT_ORDER = ["disk full at the start", "disk full mid-run", "read-only directory", "directory removed mid-run",
               "SIGTERM", "SIGHUP", "SIGINT (Ctrl-C)", "SIGKILL"]


def test_the_docs_fault_table_says_what_these_tests_saw():
    """Print the docs' fault table from this session's rows; docs/runs-on-disk.md must give the same statuses."""
    if not ROWS:
        pytest.skip("no fault test ran in this session")
    print("\n| fault | steps trained | steps kept | status | what the user reads |")
    print("| --- | --- | --- | --- | --- |")
    for fault in FAULT_ORDER:
        if fault in ROWS:
            r = ROWS[fault]
            print(f"| {fault} | {r['trained']} | {r['kept']} | {r['status']} | {r['line']} |")
    page = (ROOT / "docs" / "runs-on-disk.md").read_text()
    table = {m.group(1): m.group(2) for m in re.finditer(r"^\| ([^|]+?) \| [^|]+ \| [^|]+ \| ([^|]+?) \|", page, re.M)}
    for fault, row in ROWS.items():
        assert table.get(fault) == row["status"], f"docs/runs-on-disk.md's fault table: {fault!r} should read {row['status']!r}"


def test_the_line_of_a_run_cut_short_counts_with_thousands_separators():
    """A long run's counts read as the rest of dpprof writes them: "17,316 not recorded" (it said 17316)."""
    assert (failure_line("disk full", "reports/RUN.sqlite", 1_212, 18_528)
            == "disk full after 1,212 steps: 1,212 steps kept in reports/RUN.sqlite, 17,316 not recorded")
    assert failure_line("disk full", "r.sqlite", 1, None) == "disk full after 1 step: 1 step kept in r.sqlite"


def _rank_process(parent: int, rank: int) -> int | None:
    """The pid of a dpprof.ddp_worker below ``parent`` whose RANK is ``rank`` (read from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    below, todo = [], [parent]
    while todo:
        pid = todo.pop()
        for child in children.get(pid, []):
            below.append(child)
            todo.append(child)
    for pid in below:
        try:
            cmdline = (Path("/proc") / str(pid) / "cmdline").read_bytes()
            environ = (Path("/proc") / str(pid) / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"dpprof.ddp_worker" in cmdline and f"RANK={rank}".encode() in environ:
            return pid
    return None


@pytest.mark.slow
def test_a_ddp_rank_killed_is_said_first_not_the_peer_error_it_caused(tmp_path):
    """One rank of a 2-rank DDP job killed (SIGKILL): its file is never closed and says nothing, and rank 0 then
    fails on the closed connection. The run says the killed rank stopped first (it gave rank 0's "Connection reset
    by peer" alone, blaming the rank that survived)."""
    reports = tmp_path / "reports"
    job = subprocess.Popen([sys.executable, "-m", "dpprof", "--reports-dir", str(reports), "profile", "tutorial-linear",
                            "--ddp", "--nproc", "2", "--steps", "100000", "--quiet"],
                           env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)},
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:  # both ranks recording, some steps committed
            listed = dpprof.list_runs(reports) if reports.is_dir() else None
            if listed is not None and len(listed) and listed.loc[0, "ranks"] == 2 and listed.loc[0, "steps"] >= 3:
                break
            time.sleep(0.5)
        victim = _rank_process(job.pid, 1)
        assert victim is not None, "rank 1's process was not found"
        os.kill(victim, signal.SIGKILL)
        job.wait(timeout=180)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    [row] = dpprof.list_runs(reports).to_dict("records")
    assert row["status"] == "failed", row
    assert row["error"].startswith("rank 1 stopped without closing its file (a process killed, or its machine lost); "
                                   "then rank 0: "), row["error"]

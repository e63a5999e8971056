"""Profiles started in child processes: their state, their output, stopping them, and how far they got.

A :class:`Started` is what :meth:`dpprof.launch.Profile.start` returns. Its run id was chosen before the start
and given to the child (``--run-id``), so its run is the listing's row with that id: nothing is read out of the
child's output, and no run file is opened to find whose it is. Torch-free.
"""
from __future__ import annotations

import contextlib
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dpprof.launch import Profile

__all__ = ["LaunchError", "Started", "progress_line", "run_row", "DashboardError", "Dashboard", "dashboard_server"]

LOG_TAIL_LINES = 15  # what a page shows of a started process's output
_MESSAGE_LINES = 5  # a failed child's last lines in the one message that says why


class LaunchError(RuntimeError):
    """A started profile's process failed.

    Attributes:
        returncode: its exit status.
        lines: what it said about why (the ranks' one-line reasons, else its last lines of output).
    """

    def __init__(self, message: str, returncode: int, lines: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.returncode = returncode
        self.lines = list(lines)


@dataclass
class Started:
    """A profile started in a child process (``python -m dpprof profile ... --run-id ID``)."""

    profile: Profile  # with its run id chosen
    proc: subprocess.Popen
    log: Path  # the child's output (stdout and stderr)
    started_s: float  # time.time() at the start
    stopped: bool = False  # stop() was called: however it exits, it was stopped
    _own_log: bool = field(default=False, repr=False)  # a temporary log, removed once read

    @classmethod
    def launch(cls, profile: Profile, log: str | os.PathLike[str] | None = None,
               env: Mapping[str, str] | None = None, new_session: bool = False) -> Started:
        """Start ``profile`` (its run id chosen) in a child process writing to ``log`` (default: a temporary file)."""
        own = log is None
        if log is None:
            fd, name = tempfile.mkstemp(prefix="dpprof-", suffix=".log")
            os.close(fd)
            log = name
        path = Path(log)
        out: IO[bytes]
        with open(path, "wb") as out:
            proc = subprocess.Popen(profile.child_argv(quiet=True), stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=new_session, cwd=os.getcwd(),
                                    env={**os.environ, **profile.env, **(env or {})})
        return cls(profile, proc, path, time.time(), _own_log=own)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def run_id(self) -> str:
        """The id of the run the child records (chosen before it started)."""
        return str(self.profile.run_id)

    @property
    def cmd(self) -> list[str]:
        """The child's command line."""
        return list(self.proc.args)  # type: ignore[arg-type]

    def status(self) -> tuple[str, int | None]:
        """("running", None) or ("exited", returncode); polling reaps it, so no zombie lingers."""
        code = self.proc.poll()
        return ("running", None) if code is None else ("exited", code)

    @property
    def running(self) -> bool:
        return self.status()[0] == "running"

    def stop(self) -> None:
        """End it with SIGTERM: the recording flushes, marks its run interrupted and keeps the steps recorded."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.stopped = True

    def wait(self, timeout_s: float | None = None) -> int:
        """Wait for it to exit; returns its exit status.

        Raises:
            subprocess.TimeoutExpired: it ran past ``timeout_s`` (it is killed, and reaped, first).
        """
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise

    def output(self) -> str:
        """Everything it wrote so far ("" when its log cannot be read)."""
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        """Its last ``lines`` lines of output."""
        return "\n".join(self.output().splitlines()[-lines:])

    def raise_for_status(self) -> None:
        """After wait(): LaunchError where it failed (its command and last lines); its temporary log removed."""
        code = self.proc.poll()
        tail = self.log_tail(_MESSAGE_LINES)
        if self._own_log and code is not None:
            self.log.unlink(missing_ok=True)
        if code is not None and code != 0:
            raise LaunchError(f"{self.profile.command()} exited with {code}: {tail}", code, tail.splitlines())


def run_row(runs: Any, run_id: str) -> Any:
    """The row of a listing (dpprof.list_runs) for ``run_id``, or None before its file appears."""
    if runs is None or len(runs) == 0:
        return None
    match = runs[runs["id"] == run_id]
    return None if match.empty else match.iloc[0]


def progress_line(steps_done: Any, steps_total: int, duration_s: Any) -> str | None:
    """"step 12 of 50 · 4.1 steps/s" from a run's listed steps and duration (None before it has a step count)."""
    if steps_done is None or (isinstance(steps_done, float) and math.isnan(steps_done)):  # nothing recorded yet
        return None
    done = int(steps_done)
    rate = f" · {done / duration_s:.1f} steps/s" if done and duration_s else ""
    return f"step {done:,} of {steps_total:,}{rate}"


class DashboardError(RuntimeError):
    """The dashboard's server ended, or did not answer in time, before it served a page; the message says which
    and ends with the server's last lines of output."""


@dataclass(frozen=True)
class Dashboard:
    """A running dashboard: its address and its server's process id."""

    url: str
    pid: int


DASHBOARD_START_S = 60.0  # a cold `streamlit run` imports pandas, plotly and streamlit: seconds on a loaded 2-core machine
_STOP_S = 10.0  # after SIGTERM, before SIGKILL


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def dashboard_server(app: str | os.PathLike[str], reports: str | os.PathLike[str], log: str | os.PathLike[str],
                     env: Mapping[str, str] | None = None,
                     start_timeout_s: float = DASHBOARD_START_S) -> Iterator[Dashboard]:
    """``streamlit run APP`` headless on a free loopback port, reading the runs in ``reports``, for as long as the
    ``with`` block runs; then stopped (SIGTERM, then SIGKILL after 10 s). Its output goes to ``log``.

    Args:
        app: the dashboard's script (``app.py`` of the checkout); it runs in the script's directory.
        reports: the reports directory it reads ($DPPROF_REPORTS).
        log: where the server's output goes (overwritten).
        env: variables to set besides $DPPROF_REPORTS (on top of this process's environment).
        start_timeout_s: how long to wait for its health check to answer.

    Yields:
        its address and process id, once its health check answers "ok".

    Raises:
        DashboardError: it ended, or did not answer in ``start_timeout_s``.

    Example:
        >>> with dashboard_server("app.py", "reports", "streamlit.log") as served:
        ...     urllib.request.urlopen(served.url).status
        200
    """
    app = Path(app).resolve()
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "streamlit", "run", str(app), "--server.port", str(port), "--server.address",
             "127.0.0.1", "--server.headless", "true", "--browser.gatherUsageStats", "false"],
            cwd=app.parent, env={**os.environ, **(env or {}), "DPPROF_REPORTS": os.fspath(reports)},
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + start_timeout_s
        while True:
            with contextlib.suppress(OSError):
                if urllib.request.urlopen(f"{url}/_stcore/health", timeout=2).read() == b"ok":
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                why = (f"ended with status {proc.returncode}" if proc.poll() is not None
                       else f"did not answer in {start_timeout_s:.0f} s")
                tail = Path(log).read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
                raise DashboardError("\n".join([f"the dashboard's server {why}; its output:", *tail]))
            time.sleep(0.1)
        yield Dashboard(url, proc.pid)
    finally:
        proc.terminate()
        try:
            proc.wait(_STOP_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

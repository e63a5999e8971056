"""Profiles started in child processes: their state, their output, stopping them, and how far they got.

A :class:`Started` is what :meth:`dpprof.launch.Profile.start` returns. Its run id was chosen before the start
and given to the child (``--run-id``), so its run is the listing's row with that id: nothing is read out of the
child's output, and no run file is opened to find whose it is. Torch-free.
"""
from __future__ import annotations

import math
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dpprof.launch import Profile

__all__ = ["LaunchError", "Started", "progress_line", "run_row"]

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

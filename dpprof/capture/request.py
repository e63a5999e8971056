"""Asking a running run for a deep capture: ``dpprof capture RUN --steps N`` and the dashboard's button.

The asker writes a small request file in the reports directory (``.<run id>.capture-request.json``, a dot-name the
listing skips, store.files.capture_request_name); the recording process looks for it about once a second from a
thread of its own (dpprof.capture.session, never on the training thread), profiles the next N steps from the next
step boundary on, and writes its answer beside it (``.<run id>.capture-answer.json``): the steps captured and the
raw trace's name, or why there is none. Loads no torch: the CLI and the dashboard ask without it.

The ranks of a distributed run each read the request and must profile the same steps: the request names its first
step, the step after the furthest any rank has recorded plus what the ranks step through in LEAD_S (the time a rank
takes to see a request and a step to be on disk). Each rank answers in a file of its own
(``.<run id>.rank<N>.capture-answer.json``), and the asker waits for every rank's.

Example:
    >>> asked = ask(dpprof.load_run("20261126-040000-3fa9c1"), steps=5)  # doctest: +SKIP
    >>> wait_for_answer(asked, timeout_s=60).trace                          # doctest: +SKIP
    '20261126-040000-3fa9c1.capture-12-17.pt.trace.json.gz'
"""
from __future__ import annotations

import json
import math
import os
import socket
import time
import uuid
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from dpprof.capture.window import MAX_CAPTURE_STEPS, CaptureError
from dpprof.store.files import capture_answer_name, capture_request_name, remove_files
from dpprof.store.reader import RunFileError, StoredRun, read_run_file
from dpprof.store.status import pid_alive

__all__ = ["CaptureRequest", "CaptureAnswer", "ask", "wait_for_answer", "answer_to", "read_request", "write_answer",
           "ANSWER_POLL_S"]

LEAD_S = 4.0  # a distributed run's window starts this far ahead: a rank's request poll (1 s), its steps' commit (0.5 s)
MIN_LEAD_STEPS = 2
ANSWER_POLL_S = 0.2  # how often the asker looks for the answer: a person waiting notices ~0.2 s, the disk does not
STALE_REQUEST_S = 3600.0  # a request asked from another host is withdrawn after this (its asker cannot be seen)
_STATUS_EVERY_S = 2.0  # how often the asker reads the run's status, to say at once that it ended without answering


@dataclass(frozen=True)
class CaptureRequest:
    """A request written for a running run: which run, where, how many steps, and its own id (``nonce``)."""

    run_id: str
    directory: str
    steps: int
    nonce: str
    run_path: str
    first_step: int | None = None  # a distributed run's: the step every rank starts at
    ranks: tuple[int, ...] = ()  # a distributed run's ranks, each of which answers


@dataclass(frozen=True)
class CaptureAnswer:
    """The recorder's answer: steps ``first_step`` to ``end_step - 1`` captured into the raw trace ``trace`` (a file
    name in the reports directory) and the run, or ``error`` saying why not."""

    request: str
    first_step: int | None = None
    end_step: int | None = None
    trace: str | None = None
    error: str | None = None
    traces: tuple[str, ...] = ()  # a distributed run's: each rank's raw trace, in rank order


def _write_json(path: Path, value: dict[str, Any]) -> None:
    """Write ``value`` whole under ``path`` (a reader never sees half of it)."""
    part = path.with_name(path.name + ".part")
    part.write_text(json.dumps(value))
    os.replace(part, path)


def ask(run: StoredRun, steps: int) -> CaptureRequest:
    """Ask the running run ``run`` to capture its next ``steps`` steps.

    Raises:
        CaptureError: the run is not being recorded now (ended, or its process is gone), was imported from a trace
            rather than recorded by dpprof, or ``steps`` is out of range; or the request cannot be written (one
            line each).
    """
    if not 1 <= steps <= MAX_CAPTURE_STEPS:
        raise CaptureError(f"--steps {steps}: capture 1 to {MAX_CAPTURE_STEPS:,} steps")
    if run.meta.get("source") is not None:
        raise CaptureError(f"run {run.id} was imported from a trace, not recorded by dpprof: there is no recording "
                           "to capture from")
    if not run.live:
        raise CaptureError(f"run {run.id} is {run.meta.get('status')}, not running: only a run being recorded "
                           "can capture (use --capture A:B when starting one)")
    directory = run.path.parent
    request = CaptureRequest(run_id=run.id, directory=str(directory), steps=steps, nonce=uuid.uuid4().hex,
                             run_path=str(run.path))
    ranks = [r for r in run.meta.get("ranks") or [] if isinstance(r, int)]
    if run.meta.get("rank") is not None or len(run.paths) > 1:
        request = replace(request, first_step=_first_step_of_all(run), ranks=tuple(sorted(ranks)))
    path = directory / capture_request_name(run.id)
    value = {"request": request.nonce, "steps": steps, "first_step": request.first_step,
             "asked_at": datetime.now(timezone.utc).isoformat(), "pid": os.getpid(), "host": socket.gethostname()}
    try:
        if not _write_new(path, value):  # another asker's request is there
            pending = _pending(path)
            if pending is not None:
                raise CaptureError(f"run {run.id} has a capture request pending already ({pending}): wait for its "
                                   "answer, then ask again")
            remove_files(str(path))  # its asker is gone: the request is withdrawn
            if not _write_new(path, value):
                raise CaptureError(f"run {run.id} has a capture request pending already: wait for its answer, then "
                                   "ask again")
    except OSError as err:
        raise CaptureError(f"cannot write the capture request in {directory}: {err.strerror or err}") from None
    answers = [directory / capture_answer_name(run.id, r) for r in request.ranks or [None]]
    remove_files(*(str(a) for a in answers if _answered(a) != request.nonce))  # earlier answers: never read
    return request


def _write_new(path: Path, value: dict[str, Any]) -> bool:
    """Write ``value`` whole under ``path`` unless a file of that name is there (False then): a reader never sees
    half of it, and of two askers at once one gets the name."""
    part = path.with_name(f"{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.part")
    part.write_text(json.dumps(value))
    try:
        os.link(part, path)
    except FileExistsError:
        return False
    finally:
        os.unlink(part)
    return True


def _pending(path: Path) -> str | None:
    """Who asked the request at ``path`` ("process 123 on host, at 12:01:02"), or None where that asker is gone (its
    process on this host ended; on another host, asked over STALE_REQUEST_S ago) or the file is no request."""
    try:
        value = json.loads(path.read_text())
        pid, host, asked = value.get("pid"), value.get("host"), datetime.fromisoformat(value["asked_at"])
        age = (datetime.now(timezone.utc) - asked).total_seconds()  # a time with no zone: no request of ours
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None
    if (pid_alive(pid) if host == socket.gethostname() else age < STALE_REQUEST_S):
        return f"asked by process {pid} on {host} at {asked:%H:%M:%S}"
    return None


def _first_step_of_all(run: StoredRun) -> int:
    """The step a distributed run's ranks can all start a window at: past the furthest any has recorded by the
    steps they take in LEAD_S (their median step of late), at least MIN_LEAD_STEPS."""
    steps = run.steps
    if steps.empty:
        return MIN_LEAD_STEPS
    recent = steps[steps["step"] >= steps["step"].max() - 20]["duration_ms"].dropna()
    step_s = float(recent.median()) / 1e3 if len(recent) else 0.0
    lead = MIN_LEAD_STEPS if step_s <= 0 else max(MIN_LEAD_STEPS, math.ceil(LEAD_S / step_s))
    return int(steps["step"].max()) + 1 + lead


def wait_for_answer(request: CaptureRequest, timeout_s: float | None = None) -> CaptureAnswer:
    """Wait for the answer to ``request``; the request and answer files are removed once it is read.

    Raises:
        CaptureError: the run ended, or ``timeout_s`` passed, without an answer (the request is withdrawn).
    """
    directory = Path(request.directory)
    answer_paths = [directory / capture_answer_name(request.run_id, r) for r in request.ranks or [None]]
    start = last_status = time.monotonic()
    try:
        while True:
            answer = answer_to(request)
            if answer is not None:
                return answer
            now = time.monotonic()
            if now - last_status >= _STATUS_EVERY_S:
                last_status = now
                status = _status(request.run_path)
                if status != "running" and answer_to(request) is None:
                    raise CaptureError(f"run {request.run_id} ended ({status}) before it captured the steps asked")
            if timeout_s is not None and now - start > timeout_s:
                raise CaptureError(f"run {request.run_id} did not capture {request.steps} steps in {timeout_s:g} s "
                                   "(its steps are slower than that, or it stopped stepping); the request is withdrawn")
            time.sleep(ANSWER_POLL_S)
    finally:  # its own request and answers only: another asker's may be there once this one's is withdrawn
        mine = read_request(directory, request.run_id)
        if mine is not None and mine[0] == request.nonce:
            remove_files(str(directory / capture_request_name(request.run_id)))
        remove_files(*(str(p) for p in answer_paths if _answered(p) == request.nonce))


def answer_to(request: CaptureRequest) -> CaptureAnswer | None:
    """The answer to ``request`` if the run (every rank of a distributed run) has written it, without waiting (a
    page that re-reads every few seconds); None until then. A distributed run's answer is its ranks' together: their
    traces in rank order, or each failing rank's error."""
    directory = Path(request.directory)
    answers = [_read_answer(directory / capture_answer_name(request.run_id, r)) for r in request.ranks or [None]]
    if any(a is None or a.request != request.nonce for a in answers):
        return None
    if not request.ranks:
        return answers[0]
    failed = [f"rank {r}: {a.error}" for r, a in zip(request.ranks, answers) if a is not None and a.error]
    if failed:
        return CaptureAnswer(request=request.nonce, error="; ".join(failed))
    first = answers[0]
    assert first is not None
    return CaptureAnswer(request=request.nonce, first_step=first.first_step, end_step=first.end_step,
                         trace=first.trace, traces=tuple(a.trace for a in answers if a is not None and a.trace))


def _status(run_path: str) -> str:
    try:
        return str(read_run_file(run_path)[0].get("status"))
    except (RunFileError, OSError):
        return "gone"


def _answered(path: Path) -> str | None:
    """The request the answer at ``path`` answers (its nonce); None where there is no answer."""
    answer = _read_answer(path)
    return answer.request if answer is not None else None


def _read_answer(path: Path) -> CaptureAnswer | None:
    try:
        value = json.loads(path.read_text())
        return CaptureAnswer(**{k: value.get(k) for k in ("request", "first_step", "end_step", "trace", "error")})
    except (OSError, ValueError, TypeError):
        return None


def read_request(directory: str | os.PathLike[str], run_id: str) -> tuple[str, int, int | None] | None:
    """The request for run ``run_id`` waiting in ``directory``: its nonce, steps and first step (a distributed
    run's; None: the next step); None where there is none or it is not a request (the recorder's side; a bad file
    is ignored, never an error in training)."""
    try:
        value = json.loads((Path(directory) / capture_request_name(run_id)).read_text())
        nonce, steps, first = value["request"], value["steps"], value.get("first_step")
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None
    if not isinstance(nonce, str) or not _count(steps) or not (first is None or _count(first)):
        return None
    return nonce, steps, first


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def write_answer(directory: str | os.PathLike[str], run_id: str, answer: CaptureAnswer, rank: int | None = None
                 ) -> None:
    """The recorder's (or one rank's) answer to a request, written whole beside it (an unwritable directory is
    ignored: the asker times out and says so)."""
    try:
        _write_json(Path(directory) / capture_answer_name(run_id, rank), asdict(answer))
    except OSError:
        pass

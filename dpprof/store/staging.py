"""Runs bound for a network or FUSE filesystem: recorded on local disk, moved into the reports directory whole.

SQLite's write-ahead log needs memory shared on one host, which a network filesystem does not give
(dpprof.store.filesystems). A run whose reports directory is on one is written in a local staging
directory ($DPPROF_STAGING_DIR, else ``dpprof-staging-<uid>`` in the temp directory) and, when it
closes, copied beside its destination under a hidden name and given its own name only whole, never
over an existing file; the local copy then goes. Until then the run is not listed.

Beside each staged run lies ``<run file>.dest.json``, naming its destination and locked (flock) by the
recording process while it lives. A staged run its process left behind (SIGKILL, a move that failed)
stays on local disk, and the next recording on this host moves it into place: the lock is free once
its process is gone. $DPPROF_NETWORK_FS=direct records in place anyway, =stage stages on any filesystem.
"""
from __future__ import annotations

import filecmp
import json
import logging
import os
import sqlite3
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dpprof.store import filesystems
from dpprof.store.faults import RecordingError, cause_of, start_failure
from dpprof.store.publish import recover
from dpprof.store.files import (SIDE_FILES, STAGING_ENV, fold_log, hidden_name, lock_if_free, move_into_place,
                                remove_files, staging_dir, sweep_leftovers)
from dpprof.store.writer import SqliteSink, create_run_file

try:
    import fcntl
except ImportError:  # Windows: no flock, so a staged run left behind is not moved by the next recording
    fcntl = None  # type: ignore[assignment]

__all__ = ["Staging", "StagedSink", "staging_for", "staging_dir", "open_sink", "move_into_place",
           "move_leftover_runs", "check_reports_dir", "MODE_ENV", "STAGING_ENV"]

MODE_ENV = "DPPROF_NETWORK_FS"  # auto: stage on a network or FUSE filesystem; stage: always; direct: never
MODES = ("auto", "stage", "direct")
DESTINATION_SUFFIX = ".dest.json"  # beside a staged run: where it goes, locked while its process records

log = logging.getLogger("dpprof")


@dataclass(frozen=True)
class Staging:
    """Runs for ``reports`` are written in ``directory`` on local disk first; ``filesystem`` is the reason
    (None where $DPPROF_NETWORK_FS=stage asked for it)."""

    reports: Path
    directory: Path
    filesystem: filesystems.Filesystem | None

    def why(self, subject: str | None = None) -> str:
        """Why runs are staged: "DIR is on nfs, where ..." (``subject`` instead of DIR), or the setting."""
        if self.filesystem is None:
            return f"{MODE_ENV}=stage"
        return f"{subject or self.reports} is on {self.filesystem.type}, where SQLite's write-ahead log is not safe"

    def start_line(self, staged: str | os.PathLike[str]) -> str:
        """The one line a recording says when it starts staged."""
        line = (f"{self.why()}: recording in {staged} on local disk and moving the run into {self.reports} when "
                f"it closes (dpprof runs and the dashboard list it from then")
        return line + (f"; {MODE_ENV}=direct records in place)" if self.filesystem is not None else ")")

    def refusal(self, cause: str) -> RecordingError:
        """The error for a run that must be staged and cannot be: it names the settings that make it work."""
        return RecordingError(f"cannot record in {self.reports}: {self.why('it')}, and the staging directory "
                              f"{self.directory} {cause}: set {STAGING_ENV} to a directory on local disk, or "
                              f"{MODE_ENV}=direct to record in place")


def staging_for(reports: str | os.PathLike[str]) -> Staging | None:
    """Where runs for ``reports`` are staged; None where they are written in place.

    Raises:
        RecordingError: they must be staged and the staging directory cannot be used (one line naming
            $DPPROF_STAGING_DIR and $DPPROF_NETWORK_FS), or $DPPROF_NETWORK_FS has no known value.
    """
    reports = Path(reports)
    mode = os.environ.get(MODE_ENV, "").strip().lower() or "auto"
    if mode not in MODES:
        raise RecordingError(f"cannot record in {reports}: {MODE_ENV}={os.environ[MODE_ENV]} is none of "
                             f"{', '.join(MODES)}")
    if mode == "direct":
        return None
    fs = filesystems.filesystem_of(reports)
    if mode == "auto" and not fs.network:
        return None
    staging = Staging(reports, staging_dir(), fs if fs.network else None)
    _check(staging)
    return staging


def _check(staging: Staging) -> None:
    directory = staging.directory
    where = filesystems.filesystem_of(directory)
    if where.network:
        raise staging.refusal(f"is on {where.type} too")
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        chosen = bool(os.environ.get(STAGING_ENV))
        if not chosen and hasattr(os, "getuid") and directory.stat().st_uid != os.getuid():
            raise staging.refusal("is another user's")  # its name in a shared temp directory can be taken by anyone
        probe = directory / f".probe-{os.getpid()}"
        os.close(os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        probe.unlink()
    except OSError as err:
        raise staging.refusal(f"cannot be used ({cause_of(err)})") from None


class StagedSink(SqliteSink):
    """A SqliteSink whose run file is written in the staging directory and moved to ``destination`` at close.

    Attributes:
        path: where the run file is: staged until it is moved, then ``destination``.
        stays: after close, the line saying where the run stays on local disk if it could not be moved.
    """

    def __init__(self, destination: str, staging: Staging, run_row: dict[str, Any], **kwargs: Any) -> None:
        self.destination = destination
        self._target = os.path.abspath(destination)  # where it goes, whatever the working directory is at close
        self.staging = staging
        self.stays: str | None = None
        staged = str(staging.directory / os.path.basename(destination))
        try:
            self._lock = _claim(staged, self._target)  # for whichever process moves it
        except OSError as err:
            raise staging.refusal(f"cannot be used ({cause_of(err)})") from None
        try:
            super().__init__(staged, run_row, **kwargs)
        except RecordingError as err:
            _release(self._lock, staged)
            cause = str(err).removeprefix(f"cannot record in {staging.directory}: ")
            raise staging.refusal(f"cannot be used ({cause})") from None

    def close(self, steps_total: int | None = None) -> None:
        """Close the run file, then move it into the reports directory whole."""
        try:
            super().close(steps_total)
        finally:
            self._move()

    def _move(self) -> None:
        staged = self.path
        if self.removed or self.lost or not os.path.exists(staged):  # no run file to move
            _release(self._lock, staged)
            return
        try:
            if not self.folded:  # its write-ahead log is still beside it (a reader, a full disk)
                raise sqlite3.OperationalError("its write-ahead log could not be folded back into it")
            move_into_place(staged, self._target)
        except (OSError, sqlite3.Error) as err:  # the run stays whole on local disk; the lock stays ours
            self.stays = (f"the run stays on local disk in {staged} (moving it into {self.staging.reports}: "
                          f"{cause_of(err)}); the first recording on this host after this process ends moves it")
            return
        self.path = self.destination
        if self.message is not None:
            self.message = self.message.replace(staged, self.destination)
        _release(self._lock, staged)


def open_sink(path: str, run_row: dict[str, Any], **kwargs: Any) -> SqliteSink:
    """The sink for a new run file at ``path``: staged on local disk, saying so in one line, where its
    directory is on a network or FUSE filesystem; first, staged runs left behind are moved into place, and what
    imports and merges killed in the directory left is finished (dpprof.store.publish.recover)."""
    move_leftover_runs()
    recover(os.path.dirname(path) or ".")  # imports and merges killed here: their runs published whole, or removed
    for name in sweep_leftovers(os.path.dirname(path) or "."):  # half-built files of processes killed long ago
        log.warning("dpprof: removed %s, left in %s by a process killed while writing it", name,
                    os.path.dirname(path) or ".")
    staging = staging_for(os.path.dirname(path) or ".")
    if staging is None:
        return SqliteSink(path, run_row, **kwargs)
    sink = StagedSink(path, staging, run_row, **kwargs)
    log.warning("dpprof: %s", staging.start_line(sink.path))
    return sink


def _claim(staged: str, destination: str) -> int:
    """Write ``staged``'s destination beside it, locked while this process lives; returns the lock's descriptor.
    The file is locked before it gets its name, so no other process sees it unlocked."""
    sidecar = staged + DESTINATION_SUFFIX
    built = os.path.join(os.path.dirname(sidecar), f".{os.path.basename(sidecar)}.{os.getpid()}")
    fd = os.open(built, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        if fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(fd, json.dumps({"destination": destination, "pid": os.getpid()}).encode())
        os.fsync(fd)
        os.rename(built, sidecar)
    except BaseException:
        os.close(fd)
        remove_files(built)
        raise
    return fd


def _release(lock: int, staged: str) -> None:
    """The staged run is moved or gone: remove its destination file, then let go of the lock."""
    remove_files(staged + DESTINATION_SUFFIX)
    os.close(lock)


def move_leftover_runs(directory: str | os.PathLike[str] | None = None) -> list[Path]:
    """Move into place the staged runs whose process ended before moving them (SIGKILL, a failed move).

    A run still recording is never touched, nor a file at its destination: a different file there keeps
    the staged run on local disk. Each run moved, or left for a reason, is one line on the dpprof logger.

    Returns:
        where the runs moved now are.
    """
    directory = Path(directory) if directory is not None else staging_dir()
    if fcntl is None or not directory.is_dir():
        return []
    moved = []
    for sidecar in sorted(directory.glob(f"*{DESTINATION_SUFFIX}")):
        if sidecar.name.startswith("."):
            continue
        lock = lock_if_free(sidecar)
        if lock is None:
            continue
        try:
            destination = _left_over(sidecar, lock)
            if destination is not None:
                moved.append(destination)
        finally:
            os.close(lock)
    return moved


def _left_over(sidecar: Path, lock: int) -> Path | None:
    staged = str(sidecar)[:-len(DESTINATION_SUFFIX)]
    try:
        with os.fdopen(os.dup(lock), encoding="utf-8") as f:
            destination = json.load(f)["destination"]
    except (OSError, ValueError, KeyError, TypeError):
        return None  # not ours to read: leave it
    if not os.path.exists(staged):  # moved; its process ended before removing this
        remove_files(str(sidecar))
        return None
    try:
        fold_log(staged)
        move_into_place(staged, destination)
    except FileExistsError:
        if not filecmp.cmp(staged, destination, shallow=False):
            log.warning("dpprof: a run left on local disk in %s stays there: %s is another file", staged, destination)
            return None
        remove_files(staged)  # its process moved it and ended before removing the local copy
    except (OSError, sqlite3.Error) as err:
        log.warning("dpprof: a run left on local disk in %s stays there: moving it into %s: %s", staged,
                    os.path.dirname(destination), cause_of(err))
        return None
    else:
        log.warning("dpprof: moved %s, a run its process left on local disk, into %s", os.path.basename(staged),
                    destination)
    remove_files(*(staged + s for s in SIDE_FILES), str(sidecar))
    return Path(destination)


def check_reports_dir(directory: str | os.PathLike[str]) -> None:
    """Raise RecordingError, with the line a run would give, if a run cannot be created in ``directory``.

    For a caller that starts a recording elsewhere (the dashboard starting ``dpprof profile``): it
    makes the directory and an empty run file under a hidden name, the way a run does, then removes it.
    On a network or FUSE filesystem the run file is made in the staging directory (dpprof.store.staging)
    and only a plain file in ``directory``, where the run is moved at close.
    """
    directory = os.fspath(directory)
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as err:
        raise start_failure(directory, err) from None
    staging = staging_for(directory)  # raises where runs must be staged and cannot be
    where = str(staging.directory) if staging is not None else directory
    probe = os.path.join(where, f"probe-{os.getpid()}-{threading.get_ident()}.sqlite")
    try:
        create_run_file(hidden_name(probe), {"id": "probe", "status": "probe"}).close()
    except (sqlite3.Error, OSError) as err:
        if staging is not None:
            raise staging.refusal(f"cannot be used ({cause_of(err)})") from None
        raise start_failure(directory, err) from None
    finally:
        remove_files(hidden_name(probe), *(hidden_name(probe) + s for s in SIDE_FILES))
    if staging is not None:  # where the run is moved at close: a plain file, as the move makes
        moved = hidden_name(os.path.join(directory, os.path.basename(probe)))
        try:
            os.close(os.open(moved, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        except OSError as err:
            raise start_failure(directory, err) from None
        remove_files(moved)

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

import errno
import filecmp
import json
import logging
import os
import shutil
import sqlite3
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dpprof.store import filesystems
from dpprof.store.faults import RecordingError, cause_of
from dpprof.store.publish import recover
from dpprof.store.files import SIDE_FILES, hidden_name, lock_if_free, publish_file, remove_files
from dpprof.store.writer import SqliteSink

try:
    import fcntl
except ImportError:  # Windows: no flock, so a staged run left behind is not moved by the next recording
    fcntl = None  # type: ignore[assignment]

__all__ = ["Staging", "StagedSink", "staging_for", "staging_dir", "open_sink", "move_into_place",
           "move_leftover_runs", "MODE_ENV", "STAGING_ENV"]

MODE_ENV = "DPPROF_NETWORK_FS"  # auto: stage on a network or FUSE filesystem; stage: always; direct: never
STAGING_ENV = "DPPROF_STAGING_DIR"
MODES = ("auto", "stage", "direct")
DESTINATION_SUFFIX = ".dest.json"  # beside a staged run: where it goes, locked while its process records

log = logging.getLogger("dpprof")


def staging_dir() -> Path:
    """Where runs are staged: $DPPROF_STAGING_DIR, else this user's ``dpprof-staging-<uid>`` in the temp directory."""
    if os.environ.get(STAGING_ENV):
        return Path(os.environ[STAGING_ENV])
    user = os.getuid() if hasattr(os, "getuid") else os.environ.get("USERNAME", "user")
    return Path(tempfile.gettempdir()) / f"dpprof-staging-{user}"


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
    staging = staging_for(os.path.dirname(path) or ".")
    if staging is None:
        return SqliteSink(path, run_row, **kwargs)
    sink = StagedSink(path, staging, run_row, **kwargs)
    log.warning("dpprof: %s", staging.start_line(sink.path))
    return sink


def move_into_place(src: str | os.PathLike[str], dest: str | os.PathLike[str]) -> None:
    """Give the whole run file ``src`` the name ``dest``, on another filesystem too, never over an existing file.

    On one filesystem it is linked (or renamed). Across filesystems it is copied beside ``dest`` under a
    hidden name, flushed to disk and given its name only whole; then ``src`` is removed.

    Raises:
        FileExistsError: ``dest`` exists (nothing changed).
        OSError, sqlite3.Error: it could not be copied (``src`` stays, nothing is left beside ``dest``).
    """
    src, dest = os.fspath(src), os.fspath(dest)
    os.makedirs(os.path.dirname(dest) or ".", exist_ok=True)
    try:
        publish_file(src, dest)
        return
    except OSError as err:
        if err.errno != errno.EXDEV:
            raise
    built = hidden_name(dest)
    try:
        _copy(src, built)
        publish_file(built, dest)
    except BaseException:
        remove_files(built)
        raise
    remove_files(src)


def _copy(src: str, dest: str) -> None:
    """Copy a run file byte for byte under SQLite's read lock (no write changes it meanwhile; a crashed
    transaction is rolled back first), and flush the copy to disk."""
    con = sqlite3.connect(src, timeout=30)
    try:
        con.execute("BEGIN")
        if con.execute("PRAGMA journal_mode").fetchone()[0] == "wal":
            raise sqlite3.OperationalError("its write-ahead log could not be folded back into it")
        con.execute("SELECT count(*) FROM sqlite_master").fetchone()  # takes the read lock
        with open(src, "rb") as f, open(dest, "wb") as out:
            shutil.copyfileobj(f, out, 1 << 20)
            out.flush()
            os.fsync(out.fileno())
    finally:
        con.close()


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
        _fold(staged)
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


def _fold(path: str) -> None:
    """Fold a left-behind run's write-ahead log back into it, so that the file alone is the whole run."""
    con = sqlite3.connect(path, timeout=5)
    try:
        con.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        if con.execute("PRAGMA journal_mode=DELETE").fetchone()[0] != "delete":
            raise sqlite3.OperationalError("its write-ahead log could not be folded back into it")
    finally:
        con.close()

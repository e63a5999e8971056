"""What a failed write means: the cause of a storage error in a few words, and the one line the user reads.

A write to the reports directory can fail before a run starts (the directory is read-only,
missing, not ours, or the disk is full) or while it records (the disk fills). Either way the
user reads one line naming the place and the cause, never a traceback.
"""
from __future__ import annotations

import errno
import os
import shutil
import sqlite3

from dpprof.store import filesystems
from dpprof.units import plural

__all__ = ["symlink_loop", "RunFileError", "RecordingError", "cause_of", "is_disk_full", "start_failure", "failure_line", "DISK_FULL", "STORAGE_CAUSES"]

DISK_FULL = "disk full"

QUOTA_EXCEEDED = "disk quota exceeded"

_ERRNO_CAUSES = {
    errno.ENOSPC: DISK_FULL,
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
    errno.ENOENT: "no such directory",
    errno.ENOTDIR: "not a directory",
    errno.EIO: "input/output error",
}
if hasattr(errno, "EDQUOT"):  # not on every platform
    _ERRNO_CAUSES[errno.EDQUOT] = QUOTA_EXCEEDED
# SQLite's primary result codes (sqlite3.h) for the failures a reports directory can meet
_SQLITE_CAUSES = {
    13: DISK_FULL,  # SQLITE_FULL
    8: "read-only file system",  # SQLITE_READONLY
    3: "permission denied",  # SQLITE_PERM
    23: "permission denied",  # SQLITE_AUTH
}
SQLITE_IOERR = 10  # sqlite3.h: "some kind of disk I/O error occurred"
# Less than this free beside a file whose write failed with SQLITE_IOERR: the disk is full (one commit of a busy run
# is hundreds of KB; dpprof.store.status's FULL_DISK_FREE_BYTES infers a full disk the same way)
NEARLY_FULL_BYTES = 1 << 20
# What ``cause_of`` says of a storage failure (the disk, the filesystem); anything else is about the data written
STORAGE_CAUSES = frozenset({*_ERRNO_CAUSES.values(), *_SQLITE_CAUSES.values()})


class RunFileError(Exception):
    """A file in reports/ that cannot be read as a dpprof run; the message says why."""


class RecordingError(Exception):
    """A run could not be recorded in its reports directory; the message says where and why, in one line.

    Attributes:
        path: the directory (or file) it could not write, where known.
        cause: why, in a few words (``cause_of``), where known.
    """

    def __init__(self, message: str, path: str | None = None, cause: str | None = None) -> None:
        super().__init__(message)
        self.path = path
        self.cause = cause


def cause_of(err: BaseException, where: str | os.PathLike[str] | None = None) -> str:
    """A storage error in a few words: "disk full", "read-only file system", "permission denied", ...

    SQLite says "disk I/O error" when a full disk stops a write it makes through a mapping (its write-ahead log's
    index, a file's growth on tmpfs): with ``where`` (the file or directory written), that error on a disk with
    less than NEARLY_FULL_BYTES free is "disk full", the actual problem.
    """
    if isinstance(err, OSError) and err.errno == errno.ENOENT and where is not None:
        made = filesystems.nothing_made_in(where)  # /proc is there: "no such directory" would send the user looking
        if made is not None:
            return made
    if isinstance(err, OSError) and err.errno in _ERRNO_CAUSES:
        return _ERRNO_CAUSES[err.errno]
    if isinstance(err, sqlite3.Error):
        code = getattr(err, "sqlite_errorcode", None)
        if code is not None and code & 0xFF in _SQLITE_CAUSES:
            return _SQLITE_CAUSES[code & 0xFF]
        if code is not None and code & 0xFF == SQLITE_IOERR and where is not None and _nearly_full(where):
            return DISK_FULL
        return str(err) or type(err).__name__
    if isinstance(err, OSError) and err.strerror:
        return err.strerror.lower()
    return str(err) or type(err).__name__


def _nearly_full(where: str | os.PathLike[str]) -> bool:
    path = os.fspath(where)
    while path and not os.path.isdir(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    try:
        return shutil.disk_usage(path or ".").free < NEARLY_FULL_BYTES
    except OSError:
        return False


def is_disk_full(err: BaseException, where: str | os.PathLike[str] | None = None) -> bool:
    return cause_of(err, where) in (DISK_FULL, QUOTA_EXCEEDED)


def symlink_loop(path: str | os.PathLike[str]) -> str | None:
    """"a symlink loop (it points to TARGET)" where following ``path`` never ends (ELOOP); None otherwise."""
    try:
        os.stat(path)
    except OSError as err:
        if err.errno == errno.ELOOP:
            try:
                return f"a symlink loop (it points to {os.readlink(path)})"
            except OSError:  # the loop is in a directory above it
                return "behind a symlink loop"
    return None


def start_failure(directory: str | os.PathLike[str], err: BaseException) -> RecordingError:
    """The error for a run that could not start: "cannot record in DIR: CAUSE"."""
    cause = cause_of(err, directory)
    if isinstance(err, FileExistsError) and not os.path.isdir(directory):
        loop = symlink_loop(directory)  # else the reports directory's own path is a file
        cause = f"{loop}, not a directory" if loop else "not a directory"
    return RecordingError(f"cannot record in {os.fspath(directory)}: {cause}", os.fspath(directory), cause)


def failure_line(cause: str, path: str, steps_kept: int, steps_total: int | None) -> str:
    """"disk full after 212 steps: 212 steps kept in PATH, 188 not recorded"."""
    line = f"{cause} after {plural(steps_kept, 'step')}: {plural(steps_kept, 'step')} kept in {path}"
    if steps_total is not None and steps_total > steps_kept:
        line += f", {steps_total - steps_kept:,} not recorded"
    return line

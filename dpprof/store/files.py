"""Run files on disk: their names, the files SQLite keeps beside them, and giving a file its name only whole.

Shared by the writer, the staging of runs bound for network filesystems, the publisher of imports and the readers,
below all of them.
"""
from __future__ import annotations

import errno
import os
import re
import shutil
import sqlite3
import tempfile
import time
from pathlib import Path

__all__ = ["SIDE_FILES", "RANK_FILE", "CAPTURE_TRACE", "capture_trace_name", "is_capture_trace", "capture_request_name",
           "capture_answer_name", "hidden_name", "remove_files", "publish_file", "run_signature",
           "dir_signature", "lock_if_free", "move_into_place", "staging_dir", "STAGING_ENV", "LEFTOVER_AGE_S",
           "sweep_leftovers", "fold_log"]

SQLITE_HEADER = b"SQLite format 3\x00"  # the first 16 bytes of every SQLite database
SIDE_FILES = ("-wal", "-shm", "-journal")  # SQLite's write-ahead log, its shared memory and its rollback journal
RANK_FILE = re.compile(r"^(.+)\.rank(\d+)\.sqlite$")  # <run id>.rank<N>.sqlite: one rank of a distributed run
STAGING_ENV = "DPPROF_STAGING_DIR"  # where runs bound for a network filesystem are staged (dpprof.store.staging)
# A deep capture's raw trace, beside its run for Perfetto: <run file without .sqlite>.capture-<A>-<B>.pt.trace.json.gz
# (steps A to B-1). Named after the run file, so that whatever takes a run's files by its id (run_signature's glob)
# takes it too; ending in .json.gz, the run listing never opens it as a run, and a directory given to `dpprof import`
# leaves it out (its steps are in the run already); named alone, it imports as any trace does.
CAPTURE_TRACE = re.compile(r"^(.+)\.capture-(\d+)-(\d+)\.pt\.trace\.json\.gz$")
_NO_HARD_LINKS = {errno.EPERM, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK, errno.ENOSYS}


def capture_trace_name(run_file: str, first_step: int, end_step: int) -> str:
    """The name of the raw trace of steps ``first_step`` to ``end_step - 1`` captured in the run file ``run_file``."""
    stem = os.path.basename(run_file).removesuffix(".sqlite")
    return f"{stem}.capture-{first_step}-{end_step}.pt.trace.json.gz"


def is_capture_trace(name: str) -> bool:
    """Whether a file name is a deep capture's raw trace (CAPTURE_TRACE)."""
    return CAPTURE_TRACE.match(name) is not None


def capture_request_name(run_id: str) -> str:
    """The file ``dpprof capture`` writes in the reports directory to ask a running run for a capture: a dot-name,
    so the listing skips it."""
    return f".{run_id}.capture-request.json"


def capture_answer_name(run_id: str, rank: int | None = None) -> str:
    """The file a running run (or one rank of it) writes beside its request once the capture it asked for is stored
    (or failed)."""
    return f".{run_id}{'' if rank is None else f'.rank{rank}'}.capture-answer.json"


def hidden_name(path: str) -> str:
    """Where a file is built before it appears under ``path``: a dot-name the listing skips."""
    directory, name = os.path.split(path)
    return os.path.join(directory, f".{name}.part")


# A file dpprof builds under a hidden name (a run file or a capture's raw trace before it takes its name, an answer to
# a capture request) lives seconds, minutes for the largest capture; one this old was left by a killed process
LEFTOVER_AGE_S = 6 * 3600.0
_LEFTOVER = re.compile(r"^\..+(?:\.sqlite\.part|\.capture-\d+-\d+\.pt\.trace\.json\.gz|\.capture-answer\.json)$")


def sweep_leftovers(directory: str | os.PathLike[str], now: float | None = None) -> list[str]:
    """Remove the hidden files killed processes left in ``directory`` (a run file or a capture's raw trace half built,
    an answer no asker read), each over LEFTOVER_AGE_S old; returns their names. Never a run, never a young file."""
    now = time.time() if now is None else now
    removed: list[str] = []
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return removed
    for entry in entries:
        try:
            if _LEFTOVER.match(entry.name) and entry.is_file(follow_symlinks=False) and \
                    now - entry.stat(follow_symlinks=False).st_mtime > LEFTOVER_AGE_S:
                os.unlink(entry.path)
                removed.append(entry.name)
        except OSError:
            continue  # gone meanwhile, or not ours to remove
    return removed


def fold_log(path: str | os.PathLike[str]) -> None:
    """Fold a run file's write-ahead log back into it, so that the file alone is the whole run.

    Raises:
        sqlite3.Error: the log could not be folded (a reader holds it, the disk is full).
    """
    con = sqlite3.connect(path, timeout=5)
    try:
        con.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        if con.execute("PRAGMA journal_mode=DELETE").fetchone()[0] != "delete":
            raise sqlite3.OperationalError("its write-ahead log could not be folded back into it")
    finally:
        con.close()


def remove_files(*paths: str) -> None:
    """Remove each of ``paths`` that exists; one that cannot be removed is left."""
    for p in paths:
        try:
            os.unlink(p)
        except OSError:
            pass


def publish_file(built: str, path: str) -> None:
    """Give a whole file its name, never over an existing one."""
    try:
        os.link(built, path)  # fails if ``path`` exists: the name is claimed atomically
    except OSError as err:
        if err.errno not in _NO_HARD_LINKS:
            raise
        if os.path.exists(path):
            raise FileExistsError(errno.EEXIST, "file exists", path) from None
        os.rename(built, path)
    else:
        os.unlink(built)


def run_signature(path: Path, run_id: str) -> tuple[tuple[str, int, int], ...]:
    """Name, modification time and size of a run's files (every rank's of a distributed run, a copy's own file)
    and of their write-ahead logs: it changes whenever a writer commits (a cache key for what is read of the run)."""
    out = []
    for p in sorted(path.parent.glob(f"{run_id}*")):
        try:
            s = p.stat()
            out.append((p.name, s.st_mtime_ns, s.st_size))
        except OSError:  # gone between the glob and the stat
            continue
    return tuple(out)


def dir_signature(directory: Path) -> tuple[tuple[str, int, int], ...]:
    """Name, modification time and size of every entry of a reports directory (0, 0 for one gone or unreadable
    since the scan): it changes whenever a run file or a staging directory appears, grows or goes."""
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return ()
    out = []
    for e in entries:
        try:
            st = e.stat()
            out.append((e.name, st.st_mtime_ns, st.st_size))
        except OSError:
            out.append((e.name, 0, 0))
    return tuple(sorted(out))


def lock_if_free(path: Path) -> int | None:
    """An exclusive lock on ``path`` (a staged run's or staging directory's owner file) where no process holds one:
    its descriptor, for the command taking over what a gone process left; None while a process holds it, or where
    the file is gone or was removed (by the process itself) while this one waited. Needs fcntl (POSIX)."""
    import fcntl

    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if os.fstat(fd).st_nlink == 0:  # moved and removed by its process while this one waited
            raise BlockingIOError
    except OSError:
        os.close(fd)
        return None
    return fd


def staging_dir() -> Path:
    """Where runs are staged: $DPPROF_STAGING_DIR, else this user's ``dpprof-staging-<uid>`` in the temp directory."""
    if os.environ.get(STAGING_ENV):
        return Path(os.environ[STAGING_ENV])
    user = os.getuid() if hasattr(os, "getuid") else os.environ.get("USERNAME", "user")
    return Path(tempfile.gettempdir()) / f"dpprof-staging-{user}"


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
        _copy_run_file(src, built)
        publish_file(built, dest)
    except BaseException:
        remove_files(built)
        raise
    remove_files(src)


def _copy_run_file(src: str, dest: str) -> None:
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

"""Run files built out of sight and published whole: a kill at any instant leaves no run, or one that says it is
incomplete, never one listed as finished with some of its files.

A command that writes several run files at once (``dpprof import`` of a job's traces, ``dpprof merge``) builds
them in a hidden staging directory, ``.import-<run id>`` or ``.merge-<token>``, in the reports directory (on local
disk where that is on a network filesystem: dpprof.store.staging). Inside lies ``owner.json`` (the process's id,
host and the reports directory), locked (flock) while the process lives. The directory is made under another name
(``.claim.import-<run id>``) and gets its own only once that file is in it, locked, so a staging directory without
an owner file has no process (one killed while removing it). Once every file is whole the process
writes ``ready.json`` naming them, then gives each its name in the reports directory, never over another file.
Each rank file of a distributed run says how many files the run has (a recording's ``world_size``, an imported
run's trace files), so the listing shows a run holding fewer as incomplete, with the count
(dpprof.store.reader), while it is being published and after a kill.

A staging directory whose process is gone (SIGKILL, a power cut) is finished by the next command that writes to
the reports directory (``recover``: ``dpprof import``, ``merge``, ``profile``, any recording): with ``ready.json``
the files not yet published are published, and the run is whole; without it nothing of it was published, and it
is removed. Until then ``list_runs`` lists it (``interrupted``) as an interrupted import or merge with the reason.
A staging directory whose process lives is never touched, nor any file outside staging directories. A claim
directory left by a process killed while claiming holds no run file; the next command writing there removes it.
"""
from __future__ import annotations

import filecmp
import json
import logging
import os
import shutil
import socket
import time
from pathlib import Path
from types import TracebackType
from typing import Any

from dpprof.store.files import lock_if_free, move_into_place, staging_dir
from dpprof.store.status import pid_alive

try:
    import fcntl
except ImportError:  # Windows: no flock; a staging directory's process is then judged by its pid
    fcntl = None  # type: ignore[assignment]

__all__ = ["CLAIM_PREFIX", "OWNER_FILE", "READY_FILE", "STAGE_KINDS", "UNCLAIMED_GRACE_S", "Stage", "interrupted", "recover"]

STAGE_KINDS = {".import-": "import", ".merge-": "merge"}  # staging directory name prefix -> the command
CLAIM_PREFIX = ".claim"  # a staging directory being claimed: ".claim" + its name, until its owner file is in it
OWNER_FILE = "owner.json"  # who builds the staging directory; locked while that process lives
READY_FILE = "ready.json"  # written once every file is whole: from then on the files are published, never dropped
# A claim directory gets its locked owner file a moment after it is made (two system calls); one older than this
# without it was left by a process killed in between. A minute is far beyond any such moment, even on a loaded
# machine.
UNCLAIMED_GRACE_S = 60.0

log = logging.getLogger("dpprof")


def _write_json(path: Path, value: dict[str, Any]) -> None:
    """Write a small JSON file whole (flushed, then renamed into place)."""
    built = path.with_name(f".{path.name}.part")
    with open(built, "w", encoding="utf-8") as f:
        json.dump(value, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(built, path)


class Stage:
    """A staging directory where one command builds run files, then publishes them into ``reports`` whole.

    Use it as a context manager: the directory is made and claimed on entry; ``publish`` gives the files their
    names in ``reports``; an error inside the block (or in ``publish``) takes back what this command published and
    removes the directory, so that nothing of it is left. A kill leaves the directory for ``recover``.

    Args:
        reports: the reports directory the files are published into (it must exist).
        name: the staging directory's name, beginning with a prefix of STAGE_KINDS (".import-<run id>").
        where: the directory to make it in (default ``reports``; a local staging directory for a reports directory
            on a network filesystem).
    """

    def __init__(self, reports: str | os.PathLike[str], name: str, where: str | os.PathLike[str] | None = None) -> None:
        if not name.startswith(tuple(STAGE_KINDS)):
            raise ValueError(f"a staging directory's name begins with one of {', '.join(STAGE_KINDS)}: {name!r}")
        self.reports = Path(os.path.abspath(reports))
        self.path = Path(where if where is not None else self.reports) / name
        self.published: list[Path] = []
        self._lock: int | None = None

    def __enter__(self) -> Stage:  # noqa: PYI034 - typing.Self is 3.11+, dpprof runs on 3.10
        claiming = self.path.with_name(CLAIM_PREFIX + self.path.name)
        claiming.mkdir()
        try:
            self._lock = _claim(claiming, self.reports)
            if self.path.exists():  # os.rename would replace an empty directory of that name
                raise FileExistsError(f"{self.path} exists")
            os.rename(claiming, self.path)  # the lock goes with its file: the directory is owned from its first instant
        except BaseException:
            if self._lock is not None:
                os.close(self._lock)
                self._lock = None
            shutil.rmtree(claiming, ignore_errors=True)
            raise
        return self

    def publish(self, files: list[Path]) -> list[Path]:
        """Give each whole file in the staging directory its name in the reports directory, in the order given,
        never over an existing file; then remove the staging directory. Returns where the files are now.

        Raises:
            FileExistsError: a file of that name is in the reports directory (what was published is taken back).
            OSError: a file could not be moved (the same).
        """
        _write_json(self.path / READY_FILE, {"files": [f.name for f in files], "reports": str(self.reports)})
        for f in files:
            target = self.reports / f.name
            move_into_place(f, target)
            self.published.append(target)
        try:
            _remove_stage(self.path)
        except OSError:  # the run is whole and listed; what bookkeeping is left goes when the block ends
            pass
        return list(self.published)

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None) -> None:
        try:
            if err is not None:
                self._take_back()
            if self.path.exists():
                shutil.rmtree(self.path, ignore_errors=True)
        finally:
            if self._lock is not None:
                os.close(self._lock)
                self._lock = None

    def _take_back(self) -> None:
        """The command failed: its published files go back into the staging directory (or, moved across
        filesystems, are removed), so that nothing of the run stays listed."""
        for target in reversed(self.published):
            try:
                os.rename(target, self.path / target.name)
            except OSError:
                try:
                    target.unlink()
                except OSError:
                    pass
        self.published.clear()


def _claim(stage: Path, reports: Path) -> int:
    """Write ``stage``'s owner file, locked before it gets its name; returns the lock's descriptor."""
    built = stage / f".{OWNER_FILE}.{os.getpid()}"
    fd = os.open(built, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o644)
    try:
        if fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        owner = {"pid": os.getpid(), "host": socket.gethostname(), "reports": str(reports),
                 "started_at": time.time()}
        os.write(fd, json.dumps(owner).encode())
        os.fsync(fd)
        os.rename(built, stage / OWNER_FILE)
    except BaseException:
        os.close(fd)
        try:
            os.unlink(built)
        except OSError:
            pass
        raise
    return fd


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _owned_by_the_living(stage: Path, owner: dict[str, Any] | None) -> bool:
    """Whether a process that lives holds ``stage`` (without taking anything: for the listing)."""
    if owner is None:
        if not stage.name.startswith(CLAIM_PREFIX):
            return False  # a staging directory has its owner file from its first instant: its process removed it
        try:  # a claim directory: its process may be about to write it
            return time.time() - stage.stat().st_mtime < UNCLAIMED_GRACE_S
        except OSError:
            return True
    if fcntl is None:
        return owner.get("host") == socket.gethostname() and pid_alive(owner.get("pid"))
    try:
        fd = os.open(stage / OWNER_FILE, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return True  # its process holds the lock (or a command recovering it does)
    finally:
        os.close(fd)  # closing lets go of a lock taken here
    return False


def _take_over(stage: Path) -> int | None:
    """The lock of a staging (or claim) directory whose process is gone, for the command recovering it: a
    descriptor (-1 where there is no owner file to lock), or None while a process holds it."""
    owner = _read_json(stage / OWNER_FILE)
    if owner is None:
        return None if _owned_by_the_living(stage, None) else -1
    if fcntl is None:
        return None if _owned_by_the_living(stage, owner) else -1
    return lock_if_free(stage / OWNER_FILE)  # None too where another command recovered it meanwhile


def _stages(reports: Path, claims: bool = False) -> list[Path]:
    """The staging directories for ``reports`` (``claims``: the claim directories): in it, and in the local
    staging directory those of its imports written there (their owner file names ``reports``; a claim directory
    without one holds nothing and goes with any)."""
    prefixes = tuple(CLAIM_PREFIX + prefix if claims else prefix for prefix in STAGE_KINDS)
    found: list[Path] = []
    for directory in dict.fromkeys((reports, Path(os.path.abspath(staging_dir())))):
        try:
            entries = sorted(directory.iterdir())
        except OSError:
            continue
        for entry in entries:
            if not entry.name.startswith(prefixes) or not entry.is_dir() or entry.is_symlink():
                continue
            if directory != reports:
                owner = _read_json(entry / OWNER_FILE) or _read_json(entry / READY_FILE)
                if owner is None and claims:
                    found.append(entry)
                if (owner or {}).get("reports") != str(reports):
                    continue
            found.append(entry)
    return found


def _run_files(stage: Path) -> list[Path]:
    """The run files a staging directory holds (not its bookkeeping, nor SQLite's side files)."""
    try:
        return [p for p in stage.iterdir() if p.name.endswith(".sqlite") and not p.name.startswith(".")]
    except OSError:
        return []


def _kind(stage: Path) -> str:
    name = stage.name.removeprefix(CLAIM_PREFIX)
    return next(kind for prefix, kind in STAGE_KINDS.items() if name.startswith(prefix))


def interrupted(reports: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The staging directories for ``reports`` whose process is gone, for the listing: each a row with ``id`` (the
    directory's name, ".import-<run id>"), ``status`` ("interrupted import", "interrupted merge"), ``path`` and
    ``reason``. Reads only."""
    reports = Path(os.path.abspath(reports))
    rows = []
    for stage in _stages(reports):
        owner = _read_json(stage / OWNER_FILE)
        if _owned_by_the_living(stage, owner):
            continue
        kind = _kind(stage)
        ready = _read_json(stage / READY_FILE)
        who = f"process {owner['pid']} on {owner.get('host')}" if owner and "pid" in owner else "its process"
        nxt = f"the next dpprof import, merge or recording in {reports}"
        if ready is not None:
            names = [str(n) for n in ready.get("files") or []]
            published = sum(1 for n in names if (reports / n).exists() and not (stage / n).exists())
            reason = (f"{kind} stopped while publishing ({who} is gone): {published} of {len(names)} run files "
                      f"published, the rest in {stage}; {nxt} publishes them" if published < len(names) else
                      f"{kind} stopped ({who} is gone) after publishing all {len(names)} run files; {nxt} removes "
                      f"{stage}")
        else:
            held = len(_run_files(stage))
            if held:
                reason = (f"{kind} stopped before its files were whole ({who} is gone): nothing of it was published "
                          f"({held} unfinished run file{'s' if held != 1 else ''} there); {nxt} removes {stage}")
            else:  # killed before writing any, or as it removed the directory after publishing every file
                reason = f"{kind} stopped ({who} is gone), leaving no run file in {stage}; {nxt} removes it"
        rows.append({"id": stage.name, "status": f"interrupted {kind}", "path": str(stage),
                     "reason": reason})
    return rows


def recover(reports: str | os.PathLike[str]) -> list[str]:
    """Finish what commands killed while writing to ``reports`` left: publish the rest of a staging directory
    that was being published, remove one that was not. A staging directory whose process lives is never touched.

    Returns:
        one line per staging directory recovered or removed (each also said on the dpprof logger).
    """
    reports = Path(os.path.abspath(reports))
    said = []
    for stage in _stages(reports):
        lock = _take_over(stage)
        if lock is None:
            continue
        try:
            line = _recover(stage, reports)
        except OSError as err:
            line = f"dpprof: {stage}, left by an interrupted {_kind(stage)}, stays: {err}"
        finally:
            if lock >= 0:
                os.close(lock)
        if line:
            log.warning("%s", line)
            said.append(line)
    for claim in _stages(reports, claims=True):
        lock = _take_over(claim)
        if lock is None:
            continue
        try:
            shutil.rmtree(claim, ignore_errors=True)
        finally:
            if lock >= 0:
                os.close(lock)
        line = f"dpprof: removed {claim}, which an {_kind(claim)} killed while claiming it left (it holds no run file)"
        log.warning("%s", line)
        said.append(line)
    return said


def _recover(stage: Path, reports: Path) -> str | None:
    kind = _kind(stage)
    ready = _read_json(stage / READY_FILE)
    if ready is None:  # its files were never published: they go, with the directory
        held = len(_run_files(stage))
        _remove_stage(stage, everything=True)
        if not held:
            return f"dpprof: removed {stage}, which an interrupted {kind} left with no run file in it"
        return (f"dpprof: removed {stage}, left by an interrupted {kind} before its files were whole ({held} "
                f"unfinished run file{'s' if held != 1 else ''}, none published)")
    names = [str(n) for n in ready.get("files") or [] if str(n) == os.path.basename(str(n))]
    kept, moved = [], 0
    for name in names:
        staged, target = stage / name, reports / name
        if not staged.exists():
            continue  # published before the kill
        try:
            move_into_place(staged, target)
            moved += 1
        except FileExistsError:
            if filecmp.cmp(staged, target, shallow=False):
                staged.unlink()  # published, and killed before its staged name went
            else:
                kept.append(name)
    if kept:
        return (f"dpprof: {stage}, left by an interrupted {kind}, stays: {', '.join(kept)} "
                f"{'is' if len(kept) == 1 else 'are'} in {reports} already as other files")
    _remove_stage(stage)
    if not moved:
        return f"dpprof: removed {stage}: every run file an interrupted {kind} left there was published already"
    return (f"dpprof: published the {moved} run file{'s' if moved != 1 else ''} of {len(names)} that an interrupted "
            f"{kind} left in {stage} into {reports}; the run is whole")


def _remove_stage(stage: Path, everything: bool = False) -> None:
    """Remove a staging directory: its bookkeeping files and (``everything``) the unpublished files it holds."""
    if everything:
        shutil.rmtree(stage, ignore_errors=True)  # another command recovering it at once removes the same files
        if stage.exists():
            raise OSError(f"cannot remove {stage}")
        return
    try:
        (stage / READY_FILE).unlink()
    except FileNotFoundError:
        pass
    for leftover in stage.iterdir():  # side files of the staged runs (-journal) and half-written bookkeeping
        if leftover.name.startswith(".") or leftover.name.endswith(("-wal", "-shm", "-journal")):
            leftover.unlink()
    try:  # the owner file last: a directory without one is taken for a dead process's (the next command removes it)
        (stage / OWNER_FILE).unlink()
    except FileNotFoundError:
        pass
    stage.rmdir()

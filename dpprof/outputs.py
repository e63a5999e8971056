"""Files a command writes for the user (CSV tables, trace files, an imported run): whole, or not at all.

Each file is written under a hidden temporary name beside its own (``.steps.csv.<pid>.<random>.part``) and takes
its own name, replacing a file of that name, only when every file of the command is whole and flushed to disk (and
a file the command supersedes by its absence, an earlier export's table, goes then: ``Outputs.remove``).
On any failure the temporary files go, and so does every directory the command made that holds nothing else;
a file or directory that was there before is never touched. An ``OSError`` on the way becomes one
``OutputError`` line naming the path and the reason: "read-only file system", "disk full", "permission
denied", "no such directory D", "D is an existing file, not a directory", "nothing can be made in /proc (a
proc filesystem)"; so does a RecordingError of a run file written inside (``dpprof import``'s). ``dpprof export``
(``--out`` and ``--trace``) and ``dpprof import`` write through it.

Example:
    >>> with Outputs() as out:
    ...     directory = out.directory("run-csv")
    ...     out.open(directory / "steps.csv").write(b"step,duration_ms\\n")
"""
from __future__ import annotations

import errno
import os
import secrets
import stat
from pathlib import Path
from types import TracebackType
from typing import BinaryIO

from dpprof.store import filesystems
from dpprof.store.faults import RecordingError, cause_of
from dpprof.store.files import SIDE_FILES, SQLITE_HEADER

__all__ = ["OutputError", "Outputs", "why_not_written"]

PART_SUFFIX = ".part"


class OutputError(Exception):
    """An output could not be written; the message names the path and the reason in one line, and nothing of
    it was left behind."""


def _nearest_existing(path: Path) -> Path:
    while not os.path.lexists(path) and path.parent != path:
        path = path.parent
    return path


def why_not_written(path: str | os.PathLike[str], err: OSError) -> str:
    """Why ``path`` could not be written, in a few words, from the error and what is on disk now."""
    path = Path(os.path.abspath(path))
    code = err.errno
    if code in (errno.EEXIST, errno.ENOTDIR, errno.ENOENT):
        found = _nearest_existing(path)
        if found != path and not found.is_dir():  # a file where a directory on the way should be
            return f"{found} is an existing file, not a directory"
        if code == errno.EEXIST and found == path and not path.is_dir():
            return "it is an existing file, not a directory"
        if code == errno.ENOENT and found != path and found.is_dir():
            made = filesystems.nothing_made_in(found)  # the directory is there and takes no new entry, whoever asks
            if made is not None:
                return made
            if found != path.parent:
                return f"no such directory {path.parent}"
    if code == errno.EISDIR:
        return "it is a directory"
    return cause_of(err, path)  # /proc itself, say: nothing can be made in it


class Outputs:
    """The files and directories one command writes, made whole or not at all (see the module's docstring).

    Use it as a context manager: ``directory`` makes a directory (and its missing parents), ``open`` gives a
    binary stream for a file; when the block ends without an error every file takes its name. Any error
    removes what the block made; an ``OSError`` is raised as an ``OutputError`` naming the path and why.
    """

    def __init__(self) -> None:
        # (stream, temporary path, its own path, that path as the user named it)
        self._files: list[tuple[BinaryIO, Path, Path, Path]] = []
        self._made: list[Path] = []  # directories made, outermost first
        self._asked: list[Path] = []  # paths asked for, the last one being worked on last
        self._removed: list[Path] = []  # files there before that go once every file is whole
        self._done = False

    def __enter__(self) -> Outputs:  # noqa: PYI034 - typing.Self is 3.11+, dpprof runs on 3.10
        return self

    def directory(self, path: str | os.PathLike[str]) -> Path:
        """Make ``path`` and its missing parents (those made go again on failure, if empty); returns it."""
        path = Path(os.path.abspath(path))
        self._asked.append(path)
        missing = []
        at = path
        while not os.path.lexists(at) and at.parent != at:
            missing.append(at)
            at = at.parent
        for d in reversed(missing):
            try:
                os.mkdir(d)
            except OSError as err:  # about the directory the user named
                raise OSError(err.errno, err.strerror, str(path)) from None
            self._made.append(d)
        if not path.is_dir():  # there already, as a file
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(path))
        return path

    def open(self, path: str | os.PathLike[str]) -> BinaryIO:
        """A binary stream writing ``path``'s contents, under a temporary name until the block ends well.

        A symbolic link is written through (its target is replaced); an existing file keeps its permissions. An
        SQLite database (a run file) or a side file of one (its write-ahead log, ...) is never replaced, named or
        linked to: that is an OutputError.
        """
        shown = Path(os.path.abspath(path))  # as the user named it, in an error
        self._asked.append(shown)
        path = Path(os.path.realpath(shown))
        mode = None
        if os.path.lexists(path):
            st = os.stat(path)
            if stat.S_ISDIR(st.st_mode):
                raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(shown))
            if not stat.S_ISREG(st.st_mode):  # a device or pipe is not replaced by a file
                raise OSError(errno.EINVAL, "not a regular file", str(shown))
            mode = stat.S_IMODE(st.st_mode)
            database = _database_at(path)
            if database is not None:
                how = "is" if path == shown else f"links to {path}, which is"
                raise OutputError(f"cannot write {shown}: it {how} {database}, which an output never replaces; "
                                  "nothing was written")
        temp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}{PART_SUFFIX}")
        try:
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
        except OSError as err:  # about the file the user named, not its temporary name
            raise OSError(err.errno, err.strerror, str(shown)) from None
        try:
            if mode is not None:
                os.fchmod(fd, mode)
            stream = open(fd, "wb")  # noqa: SIM115 - closed when the block ends
        except BaseException:
            os.close(fd)
            _unlink(temp)
            raise
        self._files.append((stream, temp, path, shown))
        return stream

    def remove(self, path: str | os.PathLike[str]) -> None:
        """Remove ``path``, a file there before (an earlier output's, which this one supersedes by its absence), when
        the block ends well: together with the files taking their names, never on failure."""
        self._removed.append(Path(os.path.abspath(path)))

    def _commit(self) -> None:
        for stream, temp, _, shown in self._files:
            self._asked.append(shown)
            if stream.closed:  # closed by its writer: flushed, not yet on disk
                fd = os.open(temp, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            else:
                stream.flush()
                os.fsync(stream.fileno())
                stream.close()
        for _, temp, path, _ in self._files:
            os.replace(temp, path)
        self._done = True
        for path in self._removed:
            _unlink(path)

    def _clean(self) -> None:
        for stream, temp, _, _ in self._files:
            try:
                stream.close()
            except OSError:  # a full disk says so again at close: the file goes all the same
                pass
            _unlink(temp)
        for d in reversed(self._made):
            try:
                os.rmdir(d)  # only when empty: never what another process put there meanwhile
            except OSError:
                pass

    def _named(self, filename: object) -> Path:
        """The path the user knows that an error about ``filename`` is about: a file's own name, not its
        temporary one; the directory asked for, not a hidden one made in it."""
        failed = Path(os.path.abspath(filename)) if isinstance(filename, (str, os.PathLike)) else None
        if failed is not None:
            for _, temp, _, shown in self._files:
                if failed == temp:
                    return shown
            if failed in self._asked:
                return failed
            for asked in reversed(self._asked):  # a hidden file made inside a directory asked for
                if asked in failed.parents:
                    return asked
            return failed
        return self._asked[-1] if self._asked else Path.cwd()

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None) -> None:
        if err is None:
            try:
                self._commit()
                return
            except OSError as failed:
                err = failed
            finally:
                if not self._done:
                    self._clean()
        else:
            self._clean()
        if isinstance(err, OSError):  # anything else goes on as it is, after the same cleaning
            path = self._named(err.filename)
            raise OutputError(f"cannot write {path}: {why_not_written(path, err)}; nothing was written") from None
        if isinstance(err, RecordingError) and err.path is not None and err.cause is not None:  # a run file's
            raise OutputError(f"cannot write {self._named(err.path)}: {err.cause}; nothing was written") from None


def _database_at(path: Path) -> str | None:
    """What ``path`` is if it is an SQLite database ("an SQLite database (a run file?)") or one's side file
    (``-wal``, ``-shm``, ``-journal`` beside it); None for any other file."""
    for suffix in SIDE_FILES:
        if path.name.endswith(suffix) and os.path.isfile(path.with_name(path.name[:-len(suffix)])):
            return f"the {suffix[1:]} file of the SQLite database {path.name[:-len(suffix)]}"
    try:
        with open(path, "rb") as f:
            head = f.read(len(SQLITE_HEADER))
    except OSError:
        return None
    return "an SQLite database (dpprof's runs are)" if head == SQLITE_HEADER else None


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass

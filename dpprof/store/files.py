"""Run files on disk: their names, the files SQLite keeps beside them, and giving a file its name only whole.

Shared by the writer, the staging of runs bound for network filesystems, and the readers, below all of them.
"""
from __future__ import annotations

import errno
import os
import re

__all__ = ["SIDE_FILES", "RANK_FILE", "hidden_name", "remove_files", "publish_file"]

SIDE_FILES = ("-wal", "-shm", "-journal")  # SQLite's write-ahead log, its shared memory and its rollback journal
RANK_FILE = re.compile(r"^(.+)\.rank(\d+)\.sqlite$")  # <run id>.rank<N>.sqlite: one rank of a distributed run
_NO_HARD_LINKS = {errno.EPERM, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK, errno.ENOSYS}


def hidden_name(path: str) -> str:
    """Where a file is built before it appears under ``path``: a dot-name the listing skips."""
    directory, name = os.path.split(path)
    return os.path.join(directory, f".{name}.part")


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

"""Whether a run's process still records it: the status a reader gives a run file, and the liveness test the
publisher shares (a run or staging directory owned by a process that is gone is not 'running')."""
from __future__ import annotations

import os
import shutil
import socket
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

__all__ = ["HEARTBEAT_TIMEOUT_S", "FULL_DISK_FREE_BYTES", "effective_status", "pid_alive", "stopped_by_full_disk"]

HEARTBEAT_TIMEOUT_S = 30.0  # the writer commits every 0.5 s; 60 missed commits means it is gone
# A run that stopped without closing, with its write-ahead log beside it on a disk with less than this
# free, was cut short by the full disk: one commit of a busy run is hundreds of KB of log.
FULL_DISK_FREE_BYTES = 1 << 20


def pid_alive(pid: object) -> bool:
    """Whether process ``pid`` on this host lives; another user's process, or a pid not to judge by, counts as alive."""
    try:
        os.kill(int(pid), 0)  # type: ignore[call-overload]
    except ProcessLookupError:
        return False
    except (PermissionError, TypeError, ValueError, OverflowError):
        return True
    return True


def effective_status(row: dict[str, Any], path: Path | None = None) -> str:
    """A 'running' run whose process is gone, or whose writer stopped beating, is incomplete; or
    disk_full, when its write-ahead log is still beside it on a full disk (the writer could not even
    store that status)."""
    if row.get("status") != "running":
        return row.get("status") or "unknown"
    stopped = row.get("host") == socket.gethostname() and row.get("pid") and not pid_alive(int(row["pid"]))
    beat = row.get("heartbeat_at")
    if not stopped and beat:
        stopped = (datetime.now(timezone.utc) - datetime.fromisoformat(beat)).total_seconds() > HEARTBEAT_TIMEOUT_S
    if not stopped:
        return "running"
    return "disk_full" if path is not None and stopped_by_full_disk(path) else "incomplete"


def stopped_by_full_disk(path: Path) -> bool:
    """Whether the run file at ``path`` has a write-ahead log beside it on a disk that is (nearly) full."""
    wal = path.with_name(path.name + "-wal")
    try:
        return wal.stat().st_size > 0 and shutil.disk_usage(path.parent).free < FULL_DISK_FREE_BYTES
    except OSError:
        return False

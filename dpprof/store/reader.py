"""Reading runs: list_runs() over a reports directory and load_run() of one run, as DataFrames.

A file that is not a dpprof run, a truncated or corrupt file, or one written by a newer schema
is listed with its reason and never makes listing fail. Reading never modifies a run.
"""
from __future__ import annotations

import json
import os
import socket
import sqlite3
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pandas as pd

from dpprof.store.schema import FORMAT, RECORD_TABLES, RUN_COLUMNS, SCHEMA_VERSION

__all__ = ["RUN_SUFFIX", "list_runs", "load_run", "StoredRun", "RunFileError", "reports_dir",
           "HEARTBEAT_TIMEOUT_S"]

RUN_SUFFIX = ".sqlite"
_SIDE_FILES = ("-wal", "-shm", "-journal")
_SQLITE_MAGIC = b"SQLite format 3\x00"
HEARTBEAT_TIMEOUT_S = 30.0  # the writer commits every 0.5 s; 60 missed commits means it is gone
TABLES = ("steps", "phases", "memory", "allocator", "devices", "gpu_samples", "findings", "notes")


class RunFileError(Exception):
    """A file in reports/ that cannot be read as a dpprof run; the message says why."""


def reports_dir(path: str | os.PathLike[str] | None = None) -> Path:
    """The reports directory: ``path``, else $DPPROF_REPORTS, else ./reports."""
    return Path(path if path is not None else os.environ.get("DPPROF_REPORTS", "reports"))


def _connect_ro(path: Path) -> sqlite3.Connection:
    with open(path, "rb") as f:
        head = f.read(len(_SQLITE_MAGIC))
    if head != _SQLITE_MAGIC:
        raise RunFileError("not a dpprof run: not an SQLite file" if head else "empty file")
    try:
        return sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, timeout=5)
    except sqlite3.Error as err:
        raise RunFileError(f"cannot open: {err}") from None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _effective_status(row: dict[str, Any]) -> str:
    """A 'running' run whose process is gone, or whose writer stopped beating, is incomplete."""
    if row.get("status") != "running":
        return row.get("status") or "unknown"
    if row.get("host") == socket.gethostname() and row.get("pid") and not _pid_alive(int(row["pid"])):
        return "incomplete"
    beat = row.get("heartbeat_at")
    if beat:
        age = (datetime.now(timezone.utc) - datetime.fromisoformat(beat)).total_seconds()
        if age > HEARTBEAT_TIMEOUT_S:
            return "incomplete"
    return "running"


def _read_meta(con: sqlite3.Connection) -> dict[str, Any]:
    try:
        meta = dict(con.execute("SELECT key, value FROM meta").fetchall())
    except sqlite3.DatabaseError as err:
        if "no such table" in str(err):
            raise RunFileError("not a dpprof run: an SQLite file without dpprof's meta table") from None
        raise RunFileError(f"corrupt or truncated: {err}") from None
    if meta.get("format") != FORMAT:
        raise RunFileError("not a dpprof run: meta.format is not 'dpprof-run'")
    version = int(meta.get("schema_version", 0))
    if version > SCHEMA_VERSION:
        raise RunFileError(f"written by a newer dpprof (schema {version}; this dpprof reads up to "
                           f"{SCHEMA_VERSION}): upgrade dpprof to open it")
    try:
        cur = con.execute(f"SELECT {', '.join(RUN_COLUMNS)} FROM runs")
        rows = cur.fetchall()
    except sqlite3.DatabaseError as err:
        raise RunFileError(f"corrupt or truncated: {err}") from None
    if len(rows) != 1:
        raise RunFileError(f"corrupt: expected one run row, found {len(rows)}")
    row = dict(zip(RUN_COLUMNS, rows[0]))
    for key in ("devices", "workload_args"):
        row[key] = json.loads(row[key]) if row[key] else ([] if key == "devices" else {})
    row["stored_status"] = row["status"]
    row["status"] = _effective_status(row)
    row["schema_version"] = version
    return row


@dataclass
class StoredRun:
    """A run read from its file: ``meta`` and one DataFrame per table (read on first use)."""

    path: Path
    meta: dict[str, Any]
    _frames: dict[str, pd.DataFrame] = field(default_factory=dict, repr=False)

    @property
    def id(self) -> str:
        return self.meta["id"]

    def table(self, name: str) -> pd.DataFrame:
        """One table as a DataFrame."""
        if name not in TABLES:
            raise KeyError(f"no table {name!r}; tables are {', '.join(TABLES)}")
        if name not in self._frames:
            con = _connect_ro(self.path)
            try:
                self._frames[name] = pd.read_sql_query(f"SELECT * FROM {name}", con)
            except (sqlite3.DatabaseError, pd.errors.DatabaseError) as err:
                raise RunFileError(f"{self.path.name}: corrupt table {name}: {err}") from None
            finally:
                con.close()
            if name == "steps":
                self._frames[name]["explicit"] = self._frames[name]["explicit"].astype(bool)
        return self._frames[name]

    def query(self, sql: str, params: tuple[Any, ...] = ()) -> pd.DataFrame:
        """An SQL query against the run file (for aggregates over large runs)."""
        con = _connect_ro(self.path)
        try:
            return pd.read_sql_query(sql, con, params=params)
        finally:
            con.close()

    def frames(self) -> dict[str, pd.DataFrame]:
        return {name: self.table(name) for name in TABLES}

    steps = property(lambda self: self.table("steps"))
    phases = property(lambda self: self.table("phases"))
    memory = property(lambda self: self.table("memory"))
    allocator = property(lambda self: self.table("allocator"))
    devices = property(lambda self: self.table("devices"))
    gpu_samples = property(lambda self: self.table("gpu_samples"))
    findings = property(lambda self: self.table("findings"))
    notes = property(lambda self: self.table("notes"))


def _candidates(directory: Path) -> list[Path]:
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir()
                  if p.is_file() and not p.name.startswith(".") and not p.name.endswith(_SIDE_FILES))


def _summary(con: sqlite3.Connection) -> dict[str, Any]:
    steps, duration = con.execute("SELECT COUNT(*), SUM(duration_ms) FROM steps").fetchone()
    return {"steps": steps, "steps_duration_ms": duration}


def list_runs(reports_dir_: str | os.PathLike[str] | None = None) -> pd.DataFrame:
    """Every file in the reports directory, one row each; unreadable ones with their ``reason``.

    Returns:
        a DataFrame with id, name, status, created_at, ended_at, backend, devices, workload,
        steps, duration_s, path and reason (None for readable runs), newest first.
    """
    rows = []
    for path in _candidates(reports_dir(reports_dir_)):
        base = {"path": str(path), "reason": None}
        try:
            con = _connect_ro(path)
            try:
                meta = _read_meta(con)
                summary = _summary(con)
            except sqlite3.DatabaseError as err:
                raise RunFileError(f"corrupt or truncated: {err}") from None
            finally:
                con.close()
        except RunFileError as err:
            rows.append({**base, "id": path.stem, "status": "unreadable", "reason": str(err)})
            continue
        except OSError as err:
            rows.append({**base, "id": path.stem, "status": "unreadable", "reason": f"cannot read: {err}"})
            continue
        rows.append({**base, **{k: meta[k] for k in ("id", "name", "status", "created_at", "ended_at",
                                                        "backend", "workload", "error", "dropped_records")},
                     "devices": ",".join(meta["devices"]), "steps": summary["steps"],
                     "duration_s": _duration_s(meta)})
    columns = ["id", "name", "status", "created_at", "ended_at", "duration_s", "backend", "devices",
               "workload", "steps", "dropped_records", "error", "path", "reason"]
    df = pd.DataFrame(rows, columns=columns)
    return df.sort_values("created_at", ascending=False, na_position="last", kind="stable").reset_index(drop=True)


def _duration_s(meta: dict[str, Any]) -> float | None:
    end = meta.get("ended_at") or meta.get("heartbeat_at")
    if not (meta.get("created_at") and end):
        return None
    return (datetime.fromisoformat(end) - datetime.fromisoformat(meta["created_at"])).total_seconds()


def _resolve(run: str | os.PathLike[str], directory: Path) -> Path:
    path = Path(run)
    if path.is_file():
        return path
    for candidate in (directory / f"{run}{RUN_SUFFIX}", directory / str(run)):
        if candidate.is_file():
            return candidate
    matches = [p for p in _candidates(directory) if p.stem.startswith(str(run))]
    if len(matches) == 1:
        return matches[0]
    if len(matches) > 1:
        raise RunFileError(f"{run!r} matches {len(matches)} runs in {directory}: "
                           f"{', '.join(p.stem for p in matches[:5])}")
    raise RunFileError(f"no run {run!r} in {directory} (dpprof runs lists them)")


def load_run(run: str | os.PathLike[str], reports_dir_: str | os.PathLike[str] | None = None) -> StoredRun:
    """Open one run by id (or a unique id prefix) in the reports directory, or by path.

    Raises:
        RunFileError: no such run, or the file is not a readable dpprof run (the message says why).
    """
    path = _resolve(run, reports_dir(reports_dir_))
    con = _connect_ro(path)
    try:
        meta = _read_meta(con)
    except sqlite3.DatabaseError as err:
        raise RunFileError(f"{path.name}: corrupt or truncated: {err}") from None
    finally:
        con.close()
    return StoredRun(path=path, meta=meta)

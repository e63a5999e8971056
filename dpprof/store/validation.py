"""What a value read from a run file must be, checked where the store reads it (dpprof.store.reader).

A run file is written by dpprof, but it may have been copied, edited or damaged since: any value of it may be
text where a number belongs, NULL, infinite, negative or absurdly large, and any JSON may not parse. The reader
checks the run's metadata (``run_meta``: bad values become None or empty, each with a one-line reason) and its
tables (``damage``: the rows with a bad value, counted per table, which the reader then leaves out), so that
nothing above the store ever sees such a value, and one bad value never takes a run, a listing or a page down.
"""
from __future__ import annotations

import json
import math
import re
import sqlite3
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from dpprof.records import SCRIPT_BUCKET, TABLE_OF
from dpprof.store.retention import BOUNDED, Retention, stored_retention
from dpprof.store.schema import AGGREGATE_TABLES, RUN_COLUMNS, columns_of

__all__ = ["MAX_VALUE", "RUN_ID", "NOT_NULL", "TableDamage", "schema_version", "run_meta", "damage", "added"]

# The largest magnitude a stored figure may have: a thousand times any real one (1e15 ms is 31,700 years, 1e15
# bytes a petabyte, more than any device holds), and far below float64's and int64's limits, so that sums over a
# run's rows and unit conversions (ms to the microseconds of a trace) stay finite and exact enough.
MAX_VALUE = 1e15
# A run id names its files (<id>.sqlite, <id>.rank<N>.sqlite, found by glob): dpprof.store.ids.new_run_id's, or
# one given to dpprof.record; never empty, hidden, a path or a glob pattern.
RUN_ID = re.compile(r"[^./\\\x00-\x1f*?\[\]][^/\\\x00-\x1f*?\[\]]{0,199}")  # fullmatch
# Figures that are times since the run started may precede it (an imported trace's events before its first
# step); every other figure (a duration, a size, a count, a step number, a percentage) is never negative.
SIGNED = frozenset({"start_ms", "t_ms", "launch_ms", "value"})
# ... and a comms row's bucket may be SCRIPT_BUCKET (-1): a collective the script called itself
LOWEST = {"bucket": SCRIPT_BUCKET}
# The columns that say what a row is and when (its step, device, phase, time), which every reader of the table
# relies on and every writer fills; any other column may hold NULL (a figure the source did not have: an
# imported trace's unknown reserved bytes, a block's minimum before a finite one, a call without a batch).
NOT_NULL = {
    "steps": ("step", "start_ms", "duration_ms"),
    "phases": ("step", "call", "phase", "device", "start_ms", "duration_ms"),
    "memory": ("step", "call", "device"),
    "allocator": ("step", "call", "device", "phase"),
    "gpu_samples": ("t_ms", "device"),
    "devices": ("device",),
    "notes": ("source", "message"),
    "findings": ("kind", "severity", "title"),
    "comms": ("step", "device", "launch_ms", "duration_ms"),
    "gpu_time": ("step", "device", "window_ms"),
    "step_blocks": ("block", "first_step", "last_step", "steps", "sum_ms"),
    "phase_blocks": ("phase", "device", "block", "first_step", "last_step", "steps", "calls", "sum_ms"),
    "memory_blocks": ("device", "block", "first_step", "last_step", "steps", "calls"),
    "allocator_blocks": ("device", "phase", "block", "rows"),
    "chunk_counts": ("device", "calls"),
    "outlier_steps": ("step", "duration_ms"),
    "run_sketches": ("kind", "device"),
}
_INT_META = ("pid", "rank", "world_size", "dropped_records", "detail_from")
_TEXT_META = ("name", "host", "torch_version", "cuda_version", "backend", "workload", "status", "error", "source")
_DATE_META = ("created_at", "ended_at", "heartbeat_at")


def _shown(value: Any) -> str:
    """A stored value as a reason quotes it: short, on one line."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def schema_version(value: Any) -> int:
    """meta.schema_version as a number, or ValueError saying what it is instead."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value:
        return value
    if isinstance(value, str) and value.strip().isdigit() and len(value.strip()) < 10:
        return int(value.strip())
    raise ValueError(f"meta.schema_version is {_shown(value)}, not a schema number")


def _date(value: str) -> str:
    """An ISO date as the reader keeps it (UTC where it names no zone), or ValueError."""
    parsed = datetime.fromisoformat(value)
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=timezone.utc)
    return parsed.isoformat()


def _int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError
    if value != int(value) or not 0 <= value <= MAX_VALUE:
        raise ValueError
    return int(value)


def _retention(value: Any) -> str:
    """runs.detail as the JSON of a Retention with sane numbers, or ValueError."""
    retention = stored_retention(value)
    if retention is None:
        raise ValueError
    for name, field in Retention.__dataclass_fields__.items():
        got = getattr(retention, name)
        if field.type in ("int", "float") and (isinstance(got, bool) or not isinstance(got, (int, float))
                                               or not math.isfinite(got) or abs(got) > MAX_VALUE):
            raise ValueError
    return retention.to_json()


def run_meta(stored: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The runs row of a file with every value checked: (row, reasons).

    A value that is not what its column holds (text where a number belongs, a date that is no date, JSON that
    does not parse or is not the list or object it should be) reads as None (an empty list or object for the JSON
    columns; dpprof's default retention for ``detail``), and its reason, one line naming the column and the value,
    is in ``reasons``. The id must be a run id (``RUN_ID``): a run without one cannot be opened, so ValueError.
    """
    row = {c: stored.get(c) for c in RUN_COLUMNS}  # a column added since the file was written reads as None
    reasons: list[str] = []

    def bad(column: str, what: str, empty: Any = None) -> None:
        reasons.append(f"runs.{column} is {_shown(row[column])}, not {what}")
        row[column] = empty

    if not isinstance(row["id"], str) or not RUN_ID.fullmatch(row["id"]):
        raise ValueError(f"runs.id is {_shown(row['id'])}, not a run id")
    for column in _TEXT_META:
        if row[column] is not None and not isinstance(row[column], str):
            bad(column, "text")
    for column in _INT_META:
        if row[column] is not None:
            try:
                row[column] = _int(row[column])
            except ValueError:
                bad(column, "a whole number")
    for column in _DATE_META:
        raw = row[column]
        if raw is not None:
            try:
                row[column] = _date(raw if isinstance(raw, str) else "")
            except ValueError:
                bad(column, "a date")
    for column, kind, empty in (("devices", list, []), ("workload_args", dict, {})):
        if not row[column]:
            row[column] = empty
            continue
        raw = row[column]
        try:
            value = json.loads(raw) if isinstance(raw, str) else None
        except (ValueError, RecursionError):
            value = None
        if not isinstance(value, kind) or (kind is list and not all(isinstance(d, str) for d in value)):
            bad(column, "a JSON list of device names" if kind is list else "a JSON object", empty)
        else:
            row[column] = value
    if row["detail"]:
        try:
            row["detail"] = json.loads(_retention(row["detail"]))
        except (ValueError, TypeError, RecursionError, AttributeError):
            bad("detail", "a retention (read with dpprof's default)", json.loads(BOUNDED.to_json()))
    else:
        row["detail"] = None  # dpprof.store.retention.Retention's fields; None: a file of schema 1
    return row, reasons


def _columns(table: str) -> dict[str, tuple[str, bool]]:
    """Column -> (SQL type, may be NULL) of a record or aggregate table."""
    cls = next((c for c, t in TABLE_OF.items() if t == table), None)
    columns = columns_of(cls) if cls is not None else AGGREGATE_TABLES[table][0]
    return {name: (kind, name not in NOT_NULL.get(table, ())) for name, kind in columns.items()}


def _lowest(column: str) -> float:
    """The least value ``column`` may hold."""
    return -MAX_VALUE if column in SIGNED else LOWEST.get(column, 0)


def _wanted(column: str, kind: str) -> str:
    """What ``column`` must hold, in words: "a number from 0 to 1e+15", "text"."""
    if kind in ("INTEGER", "REAL"):
        return f"a number from {_lowest(column):g} to {MAX_VALUE:g}"
    return "text" if kind == "TEXT" else "a sketch (int32 pairs)"


def _valid_sql(column: str, kind: str, nullable: bool) -> str:
    """An SQL condition that holds (never NULL) where ``column`` holds a value its readers can use.

    Written for speed, as it is tested on every row of a long run: SQLite orders NULL < numbers < text < blobs, so
    a number column's value is a number in range where it lies BETWEEN the bounds (text, a blob, an infinity or
    NULL never does), and a text column's is text where it lies from '' up to the least blob.
    """
    c = f'"{column}"'
    if kind in ("INTEGER", "REAL"):
        low = _lowest(column)
        test = f"{c} BETWEEN {low:.0f} AND {MAX_VALUE:.0f}"
    elif kind == "TEXT":
        test = f"{c} >= '' AND {c} < x''"
    else:  # a sketch: little-endian int32 pairs (dpprof.store.sketch)
        test = f"typeof({c}) = 'blob' AND length({c}) % 8 = 0"
    return f"({c} IS NULL OR ({test}))" if nullable else f"({c} IS NOT NULL AND {test})"


@dataclass(frozen=True)
class TableDamage:
    """The rows of one table with a bad value, left out when the run is read."""

    table: str
    rows: int
    columns: tuple[tuple[str, str], ...]  # the columns holding the bad values, and what each must hold
    keep: str  # the SQL condition of the rows kept

    @property
    def text(self) -> str:
        """One line: what was left out, and why: "steps: 1 row left out (duration_ms not a number from 0 to 1e+15)"."""
        why = ", ".join(f"{name} not {wanted}" for name, wanted in self.columns)
        return f"{self.table}: {self.rows:,} row{'s' if self.rows != 1 else ''} left out ({why})"


def damage(con: sqlite3.Connection, tables: list[str], after: dict[str, int] | None = None,
           scanned: dict[str, int] | None = None) -> list[TableDamage]:
    """The tables of a run file (of ``tables``, where present) with rows holding a bad value: one scan of each.

    Args:
        after: per table, scan only the rows whose rowid is past this one (rows a live recording appended since
            an earlier scan); the counts are then of those rows alone.
        scanned: filled with each scanned table's largest rowid (for the next ``after``).
    """
    out = []
    present = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    for table in tables:
        if table not in present:
            continue
        have = [r[1] for r in con.execute(f"PRAGMA table_info({table})")]
        columns = {name: spec for name, spec in _columns(table).items() if name in have}
        tests = {name: _valid_sql(name, kind, nullable) for name, (kind, nullable) in columns.items()}
        if not tests:
            continue
        keep = " AND ".join(tests.values())
        since = (after or {}).get(table)
        where = f"NOT ({keep})" + (f" AND rowid > {int(since)}" if since is not None else "")
        if scanned is not None:
            scanned[table] = con.execute(f"SELECT COALESCE(MAX(rowid), 0) FROM {table}").fetchone()[0]
            where += f" AND rowid <= {int(scanned[table])}"
        rows = con.execute(f"SELECT COUNT(*) FROM {table} WHERE {where}").fetchone()[0]
        if rows:  # which columns: a second look, at the bad rows only
            sums = ", ".join(f"SUM(NOT {t})" for t in tests.values())
            counts = con.execute(f"SELECT {sums} FROM {table} WHERE {where}").fetchone()
            bad = tuple((name, _wanted(name, columns[name][0])) for name, n in zip(tests, counts) if n)
            out.append(TableDamage(table, int(rows), bad, keep))
    return out


def added(before: list[TableDamage], since: list[TableDamage]) -> list[TableDamage]:
    """An earlier scan's damage with that of the rows scanned since: counts summed, bad columns joined."""
    out = {d.table: d for d in before}
    for d in since:
        was = out.get(d.table)
        out[d.table] = d if was is None else TableDamage(
            d.table, was.rows + d.rows, (*was.columns, *(c for c in d.columns if c not in was.columns)), d.keep)
    return list(out.values())

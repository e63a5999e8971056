"""The background writer: records go into a bounded buffer and one thread commits them to the run file.

The training step never waits on disk. put() is a deque append; when the buffer is full the
record is dropped and counted, and the count is stored with the run. The writer commits at
least every FLUSH_INTERVAL_S, so a process killed with SIGKILL loses at most that much.

When a write fails (the disk fills), the writer keeps everything committed, commits what of the
failed batch still fits, stops writing and counts what it drops; training goes on. A run file
is built under a hidden name and appears under its own only whole, so a listing never shows a
half-created run, and a run that cannot start leaves no file behind.
"""
from __future__ import annotations

import json
import logging
import operator
import os
import sqlite3
import threading
import time
from collections import deque
from dataclasses import fields
from datetime import datetime, timezone
from itertools import chain
from pathlib import Path
from typing import Any, Callable

from dpprof.records import RECORD_OF_TABLE, STEP_ROW, FindingRecord, NoteRecord, Record, Row, StepRecord
from dpprof.store.blocks import Aggregator, SampleWindows
from dpprof.store.files import SIDE_FILES, hidden_name, publish_file, remove_files
from dpprof.store.faults import cause_of, failure_line, is_disk_full, start_failure
from dpprof.store.retention import BOUNDED, Retention
from dpprof.store.schema import FORMAT, RECORD_TABLES, RUN_COLUMNS, SCHEMA_VERSION, ddl
from dpprof.store.status import effective_status
from dpprof.units import plural

__all__ = ["SqliteSink", "FLUSH_INTERVAL_S", "MAX_BUFFERED_RECORDS", "create_run_file", "replace_findings",
           "fold_leftover_logs"]

FLUSH_INTERVAL_S = 0.5  # the issue asks for at least one commit a second; half that leaves margin
FOLD_RETRY_S = 2.0  # how long close() waits for readers to let go before leaving the run in WAL mode
REFOLD_INTERVAL_S = 5.0  # after the disk filled, how often a live writer tries again to fold its log back
PUT_HEADROOM = 4096  # records one forward call or step may put between two looks at the buffer's size (put)
MAX_BUFFERED_RECORDS = 200_000  # ~30 MB of records; 100 s of an 8-device run at 100 steps/s
MIN_KEPT_SLICE = 16  # after a failed commit, ever smaller slices of it are tried, down to this many records

log = logging.getLogger("dpprof")

_ROW_OF = {cls: operator.attrgetter(*(f.name for f in fields(cls))) for cls in RECORD_TABLES}


def _insert_many(cls: type, n: int) -> str:
    """INSERT of ``n`` rows of ``cls``'s table in one statement."""
    one = "(" + ", ".join("?" * len(fields(cls))) + ")"
    return f"INSERT INTO {RECORD_TABLES[cls]} VALUES " + ", ".join([one] * n)


_INSERT = {cls: _insert_many(cls, 1) for cls in RECORD_TABLES}
# A commit inserts many rows per statement: executemany steps SQLite once per row and releases the
# GIL around every step, so each row would be a hand-off to the training threads. 999 is the fewest
# bound variables any SQLite allows in one statement.
_ROWS_PER_INSERT = {cls: max(1, 999 // len(fields(cls))) for cls in RECORD_TABLES}
_INSERT_BLOCK = {cls: _insert_many(cls, n) for cls, n in _ROWS_PER_INSERT.items()}
_WRITE_ERRORS = (sqlite3.Error, OSError)


def _now() -> str:
    return datetime.now(timezone.utc).isoformat()


def _connect(path: str) -> sqlite3.Connection:
    con = sqlite3.connect(path, timeout=30, check_same_thread=False)
    mode = con.execute("PRAGMA journal_mode=WAL").fetchone()[0]  # readers (the dashboard) read while we write
    if mode != "wal":
        con.close()
        raise sqlite3.OperationalError(f"cannot put {path} in WAL mode (journal mode stays {mode})")
    con.execute("PRAGMA synchronous=NORMAL")  # durable across a killed process; fsync at checkpoints
    return con


def create_run_file(path: str, run_row: dict[str, Any]) -> sqlite3.Connection:
    """Create a new run file (never an existing one) with its schema and runs row; open it for writing.

    The file is built under a hidden name and given its own only when whole, and the first write
    in WAL mode is made before this returns. Whatever fails, no file is left behind.
    """
    built = hidden_name(path)
    fd = os.open(built, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    os.close(fd)
    try:
        con = sqlite3.connect(built, timeout=30)
        try:
            with con:
                for statement in ddl():
                    con.execute(statement)
                con.executemany("INSERT INTO meta VALUES (?, ?)",
                                [("format", FORMAT), ("schema_version", str(SCHEMA_VERSION))])
                cols = list(RUN_COLUMNS)
                con.execute(f"INSERT INTO runs ({', '.join(cols)}) VALUES ({', '.join('?' * len(cols))})",
                            [_encode(run_row.get(c)) for c in cols])
        finally:
            con.close()
        publish_file(built, path)
    except BaseException:
        remove_files(built, built + "-journal")
        raise
    opened: sqlite3.Connection | None = None
    try:
        con = opened = _connect(path)
        with con:  # the write-ahead log and its index exist, or this fails here, before the first step
            con.execute("UPDATE runs SET heartbeat_at = ?", (_now(),))
    except BaseException:
        if opened is not None:
            opened.close()
        remove_files(path, *(path + s for s in SIDE_FILES))  # our own file, created a moment ago, holding no step
        raise
    return con


def _encode(value: Any) -> Any:
    return json.dumps(value) if isinstance(value, (list, dict)) else value


class SqliteSink:
    """A Sink that writes one run file from a background thread.

    Every commit also brings the run's per-block aggregates up to date and thins the detail of steps the
    retention does not keep (dpprof.store.blocks, dpprof.store.retention), in the same transaction.

    Attributes:
        failure: why writing stopped ("disk full", ...), or None while every commit succeeds.
        steps_kept: step records committed to the file.
        lost: the file is gone from disk (its directory was removed and could not be made again, or
            writing failed before the first step and the empty run was ``removed``).
        written_back: the file was removed while recording and dpprof wrote it back to its path.
        clock_ms: the run's clock, for the time of the note a failure leaves (set by the run).
    """

    def __init__(self, path: str, run_row: dict[str, Any], max_buffered: int = MAX_BUFFERED_RECORDS,
                 flush_interval_s: float | None = None, retention: Retention = BOUNDED) -> None:
        self.path = path
        self._aggregator: Aggregator | None = Aggregator(retention)
        self._samples = SampleWindows(retention) if retention.bounded else None
        self._detail_from = 0
        try:
            self._con = create_run_file(path, {**run_row, "heartbeat_at": _now(), "dropped_records": 0,
                                               "detail": retention.to_json(), "detail_from": 0})
        except _WRITE_ERRORS as err:
            raise start_failure(os.path.dirname(path) or ".", err) from None
        self._buffer: deque[Record | Row] = deque()
        self._max = max_buffered
        self._interval = FLUSH_INTERVAL_S if flush_interval_s is None else flush_interval_s  # read now: tests set it
        self.dropped = 0
        self._drop_lock = threading.Lock()
        self._run_updates: dict[str, Any] = {}
        self.failure: str | None = None
        self.disk_full = False
        self.steps_kept = 0
        self.lost = False
        self.written_back = False
        self.removed = False
        self.folded = True
        self.clock_ms: Callable[[], float] | None = None
        self.message: str | None = None
        self._unwritten: dict[str, Any] = {}
        self._last_fold_try = 0.0
        self._commits = 0
        self._committed = threading.Condition()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="dpprof-writer", daemon=True)
        self._thread.start()

    @property
    def put(self) -> Callable[[Record | Row], None]:
        """``sink.put(record)`` buffers a record, or a row (dpprof.records.Row), for the next commit; drops and counts
        it when full.

        Far from full this is the buffer's own append, one C call a record: a probe takes ``put`` once per forward
        call or step (dpprof.parallel.probe, dpprof.parallel.fsdp) and puts that call's records with it, so the
        buffer may pass its limit by at most what one call puts (PUT_HEADROOM is ample); near full, every record
        is checked."""
        buffer = self._buffer
        return buffer.append if len(buffer) + PUT_HEADROOM < self._max else self._put_checked

    def _put_checked(self, record: Record | Row) -> None:
        if len(self._buffer) < self._max:
            self._buffer.append(record)
        else:
            with self._drop_lock:
                self.dropped += 1

    def update_run(self, **values: Any) -> None:
        """Change columns of the runs row at the next commit."""
        self._run_updates.update(values)

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Commit what is buffered now and wait for it; False if that took longer than ``timeout_s``."""
        with self._committed:
            target = self._commits + 2  # a commit under way may have taken the buffer before the last records
            self._wake.set()
            return self._committed.wait_for(lambda: self._commits >= target or not self._thread.is_alive(),
                                            timeout_s)

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                self._wake.wait(self._interval)
                self._wake.clear()
                self._commit()
            self._commit()
        except BaseException as err:  # nothing the disk does may take the training loop down
            if self.failure is None:
                self.failure = cause_of(err, self.path)
        finally:
            with self._committed:
                self._committed.notify_all()

    def _drain(self) -> list[Record | Row]:
        buffer, records = self._buffer, []
        while buffer:
            records.append(buffer.popleft())
        return records

    def _count_dropped(self, n: int) -> None:
        with self._drop_lock:
            self.dropped += n

    def _commit(self) -> None:
        records = self._drain()
        updates, self._run_updates = self._run_updates, {}
        if self.failure is not None:  # writing stopped: count what comes, fold the log once space allows
            self._count_dropped(len(records))
            self._keep_run_updates(updates)
            self._try_fold_again()
        else:
            updates.update(heartbeat_at=_now(), dropped_records=self.dropped)
            try:
                self._write(records, updates, aggregate=True, final=self._stop.is_set())
            except _WRITE_ERRORS as err:
                self._keep_run_updates(updates)
                self._stop_writing(err, records)
            else:
                if not os.path.exists(self.path):
                    self._write_back()
        with self._committed:
            self._commits += 1
            self._committed.notify_all()

    def _write(self, records: list[Record | Row], updates: dict[str, Any], aggregate: bool = False,
               final: bool = False) -> None:
        """Insert ``records`` and apply ``updates`` to the runs row in one transaction; with ``aggregate``, also
        the aggregates' statements for them (a retried slice of a failed commit is not counted again)."""
        if aggregate and self._samples is not None:
            records = self._samples.thin(records, final)
        batches: dict[type, list[Record | Row]] = {}  # each table's records and rows (a row: (table, *fields))
        for record in records:
            cls = RECORD_OF_TABLE[record[0]] if isinstance(record, tuple) else type(record)
            batches.setdefault(cls, []).append(record)
        statements: list[tuple[str, Any]] = []
        if aggregate and self._aggregator is not None:
            try:
                self._aggregator.add(records)
                statements = self._aggregator.statements(final)
            except Exception as err:  # noqa: BLE001 - a fault in the aggregates never costs a row
                statements, updates = self._stop_aggregating(err, updates)
            else:
                if self._aggregator.detail_from != self._detail_from:
                    updates = {**updates, "detail_from": self._aggregator.detail_from}
        with self._con:
            for cls, rows in batches.items():
                # each statement's rows are built just before it runs: SQLite runs it with the GIL
                # released, so the training threads get the GIL back between chunks instead of
                # waiting out the interpreter's switch interval behind one long Python loop
                n, row_of = _ROWS_PER_INSERT[cls], _ROW_OF[cls]
                for i in range(0, len(rows), n):
                    chunk = rows[i:i + n]
                    sql = _INSERT_BLOCK[cls] if len(chunk) == n else _insert_many(cls, len(chunk))
                    self._con.execute(sql, list(chain.from_iterable(
                        r[1:] if isinstance(r, tuple) else row_of(r) for r in chunk)))
            for sql, params in statements:
                self._con.execute(sql, params)
            if updates:
                self._con.execute(f"UPDATE runs SET {', '.join(f'{k} = ?' for k in updates)}",
                                  [_encode(v) for v in updates.values()])
        self.steps_kept += len(batches.get(StepRecord, ()))
        if self._aggregator is not None:
            self._detail_from = self._aggregator.detail_from

    def _stop_aggregating(self, err: Exception, updates: dict[str, Any]) -> tuple[list[tuple[str, Any]], dict[str, Any]]:
        """The aggregates could not take a record: keep every row from now on, and read the run from its rows
        (runs.detail cleared), with a note saying why."""
        self._aggregator = None
        log.warning("dpprof: %s: per-block aggregates stopped (%s: %s); the run keeps every row from here on",
                    self.path, type(err).__name__, err)
        note = self._note(f"per-block aggregates stopped after {plural(self.steps_kept, 'step')} "
                          f"({type(err).__name__}: {err}); "
                          "the run keeps every row from there on and is read from its rows")
        return [note], {**updates, "detail": None}

    def _stop_writing(self, err: BaseException, records: list[Record | Row]) -> None:
        """A commit failed: store the failure with the run's columns the commit carried (its devices), then what
        of its records still fits, in the order they were recorded, each slice with the failure's line for the
        steps then kept; then stop writing. Whatever fits last on a full disk, the run says its status, its
        devices and the steps it holds (its records alone would take the last room)."""
        self.failure = cause_of(err, self.path)
        self.disk_full = is_disk_full(err, self.path)
        self._store((self._run_row(self._failure_columns(self._stopped_line(self.steps_kept))),))
        kept, size = 0, len(records) // 2
        while size >= MIN_KEPT_SLICE and kept < len(records):
            part = records[kept:kept + size]
            steps = self.steps_kept + sum(isinstance(r, StepRecord) or (isinstance(r, tuple) and r[0] == STEP_ROW)
                                          for r in part)
            try:
                self._write(part, self._failure_columns(self._stopped_line(steps)))
                kept += len(part)  # the last slice may be shorter than ``size``
            except _WRITE_ERRORS:
                size //= 2
        self._count_dropped(len(records) - kept)
        self.folded = False
        self._last_fold_try = time.monotonic()
        self.record_failure(self._stopped_line(self.steps_kept))

    def _stopped_line(self, steps_kept: int) -> str:
        return f"{self.failure} after {plural(steps_kept, 'step')}: the steps after them were not recorded"

    def _keep_run_updates(self, updates: dict[str, Any]) -> None:
        """Run columns that could not be written (the devices seen, ...), for the failure's own update;
        the status stays the failure's."""
        for key in ("status", "error", "heartbeat_at", "dropped_records"):
            updates.pop(key, None)
        self._unwritten.update(updates)

    def record_failure(self, message: str) -> bool:
        """Store the failure in the run (its status, error and a note) if that still fits; True if it did."""
        row = self._run_row(self._failure_columns(message))
        return self._store((row, self._note(message)), (row,))  # a note if it fits; the status alone if only that does

    def _failure_columns(self, message: str) -> dict[str, Any]:
        """The runs row's columns for a failure: the status, the line, what was dropped, the columns not written."""
        return {**self._unwritten, "status": "disk_full" if self.disk_full else "failed", "error": message,
                "dropped_records": self.dropped}

    @staticmethod
    def _run_row(values: dict[str, Any]) -> tuple[str, tuple[Any, ...]]:
        """The statement setting these columns of the runs row."""
        return f"UPDATE runs SET {', '.join(f'{k} = ?' for k in values)}", tuple(_encode(v) for v in values.values())

    def _note(self, message: str) -> tuple[str, tuple[Any, ...]]:
        t_ms = self.clock_ms() if self.clock_ms is not None else float("nan")
        return _INSERT[NoteRecord], _ROW_OF[NoteRecord](NoteRecord(t_ms=t_ms, source="store", message=message))

    def _store(self, *attempts: tuple[tuple[str, tuple[Any, ...]], ...]) -> bool:
        for statements in attempts:
            try:
                with self._con:
                    for sql, params in statements:
                        self._con.execute(sql, params)
                return True
            except _WRITE_ERRORS:
                continue
        return False

    def _try_fold_again(self) -> None:
        if self.folded or self.lost or time.monotonic() - self._last_fold_try < REFOLD_INTERVAL_S:
            return
        self._last_fold_try = time.monotonic()
        self.folded = self._checkpoint()

    def _checkpoint(self) -> bool:
        """Copy the write-ahead log into the run file and empty it; False if a reader or the full disk stops it."""
        try:
            return not self._con.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()[0]
        except _WRITE_ERRORS:
            return False

    def _write_back(self) -> None:
        """The run file was removed while recording (its directory deleted): write what the open file
        holds back to its path and go on writing there."""
        built = hidden_name(self.path)
        try:
            os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
            copy = sqlite3.connect(built)
            try:
                self._con.backup(copy)
            finally:
                copy.close()
            publish_file(built, self.path)
            con = _connect(self.path)
        except _WRITE_ERRORS as err:
            remove_files(built, built + "-journal")
            self.failure = (f"{os.path.dirname(self.path)} was removed during the run and cannot be made "
                            f"again ({cause_of(err)})")
            self.lost = True
            return
        old, self._con = self._con, con
        old.close()
        self.written_back = True

    def close(self, steps_total: int | None = None) -> None:
        """Commit everything and fold the write-ahead log back so the run is one file again.

        Everything is committed before this returns. Folding the log needs the file to itself and
        room on the disk: while a reader (the dashboard, another rank) has it open, it is retried
        for FOLD_RETRY_S; either way a run left in WAL mode is intact, with its -wal and -shm files
        beside it. ``message`` is then the one line to tell the user, if something went wrong.

        Args:
            steps_total: how many steps the training made (the run knows; the writer counts what it kept).
        """
        self._stop.set()
        self._wake.set()
        self._thread.join()
        if self.failure is not None and self.steps_kept == 0 and not self.lost:
            self._remove_empty_run()  # failed before its first step: like a run that could not start
        self.message = self._message(steps_total)
        try:
            if self.lost:
                return
            if self.failure is not None:
                self._checkpoint()  # folding the log first may free the room the final line needs
                self.record_failure(self.message or self.failure)
            elif self.written_back and self.message:
                self._store((self._note(self.message),))
            self._fold()
        finally:
            if not self.removed:
                self._con.close()

    def _remove_empty_run(self) -> None:
        """Our own file, holding no step: removed, so that a listing shows no run that recorded nothing."""
        self._con.close()
        remove_files(self.path, *(self.path + s for s in SIDE_FILES))
        self.lost = self.removed = True

    def _message(self, steps_total: int | None) -> str | None:
        if self.removed:
            not_recorded = f", {steps_total} steps not recorded" if steps_total else ""
            return (f"cannot record in {os.path.dirname(self.path) or '.'}: {self.failure} before the first "
                    f"step was stored: no run file kept{not_recorded}")
        if self.lost:
            return f"the run is lost: {self.failure}"
        if self.failure is not None:
            return failure_line(self.failure, self.path, self.steps_kept, steps_total)
        if self.written_back:
            return (f"{os.path.dirname(self.path)} was removed during the run: dpprof wrote the run back to "
                    f"{self.path} ({self.steps_kept} steps)")
        return None

    def _fold(self) -> None:
        deadline = time.monotonic() + FOLD_RETRY_S
        while True:
            try:
                self._con.execute("PRAGMA incremental_vacuum").fetchall()  # free pages given back: the file shrinks
                self._con.execute("PRAGMA wal_checkpoint(TRUNCATE)")
                self._con.execute("PRAGMA journal_mode=DELETE")
                self.folded = True
                return
            except sqlite3.OperationalError as err:
                if is_disk_full(err, self.path):
                    self.folded = False
                    if self.failure is None:  # a failed run's one line says it; a whole run's log must go with it
                        log.warning("dpprof: %s is whole but the disk is full: it keeps its write-ahead log "
                                    "beside it (%s-wal) until there is room", self.path, self.path)
                    return
                if time.monotonic() > deadline:
                    self.folded = False
                    log.warning("dpprof: %s stays in WAL mode (a reader has it open): %s", self.path, err)
                    return
                time.sleep(0.05)


def fold_leftover_logs(directory: str | os.PathLike[str]) -> list[Path]:
    """Fold back the write-ahead logs that runs no longer recording left beside them (the disk was
    full when they closed); returns the run files now whole. Never touches a run still recording, nor a file
    that is not a dpprof run (another program's SQLite database in the directory keeps its journal mode)."""
    folded = []
    for wal in sorted(Path(directory).glob("*.sqlite-wal")):
        path = wal.with_name(wal.name[:-len("-wal")])
        if path.name.startswith(".") or not path.is_file():
            continue
        if not _stopped_run(path):
            continue
        try:
            con = sqlite3.connect(path, timeout=0.5)
        except sqlite3.Error:
            continue
        try:
            con.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            if con.execute("PRAGMA journal_mode=DELETE").fetchone()[0] == "delete":
                folded.append(path)
        except sqlite3.Error:
            continue  # no room yet, or a reader holds it: the next recording tries again
        finally:
            con.close()
    return folded


def _stopped_run(path: Path) -> bool:
    """Whether ``path`` is a dpprof run no process records any longer, read without writing: a connection that may
    write would fold the log of any WAL database as it closes, another program's too."""
    try:
        con = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, timeout=0.5)
    except sqlite3.Error:
        return False
    try:
        if con.execute("SELECT value FROM meta WHERE key = 'format'").fetchone() != (FORMAT,):
            return False  # another program's database (with a `runs` table of its own, say): never ours to change
        cur = con.execute("SELECT * FROM runs")
        row = dict(zip((d[0] for d in cur.description), cur.fetchone() or ()))
        return not (row.get("status") == "running" and effective_status(row) == "running")
    except sqlite3.Error:
        return False
    finally:
        con.close()


def replace_findings(path: str, findings: list[tuple[Any, ...]]) -> None:
    """Store a closed run's findings (rows in FindingRecord field order), replacing earlier ones."""
    con = sqlite3.connect(path, timeout=30)
    try:
        with con:
            con.execute("DELETE FROM findings")
            con.executemany(_INSERT[FindingRecord], findings)
    finally:
        con.close()

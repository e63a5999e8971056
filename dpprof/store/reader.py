"""Reading runs: list_runs() over a reports directory and load_run() of one run, as DataFrames.

A file that is not a dpprof run, a truncated or corrupt file, or one written by a newer schema
is listed with its reason and never makes listing fail. Reading never modifies a run.
"""
from __future__ import annotations

import os
import shutil
import sqlite3
import stat
import tempfile
import threading
from contextlib import contextmanager
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd

from dpprof.loaders import said_in
from dpprof.records import ALL_REDUCE
from dpprof.store.faults import RunFileError, cause_of, symlink_loop
from dpprof.store.files import RANK_FILE, SIDE_FILES, SQLITE_HEADER, fold_log
from dpprof.store.schema import AGGREGATE_TABLES, CHECKED_TABLES, FORMAT, RECORD_TABLES, SCHEMA_VERSION, TABLES, columns_of
from dpprof.store.status import FULL_DISK_FREE_BYTES, HEARTBEAT_TIMEOUT_S, effective_status
from dpprof.store.validation import TableDamage, added, damage, run_meta, schema_version

if TYPE_CHECKING:
    from dpprof.store.model import RunModel

__all__ = ["RUN_SUFFIX", "list_runs", "read_run_file", "checks_under_their_runs", "load_run", "StoredRun", "RunFileError",
           "reports_dir", "reports_dir_problem", "LISTING_COLUMNS", "HEARTBEAT_TIMEOUT_S", "FULL_DISK_FREE_BYTES", "CHECKED_TABLES", "why_not_regular", "file_damage",
           "effective_status", "integrity_problem", "named_collectives", "typed"]

RUN_SUFFIX = ".sqlite"
# torch.profiler traces waiting to be imported (dpprof import; the Runs page lists them), not runs
_TRACE_FILES = (".json", ".json.gz")
_DAMAGE_CACHE_FILES = 256  # files whose check is remembered (by name, size and modification time)
_damage_cache: dict[tuple[str, int, int, int, int], list[TableDamage]] = {}
_damage_lock = threading.Lock()
# a live run file's last check: its inode, each record table's largest rowid checked, and the damage found
_live_scans: dict[str, tuple[int, dict[str, int], list[TableDamage]]] = {}
READS = ("auto", "rows", "aggregates")  # load_run's read: where a run's figures come from


def named_collectives(rows: pd.DataFrame) -> pd.DataFrame:
    """Rows read from a comms table, each collective named: a file written before dpprof stored what a recorded DDP
    bucket's collective is holds NULL there, and a gradient bucket's all-reduce is all it can be (no other row was
    ever stored unnamed), so it reads as ``records.ALL_REDUCE``, as the run's files recorded since store it."""
    if "collective" in rows.columns and rows["collective"].isna().any():
        # as a column of names reads (pandas' str dtype), not one that was NULL throughout (object)
        rows["collective"] = rows["collective"].astype(object).where(rows["collective"].notna(),
                                                                     ALL_REDUCE).infer_objects()
    return rows


def reports_dir(path: str | os.PathLike[str] | None = None) -> Path:
    """The reports directory: ``path``, else $DPPROF_REPORTS, else ./reports."""
    return Path(path if path is not None else os.environ.get("DPPROF_REPORTS", "reports"))


# list_runs and load_run take ``reports_dir=`` as record, instrument and import_traces do: the name is their argument
resolve_reports_dir = reports_dir


def reports_dir_problem(path: str | os.PathLike[str] | None = None) -> str | None:
    """Why the reports directory (``reports_dir(path)``) can hold no runs although something is there ("the reports
    directory D is an existing file, not a directory"); None for a directory, or where nothing is (no runs yet)."""
    directory = reports_dir(path)
    loop = symlink_loop(directory)
    if loop is not None:
        return f"the reports directory {directory} is {loop}, not a directory"
    if directory.is_dir() or not os.path.lexists(directory):
        return None
    try:
        mode = os.stat(directory).st_mode
    except OSError:  # a dangling symlink, or one that cannot be followed
        what = f"a symlink to {os.readlink(directory)}, which is not there" if directory.is_symlink() else "unreadable"
    else:
        what = "an existing file" if stat.S_ISREG(mode) else next(
            (name for test, name in _FILE_TYPES if test(mode)), "no file")
    return f"the reports directory {directory} is {what}, not a directory"


_FILE_TYPES = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
               (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def why_not_regular(path: Path) -> str | None:
    """Why ``path`` is no regular file, found without opening it (opening a FIFO would block, a device never
    ends): "not a regular file: a FIFO (named pipe)", "dangling symlink to ...", "no such file or directory"; None
    for a regular file (or a symlink to one)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        if path.is_symlink():
            return f"dangling symlink to {os.readlink(path)}: its target does not exist"
        return "no such file or directory"
    except OSError as err:
        return f"cannot read: {err.strerror or err}"
    if stat.S_ISREG(st.st_mode):
        return None
    what = next((name for test, name in _FILE_TYPES if test(st.st_mode)), "not a file")
    link = f" (symlink to {os.readlink(path)})" if path.is_symlink() else ""
    return f"not a regular file: {what}{link}"


def _connect_ro(path: Path) -> sqlite3.Connection:
    why = why_not_regular(path)
    if why:
        raise RunFileError(why)
    # O_NONBLOCK: a file swapped for a FIFO since the check above still never blocks the open
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise RunFileError("not a regular file")
        head = f.read(len(SQLITE_HEADER))
    if head != SQLITE_HEADER:
        raise RunFileError("not a dpprof run: not an SQLite file" if head else "empty file")
    try:
        con = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, timeout=5,
                              check_same_thread=False)
    except sqlite3.Error as err:
        raise RunFileError(f"cannot open: {err}") from None
    try:
        con.execute("SELECT count(*) FROM sqlite_master").fetchone()
    except sqlite3.Error as err:
        if getattr(err, "sqlite_errorname", None) not in _NOT_READABLE_IN_PLACE:
            return con  # damage or a busy writer: the caller's first read says it, as it would without this check
        con.close()
        return _private_copy(path)
    return con


# What a read-only connection cannot read in place although the run is whole: a hot rollback journal beside the file
# (its process killed mid-write after the run closed, storing its findings) that only a writer may roll back; a
# write-ahead log whose index (-shm) is missing and cannot be made (a killed run copied onto a read-only path)
_NOT_READABLE_IN_PLACE = ("SQLITE_READONLY_ROLLBACK", "SQLITE_CANTOPEN")


def _private_copy(path: Path) -> sqlite3.Connection:
    """A read-only connection to a copy of the run file and its journal or log, made in the temp directory and made
    whole there (the journal rolled back, the log folded in) as SQLite would in place: the run's own files are left as
    they are. The copy is gone from disk once opened (the connection holds it)."""
    try:
        with tempfile.TemporaryDirectory(prefix="dpprof-read-") as directory:
            copy = os.path.join(directory, path.name)
            for suffix in ("", "-journal", "-wal"):
                if os.path.isfile(f"{path}{suffix}"):
                    shutil.copyfile(f"{path}{suffix}", f"{copy}{suffix}")
            fold_log(copy)
            return sqlite3.connect(f"{Path(copy).as_uri()}?mode=ro", uri=True, timeout=5, check_same_thread=False)
    except (OSError, sqlite3.Error) as err:
        raise RunFileError(f"cannot read: it must be read from a copy (a journal or log beside it that cannot be "
                           f"used in place), and the copy failed: {cause_of(err)}") from None


# quick_check's problems named in integrity_problem's line: the first few say where the damage is
QUICK_CHECK_SHOWN = 3


def integrity_problem(path: Path) -> str | None:
    """What SQLite's quick_check finds wrong inside a run file (a damaged page opening it never reads), opened read
    only, in one line (its first few problems, without SQLite's ``*** in database main ***`` heading); None where
    it finds nothing."""
    try:
        con = _connect_ro(path)
        try:
            rows = con.execute(f"PRAGMA quick_check({QUICK_CHECK_SHOWN})").fetchall()
        finally:
            con.close()
    except (RunFileError, sqlite3.Error) as err:
        rows = [(str(err),)]
    found = [line.strip() for row in rows for line in str(row[0]).splitlines()]
    found = [line for line in found if line and not line.startswith("***")]
    return None if found == ["ok"] else "; ".join(found) or "quick_check failed"


def _file_key(path: Path) -> tuple[str, int, int, int, int]:
    """A run file's name, size and modification time, and its write-ahead log's: it changes at every commit."""
    st = path.stat()
    try:
        wal = path.with_name(path.name + "-wal").stat()
        wal_key = (wal.st_mtime_ns, wal.st_size)
    except OSError:
        wal_key = (0, 0)
    return (str(path.resolve()), st.st_mtime_ns, st.st_size, *wal_key)


def file_damage(path: Path, live: bool = False) -> list[TableDamage]:
    """The tables of a run file with rows holding a bad value (dpprof.store.validation.damage), checked once per
    version of the file.

    ``live``: the file is being recorded (its run's status is running). Its record tables only grow at the end
    while a recording appends to them, so a new version of it is checked from the rows past the last check on,
    not again whole: a long running run's pages re-read it every two seconds (each commit is a new version). Its
    per-block aggregates, rewritten in place and small, are checked whole every time.
    """
    try:
        key = _file_key(path)
    except OSError as err:  # gone since it was listed
        raise RunFileError(f"{path.name}: cannot read: {err.strerror or err}") from None
    with _damage_lock:
        if key in _damage_cache:
            return _damage_cache[key]
        earlier = _live_scans.get(key[0]) if live else None
    con = _connect_ro(path)
    try:
        inode = path.stat().st_ino
        scanned: dict[str, int] = {}
        if earlier is not None and earlier[0] == inode:
            grown = damage(con, list(TABLES), after=earlier[1], scanned=scanned)
            found = added([d for d in earlier[2] if d.table in TABLES], grown) + damage(con, list(AGGREGATE_TABLES))
        else:
            found = damage(con, list(TABLES), scanned=scanned) + damage(con, list(AGGREGATE_TABLES))
    except sqlite3.DatabaseError as err:
        raise RunFileError(f"{path.name}: corrupt: {err}") from None
    finally:
        con.close()
    with _damage_lock:
        if len(_damage_cache) >= _DAMAGE_CACHE_FILES:
            _damage_cache.clear()
            _live_scans.clear()
        _damage_cache[key] = found
        if live:
            _live_scans[key[0]] = (inode, scanned, found)
        else:
            _live_scans.pop(key[0], None)
    return found


def _cleaned(path: Path, found: list[TableDamage]) -> sqlite3.Connection:
    """A read-only connection to a damaged run file whose damaged tables are shadowed by TEMP copies of their
    usable rows, so every query reads only those. The copies are numbered 1, 2, ... in the order the rows were
    written: readers count a table's rows by its last rowid, and read it in that order."""
    con = _connect_ro(path)
    try:
        for d in found:
            columns = ", ".join(f'"{r[1]}"' for r in con.execute(f"PRAGMA main.table_info({d.table})"))
            ddl = con.execute("SELECT sql FROM main.sqlite_master WHERE type = 'table' AND name = ?",
                              (d.table,)).fetchone()[0]
            order = " ORDER BY rowid" if "WITHOUT ROWID" not in ddl.upper() else ""
            con.execute(f"CREATE TEMP TABLE {d.table} AS SELECT * FROM main.{d.table} WHERE 0")
            con.execute(f"INSERT INTO temp.{d.table} ({columns}) SELECT {columns} FROM main.{d.table} "
                        f"WHERE {d.keep}{order}")
        con.commit()  # ends the implicit transaction: no lock is left on the run file
    except sqlite3.DatabaseError as err:
        con.close()
        raise RunFileError(f"{path.name}: corrupt: {err}") from None
    return con


def _read_meta(con: sqlite3.Connection, path: Path | None = None) -> dict[str, Any]:
    try:
        meta = dict(con.execute("SELECT key, value FROM meta").fetchall())
    except sqlite3.DatabaseError as err:
        if "no such table" in str(err):
            raise RunFileError("not a dpprof run: an SQLite file without dpprof's meta table") from None
        raise RunFileError(f"corrupt or truncated: {err}") from None
    if meta.get("format") != FORMAT:
        raise RunFileError("not a dpprof run: meta.format is not 'dpprof-run'")
    try:
        version = schema_version(meta.get("schema_version", 0))
    except ValueError as err:
        raise RunFileError(f"corrupt: {err}") from None
    if version > SCHEMA_VERSION:
        raise RunFileError(f"written by a newer dpprof (schema {version}; this dpprof reads up to "
                           f"{SCHEMA_VERSION}): upgrade dpprof to open it")
    try:
        cur = con.execute("SELECT * FROM runs")
        rows = cur.fetchall()
    except sqlite3.DatabaseError as err:
        raise RunFileError(f"corrupt or truncated: {err}") from None
    if len(rows) != 1:
        raise RunFileError(f"corrupt: expected one run row, found {len(rows)}")
    try:  # every value checked (dpprof.store.validation): a bad one reads as None, with its reason in "damage"
        row, row["damage"] = run_meta(dict(zip((d[0] for d in cur.description), rows[0])))
    except ValueError as err:
        raise RunFileError(f"corrupt: {err}") from None
    row["stored_status"] = row["status"]
    row["status"] = effective_status(row, path)
    row["schema_version"] = version
    return row


def typed(table: str, frame: pd.DataFrame) -> pd.DataFrame:
    """``frame`` (a record table's rows, read from a file or a run kept in memory) with the types its readers
    expect, in place: the steps' ``explicit`` a bool, their ``loader_ms`` a number (NaN where a step has none, as a
    CSV of the table reads it back)."""
    if table == "steps":
        frame["explicit"] = frame["explicit"].astype(bool)
        frame["loader_ms"] = pd.to_numeric(frame["loader_ms"], errors="coerce").astype(float)
    return frame


@dataclass
class StoredRun:
    """A run read from its file (or, for a torch.distributed run, its rank files): ``meta`` and one
    DataFrame per table, read on first use. Every table and query result carries a ``rank`` column (the
    file's rank; 0 for a one-file run), so the same columns come back whatever the kind of run. ``model``
    says what kind of run it is and what it holds."""

    path: Path  # the run's file; for a multi-rank run, the lowest rank's
    meta: dict[str, Any]
    _frames: dict[str, pd.DataFrame] = field(default_factory=dict, repr=False)
    paths: list[Path] = field(default_factory=list)  # every file of the run, by rank
    _model: RunModel | None = field(default=None, repr=False)
    # where figures are read from: "auto" (RunModel.aggregated decides), "rows" (the detail rows, never the
    # per-block aggregates: a run recorded with detail="all" then gives full detail's figures) or "aggregates"
    read: str = "auto"
    # which deep capture the operator, kernel and memory tables are read from (its first step, one of
    # dpprof.store.detail_rows.captures); None: the latest
    capture: int | None = None
    _captures: list[Any] | None = field(default=None, repr=False)  # captures(), read once
    # files with damaged tables: a connection reading only their usable rows (dpprof.store.validation), kept open
    _cleaned: dict[Path, sqlite3.Connection] = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        if not self.paths:
            self.paths = [self.path]

    @property
    def id(self) -> str:
        return self.meta["id"]

    @property
    def mtime(self) -> float:
        """The newest modification time of the run's files (a cache key for readers)."""
        return max(p.stat().st_mtime for p in self.paths)

    @property
    def live(self) -> bool:
        """Whether the run is being recorded now (its files grow at the end as it runs)."""
        return self.meta.get("status") == "running"

    @property
    def damage(self) -> list[str]:
        """What was wrong in the run's files, one line each: values of its metadata that read as None, and the
        rows of its tables left out for a bad value (dpprof.store.validation); [] for a sound run."""
        said = [*self.meta.get("damage", [])]
        for path in self.paths:
            prefix = f"{path.name}: " if len(self.paths) > 1 else ""
            said += [prefix + d.text for d in file_damage(path, self.live)]
        return said

    @property
    def damaged_rows(self) -> dict[str, dict[str, int]]:
        """The rows of each table left out for a bad value, per file (file name -> table -> rows): what ``damage``
        says in words, as counts (dpprof.store.validation); {} for a sound run."""
        out: dict[str, dict[str, int]] = {}
        for path in self.paths:
            found = {d.table: d.rows for d in file_damage(path, self.live)}
            if found:
                out[path.name] = found
        return out

    def file_meta(self) -> pd.DataFrame:
        """Each file's own run row, checked as ``meta`` is (dpprof.store.validation): columns rank, created_at (None
        where the file's is no date), devices (a list) and host (None where unknown)."""
        rows = []
        for path in self.paths:
            try:
                meta = _open(path)[0]
            except RunFileError as err:
                raise RunFileError(f"{path.name}: {err}") from None
            host = meta.get("host")
            rows.append({"rank": self._file_rank(path), "created_at": meta["created_at"], "devices": meta["devices"],
                         "host": host if isinstance(host, str) and host else None})
        return pd.DataFrame(rows, columns=["rank", "created_at", "devices", "host"])

    def data_loaders(self) -> dict[int, list[dict[str, Any]]]:
        """Each rank's DataLoaders as its file's workload_args say (dpprof.loaders: recorded settings, or a trace's
        iterators): rank -> their settings (0 for a one-file run); [] for a rank recorded with the watch on that
        iterated none, and a file that does not say (written before the watch, a trace without DataLoader ranges) is
        left out. A distributed run's come from the rank files' metadata load_run read (``rank_data_loaders``), of the
        files this view holds."""
        by_rank = self.meta.get("rank_data_loaders")
        if isinstance(by_rank, dict):
            held = {self._file_rank(p) for p in self.paths}
            return {rank: found for rank, found in by_rank.items() if rank in held}
        found = _loaders_in(self.meta)
        return {self._file_rank(self.paths[0]): found} if found is not None else {}

    @contextmanager
    def connect(self, path: Path) -> Iterator[sqlite3.Connection]:
        """A read-only connection to one of the run's files, whose tables hold only rows with usable values: a
        damaged table's bad rows are left out (``damage`` says which)."""
        found = file_damage(path, self.live)
        if not found:
            con = _connect_ro(path)
            try:
                yield con
            finally:
                con.close()
            return
        with self._lock:  # one connection per damaged file, shared by this run's reads one at a time
            if path not in self._cleaned:
                self._cleaned[path] = _cleaned(path, found)
            yield self._cleaned[path]

    def _read(self, sql: str, params: tuple[Any, ...], what: str) -> pd.DataFrame:
        frames = []
        for rank, path in enumerate(self.paths):
            with self.connect(path) as con:
                try:
                    df = named_collectives(pd.read_sql_query(sql, con, params=params))
                except (sqlite3.DatabaseError, pd.errors.DatabaseError) as err:
                    raise RunFileError(f"{path.name}: corrupt {what}: {err}") from None
            df["rank"] = self._file_rank(path)
            frames.append(df)
        return frames[0] if len(frames) == 1 else pd.concat(frames, ignore_index=True)

    def file_rank(self, path: Path) -> int:
        """The rank one of the run's files holds (its name's <id>.rank<N>.sqlite, else the run's rank, else 0)."""
        return self._file_rank(path)

    def _file_rank(self, path: Path) -> int:
        """The rank a file holds: from its name (<id>.rank<N>.sqlite), else the run's rank, else 0."""
        rank = _rank_of(path)
        return rank if rank is not None else int(self.meta.get("rank") or 0)

    @property
    def model(self) -> RunModel:
        """What the run is and holds (its kind, device axis, measurements), read once: dpprof.store.model."""
        if self._model is None:
            from dpprof.store.model import describe

            self._model = describe(self)
        return self._model

    def _has_table(self, path: Path, name: str) -> bool:
        with self.connect(path) as con:
            try:
                return con.execute("SELECT 1 FROM main.sqlite_master WHERE type = 'table' AND name = ?",
                                   (name,)).fetchone() is not None
            except sqlite3.DatabaseError as err:
                raise RunFileError(f"{path.name}: corrupt: {err}") from None

    def table(self, name: str) -> pd.DataFrame:
        """One table as a DataFrame."""
        if name not in TABLES:
            raise KeyError(f"no table {name!r}; tables are {', '.join(TABLES)}")
        if name not in self._frames:
            cls = next(c for c, t in RECORD_TABLES.items() if t == name)
            if all(self._has_table(path, name) for path in self.paths):
                frame = self._read(f"SELECT * FROM {name}", (), f"table {name}")
                for column in columns_of(cls):  # a column added to the schema since the file was written: NULL
                    if column not in frame.columns:
                        frame[column] = None
                self._frames[name] = frame
            else:  # a table added to the schema since the file was written: it holds no rows
                self._frames[name] = pd.DataFrame(columns=[*columns_of(cls), "rank"])
            typed(name, self._frames[name])
        return self._frames[name]

    def query(self, sql: str, params: tuple[Any, ...] = ()) -> pd.DataFrame:
        """An SQL query against the run file (for aggregates over large runs): the rows of each rank's file,
        with a ``rank`` column."""
        return self._read(sql, params, "query")

    @property
    def ranks(self) -> int:
        """How many files the run has: one, or one per rank of a torch.distributed run."""
        return len(self.paths)

    def frames(self) -> dict[str, pd.DataFrame]:
        return {name: self.table(name) for name in TABLES}

    def captures(self) -> list[Any]:
        """The deep captures whose tables the run keeps (dpprof.store.detail_rows.read_captures), read once: every
        read of the operator tables picks its rows by them."""
        if self._captures is None:
            from dpprof.store import detail_rows

            self._captures = detail_rows.read_captures(self)
        return self._captures

    def operators(self, **kw: Any) -> pd.DataFrame:
        """The run's operators (dpprof.store.detail_rows.operators: by, rank, device, top, search, sort)."""
        from dpprof.store import detail_rows

        return detail_rows.operators(self, **kw)

    def kernels(self, **kw: Any) -> pd.DataFrame:
        """The run's kernels (dpprof.store.detail_rows.kernels: by, rank, device, top, search)."""
        from dpprof.store import detail_rows

        return detail_rows.kernels(self, **kw)

    def gpu_metrics(self, **kw: Any) -> pd.DataFrame:
        """GPU utilization, SM efficiency and occupancy per step (dpprof.store.detail_rows.gpu_metrics)."""
        from dpprof.store import detail_rows

        return detail_rows.gpu_metrics(self, **kw)

    def memory_timeline(self, **kw: Any) -> pd.DataFrame:
        """Allocated and reserved bytes over time (dpprof.store.detail_rows.memory_timeline)."""
        from dpprof.store import detail_rows

        return detail_rows.memory_timeline(self, **kw)

    def memory_events(self, **kw: Any) -> pd.DataFrame:
        """Allocations paired with their frees (dpprof.store.detail_rows.memory_events)."""
        from dpprof.store import detail_rows

        return detail_rows.memory_events(self, **kw)

    def modules(self, **kw: Any) -> pd.DataFrame:
        """The nn.Module tree (dpprof.store.detail_rows.modules)."""
        from dpprof.store import detail_rows

        return detail_rows.modules(self, **kw)

    @property
    def detail_missing(self) -> str | None:
        """Why the run has no operator data, or None (dpprof.store.detail_rows.detail_missing)."""
        from dpprof.store import detail_rows

        return detail_rows.detail_missing(self)

    steps = property(lambda self: self.table("steps"))
    phases = property(lambda self: self.table("phases"))
    memory = property(lambda self: self.table("memory"))
    allocator = property(lambda self: self.table("allocator"))
    devices = property(lambda self: self.table("devices"))
    gpu_samples = property(lambda self: self.table("gpu_samples"))
    findings = property(lambda self: self.table("findings"))
    notes = property(lambda self: self.table("notes"))
    comms = property(lambda self: self.table("comms"))
    gpu_time = property(lambda self: self.table("gpu_time"))


def _candidates(directory: Path) -> list[Path]:
    """The files of the reports directory that may be runs: every regular file but hidden, side and trace files, and
    anything else named *.sqlite (a directory, a FIFO, a device, a dangling symlink: listed with why it is none)."""
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir()
                  if not p.name.startswith(".") and not p.name.endswith(SIDE_FILES)
                  and not p.name.lower().endswith(_TRACE_FILES)
                  and (p.name.endswith(RUN_SUFFIX) or p.is_file()))


def _summary(con: sqlite3.Connection) -> dict[str, Any]:
    """Steps and their total time, from lookups: steps are never deleted (the last rowid counts them), and a file of
    schema 2 sums its step blocks (dpprof.store.blocks) rather than every step's row."""
    steps = con.execute("SELECT COALESCE(MAX(rowid), 0) FROM steps").fetchone()[0]
    blocks = con.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'step_blocks'").fetchone()
    duration = con.execute("SELECT SUM(sum_ms) FROM step_blocks" if blocks else
                           "SELECT SUM(duration_ms) FROM steps").fetchone()[0]
    return {"steps": steps, "steps_duration_ms": duration}


def _rank_of(path: Path) -> int | None:
    match = RANK_FILE.match(path.name)
    return int(match.group(2)) if match else None


def read_run_file(path: str | os.PathLike[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """One run file's metadata and summary (steps, their total time) as the listing reads them; RunFileError
    saying why not."""
    return _open(Path(path))


def _open(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """A run file's metadata and summary, or RunFileError saying why not."""
    try:
        con = _connect_ro(path)
    except OSError as err:
        raise RunFileError(f"cannot read: {err}") from None
    try:
        return _read_meta(con, path), _summary(con)
    except sqlite3.DatabaseError as err:
        raise RunFileError(f"corrupt or truncated: {err}") from None
    finally:
        con.close()


# worst first: a rank that died without closing its file (incomplete) says more about the run than
# one that was stopped cleanly (interrupted), as when torchrun stops the others after a rank died
_STATUS_RANK = {"failed": 0, "disk_full": 1, "incomplete": 2, "interrupted": 3, "running": 4, "unknown": 5,
                "finished": 6}


def _as_copy(path: Path, meta: dict[str, Any]) -> dict[str, Any]:
    """A run file's meta as the file it was read from holds it. A file not named after the run it holds (a copy,
    ``cp RUN.sqlite backup.sqlite``; a rank file copied under another name) is a one-file run of its own, whose
    id is the file's name (without .sqlite), ``copy_of`` the id stored in it: never merged with the run it copies."""
    match = RANK_FILE.match(path.name)
    named = match.group(1) if match else path.stem if path.suffix == RUN_SUFFIX else path.name
    if named == meta["id"]:  # the run's own file: its name says whether it is one rank's (and which)
        rank = int(match.group(2)) if match else None
        return meta if (meta.get("rank") is None) == (rank is None) else {**meta, "rank": rank}
    return {**meta, "id": path.stem if path.suffix == RUN_SUFFIX else path.name, "copy_of": meta["id"], "rank": None}


def _combine(metas: list[dict[str, Any]]) -> dict[str, Any]:
    """One run's metadata from its ranks' files: rank 0's, with every rank's devices and the worst status."""
    metas = sorted(metas, key=lambda m: m.get("rank") or 0)
    meta = dict(metas[0])
    meta["devices"] = [d for m in metas for d in m["devices"]]
    meta["status"] = min((m["status"] for m in metas), key=lambda s: _STATUS_RANK.get(s, _STATUS_RANK["unknown"]))
    meta["error"] = _first_error(metas)
    meta["dropped_records"] = sum(m.get("dropped_records") or 0 for m in metas)
    meta["detail_from"] = max((m.get("detail_from") or 0 for m in metas), default=0)
    meta["ranks"] = [m.get("rank") for m in metas]
    meta["damage"] = [d for m in metas for d in m.get("damage") or []]
    meta["rank_data_loaders"] = {int(m.get("rank") or 0): found for m in metas
                                 if (found := _loaders_in(m)) is not None}
    ends = [m.get("ended_at") for m in metas]
    known = [e for e in ends if e]
    meta["ended_at"] = max(known) if len(known) == len(ends) else None  # ended only when every rank's file has
    missing = _missing_files(metas)
    if missing is not None and meta["status"] == "finished":  # never finished with some of its files
        meta["status"], meta["error"] = "incomplete", missing
    return meta


def _loaders_in(meta: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The DataLoaders one run file's workload_args say (dpprof.loaders.said_in: [] where it watched and none was
    iterated, None where it does not say)."""
    return said_in(meta.get("workload_args"))


def _first_error(metas: list[dict[str, Any]]) -> str | None:
    """The error of the rank that ended first with one, named by its rank where the run has several: a rank that
    raised is the cause, and the others' errors (a peer's closed connection, torchrun's stop) came after it. A rank
    whose file was never closed (its process killed, its machine lost) said nothing, and is said first: the others'
    errors are what its loss did to them."""
    failed = [m for m in metas if m.get("error")]
    if not failed:
        return None
    first = min(failed, key=lambda m: (m.get("ended_at") is None, m.get("ended_at") or ""))
    said = f"rank {first['rank']}: {first['error']}" if len(metas) > 1 and first.get("rank") is not None \
        else str(first["error"])
    lost = [m["rank"] for m in metas if m.get("status") == "incomplete" and not m.get("ended_at")
            and not m.get("error") and m.get("rank") is not None]
    if len(metas) > 1 and lost:
        which = f"rank {lost[0]}" if len(lost) == 1 else f"ranks {', '.join(map(str, lost))}"
        said = (f"{which} stopped without closing {'its file' if len(lost) == 1 else 'their files'} (a process "
                f"killed, or its machine lost); then {said}")
    return said


def _missing_files(metas: list[dict[str, Any]]) -> str | None:
    """Why a distributed run's files are fewer than it says it has, in one sentence; None where none is missing.

    Each rank file says how many the run has: an imported run, its trace files (``workload_args.trace_files``);
    a recording, its ``world_size``. A run being published (dpprof.store.publish), or left by a kill while it was,
    holds fewer, as does a recording whose other ranks' files are on other machines (``dpprof merge``)."""
    first = metas[0]
    if first.get("rank") is None:
        return None
    if first.get("source") == "trace":  # dpprof.store.model.TRACE_SOURCE (model imports this module)
        listing = (first.get("workload_args") or {}).get("trace_files")
        expected, what = (len(listing) if isinstance(listing, list) else None), "its trace files"
    else:
        size = first.get("world_size")
        expected, what = (size if isinstance(size, int) and not isinstance(size, bool) else None), "its ranks"
    held = sorted({m.get("rank") for m in metas}, key=lambda r: (r is None, r))
    if expected is None or len(held) >= expected:
        return None
    return (f"{len(held)} of the {expected} run files of {what} are here (rank{'s' if len(held) != 1 else ''} "
            f"{', '.join(map(str, held))}): the others were not written, gathered (dpprof merge) or published yet")


LISTING_COLUMNS = ["id", "name", "status", "created_at", "ended_at", "duration_s", "backend", "devices", "workload",
                   "steps", "ranks", "dropped_records", "error", "balanced", "check_of", "source", "path", "reason",
                   "copy_of", "damage"]  # list_runs' columns


def list_runs(reports_dir: str | os.PathLike[str] | None = None) -> pd.DataFrame:
    """Every run in the reports directory, one row each, and every unreadable file with its ``reason``.

    A torch.distributed run's rank files are one row (``ranks`` says how many); one holding fewer files than it
    says it has is ``incomplete``, its ``error`` saying how many. A staging directory that an import or merge killed
    before it finished left (dpprof.store.publish) is a row of status "interrupted import" or "interrupted merge"
    with its ``reason``.

    Returns:
        a DataFrame with id, name, status, created_at, ended_at, duration_s, backend (in words:
        dpprof.store.model.backend_label: "gloo" for a DDP recording on gloo, never "rank"), devices,
        workload, steps, ranks, dropped_records, error, balanced (recorded with the balanced model and
        criterion), check_of (the run it checks, for a run ``dpprof advise --check`` recorded; else None), source
        ("trace" for an imported trace, else None), path, reason (why the file is no readable run; None for
        readable runs), copy_of (for a file holding a copy of another run's file: that run's id; its own id is its
        file's name) and damage (what was wrong in the run's metadata, read as None: dpprof.store.validation),
        newest first; with no rows where the directory is not there yet.

    Raises:
        RunFileError: something that is no directory is where the reports directory should be (reports_dir_problem).
    """
    from dpprof.store.model import backend_label

    problem = reports_dir_problem(reports_dir)
    if problem is not None:  # a file where the directory should be: not "no runs"
        raise RunFileError(problem)
    rows: list[dict[str, Any]] = []
    by_id: dict[str, list[tuple[Path, dict[str, Any], dict[str, Any]]]] = {}
    for path in _candidates(resolve_reports_dir(reports_dir)):
        try:
            meta, summary = _open(path)
        except RunFileError as err:
            rows.append({"id": path.stem, "status": "unreadable", "path": str(path), "reason": str(err)})
            continue
        # a torch.distributed run's rank files are one run; any other file is its own (a copy too: never merged)
        meta = _as_copy(path, meta)
        by_id.setdefault(meta["id"] if meta.get("rank") is not None else str(path), []).append((path, meta, summary))
    for files in by_id.values():
        meta = _combine([m for _, m, _ in files])
        rows.append({**{k: meta[k] for k in ("id", "name", "status", "created_at", "ended_at",
                                              "workload", "error", "dropped_records")},
                     "copy_of": meta.get("copy_of"), "damage": "; ".join(meta.get("damage") or []) or None,
                     "backend": backend_label(meta),
                     "devices": ",".join(meta["devices"]), "steps": max(s["steps"] for _, _, s in files),
                     "ranks": len(files), "duration_s": _duration_s(meta), "path": str(files[0][0]),
                     "balanced": bool((meta.get("workload_args") or {}).get("balanced")),
                     "check_of": (meta.get("workload_args") or {}).get("check_of"),
                     "source": meta.get("source"), "reason": None})
    from dpprof.store.publish import interrupted

    rows += interrupted(resolve_reports_dir(reports_dir))  # imports and merges killed before they finished, with why
    df = pd.DataFrame(rows, columns=LISTING_COLUMNS)
    for count in ("steps", "ranks", "dropped_records"):  # whole numbers, missing for a file that is no run
        df[count] = pd.to_numeric(df[count], errors="coerce").round().astype("Int64")
    return df.sort_values("created_at", ascending=False, na_position="last", kind="stable").reset_index(drop=True)


def checks_under_their_runs(runs: pd.DataFrame) -> pd.DataFrame:
    """list_runs' rows with each run's checks (the runs ``dpprof advise --check`` recorded of it, ``check_of``)
    right after it, newest first among them; a check whose run is not in the listing stays where it was."""
    if runs.empty or runs["check_of"].isna().all():
        return runs
    present = set(runs["id"])
    checks = runs[runs["check_of"].notna() & runs["check_of"].isin(present)]
    order: list[int] = []
    for index, row in runs.iterrows():
        if index in checks.index:
            continue
        order.append(index)
        order.extend(checks.index[checks["check_of"] == row["id"]])
    return runs.loc[order]


def _duration_s(meta: dict[str, Any]) -> float | None:
    end = meta.get("ended_at") or meta.get("heartbeat_at")
    if not (meta.get("created_at") and end):
        return None
    return (datetime.fromisoformat(end) - datetime.fromisoformat(meta["created_at"])).total_seconds()


def _resolve(run: str | os.PathLike[str], directory: Path) -> Path:
    if not os.fspath(run).strip():  # a prefix of every id: never "the one run" of a directory holding one
        raise RunFileError("no run named: give a run id, a unique prefix of one, or a run file's path")
    path = Path(run)
    for candidate in (path, directory / f"{run}{RUN_SUFFIX}", directory / str(run)):
        if candidate.is_file():
            return candidate
        if os.path.lexists(candidate) and (candidate.name.endswith(RUN_SUFFIX) or candidate.is_symlink()):
            # there, but no regular file (a directory, a FIFO, a device, a dangling symlink): say what it is
            raise RunFileError(f"{candidate.name}: {why_not_regular(candidate)}")
    matches = [p for p in _candidates(directory) if p.name.startswith(str(run))]
    ids = {rank.group(1) if (rank := RANK_FILE.match(p.name)) else p.stem for p in matches}
    if len(ids) == 1:
        return min(matches, key=lambda p: _rank_of(p) or 0)
    if len(ids) > 1:
        raise RunFileError(f"{run!r} matches {len(ids)} runs in {directory}: {', '.join(sorted(ids)[:5])}")
    if os.sep in os.fspath(run) or (os.altsep and os.altsep in os.fspath(run)):
        # a path (no id has a separator, so it was never looked up in the directory): the file is not there
        raise RunFileError(f"no run file {os.fspath(run)!r}: no such file")
    problem = reports_dir_problem(directory)
    if problem is not None:  # not "no run": nothing in it could be
        raise RunFileError(f"no run {os.fspath(run)!r}: {problem}")
    raise RunFileError(f"no run {os.fspath(run)!r} in {directory} (dpprof runs lists them)")


def load_run(run: str | os.PathLike[str], reports_dir: str | os.PathLike[str] | None = None,
             read: str = "auto") -> StoredRun:
    """Open one run by id (or a unique id prefix) in the reports directory, or by path.

    A torch.distributed run is read from every rank file of it beside the one named. ``read`` says where
    figures come from: "auto" (a long run's aggregates, a short run's rows), "rows" or "aggregates" (a run of
    schema 1 has rows only).

    Raises:
        RunFileError: no such run, or the file is not a readable dpprof run (the message says why).
    """
    if read not in READS:
        raise ValueError(f"read must be one of {', '.join(READS)}, got {read!r}")
    path = _resolve(run, resolve_reports_dir(reports_dir))
    try:
        meta, _ = _open(path)
    except RunFileError as err:
        raise RunFileError(f"{path.name}: {err}") from None
    meta = _as_copy(path, meta)
    if meta.get("rank") is None:
        return StoredRun(path=path, meta=meta, read=read)
    files = sorted(path.parent.glob(f"{meta['id']}.rank*{RUN_SUFFIX}"), key=lambda p: _rank_of(p) or 0)
    metas, held = [], []
    for f in files:
        try:
            found = _as_copy(f, _open(f)[0])
        except RunFileError as err:
            raise RunFileError(f"{f.name}: {err}") from None
        if found.get("rank") is not None:  # not a copy of another run's rank file under this run's name
            metas.append(found)
            held.append(f)
    return StoredRun(path=held[0], meta=_combine(metas), paths=held, read=read)

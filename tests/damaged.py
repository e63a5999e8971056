"""Damaged copies of run files the CPU backend really recorded, for the tests of reading them (test_damaged.py):
one value set to what a damaged, edited or hostile file may hold, by SQL on a copy (never on the run itself)."""
from __future__ import annotations

import math
import random
import shutil
import sqlite3
from pathlib import Path

# What a damaged file may hold where a value belongs: text, NaN (SQLite stores it as NULL), infinities, huge and
# negative numbers, NULL, JSON that does not parse, an empty string.
BAD_VALUES = ("abc", math.nan, math.inf, -math.inf, 1e300, 2**62, -5, -1e-3, None, "{not json", "", "[1, 2]")


def damaged_copy(source: Path, target: Path, sql: str, params: tuple = ()) -> Path:
    """A copy of the run file ``source`` at ``target``, with ``sql`` run on the copy."""
    shutil.copyfile(source, target)
    con = sqlite3.connect(target)
    try:
        con.execute(sql, params)
        con.commit()
    finally:
        con.close()
    return target


def _tables(con: sqlite3.Connection) -> list[str]:
    return [r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")]


def tables_with_rows(path: Path) -> list[str]:
    """The tables of the run file ``path`` that hold at least one row, by name."""
    con = sqlite3.connect(path)
    try:
        return [t for t in _tables(con) if con.execute(f"SELECT EXISTS(SELECT 1 FROM {t})").fetchone()[0]]
    finally:
        con.close()


def mutate(path: Path, rng: random.Random, table: str | None = None) -> str:
    """Set one value of the run file ``path`` (in ``table``, or a random table with rows; a random column and row)
    to one of BAD_VALUES, in place; returns what was done, for a failing test's message."""
    tables = [table] if table is not None else tables_with_rows(path)
    con = sqlite3.connect(path)
    try:
        for _ in range(50):  # a mutation the file's constraints refuse (a duplicate key) is tried again
            table = rng.choice(tables)
            info = con.execute(f"PRAGMA table_info({table})").fetchall()
            column = rng.choice([r[1] for r in info])
            keys = [r[1] for r in info if r[5]] or ["rowid"]
            rows = con.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0]
            where = con.execute(f"SELECT {', '.join(keys)} FROM {table} LIMIT 1 OFFSET ?",
                                (rng.randrange(rows),)).fetchone()
            value = rng.choice(BAD_VALUES)
            if table == "meta" and column == "key":
                continue  # a file without its format key is no dpprof run: tested on its own
            try:
                con.execute(f'UPDATE {table} SET "{column}" = ? WHERE {" AND ".join(f"{k} IS ?" for k in keys)}',
                            (value, *where))
            except sqlite3.IntegrityError:
                continue
            con.commit()
            return f"{table}.{column} = {value!r} where {dict(zip(keys, where))}"
        raise AssertionError(f"no mutation of {path} was accepted")
    finally:
        con.close()

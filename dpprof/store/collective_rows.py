"""Each rank's collectives, read one rank file at a time: what dpprof.findings.collectives streams over, so a run of
many ranks is matched in memory bounded by one rank's comms table."""
from __future__ import annotations

import sqlite3
from collections.abc import Iterator

import pandas as pd

from dpprof.store.reader import RunFileError, StoredRun, named_collectives

__all__ = ["rank_collectives"]


def rank_collectives(run: StoredRun) -> Iterator[tuple[int, pd.DataFrame]]:
    """(rank, its comms rows: step, launch_ms, duration_ms, collective) for each of the run's files in turn, over the
    steps whose detail stands for the run (RunModel.sampled_steps_sql)."""
    sampled = run.model.sampled_steps_sql()
    for path in run.paths:
        with run.connect(path) as con:
            try:
                rows = named_collectives(pd.read_sql_query("SELECT step, launch_ms, duration_ms, collective FROM comms "
                                                           f"WHERE {sampled}", con))
            except (sqlite3.DatabaseError, pd.errors.DatabaseError) as err:
                raise RunFileError(f"{path.name}: corrupt comms: {err}") from None
        yield run.file_rank(path), rows

"""The run store: what is written is what is read, whatever happens to the process or the files."""
from __future__ import annotations

import gc
import hashlib
import os
import re
import shutil
import sqlite3
import subprocess
import sys
import time
from dataclasses import astuple
from pathlib import Path

import forked
import pandas as pd
import pytest
import torch
from torch import nn

import dpprof
from dpprof.store.reader import RunFileError
from dpprof.cli import main
from dpprof.records import (ALL_REDUCE, COMM_ROW, MEMORY_ROW, PHASE_ROW, STEP_ROW, CommRecord, DeviceMemoryRecord,
                            PhaseRecord, StepRecord, record_of_row)
from dpprof.store import writer
from dpprof.store.collective_rows import rank_collectives
from dpprof.store.writer import SqliteSink
from dpprof.views.text import dropped_records
from recorded import killed_child, record, record_until_killed


def _record(steps=4, store=True, workers=2, name="run"):
    torch.manual_seed(0)
    net = dpprof.DataParallel(nn.Linear(5, 2), device_ids=dpprof.cpu_devices(workers))
    with dpprof.record(name=name, store=store) as run:
        for _ in range(steps):
            with run.step():
                net(torch.randn(7, 5)).sum().backward()
    return run


def test_records_written_equal_records_read(reports):
    mem = _record(store=False)
    path = str(reports / "copy.sqlite")
    reports.mkdir(exist_ok=True)
    sink = SqliteSink(path, mem.metadata())
    for table in mem.sink.tables.values():
        for rec in table:
            sink.put(rec)
    sink.close()
    stored = dpprof.load_run(path)
    expected = mem.frames()
    # a CPU run has no allocator or GPU samples (and findings are computed after close)
    assert {t for t, df in expected.items() if len(df)} == {"steps", "phases", "memory", "devices", "notes"}
    for table, df in expected.items():
        got = stored.table(table)
        assert len(got) == len(df)
        # every table read carries the file's rank: 0 for a one-file run
        assert list(got.columns) == [*df.columns, "rank"] and (got["rank"] == 0).all()
        pd.testing.assert_frame_equal(got.drop(columns="rank").reset_index(drop=True), df.reset_index(drop=True),
                                      check_dtype=False)


def test_a_row_is_stored_as_its_record_is(reports):
    """The hot path's rows (dpprof.records.Row) and the records they stand for make the same run file."""
    mem = _record(store=False)
    reports.mkdir(exist_ok=True)
    stored = {}
    for kind in ("records", "rows"):
        sink = SqliteSink(str(reports / f"{kind}.sqlite"), mem.metadata())
        for table, recs in mem.sink.tables.items():
            for rec in recs:
                as_row = kind == "rows" and table in (PHASE_ROW, COMM_ROW, STEP_ROW, MEMORY_ROW)
                sink.put((table, *astuple(rec)) if as_row else rec)
        sink.put(CommRecord(0, "rank:0", 0, 1024, 1.5, 0.25, "all-gather") if kind == "records"
                 else (COMM_ROW, 0, "rank:0", 0, 1024, 1.5, 0.25, "all-gather"))
        sink.close()
        stored[kind] = dpprof.load_run(reports / f"{kind}.sqlite")
    assert len(stored["rows"].table("phases")) == len(mem.sink.tables["phases"]) > 0
    for table in ("steps", "phases", "memory", "comms"):
        pd.testing.assert_frame_equal(stored["rows"].table(table), stored["records"].table(table))
    keys = {"phase_blocks": ["block", "phase", "device"], "step_blocks": ["block"], "memory_blocks": ["block", "device"]}
    for table, key in keys.items():  # the per-block aggregates the writer keeps from them
        blocks = {kind: pd.read_sql(f"SELECT * FROM {table}", sqlite3.connect(run.path)).sort_values(
            key, ignore_index=True) for kind, run in stored.items()}
        assert len(blocks["rows"]) > 0
        pd.testing.assert_frame_equal(blocks["rows"], blocks["records"])
    assert record_of_row((COMM_ROW, 0, "rank:0", 0, 1024, 1.5, 0.25, None)) == CommRecord(0, "rank:0", 0, 1024, 1.5,
                                                                                         0.25)


def test_the_rows_a_step_leaves_for_the_writer_leave_the_garbage_collectors_lists(reports, monkeypatch):
    """What the training thread hands the writer is not tracked by the garbage collector once it has lived through
    one collection: records waiting for the next commit would otherwise be moved into the oldest generation and set
    off full collections of the whole process (dpprof.records.Row)."""
    monkeypatch.setattr(writer, "FLUSH_INTERVAL_S", 600.0)  # nothing committed while the steps run
    torch.manual_seed(0)
    net = dpprof.DataParallel(nn.Linear(5, 2), device_ids=dpprof.cpu_devices(2))
    with dpprof.record(name="rows") as run:
        for _ in range(3):
            with run.step():
                net(torch.randn(7, 5)).sum().backward()
        waiting = list(run.sink._buffer)
        rows = [r for r in waiting if isinstance(r, tuple)]
        gc.collect()
        assert not [r for r in rows if gc.is_tracked(r)]
        made = [record_of_row(r) for r in rows]
    # every step, phase and device's memory of the steps is a row: scatter, replicate, parallel_apply, each worker's
    # apply, gather, backward
    phases = [r for r in made if isinstance(r, PhaseRecord)]
    assert {r.phase for r in phases} == {"scatter", "replicate", "parallel_apply", "apply", "gather", "backward"}
    stored = dpprof.load_run(run.path)
    assert len(phases) == len(stored.table("phases"))
    assert sum(isinstance(r, StepRecord) for r in made) == len(stored.table("steps")) == 3
    assert sum(isinstance(r, DeviceMemoryRecord) for r in made) == len(stored.table("memory")) == 6


def test_a_recorded_run_lands_in_reports_with_its_metadata(reports):
    run = _record(steps=3, name="meta check")
    assert os.path.dirname(run.path) == str(reports)
    listed = dpprof.list_runs()
    assert listed[["id", "name", "status", "backend", "devices", "steps"]].values.tolist() == [
        [run.id, "meta check", "finished", "cpu", "cpu:0,cpu:1", 3]]
    stored = dpprof.load_run(run.id)
    assert stored.meta["pid"] == os.getpid() and stored.meta["torch_version"] == torch.__version__
    assert stored.meta["devices"] == ["cpu:0", "cpu:1"] and stored.meta["ended_at"]
    assert not any(p.name.endswith(("-wal", "-shm")) for p in reports.iterdir())  # one file per run
    assert dpprof.load_run(run.id[:12]).id == run.id  # a unique prefix is enough


def test_run_ids_sort_by_time_and_differ_within_a_second():
    from datetime import datetime, timezone

    from dpprof.store.ids import new_run_id

    now = datetime(2026, 11, 23, 9, 5, 7, tzinfo=timezone.utc)
    ids = {new_run_id(now) for _ in range(50)}
    assert len(ids) == 50 and all(re.fullmatch(r"20261123-090507-[0-9a-f]{6}", i) for i in ids)
    assert new_run_id(now) < new_run_id(now.replace(second=8))




def test_sigkill_leaves_an_incomplete_run_holding_every_committed_step(reports):
    path, last, _, _ = record_until_killed(killed_child(), 30, {"DPPROF_REPORTS": str(reports)})
    stored = dpprof.load_run(path)
    assert stored.meta["status"] == "incomplete"
    steps = stored.steps["step"].tolist()
    assert steps == list(range(len(steps))) and len(steps) > last
    phases = stored.phases[stored.phases["step"].isin(steps)]
    assert (phases.groupby("step")["phase"].nunique() == 6).all()
    listed = dpprof.list_runs()
    assert listed.loc[0, "status"] == "incomplete" and pd.isna(listed.loc[0, "reason"])


@pytest.mark.slow
def test_four_processes_recording_at_once_each_get_a_whole_run(reports):
    cmd = [sys.executable, "-m", "dpprof", "profile", "tutorial-linear", "--steps", "15", "--devices",
           "cpu:2", "--quiet"]
    procs = [forked.Popen(cmd + ["--name", f"p{i}"], env={**os.environ, "DPPROF_REPORTS": str(reports)},
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for i in range(4)]
    for p in procs:
        assert p.wait(timeout=120) == 0, p.stderr.read()
    runs = dpprof.list_runs()
    assert sorted(runs["name"]) == ["p0", "p1", "p2", "p3"]
    assert runs["id"].nunique() == 4 and (runs["status"] == "finished").all() and (runs["steps"] == 15).all()


def _sha(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def test_bad_files_are_listed_with_a_reason_and_never_break_listing(reports):
    good = _record(steps=2, name="good")
    good_hash = _sha(good.path)
    size = os.path.getsize(good.path)
    with open(good.path, "rb") as f:
        (reports / "truncated.sqlite").write_bytes(f.read(size // 3))
    (reports / "garbage.sqlite").write_bytes(b"this is not a database" * 50)
    (reports / "empty.sqlite").write_bytes(b"")
    (reports / "notes.txt").write_text("hello")
    foreign = sqlite3.connect(reports / "foreign.sqlite")
    foreign.execute("CREATE TABLE t (x)")
    foreign.commit()
    foreign.close()
    newer = reports / "newer.sqlite"
    shutil.copy(good.path, newer)
    con = sqlite3.connect(newer)
    con.execute("UPDATE meta SET value = '99' WHERE key = 'schema_version'")
    con.commit()
    con.close()

    runs = dpprof.list_runs().set_index("path")
    reasons = {os.path.basename(p): r for p, r in runs["reason"].items()}
    assert pd.isna(reasons[os.path.basename(good.path)])
    assert "corrupt" in reasons["truncated.sqlite"] or "malformed" in reasons["truncated.sqlite"]
    assert reasons["garbage.sqlite"] == "not a dpprof run: not an SQLite file"
    assert reasons["notes.txt"] == "not a dpprof run: not an SQLite file"
    assert reasons["empty.sqlite"] == "empty file"
    assert "without dpprof's meta table" in reasons["foreign.sqlite"]
    assert "newer dpprof (schema 99" in reasons["newer.sqlite"]
    for name in ("truncated", "garbage", "foreign", "newer"):
        with pytest.raises(RunFileError):
            dpprof.load_run(reports / f"{name}.sqlite")
    assert _sha(good.path) == good_hash  # reading changed nothing


def test_a_full_buffer_drops_and_counts_records_without_blocking(reports):
    mem = _record(steps=5, store=False)
    records = [r for table in mem.sink.tables.values() for r in table]
    reports.mkdir(exist_ok=True)
    path = str(reports / "overflow.sqlite")
    sink = SqliteSink(path, mem.metadata(), max_buffered=10, flush_interval_s=60)
    t0 = time.perf_counter()
    for rec in records:
        sink.put(rec)
    assert time.perf_counter() - t0 < 1.0  # never waits on the writer
    assert sink.dropped == len(records) - 10
    sink.close()
    stored = dpprof.load_run(path)
    assert stored.meta["dropped_records"] == len(records) - 10
    assert sum(len(stored.table(t)) for t in ("steps", "phases", "memory", "allocator")) == 10


def test_records_put_through_the_fast_append_are_bounded_and_counted_when_the_writer_falls_behind(reports, monkeypatch):
    """Far from full, a probe puts its call's records with the buffer's own append (SqliteSink.put): a writer that
    falls behind still leaves the buffer at its limit, and every record is stored or counted as dropped."""
    monkeypatch.setattr(writer, "FLUSH_INTERVAL_S", 60)  # no commit until close: the writer has fallen behind
    monkeypatch.setattr(writer, "PUT_HEADROOM", 20)  # over one step's records of this run (11)
    reports.mkdir(exist_ok=True)
    made = sum(len(t) for t in _record(steps=40, store=False).sink.tables.values())
    torch.manual_seed(0)
    net = dpprof.DataParallel(nn.Linear(5, 2), device_ids=dpprof.cpu_devices(2))
    most = 0
    with dpprof.record(name="behind") as run:
        run.sink._max = 100
        for _ in range(40):
            with run.step():
                net(torch.randn(7, 5)).sum().backward()
            most = max(most, len(run.sink._buffer))
    assert most == 100 and made > 300
    stored = dpprof.load_run(run.path)
    kept = sum(len(stored.table(t)) for t in ("steps", "phases", "memory", "devices", "notes"))
    assert kept == 100 and stored.meta["dropped_records"] == made - kept


def test_a_run_that_dropped_records_says_so_in_one_sentence_wherever_it_is_shown(reports, capsys):
    mem = _record(steps=5, store=False)
    records = [r for table in mem.sink.tables.values() for r in table]
    reports.mkdir(exist_ok=True)
    sink = SqliteSink(str(reports / "overflow.sqlite"), mem.metadata(), max_buffered=10, flush_interval_s=60)
    for rec in records:
        sink.put(rec)
    sink.close()
    stored = dpprof.load_run(reports / "overflow.sqlite")
    said = dropped_records(stored.meta)
    assert said == f"{len(records) - 10:,} records were dropped: the writer fell behind"
    assert main(["show", str(reports / "overflow.sqlite")]) == 0
    assert f"  warning: {said}\n" in capsys.readouterr().out
    whole = dpprof.load_run(_record(steps=2).path)
    assert whole.meta["dropped_records"] == 0 and dropped_records(whole.meta) is None


def test_unknown_run_is_a_clear_error(reports):
    _record(steps=1)
    with pytest.raises(RunFileError, match="no run 'nope'"):
        dpprof.load_run("nope")
    for empty in ("", "  "):  # a prefix of every id: not the directory's one run
        with pytest.raises(RunFileError, match="no run named: give a run id, a unique prefix of one"):
            dpprof.load_run(empty)


def test_a_reader_holding_the_file_while_the_run_closes_changes_nothing(reports, monkeypatch, caplog):
    import dpprof.store.writer as writer
    monkeypatch.setattr(writer, "FOLD_RETRY_S", 0.2)
    torch.manual_seed(0)
    net = dpprof.DataParallel(nn.Linear(5, 2), device_ids=dpprof.cpu_devices(2))
    with dpprof.record(name="watched") as run:
        for _ in range(3):
            net(torch.randn(4, 5)).sum().backward()
        time.sleep(0.7)  # the writer has committed
        reader = sqlite3.connect(f"file:{run.path}?mode=ro", uri=True)
        assert reader.execute("SELECT COUNT(*) FROM steps").fetchone()[0] >= 2  # reading a running run
    try:
        assert dpprof.load_run(run.id).meta["status"] == "finished"  # closed, whole, readable
        assert len(dpprof.load_run(run.id).steps) == 3
        assert "stays in WAL mode" in caplog.text
    finally:
        reader.close()


def test_a_file_older_than_a_table_or_column_the_schema_added_still_reads(reports):
    run = _record(steps=2, name="older")
    old = reports / "older.sqlite"
    shutil.copy(run.path, old)
    con = sqlite3.connect(old)
    con.execute("DROP TABLE comms")
    con.execute("DROP TABLE gpu_time")
    con.execute("ALTER TABLE runs DROP COLUMN world_size")
    con.execute("ALTER TABLE runs DROP COLUMN source")
    con.execute("ALTER TABLE findings DROP COLUMN unit")
    con.commit()
    con.close()
    stored = dpprof.load_run(old)
    assert "unit" in stored.findings.columns  # a column a record type gained since: NULL
    assert stored.meta["world_size"] is None and stored.meta["source"] is None and stored.meta["name"] == "older"
    assert stored.comms.empty and list(stored.comms.columns) == [
        "step", "device", "bucket", "bucket_bytes", "launch_ms", "duration_ms", "collective", "rank"]
    assert stored.gpu_time.empty
    assert len(stored.steps) == 2


def test_a_ddp_run_stores_what_its_collectives_are_and_an_older_file_reads_the_same(profiled, tmp_path, capsys):
    """A recorded DDP rank stores each bucket's collective (records.ALL_REDUCE) as it records it; a run file written
    before, whose comms hold NULL there, reads the same everywhere: its comms table, the collectives the straggler
    matching streams (store.collective_rows), every CSV of dpprof export and dpprof show."""
    new, old = tmp_path / "new", tmp_path / "old"
    profiled(new, "tutorial-linear", "--ddp", "--nproc", "2", "--steps", "4")  # recorded once a session
    profiled(old, "tutorial-linear", "--ddp", "--nproc", "2", "--steps", "4")
    [run_id] = dpprof.list_runs(new)["id"]
    for path in sorted(old.glob("*.sqlite")):
        with sqlite3.connect(path) as con:
            assert {c for (c,) in con.execute("SELECT DISTINCT collective FROM comms")} == {ALL_REDUCE}
            con.execute("UPDATE comms SET collective = NULL")  # as every DDP run recorded before stored it
        con.close()
    read = {}
    for directory in (new, old):
        run = dpprof.load_run(run_id, directory)
        assert main(["--reports-dir", str(directory), "export", run_id, "--out", str(directory / "csv")]) == 0
        capsys.readouterr()  # the files it wrote
        assert main(["--reports-dir", str(directory), "show", run_id]) == 0
        read[directory] = (run.comms, [rows for _, rows in rank_collectives(run)], capsys.readouterr().out,
                           {p.name: p.read_bytes() for p in sorted((directory / "csv").glob("*.csv"))})
    assert set(read[old][0]["collective"]) == {ALL_REDUCE} and len(read[old][0]) >= 8
    pd.testing.assert_frame_equal(read[old][0], read[new][0])
    for mine, theirs in zip(read[old][1], read[new][1], strict=True):
        pd.testing.assert_frame_equal(mine, theirs)
    assert read[old][2] == read[new][2]
    assert read[old][3] == read[new][3] and b"all-reduce" in read[old][3]["comms.csv"]


def test_list_runs_and_load_run_take_reports_dir_by_name_as_the_docs_and_record_do(tmp_path, monkeypatch):
    # their argument was named reports_dir_: dpprof.list_runs(reports_dir=...) as docs/api.md writes it was a TypeError
    monkeypatch.setenv("DPPROF_REPORTS", str(tmp_path / "elsewhere"))
    run = record(tmp_path, "by name", workers=2, steps=2, batch_size=8, workload="tutorial-linear")
    assert dpprof.list_runs(reports_dir=tmp_path)["id"].tolist() == [run.id]
    assert dpprof.load_run(run.id, reports_dir=tmp_path).meta["name"] == "by name"
    assert dpprof.list_runs(tmp_path)["id"].tolist() == [run.id]  # by position, as before
    with pytest.raises(RunFileError, match=f"no run 'nope' in {re.escape(str(tmp_path))}"):
        dpprof.load_run("nope", reports_dir=tmp_path)


def test_list_runs_of_a_file_given_for_the_reports_directory_says_so_and_leaves_it(tmp_path):
    """A run's own file given as the reports directory: list_runs raises what `dpprof runs` says (it returned no runs
    without a word); a directory not made yet is still no runs."""
    run = record(tmp_path, "kept", workers=2, steps=2, batch_size=8, workload="tutorial-linear")
    before = Path(run.path).read_bytes()
    with pytest.raises(RunFileError) as err:
        dpprof.list_runs(run.path)
    assert str(err.value) == f"the reports directory {run.path} is an existing file, not a directory"
    assert Path(run.path).read_bytes() == before
    assert dpprof.list_runs(tmp_path / "not yet").empty


def test_a_recording_leaves_another_programs_wal_database_in_its_directory_as_it_is(reports):
    """A SQLite file of another program in the reports directory, in WAL mode with its log beside it and a `runs`
    table of its own: a recording, which folds back the logs runs left on a full disk, never switched it out of WAL."""
    reports.mkdir()
    other = reports / "tracker.sqlite"
    script = f"""
import os, sqlite3
con = sqlite3.connect({str(other)!r})
con.execute("PRAGMA journal_mode=WAL")
con.execute("CREATE TABLE runs (id INTEGER, status TEXT)")
con.execute("INSERT INTO runs VALUES (1, 'done')")
con.commit()
os._exit(0)  # its log stays beside it, as a program that has not closed the database leaves it
"""
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    before = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in reports.iterdir()}
    assert sorted(before) == ["tracker.sqlite", "tracker.sqlite-shm", "tracker.sqlite-wal"]
    net = dpprof.DataParallel(nn.Linear(5, 2), device_ids=dpprof.cpu_devices(2))
    with dpprof.record(name="beside", reports_dir=reports) as run:
        with run.step():
            net(torch.randn(8, 5)).sum().backward()
    after = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in reports.iterdir() if p != Path(run.path)}
    assert sorted(after) == sorted(before)
    # the database and its log as they were (-shm is SQLite's scratch index of the log, which any reader updates)
    assert {k: v for k, v in after.items() if not k.endswith("-shm")} == \
        {k: v for k, v in before.items() if not k.endswith("-shm")}
    con = sqlite3.connect(f"{other.as_uri()}?mode=ro", uri=True)
    try:
        assert con.execute("PRAGMA journal_mode").fetchone() == ("wal",)
    finally:
        con.close()

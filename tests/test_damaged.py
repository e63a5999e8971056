"""Reading damaged run files (dpprof.store.validation through dpprof.store.reader): copies of runs the CPU backend
really records and of an imported shared trace, each with bad values set by SQL; a copy of a run; files named *.sqlite
that are no regular files; and a seeded fuzz over every table. Whatever one file holds, ``dpprof runs``, ``show``,
``export``, ``advise`` and every dashboard page raise nothing, the other runs read as before, and no file is changed.
"""
from __future__ import annotations

import hashlib
import math
import os
import random
import shutil
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest
from streamlit.testing.v1 import AppTest

from damaged import damaged_copy, mutate, tables_with_rows
import forked
from dpprof.cli import main
from dpprof.store import queries
from dpprof.store.reader import list_runs, load_run
from dpprof.store.retention import Retention
from dpprof.trace.importer import import_traces
import fake_pynvml
from recorded import (BUS, killed_child, record, record_failed, record_straggler, record_until_killed,
                      record_with_gpu_samples)

ROOT = Path(__file__).resolve().parents[1]
APP = ROOT / "app.py"
TRACES = ROOT.parent / "shared" / "traces"
PAGES = ["runs", "overview", "load", "timeline", "advise", "compare", "devices", "new_run", "export"]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from app_pages import common  # noqa: E402  (the module object the app's pages use)


@pytest.fixture(scope="module")
def sound(tmp_path_factory):
    """A run recorded on 2 CPU workers and one rank of a real DDP trace imported: the files damaged copies start from."""
    directory = tmp_path_factory.mktemp("sound")
    plain = record(directory, "plain", workers=2, steps=6, batch_size=32)
    imported = import_traces([TRACES / "ddp-2ranks-rank0-nccl.json.gz"], directory)
    return SimpleNamespace(dir=directory, plain=plain, trace=load_run(imported.paths[0]))


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _with_bad_copy(reports: Path, source: Path, sql: str, params: tuple = (), name: str = "bad.sqlite"):
    """The reports directory holding ``source`` as it is and a copy of it named ``name`` with ``sql`` run on it."""
    reports.mkdir(exist_ok=True)
    good = reports / source.name
    shutil.copyfile(source, good)
    return good, damaged_copy(source, reports / name, sql, params)


def _finite(values) -> bool:
    return all(v is None or not isinstance(v, float) or math.isfinite(v) for v in values)


def test_a_schema_version_that_is_no_number_lists_the_file_with_its_reason(reports, sound, capsys):
    good, bad = _with_bad_copy(reports, sound.plain.path, "UPDATE meta SET value = 'abc' WHERE key = 'schema_version'")
    runs = list_runs(reports).set_index("path")
    reason = "corrupt: meta.schema_version is 'abc', not a schema number"
    assert runs.at[str(bad), "status"] == "unreadable" and runs.at[str(bad), "reason"] == reason
    assert runs.at[str(good), "status"] == "finished" and runs.at[str(good), "devices"] == "cpu:0,cpu:1"
    code, out, _ = _cli(capsys, "runs")
    assert code == 0 and f"unreadable: {bad}: {reason}" in out
    for command in (["show", "bad"], ["export", "bad", "--out", str(reports.parent / "csv")]):
        code, out, err = _cli(capsys, *command)
        assert code == 1 and err == f"dpprof: bad.sqlite: {reason}\n", command
    assert _cli(capsys, "show", sound.plain.id)[0] == 0


@pytest.mark.parametrize("value", [None, "", "../x", "a*", "a\nb"])
def test_a_run_id_that_names_no_file_makes_the_file_unreadable(reports, sound, capsys, value):
    good, bad = _with_bad_copy(reports, sound.plain.path, "UPDATE runs SET id = ?", (value,))
    runs = list_runs(reports).set_index("path")
    assert runs.at[str(bad), "reason"] == f"corrupt: runs.id is {value!r}, not a run id"
    assert pd.isna(runs.at[str(good), "reason"])
    assert _cli(capsys, "show", "bad")[0] == 1 and _cli(capsys, "runs")[0] == 0


META_CASES = [  # SQL on the runs row, and the one line each bad value gets
    ("UPDATE runs SET devices = '{not json'", ["runs.devices is '{not json', not a JSON list of device names"]),
    ("UPDATE runs SET created_at = 'not a date', ended_at = '2026-13-45'",
     ["runs.ended_at is '2026-13-45', not a date", "runs.created_at is 'not a date', not a date"]),
    ("UPDATE runs SET workload_args = '[1, 2]', detail = '{\"every\": \"abc\"}'",
     ["runs.workload_args is '[1, 2]', not a JSON object",
      "runs.detail is '{\"every\": \"abc\"}', not a retention (read with dpprof's default)"]),
    ("UPDATE runs SET rank = 'abc', dropped_records = 1e300, pid = -5",
     ["runs.pid is -5, not a whole number", "runs.rank is 'abc', not a whole number",
      "runs.dropped_records is 1e+300, not a whole number"]),
    ("UPDATE runs SET status = 'running', heartbeat_at = 'soon', name = x'41'",
     ["runs.name is b'A', not text", "runs.heartbeat_at is 'soon', not a date"]),
]


@pytest.mark.parametrize("sql,said", META_CASES, ids=[c[0].split("SET ")[1][:30] for c in META_CASES])
def test_a_bad_value_in_the_runs_row_reads_as_missing_with_its_reason(reports, sound, capsys, sql, said):
    good, bad = _with_bad_copy(reports, sound.plain.path, sql)
    before = _digest(bad)
    runs = list_runs(reports).set_index("path")
    assert pd.isna(runs.at[str(bad), "reason"])  # readable: listed, and opened as far as it can be
    assert sorted(runs.at[str(bad), "damage"].split("; ")) == sorted(said)
    assert pd.isna(runs.at[str(good), "damage"]) and runs.at[str(good), "devices"] == "cpu:0,cpu:1"
    code, out, _ = _cli(capsys, "runs")
    assert code == 0 and f"damaged: bad: {runs.at[str(bad), 'damage']}" in out
    code, out, _ = _cli(capsys, "show", "bad")
    assert code == 0 and all(f"  damaged: {line}\n" in out for line in said)
    assert "median" in out  # its steps are all there
    assert _cli(capsys, "export", "bad", "--out", str(reports.parent / "csv"))[0] == 0
    assert _cli(capsys, "export", "bad", "--trace", str(reports.parent / "bad.json"))[0] == 0
    assert load_run("bad").damage == runs.at[str(bad), "damage"].split("; ")
    assert _digest(bad) == before


ROW_CASES = [  # a value set in one row of step 2 (of 0-5)
    ("steps", "duration_ms", "abc"), ("steps", "duration_ms", None), ("steps", "duration_ms", -5.0),
    ("steps", "duration_ms", math.inf), ("steps", "step", 1e300), ("steps", "start_ms", -math.inf),
    ("phases", "duration_ms", "abc"), ("phases", "start_ms", math.inf), ("phases", "device", None),
    ("phases", "step", -1), ("memory", "activation_bytes", -1), ("memory", "input_bytes", 1e300),
    ("memory", "device", b"\x00"), ("memory", "step", "two"),
]
WANTED = {"start_ms": "a number from -1e+15 to 1e+15", "device": "text"}  # else a number from 0 to 1e+15


@pytest.mark.parametrize("table,column,value", ROW_CASES, ids=[f"{t}.{c}={v!r}" for t, c, v in ROW_CASES])
def test_a_row_with_a_bad_value_is_left_out_and_counted(reports, sound, capsys, table, column, value):
    sql = f'UPDATE {table} SET "{column}" = ? WHERE rowid = (SELECT MIN(rowid) FROM {table} WHERE step = 2)'
    good, bad = _with_bad_copy(reports, sound.plain.path, sql, (value,))
    before = _digest(bad)
    run = load_run("bad")
    wanted = WANTED.get(column, "a number from 0 to 1e+15")
    assert run.damage == [f"{table}: 1 row left out ({column} not {wanted})"]
    assert len(run.table(table)) == len(sound.plain.table(table)) - 1
    stats = queries.run_stats(run)
    assert stats["steps"] == run.model.steps == (5 if table == "steps" else 6) and _finite(stats.values())
    assert stats["median_step_ms"] >= 0 and stats["mean_step_ms"] >= 0
    assert queries.run_stats(load_run(good.stem)) == queries.run_stats(sound.plain)  # the other run reads as before
    code, out, _ = _cli(capsys, "show", "bad")
    assert code == 0 and f"  damaged: {run.damage[0]}\n" in out and "inf" not in out and "nan" not in out.lower()
    assert _cli(capsys, "export", "bad", "--out", str(reports.parent / "csv"))[0] == 0
    assert _cli(capsys, "export", "bad", "--trace", str(reports.parent / "bad.json.gz"))[0] == 0
    assert _digest(bad) == before


def test_advise_reads_a_run_whose_step_duration_is_text(reports, sound, capsys, calibration_home, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(calibration_home))
    _with_bad_copy(reports, sound.plain.path, "UPDATE steps SET duration_ms = 'abc' WHERE step = 3")
    code, out, err = _cli(capsys, "advise", "bad")
    assert code == 0, err
    assert "run bad  'plain': DataParallel on 2 CPU workers" in out
    assert "over 5 steps" in out  # the 6 recorded less the one left out


def test_a_copy_of_a_run_is_a_run_of_its_own(reports, sound, capsys):
    reports.mkdir()
    original = reports / sound.plain.path.name
    shutil.copyfile(sound.plain.path, original)
    shutil.copyfile(original, reports / "backup.sqlite")  # cp RUN.sqlite backup.sqlite
    runs = list_runs(reports).set_index("id")
    assert sorted(runs.index) == sorted([sound.plain.id, "backup"])
    assert runs.at[sound.plain.id, "devices"] == runs.at["backup", "devices"] == "cpu:0,cpu:1"  # never merged
    assert runs.at["backup", "copy_of"] == sound.plain.id and pd.isna(runs.at[sound.plain.id, "copy_of"])
    assert runs.at["backup", "ranks"] == runs.at[sound.plain.id, "ranks"] == 1
    copy, run = load_run("backup"), load_run(sound.plain.id)
    assert (copy.id, copy.path.name, copy.meta["copy_of"]) == ("backup", "backup.sqlite", sound.plain.id)
    assert run.id == sound.plain.id and run.path == original and run.meta["devices"] == ["cpu:0", "cpu:1"]
    assert queries.run_stats(copy) == queries.run_stats(run)
    code, out, _ = _cli(capsys, "runs")
    assert code == 0 and f"copy: backup is a copy of run {sound.plain.id}" in out
    code, out, _ = _cli(capsys, "show", "backup")
    assert code == 0 and out.startswith("run backup ") and f"a copy of run {sound.plain.id}" in out


def test_a_copy_of_a_rank_file_under_another_name_is_a_run_of_its_own(reports, sound):
    reports.mkdir()
    rank = reports / sound.trace.path.name
    shutil.copyfile(sound.trace.path, rank)
    shutil.copyfile(rank, reports / "rank-backup.sqlite")
    runs = list_runs(reports).set_index("id")
    assert runs.at[sound.trace.id, "ranks"] == 1 and runs.at[sound.trace.id, "devices"] == "rank:0"
    assert runs.at["rank-backup", "copy_of"] == sound.trace.id and runs.at["rank-backup", "devices"] == "rank:0"
    assert load_run("rank-backup").paths == [reports / "rank-backup.sqlite"]
    assert load_run(sound.trace.id).paths == [rank]


def _fifo_directory(reports: Path, sound) -> dict[str, str]:
    """The reports directory holding a run and, named *.sqlite, a directory, a FIFO, a symlink to /dev/zero and a
    dangling symlink; returns each one's name and the reason it is listed with."""
    reports.mkdir()
    shutil.copyfile(sound.plain.path, reports / sound.plain.path.name)
    (reports / "dir.sqlite").mkdir()
    os.mkfifo(reports / "fifo.sqlite")
    (reports / "zero.sqlite").symlink_to("/dev/zero")
    (reports / "gone.sqlite").symlink_to(reports / "nowhere.sqlite")
    return {"dir.sqlite": "not a regular file: a directory", "fifo.sqlite": "not a regular file: a FIFO (named pipe)",
            "zero.sqlite": "not a regular file: a character device (symlink to /dev/zero)",
            "gone.sqlite": f"dangling symlink to {reports / 'nowhere.sqlite'}: its target does not exist"}


def test_a_directory_fifo_device_or_dangling_symlink_named_sqlite_is_listed_with_why(reports, sound):
    expected = _fifo_directory(reports, sound)
    # in a child process with a deadline: opening the FIFO would block it for good
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = forked.run([sys.executable, "-m", "dpprof", "runs"], capture_output=True, text=True, timeout=120,
                      env=env)
    assert done.returncode == 0, done.stderr
    for name, reason in expected.items():
        assert f"unreadable: {reports / name}: {reason}\n" in done.stdout
    assert sound.plain.id in done.stdout
    for name, reason in expected.items():
        done = forked.run([sys.executable, "-m", "dpprof", "show", name], capture_output=True, text=True,
                          timeout=120, env=env)
        assert (done.returncode, done.stderr) == (1, f"dpprof: {name}: {reason}\n")
    runs = list_runs(reports).set_index("path")
    assert {Path(p).name: r for p, r in runs["reason"].items() if isinstance(r, str)} == expected


def _killed_mid_write(path: Path) -> None:
    """Kill a process as it writes to the closed run file ``path`` (as a run's findings are stored after it closes):
    it leaves the file half written and the rollback journal that undoes it (a hot journal) beside it."""
    script = f"""
import os, signal, sqlite3
con = sqlite3.connect({str(path)!r})
con.execute("PRAGMA cache_size=1")  # the half-done transaction spills into the run file itself
con.execute("BEGIN")
con.execute("DELETE FROM findings")
con.execute("DELETE FROM steps")
os.kill(os.getpid(), signal.SIGKILL)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr
    assert Path(f"{path}-journal").stat().st_size > 0


def test_a_run_left_with_a_hot_journal_reads_whole_and_is_not_changed(reports, sound, capsys, tmp_path):
    reports.mkdir()
    path = reports / sound.plain.path.name
    shutil.copyfile(sound.plain.path, path)
    _killed_mid_write(path)
    before = {p.name: _digest(p) for p in reports.iterdir()}
    runs = list_runs(reports).set_index("id")
    assert runs.at[sound.plain.id, "status"] == "finished" and runs.at[sound.plain.id, "steps"] == 6
    code, out, err = _cli(capsys, "runs")
    assert code == 0 and "unreadable" not in out and err == ""
    code, out, err = _cli(capsys, "show", sound.plain.id)
    assert code == 0 and out.startswith(f"run {sound.plain.id}  'plain'  status finished") and err == ""
    code, out, err = _cli(capsys, "export", sound.plain.id, "--out", str(tmp_path / "csv"))
    assert code == 0 and err == ""
    assert len(pd.read_csv(tmp_path / "csv" / "steps.csv")) == 6
    assert {p.name: _digest(p) for p in reports.iterdir()} == before  # the journal is still there, undone nowhere


def test_a_killed_run_without_its_shm_on_a_read_only_path_reads_with_every_committed_step(reports, mount, capsys):
    """A run killed while recording, its file and write-ahead log copied (not its -shm) onto a read-only path."""
    point = mount("16m")
    if point is None:
        pytest.skip("mounting a tmpfs is not permitted here")
    path, last, _, _ = record_until_killed(killed_child(), 3, {"DPPROF_REPORTS": str(reports)})
    path = Path(path)
    assert Path(f"{path}-wal").stat().st_size > 0
    kept = len(load_run(path).steps)
    assert kept >= last + 1
    for suffix in ("", "-wal"):
        shutil.copyfile(f"{path}{suffix}", point / f"{path.name}{suffix}")
    done = subprocess.run(["mount", "-o", "remount,ro", str(point)], capture_output=True, timeout=30)
    if done.returncode != 0:
        pytest.skip("remounting the tmpfs read-only is not permitted here")
    before = {p.name: _digest(p) for p in point.iterdir()}
    runs = list_runs(point).set_index("id")
    assert runs.at[path.stem, "status"] == "incomplete" and runs.at[path.stem, "steps"] == kept
    code, out, err = _cli(capsys, "--reports-dir", str(point), "show", path.stem)
    assert code == 0 and out.startswith(f"run {path.stem}  'killed'  status incomplete") and err == ""
    assert len(load_run(point / path.name).steps) == kept
    assert {p.name: _digest(p) for p in point.iterdir()} == before


def test_sound_runs_of_every_kind_read_whole(tmp_path, sound, fake_gpus):
    """No run dpprof writes has a value the reader would leave out: recorded (plain, balanced, failed, thinned by
    its retention, with NVML samples of two fake GPUs) and imported (every shared trace)."""
    directory = tmp_path / "kinds"
    shutil.copytree(sound.dir, directory)
    fake_gpus([fake_pynvml.gpu(BUS[0]), fake_pynvml.gpu(BUS[1], util=30)])
    record_with_gpu_samples(directory)
    record(directory, "balanced", workers=3, steps=4, batch_size=33, balanced=True)
    record_failed(directory)
    record_straggler(directory, steps=120, detail=Retention(first_steps=10, last_steps=10, every=10, chunk_steps=20,
                                                            block_steps=10))
    for trace in sorted(TRACES.glob("*.json.gz")):
        if "rank0-nccl" not in trace.name:  # imported by the fixture
            import_traces([trace], directory)
    runs = list_runs(directory)
    assert runs["reason"].isna().all() and runs["damage"].isna().all() and len(runs) >= 8
    held = set()
    for path in runs["path"]:
        run = load_run(path)
        assert run.damage == [], path
        assert run.model.steps > 0 or run.meta["status"] == "failed"
        held |= run.model.has
    assert {"memory", "gpu_samples", "allocator", "comms", "gpu_time"} <= held  # every table was checked with rows


def _every_page(at: AppTest, run_id: str) -> None:
    at.session_state[common.RUN_KEY] = run_id
    for page in PAGES:
        at.switch_page(f"app_pages/{page}.py").run()
        assert not at.exception, (run_id, page, [e.message for e in at.exception])


def test_every_page_opens_a_damaged_run_and_says_what_was_left_out(reports, sound):
    _with_bad_copy(reports, sound.plain.path, "UPDATE steps SET duration_ms = 'abc' WHERE step = 2")
    con_sql = ["UPDATE runs SET devices = '{not json', created_at = 'not a date', ended_at = '2026-13-45'",
               "UPDATE memory SET activation_bytes = -1 WHERE step = 3", "UPDATE phases SET duration_ms = 9e999 "
               "WHERE rowid = 5", "UPDATE meta SET value = 'abc' WHERE key = 'schema_version'"]
    import sqlite3

    con = sqlite3.connect(reports / "bad.sqlite")
    con.executescript(";".join(con_sql[:3]))
    con.close()
    damaged_copy(sound.plain.path, reports / "unreadable.sqlite", con_sql[3])
    at = AppTest.from_file(str(APP), default_timeout=120)
    at.run()
    assert not at.exception
    _every_page(at, "bad")
    at.switch_page("app_pages/overview.py").run()
    shown = "\n".join(t.value for t in at.text)
    assert "steps: 1 row left out" in shown and "runs.devices is '{not json'" in shown
    assert any("The run file is damaged" in w.value for w in at.warning)
    at.switch_page("app_pages/runs.py").run()
    listed = at.dataframe[0].value.set_index("id")
    assert "runs.created_at is 'not a date'" in listed.at["bad", "damage"] and listed.at["bad", "copy_of"] == sound.plain.id
    assert at.dataframe[-1].value.set_index("file").at["unreadable.sqlite", "reason"].startswith("corrupt: meta.")
    _every_page(at, sound.plain.id)  # the sound run beside it, as ever


FUZZ_SEED = 20261126
# Every table that holds rows in either sound run is the first one damaged in one case of each fuzz test: a fixed
# number of cases that reaches every table, the same on any machine however loaded (a time budget reached about
# half of them on a loaded 2-core machine).
FUZZ_PAGE_TABLES_PER_CASE = 3  # values damaged in each file the pages open, as before


def _every_table(sound) -> list[tuple[Path, str]]:
    """(sound run file, table) for every table holding rows in the recorded run and in the imported trace."""
    return [(source, table) for source in (sound.plain.path, sound.trace.path) for table in tables_with_rows(source)]


def _fuzzed(reports: Path, sound, rng: random.Random, index: int, source: Path,
            table: str) -> tuple[Path, Path, list[str]]:
    """A reports directory of its own holding copies of both sound runs under their own names (a rank file stays a
    rank file), the copy of ``source`` with 1 to 3 values set to bad ones, the first in ``table``: (that one, the
    other, what was set)."""
    directory = reports / f"case{index}"
    directory.mkdir(parents=True)
    for copied in (sound.plain.path, sound.trace.path):
        shutil.copyfile(copied, directory / copied.name)
    target = directory / source.name
    other = directory / (sound.trace.path if source == sound.plain.path else sound.plain.path).name
    more = rng.randint(0, 2)
    return target, other, [mutate(target, rng, table)] + [mutate(target, rng) for _ in range(more)]


@pytest.mark.slow
def test_fuzz_bad_values_in_a_run_file_never_break_runs_show_or_export(reports, sound, capsys, monkeypatch):
    rng = random.Random(FUZZ_SEED)
    cases = _every_table(sound)
    for index, (source, table) in enumerate(cases):
        target, other, done = _fuzzed(reports, sound, rng, index, source, table)
        monkeypatch.setenv("DPPROF_REPORTS", str(target.parent))
        before = _digest(target)
        run_id = target.name.split(".")[0]
        for argv in (["runs"], ["show", run_id], ["export", run_id, "--out", str(target.parent / "csv")],
                     ["export", run_id, "--trace", str(target.parent / "t.json.gz")]):
            try:
                code, out, err = _cli(capsys, *argv)
            except Exception as exc:  # noqa: BLE001  (the failure says which case and command)
                raise AssertionError(f"{argv} on {target.name} after {done}: {exc!r}") from exc
            assert code in (0, 1) and (code == 0 or err.count("\n") == 1), (argv, done, err)
        runs = list_runs(target.parent).set_index("path")
        assert pd.isna(runs.at[str(other), "reason"]) and pd.isna(runs.at[str(other), "damage"]), done
        # the other run reads as before
        assert queries.run_stats(load_run(other)) == queries.run_stats(load_run(sound.dir / other.name)), done
        assert _digest(target) == before
    print(f"{len(cases)} damaged files read by runs, show, export and export --trace")  # seen with -s
    assert len(cases) >= 20, f"only {len(cases)} tables with rows in the two sound runs"


@pytest.mark.slow
def test_fuzz_bad_values_in_a_run_file_never_break_a_page(reports, sound):
    rng = random.Random(FUZZ_SEED + 1)
    opened = 0
    reports.mkdir()
    for source in (sound.plain.path, sound.trace.path):
        shutil.copyfile(source, reports / source.name)
    # each file damaged in the next FUZZ_PAGE_TABLES_PER_CASE tables of one run (a random one where its run has none
    # left): every table of both runs is damaged in some file the pages are asked to open
    cases: list[tuple[Path, list[str]]] = []
    for source in (sound.plain.path, sound.trace.path):
        tables = [table for kind, table in _every_table(sound) if kind == source]
        cases += [(source, tables[i:i + FUZZ_PAGE_TABLES_PER_CASE])
                  for i in range(0, len(tables), FUZZ_PAGE_TABLES_PER_CASE)]
    at = AppTest.from_file(str(APP), default_timeout=120)
    at.run()
    for index, (source, tables) in enumerate(cases):
        target = reports / f"fuzzed-{index}{'.rank0' if source == sound.trace.path else ''}.sqlite"
        shutil.copyfile(source, target)
        done = [mutate(target, rng, table) for table in tables]
        done += [mutate(target, rng) for _ in range(FUZZ_PAGE_TABLES_PER_CASE - len(tables))]
        runs = list_runs(reports).set_index("path")
        if pd.isna(runs.at[str(target), "reason"]):  # an unreadable one is listed, never chosen
            opened += 1
            at.session_state[common.RUN_KEY] = runs.at[str(target), "id"]
            for page in PAGES:
                at.switch_page(f"app_pages/{page}.py").run()
                assert not at.exception, (target.name, done, page, [e.message for e in at.exception])
    at.session_state[common.RUN_KEY] = sound.plain.id
    at.switch_page("app_pages/overview.py").run()
    assert not at.exception and at.title[0].value == "plain"
    print(f"{len(cases)} damaged files, {opened} opened on every page")  # seen with -s
    assert len(cases) >= 7 and opened >= 1, f"only {len(cases)} fuzz cases ({opened} opened)"


def test_a_trace_or_rank_file_named_that_is_a_device_says_so(tmp_path, capsys):
    zero_trace, zero_rank = tmp_path / "zero.json", tmp_path / "zero.rank0.sqlite"
    zero_trace.symlink_to("/dev/zero")
    zero_rank.symlink_to("/dev/zero")
    said = "not a regular file: a character device (symlink to /dev/zero)"
    assert _cli(capsys, "import", str(zero_trace))[::2] == (1, f"dpprof: {zero_trace}: {said}\n")
    assert _cli(capsys, "merge", str(zero_rank), "--out", str(tmp_path / "merged"))[::2] == (1, f"dpprof: {zero_rank}: {said}\n")
    assert not (tmp_path / "merged").exists()


def test_a_rank_file_whose_rank_is_no_number_is_still_its_runs_rank(reports, sound, capsys):
    reports.mkdir()
    rank = damaged_copy(sound.trace.path, reports / sound.trace.path.name, "UPDATE runs SET rank = 'zero'")
    row = list_runs(reports).set_index("id").loc[sound.trace.id]
    assert (row["ranks"], row["devices"], row["damage"]) == (1, "rank:0", "runs.rank is 'zero', not a whole number")
    assert pd.isna(row["copy_of"]) and load_run(sound.trace.id).paths == [rank]
    assert _cli(capsys, "show", sound.trace.id)[0] == 0


@pytest.mark.parametrize("sql", ["UPDATE runs SET detail_from = 1e12",
                                 "UPDATE steps SET step = 999999999999 WHERE rowid = (SELECT MAX(rowid) FROM steps)"])
def test_a_step_number_far_past_a_thinned_runs_steps_never_makes_a_read_hang(reports, sql):
    """A run thinned by its retention is read from its sample of steps, counted from stored step numbers: one far
    past the run's steps must not make a read count up to it."""
    run = record_straggler(reports, steps=120, detail=Retention(first_steps=10, last_steps=10, every=10,
                                                                chunk_steps=20, block_steps=10))
    assert load_run(run.path).model.aggregated
    damaged_copy(Path(run.path), reports / "bad.sqlite", sql)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    for argv in (["show", "bad"], ["export", "bad", "--trace", str(reports.parent / "bad.json")]):
        done = forked.run([sys.executable, "-m", "dpprof", *argv], capture_output=True, text=True, timeout=180,
                          env=env)
        assert done.returncode == 0, (argv, done.stderr[-2000:])


def test_a_live_run_file_is_checked_from_its_new_rows_on_and_finds_what_a_whole_check_finds(tmp_path, sound):
    """A running run's file is checked again at each commit from the rows past the last check (not whole): rows
    appended since, sound or bad, count as a check of the whole file would count them."""
    from dpprof.store import reader
    from dpprof.store.reader import file_damage

    live = tmp_path / "live.sqlite"
    shutil.copyfile(sound.plain.path, live)
    assert file_damage(live, live=True) == []
    appended = ("INSERT INTO steps SELECT step + 1000, start_ms, {}, batch_size, devices_used, forward_calls, explicit,"
                " raised_calls, loader_ms FROM steps WHERE step < 3")
    for duration, more in (("duration_ms", 0), ("'abc'", 3), ("duration_ms", 0), ("1e300", 3)):
        con = sqlite3.connect(live)
        con.execute(appended.format(duration) + " ORDER BY step")  # same columns, steps past the run's
        con.commit()
        con.close()
        whole = tmp_path / f"whole-{duration}.sqlite"  # the same file under another name: checked whole
        shutil.copyfile(live, whole)
        assert [d.text for d in file_damage(live, live=True)] == [d.text for d in file_damage(whole)]
    [steps] = file_damage(live, live=True)
    assert steps.rows == 6 and [c for c, _ in steps.columns] == ["duration_ms"]
    con = sqlite3.connect(live)
    last = con.execute("SELECT MAX(rowid) FROM steps").fetchone()[0]
    con.close()
    assert reader._live_scans[str(live.resolve())][1]["steps"] == last  # where the next check starts

"""A run appears whole or not at all (dpprof.store.publish): an import killed while it writes or publishes its
files, a full disk during an import, and --jobs past the cores.

The kills are deterministic: ``dpprof import`` runs in a child process whose file move (or findings step) is
wrapped to SIGKILL the child right after the first rank file is published (or before any is), so the state a
kill at that instant leaves is on disk every time, whatever the load.
"""
from __future__ import annotations

import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import forked
import pytest
from cpu_traces import single_process_trace
from recorded import record
from streamlit.testing.v1 import AppTest

import dpprof
from dpprof.cli import main
from dpprof.store.publish import OWNER_FILE, READY_FILE, interrupted, recover
from dpprof.trace import import_traces

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT.parent / "shared" / "traces"
DDP128 = [TRACES / "ddp-128ranks-rank0-sampled.json.gz", TRACES / "ddp-128ranks-rank1-sampled.json.gz"]
RESNET = TRACES / "resnet50-1gpu-tb-sample.pt.trace.json.gz"

pytestmark = pytest.mark.skipif(not RESNET.exists(), reason="../shared/traces is not beside the project")

# The child: dpprof's CLI with one step wrapped to SIGKILL itself (``after`` is "publish": right after the first
# file is given its name in the reports directory; "published": after the last, before the staging directory
# goes; "removing": as it removes that directory, its owner file gone; "claimed": the staging directory claimed,
# before it has its name; "write": once the run files are written, before any is published; "pause": wait there
# until killed).
_KILLED_CHILD = """
import os, signal, sys
import dpprof.store.publish as publish
import dpprof.trace.importer as importer
from dpprof.cli import main

after = sys.argv[1]


def kill_after(owner, name):  # owner.name runs, then the process is SIGKILLed
    real = getattr(owner, name)
    def wrapped(*args, **kwargs):
        real(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGKILL)
    setattr(owner, name, wrapped)


def kill_instead(owner, name):  # the process is SIGKILLed where owner.name would run
    setattr(owner, name, lambda *args, **kwargs: os.kill(os.getpid(), signal.SIGKILL))


if after == "publish":
    kill_after(publish, "move_into_place")
elif after == "write":
    kill_instead(importer, "_store_findings")
elif after == "published":
    kill_instead(publish, "_remove_stage")
elif after == "removing":
    real_remove = publish._remove_stage
    def remove(stage, everything=False):
        kill_instead(os, "rmdir")  # its last step, the owner file gone
        real_remove(stage, everything)
    publish._remove_stage = remove
elif after == "claimed":
    kill_after(publish, "_claim")
elif after == "pause":
    def findings(written):
        open(os.environ["PAUSED"], "w").close()
        signal.pause()
    importer._store_findings = findings
sys.exit(main(sys.argv[2:]))
"""


def _child(after: str, reports: Path, *args: str, paused: Path | None = None, wait: bool = True,
           command: str = "import"):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    if paused is not None:
        env["PAUSED"] = str(paused)
    cmd = [sys.executable, "-c", _KILLED_CHILD, after, "--reports-dir", str(reports), command, *map(str, args),
           *(["--quiet"] if command == "import" else [])]
    if not wait:
        return forked.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return forked.run(cmd, env=env, capture_output=True, text=True, timeout=300, check=False)


def _dpprof(*args: str) -> subprocess.CompletedProcess:
    return forked.run([sys.executable, "-m", "dpprof", *args], capture_output=True, text=True, timeout=300, check=False,
                      env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})


def _stages(reports: Path) -> list[Path]:
    return sorted(p for p in reports.iterdir() if p.name.startswith(".import-"))


def test_a_multi_rank_import_killed_as_it_publishes_is_never_listed_finished_and_the_next_import_completes_it(reports):
    done = _child("publish", reports, *DDP128)
    assert done.returncode == -signal.SIGKILL, done.stderr
    [stage] = _stages(reports)
    run_id = stage.name.removeprefix(".import-")
    published = sorted(p.name for p in reports.glob(f"{run_id}.rank*.sqlite"))
    assert published == [f"{run_id}.rank1.sqlite"]  # the kill came right after the first file took its name
    assert sorted(p.name for p in stage.iterdir()) == sorted([f"{run_id}.rank0.sqlite", OWNER_FILE, READY_FILE])

    listing = dpprof.list_runs(reports)
    run = listing[listing["id"] == run_id]
    assert run["status"].tolist() == ["incomplete"]  # never "finished" with one rank of two
    assert run["error"].iloc[0].startswith("1 of the 2 run files of its trace files are here (rank 1)")
    left = listing[listing["status"] == "interrupted import"]
    assert left["path"].tolist() == [str(stage)]
    assert "1 of 2 run files published" in left["reason"].iloc[0]
    assert dpprof.load_run(run_id, reports).meta["status"] == "incomplete"  # it opens, as far as it goes

    shown = _dpprof("--reports-dir", str(reports), "runs")
    assert shown.returncode == 0, shown.stderr
    assert re.search(rf"^{run_id}\s.*\bincomplete\b", shown.stdout, re.MULTILINE), shown.stdout
    assert not re.search(rf"^{run_id}\s.*\bfinished\b", shown.stdout, re.MULTILINE)
    assert f"incomplete: {run_id}: 1 of the 2 run files" in shown.stdout
    assert f"interrupted import: {stage}: import stopped while publishing" in shown.stdout

    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=60)  # the dashboard's Runs page says the same
    at.run()
    at.switch_page("app_pages/runs.py").run()
    assert not at.exception, [e.message for e in at.exception]
    assert at.dataframe[0].value["status"].tolist() == ["incomplete"]
    left = at.dataframe[-1].value
    assert left[["file", "status"]].values.tolist() == [[stage.name, "interrupted import"]]

    again = _dpprof("--reports-dir", str(reports), "import", str(RESNET), "--quiet")  # the next command writing here
    assert again.returncode == 0, again.stderr
    assert f"published the 1 run file of 2 that an interrupted import left in {stage}" in again.stderr
    assert _stages(reports) == []
    listing = dpprof.list_runs(reports)
    run = listing[listing["id"] == run_id]
    assert run[["status", "ranks", "devices"]].values.tolist() == [["finished", 2, "rank:0,rank:1"]]
    assert listing["reason"].isna().all()
    whole = dpprof.load_run(run_id, reports)
    assert whole.meta["status"] == "finished" and len(whole.steps) == 4  # 2 steps on each of the 2 ranks


def _ranks_of_one_job(directory: Path, world: int) -> list[Path]:
    """``world`` rank files of one job: the shared trace of rank 0 of a 128-rank job, its distributedInfo.rank
    set to each rank (the same time span, as the ranks of one job have)."""
    import gzip
    import json

    doc = json.loads(gzip.decompress(DDP128[0].read_bytes()))
    directory.mkdir()
    files = []
    for rank in range(world):
        doc["distributedInfo"]["rank"] = rank
        files.append(directory / f"job-rank{rank}.json.gz")
        files[-1].write_bytes(gzip.compress(json.dumps(doc).encode(), compresslevel=1))
    return files


def test_an_import_killed_after_publishing_every_file_is_listed_whole_and_its_staging_directory_goes(reports):
    done = _child("published", reports, *DDP128)
    assert done.returncode == -signal.SIGKILL, done.stderr
    [stage] = _stages(reports)
    listing = dpprof.list_runs(reports)
    assert listing[listing["reason"].isna()][["status", "ranks"]].values.tolist() == [["finished", 2]]
    [left] = listing[listing["reason"].notna()]["reason"].tolist()
    assert "after publishing all 2 run files" in left
    [line] = recover(reports)
    assert line == f"dpprof: removed {stage}: every run file an interrupted import left there was published already"
    assert _stages(reports) == [] and dpprof.list_runs(reports)[["status", "ranks"]].values.tolist() == [["finished", 2]]


def test_an_import_killed_as_it_removes_its_staging_directory_leaves_a_whole_run_and_the_next_command_removes_it(
        reports):
    """The owner file goes before the directory: a staging directory without one is a dead process's, removed by
    the next command at once (it was taken for one being claimed, and kept for a minute)."""
    done = _child("removing", reports, *DDP128)
    assert done.returncode == -signal.SIGKILL, done.stderr
    [stage] = _stages(reports)
    assert list(stage.iterdir()) == []
    listing = dpprof.list_runs(reports)
    assert listing[listing["reason"].isna()][["status", "ranks"]].values.tolist() == [["finished", 2]]
    [left] = listing[listing["reason"].notna()]["reason"].tolist()
    assert f"leaving no run file in {stage}" in left
    [line] = recover(reports)
    assert line == f"dpprof: removed {stage}, which an interrupted import left with no run file in it"
    assert [p for p in reports.iterdir() if p.name.startswith(".")] == []


def test_an_import_killed_while_claiming_its_staging_directory_lists_nothing_and_the_next_command_removes_it(reports):
    done = _child("claimed", reports, *DDP128)
    assert done.returncode == -signal.SIGKILL, done.stderr
    assert _stages(reports) == []  # the staging directory never had its name
    [claim] = [p for p in reports.iterdir() if p.name.startswith(".claim.import-")]
    assert sorted(p.name for p in claim.iterdir()) == [OWNER_FILE]
    assert dpprof.list_runs(reports).empty
    again = _dpprof("--reports-dir", str(reports), "import", str(RESNET), "--quiet")
    assert again.returncode == 0, again.stderr
    assert f"dpprof: removed {claim}, which an import killed while claiming it left (it holds no run file)" in again.stderr
    assert [p for p in reports.iterdir() if p.name.startswith(".")] == []


def test_an_import_whose_process_group_is_killed_when_its_first_rank_file_appears_never_lists_a_finished_part(
        reports, tmp_path):
    """As the issue measured it: the process group (the import and its reading workers) SIGKILLed the moment the
    first rank file appears. Wherever that lands, the run is listed incomplete or not at all, never finished with
    some ranks; the next command writing there makes it whole, or removes what was never published."""
    world = 8
    traces = _ranks_of_one_job(tmp_path / "job", world)
    child = forked.Popen([sys.executable, "-m", "dpprof", "--reports-dir", str(reports), "import",
                          str(tmp_path / "job"), "--jobs", "2", "--quiet"],
                         env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while not (reports.is_dir() and any(reports.glob("*.rank*.sqlite"))):
            assert child.poll() is None, child.communicate()
            assert time.monotonic() < deadline, "no rank file appeared"
            time.sleep(0.002)
        os.killpg(child.pid, signal.SIGKILL)  # the group this test started: the import and its workers
    finally:
        child.communicate(timeout=60)
    listing = dpprof.list_runs(reports)
    runs = listing[listing["reason"].isna()]
    assert len(runs) <= 1, listing
    for _, run in runs.iterrows():  # the rank files published before the kill, if any
        ranks = int(run["ranks"])  # a float where the listing has an interrupted import's row (no ranks)
        assert run["status"] == "finished" if ranks == world else (
            run["status"] == "incomplete" and run["error"].startswith(f"{ranks} of the {world} run files")), \
            run.to_dict()
    assert main(["--reports-dir", str(reports), "import", str(RESNET), "--quiet"]) == 0  # the next command writing
    listing = dpprof.list_runs(reports)
    assert listing["reason"].isna().all() and not [p for p in reports.iterdir() if p.name.startswith(".")]
    ddp = listing[listing["workload"] != "resnet50-1gpu-tb-sample"]
    assert ddp[["status", "ranks"]].values.tolist() in ([], [["finished", world]]), ddp
    assert len(traces) == world and not runs.empty  # the kill came after the first rank file was published


def test_an_import_killed_before_its_files_are_whole_leaves_nothing_listed_as_a_run_and_a_recording_removes_it(
        reports):
    done = _child("write", reports, RESNET)
    assert done.returncode == -signal.SIGKILL, done.stderr
    [stage] = _stages(reports)
    assert (stage / OWNER_FILE).exists() and not (stage / READY_FILE).exists()
    assert [p for p in reports.iterdir() if p.name.endswith(".sqlite")] == []  # nothing of it was published
    listing = dpprof.list_runs(reports)
    assert listing[["id", "status", "path"]].values.tolist() == [[stage.name, "interrupted import", str(stage)]]
    assert "before its files were whole" in listing["reason"].iloc[0]
    assert "nothing of it was published (1 unfinished run file there)" in listing["reason"].iloc[0]

    record(reports, "next", steps=2)  # a recording writes here: it cleans up first
    assert not stage.exists()
    listing = dpprof.list_runs(reports)
    assert listing["name"].tolist() == ["next"] and listing["reason"].isna().all()


def test_the_staging_directory_of_an_import_still_running_is_never_touched(reports, tmp_path):
    paused = tmp_path / "paused"
    child = _child("pause", reports, RESNET, paused=paused, wait=False)
    try:
        deadline = time.monotonic() + 240
        while not paused.exists():  # the child reached the findings step, its files written
            assert child.poll() is None, child.communicate()
            assert time.monotonic() < deadline, "the import never reached its findings"
            time.sleep(0.05)
        [stage] = _stages(reports)
        before = sorted(p.name for p in stage.iterdir())
        assert recover(reports) == [] and interrupted(reports) == []
        assert dpprof.list_runs(reports).empty
        assert sorted(p.name for p in stage.iterdir()) == before
    finally:
        child.kill()  # the child this test started, by its own handle
        child.communicate(timeout=60)
    assert [r["status"] for r in interrupted(reports)] == ["interrupted import"]  # gone now: listed
    [line] = recover(reports)
    assert line.startswith(f"dpprof: removed {stage}, left by an interrupted import")
    assert not stage.exists() and dpprof.list_runs(reports).empty


def test_a_merge_killed_as_it_publishes_lists_the_run_incomplete_and_the_next_merge_completes_it(reports, tmp_path,
                                                                                                     monkeypatch):
    source = tmp_path / "machine-b"
    imported = import_traces(DDP128, source)  # two rank files, as another machine would leave them
    done = _child("publish", reports, source, command="merge")
    assert done.returncode == -signal.SIGKILL, done.stderr
    [stage] = [p for p in reports.iterdir() if p.name.startswith(".merge-")]
    listing = dpprof.list_runs(reports)
    run = listing[listing["id"] == imported.id]
    assert run[["status", "ranks"]].values.tolist() == [["incomplete", 1]]  # never finished with one rank of two
    assert listing[listing["reason"].notna()][["id", "status"]].values.tolist() == [[stage.name, "interrupted merge"]]
    assert main(["--reports-dir", str(reports), "merge", str(source)]) == 0
    listing = dpprof.list_runs(reports)
    assert listing[["id", "status", "ranks"]].values.tolist() == [[imported.id, "finished", 2]]
    assert not [p for p in reports.iterdir() if p.name.startswith(".")]


def test_a_merge_that_fails_as_it_publishes_takes_back_what_it_published(reports, tmp_path, monkeypatch, capsys):
    source = tmp_path / "machine-b"
    import_traces(DDP128, source)
    from dpprof.store import publish

    real, moved = publish.move_into_place, []

    def move_once(src, dest):  # the second file cannot be moved (as move_into_place fails: nothing at ``dest``)
        if moved:
            raise OSError(28, "No space left on device", str(dest))
        real(src, dest)
        moved.append(dest)

    monkeypatch.setattr(publish, "move_into_place", move_once)
    assert main(["--reports-dir", str(reports), "merge", str(source)]) == 1
    assert capsys.readouterr().err.splitlines() == [f"dpprof: cannot write {reports}: disk full; nothing was merged"]
    assert len(moved) == 1 and not moved[0].exists()
    assert dpprof.list_runs(reports).empty and list(reports.iterdir()) == []


@pytest.mark.slow
def test_a_full_disk_during_an_import_exits_1_with_one_line_and_leaves_nothing(mount, reports, capsys):
    """On a real tmpfs, filled to leave from 80% to 115% of the room the run files take (measured first, by the same
    import elsewhere): each import either imports the whole run (exit 0, finished, every step) or exits 1 with one
    line naming the directory and the disk, leaving nothing. The room is bisected between the two ends down to the
    sweep's old step (a 13th of the range): the imports are made where the outcome turns, with the last pages."""
    where = mount("8m")
    if where is None:
        pytest.skip("mounting a tmpfs is not permitted here: test_an_import_whose_writes_fail_on_a_full_disk_exits_1 "
                    "fakes it")
    assert main(["--reports-dir", str(reports), "import", *map(str, DDP128), "--quiet"]) == 0
    need_kb = sum(-(-p.stat().st_size // 4096) * 4 for p in reports.iterdir())  # in the tmpfs's 4 KiB pages
    capsys.readouterr()

    def import_with(free_kb: int) -> int:
        for p in where.iterdir():
            p.unlink() if p.is_file() else None
        assert not list(where.iterdir())
        free = os.statvfs(where).f_bavail * os.statvfs(where).f_frsize
        with open(where / "filler", "wb") as f:
            f.write(b"\0" * max(0, free - free_kb * 1024))
        directory = where / "reports"
        code = main(["--reports-dir", str(directory), "import", *map(str, DDP128), "--quiet"])
        out, err = capsys.readouterr()
        if code == 0:
            listing = dpprof.list_runs(directory)
            assert listing[["status", "steps", "ranks"]].values.tolist() == [["finished", 2, 2]], free_kb
            assert not [p for p in directory.iterdir() if p.name.startswith(".")]
            for p in list(directory.iterdir()):
                p.unlink()
            directory.rmdir()
        else:
            assert code == 1 and "imported run" not in out, (free_kb, out)
            assert err.splitlines() == [f"dpprof: cannot write {directory}: disk full; nothing was written"], free_kb
            assert not directory.exists()  # the reports directory this import made goes again, empty
        (where / "filler").unlink()
        return code

    low, high = int(need_kb * 0.8), int(need_kb * 1.15)
    outcomes = {low: import_with(low), high: import_with(high)}
    assert outcomes[low] == 1 and outcomes[high] == 0, outcomes  # the sizes span the room the run needs
    step = max(4, int(need_kb * 0.35 / 13))
    while high - low > step:  # the room where the import stops fitting, to within a step
        middle = (low + high) // 2
        outcomes[middle] = import_with(middle)
        low, high = (middle, high) if outcomes[middle] else (low, middle)
    assert len(outcomes) >= 5, outcomes


def _failing_writes(monkeypatch, fail: callable) -> None:
    """The writer's commits fail as SQLite fails on a full disk where ``fail(call number)`` says so."""
    from dpprof.store import writer

    real, calls = writer.SqliteSink._write, []

    def write(self, *args, **kwargs):
        calls.append(1)
        if fail(len(calls)):
            err = sqlite3.OperationalError("database or disk is full")
            err.sqlite_errorcode = 13  # SQLITE_FULL
            raise err
        return real(self, *args, **kwargs)

    monkeypatch.setattr(writer.SqliteSink, "_write", write)


@pytest.mark.parametrize("fail", [lambda n: n >= 1, lambda n: n >= 2, lambda n: n == 1],
                         ids=["every-commit", "after-the-first", "the-first-only"])
def test_an_import_whose_writes_fail_on_a_full_disk_exits_1(monkeypatch, reports, capsys, fail):
    """Wherever the disk fills (at once, after the first commit, or for one commit whose records then fit), the
    import exits 1 with one line naming the reports directory and the disk, and no run is left."""
    _failing_writes(monkeypatch, fail)
    assert main(["--reports-dir", str(reports), "import", str(RESNET), "--quiet"]) == 1
    out, err = capsys.readouterr()
    assert "imported run" not in out
    assert err.splitlines() == [f"dpprof: cannot write {reports}: disk full; nothing was written"]
    assert not reports.exists() or list(reports.iterdir()) == []


def test_a_failed_commit_whose_records_then_fit_counts_none_dropped(monkeypatch, tmp_path):
    """The writer retries a failed commit in halves; the last slice may be shorter than the others, and what it
    counts as dropped is what it did not store: never negative (it said "-22 records could not be written")."""
    from dpprof.store.reader import load_run
    from dpprof.store.retention import ALL
    from dpprof.store.writer import SqliteSink
    from dpprof.trace.collect import collect
    from dpprof.trace.convert import convert
    from dpprof.trace.decode import TraceFile

    records = convert(collect(TraceFile(RESNET)), 0.0, None).records  # what dpprof import writes
    assert len(records) % 16  # slices of 16 and more cannot take them all evenly: the last is shorter
    _failing_writes(monkeypatch, lambda n: n == 1)
    path = tmp_path / "run.sqlite"
    sink = SqliteSink(str(path), {"id": "r", "name": "n", "status": "finished"}, max_buffered=len(records) + 16,
                      retention=ALL)
    for one in records:
        sink.put(one)
    sink.close()
    assert sink.failure == "disk full" and sink.dropped >= 0
    stored = sum(len(t) for t in load_run(path).frames().values()) - len(load_run(path).notes)
    assert sink.dropped == len(records) - stored


def test_jobs_past_the_cores_and_files_are_capped_with_a_warning(reports, capsys, caplog):
    from dpprof.trace.jobs import capped_jobs, usable_cores

    assert main(["--reports-dir", str(reports), "import", *map(str, DDP128), "--jobs", "1000", "--quiet"]) == 0
    cap = min(usable_cores(), len(DDP128))
    said = [r.getMessage() for r in caplog.records if "--jobs" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith(f"dpprof: --jobs 1000 capped at {cap} (")
    assert "imported run" in capsys.readouterr().out
    assert capped_jobs(1000, 24, cores=2) == 2 and capped_jobs(3, 24, cores=2) == 2 and capped_jobs(8, 3, cores=16) == 3
    assert capped_jobs(2, 24, cores=2) == 2 and capped_jobs(1, 1, cores=1) == 1
    said = [r.getMessage() for r in caplog.records if "--jobs" in r.getMessage()]
    assert said[1:] == ["dpprof: --jobs 1000 capped at 2 (2 usable cores and 24 files)",
                        "dpprof: --jobs 3 capped at 2 (2 usable cores)", "dpprof: --jobs 8 capped at 3 (3 files)"]


def test_a_value_sqlite_cannot_store_names_the_trace_file_never_a_staging_path(reports, tmp_path, capsys):
    """A step number past 64 bits in a trace of a CPU process: one line naming the file (the trace's numbers are
    checked where they are read too; this is the store's own guard), never "no run PosixPath('.import-...')"."""
    import gzip
    import json

    trace = single_process_trace(tmp_path / "made", steps=2)
    doc = json.loads(trace.read_text())
    step = next(e for e in doc["traceEvents"] if str(e.get("name", "")).startswith("ProfilerStep#"))
    step["name"] = f"ProfilerStep#{2**70}"
    bad = tmp_path / "huge-step.json.gz"
    bad.write_bytes(gzip.compress(json.dumps(doc).encode()))
    code = main(["--reports-dir", str(reports), "import", str(bad), "--quiet"])
    err = capsys.readouterr().err
    assert code == 1 and len(err.splitlines()) == 1, err
    assert err.startswith("dpprof: huge-step.json.gz: ") and ".import-" not in err and "PosixPath" not in err
    assert not reports.exists() or list(reports.iterdir()) == []


@pytest.mark.slow
def test_a_ddp_recording_with_a_ranks_file_elsewhere_is_incomplete_until_merged(reports, tmp_path, capsys):
    """A DDP run whose rank 1 file is on another machine (moved out here) is listed incomplete with the count, never
    finished with one rank; ``dpprof merge`` of the other machine's directory makes it whole."""
    assert main(["--reports-dir", str(reports), "profile", "tutorial-linear", "--ddp", "--nproc", "2", "--steps", "3",
                 "--quiet"]) == 0
    [rank1] = reports.glob("*.rank1.sqlite")
    other = tmp_path / "machine-b"
    other.mkdir()
    rank1.rename(other / rank1.name)
    listing = dpprof.list_runs(reports)
    assert listing[["status", "ranks"]].values.tolist() == [["incomplete", 1]]
    assert listing["error"].iloc[0].startswith("1 of the 2 run files of its ranks are here (rank 0)")
    capsys.readouterr()
    assert main(["--reports-dir", str(reports), "show", listing["id"].iloc[0]]) == 0
    shown = capsys.readouterr().out
    assert "The run is incomplete:" in shown and "dpprof merge gathers them" in shown, shown
    assert main(["--reports-dir", str(reports), "merge", str(other)]) == 0
    listing = dpprof.list_runs(reports)
    assert listing[["status", "ranks", "error"]].values.tolist() == [["finished", 2, None]]


def test_an_import_staged_on_local_disk_and_killed_as_it_publishes_is_finished_from_there(reports, monkeypatch,
                                                                                          tmp_path):
    """A reports directory on a network filesystem has its imports built on local disk ($DPPROF_STAGING_DIR):
    the staging directory a kill leaves there is listed with the reports directory it was for, and published
    into it by the next command writing there."""
    monkeypatch.setenv("DPPROF_NETWORK_FS", "stage")  # as on NFS
    done = _child("publish", reports, *DDP128)
    assert done.returncode == -signal.SIGKILL, done.stderr
    [stage] = (tmp_path / "staging").glob(".import-*")
    assert _stages(reports) == []
    listing = dpprof.list_runs(reports)
    assert listing[listing["reason"].isna()][["status", "ranks"]].values.tolist() == [["incomplete", 1]]
    assert listing[listing["reason"].notna()]["path"].tolist() == [str(stage)]
    assert dpprof.list_runs(tmp_path / "elsewhere").empty  # another reports directory's staging is not its own
    [line] = recover(reports)
    assert line.startswith(f"dpprof: published the 1 run file of 2 that an interrupted import left in {stage}")
    assert not stage.exists()
    assert dpprof.list_runs(reports)[["status", "ranks"]].values.tolist() == [["finished", 2]]


def test_ctrl_c_during_an_import_leaves_nothing(reports, monkeypatch):
    """Interrupted in the process (Ctrl-C, not a kill), the import removes its staging directory itself: nothing is
    listed, and nothing is left for the next command."""
    from dpprof.trace import importer

    def interrupt(written):
        raise KeyboardInterrupt

    monkeypatch.setattr(importer, "_store_findings", interrupt)
    with pytest.raises(KeyboardInterrupt):
        import_traces(DDP128, reports)
    assert not reports.exists() or list(reports.iterdir()) == []
    assert dpprof.list_runs(reports).empty


def test_a_merge_into_a_file_is_one_line_and_copies_nothing(reports, tmp_path, capsys):
    source = tmp_path / "machine-b"
    import_traces(DDP128, source)
    target = tmp_path / "a-file"
    target.write_text("mine")
    assert main(["--reports-dir", str(reports), "merge", str(source), "--out", str(target)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"dpprof: --out {target}: an existing file, not a directory; nothing was copied"]
    assert target.read_text() == "mine"

"""The reports directory's file helpers (dpprof.store.files), on runs the CPU backend records."""
from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import dpprof
from dpprof.store.files import LEFTOVER_AGE_S, dir_signature, run_signature
from recorded import RunningRun, record


def test_a_running_runs_signature_changes_as_its_writer_commits_and_stays_once_it_is_closed(tmp_path):
    with RunningRun(tmp_path) as live:
        path = Path(live.path)
        run_id = path.stem
        first = run_signature(path, run_id)
        assert path.name in [name for name, _, _ in first]
        deadline = time.monotonic() + 30
        while run_signature(path, run_id) == first:  # the writer commits every 0.5 s while steps go on
            assert time.monotonic() < deadline, "the signature never changed while the run recorded"
            time.sleep(0.1)
    closed = run_signature(path, run_id)
    assert closed == run_signature(path, run_id)  # nothing writes once it is closed
    assert dpprof.load_run(path).meta["status"] == "finished"


def test_the_directory_signature_changes_when_a_run_file_appears_and_an_unreadable_entry_is_kept(tmp_path):
    with RunningRun(tmp_path) as live:
        pass
    before = dir_signature(tmp_path)
    assert Path(live.path).name in [name for name, _, _ in before]
    shutil.copyfile(live.path, tmp_path / "backup.sqlite")
    after = dir_signature(tmp_path)
    assert after != before and "backup.sqlite" in [name for name, _, _ in after]
    (tmp_path / "dangling.sqlite").symlink_to(tmp_path / "nowhere")
    assert ("dangling.sqlite", 0, 0) in dir_signature(tmp_path)  # listed, with no figures, never an error
    assert dir_signature(tmp_path / "missing") == ()


def test_the_next_recording_removes_what_killed_processes_left_half_built_long_ago(tmp_path, caplog):
    """A run file or a capture's raw trace half built, an answer no asker read: removed by the next recording in the
    directory once over LEFTOVER_AGE_S old; young ones (a process may still be writing them) and runs stay."""
    old = [".20261101-000000-aaaaaa.sqlite.part", ".20261101-000000-aaaaaa.rank1.sqlite.part",
           ".20261101-000000-aaaaaa.capture-2-4.pt.trace.json.gz", ".20261101-000000-aaaaaa.capture-answer.json",
           ".20261101-000000-aaaaaa.rank0.capture-answer.json"]
    young = [".20261127-000000-bbbbbb.sqlite.part", ".20261127-000000-bbbbbb.capture-answer.json"]
    others = [".notes.part", "mine.sqlite.part", ".20261101-000000-aaaaaa.capture-request.json"]
    long_ago = time.time() - LEFTOVER_AGE_S - 60
    for name in old + young + others:
        (tmp_path / name).write_text("x")
    for name in old + others:
        os.utime(tmp_path / name, (long_ago, long_ago))
    with caplog.at_level("WARNING", logger="dpprof"):
        run = record(tmp_path, "next", workers=2, steps=2, workload="tutorial-linear")
    left = {p.name for p in tmp_path.iterdir()}
    assert not left & set(old) and set(young) | set(others) | {f"{run.id}.sqlite"} <= left
    said = [r.getMessage() for r in caplog.records if "left in" in r.getMessage()]
    assert sorted(said) == sorted(f"dpprof: removed {n}, left in {tmp_path} by a process killed while writing it"
                                  for n in old)

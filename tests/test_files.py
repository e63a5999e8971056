"""The reports directory's file helpers (dpprof.store.files), on runs the CPU backend records."""
from __future__ import annotations

import shutil
import time
from pathlib import Path

import dpprof
from dpprof.store.files import dir_signature, run_signature
from recorded import RunningRun


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

"""dpprof merge (dpprof/store/merge.py) refusing rank files it must not copy, on rank files really recorded: one
damaged inside that still opens, and one whose rank is still being recorded."""
from __future__ import annotations

import re
import sqlite3
from pathlib import Path

import torch
from torch import nn

import dpprof
from dpprof.cli import main
from dpprof.recording import Run
from dpprof.store.reader import effective_status, read_run_file

# SQLite's b-tree page types (the first byte of a page's header): 0 is none of them
INDEX_LEAF_PAGE = 0x0A


def _merge_refused(capsys, reports: Path, *sources: Path) -> str:
    """dpprof merge of ``sources`` into ``reports``: exit 1, one line on stderr, nothing left in ``reports``."""
    assert main(["merge", *map(str, sources)]) == 1
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert not reports.exists() or not list(reports.iterdir()), list(reports.iterdir())
    return lines[0]


def _index_page_damaged(path: Path) -> int:
    """Damage, in place, the b-tree page of one of the run file's indexes (phases by step): its page type byte
    becomes no page type. Opening and listing the file never read that page; SQLite's quick_check does. Returns the
    page's number."""
    con = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
    try:
        page_size = con.execute("PRAGMA page_size").fetchone()[0]
        [root] = con.execute("SELECT rootpage FROM sqlite_master WHERE type = 'index' AND name = 'phases_step'"
                             ).fetchone()
    finally:
        con.close()
    data = bytearray(path.read_bytes())
    at = (root - 1) * page_size  # page 1 holds the 100-byte file header before its page header; root is past it
    assert data[at] == INDEX_LEAF_PAGE, "the index fits one leaf page in a 4-step run"
    data[at] = 0
    path.write_bytes(bytes(data))
    return root


def test_merge_refuses_a_rank_file_that_opens_but_is_damaged_inside_in_one_line(tmp_path, reports, capsys, profiled):
    recorded = tmp_path / "recorded"
    profiled(recorded, "tutorial-linear", "--ddp", "--nproc", "2", "--steps", "4")  # DDP, 2 gloo ranks, once a session
    machines = [tmp_path / "machine0", tmp_path / "machine1"]
    for rank, machine in enumerate(machines):  # each rank's file on a machine of its own
        machine.mkdir()
        [path] = recorded.glob(f"*.rank{rank}.sqlite")
        path.rename(machine / path.name)
    [rank0] = machines[0].iterdir()
    [rank1] = machines[1].iterdir()
    page = _index_page_damaged(rank1)
    before = rank1.read_bytes()
    meta, _ = read_run_file(rank1)  # it opens and lists as the finished rank it is
    assert meta["rank"] == 1 and meta["status"] == "finished"

    said = _merge_refused(capsys, reports, machines[0], machines[1])
    assert said.startswith(f"dpprof: {rank1}: damaged inside (") and said.endswith("); nothing was copied"), said
    # SQLite's own words for the page, which its versions phrase apart ("Page 24: ...", "Tree 24 page 24: ...")
    assert re.search(rf"\b[Pp]age {page}: ", said) and "***" not in said, said
    assert rank1.read_bytes() == before and sorted(p.name for p in machines[1].iterdir()) == [rank1.name]
    assert len(dpprof.load_run(rank0).steps) == 4  # the other rank's file is as it was


def test_merge_refuses_a_rank_still_being_recorded_and_takes_it_once_it_has_ended(tmp_path, reports, capsys):
    machine = tmp_path / "machine1"
    net = dpprof.DataParallel(nn.Linear(5, 2), device_ids=dpprof.cpu_devices(2))
    # rank 1 of a 2-rank run, recorded by this (live) process into its own rank file, and not closed yet
    run = Run(name="live rank", reports_dir=machine, rank=1, world_size=2, sample_hz=None)
    try:
        for _ in range(3):
            with run.step():
                net(torch.randn(8, 5)).sum().backward()
        flush = getattr(run.sink, "flush", None)
        if flush is not None:
            flush()
        [live] = machine.glob("*.rank1.sqlite")
        meta, _ = read_run_file(live)
        assert effective_status(meta, live) == "running"
        said = _merge_refused(capsys, reports, machine)
        assert said == (f"dpprof: {live}: run {run.id} rank 1 is still being recorded: merge it once it has ended; "
                        "nothing was copied")
        assert effective_status(read_run_file(live)[0], live) == "running"  # still recording, where it was
    finally:
        run.close()
    assert main(["merge", str(machine)]) == 0  # ended, the same file is merged
    assert dpprof.load_run(reports / live.name).steps["step"].tolist() == [0, 1, 2]


def test_merge_into_proc_says_nothing_can_be_made_there_not_no_such_directory(tmp_path, capsys, profiled):
    """--out /proc (which is there) or a directory under it: one line saying why, the rank files as they were."""
    recorded = tmp_path / "recorded"
    profiled(recorded, "tutorial-linear", "--ddp", "--nproc", "2", "--steps", "4")
    files = sorted(recorded.glob("*.rank*.sqlite"))
    before = [p.read_bytes() for p in files]
    for out, said in (("/proc", "cannot write /proc: nothing can be made in /proc (a proc filesystem); nothing was "
                                "merged"),
                      ("/proc/dpprof-merge", "--out /proc/dpprof-merge: nothing can be made in /proc (a proc "
                                             "filesystem); nothing was copied")):
        assert main(["merge", *map(str, files), "--out", out]) == 1
        assert capsys.readouterr().err == f"dpprof: {said}\n"
    assert [p.read_bytes() for p in files] == before

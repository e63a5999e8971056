"""A reports directory on a network or FUSE filesystem: detected (statfs type, mount table), and its runs
recorded on local disk and moved there whole at close; a staged run left behind by SIGKILL or a failed
move is moved by the next recording; where staging is impossible the run is refused in one line.

The network filesystem is faked: dpprof.store.filesystems.filesystem_of says "nfs" for the test's
reports directory (the staging directory, under the same tmp_path, stays what it really is).
"""
from __future__ import annotations

import errno
import os
import re
import signal
import sys
from pathlib import Path

import forked
import pytest
import torch
from torch import nn

import dpprof
from dpprof.store import filesystems, staging
from dpprof.store.faults import RecordingError
from dpprof.store.filesystems import Filesystem, classify, mount_type
from dpprof.store.staging import check_reports_dir
from recorded import killed_child, record_until_killed

ROOT = Path(__file__).resolve().parents[1]
NFS = Filesystem("nfs", True)


def _under(path: str | os.PathLike[str], directory: str | os.PathLike[str]) -> bool:
    path, directory = os.path.realpath(path), os.path.realpath(directory)
    return path == directory or path.startswith(directory + os.sep)


@pytest.fixture
def on_nfs(monkeypatch, reports):
    """The reports directory reads as NFS; every other path as what it is."""
    real = filesystems.filesystem_of
    monkeypatch.setattr(filesystems, "filesystem_of", lambda p: NFS if _under(p, reports) else real(p))
    return reports


@pytest.fixture
def staged_dir(tmp_path) -> Path:
    return tmp_path / "staging"  # $DPPROF_STAGING_DIR (conftest)


def _record(reports: Path, steps: int = 5, name: str = "linear"):
    torch.manual_seed(0)
    net = dpprof.DataParallel(nn.Linear(5, 2), device_ids=dpprof.cpu_devices(2))
    with dpprof.record(name=name, reports_dir=reports) as run:
        for _ in range(steps):
            with run.step():
                net(torch.randn(8, 5)).sum().backward()
    return run


def _lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "dpprof"]


def _start_line(reports: Path, staged: str, fs: str = "nfs") -> str:
    return (f"dpprof: {reports} is on {fs}, where SQLite's write-ahead log is not safe: recording in {staged} on "
            f"local disk and moving the run into {reports} when it closes (dpprof runs and the dashboard list it "
            "from then; DPPROF_NETWORK_FS=direct records in place)")


def _moved_line(staged: Path, reports: Path) -> str:
    return f"dpprof: moved {staged.name}, a run its process left on local disk, into {reports / staged.name}"


def _names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir()) if directory.exists() else []


# -- detection -----------------------------------------------------------------------------------

@pytest.mark.parametrize("magic, mounted, expected", [
    (0x6969, None, Filesystem("nfs", True)),
    (0x6969, "nfs4", Filesystem("nfs4", True)),
    (0xFF534D42, None, Filesystem("cifs", True)),
    (0xFE534D42, "smb3", Filesystem("smb3", True)),
    (0x517B, None, Filesystem("smb", True)),
    (0x65735546, "fuse.sshfs", Filesystem("fuse.sshfs", True)),
    (0x65735546, None, Filesystem("fuse", True)),
    (0x0BD00BD0, None, Filesystem("lustre", True)),
    (0x47504653, None, Filesystem("gpfs", True)),
    (0x00C36400, None, Filesystem("ceph", True)),
    (0x01021997, None, Filesystem("9p", True)),
    (0x6B414653, None, Filesystem("afs", True)),
    (0x19830326, None, Filesystem("beegfs", True)),
    (None, "glusterfs", Filesystem("glusterfs", True)),  # no statfs: the mount table alone
    (None, "fuse.gcsfuse", Filesystem("fuse.gcsfuse", True)),
    (0xEF53, "ext4", Filesystem("ext4", False)),
    (0x01021994, "tmpfs", Filesystem("tmpfs", False)),
    (0x794C7630, "overlay", Filesystem("overlay", False)),  # a container's root is local
    (0xEF53, None, Filesystem("0x0000ef53", False)),
    (None, None, Filesystem("unknown", False)),  # an unknown platform: local, no error
])
def test_a_filesystem_type_is_network_by_its_statfs_magic_or_its_mount_type(magic, mounted, expected):
    assert classify(magic, mounted) == expected


MOUNTINFO = """\
22 1 0:21 / /proc rw,relatime - proc proc rw
27 1 254:0 / / rw,relatime - ext4 /dev/vda rw
40 27 0:50 / /mnt/shared rw,relatime shared:5 - nfs4 server:/export rw,vers=4.2
41 40 0:51 / /mnt/shared/scratch rw,relatime - ext4 /dev/vdb rw
42 27 0:52 / /mnt/my\\040drive rw,nosuid - fuse.sshfs me@host:/ rw
43 27 0:53 / /mnt/shared2 rw - cifs //srv/share rw
44 27 0:54 / /mnt/shared2 rw - ext4 /dev/vdc rw
"""


@pytest.mark.parametrize("path, expected", [
    ("/", "ext4"),
    ("/home/me/reports", "ext4"),
    ("/mnt/shared", "nfs4"),
    ("/mnt/shared/reports", "nfs4"),
    ("/mnt/shared/scratch/reports", "ext4"),  # a local disk mounted inside the share
    ("/mnt/sharedx/reports", "ext4"),  # a longer name is not inside /mnt/shared
    ("/mnt/my drive/reports", "fuse.sshfs"),  # \040 in the table is a space
    ("/mnt/shared2/reports", "ext4"),  # mounted over the cifs share: the last mount on a point wins
])
def test_the_mount_table_gives_the_mount_with_the_longest_mount_point_above_the_path(path, expected):
    assert mount_type(path, MOUNTINFO) == expected


def test_detection_reads_statfs_and_the_mount_table(monkeypatch, tmp_path):
    here = filesystems.filesystem_of(tmp_path / "not" / "made" / "yet")  # the real one, of the nearest existing dir
    assert here == filesystems.filesystem_of(tmp_path)
    if sys.platform.startswith("linux"):
        assert here.type != "unknown"
    monkeypatch.setattr(filesystems, "_statfs_magic", lambda path: 0x6969)
    monkeypatch.setattr(filesystems, "_mounted_type", lambda path: None)
    assert filesystems.filesystem_of(tmp_path) == Filesystem("nfs", True)
    monkeypatch.setattr(filesystems, "_statfs_magic", lambda path: 0x65735546)
    monkeypatch.setattr(filesystems, "_mounted_type", lambda path: "fuse.s3fs")
    assert filesystems.filesystem_of(tmp_path) == Filesystem("fuse.s3fs", True)


def test_on_an_unknown_platform_a_path_is_local(monkeypatch, tmp_path):
    monkeypatch.setattr(filesystems.sys, "platform", "sunos5")
    monkeypatch.setattr(filesystems, "MOUNTINFO", str(tmp_path / "no-such-mountinfo"))
    assert filesystems.filesystem_of(tmp_path) == Filesystem("unknown", False)


# -- staged on local disk, moved whole at close --------------------------------------------------

def test_a_run_on_nfs_is_recorded_on_local_disk_and_appears_whole_at_close(on_nfs, staged_dir, caplog):
    reports = on_nfs
    torch.manual_seed(0)
    net = dpprof.DataParallel(nn.Linear(5, 2), device_ids=dpprof.cpu_devices(2))
    with caplog.at_level("WARNING", logger="dpprof"):
        with dpprof.record(name="staged", reports_dir=reports) as run:
            staged = run.path
            assert Path(staged).parent == staged_dir
            for _ in range(6):
                with run.step():
                    net(torch.randn(8, 5)).sum().backward()
            assert run.sink.flush()
            assert dpprof.list_runs(reports).empty  # not listed until it closes, as the line says
            assert Path(staged + staging.DESTINATION_SUFFIX).exists()
    final = reports / Path(staged).name
    assert _lines(caplog) == [_start_line(reports, staged)]  # one line, at the start
    assert run.path == str(final) and _names(reports) == [final.name]  # no hidden copy left beside it
    assert _names(staged_dir) == []  # nor anything on local disk
    stored = dpprof.load_run(run.id)
    assert stored.meta["status"] == "finished" and stored.steps["step"].tolist() == list(range(6))
    assert dpprof.list_runs(reports)["id"].tolist() == [run.id]


def test_the_dashboard_check_passes_on_nfs_and_leaves_nothing_behind(on_nfs, staged_dir):
    check_reports_dir(on_nfs)  # a run file made in the staging directory, a plain one where it would move to
    assert _names(on_nfs) == [] and _names(staged_dir) == []


def test_across_filesystems_the_run_is_copied_under_a_hidden_name_then_published(on_nfs, staged_dir, monkeypatch):
    """The staging directory and the reports directory are one filesystem here: links and renames out of
    the staging directory fail as they do across devices, so the run is copied."""
    reports = on_nfs
    real_link, real_rename, copied = os.link, os.rename, []

    def cross(real):
        def call(src, dst, *args, **kwargs):
            if _under(src, staged_dir) and _under(dst, reports):
                raise OSError(errno.EXDEV, "Invalid cross-device link")
            if _under(src, reports):
                copied.append(Path(src).name)
            return real(src, dst, *args, **kwargs)
        return call
    monkeypatch.setattr(os, "link", cross(real_link))
    monkeypatch.setattr(os, "rename", cross(real_rename))
    run = _record(reports, steps=4)
    assert copied == [f".{Path(run.path).name}.part"]  # built under a hidden name, then given its own
    assert _names(reports) == [Path(run.path).name] and _names(staged_dir) == []
    assert dpprof.load_run(run.path).steps["step"].tolist() == list(range(4))


def test_rank_files_are_each_staged_and_moved(on_nfs, staged_dir, caplog):
    """A torch.distributed run's ranks each write their own file the same way (one process per rank in a
    real job: here two Runs given rank 0 and 1 of one run id)."""
    from dpprof.recording import Run

    reports = on_nfs
    with caplog.at_level("WARNING", logger="dpprof"):
        for rank in (0, 1):
            run = Run(name="ranks", reports_dir=reports, run_id="20260101-000000-abcdef", rank=rank, world_size=2)
            assert Path(run.path).parent == staged_dir and run.path.endswith(f".rank{rank}.sqlite")
            for _ in range(3):
                with run.step():
                    pass
            run.close()
    assert len(_lines(caplog)) == 2 and all("where SQLite's write-ahead log is not safe" in l for l in _lines(caplog))
    assert _names(reports) == ["20260101-000000-abcdef.rank0.sqlite", "20260101-000000-abcdef.rank1.sqlite"]
    stored = dpprof.load_run("20260101-000000-abcdef", reports)
    assert stored.meta["ranks"] == [0, 1] and len(stored.steps) == 6
    assert _names(staged_dir) == []


@pytest.mark.slow
@pytest.mark.slow
def test_ddp_ranks_under_torchrun_stage_their_files_too(reports, staged_dir, monkeypatch):
    """$DPPROF_NETWORK_FS=stage (a filesystem the detection does not know): every rank process stages."""
    from dpprof.cli import main

    monkeypatch.setenv("DPPROF_NETWORK_FS", "stage")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert main(["profile", "tutorial-linear", "--ddp", "--nproc", "2", "--steps", "4", "--quiet"]) == 0
    [run_id] = dpprof.list_runs(reports)["id"]
    assert _names(reports) == [f"{run_id}.rank0.sqlite", f"{run_id}.rank1.sqlite"]
    assert dpprof.load_run(run_id).steps.groupby("rank").size().tolist() == [4, 4]
    assert _names(staged_dir) == []


def test_an_import_into_nfs_is_written_on_local_disk_and_moved(on_nfs, staged_dir, caplog):
    from dpprof.trace import import_traces

    traces = ROOT.parent / "shared" / "traces"
    ranks = [traces / "ddp-128ranks-rank0-sampled.json.gz", traces / "ddp-128ranks-rank1-sampled.json.gz"]
    if not ranks[0].exists():
        pytest.skip("../shared/traces is not beside the project")
    reports = on_nfs
    with caplog.at_level("WARNING", logger="dpprof"):
        run = import_traces(ranks, reports, name="recsys")
    [line] = _lines(caplog)
    assert re.fullmatch(rf"dpprof: {re.escape(str(reports))} is on nfs, where SQLite's write-ahead log is not safe: "
                        rf"writing the run in {re.escape(str(staged_dir))}/\.import-{run.id} on local disk and "
                        rf"moving it into {re.escape(str(reports))} whole", line), line
    assert _names(reports) == [f"{run.id}.rank0.sqlite", f"{run.id}.rank1.sqlite"]
    assert dpprof.load_run(run.id, reports).meta["ranks"] == [0, 1]
    assert _names(staged_dir) == []


def test_direct_records_in_place_and_stage_stages_anywhere(reports, staged_dir, monkeypatch, caplog):
    monkeypatch.setattr(filesystems, "filesystem_of", lambda p: NFS)  # even the staging directory: unused
    monkeypatch.setenv("DPPROF_NETWORK_FS", "direct")
    with caplog.at_level("WARNING", logger="dpprof"):
        run = _record(reports, steps=2)
    assert Path(run.path).parent == reports and _lines(caplog) == [] and not staged_dir.exists()
    monkeypatch.undo()
    monkeypatch.setenv("DPPROF_STAGING_DIR", str(staged_dir))
    monkeypatch.setenv("DPPROF_NETWORK_FS", "stage")
    with caplog.at_level("WARNING", logger="dpprof"):
        run = _record(reports, steps=2)
    staged = staged_dir / Path(run.path).name
    assert _lines(caplog) == [f"dpprof: DPPROF_NETWORK_FS=stage: recording in {staged} on local disk and moving the "
                              f"run into {reports} when it closes (dpprof runs and the dashboard list it from then)"]
    assert Path(run.path).parent == reports and len(_names(reports)) == 2 and _names(staged_dir) == []
    monkeypatch.setenv("DPPROF_NETWORK_FS", "sometimes")
    with pytest.raises(RecordingError, match=f"^cannot record in {re.escape(str(reports))}: DPPROF_NETWORK_FS="
                                             "sometimes is none of auto, stage, direct$"):
        _record(reports)


# -- nothing is lost: a staged run left behind is moved by the next recording ---------------------

_CHILD = killed_child(setup="""
from dpprof.store import filesystems
reports, real = os.path.realpath(os.environ["DPPROF_REPORTS"]), filesystems.filesystem_of
def faked(p):  # the reports directory is on NFS
    p = os.path.realpath(p)
    return filesystems.Filesystem("nfs", True) if p == reports or p.startswith(reports + os.sep) else real(p)
filesystems.filesystem_of = faked
""")


def test_a_sigkilled_staged_run_stays_on_local_disk_and_the_next_recording_moves_it(on_nfs, staged_dir, caplog):
    reports = on_nfs
    first, last, err, code = record_until_killed(_CHILD, 20, {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    staged = Path(first)
    assert code == -signal.SIGKILL
    assert err.splitlines() == [_start_line(reports, str(staged))]  # where the run is, said before the kill
    assert staged.parent == staged_dir and staged.exists() and dpprof.list_runs(reports).empty
    assert Path(str(staged) + staging.DESTINATION_SUFFIX).exists()
    with caplog.at_level("WARNING", logger="dpprof"):
        nxt = _record(reports, steps=2, name="next")
    lines = _lines(caplog)
    assert lines[0] == _moved_line(staged, reports)
    assert lines[1:] == [_start_line(reports, str(staged_dir / Path(nxt.path).name))]
    assert _names(staged_dir) == []  # the run file, its log and its destination file all gone from local disk
    assert _names(reports) == sorted([staged.name, Path(nxt.path).name])
    killed = dpprof.load_run(reports / staged.name)
    kept = len(killed.steps)
    assert killed.meta["status"] == "incomplete" and kept >= last + 1  # every committed step, from its folded log
    assert killed.steps["step"].tolist() == list(range(kept))


def test_a_run_still_recording_is_never_moved_by_another(on_nfs, staged_dir):
    reports = on_nfs
    net = dpprof.DataParallel(nn.Linear(5, 2), device_ids=dpprof.cpu_devices(2))
    with dpprof.record(name="live", reports_dir=reports) as run:
        with run.step():
            net(torch.randn(8, 5))
        assert staging.move_leftover_runs() == []  # its lock is held: another recording leaves it alone
        assert Path(run.path).exists() and dpprof.list_runs(reports).empty
    assert Path(run.path).parent == reports


def _stranded(reports: Path, monkeypatch, caplog):
    """A run whose move into the reports directory fails (the quota is exhausted there), then whose process
    ends (its lock is let go, as the process's end would)."""
    failed = []

    def quota(src, dest):
        if not failed:
            failed.append(dest)
            raise OSError(errno.EDQUOT, "Disk quota exceeded")
        return real(src, dest)
    real = staging.move_into_place
    monkeypatch.setattr(staging, "move_into_place", quota)
    with caplog.at_level("WARNING", logger="dpprof"):
        run = _record(reports, steps=3, name="stranded")
    os.close(run.sink._lock)
    return run


def test_a_move_that_fails_leaves_the_run_whole_on_local_disk_and_says_where(on_nfs, staged_dir, monkeypatch, caplog):
    reports = on_nfs
    run = _stranded(reports, monkeypatch, caplog)
    staged = staged_dir / Path(run.path).name
    assert run.path == str(staged) and not run.recording_failed  # every step recorded, in a file on local disk
    assert _lines(caplog) == [
        _start_line(reports, str(staged)),
        f"dpprof: the run stays on local disk in {staged} (moving it into {reports}: disk quota exceeded); the first "
        "recording on this host after this process ends moves it"]
    assert dpprof.load_run(staged).steps["step"].tolist() == [0, 1, 2] and _names(reports) == []
    caplog.clear()
    with caplog.at_level("WARNING", logger="dpprof"):
        nxt = _record(reports, steps=1, name="next")
    assert _lines(caplog)[0] == _moved_line(staged, reports)
    assert _names(reports) == sorted([staged.name, Path(nxt.path).name]) and _names(staged_dir) == []
    stored = dpprof.load_run(reports / staged.name)
    assert stored.meta["status"] == "finished" and len(stored.steps) == 3


def test_a_left_behind_run_never_replaces_another_file_at_its_destination(on_nfs, staged_dir, monkeypatch, caplog):
    reports = on_nfs
    run = _stranded(reports, monkeypatch, caplog)
    staged = staged_dir / Path(run.path).name
    (reports / staged.name).write_bytes(b"someone else's file")
    caplog.clear()
    with caplog.at_level("WARNING", logger="dpprof"):
        _record(reports, steps=1, name="next")
    assert _lines(caplog)[0] == (f"dpprof: a run left on local disk in {staged} stays there: {reports / staged.name} "
                                 "is another file")
    assert (reports / staged.name).read_bytes() == b"someone else's file"
    assert len(dpprof.load_run(staged).steps) == 3  # kept where it was


# -- refused where staging is impossible ---------------------------------------------------------

@pytest.mark.parametrize("where, cause", [
    ("under-a-file", "cannot be used (not a directory)"),
    ("on-nfs", "is on nfs too"),
])
def test_where_the_run_cannot_be_staged_it_is_refused_naming_the_settings(where, cause, on_nfs, tmp_path, monkeypatch):
    reports = on_nfs
    if where == "under-a-file":
        (tmp_path / "file").write_text("x")
        place = tmp_path / "file" / "staging"
    else:
        place = reports / "staging"  # $TMPDIR on the same share, say
    monkeypatch.setenv("DPPROF_STAGING_DIR", str(place))
    line = (f"cannot record in {reports}: it is on nfs, where SQLite's write-ahead log is not safe, and the staging "
            f"directory {place} {cause}: set DPPROF_STAGING_DIR to a directory on local disk, or "
            "DPPROF_NETWORK_FS=direct to record in place")
    with pytest.raises(RecordingError) as caught:
        _record(reports)
    assert str(caught.value) == line
    with pytest.raises(RecordingError) as caught:
        check_reports_dir(reports)  # the dashboard's check before it starts a run: the same line
    assert str(caught.value) == line
    assert _names(reports) == [] and dpprof.list_runs(reports).empty


def test_the_cli_refuses_in_one_line_without_a_traceback(tmp_path, reports):
    """`dpprof profile` in its own process: staging forced, onto a directory that cannot be made."""
    (tmp_path / "file").write_text("x")
    place = tmp_path / "file" / "staging"
    done = forked.run([sys.executable, "-m", "dpprof", "profile", "tutorial-linear", "--devices", "cpu:2",
                       "--steps", "2", "--quiet"], capture_output=True, text=True, timeout=300,
                      env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
                               "DPPROF_NETWORK_FS": "stage", "DPPROF_STAGING_DIR": str(place)})
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.splitlines() == [
        f"dpprof: cannot record in {reports}: DPPROF_NETWORK_FS=stage, and the staging directory {place} cannot be "
        "used (not a directory): set DPPROF_STAGING_DIR to a directory on local disk, or DPPROF_NETWORK_FS=direct "
        "to record in place"]

"""dpprof.outputs: what `dpprof export` (--out, --trace) and `dpprof import` write is whole or not there at all.

An output that cannot be written (read-only, permission denied, disk full, under /proc, under a file, a missing
directory) ends in one line naming the path and why, exit code 1, nothing half-written left behind, no directory
the command made left empty, and the user's runs and files as they were. /proc and a file in the way fail for
real (even as root); read-only, permission and a full disk are the real errno raised by the lowest call that
meets them (os.mkdir, os.open, os.fsync) and, where mounting is permitted, a real read-only or full tmpfs.
"""
from __future__ import annotations

import errno
import hashlib
import os
import sqlite3
from pathlib import Path

import pytest
from recorded import record

import dpprof
from dpprof.cli import main
from dpprof.outputs import OutputError, Outputs
from dpprof.trace import import_traces

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT.parent / "shared" / "traces"
RESNET = TRACES / "resnet50-1gpu-tb-sample.pt.trace.json.gz"
TWO_RANKS = [TRACES / "ddp-128ranks-rank0-sampled.json.gz", TRACES / "ddp-128ranks-rank1-sampled.json.gz"]
_WRITING = os.O_WRONLY | os.O_RDWR | os.O_CREAT


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A DataParallel run recorded on CPU workers and a 2-rank imported trace (a file per rank), in one directory."""
    directory = tmp_path_factory.mktemp("runs")
    dp = record(directory, "dp", workers=2, steps=3, batch_size=16, workload="tutorial-linear").id
    ranks = import_traces(TWO_RANKS, directory).id
    return directory, {"dataparallel": dp, "ranks": ranks}


def _tree(*roots: Path) -> dict[str, str]:
    """Every file and directory under the roots, with each file's content hash."""
    seen = {}
    for root in roots:
        for p in sorted(root.rglob("*")) if root.exists() else []:
            seen[str(p)] = "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
    return seen


def _fail(monkeypatch, code: int, under: Path | None = None, calls: tuple[str, ...] = ("mkdir", "open"),
          when=None) -> None:
    """The real OSError ``code`` from os.mkdir and os.open (when it creates or writes) under ``under`` (or for the
    paths ``when`` picks), or from every os.fsync: as a read-only, forbidden or full filesystem answers."""
    for name in calls:
        real = getattr(os, name)

        def call(*args, _real=real, _name=name, **kwargs):
            if _name == "fsync":
                raise OSError(code, os.strerror(code))
            path = Path(os.fspath(args[0]))
            writes = _name == "mkdir" or (len(args) > 1 and args[1] & _WRITING)
            if writes and ((under is not None and path.is_relative_to(under)) or (when is not None and when(path))):
                raise OSError(code, os.strerror(code), os.fspath(path))
            return _real(*args, **kwargs)

        monkeypatch.setattr(os, name, call)


def _one_line_exit_1(argv: list[str], capsys) -> str:
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 1 and out == "" and "Traceback" not in err and len(err.splitlines()) == 1, (code, out, err)
    return err.rstrip("\n")


# (argv after `export RUN`, the fault, what the line says): {t} is the test's directory
EXPORT_CASES = {
    "out-read-only": (["--out", "{t}/ro/csv"], ("ro", errno.EROFS), "cannot write {t}/ro/csv: read-only file system"),
    "trace-read-only": (["--trace", "{t}/ro/t.json"], ("ro", errno.EROFS),
                        "cannot write {t}/ro/t.json: read-only file system"),
    "out-permission": (["--out", "{t}/ro/a/csv"], ("ro", errno.EACCES), "cannot write {t}/ro/a/csv: permission denied"),
    "trace-permission": (["--trace", "{t}/ro/t.json.gz"], ("ro", errno.EACCES),
                         "cannot write {t}/ro/t.json.gz: permission denied"),
    "out-disk-full": (["--out", "{t}/new/csv"], ("fsync", errno.ENOSPC), "cannot write {t}/new/csv/run.csv: disk full"),
    "trace-disk-full": (["--trace", "{t}/t.json.gz"], ("fsync", errno.ENOSPC), "cannot write {t}/t.json.gz: disk full"),
    "out-proc": (["--out", "/proc/dpprof-test/csv"], None,
                 "cannot write /proc/dpprof-test/csv: nothing can be made in /proc (a proc filesystem)"),
    "trace-proc": (["--trace", "/proc/dpprof-test.json"], None,
                   "cannot write /proc/dpprof-test.json: nothing can be made in /proc (a proc filesystem)"),
    "out-under-a-file": (["--out", "{t}/notes.txt/csv"], None,
                         "cannot write {t}/notes.txt/csv: {t}/notes.txt is an existing file, not a directory"),
    "out-is-a-file": (["--out", "{t}/notes.txt"], None,
                      "cannot write {t}/notes.txt: it is an existing file, not a directory"),
    "trace-under-a-file": (["--trace", "{t}/notes.txt/t.json"], None,
                           "cannot write {t}/notes.txt/t.json: {t}/notes.txt is an existing file, not a directory"),
    "trace-missing-directory": (["--trace", "{t}/nowhere/t.json"], None,
                                "cannot write {t}/nowhere/t.json: no such directory {t}/nowhere"),
    "csv-then-a-trace-that-fails": (["--out", "{t}/csv", "--trace", "{t}/nowhere/t.json"], None,
                                    "cannot write {t}/nowhere/t.json: no such directory {t}/nowhere"),
}


@pytest.mark.parametrize("kind", ["dataparallel", "ranks"])
@pytest.mark.parametrize("case", list(EXPORT_CASES))
def test_an_export_that_cannot_be_written_is_one_line_naming_the_path_and_why_and_leaves_nothing(
        case, kind, runs, tmp_path, monkeypatch, capsys):
    argv, fault, says = EXPORT_CASES[case]
    directory, ids = runs
    if kind == "ranks" and "--trace" in argv:  # a file per rank: FILE.rank<N>.json[.gz]
        says = says.replace("t.json", "t.rank0.json")
    (tmp_path / "ro").mkdir()
    (tmp_path / "notes.txt").write_text("the user's own file")
    before, run_files = _tree(tmp_path), _tree(directory)
    if fault is not None:
        where, code = fault
        if where == "fsync":
            _fail(monkeypatch, code, calls=("fsync",))
        else:
            _fail(monkeypatch, code, under=tmp_path / where)
    line = _one_line_exit_1(["--reports-dir", str(directory), "export", ids[kind],
                             *[a.format(t=tmp_path) for a in argv]], capsys)
    assert line == f"dpprof: {says.format(t=tmp_path)}; nothing was written"
    monkeypatch.undo()
    assert _tree(tmp_path) == before  # no file, no .part, no directory the command made
    assert _tree(directory) == run_files  # the runs as they were
    assert not os.path.lexists("/proc/dpprof-test")


def test_a_failed_export_leaves_the_files_it_would_replace_as_they_were(runs, tmp_path, monkeypatch, capsys):
    """Exported again into the same place: a full disk keeps the last export whole; a good one replaces it,
    each file keeping its permissions."""
    directory, ids = runs
    argv = ["--reports-dir", str(directory), "export", ids["dataparallel"], "--out", str(tmp_path / "csv"),
            "--trace", str(tmp_path / "t.json")]
    assert main(argv) == 0
    (tmp_path / "csv" / "steps.csv").write_text("step\n1\n")  # the user's edit of the last export
    os.chmod(tmp_path / "t.json", 0o640)
    before = _tree(tmp_path)
    with monkeypatch.context() as full:
        _fail(full, errno.ENOSPC, calls=("fsync",))
        capsys.readouterr()
        assert _one_line_exit_1(argv, capsys).endswith(": disk full; nothing was written")
    assert _tree(tmp_path) == before
    assert main(argv) == 0
    steps = (tmp_path / "csv" / "steps.csv").read_text().splitlines()
    assert steps[0].startswith("step,") and len(steps) == 4  # three steps, written again whole
    assert (tmp_path / "t.json").stat().st_mode & 0o777 == 0o640
    assert not list(tmp_path.rglob("*.part"))


@pytest.mark.parametrize("target", ["run", "wal", "other database"])
def test_an_export_never_replaces_a_run_file_a_link_points_to(runs, tmp_path, capsys, target):
    """A link named as an output (the trace, or a CSV of --out) that points to a run file, its write-ahead log or
    any SQLite database: one line, exit 1, the file as it was and nothing written."""
    directory, ids = runs
    victim = tmp_path / "victim.sqlite"
    victim.write_bytes((directory / f"{ids['dataparallel']}.sqlite").read_bytes())
    if target == "wal":
        victim = tmp_path / "victim.sqlite-wal"
        victim.write_bytes(b"\0" * 64)
    elif target == "other database":
        victim = tmp_path / "notes.db"
        sqlite3.connect(victim).execute("CREATE TABLE t (x)").connection.close()
    out = tmp_path / "csv"
    out.mkdir()
    (out / "steps.csv").symlink_to(victim)
    (tmp_path / "t.json.gz").symlink_to(victim)
    before = _tree(tmp_path)
    for asked, argv in ((tmp_path / "t.json.gz", ["--trace", str(tmp_path / "t.json.gz")]),
                        (out / "steps.csv", ["--out", str(out)])):
        line = _one_line_exit_1(["--reports-dir", str(directory), "export", ids["dataparallel"], *argv], capsys)
        assert line.startswith(f"dpprof: cannot write {asked}: it links to {victim}, which is ")
        assert line.endswith(", which an output never replaces; nothing was written")
        assert _tree(tmp_path) == before
    if target == "run":
        assert dpprof.load_run(str(victim)).model.steps == 3


def test_every_ranks_trace_file_is_written_or_none(runs, tmp_path, monkeypatch, capsys):
    """A distributed run's file per rank: the second failing takes the first with it."""
    directory, ids = runs
    _fail(monkeypatch, errno.ENOSPC, when=lambda p: ".rank1.json" in p.name)
    line = _one_line_exit_1(["--reports-dir", str(directory), "export", ids["ranks"], "--trace",
                             str(tmp_path / "t.json.gz")], capsys)
    assert line == f"dpprof: cannot write {tmp_path}/t.rank1.json.gz: disk full; nothing was written"
    assert list(tmp_path.iterdir()) == []


def _users_reports(tmp_path: Path, runs) -> Path:
    """A reports directory holding a run of the user's (a copy of the recorded one)."""
    directory, ids = runs
    reports = tmp_path / "reports"
    reports.mkdir()
    src = Path(dpprof.load_run(ids["dataparallel"], directory).path)
    (reports / src.name).write_bytes(src.read_bytes())
    return reports


IMPORT_CASES = {  # (reports directory, fault, what the line says)
    "read-only": ("{t}/reports", ("reports", errno.EROFS), "cannot write {t}/reports: read-only file system"),
    "made-in-read-only": ("{t}/ro/reports", ("ro", errno.EROFS), "cannot write {t}/ro/reports: read-only file system"),
    "permission": ("{t}/reports", ("reports", errno.EACCES), "cannot write {t}/reports: permission denied"),
    "disk-full": ("{t}/reports", ("sqlite", None), "cannot write {t}/reports: disk full"),
    "disk-full-made": ("{t}/new/reports", ("sqlite", None), "cannot write {t}/new/reports: disk full"),
    "proc": ("/proc/dpprof-reports", None,
             "cannot write /proc/dpprof-reports: nothing can be made in /proc (a proc filesystem)"),
    "proc-itself": ("/proc", None, "cannot write /proc: nothing can be made in /proc (a proc filesystem)"),
    "under-a-file": ("{t}/notes.txt/reports", None,
                     "cannot write {t}/notes.txt/reports: {t}/notes.txt is an existing file, not a directory"),
}


def _sqlite_full(monkeypatch) -> None:
    """The run file's commits fail as SQLite fails on a full disk (SQLITE_FULL)."""
    from dpprof.store import writer

    def write(self, *args, **kwargs):
        err = sqlite3.OperationalError("database or disk is full")
        err.sqlite_errorcode = 13  # SQLITE_FULL
        raise err

    monkeypatch.setattr(writer.SqliteSink, "_write", write)


@pytest.mark.parametrize("case", list(IMPORT_CASES))
def test_an_import_that_cannot_be_written_is_one_line_and_leaves_the_users_runs_as_they_were(
        case, runs, tmp_path, monkeypatch, capsys):
    where, fault, says = IMPORT_CASES[case]
    _users_reports(tmp_path, runs)
    (tmp_path / "ro").mkdir()
    (tmp_path / "notes.txt").write_text("the user's own file")
    before = _tree(tmp_path)
    if fault is not None:
        if fault[0] == "sqlite":
            _sqlite_full(monkeypatch)
        else:
            _fail(monkeypatch, fault[1], under=tmp_path / fault[0])
    line = _one_line_exit_1(["--reports-dir", where.format(t=tmp_path), "import", str(RESNET), "--quiet"], capsys)
    assert line == f"dpprof: {says.format(t=tmp_path)}; nothing was written"
    monkeypatch.undo()
    assert _tree(tmp_path) == before
    assert dpprof.list_runs(tmp_path / "reports")["id"].tolist() == [runs[1]["dataparallel"]]
    assert not os.path.lexists("/proc/dpprof-reports")


def test_a_block_that_fails_otherwise_leaves_nothing_and_says_its_own_error(tmp_path):
    with pytest.raises(KeyError, match="no table"), Outputs() as out:
        out.open(out.directory(tmp_path / "a" / "b") / "x.csv").write(b"half")
        raise KeyError("no table")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(OutputError, match="it is a directory"), Outputs() as out:
        out.open(tmp_path)


# -- on real filesystems, where mounting is permitted ---------------------------------------------

def test_a_read_only_filesystem_for_real(mount, runs, capsys):
    ro = mount("64k", read_only=True)
    if ro is None:
        pytest.skip("mounting a tmpfs is not permitted here: the faked EROFS cases stand for it")
    directory, ids = runs
    for argv, named in ((["export", ids["dataparallel"], "--out", f"{ro}/csv"], f"{ro}/csv"),
                        (["export", ids["ranks"], "--trace", f"{ro}/t.json"], f"{ro}/t.rank0.json")):
        line = _one_line_exit_1(["--reports-dir", str(directory), *argv], capsys)
        assert line == f"dpprof: cannot write {named}: read-only file system; nothing was written"
    line = _one_line_exit_1(["--reports-dir", f"{ro}/reports", "import", str(RESNET), "--quiet"], capsys)
    assert line == f"dpprof: cannot write {ro}/reports: read-only file system; nothing was written"
    assert list(ro.iterdir()) == []


def test_a_full_disk_for_real(mount, runs, capsys):
    """A tmpfs too small for the CSV files, and one that fills while an import writes its run file."""
    small, medium = mount("24k"), mount("200k")
    if small is None:
        pytest.skip("mounting a tmpfs is not permitted here: the faked ENOSPC cases stand for it")
    directory, ids = runs
    line = _one_line_exit_1(["--reports-dir", str(directory), "export", ids["dataparallel"], "--out",
                             f"{small}/a/csv"], capsys)
    assert line.startswith(f"dpprof: cannot write {small}/a/csv/") and line.endswith(": disk full; nothing was written")
    assert list(small.iterdir()) == []
    line = _one_line_exit_1(["--reports-dir", f"{medium}/reports", "import", str(RESNET), "--quiet"], capsys)
    assert line == f"dpprof: cannot write {medium}/reports: disk full; nothing was written"
    assert list(medium.iterdir()) == []

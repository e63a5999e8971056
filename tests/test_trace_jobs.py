"""dpprof.trace.jobs: the files of one job read in worker processes give the run that reading them one after
another gives, table for table; a file that fails among several leaves nothing behind and no worker running;
how many files are read at once by default; a large plain JSON file read in parts gives what one pass gives."""
from __future__ import annotations

import gzip
import multiprocessing
import sqlite3
import sys
from pathlib import Path

import forked
import pytest

from dpprof.trace import TraceError, import_traces
from dpprof.trace import jobs as jobs_module
from dpprof.trace.collect import Collected, collect, collect_part, finish, merge_parts
from dpprof.trace.convert import convert
from dpprof.trace.importer import jobs_for
from dpprof.trace.jobs import GZIP_RATIO, WORKER_BASE_BYTES, collect_files, default_jobs, task_sizes, worker_bytes
from dpprof.trace.decode import Span, TraceFile, split_points

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT.parent / "shared" / "traces"
DDP128 = [TRACES / "ddp-128ranks-rank0-sampled.json.gz", TRACES / "ddp-128ranks-rank1-sampled.json.gz"]
DDP2 = TRACES / "ddp-2ranks-rank0-nccl.json.gz"
MiB = 2**20

pytestmark = pytest.mark.skipif(not DDP2.exists(), reason="../shared/traces is not beside the project")


def _tables(path: Path) -> dict[str, list]:
    """Every table of a run file, its rows sorted; the runs row without what differs between two imports of the
    same files (the run's id, and when the file was last written)."""
    con = sqlite3.connect(path)
    try:
        out = {}
        for (name,) in con.execute("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name"):
            cols = [r[1] for r in con.execute(f"PRAGMA table_info({name})")]
            keep = [c for c in cols if not (name == "runs" and c in ("id", "heartbeat_at"))]
            out[name] = sorted(map(repr, con.execute(f"SELECT {', '.join(keep)} FROM {name}")))
        return out
    finally:
        con.close()


@pytest.mark.parametrize("jobs", [2, 3])
def test_jobs_give_the_run_tables_of_one_after_another(jobs, reports):
    one = import_traces(DDP128, reports, jobs=1)
    many = import_traces(DDP128, reports, jobs=jobs, again=True)
    assert [p.name.split(".", 1)[1] for p in many.paths] == [p.name.split(".", 1)[1] for p in one.paths]
    assert (many.steps, many.devices) == (one.steps, one.devices) == (2, ["rank:0", "rank:1"])
    for a, b in zip(one.paths, many.paths):
        ta, tb = _tables(a), _tables(b)
        assert ta.keys() == tb.keys() and {"steps", "phases", "gpu_time", "comms", "findings", "runs"} <= set(ta)
        for table in ta:
            assert ta[table] == tb[table], table
        assert ta["steps"] and ta["gpu_time"] and ta["comms"]
    assert not multiprocessing.active_children()


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_each_start_method_collects_what_this_process_does(start_method):
    if start_method not in multiprocessing.get_all_start_methods():
        pytest.skip(f"no {start_method} here")
    files = [*DDP128, DDP2]
    here = collect_files(files, jobs=1)
    there = collect_files(files, jobs=2, start_method=start_method)
    assert [c.name for c in there] == [f.name for f in files]
    for a, b in zip(here, there):
        assert (a.events, a.meta, a.steps, a.collectives) == (b.events, b.meta, b.steps, b.collectives)
        t0 = min(s[1] for s in a.steps)
        assert convert(a, t0, a.rank).records == convert(b, t0, b.rank).records
    assert not multiprocessing.active_children()


def _truncated(source: Path, out: Path) -> Path:
    out.write_bytes(source.read_bytes()[: source.stat().st_size // 2])
    return out


@pytest.mark.parametrize("bad_at", [0, 2])
@pytest.mark.parametrize("jobs", [2, 3])
def test_a_file_that_fails_among_several_leaves_nothing_behind(bad_at, jobs, tmp_path, reports):
    files = [tmp_path / "job-rank0.json.gz", tmp_path / "job-rank1.json.gz"]
    for src, dst in zip(DDP128, files):
        dst.write_bytes(src.read_bytes())
    bad = _truncated(DDP128[1], tmp_path / "job-rank2.json.gz")
    files.insert(bad_at, bad)
    reports.mkdir(parents=True)
    with pytest.raises(TraceError, match=r"^job-rank2\.json\.gz: truncated or corrupt gzip"):
        import_traces(files, reports, jobs=jobs)
    assert not list(reports.iterdir())  # no run, no staging directory
    staging = tmp_path / "staging"
    assert not staging.exists() or not list(staging.iterdir())
    assert not multiprocessing.active_children()


def test_the_command_with_jobs_says_the_failing_file_in_one_line_and_writes_nothing(tmp_path, reports):
    bad = _truncated(DDP128[1], tmp_path / "rank1.json.gz")
    reports.mkdir(parents=True)
    proc = forked.run([sys.executable, "-m", "dpprof", "--reports-dir", str(reports), "import", "--jobs", "2",
                       str(DDP128[0]), str(bad)], capture_output=True, text=True, timeout=120, cwd=str(ROOT))
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"dpprof: {bad.name}: truncated or corrupt gzip"), proc.stderr
    assert not list(reports.iterdir())


def test_the_command_imports_with_jobs(reports):
    proc = forked.run([sys.executable, "-m", "dpprof", "--reports-dir", str(reports), "import", "--jobs", "2",
                       *map(str, DDP128)], capture_output=True, text=True, timeout=120, cwd=str(ROOT))
    assert proc.returncode == 0, proc.stderr
    assert "imported run" in proc.stdout and len(list(reports.glob("*.rank*.sqlite"))) == 2


@pytest.mark.parametrize("value", ["0", "-1", "two"])
def test_jobs_must_be_a_whole_number_of_at_least_one(value, capsys):
    from dpprof.cli import main

    with pytest.raises(SystemExit) as done:
        main(["import", "--jobs", value, str(DDP2)])
    assert done.value.code == 2 and "at least 1" in capsys.readouterr().err


@pytest.mark.parametrize("jobs", [1, 2])
def test_progress_is_told_per_file_every_byte_read(jobs, reports):
    per_file: dict[str, int] = {}
    total: list[int] = []
    import_traces(DDP128, reports, jobs=jobs, progress=total.append,
                  file_progress=lambda path, n: per_file.__setitem__(path.name, per_file.get(path.name, 0) + n))
    assert per_file == {p.name: p.stat().st_size for p in DDP128}
    assert sum(total) == sum(p.stat().st_size for p in DDP128)


GiB = 2**30


@pytest.mark.parametrize("sizes, cores, available, expected", [
    ([300 * MiB] * 4, 2, None, 2),  # one per core
    ([300 * MiB] * 4, 8, None, 4),  # no more than the files
    ([300 * MiB], 8, None, 1),  # one file: read here, no worker
    ([], 4, None, 1),
    ([300 * MiB] * 4, 1, None, 1),
    ([300 * MiB] * 4, 4, 2 * 1200 * MiB, 4),  # half the memory available holds all four
    ([300 * MiB] * 4, 4, 2 * 900 * MiB, 3),  # three
    ([300 * MiB] * 4, 4, 2 * 599 * MiB, 1),  # not two
    ([300 * MiB] * 4, 4, 0, 1),  # at least one, always
    ([2 * GiB, 300 * MiB, 300 * MiB], 4, 2 * 2600 * MiB, 2),  # the largest files are counted first
])
def test_default_jobs_one_per_core_fewer_where_memory_would_not_hold_them(sizes, cores, available, expected):
    assert default_jobs(sizes, cores=cores, available_bytes=available) == expected


def test_a_worker_estimate_grows_with_the_json_it_reads(tmp_path):
    plain, packed = tmp_path / "a.json", tmp_path / "a.json.gz"
    plain.write_bytes(b" " * MiB)
    packed.write_bytes(gzip.compress(b" " * MiB))
    assert worker_bytes(plain) == WORKER_BASE_BYTES + MiB // 8
    assert worker_bytes(packed) == WORKER_BASE_BYTES + packed.stat().st_size * GZIP_RATIO // 8


def test_the_default_uses_this_machines_cores_and_memory(monkeypatch):
    monkeypatch.setattr(jobs_module, "usable_cores", lambda: 2)
    monkeypatch.setattr(jobs_module, "available_memory_bytes", lambda: 64 * GiB)
    assert jobs_for(DDP128) == 2 and jobs_for([*DDP128, DDP2]) == 2 and jobs_for([DDP2]) == 1
    monkeypatch.setattr(jobs_module, "available_memory_bytes", lambda: WORKER_BASE_BYTES)
    assert jobs_for(DDP128) == 1
    monkeypatch.setattr(jobs_module, "available_memory_bytes", lambda: None)  # unknown: the cores decide
    assert jobs_for(DDP128) == 2
    assert 1 <= jobs_module.usable_cores()
    found = jobs_module.available_memory_bytes()
    assert found is None or found > 0


def test_one_file_or_one_job_reads_in_this_process(monkeypatch):
    monkeypatch.setattr(jobs_module, "_Workers", None)  # any worker would fail
    assert [c.name for c in collect_files(DDP128, jobs=1)] == [p.name for p in DDP128]
    assert [c.name for c in collect_files(DDP128[:1], jobs=4)] == [DDP128[0].name]
    assert collect_files([DDP2], jobs=1)[0].events == collect(TraceFile(DDP2)).events


# A large plain JSON file read in parts (dpprof.trace.decode.split_points, collect.merge_parts)

def _plain(source: Path, out: Path) -> Path:
    """A shared .json.gz trace as the plain JSON Kineto writes (only those are read in parts)."""
    with gzip.open(source, "rb") as f:
        out.write_bytes(f.read())
    return out


@pytest.fixture(scope="module")
def plain_traces(tmp_path_factory):
    """Every shared trace as plain JSON, and a CPU trace recorded here with record_shapes, profile_memory, with_stack
    and with_modules (operators with shapes, [memory] events, module frames)."""
    from detail_traces import slow_loader_trace

    directory = tmp_path_factory.mktemp("plain")
    files = [_plain(p, directory / p.name.removesuffix(".gz")) for p in sorted(TRACES.glob("*.json.gz"))]
    return [*files, slow_loader_trace(directory / "recorded")]


def _same(one: Collected, parts: Collected) -> None:
    """Every field of two Collected of one file equal: lists, typed arrays and the interned tables alike."""
    for name in ("events", "steps", "forwards", "dpprof_ranges", "optimizer", "data", "collectives", "c10d",
                 "fsdp_ranges", "comm_kernels", "comm_launches", "first_us", "last_us", "gpu_labels", "left_out", "left_out_first",
                 "notes", "meta", "memory_cumulative"):
        assert getattr(one, name) == getattr(parts, name), name
    assert (one.backward.starts, one.backward.ends) == (parts.backward.starts, parts.backward.ends)
    assert {k: (v.starts, v.ends) for k, v in one.gpu.items()} == {k: (v.starts, v.ends) for k, v in parts.gpu.items()}
    def raw(columns: dict) -> dict:  # typed arrays by their bytes: NaN (no reserved bytes, no occupancy) is NaN
        return {k: tuple(c.tobytes() for c in v) if isinstance(v, tuple) else v.tobytes() for k, v in columns.items()}

    assert raw(one.memory) == raw(parts.memory) and raw(one.memory_summed) == raw(parts.memory_summed)
    a, b = one.detail, parts.detail
    assert (a.names, a.shapes, a.tids, a.configs, a.device_properties, a.left_out, a.left_out_first) == (
        b.names, b.shapes, b.tids, b.configs, b.device_properties, b.left_out, b.left_out_first)
    assert raw(a.arrays) == raw(b.arrays)


@pytest.mark.parametrize("parts", [2, 3, 7])
def test_a_file_read_in_parts_collects_what_one_pass_does(plain_traces, parts):
    """Each file cut into parts, each part collected on its own and the parts merged: every field as one pass over
    the file gives it. A file Kineto wrote (an event's fields over several lines) is cut where asked; one written on a
    single line has no boundary a string cannot hold, and is one part."""
    split = 0
    for path in plain_traces:
        spans = split_points(path, parts)
        one_line = path.read_bytes().count(b"\n") < 10
        assert len(spans) == (1 if one_line else parts), path.name
        assert [s.index for s in spans] == list(range(len(spans))) and spans[-1].stop is None
        for before, after in zip(spans, spans[1:]):  # each cut just after an event's closing brace
            assert before.stop == after.start and path.read_bytes()[after.start - 1:after.start] == b"}"
        merged = merge_parts([collect_part(TraceFile(path, span=s)) for s in spans])
        assert merged is not None
        _same(collect(TraceFile(path)), finish(merged))
        split += len(spans) > 1
    assert split >= 3  # the 2-rank NCCL trace, the ResNet-50 one and the trace recorded here


def test_a_split_import_gives_the_run_tables_of_one_pass(plain_traces, reports):
    """dpprof import with two jobs reads one large file in two worker processes: its run file holds, table for table,
    what reading it in one pass writes (here with the size threshold lowered to these files')."""
    for path in plain_traces[2:]:
        one = import_traces([path], reports, jobs=1, again=True)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(jobs_module, "SPLIT_MIN_BYTES", 1)
            read: list[int] = []
            two = import_traces([path], reports, jobs=2, again=True, progress=read.append)
        assert sum(read) == path.stat().st_size  # every byte told once, whatever part read it
        ta, tb = _tables(one.paths[0]), _tables(two.paths[0])
        assert ta.keys() == tb.keys() and "operators" in ta
        for table in ta:
            assert ta[table] == tb[table], (path.name, table)
    assert not multiprocessing.active_children()


def _edited(source: Path, out: Path, old: bytes, new: bytes, after: float, within: bytes = b"") -> Path:
    """``source`` with the first ``old`` past ``after`` of its length (and past the next ``within``) replaced by
    ``new``."""
    data = source.read_bytes()
    at = data.index(old, data.index(within, int(len(data) * after)))
    out.write_bytes(data[:at] + new + data[at + len(old):])
    return out


def test_a_part_that_refuses_or_leaves_an_event_out_says_what_one_pass_says(plain_traces, tmp_path):
    """A step with a negative duration in the file's second half stops the import with the message reading the file
    in one pass gives (the event numbered from the file's start, not the part's); an event with a negative time
    (a kernel) is left out, counted and named alike."""
    source = next(p for p in plain_traces if p.name.startswith("resnet50"))
    text = source.read_bytes()
    step = text.index(b'"ProfilerStep#', int(len(text) * 0.55))
    dur = text.index(b'"dur":', step)
    refused = tmp_path / "refused.json"
    refused.write_bytes(text[:dur] + b'"dur": -5,' + text[text.index(b",", dur) + 1:])
    with pytest.raises(TraceError) as alone:
        collect(TraceFile(refused))
    with pytest.raises(TraceError) as in_parts:
        collect_files([refused], jobs=2, split_min_bytes=1)
    assert str(in_parts.value) == str(alone.value) and "traceEvents[" in str(alone.value)
    left = _edited(source, tmp_path / "left.json", b'"ts":', b'"ts": -3, "was":', 0.8, b'"cat": "Kernel"')
    one = collect(TraceFile(left))
    [parts] = collect_files([left], jobs=2, split_min_bytes=1)
    assert one.left_out == 1 and "traceEvents[" in one.left_out_first
    _same(one, parts)
    assert not multiprocessing.active_children()


@pytest.mark.parametrize("parts", [2, 3, 7])
def test_two_traces_joined_in_one_file_read_in_parts_are_refused_as_in_one_pass(plain_traces, parts, tmp_path):
    """Two traces joined into one file (``cat a.json b.json``): one pass refuses what follows the first trace's end;
    read in parts, a cut falls in the second trace's events, and the part before it met the first trace's end (it
    skipped the rest of its bytes, an event and the first trace's distributedInfo among them, and the parts merged
    into one trace of both): the part fails and the file read whole says what one pass says."""
    source = next(p for p in plain_traces if p.name.startswith("resnet50"))
    joined = tmp_path / "joined.json"
    joined.write_bytes(source.read_bytes() * 2)
    assert len(split_points(joined, parts)) == parts
    with pytest.raises(TraceError) as alone:
        collect(TraceFile(joined))
    with pytest.raises(TraceError) as in_parts:
        collect_files([joined], jobs=parts, split_min_bytes=1)
    assert str(in_parts.value) == str(alone.value) and "more after the trace's end" in str(alone.value)
    assert not multiprocessing.active_children()


def test_a_gzipped_or_small_file_is_read_whole(plain_traces, monkeypatch):
    """Only a plain JSON file of SPLIT_MIN_BYTES or more is read in parts; the default jobs count its parts."""
    monkeypatch.setattr(jobs_module, "usable_cores", lambda: 2)
    monkeypatch.setattr(jobs_module, "available_memory_bytes", lambda: None)
    assert split_points(DDP2, 2) == [Span(0, None, 0)]
    small = plain_traces[2]
    assert small.stat().st_size < jobs_module.SPLIT_MIN_BYTES and jobs_for([small]) == 1
    monkeypatch.setattr(jobs_module, "SPLIT_MIN_BYTES", 1)
    assert jobs_for([small]) == 2 and jobs_for([DDP2]) == 1 and len(task_sizes([small])) == 2

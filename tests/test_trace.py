"""dpprof.trace: real torch.profiler traces (../shared/traces, recorded on GPUs by other projects) import as
runs whose figures match what the files themselves say, counted here independently with gzip + json; a
dpprof.DataParallel profiled on CPU workers round-trips; bad input is refused with nothing written."""
from __future__ import annotations

import gzip
import itertools
import json
import re
import subprocess
import sys
from pathlib import Path

import forked
import pandas as pd
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import dpprof
from dpprof.findings.ddp import collective_busy
from dpprof.store import queries
from dpprof.trace import AlreadyImported, TraceError, TraceFile, import_traces, pending_traces
from dpprof.trace.collect import Collected, _Intervals
from dpprof.trace.convert import _gpu_time

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT.parent / "shared" / "traces"
RESNET = TRACES / "resnet50-1gpu-tb-sample.pt.trace.json.gz"
DDP2 = TRACES / "ddp-2ranks-rank0-nccl.json.gz"
DDP128 = [TRACES / "ddp-128ranks-rank0-sampled.json.gz", TRACES / "ddp-128ranks-rank1-sampled.json.gz"]
ALL = [RESNET, DDP2, *DDP128]

pytestmark = pytest.mark.skipif(not RESNET.exists(), reason="../shared/traces is not beside the project")


def _load(path: Path) -> dict:
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


def _steps(doc: dict) -> dict[int, tuple[float, float]]:
    """ProfilerStep#N -> (start, end) in µs."""
    out = {}
    for e in doc["traceEvents"]:
        m = re.match(r"ProfilerStep#(\d+)$", str(e.get("name", "")))
        if m and e.get("ph") == "X":
            out[int(m.group(1))] = (e["ts"], e["ts"] + e["dur"])
    return out


def _union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def _gpu_events(doc: dict, cats: set[str]) -> list[dict]:
    return [e for e in doc["traceEvents"] if e.get("ph") == "X" and e.get("cat") in cats]


@pytest.mark.parametrize("path", ALL, ids=lambda p: p.name)
def test_each_shared_trace_imports_with_its_steps_devices_and_events(path, reports):
    doc = _load(path)
    run = dpprof.load_run(import_traces([path], reports).id, reports)
    steps = _steps(doc)
    assert sorted(run.steps["step"]) == sorted(steps)
    for row in run.steps.itertuples():
        lo, hi = steps[row.step]
        assert row.duration_ms == pytest.approx((hi - lo) / 1e3, abs=1e-6)
    rank = (doc.get("distributedInfo") or {}).get("rank")
    gpus = {e["pid"] for e in _gpu_events(doc, {"kernel", "Kernel"})}
    expected = [f"rank:{rank}"] if rank is not None else [f"cuda:{g}" for g in sorted(gpus)]
    assert run.meta["devices"] == expected
    assert run.meta["source"] == "trace" and run.meta["status"] == "finished" and run.meta["pid"] is None
    files = run.meta["workload_args"]["trace_files"]
    assert files == [{"file": path.name, "bytes": path.stat().st_size, "events": len(doc["traceEvents"])}]
    assert set(run.gpu_time["device"]) == set(expected) and sorted(run.gpu_time["step"]) == sorted(steps)


@pytest.mark.parametrize("path", ALL, ids=lambda p: p.name)
def test_gpu_time_per_step_is_the_union_of_the_kernels_in_the_step(path, reports):
    doc = _load(path)
    run = dpprof.load_run(import_traces([path], reports).id, reports)
    kernels = _gpu_events(doc, {"kernel", "Kernel"})
    is_comm = lambda e: "nccl" in e["name"].lower()  # noqa: E731
    for row in run.gpu_time.itertuples():
        lo, hi = _steps(doc)[row.step]
        clip = lambda es: [(max(e["ts"], lo), min(e["ts"] + e["dur"], hi)) for e in es  # noqa: E731
                           if e["ts"] < hi and e["ts"] + e["dur"] > lo]
        compute = clip([e for e in kernels if not is_comm(e)])
        comm = clip([e for e in kernels if is_comm(e)])
        copies = clip(_gpu_events(doc, {"gpu_memcpy", "Memcpy"}))
        sets = clip(_gpu_events(doc, {"gpu_memset", "Memset"}))
        assert row.compute_ms == pytest.approx(_union_us(compute) / 1e3, rel=1e-9, abs=1e-6)
        assert row.communication_ms == pytest.approx(_union_us(comm) / 1e3, rel=1e-9, abs=1e-6)
        # the step model's priority: kernels, then copies under no kernel, then memsets under neither
        kernels_us = _union_us(compute + comm)
        assert row.memcpy_ms == pytest.approx((_union_us(compute + comm + copies) - kernels_us) / 1e3, rel=1e-9,
                                              abs=1e-6)
        busy = _union_us(compute + comm + copies + sets)
        assert row.memset_ms == pytest.approx((busy - _union_us(compute + comm + copies)) / 1e3, rel=1e-9, abs=1e-6)
        assert row.idle_ms == pytest.approx((hi - lo - busy) / 1e3, rel=1e-9, abs=1e-6)
        # overlap: communication time minus what it adds to compute alone
        overlap = _union_us(compute) + _union_us(comm) - kernels_us
        assert row.overlap_ms == pytest.approx(overlap / 1e3, rel=1e-9, abs=1e-6)
    assert run.gpu_time["compute_ms"].sum() > 0


@pytest.mark.parametrize("path", ALL, ids=lambda p: p.name)
def test_gpu_busy_and_communication_per_step_match_the_raw_events_within_1pct(path, reports):
    """An independent count from the file's own events, by the rule a user would apply: a GPU is busy while any
    kernel, copy or memset runs; it communicates while any collective kernel (every NCCL / RCCL naming) runs;
    several in flight count once, clipped to the step."""
    doc = _load(path)
    run = dpprof.load_run(import_traces([path], reports).id, reports)
    steps = _steps(doc)
    active = _gpu_events(doc, {"kernel", "Kernel", "gpu_memcpy", "Memcpy", "gpu_memset", "Memset"})
    collective = re.compile(r"^(nccl|rccl)(Dev)?Kernel|^void (nccl|rccl)", re.IGNORECASE)
    table = run.gpu_time
    assert len(table) == len(steps)  # one GPU in each of these files
    for row in table.itertuples():
        lo, hi = steps[row.step]
        spans = [(e["ts"], e["ts"] + e["dur"]) for e in active]
        busy_ms = _clipped_union(spans, lo, hi) / 1e3
        comm_ms = _clipped_union([s for s, e in zip(spans, active) if collective.match(e["name"])], lo, hi) / 1e3
        assert row.window_ms - row.idle_ms == pytest.approx(busy_ms, rel=0.01, abs=1e-3)
        assert row.communication_ms == pytest.approx(comm_ms, rel=0.01, abs=1e-3)
        assert comm_ms <= row.window_ms + 1e-6
    if path != RESNET:
        assert table["communication_ms"].sum() > 0  # the check compared something
        # the finding's figure is the same union, clipped to the step, never over 100% of it
        from dpprof.findings.ddp import collective_busy
        busy = collective_busy(run.comms, run.steps)
        got = busy.groupby("step")["busy_ms"].sum().reindex(table["step"]).to_numpy()
        assert got == pytest.approx(table["communication_ms"].to_numpy(), rel=0.01, abs=1e-3)


@pytest.mark.parametrize("path", ALL, ids=lambda p: p.name)
def test_gpu_time_parts_partition_each_step_and_the_view_stacks_to_the_step(path, reports):
    run = dpprof.load_run(import_traces([path], reports).id, reports)
    t = run.gpu_time
    parts = t[["compute_ms", "communication_ms", "memcpy_ms", "memset_ms", "idle_ms"]].sum(axis=1) - t["overlap_ms"]
    assert (parts - t["window_ms"]).abs().max() <= 0.005 * t["window_ms"].max()
    derived = t.assign(computation=t["compute_ms"] - t["overlap_ms"], comm=t["communication_ms"] - t["overlap_ms"])
    assert (derived[["computation", "comm", "overlap_ms", "memcpy_ms", "memset_ms", "idle_ms"]] >= -1e-9).all().all()
    view = queries.gpu_time(run)
    stacked = view[list(queries.GPU_TIME_PARTS)].sum(axis=1)
    assert ((stacked - view["step_ms"]).abs() <= 0.005 * view["step_ms"]).all()
    assert (view[list(queries.GPU_TIME_PARTS)] >= -1e-9).all().all()


@pytest.mark.parametrize("path", [DDP2, *DDP128], ids=lambda p: p.name)
def test_collectives_are_in_the_comms_table_with_their_bytes(path, reports):
    doc = _load(path)
    run = dpprof.load_run(import_traces([path], reports).id, reports)
    steps = _steps(doc)
    ops = [e for e in doc["traceEvents"] if e.get("ph") == "X" and re.match(r"(nccl|gloo):", str(e.get("name")))
           and e.get("cat") != "gpu_user_annotation"  # the GPU's copy of the range: one collective, not two
           and any(lo <= e["ts"] < hi for lo, hi in steps.values())]
    kernels = [e for e in _gpu_events(doc, {"kernel"}) if "nccl" in e["name"].lower()]
    comms = run.comms
    assert len(comms) == len(ops) == len(kernels)
    # each collective kernel is a row, named what it is: its "Collective name", else (SendRecv kernels carry
    # none) the all-to-all op that NCCL runs as SendRecv
    names = {"allreduce": "all-reduce", "broadcast": "broadcast"}
    assert {e["name"] for e in ops} <= {"nccl:all_reduce", "nccl:broadcast", "nccl:all_to_all", "nccl:_all_gather_base"}
    expected_names = [names[k["args"]["Collective name"]] if "Collective name" in k["args"] else
                      "all-to-all" if k["name"].startswith("ncclKernel_SendRecv") else None for k in kernels]
    assert sorted(comms["collective"]) == sorted(expected_names)
    t0 = min(lo for lo, _ in steps.values())
    assert sorted(comms["launch_ms"]) == pytest.approx(sorted((k["ts"] - t0) / 1e3 for k in kernels), abs=1e-3)
    assert sorted(comms["duration_ms"]) == pytest.approx(sorted(k["dur"] / 1e3 for k in kernels), abs=1e-3)
    sizes = {"float": 4, "int": 4, "unsigned char": 1, "signed char": 1, "long": 8, "long int": 8}
    expected = []
    for op, kernel in zip(sorted(ops, key=lambda e: e["ts"]), sorted(kernels, key=lambda e: e["ts"])):
        a = kernel["args"] if "In msg nelems" in kernel["args"] else op["args"]
        if "In msg nelems" in a:
            expected.append(a["In msg nelems"] * {"Float": 4, "Int": 4, "Long": 8, "Byte": 1}[a["dtype"]])
        else:
            n = 1
            for d in a["Input Dims"][0]:
                n *= d
            expected.append(n * sizes[a["Input type"][0]])
    assert sorted(comms["bucket_bytes"]) == sorted(expected)


def test_two_ranks_of_one_job_are_one_run_read_like_a_ddp_recording(reports):
    run = dpprof.load_run(import_traces(DDP128, reports, name="recsys").id, reports)
    assert run.meta["name"] == "recsys" and run.meta["ranks"] == [0, 1] and run.meta["world_size"] == 128
    assert run.meta["devices"] == ["rank:0", "rank:1"]
    assert sorted(run.steps.groupby("rank")["step"].apply(sorted).tolist()) == [[551, 552], [551, 552]]
    assert {"forward", "backward_compute", "comm_wait", "optimizer"} <= set(run.phases["phase"])
    assert len(list(reports.glob("*.rank*.sqlite"))) == 2
    assert not list(reports.glob(".*"))  # no staging left behind


@pytest.mark.parametrize("where", ["after", "before"])
def test_distributed_info_is_read_before_or_after_the_events(where, tmp_path, reports):
    doc = _load(DDP2)
    info = doc.pop("distributedInfo")
    events = doc.pop("traceEvents")
    ordered = ({**doc, "traceEvents": events, "distributedInfo": info} if where == "after"
               else {"distributedInfo": info, **doc, "traceEvents": events})
    path = tmp_path / f"on-demand-{where}.json"
    path.write_text(json.dumps(ordered, indent=1))
    assert path.stat().st_size > 4 * 2**20  # several of the reader's 1 MiB chunks
    trace = TraceFile(path)
    assert sum(1 for _ in trace.events()) == len(events)
    assert trace.meta["distributedInfo"] == info
    assert trace.meta["deviceProperties"] == doc["deviceProperties"]
    run = dpprof.load_run(import_traces([path], reports).id, reports)
    assert run.meta["devices"] == ["rank:0"] and run.meta["world_size"] == 2


def test_memory_events_give_the_allocator_peak_per_step(reports):
    doc = _load(RESNET)
    run = dpprof.load_run(import_traces([RESNET], reports).id, reports)
    mem = sorted((e["ts"], e["args"]["Bytes"]) for e in doc["traceEvents"]
                 if e.get("name") == "[memory]" and e["args"].get("Device Type") == 1)
    total, running = 0, []
    for ts, b in mem:
        total += b
        running.append((ts, total))
    for row in run.allocator.itertuples():
        lo, hi = _steps(doc)[row.step]
        inside = [v for ts, v in running if lo <= ts <= hi] + [v for ts, v in running if ts < lo][-1:]
        assert row.peak_allocated_bytes == max(inside)
    assert "running sum" in " ".join(run.notes["message"])


def _profile_dataparallel(reports: Path, out: Path, workers: int = 2, all_threads: bool = True):
    """Six steps of a dpprof.DataParallel on CPU workers, recorded by dpprof and by torch.profiler at once (on
    every thread, or as torch.profiler does by default, on the calling thread only)."""
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    net = dpprof.DataParallel(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10)),
                              device_ids=dpprof.cpu_devices(workers))
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    with dpprof.record(name="profiled", reports_dir=str(reports)) as run:
        config = torch._C._profiler._ExperimentalConfig(profile_all_threads=True) if all_threads else None
        with profile(activities=[ProfilerActivity.CPU], experimental_config=config) as prof:
            for _ in range(6):
                with run.step():
                    loss = net(torch.randn(64, 64)).sum()
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
    prof.export_chrome_trace(str(out))
    return dpprof.load_run(run.path)


@pytest.mark.parametrize("workers", [2, 1], ids=["2-workers", "1-worker"])  # 1: no parallel_apply, as on one GPU
def test_a_profiled_dpprof_dataparallel_round_trips_to_its_own_records(workers, reports, tmp_path):
    recorded = _profile_dataparallel(reports, tmp_path / "profiled.json", workers)
    imported = dpprof.load_run(import_traces([tmp_path / "profiled.json"], reports).id, reports)
    assert imported.meta["devices"] == recorded.meta["devices"] == [f"cpu:{i}" for i in range(workers)]
    key = ["step", "phase", "device"]
    a, b = recorded.phases, imported.phases
    assert sorted(map(tuple, a[key].values)) == sorted(map(tuple, b[key].values))  # same phases, devices, steps
    # the trace does not say which worker ran which replica: each step's applies are compared as a set
    # (the importer gives the k-th to start device k, as dpprof starts replica k's thread k-th)
    pair = lambda df: (df.assign(k=df.groupby(["step", "phase"])["duration_ms"].rank(method="first"))  # noqa: E731
                       .assign(k=lambda d: d["k"].where(d["phase"] == "apply", 0))
                       .set_index(["step", "phase", "k"])["duration_ms"].sort_index())
    rec, imp = pair(a), pair(b)
    diff = (imp - rec).drop(0, level="step")  # step 0's ranges also hold first-call setup outside dpprof's timers
    # dpprof's timer runs inside the record_function range, so the range is the longer, by the calls between
    # them (tens of µs); a thread preempted there on a loaded machine makes it longer still (loose upper bound)
    assert (diff > -0.1).all(), diff.sort_values().head()
    # the typical range is its phase and those calls: 0.1 ms, and a quarter of the typical phase more where a loaded
    # machine slows the calls as it slows the phases (seen: a median of 0.104 ms beside a 764 s bench on two cores)
    later_phases = rec.drop(0, level="step")
    assert diff.abs().median() < 0.1 + 0.25 * later_phases.median(), (diff.describe(), later_phases.median())
    # (three in four within 3 ms and a tenth: under four test workers on two cores one range held a 3.4 ms preemption,
    # and with two more engineers' tests beside them two of 15 held 16 and 28 ms)
    assert (diff < 3.0 + 0.1 * later_phases).mean() >= 0.75, diff.sort_values().tail()
    # steps: one DataParallel.forward to the next in the trace, the run.step() blocks in the recording; step 0 is
    # left out, as for the phases: its block also holds the profiler's start before the first forward (seen: 670 ms
    # recorded against 225 ms from the first forward on, on a loaded machine), which no range of the trace holds
    later = lambda run: run.steps[run.steps["step"] > 0]["duration_ms"].sum()  # noqa: E731
    assert later(imported) == pytest.approx(later(recorded), rel=0.05)
    assert "k-th dpprof.apply" in " ".join(imported.notes["message"])



def test_a_dpprof_dataparallel_profiled_on_its_calling_thread_only_says_its_applies_are_not_in_the_trace(reports,
                                                                                                        tmp_path):
    # torch.profiler's default: the replicas' threads, and their dpprof.apply ranges, are not in the trace. The
    # run said the k-th dpprof.apply was device k, and that the steps had no DataParallel.forward (they have)
    _profile_dataparallel(reports, tmp_path / "calling-thread.json", 2, all_threads=False)
    doc = json.loads((tmp_path / "calling-thread.json").read_text())
    names = [e.get("name") for e in doc["traceEvents"]]
    assert "dpprof.parallel_apply" in names and "DataParallel.forward" in names and "dpprof.apply" not in names
    run = dpprof.load_run(import_traces([tmp_path / "calling-thread.json"], reports).id, reports)
    notes = " ".join(run.notes["message"])
    assert "k-th dpprof.apply" not in notes
    assert "no dpprof.apply" in notes and "profile_all_threads=True" in notes
    assert run.model.work.label == "apply"
    assert run.model.missing["work"].startswith("The trace has no dpprof.apply ranges")
    assert "profile_all_threads=True" in run.model.missing["work"]
    assert "no forward range" not in run.model.missing["work"]
    assert set(run.phases["phase"]) == {"scatter", "replicate", "parallel_apply", "gather", "backward"}

def _execution_trace(path: Path) -> None:
    """What torch.profiler.ExecutionTraceObserver writes for a training step: {"schema", "pid", ..., "nodes"}, a JSON
    file beside the profiler's own that a user may give by mistake (it read as "no events")."""
    from torch.profiler import ExecutionTraceObserver

    model = nn.Linear(8, 2)
    observer = ExecutionTraceObserver().register_callback(str(path))
    observer.start()
    model(torch.randn(4, 8)).sum().backward()
    observer.stop()
    observer.unregister_callback()


BAD = {
    "not-json.json": lambda p: p.write_text("this is not json\n"),
    "truncated.json.gz": lambda p: p.write_bytes(RESNET.read_bytes()[: RESNET.stat().st_size // 2]),
    "chrome.json": lambda p: p.write_text(json.dumps({"traceEvents": [
        {"name": "ParseHTML", "cat": "devtools.timeline", "ph": "X", "ts": 1, "dur": 5, "pid": 1, "tid": 1}],
        "metadata": {"source": "DevTools"}})),
    "empty.json": lambda p: p.write_text(json.dumps({"schemaVersion": 1, "traceEvents": []})),
    "metadata-only.json": lambda p: p.write_text(json.dumps({"schemaVersion": 1, "traceEvents": [
        {"name": "process_name", "ph": "M", "pid": 1, "tid": 0, "args": {"name": "python"}},
        {"name": "ProfilerStep#0", "cat": "user_annotation", "ph": "i", "ts": 5, "pid": 1, "tid": 1, "s": "t"}]})),
    "execution-trace.json": _execution_trace,
    # gzip -c of a .json.gz: it read as "gzip data in a file whose name does not end in .gz" (it does)
    "twice.json.gz": lambda p: p.write_bytes(gzip.compress(RESNET.read_bytes())),
    # cut inside a string: the stdlib's "Unterminated string starting at" read as cut off before its place
    "cut-in-a-string.json": lambda p: p.write_bytes((raw := gzip.decompress(RESNET.read_bytes()))[
        :raw.index(b'"name": "', 1 << 20) + 12]),
}


@pytest.mark.parametrize("name, expected", [
    ("not-json.json", "not JSON"), ("truncated.json.gz", "truncated"), ("chrome.json", "another tool"),
    ("empty.json", "no events"), ("metadata-only.json", "no CPU ranges to make steps of (no operator or range"),
    ("execution-trace.json", "an execution trace (torch.profiler.ExecutionTraceObserver's nodes, schema '"),
    ("twice.json.gz", "gzip data again inside its gzip data (compressed twice: gunzip it once)"),
    ("cut-in-a-string.json", "truncated or corrupt JSON after 777 events (byte 1,048,592: Unterminated string starting "
                             "there)"),
])
def test_bad_input_is_one_line_naming_the_file_exit_1_and_nothing_written(name, expected, tmp_path, reports):
    path = tmp_path / name
    BAD[name](path)
    reports.mkdir(parents=True, exist_ok=True)
    before = sorted(reports.iterdir())
    proc = forked.run([sys.executable, "-m", "dpprof", "--reports-dir", str(reports), "import", str(path)],
                      capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and name in lines[0] and expected in lines[0], proc.stderr
    assert sorted(reports.iterdir()) == before


def test_files_of_two_different_jobs_are_refused_with_nothing_written(reports):
    with pytest.raises(TraceError, match="ddp-2ranks-rank0-nccl.json.gz: world_size 2 .* different jobs"):
        import_traces([DDP128[0], DDP2], reports)
    with pytest.raises(TraceError, match="different jobs"):
        import_traces([RESNET, DDP128[1]], reports)
    assert not reports.exists() or not list(reports.iterdir())


def test_one_trace_given_twice_under_two_names_is_refused_not_read_as_two_ranks(tmp_path, reports):
    """A trace without distributedInfo copied under another name: the files' ranks come from their order, and the
    same times make them overlap, so the two copies read as a 2-rank job; Kineto's trace_id, new for every trace it
    writes, says they are one. Two real ranks' files (each its own trace_id) still import as ranks."""
    import shutil

    from cpu_traces import gloo_ddp_traces, single_process_trace

    one = single_process_trace(tmp_path / "made", steps=3)
    copy = shutil.copy(one, tmp_path / "made" / "copy.pt.trace.json")
    trace_id = json.loads(one.read_text())["trace_id"]
    with pytest.raises(TraceError, match=f"^copy.pt.trace.json: the same trace as {one.name} \\(trace_id {trace_id}\\): "
                                         "one trace given twice"):
        import_traces([one, copy], reports)
    assert not reports.exists() or not list(reports.iterdir())
    ranks = gloo_ddp_traces(tmp_path / "ddp", steps=3)
    assert len({json.loads(p.read_text())["trace_id"] for p in ranks}) == 2
    assert import_traces(ranks, reports).devices == ["rank:0", "rank:1"]
    # ranks given one id (a request that profiled them all, as an on-demand trace may be) are ranks, not copies
    docs = [json.loads(p.read_text()) for p in ranks]
    shared = []
    for i, doc in enumerate(docs):
        doc["trace_id"] = docs[0]["trace_id"]
        shared.append(tmp_path / f"shared-id-rank{i}.pt.trace.json")
        shared[-1].write_text(json.dumps(doc))
    assert import_traces(shared, reports).devices == ["rank:0", "rank:1"]


def test_the_command_imports_and_show_prints_the_run(reports):
    proc = forked.run([sys.executable, "-m", "dpprof", "--reports-dir", str(reports), "import", *map(str, DDP128),
                       "--name", "two ranks"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    run_id = re.search(r"imported run (\S+)", proc.stdout).group(1)
    show = forked.run([sys.executable, "-m", "dpprof", "--reports-dir", str(reports), "show", run_id],
                      capture_output=True, text=True, timeout=120)
    assert show.returncode == 0 and "rank:0" in show.stdout and "rank:1" in show.stdout
    assert "idle" in show.stdout  # a trace-only finding: the GPU idle share


def test_a_trace_imported_already_is_refused_naming_its_run_until_asked_again(reports):
    first = import_traces([DDP2], reports).id
    before = sorted(reports.iterdir())
    with pytest.raises(AlreadyImported) as refused:
        import_traces([DDP2], reports)
    assert str(refused.value) == (f"{DDP2.name} was imported already as run {first} (dpprof show {first}); "
                                  "--again imports it once more")
    assert sorted(reports.iterdir()) == before  # nothing written
    second = import_traces([DDP2], reports, again=True).id
    assert second != first and sorted(dpprof.list_runs(reports)["id"]) == sorted([first, second])
    with pytest.raises(AlreadyImported) as twice:
        import_traces([DDP2], reports)
    last = max(first, second)  # ids sort by the second they were made in, then at random
    assert f"was imported already as runs {min(first, second)}, {last} (dpprof show {last})" in str(twice.value)


def test_one_path_given_alone_is_one_trace_not_a_file_per_character(reports):
    # a str is a Sequence of str: it read as the files "/", "t", "m", ... ("t: no such file or directory")
    listed = dpprof.load_run(import_traces([DDP2], reports).id, reports)
    for alone in (str(DDP2), DDP2):
        run = dpprof.load_run(import_traces(alone, reports, again=True).id, reports)
        assert run.steps["duration_ms"].tolist() == listed.steps["duration_ms"].tolist()
        assert run.meta["devices"] == listed.meta["devices"]
    with pytest.raises(TraceError, match=f"^{re.escape(str(TRACES / 'nope.json'))}: no such file or directory$"):
        import_traces(str(TRACES / "nope.json"), reports)


def test_files_of_one_job_imported_already_all_or_some_are_refused_naming_which(reports):
    rank0 = import_traces(DDP128[:1], reports).id
    with pytest.raises(AlreadyImported) as some:
        import_traces(DDP128, reports)
    assert str(some.value) == (f"{DDP128[0].name} was imported already as run {rank0} (dpprof show {rank0}); "
                               f"{DDP128[1].name} was not; --again imports them once more")
    both = import_traces(DDP128, reports, again=True).id
    with pytest.raises(AlreadyImported) as every:
        import_traces([TRACES], reports)  # the directory: every trace in it, two of them imported as one run
    assert f"{DDP128[1].name} was imported already as run {both} (dpprof show {both})" in str(every.value)
    assert f"{DDP128[0].name} was imported already as runs {', '.join(sorted([rank0, both]))}" in str(every.value)
    assert f"{DDP2.name}, {RESNET.name} were not" in str(every.value)
    with pytest.raises(AlreadyImported) as whole:
        import_traces([DDP128[1]], reports)
    assert str(whole.value) == (f"{DDP128[1].name} was imported already as run {both} (dpprof show {both}); "
                                "--again imports it once more")


def test_the_command_refuses_a_trace_imported_already_in_one_line_and_imports_it_with_again(reports, capsys):
    from dpprof.cli import main

    assert main(["--reports-dir", str(reports), "import", "--quiet", *map(str, DDP128)]) == 0
    first = dpprof.list_runs(reports).loc[0, "id"]
    capsys.readouterr()
    assert main(["--reports-dir", str(reports), "import", "--quiet", *map(str, DDP128)]) == 1
    err = capsys.readouterr().err
    assert err.splitlines() == [f"dpprof: {DDP128[0].name}, {DDP128[1].name} were imported already as run {first} "
                                f"(dpprof show {first}); --again imports them once more"]
    assert len(dpprof.list_runs(reports)) == 1
    assert main(["--reports-dir", str(reports), "import", "--quiet", "--again", *map(str, DDP128)]) == 0
    assert len(dpprof.list_runs(reports)) == 2


def test_pending_traces_lists_trace_files_not_yet_imported(reports):
    reports.mkdir(parents=True)
    (reports / RESNET.name).write_bytes(RESNET.read_bytes())
    (reports / DDP2.name).write_bytes(DDP2.read_bytes())
    assert pending_traces(reports)["file"].tolist() == sorted([RESNET.name, DDP2.name]) or \
        set(pending_traces(reports)["file"]) == {RESNET.name, DDP2.name}
    import_traces([reports / RESNET.name], reports)
    assert pending_traces(reports)["file"].tolist() == [DDP2.name]
    runs = dpprof.list_runs(reports)
    assert runs["reason"].isna().all()  # trace files are not listed as unreadable runs


@pytest.mark.parametrize("path", [RESNET, DDP2], ids=lambda p: p.name)
def test_progress_reports_every_byte_read_from_disk(path):
    seen = []
    trace = TraceFile(path, progress=seen.append)
    events = sum(1 for _ in trace.events())
    assert sum(seen) == path.stat().st_size and len(seen) > 1 and events == len(_load(path)["traceEvents"])


def test_the_trace_package_needs_no_streamlit():
    code = "import sys, dpprof.trace; print('streamlit' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=str(ROOT))
    assert out.stdout.split() == ["False"], out.stderr


def test_the_gpu_time_view_is_the_distributed_view_of_the_table(reports):
    from dpprof.store import queries

    run = dpprof.load_run(import_traces([DDP2], reports).id, reports)
    per = queries.gpu_time(run).set_index("device")
    table = run.gpu_time.groupby("device").mean(numeric_only=True)
    assert list(per.index) == ["rank:0"] and per.loc["rank:0", "steps"] == 3
    for device, row in per.iterrows():
        assert row["computation_ms"] + row["overlapping_ms"] == pytest.approx(table.loc[device, "compute_ms"])
        assert row["communication_ms"] + row["overlapping_ms"] == pytest.approx(table.loc[device, "communication_ms"])
        assert row["idle_pct"] == pytest.approx(100 * table.loc[device, "idle_ms"] / table.loc[device, "window_ms"])
    assert row["overlapping_ms"] > 0  # DDP overlaps its all-reduces with backward compute


def test_unknown_categories_and_odd_fields_are_data_not_errors(tmp_path, reports):
    doc = _load(DDP2)
    base = _load(DDP2)["traceEvents"]
    odd = [{"ph": "X", "cat": "some_new_category", "name": "x", "pid": 1, "tid": 1, "ts": base[100]["ts"], "dur": 1},
           {"ph": "X", "cat": "cpu_op", "name": 42, "pid": 1, "tid": 1, "ts": base[100]["ts"], "dur": 1},
           {"ph": "X", "cat": "kernel", "name": "k", "pid": 0, "tid": 7, "ts": "soon", "args": ["not", "a", "dict"]},
           {"ph": "i", "name": "[memory]", "pid": 1, "tid": 1, "ts": base[100]["ts"], "args": {"Device Type": 1}},
           {"ph": "Z", "future": {"nested": [1, 2, 3]}}]
    doc["traceEvents"] = base + odd
    doc["someFutureField"] = {"a": [1, {"b": None}]}
    path = tmp_path / "odd.json"
    path.write_text(json.dumps(doc))
    run = dpprof.load_run(import_traces([path], reports).id, reports)
    assert sorted(run.steps["step"]) == sorted(_steps(_load(DDP2)))
    assert run.meta["workload_args"]["trace_files"][0]["events"] == len(base) + len(odd)


# -- the GPU partition and the collectives' busy time, driven by random interval sets ------------------------------


_KIND = st.sampled_from(["compute", "communication", "memcpy", "memset"])
# (gpu, kind, start µs, length µs): starting before the first step, overlapping each other, running past a step's
# end or the last one
_ACTIVITY = st.tuples(st.integers(0, 1), _KIND, st.floats(-50, 1_050, allow_nan=False), st.floats(0, 400))


@st.composite
def _steps_and_activity(draw):
    bounds = sorted(draw(st.lists(st.floats(0, 1_000, allow_nan=False), min_size=2, max_size=6, unique=True)))
    contiguous = draw(st.booleans())  # ProfilerStep ranges follow one another; a step may also end before the next
    windows = [(i, lo, hi if contiguous else lo + (hi - lo) * draw(st.floats(0.3, 1.0)))
               for i, (lo, hi) in enumerate(itertools.pairwise(bounds))]
    return windows, draw(st.lists(_ACTIVITY, max_size=40))


def _clipped_union(intervals, lo, hi) -> float:
    return _union_us([(max(a, lo), min(b, hi)) for a, b in intervals if a < hi and b > lo])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_steps_and_activity())
def test_gpu_parts_sum_to_each_step_whatever_the_intervals(case):
    windows, activity = case
    c = Collected(name="random", size_bytes=0, meta={})
    for gpu, kind, start, length in activity:
        c.gpu.setdefault((gpu, kind), _Intervals()).add(start, start + length)
    records = _gpu_time(c, windows, {0: "cuda:0", 1: "cuda:1"})
    assert len(records) == len(windows) * len({g for g, _ in c.gpu})
    bounds = {step: (lo, hi) for step, lo, hi in windows}
    for r in records:
        lo, hi = bounds[r.step]
        gpu = int(r.device[-1])

        def of(*kinds: str, gpu: int = gpu) -> list[tuple[float, float]]:
            return [(s, s + n) for g, k, s, n in activity if g == gpu and k in kinds]
        parts = [r.compute_ms - r.overlap_ms, r.overlap_ms, r.communication_ms - r.overlap_ms, r.memcpy_ms,
                 r.memset_ms, r.idle_ms]
        assert min(parts) >= -1e-9
        assert sum(parts) == pytest.approx(r.window_ms, abs=1e-9) and r.window_ms == pytest.approx((hi - lo) / 1e3)
        # each part independently: kernels, then copies under no kernel, memsets under neither, the rest idle
        kernels = _clipped_union(of("compute", "communication"), lo, hi)
        assert r.compute_ms * 1e3 == pytest.approx(_clipped_union(of("compute"), lo, hi), abs=1e-6)
        assert r.communication_ms * 1e3 == pytest.approx(_clipped_union(of("communication"), lo, hi), abs=1e-6)
        assert r.memcpy_ms * 1e3 == pytest.approx(
            _clipped_union(of("compute", "communication", "memcpy"), lo, hi) - kernels, abs=1e-6)
        busy = _clipped_union(of("compute", "communication", "memcpy", "memset"), lo, hi)
        assert r.idle_ms * 1e3 == pytest.approx(hi - lo - busy, abs=1e-6)


@settings(max_examples=300, deadline=None)
@given(_steps_and_activity(), st.lists(st.sampled_from(["all-reduce", "reduce-scatter", "all-to-all"]),
                                        min_size=40, max_size=40))  # every row read is named (named_collectives)
def test_collectives_busy_is_their_union_in_the_step_never_more_than_it(case, names):
    windows, activity = case
    steps = pd.DataFrame({"step": [w[0] for w in windows], "start_ms": [w[1] for w in windows],
                          "duration_ms": [w[2] - w[1] for w in windows], "rank": 0})
    spans = [(s, s + n) for _, _, s, n in activity]
    comms = pd.DataFrame({"step": 0, "device": "rank:0", "launch_ms": [a for a, _ in spans],
                          "duration_ms": [b - a for a, b in spans], "collective": names[:len(spans)], "rank": 0})
    busy = collective_busy(comms, steps)
    kinds = [k for k in busy.columns if k not in ("step", "device", "window_ms", "busy_ms")]
    for row in busy.itertuples():
        lo, hi = next((w[1], w[2]) for w in windows if w[0] == row.step)
        assert row.busy_ms == pytest.approx(_clipped_union(spans, lo, hi), abs=1e-6)
        assert row.busy_ms <= row.window_ms + 1e-9
        assert sum(busy.at[row.Index, k] for k in kinds) == \
            pytest.approx(row.busy_ms, abs=1e-6)
    expected = sum(_clipped_union(spans, lo, hi) > 0 for _, lo, hi in windows)
    assert len(busy) == expected


def test_a_collective_kernel_the_profiler_dropped_costs_its_own_op_only(tmp_path):
    """Each collective op gets the kernel it launched (External id: its record_param_comms op), not the next in
    order: with one all-reduce kernel of the middle removed, every other op keeps its kernel, and every phase stays
    inside its step."""
    from dpprof.trace.collect import collect

    doc = json.loads(gzip.decompress(DDP2.read_bytes()))
    comm = [i for i, e in enumerate(doc["traceEvents"]) if e.get("cat") == "kernel" and "nccl" in e.get("name", "")]
    dropped = doc["traceEvents"].pop(comm[len(comm) // 2])
    path = tmp_path / "dropped.pt.trace.json"
    path.write_text(json.dumps(doc))
    whole, less = collect(TraceFile(DDP2)), collect(TraceFile(path))
    assert len(less.comm_kernels) == len(whole.comm_kernels) - 1 and len(less.collectives) == len(whole.collectives)
    kept = [(a.kernel_start_us, b.kernel_start_us) for a, b in zip(whole.collectives, less.collectives)]
    changed = [pair for pair in kept if pair[0] != pair[1]]
    assert changed == [(dropped["ts"], None)]  # its own op lost its kernel, and only it
    run = dpprof.load_run(import_traces([path], tmp_path / "reports").id, tmp_path / "reports")
    phases = run.phases.merge(run.steps[["step", "start_ms", "duration_ms"]], on="step", suffixes=("", "_step"))
    assert (phases["start_ms"] >= phases["start_ms_step"] - 1e-6).all()
    assert (phases["start_ms"] + phases["duration_ms"] <= phases["start_ms_step"] + phases["duration_ms_step"] + 1e-6).all()


def _rank_one_stopped_a_step_early(tmp_path: Path, reports: Path) -> dpprof.StoredRun:
    """The shared 2-rank job imported with rank 1's trace cut before its last ProfilerStep (its profiler stopped a
    step early)."""
    paths = []
    for rank in (0, 1):
        doc = json.loads(gzip.decompress((TRACES / f"ddp-128ranks-rank{rank}-sampled.json.gz").read_bytes()))
        if rank == 1:
            steps = [e for e in doc["traceEvents"] if str(e.get("name", "")).startswith("ProfilerStep#")]
            last = max(steps, key=lambda e: e["ts"])
            doc["traceEvents"] = [e for e in doc["traceEvents"] if e.get("ts", 0) < last["ts"] or e.get("ph") == "M"]
        paths.append(tmp_path / f"job-rank{rank}.pt.trace.json")
        paths[-1].write_text(json.dumps(doc))
    return dpprof.load_run(import_traces(paths, reports).id, reports)


def test_ranks_that_hold_different_step_counts_are_said_so_and_each_gpu_reads_its_own(tmp_path, capsys):
    """A job whose rank 1 profiler stopped a step early: `show` says how many each holds, and each GPU's figures are
    spread over its own rank's steps."""
    from dpprof.cli import main
    from dpprof.findings.detail import operator_data

    reports = tmp_path / "reports"
    run = _rank_one_stopped_a_step_early(tmp_path, reports)
    held = run.steps.groupby("rank")["step"].nunique().to_dict()
    assert held[0] == held[1] + 1
    assert main(["--reports-dir", str(reports), "show", run.id]) == 0
    assert f"{held[0]} steps on rank 0, {held[1]} on rank 1" in capsys.readouterr().out
    d = operator_data(run)
    assert d is not None and {rank for rank, _ in d.gpu_steps_of} == {0, 1}
    for (rank, _), n in d.gpu_steps_of.items():
        assert n == held[rank]


def test_ops_vs_another_rank_that_holds_more_steps_sets_its_totals_over_as_many(tmp_path, capsys):
    """A job whose rank 1 profiler stopped a step early: `ops --rank 1 --vs rank:0` set rank 1's totals over its 1
    step against rank 0's over 2, and said both were over 2 steps ("rank 1 is 302.7 ms faster than rank 0 in device
    self time over 2 steps": each operator about half rank 0's). Rank 0's calls and times are now scaled to rank 1's
    step, and the sentence says so; the other way, rank 1's are scaled to rank 0's 2 steps."""
    from dpprof.cli import main

    reports = tmp_path / "reports"
    run = _rank_one_stopped_a_step_early(tmp_path, reports)
    held = run.steps.groupby("rank")["step"].nunique().to_dict()
    assert held == {0: 2, 1: 1}
    ops = run.operators()
    self_ms = ops.groupby("rank")["device_self_ms"].sum()
    calls = ops.groupby(["rank", "name"])["calls"].sum()
    for b, a in ((1, 0), (0, 1)):
        assert main(["--reports-dir", str(reports), "ops", run.id, "--rank", str(b), "--vs", f"rank:{a}",
                     "--json", "--top", "1000"]) == 0
        doc = json.loads(capsys.readouterr().out)
        said = re.fullmatch(rf"rank {b} is ([\d.]+) ms (slower|faster) than rank {a} in device self time over "
                            rf"{held[b]} steps? \(rank {a}'s totals scaled from {held[a]} steps?\): .*", doc["sentence"])
        assert said, doc["sentence"]
        factor = held[b] / held[a]
        expected = self_ms[b] - self_ms[a] * factor
        assert float(said[1]) * (1 if said[2] == "slower" else -1) == pytest.approx(expected, abs=0.051)
        rows = pd.DataFrame(doc["operators"]).set_index("name")
        for name in ("aten::mm", "record_param_comms"):
            assert rows.loc[name, "calls_a"] == pytest.approx(calls[(a, name)] * factor)
            assert rows.loc[name, "calls_b"] == calls[(b, name)]


def test_kernel_diff_of_ranks_that_hold_different_step_counts_is_over_as_many_steps(tmp_path):
    """A job whose rank 1 profiler stopped a step early: opdiff.kernel_diff of rank 0 against rank 1 set rank 1's
    kernels over its 1 step against rank 0's over 2 (303.6 ms against 606.5: -302.9 ms, where per step rank 1 is
    0.3 ms slower); rank 0's calls and times are now scaled to rank 1's step, as the operators' side by side does."""
    from dpprof.views.opdiff import Pick, kernel_diff

    run = _rank_one_stopped_a_step_early(tmp_path, tmp_path / "reports")
    diff = kernel_diff(run, Pick(rank=0), run, Pick(rank=1)).set_index("name")
    assert diff.attrs["steps"] == 1 and diff.attrs["scaled_a"] == {0: 2} and not diff.attrs["scaled_b"]
    kernels = run.kernels().groupby(["rank", "name"])[["calls", "total_ms"]].sum()
    for col in ("calls", "total_ms"):
        a = kernels.loc[0, col] / 2
        b = kernels.loc[1, col]
        pd.testing.assert_series_equal(diff[f"{col}_a"].reindex(a.index).astype(float), a.astype(float),
                                       check_names=False)
        pd.testing.assert_series_equal(diff[f"{col}_b"].reindex(b.index).astype(float), b.astype(float),
                                       check_names=False)
    assert diff["delta_ms"].sum() == pytest.approx(kernels.loc[1, "total_ms"].sum() - kernels.loc[0, "total_ms"].sum() / 2)


def test_ops_vs_a_rank_whose_trace_holds_no_operators_says_so_not_faster(tmp_path, capsys):
    """The shared 2-rank job with rank 1's trace holding no cpu_op events (profiled without ProfilerActivity.CPU):
    `ops --rank 1 --vs rank:0` said "rank 1 is 623.2 ms faster than rank 0" with a table of rank 0's operators
    against zeros, where plain `ops --rank 1` says it has none. Either way round it now says the rank has none, with
    no table (--json: no rows)."""
    from dpprof.cli import main

    paths = []
    for rank in (0, 1):
        doc = json.loads(gzip.decompress((TRACES / f"ddp-128ranks-rank{rank}-sampled.json.gz").read_bytes()))
        if rank == 1:
            doc["traceEvents"] = [e for e in doc["traceEvents"] if e.get("cat") != "cpu_op"]
        paths.append(tmp_path / f"job-rank{rank}.pt.trace.json")
        paths[-1].write_text(json.dumps(doc))
    reports = tmp_path / "reports"
    run = dpprof.load_run(import_traces(paths, reports).id, reports)
    assert set(run.operators()["rank"]) == {0}
    said = "rank 1 has no operators to compare with rank 0's: its trace or capture holds none."
    assert main(["--reports-dir", str(reports), "ops", run.id, "--rank", "1", "--vs", "rank:0"]) == 0
    assert capsys.readouterr().out == said + "\n"
    assert main(["--reports-dir", str(reports), "ops", run.id, "--rank", "0", "--vs", "rank:1", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["sentence"] == said and doc["operators"] == []


def test_the_parts_of_the_step_of_ranks_that_hold_different_step_counts_are_each_ranks_mean(tmp_path):
    """A job whose rank 1 profiler stopped a step early: each part's ms per step (phase_totals, the Overview's shares
    chart, phase_totals.csv, Compare) is each rank's mean over its own steps, averaged over the ranks, as `dpprof show`'s
    table per rank gives it, and the parts sum to the ranks' mean step. They were the ranks' mean total over the most
    steps (2 of rank 0's, 1 of rank 1's): every part read too small, their sum under the mean step."""
    reports = tmp_path / "reports"
    run = _rank_one_stopped_a_step_early(tmp_path, reports)
    held = run.steps.groupby("rank")["step"].nunique()
    assert held[0] == held[1] + 1
    totals = queries.phase_totals(run).set_index("phase")
    mean_step = run.steps.groupby("rank")["duration_ms"].mean().mean()
    assert totals["per_step_ms"].sum() == pytest.approx(mean_step, rel=1e-9)
    parts = queries.step_parts(run)
    for phase in totals.index:
        each = parts.groupby("rank")[phase].sum() / held
        assert totals.loc[phase, "per_step_ms"] == pytest.approx(each.mean(), rel=1e-9, abs=1e-12), phase


def test_the_communication_advice_of_an_imported_fsdp_job_is_fsdps(tmp_path, reports):
    """An imported FSDP2 job on gloo: its collectives are all-gathers of parameters and reduce-scatters of gradients,
    busy over a fifth of the step. The communication finding advised compressing gradients with a DDP communication
    hook (fp16/bf16 compress, PowerSGD), which FSDP2 does not take and which would not touch an all-gather; it now
    names FSDP's mixed-precision policy, which halves the bytes of both."""
    from cpu_traces import fsdp_traces
    from dpprof.findings import run_findings

    run = dpprof.load_run(import_traces(fsdp_traces(tmp_path / "made", steps=3), reports).id, reports)
    assert run.model.sharded and set(run.comms["collective"]) == {"all-gather", "reduce-scatter"}
    found = run_findings(run).table.set_index("kind")
    assert "communication_share" in found.index, found
    advice = found.loc["communication_share", "advice"]
    assert "communication hook" not in advice and "PowerSGD" not in advice, advice
    assert "MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)" in advice


def test_a_rank_that_stopped_a_step_early_has_its_buckets_per_step(tmp_path, reports):
    """A gloo DDP job of 3 steps whose rank 1 trace ends after 2: each rank's buckets per step are counted over its
    steps past the job's first, from the run's rows. They were counted over the steps past the second (the steps past
    the first taken out twice): rank 1's one later step left out, its column read <NA>, the others' from 1 of 2."""
    from cpu_traces import gloo_ddp_traces
    from dpprof.views.overview import comm_stats

    files = gloo_ddp_traces(tmp_path / "made", steps=3)
    doc = json.loads(files[1].read_text())
    starts = sorted(e["ts"] for e in doc["traceEvents"] if str(e.get("name", "")).startswith("ProfilerStep#"))
    doc["traceEvents"] = [e for e in doc["traceEvents"] if e.get("ts", 0) < starts[-1] or e.get("ph") == "M"]
    files[1].write_text(json.dumps(doc))
    run = dpprof.load_run(import_traces(files, reports).id, reports)
    assert run.steps.groupby("rank")["step"].nunique().to_dict() == {0: 3, 1: 2}
    later = run.comms[run.comms["step"] > run.comms["step"].min()]
    expected = later.groupby(["device", "step"])["bucket"].nunique().groupby("device").median()
    assert set(expected.index) == {"rank:0", "rank:1"}
    assert comm_stats(run).set_index("device")["buckets_per_step"].to_dict() == expected.to_dict()


def test_the_operators_behind_a_straggler_are_set_against_as_many_steps_of_the_others(tmp_path, reports):
    """Rank 1 of a 2-rank gloo job sleeps before each forward (the straggler); rank 0's trace ends a step early. The
    operators behind the straggler finding set rank 1's host self time over its 6 steps against rank 0's over 5: the
    difference held a step of rank 1's whole work, its calls "N calls against 5/6 N". Each rank's totals are now
    scaled to the straggler's steps, and the sentence says so."""
    from cpu_traces import gloo_ddp_traces
    from dpprof.findings import run_findings

    files = gloo_ddp_traces(tmp_path / "made", steps=6, delay=(1, 0.03))
    doc = json.loads(files[0].read_text())
    starts = sorted(e["ts"] for e in doc["traceEvents"] if str(e.get("name", "")).startswith("ProfilerStep#"))
    doc["traceEvents"] = [e for e in doc["traceEvents"] if e.get("ts", 0) < starts[-1] or e.get("ph") == "M"]
    files[0].write_text(json.dumps(doc))
    run = dpprof.load_run(import_traces(files, reports).id, reports)
    held = run.steps.groupby("rank")["step"].nunique().to_dict()
    assert held == {0: 5, 1: 6}
    evidence = run_findings(run).table.set_index("kind").loc["straggler_rank", "evidence"]
    said = re.search(r"rank:1 is ([\d.]+) ms (slower|faster) than the others' mean \(each rank's scaled to 6 steps\) "
                     r"in host self time over 6 steps", evidence)
    assert said, evidence
    ops = run.operators()
    self_ms = ops.groupby("rank")["host_self_ms"].sum()
    expected = self_ms[1] - self_ms[0] * held[1] / held[0]
    assert float(said[1]) * (1 if said[2] == "slower" else -1) == pytest.approx(expected, abs=0.051)


def test_ranks_named_by_their_files_alone_are_not_taken_for_the_whole_job(tmp_path):
    """Without distributedInfo, files named job-rank2 and job-rank10 are two ranks of a job of unknown size (not "a
    2-rank job"); files of ranks 0 to n-1 are taken for the job."""
    def named(ranks):
        paths = []
        for i, rank in enumerate(ranks):
            doc = json.loads(gzip.decompress(DDP128[i].read_bytes()))
            doc.pop("distributedInfo", None)
            paths.append(tmp_path / f"{'-'.join(map(str, ranks))}" / f"job-rank{rank}.pt.trace.json")
            paths[-1].parent.mkdir(exist_ok=True)
            paths[-1].write_text(json.dumps(doc))
        run = import_traces(paths, tmp_path / "reports")
        return dpprof.load_run(run.id, tmp_path / "reports")

    apart = named([2, 10])
    assert apart.meta["world_size"] is None and apart.model.scope == "ranks 2 and 10"
    whole = named([0, 1])
    assert whole.meta["world_size"] == 2 and whole.model.scope == "2 ranks"


def test_profiling_cycles_of_one_process_are_refused_as_ranks_with_what_they_are(tmp_path, reports):
    """tensorboard_trace_handler writes one file per cycle of a schedule with repeat, named <worker>.<time>: two of one
    process are no ranks of a job."""
    from cpu_traces import single_process_trace

    for stamp in ("1764230400000", "1764230405000"):
        single_process_trace(tmp_path / "tb", stem=f"host_4242.{stamp}")
    with pytest.raises(TraceError, match=r"host_4242\.1764230400000\.pt\.trace\.json, host_4242\.1764230405000\.pt\."
                                         r"trace\.json: 2 profiling cycles of one process \(host_4242, "):
        import_traces([tmp_path / "tb"], reports)
    assert not reports.exists() or not any(reports.iterdir())


def test_a_tensorboard_log_directory_names_its_runs_directories(tmp_path, reports):
    """tensorboard_trace_handler(dir_name) writes each run's files into a directory of its own, and TensorBoard is
    given the directory above them: dpprof import of that one said only that it held no trace files."""
    from cpu_traces import single_process_trace

    log = tmp_path / "log"
    for run in ("resnet18", "resnet50"):
        single_process_trace(log / run, stem=f"host_4242.{1764230400000 if run == 'resnet18' else 1764230405000}")
    (log / "notes").mkdir()
    with pytest.raises(TraceError, match=re.escape(
            f"{log}: no .json or .json.gz trace files in this directory; its directories resnet18, resnet50 hold "
            "some (a TensorBoard log directory, a directory per run): import one of them")):
        import_traces([log], reports)
    with pytest.raises(TraceError, match=re.escape(f"{log / 'notes'}: no .json or .json.gz trace files in this "
                                                   "directory") + "$"):
        import_traces([log / "notes"], reports)
    assert not reports.exists() or not any(reports.iterdir())
    assert import_traces([log / "resnet50"], reports).steps == 1


def test_profiling_cycles_of_a_ddp_job_say_which_files_import_together(tmp_path, reports):
    """A DDP job profiled with a schedule with repeat: tensorboard_trace_handler writes a file per rank per cycle
    (<host>_<pid>.<time>). Refused as before, the line says which files are one cycle of the job, one per rank; it
    said "import each file on its own", each of which is one rank of the job alone."""
    from cpu_traces import gloo_ddp_traces

    handler = tmp_path / "tb"
    handler.mkdir()
    for cycle in range(2):  # a cycle of each rank: each rank's file named as the handler names it
        for rank, path in enumerate(gloo_ddp_traces(tmp_path / f"cycle{cycle}", steps=2)):
            path.rename(handler / f"vm_{4100 + rank}.{1764230400000 + 5000 * cycle + 3 * rank}.pt.trace.json")
    cycles = [[f"vm_4100.{1764230400000 + 5000 * c}.pt.trace.json", f"vm_4101.{1764230400003 + 5000 * c}.pt.trace.json"]
              for c in range(2)]
    with pytest.raises(TraceError, match=re.escape(
            f"import each cycle's files together, one per rank: {', '.join(cycles[0])}; {', '.join(cycles[1])}")):
        import_traces([handler], reports)
    assert not reports.exists() or not any(reports.iterdir())
    run = import_traces([handler / name for name in cycles[1]], reports)
    assert run.devices == ["rank:0", "rank:1"] and run.steps == 2


def test_a_trace_without_a_schedule_has_a_step_per_optimizer_step(tmp_path, reports):
    """``prof.export_chrome_trace`` after profiling without a schedule (the tutorials' way) writes no ProfilerStep
    ranges: each step ends as an Optimizer.step# range does, as ``dpprof run`` cuts a script's steps, instead of the
    whole trace as one step whose backward held every later step's forward."""
    model = nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            loss = model(torch.randn(4, 8)).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
    path = tmp_path / "plain.json"
    prof.export_chrome_trace(str(path))
    doc = _load(path)
    assert not _steps(doc)
    ops = sorted(e["ts"] + e["dur"] for e in doc["traceEvents"] if str(e.get("name")).startswith("Optimizer.step#"))
    assert len(ops) == 3
    run = dpprof.load_run(import_traces([path], reports).id, reports)
    steps = run.steps.sort_values("step")
    assert steps["step"].tolist() == [0, 1, 2]
    # steps 1 and 2 run from one optimizer step's end to the next's
    assert steps["duration_ms"].iloc[1:].tolist() == pytest.approx([(b - a) / 1e3 for a, b in zip(ops, ops[1:])],
                                                                   abs=1e-5)
    ends_ms = (steps["start_ms"] + steps["duration_ms"]).tolist()
    assert [b - a for a, b in zip(ends_ms, ends_ms[1:])] == pytest.approx([(b - a) / 1e3 for a, b in zip(ops, ops[1:])],
                                                                          abs=1e-5)
    phases = run.phases
    assert set(phases[phases.phase == "backward"]["step"]) == {0, 1, 2}  # each step's own backward
    assert any("each step ends as an Optimizer.step# range does (3)" in n for n in run.notes["message"])


@pytest.mark.filterwarnings("ignore:Warning. Profiler clears events at the end of each cycle:UserWarning")
def test_the_cycles_of_a_named_worker_are_one_workload(tmp_path, reports):
    """tensorboard_trace_handler with the script's worker_name writes <worker_name>.<time ns>.pt.trace.json, one file
    per cycle of a schedule with repeat: each imported on its own is a run of the job "trainer", not of a workload
    named after the file's time that no other run shares."""
    model = nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    handler = torch.profiler.tensorboard_trace_handler(str(tmp_path / "tb"), worker_name="trainer")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], on_trace_ready=handler,
                                schedule=torch.profiler.schedule(wait=0, warmup=1, active=1, repeat=2)) as prof:
        for _ in range(4):
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
            prof.step()
    files = sorted((tmp_path / "tb").iterdir())
    assert len(files) == 2 and all(re.fullmatch(r"trainer\.\d{10,}\.pt\.trace\.json", f.name) for f in files)
    runs = [dpprof.load_run(import_traces([f], reports).id, reports) for f in files]
    assert [r.meta["workload"] for r in runs] == ["trainer", "trainer"]


def test_collectives_whose_sizes_the_trace_lacks_show_no_bytes_rather_than_zero(tmp_path, reports):
    """A gloo DDP job profiled without record_shapes: its collectives' sizes are not in the trace, which the bucket
    finding says; the per-rank collectives table (dpprof show, the Overview) has no bytes for them either (it said
    0.00 sent per step)."""
    import contextlib
    import io

    from cpu_traces import gloo_ddp_traces
    from dpprof.cli import main
    from dpprof.views.overview import comm_stats

    run = dpprof.load_run(import_traces(gloo_ddp_traces(tmp_path / "made", steps=4), reports).id, reports)
    assert len(run.comms) and run.comms["bucket_bytes"].isna().all()
    stats = comm_stats(run)
    assert list(stats["device"]) == ["rank:0", "rank:1"] and stats["sent_per_step_bytes"].isna().all()
    assert (stats["busy_ms"] > 0).all()
    # buckets per step: each rank's distinct collectives in its steps past the first (the first forward's broadcast of
    # the model is no bucket), the median, from the run's rows; it read 1.50 with the first step's broadcast in
    later = run.comms[run.comms["step"] > run.comms["step"].min()]
    expected = later.groupby(["device", "step"])["bucket"].nunique().groupby("device").median()
    assert stats.set_index("device")["buckets_per_step"].to_dict() == expected.to_dict()
    assert run.comms[run.comms["step"] == run.comms["step"].min()].groupby("device")["bucket"].nunique().gt(
        expected).all()  # the first step's broadcast is there, and left out
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["--reports-dir", str(reports), "show", run.id]) == 0
    table = out.getvalue().split("collectives per step past the first (from the trace):")[1].split("\n\n")[0]
    header, _, *ranks = table.strip("\n").splitlines()
    end = header.index("sent per step (MiB)") + len("sent per step (MiB)")  # right-aligned under its header
    assert [line[:end].split()[-1] for line in ranks] == ["-", "-"], table
    assert "its size is not in the trace" in out.getvalue()


def test_some_ranks_of_a_job_with_a_straggler_are_not_told_their_wait_is_communication(tmp_path, reports):
    """Rank 1 of a 2-rank gloo job sleeps before each forward: imported together, rank 1 is the straggler; rank 0
    imported alone waits ~30 ms a step inside its all-reduce with no straggler to name, and its communication finding
    said only "raise the per-rank batch". It now says that a rank not in the run may be what it waits for."""
    from cpu_traces import gloo_ddp_traces
    from dpprof.findings import run_findings

    files = gloo_ddp_traces(tmp_path / "made", steps=4, delay=(1, 0.03))
    words = "only 1 of the job's 2 ranks is in this run: time inside a collective includes waiting for a slower rank"
    alone = dpprof.load_run(import_traces(files[:1], reports).id, reports)
    found = run_findings(alone).table.set_index("kind")
    assert "straggler_rank" not in found.index
    assert words in found.loc["communication_share", "evidence"]
    assert found.loc["communication_share", "advice"].startswith("Bring every rank's file into the run first")
    both = dpprof.load_run(import_traces(files, reports, again=True).id, reports)
    found = run_findings(both).table
    assert found.set_index("kind").loc["straggler_rank", "device"] == "rank:1"
    assert not found["evidence"].str.contains("ranks is in this run|ranks are in this run").any()
    assert not found["advice"].str.contains("Bring every rank's file").any()
    # one step figure: the communication finding's mean step past the first is the job's (the slowest rank's each
    # step, the data finding's), not each rank's own step averaged
    comm = found.set_index("kind").loc["communication_share", "evidence"]
    said = float(re.search(r"of a ([\d.]+) ms mean step past the first", comm).group(1))
    job = both.steps.groupby("step")["duration_ms"].max().sort_index().iloc[1:]
    assert said == pytest.approx(job.mean(), abs=0.006)


def test_a_bucket_launched_in_backward_is_backwards_though_gloo_starts_it_after_backwards_last_op(tmp_path, reports):
    """A gloo DDP job with a bucket per parameter whose rank 1 sleeps before each forward: rank 0's first two buckets
    hold gloo's two worker threads waiting for rank 1, so its last buckets' gloo:all_reduce ranges start ~30 ms after
    backward's last op, though their c10d::allreduce_ launched them inside it. They were taken for the script's own
    collectives (script_comm), the wait in them out of backward; a collective is now placed by its launch."""
    from cpu_traces import gloo_ddp_traces

    files = gloo_ddp_traces(tmp_path / "made", steps=3, delay=(1, 0.03), bucket_cap_mb=1e-6)
    run = dpprof.load_run(import_traces(files, reports).id, reports)
    phases = run.phases
    assert "script_comm" not in set(phases["phase"])  # the script calls no collective of its own
    waits = phases[phases["phase"] == "comm_wait"].groupby("device")["step"].nunique().to_dict()
    assert waits == {"rank:0": 3, "rank:1": 3}
    later = run.comms[run.comms["step"] > run.comms["step"].min()]
    assert later.groupby(["device", "step"]).size().min() >= 3  # buckets per step, each all-reduced
    per = phases.pivot_table(index=["device", "step"], columns="phase", values="duration_ms", aggfunc="sum")
    assert (per["backward_compute"] + per["comm_wait"] <= per["backward"] + 1e-6).all()

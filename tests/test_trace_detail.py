"""Operators, kernels, GPU metrics, memory and modules of imported traces (dpprof.trace.detail, dpprof.store.detail_rows),
checked against figures computed here independently from the raw events of every shared trace (plain json and gzip,
direct code): calls and sums exact (to float rounding), means within 0.1 %, utilization, SM efficiency and occupancy
within 0.5 points. Plus a trace recorded here on CPU with shapes, memory, stacks and modules; runs without the tables;
bad values in the events."""
from __future__ import annotations

import functools
import gzip
import json
import math
import sqlite3
import threading
from collections import defaultdict
from pathlib import Path

import pandas as pd
import pytest

import dpprof
from dpprof.store.schema import DETAIL_TABLES
from dpprof.cli import main
from dpprof.store import detail_rows
from dpprof.trace.detail import TC_ELIGIBLE_OPS, TC_KERNEL_PATTERNS, detail_of_trace
from dpprof.trace.importer import import_traces

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT.parent / "shared" / "traces"
SINGLE = ["resnet50-1gpu-tb-sample.pt.trace.json.gz", "ddp-2ranks-rank0-nccl.json.gz"]
RANKS = ["ddp-128ranks-rank0-sampled.json.gz", "ddp-128ranks-rank1-sampled.json.gz"]
OP_CATS = {"cpu_op", "Operator"}
KERNEL_CATS = {"kernel", "Kernel"}
LAUNCH_CATS = {"cuda_runtime", "cuda_driver", "Runtime"}
SUM_REL = 1e-9  # sums of the same floats in another order
MEAN_REL = 1e-3  # 0.1 %
POINTS = 0.5  # percentage points


def _events(path: Path) -> tuple[list[dict], dict]:
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt") as f:
        doc = json.load(f)
    return doc["traceEvents"], doc


def _timed(e: dict) -> bool:
    return (e.get("ph") == "X" and isinstance(e.get("ts"), (int, float)) and isinstance(e.get("dur"), (int, float))
            and isinstance(e.get("name"), str))


def _tid(t: object) -> object:
    return int(t) if isinstance(t, str) and t.isdigit() else t


def _ext(args: dict) -> object:
    return args.get("External id", args.get("external id"))


class Reference:
    """A trace's figures computed the plain way: lists of dicts, loops, no numpy, nothing of dpprof's."""

    def __init__(self, path: Path) -> None:
        events, self.doc = _events(path)
        self.ops = [e for e in events if _timed(e) and e.get("cat") in OP_CATS
                    and not e["name"].startswith("ProfilerStep#")]
        self.kernels = [e for e in events if _timed(e) and e.get("cat") in KERNEL_CATS]
        self.launches = [e for e in events if _timed(e) and e.get("cat") in LAUNCH_CATS]
        self.steps = sorted((e["ts"], e["ts"] + e["dur"], int(e["name"].split("#")[1])) for e in events
                            if _timed(e) and e.get("cat") in (OP_CATS | {"user_annotation"})
                            and e["name"].startswith("ProfilerStep#"))
        self.memory = [e for e in events if e.get("ph") == "i" and e.get("name") == "[memory]"]
        self.python = [e for e in events if _timed(e) and e.get("cat") == "python_function"
                       and (e.get("args") or {}).get("Python module id") is not None]
        self._nest()
        self._link()

    @staticmethod
    def _parents(items: list[dict]) -> list[int | None]:
        """The innermost item holding each one on its thread (intervals sorted by start, longest first)."""
        parent: list[int | None] = [None] * len(items)
        per_tid = defaultdict(list)
        for i, e in enumerate(items):
            per_tid[_tid(e["tid"])].append(i)
        for idx in per_tid.values():
            idx.sort(key=lambda i: (items[i]["ts"], -(items[i]["ts"] + items[i]["dur"])))
            open_: list[int] = []
            for i in idx:
                start, end = items[i]["ts"], items[i]["ts"] + items[i]["dur"]
                # a holder began no later, ends no earlier, and this one begins before the holder's end (an op of
                # no length holds nothing)
                while open_ and not (start < items[open_[-1]]["ts"] + items[open_[-1]]["dur"]
                                     and end <= items[open_[-1]]["ts"] + items[open_[-1]]["dur"]):
                    open_.pop()
                parent[i] = open_[-1] if open_ else None
                open_.append(i)
        return parent

    def _nest(self) -> None:
        self.parent = self._parents(self.ops)
        self.ops_of_tid: dict[object, list[tuple[int, dict]]] = defaultdict(list)  # (index, op), in file order
        for i, e in enumerate(self.ops):
            self.ops_of_tid[_tid(e["tid"])].append((i, e))
        self.children_ms = [0.0] * len(self.ops)
        for i, p in enumerate(self.parent):
            if p is not None:
                self.children_ms[p] += self.ops[i]["dur"] / 1e3

    def _innermost(self, tid: object, ts: float) -> int | None:
        # the open op that began last; of two beginning together, the shorter; of two alike, the later in the file
        # (it nests in the earlier: _parents). Each of the thread's ops is looked at, in file order.
        best = None
        for i, e in self.ops_of_tid.get(tid, ()):
            if e["ts"] <= ts <= e["ts"] + e["dur"]:
                if best is None or (e["ts"], -e["dur"]) >= (self.ops[best]["ts"], -self.ops[best]["dur"]):
                    best = i
        return best

    def _link(self) -> None:
        by_ext = {_ext(e.get("args") or {}): i for i, e in enumerate(self.ops) if _ext(e.get("args") or {}) is not None}
        launch_op = {}
        for e in self.launches:
            a = e.get("args") or {}
            op = by_ext.get(_ext(a))
            if op is None:
                op = self._innermost(_tid(e["tid"]), e["ts"])
            launch_op[a.get("correlation")] = op
        self.self_dev = [0.0] * len(self.ops)
        self.kernel_op: list[int | None] = []
        for k in self.kernels:
            a = k.get("args") or {}
            corr = a.get("correlation")
            op = launch_op.get(corr)  # its launch's op, else (no launch, or one of no op) its own External id's
            if op is None:
                op = by_ext.get(_ext(a))
            self.kernel_op.append(op)
            if op is not None:
                self.self_dev[op] += k["dur"] / 1e3
        self.total_dev = list(self.self_dev)
        for i in range(len(self.ops)):
            if self.self_dev[i]:
                p = self.parent[i]
                while p is not None:
                    self.total_dev[p] += self.self_dev[i]
                    p = self.parent[p]

    def operators(self) -> dict[str, dict[str, float]]:
        out: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        for i, e in enumerate(self.ops):
            row = out[e["name"]]
            row["calls"] += 1
            row["host_total_ms"] += e["dur"] / 1e3
            row["host_self_ms"] += e["dur"] / 1e3 - self.children_ms[i]
            row["device_self_ms"] += self.self_dev[i]
            row["device_total_ms"] += self.total_dev[i]
        return out

    def kernel_stats(self) -> dict[str, dict[str, float]]:
        out: dict[str, dict[str, float]] = {}
        for k in self.kernels:
            a = k.get("args") or {}
            row = out.setdefault(k["name"], {"calls": 0, "total_ms": 0.0, "min_ms": math.inf, "max_ms": 0.0,
                                             "bw": 0.0, "ow": 0.0})
            ms = k["dur"] / 1e3
            row["calls"] += 1
            row["total_ms"] += ms
            row["min_ms"] = min(row["min_ms"], ms)
            row["max_ms"] = max(row["max_ms"], ms)
            row["bw"] += a["blocks per SM"] * ms
            row["ow"] += a["est. achieved occupancy %"] * ms
        for row in out.values():
            row["mean_ms"] = row["total_ms"] / row["calls"]
            row["mean_blocks_per_sm"] = row["bw"] / row["total_ms"] if row["total_ms"] else math.nan
            row["mean_occupancy_pct"] = row["ow"] / row["total_ms"] if row["total_ms"] else math.nan
        return out

    def gpu_metrics(self, lo: float, hi: float) -> tuple[float, float, float]:
        """Utilization, SM efficiency and occupancy (%) over [lo, hi], by walking the kernels' edges."""
        edges = []
        for k in self.kernels:
            a = k.get("args") or {}
            edges += [(k["ts"], 1, a["blocks per SM"]), (k["ts"] + k["dur"], -1, -a["blocks per SM"])]
        edges.sort(key=lambda x: x[0])
        busy = sm = 0.0
        running, level = 0, 0.0
        for (t, d, v), nxt in zip(edges, edges[1:] + [(hi, 0, 0.0)]):
            running += d
            level += v
            a, b = min(max(t, lo), hi), min(max(nxt[0], lo), hi)
            if running > 0:
                busy += b - a
            sm += (b - a) * min(max(level, 0.0), 1.0)
        weight = occ = 0.0
        for k in self.kernels:
            clipped = max(0.0, min(k["ts"] + k["dur"], hi) - max(k["ts"], lo))
            weight += clipped
            occ += clipped * k["args"]["est. achieved occupancy %"]
        window = hi - lo
        return 100 * busy / window, 100 * sm / window, occ / weight if weight else math.nan


@functools.cache
def _reference(path: Path) -> Reference:
    """A trace file's Reference, made once: the traces of ../shared/traces and the module's CPU trace are read by
    several tests, and a Reference is only read after it is made."""
    return Reference(path)


@pytest.fixture(scope="module", autouse=True)
def _references_dropped_after_the_module():
    yield
    _reference.cache_clear()


def _close(a: float, b: float, rel: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=rel, abs_tol=1e-9)


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """Each shared trace imported as a run (the two 128-rank files as one run of two ranks)."""
    reports = tmp_path_factory.mktemp("reports")
    runs = {name: dpprof.load_run(import_traces([TRACES / name], reports).paths[0]) for name in SINGLE}
    both = import_traces([TRACES / n for n in RANKS], reports)
    runs["ranks"] = dpprof.load_run(both.paths[0])
    return runs


def _cases():
    return [(name, name, None) for name in SINGLE] + [(name, "ranks", r) for r, name in enumerate(RANKS)]


@pytest.mark.parametrize("trace,run,rank", _cases())
def test_operators_match_the_raw_events(imported, trace, run, rank):
    ref = _reference(TRACES / trace).operators()
    got = detail_rows.operators(imported[run], rank=rank)
    assert set(got["name"]) == set(ref), "every operator name, and no other"
    assert got.groupby("name").size().max() == 1, "one device per name in a one-process trace"
    for row in got.itertuples():
        want = ref[row.name]
        assert row.calls == want["calls"], row.name
        for col in ("host_total_ms", "host_self_ms", "device_total_ms", "device_self_ms"):
            assert _close(getattr(row, col), want[col], SUM_REL), (row.name, col, getattr(row, col), want[col])
    assert got["device_total_ms"].sum() > 0
    assert (got["host_self_ms"] >= -1e-6).all()


@pytest.mark.parametrize("trace,run,rank", _cases())
def test_kernels_match_the_raw_events(imported, trace, run, rank):
    ref = _reference(TRACES / trace).kernel_stats()
    got = detail_rows.kernels(imported[run], rank=rank)
    assert set(got["name"]) == set(ref)
    for row in got.itertuples():
        want = ref[row.name]
        assert row.calls == want["calls"]
        for col, rel in (("total_ms", SUM_REL), ("min_ms", SUM_REL), ("max_ms", SUM_REL), ("mean_ms", MEAN_REL),
                         ("mean_blocks_per_sm", MEAN_REL), ("mean_occupancy_pct", MEAN_REL)):
            assert _close(getattr(row, col), want[col], rel), (row.name, col)
        assert row.tensor_cores == any(p in row.name for p in TC_KERNEL_PATTERNS)


@pytest.mark.parametrize("trace,run,rank", _cases())
def test_gpu_metrics_match_the_plugins_definitions(imported, trace, run, rank):
    ref = _reference(TRACES / trace)
    per_step = detail_rows.gpu_metrics(imported[run], rank=rank)
    assert len(per_step) == len(ref.steps)
    steps = {n: (lo, hi) for lo, hi, n in ref.steps}
    for row in per_step.itertuples():
        util, sm, occ = ref.gpu_metrics(*steps[row.step])
        assert abs(row.utilization_pct - util) <= POINTS, row.step
        assert abs(row.sm_efficiency_pct - sm) <= POINTS, row.step
        assert abs(row.achieved_occupancy_pct - occ) <= POINTS, row.step
    summary = detail_rows.gpu_summary(imported[run], rank=rank).iloc[0]
    util, sm, occ = ref.gpu_metrics(ref.steps[0][0], ref.steps[-1][1])
    assert abs(summary["utilization_pct"] - util) <= POINTS
    assert abs(summary["sm_efficiency_pct"] - sm) <= POINTS
    assert abs(summary["achieved_occupancy_pct"] - occ) <= POINTS
    assert 0 < summary["utilization_pct"] <= 100


def test_tensor_core_share_of_eligible_ops(imported):
    """The nccl trace's convolution backward runs tensor-core kernels (A100, TF32): its tc_pct is their time's share,
    from the raw events."""
    ref = _reference(TRACES / SINGLE[1])
    tc_ms: dict[str, float] = defaultdict(float)
    for k, op in zip(ref.kernels, ref.kernel_op):
        if op is None or not any(p in k["name"] for p in TC_KERNEL_PATTERNS):
            continue
        while op is not None:  # the kernel counts in its op's total and in every op holding it
            tc_ms[ref.ops[op]["name"]] += k["dur"] / 1e3
            op = ref.parent[op]
    got = detail_rows.operators(imported[SINGLE[1]])
    assert tc_ms, "the trace has tensor-core kernels"
    for row in got.itertuples():
        assert row.tc_eligible == (row.name in TC_ELIGIBLE_OPS)
        if row.device_total_ms > 0:
            assert _close(row.tc_pct, 100 * tc_ms.get(row.name, 0.0) / row.device_total_ms, 1e-6), row.name


def test_resnet_memory_curve_and_operator_memory(imported):
    """The 2021 format has no Total Allocated: the curve is the running sum of Bytes (never below 0), its peak and
    step exact; memory events carry no address, so none are paired, and the notes say so."""
    events, _ = _events(TRACES / SINGLE[0])
    ref = _reference(TRACES / SINGLE[0])
    gpu = sorted((e["ts"], e["args"]["Bytes"]) for e in events if e.get("name") == "[memory]"
                 and e["args"].get("Device Type") == 1)
    running, peak, peak_ts = 0, 0, None
    for ts, b in gpu:
        running = max(running + b, 0)
        if running > peak:
            peak, peak_ts = running, ts
    peak_step = next(n for lo, hi, n in ref.steps if lo <= peak_ts <= hi)
    run = imported[SINGLE[0]]
    peaks = detail_rows.memory_peaks(run).set_index("device")
    assert peaks.loc["cuda:0", "peak_allocated_bytes"] == peak
    assert peaks.loc["cuda:0", "peak_step"] == peak_step
    assert bool(peaks.loc["cuda:0", "cumulative"])
    timeline = detail_rows.memory_timeline(run, device="cuda:0")
    assert 0 < len(timeline) <= 2_000 and timeline["allocated_bytes"].max() == peak
    assert detail_rows.memory_events(run).empty
    assert any("no address" in n and n.endswith("the curve and the per-operator statistics are read as usual")
               for n in detail_rows.detail_notes(run))
    # per operator: every GPU allocation inside an op counts for the innermost op holding it
    allocated: dict[str, int] = defaultdict(int)
    for e in events:
        if e.get("name") == "[memory]" and e["args"].get("Device Type") == 1 and e["args"]["Bytes"] > 0:
            op = ref._innermost(_tid(e["tid"]), e["ts"]) if e["args"]["Bytes"] > 100_000_000 else None
            if op is not None:
                allocated[ref.ops[op]["name"]] += e["args"]["Bytes"]
    got = detail_rows.operator_memory(run, device="cuda:0").set_index("name")
    assert got["allocated_bytes"].sum() > 0
    for name, nbytes in allocated.items():  # the large allocations alone: a floor for each op's bytes
        assert got.loc[name, "allocated_bytes"] >= nbytes


def _cpu_trace(path: Path) -> int:
    """A small model trained 4 steps on CPU under torch.profiler with shapes, memory, stacks and modules; the tid
    torch.profiler writes for this thread (its OS thread id)."""
    import torch
    from torch import nn
    from torch.profiler import ProfilerActivity, profile, schedule

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True, profile_memory=True, with_stack=True,
                 with_modules=True, schedule=schedule(wait=0, warmup=1, active=3, repeat=1),
                 on_trace_ready=lambda p: p.export_chrome_trace(str(path))) as prof:
        for _ in range(4):
            model(torch.randn(32, 64)).sum().backward()
            opt.step()
            opt.zero_grad()
            prof.step()
    return threading.get_native_id()


def _raw_pairs(memory: list[dict]) -> list[tuple[int, float | None]]:
    """(bytes, lifetime in µs or None) of each allocation in raw [memory] events, paired by walking each device's
    events in time order with the addresses open: an allocation at an open address leaves the earlier unfreed."""
    out: list[tuple[int, float | None]] = []
    by_device: dict[tuple, list[dict]] = defaultdict(list)
    for e in memory:
        by_device[(e["args"].get("Device Type"), e["args"].get("Device Id"))].append(e)
    for found in by_device.values():
        open_at: dict[int, dict] = {}
        for e in sorted(found, key=lambda e: e["ts"]):
            size, addr = e["args"]["Bytes"], e["args"]["Addr"]
            if size > 0:
                if addr in open_at:
                    out.append((open_at[addr]["args"]["Bytes"], None))
                open_at[addr] = e
            elif size < 0 and addr in open_at:
                opened = open_at.pop(addr)
                out.append((opened["args"]["Bytes"], e["ts"] - opened["ts"]))
        out += [(e["args"]["Bytes"], None) for e in open_at.values()]
    return out


def _pairs(events: pd.DataFrame) -> list[tuple[int, float | None]]:
    """(bytes, lifetime in µs or None) of each stored memory event."""
    return [(int(b), None if pd.isna(life) else life * 1e3) for b, life in zip(events["bytes"], events["lifetime_ms"])]


def _by_size(pair: tuple[int, float | None]) -> tuple[int, float]:
    return pair[0], -1.0 if pair[1] is None else pair[1]


@pytest.fixture(scope="module")
def cpu_trace(tmp_path_factory):
    path = tmp_path_factory.mktemp("cpu") / "cpu.pt.trace.json"
    _cpu_trace(path)
    return path


def test_cpu_trace_operators_memory_and_modules(cpu_trace, tmp_path):
    ref = _reference(cpu_trace)
    run = dpprof.load_run(import_traces([cpu_trace], tmp_path).paths[0])
    ops = detail_rows.operators(run)
    want = ref.operators()
    assert set(ops["name"]) == set(want) and set(ops["device"]) == {"cpu:0"}
    for row in ops.itertuples():
        assert row.calls == want[row.name]["calls"]
        assert _close(row.host_total_ms, want[row.name]["host_total_ms"], SUM_REL)
        assert _close(row.host_self_ms, want[row.name]["host_self_ms"], SUM_REL)
    assert ops["device_total_ms"].isna().all(), "a CPU-only trace has no device time: unknown, not 0"
    shapes = detail_rows.operators(run, by="shape")
    assert shapes.groupby("name")["calls"].sum().to_dict() == {n: w["calls"] for n, w in want.items()}
    assert shapes["input_shapes"].str.contains(r"\[32,64\]").any()
    # memory: the curve's peak is the largest Total Allocated; events paired by address on the device
    mem = [e for e in ref.memory if e["args"].get("Device Type") == 0]
    peaks = detail_rows.memory_peaks(run).iloc[0]
    assert peaks["peak_allocated_bytes"] == max(e["args"]["Total Allocated"] for e in mem)
    frees = sum(1 for e in mem if e["args"]["Bytes"] < 0)
    allocs = sum(1 for e in mem if e["args"]["Bytes"] > 0)
    events = detail_rows.memory_events(run)
    assert len(events) == allocs
    paired = events["free_t_ms"].notna().sum()
    assert paired <= frees and paired > 0
    # each allocation with its address's next event on the device if that is a free, computed here event by event
    ours, theirs = sorted(_pairs(events), key=_by_size), sorted(_raw_pairs(mem), key=_by_size)
    assert [(b, life is None) for b, life in ours] == [(b, life is None) for b, life in theirs]
    assert [life for _, life in ours if life is not None] == pytest.approx(
        [life for _, life in theirs if life is not None], abs=1e-3)  # µs: the ms stored, times 1e3
    assert (events.dropna(subset=["lifetime_ms"])["lifetime_ms"] >= 0).all()
    assert events["bytes"].sum() == sum(e["args"]["Bytes"] for e in mem if e["args"]["Bytes"] > 0)
    op_mem = detail_rows.operator_memory(run)
    assert op_mem["allocations"].sum() == sum(1 for e in mem if e["args"]["Bytes"] > 0
                                              and ref._innermost(_tid(e["tid"]), e["ts"]) is not None)
    # modules: each nn.Module event once, nested by time
    modules = detail_rows.modules(run).set_index("path")
    counts: dict[str, int] = defaultdict(int)
    for e in ref.python:
        counts[e["name"].removeprefix("nn.Module: ")] += 1
    assert modules.groupby("module")["occurrences"].sum().to_dict() == dict(counts)
    assert pd.isna(modules.loc["Sequential_0", "parent"])
    assert modules.loc["Sequential_0/Linear_0", "parent"] == "Sequential_0"
    assert modules.loc["Sequential_0/Linear_0", "operators"] > 0


def test_detail_of_trace_puts_each_threads_ops_on_its_device(tmp_path):
    """dpprof's CPU workers: a thread's ops and CPU memory go to the device the caller names for its tid (the OS
    thread id torch.profiler writes); threads it does not name, to the process's device."""
    path = tmp_path / "thread.pt.trace.json"
    tid = _cpu_trace(path)
    ref = Reference(path)
    assert {_tid(e["tid"]) for e in ref.ops} == {tid}, "torch.profiler writes the OS thread id"
    named = detail_of_trace(path, {tid: "cpu:1"})
    assert named.operators.groupby("device")["calls"].sum().to_dict() == {"cpu:1": len(ref.ops)}
    assert list(named.memory_peaks["device"]) == ["cpu:1"]
    assert set(named.modules["device"]) == {"cpu:1"}
    others = detail_of_trace(path, {tid + 1: "cpu:1"})
    assert set(others.operators["device"]) == {"cpu:0"}


def test_write_detail_adds_the_tables_to_a_recorded_run(tmp_path, cpu_trace):
    """The capture's path: a run the CPU backend recorded has no operator data, then has it once written."""
    from recorded import record

    run = record(tmp_path, "plain", steps=3)
    why = detail_rows.detail_missing(run)
    assert why is not None and "capture" in why
    assert detail_rows.operators(run).empty and list(detail_rows.operators(run).columns)[:3] == ["rank", "device", "name"]
    assert main(["--reports-dir", str(tmp_path), "ops", run.id]) == 1
    detail_rows.write_detail(run.path, detail_of_trace(cpu_trace))
    again = dpprof.load_run(run.path)
    assert detail_rows.detail_missing(again) is None
    assert detail_rows.operators(again)["calls"].sum() == len(_reference(cpu_trace).ops)
    assert again.steps.equals(run.steps), "the run's own tables are untouched"


def test_a_run_keeps_each_captures_tables_and_a_capture_of_the_same_steps_replaces_its_own(tmp_path, cpu_trace):
    """Captures are kept apart by first step (read: the latest, or the one asked for); the same first step again
    replaces its own; a file whose tables predate the capture column reads as one set, replaced by the next capture;
    an import's tables (no capture) replace everything."""
    from recorded import record

    run = record(tmp_path, "captures", steps=3)
    cpu_ops, resnet_ops = len(_reference(cpu_trace).ops), len(_reference(TRACES / SINGLE[0]).ops)
    cpu, resnet = detail_of_trace(cpu_trace), detail_of_trace(TRACES / SINGLE[0])
    assert cpu_ops != resnet_ops

    def calls(window=None) -> int:
        stored = dpprof.load_run(run.path)
        stored.capture = window
        return int(stored.operators()["calls"].sum())

    detail_rows.write_detail(run.path, cpu, detail_rows.Capture(0, 2, ("a",)))
    detail_rows.write_detail(run.path, resnet, detail_rows.Capture(5, 7, ("b",)))
    stored = dpprof.load_run(run.path)
    assert detail_rows.captures(stored) == [detail_rows.Capture(0, 2, ("a",)), detail_rows.Capture(5, 7, ("b",))]
    assert (calls(), calls(5), calls(0)) == (resnet_ops, resnet_ops, cpu_ops)
    with pytest.raises(ValueError, match="no capture starting at step 3: its captures start at steps 0, 5"):
        calls(3)
    detail_rows.write_detail(run.path, cpu, detail_rows.Capture(5, 8, ("c",)))  # steps 5 on again
    assert detail_rows.captures(dpprof.load_run(run.path))[-1] == detail_rows.Capture(5, 8, ("c",))
    assert (calls(5), calls(0)) == (cpu_ops, cpu_ops)
    with sqlite3.connect(run.path) as con:  # the layout of a file written before captures were kept apart
        for table in DETAIL_TABLES:
            con.execute(f"ALTER TABLE {table} DROP COLUMN capture")
        con.execute("DROP TABLE captures")
    con.close()
    assert detail_rows.captures(dpprof.load_run(run.path)) == [] and calls() == 2 * cpu_ops  # one set: every row
    detail_rows.write_detail(run.path, resnet, detail_rows.Capture(9, 10))
    assert detail_rows.captures(dpprof.load_run(run.path)) == [detail_rows.Capture(9, 10)]
    assert calls() == resnet_ops, "the rows of unknown steps were replaced"
    detail_rows.write_detail(run.path, cpu)  # an import's tables: the file's whole set
    assert detail_rows.captures(dpprof.load_run(run.path)) == [] and calls() == cpu_ops


def test_an_import_without_the_tables_reads_with_the_reason(tmp_path, capsys):
    """A run imported before dpprof kept operators (its file has none of the tables) reads as no data and why."""
    run = import_traces([TRACES / RANKS[0]], tmp_path)
    with sqlite3.connect(run.paths[0]) as con:
        for table in ("operators", "operator_shapes", "kernels", "kernel_ops", "gpu_metrics", "memory_timeline",
                      "memory_peaks", "memory_events", "operator_memory", "modules", "detail_notes"):
            con.execute(f"DROP TABLE {table}")
    old = dpprof.load_run(run.paths[0])
    assert "import its trace files again" in detail_rows.detail_missing(old)
    for read in (detail_rows.operators, detail_rows.kernels, detail_rows.gpu_metrics, detail_rows.memory_timeline,
                 detail_rows.memory_events, detail_rows.modules):
        assert read(old).empty
    for command in ("ops", "kernels", "memory"):
        capsys.readouterr()
        assert main(["--reports-dir", str(tmp_path), command, run.id]) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "no operator data" in err[0]
    assert not any(p.name.startswith("operators") for p in tmp_path.iterdir())


def test_ops_of_a_trace_without_cpu_ops_says_why_as_the_operators_page_does(cpu_trace, tmp_path, capsys):
    """A trace profiled without ProfilerActivity.CPU (here the CPU trace with its cpu_op events taken out) has
    operator tables with no rows: dpprof ops printed "(none)"; it now says why in the Operators page's words (exit 0,
    as kernels and memory say their empty tables); the same trace with its cpu_op events prints its operators."""
    from dpprof.views.operators import missing_text

    doc = json.loads(cpu_trace.read_text())
    doc["traceEvents"] = [e for e in doc["traceEvents"] if e.get("cat") != "cpu_op"]
    path = tmp_path / "no-ops.pt.trace.json"
    path.write_text(json.dumps(doc))
    run = dpprof.load_run(import_traces([path], tmp_path).id, tmp_path)
    said = missing_text(run)
    assert run.detail_missing is None and said and "no cpu_op events" in said
    capsys.readouterr()
    assert main(["--reports-dir", str(tmp_path), "ops", run.id]) == 0
    assert capsys.readouterr().out == said + "\n"
    whole = dpprof.load_run(import_traces([cpu_trace], tmp_path).id, tmp_path)
    assert missing_text(whole) is None
    assert main(["--reports-dir", str(tmp_path), "ops", whole.id]) == 0
    out = capsys.readouterr().out
    assert "no cpu_op events" not in out and "aten::" in out


def test_memory_of_a_trace_without_memory_events_says_why_as_the_memory_page_does(imported, capsys):
    """The 2-rank job's traces hold no [memory] events: `dpprof memory` said torch.profiler "writes none when it
    profiles every thread, as a DataParallel run's deep capture does; a DDP or FSDP rank's capture has them" of an
    imported trace, which no capture made; it now says the Memory page's reason (profile with profile_memory=True and
    import it again)."""
    from dpprof.views.memory import missing_text

    run = imported["ranks"]
    said = missing_text(run)
    assert said and "profile_memory=True" in said and "capture" not in said
    assert main(["memory", str(run.paths[0])]) == 0
    assert capsys.readouterr().out == said + "\n"


def test_ops_vs_another_run_of_more_ranks_says_its_ranks_are_summed(imported, capsys):
    """`ops ONE --vs JOB`: the one-rank NCCL trace against the 2-rank job, whose operators are both ranks' summed
    (calls twice one rank's), was said "... than job-rank0..." as though against one rank; the job's side now says
    "(2 ranks summed)", and `--rank 1` of the job against the one-rank run says it of neither."""
    one, job = imported[SINGLE[1]], imported["ranks"]
    for b, flags, a, summed in ((one, [], job, " (2 ranks summed)"), (job, ["--rank", "1"], one, "")):
        assert main(["--reports-dir", str(Path(b.paths[0]).parent), "ops", b.id, *flags, "--vs", a.id, "--json"]) == 0
        sentence = json.loads(capsys.readouterr().out)["sentence"]
        label_a = str(a.meta.get("name") or a.id)
        assert f" than {label_a}{summed} in " in sentence, sentence
        assert "ranks summed" not in sentence.split(" is ", 1)[0], sentence
        if summed:  # both of the job's ranks hold 2 steps to the one rank's 3: said once, not rank by rank
            assert f"({label_a}{summed}'s totals scaled from 2 steps)" in sentence, sentence


def test_commands_print_json_in_the_issues_shapes(imported, capsys):
    run = imported["ranks"]
    assert main(["ops", str(run.path), "--json", "--top", "3"]) == 0
    ops = json.loads(capsys.readouterr().out)["operators"]
    assert len(ops) == 3 and set(ops[0]) == {"rank", "device", "name", "calls", "host_total_ms", "host_self_ms",
                                            "device_total_ms", "device_self_ms"}
    assert main(["kernels", str(run.path), "--json", "--rank", "1"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert {k["rank"] for k in doc["kernels"]} == {1} and len(doc["kernels"]) == 20
    assert set(doc["kernels"][0]) == {"rank", "device", "name", "calls", "total_ms", "mean_blocks_per_sm",
                                      "mean_occupancy_pct", "tensor_cores"}
    assert [g["rank"] for g in doc["gpu"]] == [1]
    assert set(doc["gpu"][0]) == {"rank", "device", "utilization_pct", "sm_efficiency_pct", "achieved_occupancy_pct"}
    assert main(["memory", str(imported[SINGLE[0]].path), "--json"]) == 0
    devices = json.loads(capsys.readouterr().out)["devices"]
    assert {d["device"] for d in devices} == {"cuda:0", "host"}
    assert set(devices[0]) == {"rank", "device", "peak_allocated_bytes", "peak_reserved_bytes", "peak_step"}
    assert main(["ops", str(run.path), "--by", "shape", "--device", "rank:0", "--top", "5"]) == 0
    assert "input_shapes" in capsys.readouterr().out
    for command in ("ops", "kernels", "memory"):  # a rank the run does not hold: said, not an empty table
        assert main([command, str(run.path), "--rank", "5"]) == 1
        said = capsys.readouterr()
        assert said.out == "" and f"has no rank 5: it holds ranks {', '.join(map(str, run.model.ranks))}" in said.err


def test_export_writes_the_detail_csvs(imported, tmp_path):
    from dpprof.views.export import export_run

    written = {p.name for p in export_run(imported[SINGLE[1]], tmp_path / "out")}
    assert {"operators.csv", "kernels.csv", "gpu_metrics.csv", "memory_timeline.csv", "memory_events.csv"} <= written
    ops = pd.read_csv(tmp_path / "out" / "operators.csv")
    assert len(ops) == len(detail_rows.operators(imported[SINGLE[1]]))


def test_bad_values_are_left_out_and_counted(cpu_trace, tmp_path):
    """NaN and strings where numbers go, in the events the tables read: the events are left out and counted (the
    import's notes say how many), never a crash."""
    doc = json.loads(cpu_trace.read_text())
    ops = [e for e in doc["traceEvents"] if e.get("cat") == "cpu_op"]
    mem = [e for e in doc["traceEvents"] if e.get("name") == "[memory]"]
    ops[0]["dur"] = "slow"
    ops[1]["ts"] = float("nan")
    mem[0]["args"]["Bytes"] = "many"
    mem[1]["args"]["Total Allocated"] = float("nan")
    bad = tmp_path / "bad.pt.trace.json"
    bad.write_text(json.dumps(doc))  # NaN written as the bare NaN the profiler's JSON can hold
    assert "NaN" in bad.read_text()
    detail = detail_of_trace(bad)
    good = detail_of_trace(cpu_trace)
    assert detail.operators["calls"].sum() == good.operators["calls"].sum() - 2
    said = [n for n in detail.notes if "left out of the operator, kernel and memory tables" in n]  # the op's dur and the event's Bytes
    assert len(said) == 1 and said[0].startswith("2 values") and "dur is missing or not a number" in said[0], said
    # a NaN Total Allocated reads as none (the decoder's rule): that device's curve is the running sum of Bytes
    assert bool(detail.memory_peaks["cumulative"].iloc[0]) and not bool(good.memory_peaks["cumulative"].iloc[0])
    assert detail.memory_events["bytes"].count() < good.memory_events["bytes"].count()
    imported = import_traces([bad], tmp_path / "reports")  # and the import says it, as it says the events it left out
    said = "bad.pt.trace.json: 2 values that cannot be (a time or size no event can have) left out"
    assert any(n.startswith(said) for n in imported.notes), imported.notes


@pytest.mark.parametrize("bad", ["'x'", "1e300 * 1e300", "-1e300 * 1e300", "2.5", "x'00ff'", "NULL", "1e18"])
def test_a_damaged_detail_table_reads_its_bad_values_as_missing(imported, tmp_path, capsys, bad):
    """Every value of every detail table replaced by one that is no figure (text, ±inf, a fraction, a blob, NULL, a
    count past the store's MAX_VALUE): the readers, the three commands and the CSVs still work, reading it as missing;
    names that are no text still print. The run file given is a copy: the user's is never written."""
    import shutil
    import sqlite3

    from dpprof.store.schema import DETAIL_TABLES

    source = imported[SINGLE[0]].path
    path = tmp_path / Path(source).name
    shutil.copy(source, path)
    con = sqlite3.connect(path)
    with con:
        for table, columns in DETAIL_TABLES.items():
            sets = ", ".join(f'"{c}" = {bad}' for c, kind in columns.items() if kind in ("REAL", "INTEGER"))
            if sets:
                con.execute(f"UPDATE {table} SET {sets}")
        con.execute("UPDATE operators SET name = 7 WHERE rowid % 2 = 0")  # a name that is a number
    con.close()
    run = dpprof.load_run(path)
    frames = [run.operators(), run.kernels(), run.gpu_metrics(), run.memory_timeline(), run.memory_events(),
              run.modules()]
    assert len(frames[0]) > 0 and frames[0]["calls"].isna().all()  # rows kept, each bad count missing
    for df in frames:
        numeric = df.select_dtypes("number")
        assert not numeric.isin([float("inf"), float("-inf")]).any().any()
    for command in ("ops", "kernels", "memory"):
        code = main([command, str(path), "--json"])
        out = capsys.readouterr().out
        assert code in (0, 1) and (code == 1 or json.loads(out))  # JSON, or one line saying there is nothing to show
    assert main(["export", str(path), "--out", str(tmp_path / "csv")]) in (0, 1)
    assert (tmp_path / "csv" / "operators.csv").exists()


def test_a_device_with_none_of_a_tables_rows_is_said_so_not_taken_for_the_whole_run(imported, capsys):
    """ResNet-50's trace: its kernels and operators are cuda:0's, its host has [memory] events only. `dpprof kernels
    --device host` said "no kernels in this run (a CPU-only trace or capture)" of a GPU run, and `ops --device host`
    printed "(none)"; each says the device has none and which devices have them."""
    path = str(imported[SINGLE[0]].path)
    for command, what in (("kernels", "kernels"), ("ops", "operators")):
        assert main([command, path, "--device", "host"]) == 0
        out = capsys.readouterr().out
        assert out.strip() == f"no {what} on host in this run: its {what} are cuda:0's", out
    assert main(["memory", path, "--device", "host"]) == 0  # host has memory of its own
    assert "peak_allocated_bytes" in capsys.readouterr().out


def test_tables_shorten_long_names_in_the_terminal_and_json_keeps_them_whole(imported, capsys):
    """The 128-rank job's fbgemm kernels are named with their whole C++ signature (1,700 characters), and pandas pads
    a column to its longest cell: every row of `dpprof kernels` was 2,070 characters wide (`ops --by shape` 2,775,
    `kernels --by operator` 2,247), unreadable in a terminal. Text cells are now cut to CELL_CHARS, keeping the start
    and end, a line under the table says so, and --json keeps each name whole. No terminal is needed (the width is
    fixed), so this holds under nohup as in a terminal. Names that read the same so (three fbgemm kernels that differ
    at their 72nd character) also keep the characters where they differ: no two kernels read alike."""
    from dpprof.cli import CELL_CHARS, _cell, _shortened

    run = imported["ranks"]
    assert main(["kernels", str(run.path), "--json"]) == 0
    names = [k["name"] for k in json.loads(capsys.readouterr().out)["kernels"]]
    longest = max(names, key=len)
    assert len(longest) > 1_500  # whole in JSON
    assert main(["kernels", str(run.path)]) == 0
    out = capsys.readouterr().out
    tail = (CELL_CHARS - 3) // 3
    shown = _shortened(names)
    assert len(set(shown)) == len(set(names))  # a row a kernel and rank: different kernels never read alike
    for name, text in zip(names, shown):
        assert f"  {text}  " in out
        if len(name) > CELL_CHARS:  # its start, "...", (where it reads as another: where they differ, "..."), its end
            start, *middle, end = text.split("...")
            assert name.startswith(start) and len(start) == CELL_CHARS - 3 - tail and end == name[-tail:]
            at = len(start)
            for piece in middle:  # in order, each after a gap
                assert name.find(piece, at + 1) > at
                at = name.find(piece, at + 1) + len(piece)
    assert len({_cell(n) for n in set(names)}) < len(set(names))  # shortened alike, some read the same
    assert out.rstrip().endswith(f"(text over {CELL_CHARS} characters is shortened to its start and end; --json and "
                                 "dpprof export give it whole)")
    assert all(name in out for name in names if len(name) <= CELL_CHARS)  # short names as they are
    for name in (*SINGLE, "ranks"):
        for command in (["kernels"], ["kernels", "--by", "operator"], ["ops"], ["ops", "--by", "shape"], ["memory"]):
            assert main([*command, str(imported[name].path)]) == 0
            widest = max(map(len, capsys.readouterr().out.splitlines()))
            # the widest table, kernels by operator (16 columns, two of them text), is 346 characters (309 before
            # names that read alike kept where they differ)
            assert widest <= 360, (name, command, widest)


def test_a_traces_names_are_shown_in_tables_never_obeyed(cpu_trace, tmp_path, capsys):
    """A trace is a file from elsewhere: an operator named "aten::mm" plus ESC [2J (clear the screen) and an OSC that
    sets the terminal's title reached the terminal as written through `dpprof ops` and `dpprof memory` (its escapes
    obeyed: the table wiped), though `dpprof runs` showed names as their escapes. The table printer now escapes
    control characters in every text cell, as runs did; --json keeps the name as the trace has it."""
    doc = json.loads(cpu_trace.read_text())
    hostile = "\x1b[2J\x1b]0;pwned\x07"
    named = {e["name"] for e in doc["traceEvents"] if e.get("cat") == "cpu_op"}
    victim = "aten::mm" if "aten::mm" in named else sorted(named)[0]
    for e in doc["traceEvents"]:
        if e.get("cat") == "cpu_op" and e.get("name") == victim:
            e["name"] = victim + hostile
    path = tmp_path / "hostile.pt.trace.json"
    path.write_text(json.dumps(doc))
    run = dpprof.load_run(import_traces([path], tmp_path).id, tmp_path)
    capsys.readouterr()
    for command in (["ops"], ["ops", "--by", "shape"]):
        assert main(["--reports-dir", str(tmp_path), *command, run.id, "--top", "500"]) == 0
        out = capsys.readouterr().out
        assert "\x1b" not in out and "\x07" not in out, command
        assert victim + "\\x1b[2J\\x1b]0;pwned\\x07" in out, command
    assert main(["--reports-dir", str(tmp_path), "ops", run.id, "--top", "500", "--json"]) == 0
    assert victim + hostile in {o["name"] for o in json.loads(capsys.readouterr().out)["operators"]}

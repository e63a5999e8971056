"""dpprof.trace.export: every kind of run the code records (DataParallel on CPU workers, balanced, DDP ranks, a
run with NVML samples, imported torch.profiler traces re-exported, a thinned run) written as a trace file, checked
against the format's rules (metadata names every device, no two slices of a track cross, counters where the run has
memory, each phase a dpprof.* slice with its step and call, steps as ProfilerStep#N) and read back through
``dpprof import`` (the same steps; each device's phase totals within 1%)."""
from __future__ import annotations

import gzip
import io
import json
import os
import shutil
import sqlite3
import sys
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest

import dpprof
import dpprof.trace.export as trace_export
import fake_pynvml
import forked
from dpprof.cli import main
from dpprof.findings import run_findings
from dpprof.store.reader import TABLES
from dpprof.store.retention import Retention
from dpprof.trace import TraceError, import_traces
from dpprof.trace.export import MEMORY_COUNTER, export_trace, parse_steps, plan_trace, rank_path
from dpprof.trace.readback import EXPORT_KEY
from dpprof.views import export as export_view
from dpprof.views.compare import default_compare
from dpprof.views.fsdp import fsdp_collective_table
from recorded import BUS, record, record_straggler, record_with_gpu_samples

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT.parent / "shared" / "traces"
STRAGGLER = ROOT / "tests" / "scripts" / "train_straggler.py"
TOTALS_REL = 0.01  # the round trip keeps each device's phase totals within 1%
THIN = Retention(first_steps=20, last_steps=20, every=10, chunk_steps=20, block_steps=10)
IMPORTED = {"resnet trace": ["resnet50-1gpu-tb-sample.pt.trace.json.gz"],
            "ddp trace": ["ddp-2ranks-rank0-nccl.json.gz"],
            "128-rank trace": ["ddp-128ranks-rank0-sampled.json.gz", "ddp-128ranks-rank1-sampled.json.gz"]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, profiled):
    """One run of each kind in one reports directory: name -> run id."""
    directory = tmp_path_factory.mktemp("runs")
    ids = {"dataparallel": record(directory, "dp", workers=2, steps=4, batch_size=16).id,
           "balanced": record(directory, "bal", workers=3, steps=4, batch_size=33, balanced=True).id,
           "thinned": dpprof.load_run(record_straggler(directory, 110, detail=THIN, name="thinned").path).id}
    profiled(directory, "tutorial-linear", "--ddp", "--nproc", "2", "--steps", "4")  # recorded once a session
    listing = dpprof.list_runs(directory)
    ids["ddp"] = listing[listing["ranks"] == 2]["id"].iloc[0]
    profiled(directory, "tutorial-linear", "--fsdp", "--nproc", "2", "--steps", "4")
    listing = dpprof.list_runs(directory)
    ids["fsdp"] = next(i for i in listing[listing["ranks"] == 2]["id"] if i != ids["ddp"])
    for name, files in IMPORTED.items():
        ids[name] = import_traces([TRACES / f for f in files], directory).id
    return SimpleNamespace(dir=directory, ids=ids)


def read_trace(path: Path) -> dict:
    opener = gzip.open if path.name.lower().endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


def _ns(us: float) -> int:
    return round(us * 1000)


def crossed(events: list[dict]) -> list[tuple]:
    """Slices ("ph": "X") of one track, (pid, tid), that overlap without nesting (Perfetto drops them)."""
    tracks: dict[tuple, list[tuple[int, int, str]]] = {}
    for e in events:
        if e.get("ph") == "X":
            start = _ns(e["ts"])
            tracks.setdefault((e["pid"], e["tid"]), []).append((start, start + _ns(e["dur"]), e["name"]))
    bad = []
    for track, slices in tracks.items():
        stack: list[tuple[int, int, str]] = []
        for s in sorted(slices, key=lambda x: (x[0], -x[1])):
            while stack and stack[-1][1] <= s[0]:
                stack.pop()
            if stack and s[1] > stack[-1][1]:
                bad.append((track, stack[-1], s))
            stack.append(s)
    return bad


def _devices_of(doc: dict) -> dict[int, str]:
    """pid -> the device its process is (process_name: "cpu:1 (...)", "rank 0 (...)")."""
    names = {e["pid"]: e["args"]["name"] for e in doc["traceEvents"] if e.get("name") == "process_name"}
    return {pid: name.split(" (")[0].replace("rank ", "rank:") for pid, name in names.items()}


def _phase_totals(run) -> pd.Series:
    return run.phases.groupby(["device", "phase"])["duration_ms"].sum()


def _export(run, tmp_path: Path, name: str = "trace.json.gz", **kw):
    plan, written = export_trace(run, tmp_path / name, **kw)
    return plan, written, [read_trace(w.path) for w in written]


def check_format(run, plan, docs: list[dict]) -> None:
    """The rules every exported file keeps (see the module docstring)."""
    model = run.model
    named: dict[str, int] = {}
    for doc in docs:
        assert doc["schemaVersion"] == 1 and isinstance(doc["baseTimeNanoseconds"], int)
        info = doc["dpprofExport"]
        assert info["run"] == run.id and info["steps"]["ranges"] == plan.ranges
        events = doc["traceEvents"]
        assert crossed(events) == []
        devices = _devices_of(doc)
        sort = {e["pid"]: e["args"]["sort_index"] for e in events if e.get("name") == "process_sort_index"}
        assert set(sort) == set(devices)
        ordered = [devices[p] for p in sorted(devices, key=sort.get)]
        # in the run's device order (GPUs NVML sampled that are not on the device axis after them)
        assert [d for d in ordered if d in model.devices] == [d for d in model.devices if d in ordered]
        named.update({d: p for p, d in devices.items()})
        if run.ranks > 1 and len(docs) > 1:  # a rank's file says its rank, as torch.profiler's do
            assert doc["distributedInfo"]["rank"] == info["ranks"][0]
        # every thread id belongs to a device of the file
        threads = {e["tid"] for e in events if e.get("ph") in ("X", "i")}
        assert {str(t) for t in threads} <= set(doc["dpprofThreads"])
        assert set(doc["dpprofThreads"].values()) <= set(devices.values())
    assert set(model.devices) <= set(named)  # metadata names every device
    events = [e for doc in docs for e in doc["traceEvents"]]
    written = set(int(s) for s in plan.steps)
    # steps: one ProfilerStep#N per step written and rank
    steps = [int(e["name"].split("#")[1]) for e in events if e.get("ph") == "X" and e["name"].startswith("ProfilerStep#")]
    assert sorted(steps) == sorted(s for s in run.steps["step"] if s in written)
    # phases: one dpprof.<phase> slice per phase row, on its device, with its step and call
    rows = run.phases[run.phases["step"].isin(written)]
    expected = sorted(zip(rows["device"], "dpprof." + rows["phase"], rows["step"], rows["call"]))
    devices = {p: d for doc in docs for p, d in _devices_of(doc).items()}
    got = sorted((devices[e["pid"]], e["name"], e["args"]["step"], e["args"]["call"]) for e in events
                 if e.get("ph") == "X" and e["name"].startswith("dpprof.") and e["name"] != "dpprof.allreduce")
    assert got == expected
    # counters where the run has memory: dpprof's accounting on each device that has it; the allocator's
    memory = run.memory[run.memory["step"].isin(written)]
    counted = {devices[e["pid"]] for e in events if e.get("ph") == "C" and e["name"] == MEMORY_COUNTER}
    assert counted == set(memory["device"])
    allocator = run.allocator[run.allocator["step"].isin(written)]
    alloc = {devices[e["pid"]] for e in events if e.get("ph") == "C" and e["name"] == "CUDA allocated (bytes)"}
    assert alloc == set(allocator["device"])


def check_round_trip(run, plan, paths: list[Path], reports: Path) -> None:
    """dpprof import of the files: the same steps, each device's phase totals within 1%, the same device axis."""
    back = dpprof.load_run(import_traces(paths, reports).id, reports)
    written = set(int(s) for s in plan.steps)
    assert sorted(set(back.steps["step"])) == sorted(written)
    original = run.phases[run.phases["step"].isin(written)].groupby(["device", "phase"])["duration_ms"].sum()
    got = _phase_totals(back)
    assert list(got.index) == list(original.index)
    assert ((got - original).abs() <= TOTALS_REL * original.abs() + 1e-6).all(), pd.concat([original, got], axis=1)
    if EXPORT_KEY in json.loads(gzip.open(paths[0]).read() if paths[0].suffix.lower() == ".gz" else paths[0].read_bytes()):
        # dpprof's own file: each step's phases come back in their own step, to the ns the file writes (an end at
        # the next step's start, but for ts + dur's rounding, stays in its step)
        def per_step(r) -> pd.Series:
            p = r.phases[r.phases["step"].isin(written)]
            return p.groupby(["step", "device", "phase"])["duration_ms"].sum()
        mine, read = per_step(run), per_step(back)
        assert list(read.index) == list(mine.index)
        assert ((read - mine).abs() <= 2e-6).all(), pd.concat([mine, read], axis=1)[(read - mine).abs() > 2e-6]
    assert list(back.model.devices) == list(run.model.devices)
    assert back.model.dataparallel == run.model.dataparallel  # DataParallel's phases read back as DataParallel's
    # the run it was, by name and workload (not the file's): Compare pairs the two
    assert (back.meta["name"], back.meta["workload"]) == (run.meta["name"], run.meta["workload"])
    assert back.meta["host"] == run.meta["host"]  # Kineto's host_name (it came back unknown)
    assert run.meta["host"] or run.meta["source"] == "trace"  # a recorded run's machine; a trace's, where it says
    check_allocator_peaks(run, back, written)


def check_allocator_peaks(run, back, steps: set[int]) -> None:
    """The allocator's peaks the pages show (each device's highest allocated and reserved bytes) read back within
    1%: the exported [memory] events carry real Total Allocated and Total Reserved."""
    def peaks(r) -> pd.DataFrame:
        a = r.allocator[r.allocator["step"].isin(steps)]
        return a.groupby("device")[["peak_allocated_bytes", "reserved_bytes"]].max().astype(float)

    original, got = peaks(run), peaks(back)
    assert list(got.index) == list(original.index)
    for column in original.columns:
        want = original[column].dropna()
        assert ((got[column].reindex(want.index) - want).abs() <= TOTALS_REL * want.abs()).all(), (column, want, got)


KINDS = ["dataparallel", "balanced", "ddp", "fsdp", *IMPORTED]


@pytest.mark.parametrize("name", KINDS)
def test_each_kind_exports_a_trace_that_keeps_the_rules_and_imports_back(runs, name, tmp_path):
    run = dpprof.load_run(runs.ids[name], runs.dir)
    plan, written, docs = _export(run, tmp_path)
    assert len(written) == run.ranks  # a distributed run: a file per rank, as torch.profiler writes them
    if run.ranks > 1:
        assert [w.path.name for w in written] == [f"trace.rank{r}.json.gz" for r in range(run.ranks)]
    assert len(plan.steps) == run.model.steps and not plan.cut
    check_format(run, plan, docs)
    check_round_trip(run, plan, [w.path for w in written], tmp_path / "back")
    if name == "resnet trace":  # the check compares something: this trace's [memory] events peak at 2.6 GiB
        assert run.allocator["peak_allocated_bytes"].max() > 2**31


def test_an_fsdp_run_reads_back_as_fsdp_with_its_phases_and_collectives(runs, tmp_path):
    """An FSDP run's per-rank files import as an imported trace of FSDP: its waits and copies, its all-gathers and
    reduce-scatters, its FSDP collectives table, and a note of what the file does not carry."""
    run = dpprof.load_run(runs.ids["fsdp"], runs.dir)
    assert run.model.kind == "fsdp"
    _, written, docs = _export(run, tmp_path, "exported-fsdp.json.gz")
    # its all-gathers and reduce-scatters lie on the lane of every collective, named so (not "all-reduce")
    for doc in docs:
        lanes = {e["tid"]: e["args"]["name"] for e in doc["traceEvents"] if e.get("name") == "thread_name"}
        on = {lanes[e["tid"]] for e in doc["traceEvents"] if e.get("ph") == "X" and e["name"].startswith("gloo:")}
        assert on == {"collectives"}
    reports = tmp_path / "back"
    reports.mkdir()
    for path in run.paths:  # the original beside the run read back
        shutil.copy2(path, reports / path.name)
    back = dpprof.load_run(import_traces([w.path for w in written], reports).id, reports)
    # the run it was, not the file's name ("exported-fsdp"): Compare opens on the two, the older as its baseline
    assert back.meta["workload"] == run.meta["workload"] == "tutorial-linear"
    assert back.meta["name"] == run.meta["name"] and back.id != run.id
    assert default_compare(dpprof.list_runs(reports), back.id) == ([run.id, back.id], None)
    assert {"copy_in", "all_gather_wait", "copy_out", "reduce_scatter_wait"} <= set(back.phases["phase"])
    assert back.model.sharded and back.model.fsdp_phases and "FSDP" in back.model.title
    assert back.model.work == run.model.work  # each rank's work as the recorded run's: forward + backward, inside
    count = ["device", "collective"]
    assert back.comms.groupby(count).size().to_dict() == run.comms.groupby(count).size().to_dict()
    # each collective as it was recorded: its bucket (its index among its step's of its kind), bytes and name
    keys = ["rank", "step", "device", "bucket", "bucket_bytes", "collective"]
    assert sorted(map(tuple, back.comms[keys].values.tolist())) == sorted(map(tuple, run.comms[keys].values.tolist()))
    assert list(fsdp_collective_table(back)["collective"]) == list(fsdp_collective_table(run)["collective"])
    assert any("sharded and gathered bytes" in m for m in back.notes["message"])
    # the findings of FSDP's rules, as the recorded run's (DDP's communication share was raised instead)
    said = ["kind", "severity", "device", "title"]
    found = run_findings(run).table
    assert "reshard_after_forward" in set(found["kind"])  # structural: its all-gathers in backward
    pd.testing.assert_frame_equal(run_findings(back).table[said], found[said])


# one gloo rank sharding with FSDP2, profiled: its trace has FSDP's ranges (a rank alone runs no collectives)
ONE_FSDP_RANK = """
import sys, torch, torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.profiler import profile, ProfilerActivity, schedule
out = sys.argv[1]
dist.init_process_group("gloo", init_method="file://" + out + ".store", rank=0, world_size=1)
net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
fully_shard(net[0])
fully_shard(net)
opt = torch.optim.SGD(net.parameters(), lr=0.1)
with profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=0, warmup=1, active=2, repeat=1),
             on_trace_ready=lambda p: p.export_chrome_trace(out)) as prof:
    for _ in range(3):
        net(torch.randn(4, 8)).sum().backward(); opt.step(); opt.zero_grad(); prof.step()
del net, opt, prof  # FSDP's state holds the process group: freed before it is destroyed, not at the interpreter's end
dist.destroy_process_group()
"""


def test_an_imported_trace_of_fsdp_exported_again_reads_back_as_fsdp(tmp_path):
    """An imported torch.profiler trace of an FSDP job has no FSDP ranges to write when exported: its file says it is
    one (dpprofExport.fsdp), so read back it is an imported trace of FSDP again, not of DDP."""
    import forked

    trace = tmp_path / "onefsdp-rank0.pt.trace.json"
    done = forked.run([sys.executable, "-c", ONE_FSDP_RANK, str(trace)], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    once = dpprof.load_run(import_traces([trace], tmp_path / "once").id, tmp_path / "once")
    assert once.model.sharded and "FSDP" in once.model.title
    _, written, docs = _export(once, tmp_path)
    assert [d[EXPORT_KEY].get("fsdp") for d in docs] == [True]
    back = dpprof.load_run(import_traces([w.path for w in written], tmp_path / "back").id, tmp_path / "back")
    assert back.model.sharded and "FSDP" in back.model.title and "DDP" not in back.model.title
    assert back.steps["duration_ms"].tolist() == pytest.approx(once.steps["duration_ms"].tolist(), abs=1e-3)
    assert any("an imported trace of an FSDP job" in m for m in back.notes["message"])


def test_a_ddp_runs_file_says_nothing_of_fsdp(runs, tmp_path):
    _, _, docs = _export(dpprof.load_run(runs.ids["ddp"], runs.dir), tmp_path)
    assert docs and all("fsdp" not in d[EXPORT_KEY] for d in docs)


@pytest.mark.slow
def test_a_ddp_run_whose_process_group_named_no_backend_reads_back_with_its_all_reduces(tmp_path):
    """A process group made without naming a backend stores what torch says of it ("undefined", or one per device
    type): its all-reduces are written as torch names them on its ranks' device (gloo:all_reduce on CPUs), so they
    read back (they were written as a name no import reads, and the run read back had no collective).
    The GPU is hidden from the ranks: where torch sees one, a group made without a backend is NCCL's alone (torch
    2.11 on an H100: "No backend type associated with device type cpu"), and this CPU script cannot run at all."""
    reports = tmp_path / "reports"
    for out in forked.run_ranks(2, ["-m", "dpprof", "--reports-dir", str(reports), "run", str(STRAGGLER), "--steps", "4",
                                    "--load-ms", "5", "--no-backend"],
                                env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
                                     "CUDA_VISIBLE_DEVICES": ""}):
        assert out.returncode == 0, out.stderr[-3000:]
    [run_id] = dpprof.list_runs(reports)["id"]
    run = dpprof.load_run(run_id, reports)
    assert run.model.kind == "ddp" and run.meta["workload_args"]["backend"] not in ("gloo", "nccl")
    _, written, docs = _export(run, tmp_path)
    assert {e["name"] for doc in docs for e in doc["traceEvents"] if e.get("ph") == "X" and ":" in e["name"]} == \
        {"gloo:all_reduce"}
    back = dpprof.load_run(import_traces([w.path for w in written], tmp_path / "back").id, tmp_path / "back")
    keys = ["rank", "step", "bucket", "bucket_bytes", "collective"]
    assert len(run.comms) >= 8
    assert sorted(map(tuple, back.comms[keys].values.tolist())) == sorted(map(tuple, run.comms[keys].values.tolist()))


def test_a_gpu_ranks_file_keeps_its_gpu(runs, tmp_path):
    """An imported NCCL rank's trace (its GPU an A100, no [memory] events) exported as its rank's file: the file has
    the GPU's deviceProperties, and read back the rank is a GPU with its name, memory and SMs."""
    run = dpprof.load_run(runs.ids["ddp trace"], runs.dir)
    _, written, docs = _export(run, tmp_path)
    assert [p["name"] for p in docs[0]["deviceProperties"]] == ["NVIDIA A100-PG509-200"]
    back = dpprof.load_run(import_traces([w.path for w in written], tmp_path / "back").id, tmp_path / "back")
    columns = ["device", "kind", "name", "total_memory_bytes", "multiprocessor_count", "capability"]
    assert back.devices[columns].to_dict("records") == run.devices[columns].to_dict("records")
    assert back.meta["backend"] == "cuda" and "CPU only" not in back.model.title


def test_a_run_file_with_damaged_steps_exports_saying_what_it_left_out(runs, tmp_path, capsys):
    """Two steps' rows damaged in a copy of a recorded run (the store leaves them out as it reads): the header counts
    every step recorded, the file and one stderr line say what was left out, as many rows as dpprof show lists."""
    from damaged import damaged_copy

    run = dpprof.load_run(runs.ids["dataparallel"], runs.dir)
    copy = damaged_copy(run.path, tmp_path / "damaged.sqlite", "UPDATE steps SET duration_ms = 'abc' WHERE step = 1")
    con = sqlite3.connect(copy)
    con.execute("UPDATE steps SET start_ms = -1e300 WHERE step = 2")
    con.commit()
    con.close()
    damaged = dpprof.load_run(copy)
    assert damaged.damage == ["steps: 2 rows left out (start_ms not a number from -1e+15 to 1e+15, duration_ms not "
                              "a number from 0 to 1e+15)"]
    assert main(["export", str(copy), "--trace", str(tmp_path / "d.json")]) == 0
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "2 damaged rows of the run file" in err
    doc = read_trace(tmp_path / "d.json")
    steps = doc["dpprofExport"]["steps"]
    assert (steps["recorded"], steps["damaged"], steps["written"]) == (run.model.steps, 2, run.model.steps - 2)
    assert steps["ranges"] == [[0, 1], [3, run.model.steps]]
    assert doc["dpprofLeftOut"].startswith("2 damaged rows of the run file")


@pytest.mark.parametrize("name", ["ddp", "fsdp"])
def test_the_csvs_of_a_ranks_run_are_in_the_docs_with_their_rank_and_say_what_each_collective_is(runs, name,
                                                                                               tmp_path, capsys):
    """Every CSV dpprof export --out writes is in docs/cli.md; those per rank have a rank column (fsdp_collectives
    too); a recorded DDP run's comms say all-reduce, the word its trace imported again says."""
    run = dpprof.load_run(runs.ids[name], runs.dir)
    assert main(["--reports-dir", str(runs.dir), "export", run.id, "--out", str(tmp_path / "csv")]) == 0
    capsys.readouterr()
    written = {p.name: pd.read_csv(p) for p in (tmp_path / "csv").glob("*.csv")}
    docs = (ROOT / "docs" / "cli.md").read_text()
    made = [n for n in written if n[:-len(".csv")] not in TABLES]  # the stored tables: "one file per table"
    assert "fsdp_collectives.csv" in made or name != "fsdp"
    assert [n for n in made if f"`{n}`" not in docs] == []
    per_device = {"device_summary.csv", "findings.csv", "phase_totals.csv"}  # the docs name them
    assert [n for n, df in written.items() if "rank" not in df.columns and n not in per_device] == []
    comms = written["comms.csv"]
    if name == "fsdp":
        assert set(written["fsdp_collectives.csv"]["rank"]) == {0, 1}
        assert set(comms["collective"]) == {"all-gather", "reduce-scatter"}
    else:
        _, exported, _ = _export(run, tmp_path)
        back = dpprof.load_run(import_traces([w.path for w in exported], tmp_path / "back").id, tmp_path / "back")
        assert set(comms["collective"]) == set(back.comms["collective"]) == {"all-reduce"}


@pytest.mark.parametrize("name", ["dataparallel", "ddp"])
def test_a_steps_batch_size_reads_back_and_what_does_not_is_as_the_docs_say(runs, name, tmp_path):
    """Read back, each step keeps its batch size (its ProfilerStep's args); as docs/traces.md says, its steps are
    ProfilerStep ranges (explicit), its times count from the run's first step, and forward calls read as 0."""
    run = dpprof.load_run(runs.ids[name], runs.dir)
    _, written, _ = _export(run, tmp_path)
    back = dpprof.load_run(import_traces([w.path for w in written], tmp_path / "back").id, tmp_path / "back")
    keys = ["rank", "step"]
    mine, read = run.steps.sort_values(keys).reset_index(drop=True), back.steps.sort_values(keys).reset_index(drop=True)
    assert read["batch_size"].tolist() == mine["batch_size"].tolist() and mine["batch_size"].notna().all()
    assert read["explicit"].all() and mine["explicit"].all() == (name == "dataparallel")  # DDP's steps: implicit
    shift = (read["start_ms"] - mine["start_ms"]).groupby(read["rank"])  # one shift per rank: its clock's
    assert ((shift.max() - shift.min()) < 1e-5).all() and read["start_ms"].min() == 0 < mine["start_ms"].min()
    assert (read["forward_calls"] == 0).all()
    said = " ".join((ROOT / "docs" / "traces.md").read_text().split())
    assert all(words in said for words in ("`steps.explicit`", "`start_ms`", "`batch_size` comes back"))


def test_a_phase_ending_at_the_next_steps_start_reads_back_in_its_own_step(runs, tmp_path):
    """A DDP rank's optimizer that ends where the next step begins, with a ts and dur whose float sum is past that
    start by a rounding (as 573885.116 + 64.236 = 573949.3520000001 is): it reads back in its own step."""
    run = dpprof.load_run(runs.ids["ddp"], runs.dir)
    _, written, docs = _export(run, tmp_path)
    doc = docs[0]
    events = doc["traceEvents"]
    steps = sorted((e for e in events if str(e.get("name", "")).startswith("ProfilerStep#")), key=lambda e: e["ts"])

    def rounding_past(start: float, dur: float) -> bool:
        return round(start - dur, 3) + dur > start and round(round(start - dur, 3) + dur, 3) == start

    # the optimizer moved to end at the next step's start, with a duration within 1 ms of its own whose sum with its
    # start rounds past that start; a next step's start may have none near it (a search for one past 1 ms moved the
    # optimizer before its step began): the next step then starts up to 0.2 ms later, where one has
    step, after = steps[1], steps[2]
    optimizer = next(e for e in events if e.get("name") == "dpprof.optimizer" and step["ts"] <= e["ts"] < after["ts"])
    end = round(after["ts"] + after["dur"], 3)
    start, dur = next((t, d) for t in (round(after["ts"] + j / 1000, 3) for j in range(200))
                      for d in (round(optimizer["dur"] + k / 1000, 3) for k in range(1000))
                      if rounding_past(t, d) and t - d >= step["ts"])
    after["ts"], after["dur"] = start, round(end - start, 3)
    number = int(step["name"].split("#")[1])
    optimizer["ts"], optimizer["dur"] = round(start - dur, 3), dur
    step["dur"] = round(start - step["ts"], 3)
    edited = tmp_path / "edited.rank0.json"
    edited.write_text(json.dumps(doc))
    back = dpprof.load_run(import_traces([edited], tmp_path / "back").id, tmp_path / "back")
    mine = back.phases[(back.phases["phase"] == "optimizer")]
    assert mine.groupby("step").size().to_dict() == {s: 1 for s in sorted(set(back.steps["step"]))}
    assert mine.set_index("step").at[number, "duration_ms"] == pytest.approx(dur / 1e3, abs=1e-9)
    assert not any("ended after the next began" in m for m in back.notes["message"])


def test_the_checker_finds_slices_that_cross(runs, tmp_path):
    """The rule is not empty: a DDP rank's data phase is inside its step (the step starts where the previous one
    ended), so the export crosses nothing; moved to start a millisecond before its step, as recordings before the
    step model put it, it crosses the step before on one track, and the checker says so."""
    run = dpprof.load_run(runs.ids["ddp"], runs.dir)
    _, _, docs = _export(run, tmp_path)
    events = [dict(e, tid=0) for e in docs[0]["traceEvents"] if e.get("ph") == "X"]  # the steps' track too

    def data_crosses(found: list[tuple]) -> bool:
        return any(s[2] == "dpprof.data" or s[1][2] == "dpprof.data" for s in found)

    assert not data_crosses(crossed(events))
    data = next(e for e in events if e["name"] == "dpprof.data")
    early = dict(data, ts=data["ts"] - 1_000, dur=data["dur"] + 1_000)  # 1 ms into the step before
    assert data_crosses(crossed([*[e for e in events if e is not data], early]))


def test_a_ddp_run_in_one_file_holds_every_rank_on_one_clock_and_refuses_to_import_as_one_process(runs, tmp_path):
    run = dpprof.load_run(runs.ids["ddp"], runs.dir)
    plan, written, docs = _export(run, tmp_path, one_file=True)
    assert len(written) == 1 and docs[0]["distributedInfo"]["ranks"] == [0, 1]
    check_format(run, plan, docs)
    # ranks step together: each rank's all-reduce of a step ends at about the same time on the file's clock
    ends = {}
    for e in docs[0]["traceEvents"]:
        if e.get("ph") == "X" and e["name"] == "dpprof.comm_wait":
            ends.setdefault(e["args"]["step"], []).append(e["ts"] + e["dur"])
    assert all(max(v) - min(v) < 50_000 for v in ends.values()), ends  # within 50 ms (the machine is shared)
    with pytest.raises(TraceError, match="2 ranks of a distributed run in one file"):
        import_traces([written[0].path], tmp_path / "back")


def test_nvml_samples_are_counters_on_their_gpus(fake_gpus, tmp_path):
    fake_gpus([fake_pynvml.gpu(bus) for bus in BUS])
    run = record_with_gpu_samples(tmp_path / "reports", steps=4)
    assert len(run.gpu_samples)
    plan, _, docs = _export(run, tmp_path)
    check_format(run, plan, docs)
    devices = _devices_of(docs[0])
    counters = {(devices[e["pid"]], e["name"]) for e in docs[0]["traceEvents"] if e.get("ph") == "C"}
    assert {("cuda:0", "GPU utilization (%)"), ("cuda:1", "GPU utilization (%)"),
            ("cuda:0", "GPU memory used (bytes)")} <= counters
    assert all(e["name"] != "GPU utilization (%)" or set(e["args"]) == {"gpu_util_pct"}
               for e in docs[0]["traceEvents"] if e.get("ph") == "C")


def test_a_thinned_run_exports_the_steps_it_holds_in_full_and_says_which(runs, tmp_path, capsys):
    run = dpprof.load_run(runs.ids["thinned"], runs.dir)
    model = run.model
    assert model.thinned and model.detail_from > 0
    held = sorted(set(run.phases["step"]) | set(run.memory["step"]))
    assert len(held) < model.steps
    assert main(["--reports-dir", str(runs.dir), "export", run.id, "--trace", str(tmp_path / "thin.json")]) == 0
    out, err = capsys.readouterr()
    assert out.strip() == str(tmp_path / "thin.json")
    assert len(err.strip().splitlines()) == 1 and f"holds {len(held)} of its {model.steps:,} steps in full" in err
    doc = read_trace(tmp_path / "thin.json")
    steps = doc["dpprofExport"]["steps"]
    assert [s for a, b in steps["ranges"] for s in range(a, b)] == held
    assert steps["recorded"] == model.steps and steps["held_in_full"] == len(held) and not steps["cut_to_fit"]
    assert "one step in 10" in doc["dpprofExport"]["detail"]
    plan = plan_trace(run)
    check_format(run, plan, [doc])
    check_round_trip(run, plan, [tmp_path / "thin.json"], tmp_path / "back")


def test_steps_picks_a_range(runs, tmp_path, capsys):
    run = dpprof.load_run(runs.ids["thinned"], runs.dir)
    assert main(["--reports-dir", str(runs.dir), "export", run.id, "--trace", str(tmp_path / "r.json.gz"),
                 "--steps", "5:12"]) == 0
    doc = read_trace(tmp_path / "r.json.gz")
    assert doc["dpprofExport"]["steps"]["ranges"] == [[5, 12]] and doc["dpprofExport"]["steps"]["asked"] == "5:12"
    steps = {e["name"] for e in doc["traceEvents"] if e["name"].startswith("ProfilerStep#")}
    assert steps == {f"ProfilerStep#{s}" for s in range(5, 12)}
    plan = plan_trace(run, (5, 12))
    check_format(run, plan, [doc])
    check_round_trip(run, plan, [tmp_path / "r.json.gz"], tmp_path / "back")
    # steps thinned away are not there: of 40:60, 40 and 50 are held in full (one in 10), and the ranges say so
    assert main(["--reports-dir", str(runs.dir), "export", run.id, "--trace", str(tmp_path / "s.json"),
                 "--steps", "40:60"]) == 0
    held = sorted(s for s in set(run.phases["step"]) if 40 <= s < 60)
    assert {40, 50} <= set(held) and len(held) < 20
    ranges = read_trace(tmp_path / "s.json")["dpprofExport"]["steps"]["ranges"]
    assert [s for a, b in ranges for s in range(a, b)] == held and len(ranges) > 1


@pytest.mark.parametrize("text, steps", [("5:12", (5, 12)), ("5:", (5, None)), (":12", (None, 12)), ("7", (7, 8)),
                                         (" 5 : 12 ", (5, 12))])
def test_parse_steps(text, steps):
    assert parse_steps(text) == steps


@pytest.mark.parametrize("text", ["2_0:3_0", "+3:5", "1e3", "\u0663:5", "", "1:2:3"])
def test_parse_steps_takes_step_numbers_only(text):
    """Python's int() reads 2_0 as 20, +3 as 3 and Arabic-Indic digits: a step number is plain digits."""
    with pytest.raises(ValueError, match="expected A:B"):
        parse_steps(text)


@pytest.mark.parametrize("argv, says", [
    (["--steps", "9:3"], "B must be after A"), (["--steps", "a:b"], "expected A:B"),
    (["--trace", "{tmp}/t.txt"], "must end in .json or .json.gz"), (["--one-file"], "give --trace"),
    (["--steps", "2_0:3_0"], "expected A:B"),
    (["--steps", "100000:"], "picks no step run"),
    # not Python's from-the-end: -3: wrote every step and -3:2 steps 0 and 1, without a word
    (["--steps", "-3:2"], "--steps '-3:2': steps count from 0, so A and B cannot be negative"),
    (["--steps", "-3:"], "--steps '-3:': steps count from 0"), (["--steps", ":-1"], "cannot be negative")])
def test_bad_trace_arguments_are_usage_errors(runs, argv, says, tmp_path, capsys):
    argv = [a.format(tmp=tmp_path) for a in argv]
    if "--trace" not in argv:
        argv += ["--trace", str(tmp_path / "t.json")] if argv[0] == "--steps" else []
    with pytest.raises(SystemExit) as exit_:
        main(["--reports-dir", str(runs.dir), "export", runs.ids["dataparallel"], *argv])
    assert exit_.value.code == 2 and says in capsys.readouterr().err
    assert not list(tmp_path.glob("t.*"))


def test_a_run_over_the_viewers_limit_exports_the_newest_steps_that_fit_and_says_which(runs, tmp_path, capsys,
                                                                                      monkeypatch):
    run = dpprof.load_run(runs.ids["thinned"], runs.dir)
    whole = plan_trace(run)
    monkeypatch.setattr(trace_export, "MAX_EVENTS", whole.events // 3)  # a viewer a third the size
    assert main(["--reports-dir", str(runs.dir), "export", run.id, "--trace", str(tmp_path / "cut.json.gz")]) == 0
    out, err = capsys.readouterr()
    doc = read_trace(tmp_path / "cut.json.gz")
    steps = doc["dpprofExport"]["steps"]
    kept = [s for a, b in steps["ranges"] for s in range(a, b)]
    assert steps["cut_to_fit"] and kept == [int(s) for s in whole.steps[-len(kept):]] and len(kept) < len(whole.steps)
    assert len(doc["traceEvents"]) <= whole.events // 3
    assert len(err.strip().splitlines()) == 1 and "newest" in err and f"{kept[0]}:{kept[-1] + 1}" in err
    assert "--steps A:B picks others" in err
    # --steps is obeyed as asked, over the limit or not, and said in one line
    assert main(["--reports-dir", str(runs.dir), "export", run.id, "--trace", str(tmp_path / "all.json"),
                 "--steps", "0:"]) == 0
    err = capsys.readouterr().err
    assert read_trace(tmp_path / "all.json")["dpprofExport"]["steps"]["written"] == len(whole.steps)
    assert len(err.strip().splitlines()) == 1


def test_rank_path_names_each_ranks_file_as_dpprof_import_reads_it(tmp_path):
    assert rank_path(tmp_path / "t.json.gz", 3).name == "t.rank3.json.gz"
    assert rank_path(tmp_path / "t.json", 0).name == "t.rank0.json"
    assert rank_path(tmp_path / "T.JSON.GZ", 1).name == "T.rank1.JSON.GZ"  # the suffix as written, any case


def test_a_trace_name_in_capitals_is_exported_gzipd_per_rank_and_imported_back(runs, tmp_path):
    """T.JSON.GZ was refused ("must end in .json or .json.gz"); import's listing of a folder skipped T.JSON."""
    run = dpprof.load_run(runs.ids["ddp"], runs.dir)
    assert main(["--reports-dir", str(runs.dir), "export", run.id, "--trace", str(tmp_path / "T.JSON.GZ")]) == 0
    files = sorted(tmp_path.glob("T.rank*.JSON.GZ"))
    assert [f.name for f in files] == ["T.rank0.JSON.GZ", "T.rank1.JSON.GZ"]
    assert all(f.read_bytes()[:2] == b"\x1f\x8b" for f in files)  # gzip's magic
    check_round_trip(run, plan_trace(run), files, tmp_path / "back")
    plain = tmp_path / "plain"
    plain.mkdir()
    assert main(["--reports-dir", str(runs.dir), "export", runs.ids["dataparallel"], "--trace",
                 str(plain / "T.JSON")]) == 0
    assert json.loads((plain / "T.JSON").read_text())["traceEvents"]
    assert main(["--reports-dir", str(tmp_path / "r2"), "import", str(plain)]) == 0
    assert len(dpprof.list_runs(tmp_path / "r2")) == 1


def test_export_writes_csv_only_with_out_and_the_trace_with_it(runs, tmp_path, capsys):
    assert main(["--reports-dir", str(runs.dir), "export", runs.ids["dataparallel"], "--trace",
                 str(tmp_path / "t.json.gz"), "--out", str(tmp_path / "csv")]) == 0
    out = capsys.readouterr().out.split()
    assert str(tmp_path / "t.json.gz") in out and any(p.endswith("steps.csv") for p in out)


def test_the_export_pages_downloads_are_the_same_trace(runs, tmp_path):
    """The dashboard's Export page: the trace as .json.gz (a distributed run's ranks side by side) and, for a
    distributed run, a zip of one file per rank that dpprof import reads back as ranks."""
    run = dpprof.load_run(runs.ids["ddp"], runs.dir)
    doc = json.loads(gzip.decompress(export_view.run_trace(run)))
    check_format(run, plan_trace(run), [doc])
    text = export_view.trace_text(run)
    assert "4 steps: 0:4" in text and "ui.perfetto.dev" in text and "per-rank files" in text
    with zipfile.ZipFile(io.BytesIO(export_view.rank_traces_zip(run))) as z:
        names = sorted(z.namelist())
        assert names == [f"{run.id}/{run.id}.pt.trace.rank{r}.json.gz" for r in (0, 1)]
        z.extractall(tmp_path)
    files = [tmp_path / n for n in names]
    check_format(run, plan_trace(run), [read_trace(f) for f in files])
    check_round_trip(run, plan_trace(run), files, tmp_path / "back")


@pytest.mark.parametrize("base_ns", [0, 1_764_230_400_123_456_789, 1_800_000_000_000_000_001])
def test_an_imported_traces_first_step_starts_at_zero_whatever_its_base_time_and_exports_back(tmp_path, base_ns):
    """ts are microseconds after baseTimeNanoseconds (~1.8e15 us since the epoch, where a float keeps a quarter of a
    microsecond): the run's origin is the first step's own ts, so no step starts before it and its export, which
    writes no negative ts, imports back."""
    from cpu_traces import single_process_trace

    path = single_process_trace(tmp_path / "made", steps=3)
    doc = json.loads(path.read_text())
    doc["baseTimeNanoseconds"] = base_ns
    path.write_text(json.dumps(doc))
    run = dpprof.load_run(import_traces([path], tmp_path / "reports").id, tmp_path / "reports")
    assert run.steps["start_ms"].min() == 0.0 and (run.phases["start_ms"] >= 0).all()
    plan, written, docs = _export(run, tmp_path)
    assert min(e["ts"] for d in docs for e in d["traceEvents"] if "ts" in e) >= 0
    check_round_trip(run, plan, [w.path for w in written], tmp_path / "back")


@pytest.mark.parametrize("name", ["dataparallel", "balanced", "ddp", "fsdp"])
def test_a_runs_machine_inventory_reads_back_whole(runs, name, tmp_path):
    """Each device's inventory row (a CPU worker's name, model, cores and threads; a rank's; a GPU's PCI bus and NVML
    index beside what Kineto's deviceProperties hold) goes in the file's dpprofExport.inventory and comes back as
    it was recorded: devices.csv of the run read back is the recorded run's."""
    run = dpprof.load_run(runs.ids[name], runs.dir)
    _, written, _ = _export(run, tmp_path)
    back = dpprof.load_run(import_traces([w.path for w in written], tmp_path / "back").id, tmp_path / "back")
    keys = ["rank", "device"]
    mine = run.devices.sort_values(keys).reset_index(drop=True)
    assert mine["cpu_model"].notna().all() and mine["cores"].notna().all()  # there is something to carry
    assert back.devices.sort_values(keys).reset_index(drop=True).equals(mine), (mine, back.devices)


def test_an_edited_inventory_keeps_what_is_well_formed_and_leaves_the_rest_unknown(runs, tmp_path):
    """A file's dpprofExport.inventory edited by hand: a figure of the wrong type or out of range, a kind that is no
    host's, a row that is not one, a device the file does not have: each such thing is unknown (never stored, never
    an error), and the well-formed figures come back."""
    run = dpprof.load_run(runs.ids["dataparallel"], runs.dir)
    _, written, [doc] = _export(run, tmp_path, name="trace.json")
    first, second = doc["dpprofExport"]["inventory"][:2]
    first.update(cores="two", threads=-1, cpu_model=7, kind="gpu", name="edited worker")
    second.update(cores=2.5, threads=2 ** 40, kind=None)
    doc["dpprofExport"]["inventory"] += ["a row", {"device": 3}, {"device": "cpu:9", "cores": 4}]
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(doc))
    back = dpprof.load_run(import_traces([edited], tmp_path / "back").id, tmp_path / "back").devices.set_index("device")
    assert sorted(back.index) == sorted(run.devices["device"])  # no device the file does not hold
    a, b = back.loc[first["device"]], back.loc[second["device"]]
    assert (a["name"], a["kind"]) == ("edited worker", "cpu") and a[["cpu_model", "cores", "threads"]].isna().all()
    assert b["kind"] == "cpu" and b[["cores", "threads"]].isna().all() and b["cpu_model"] == second["cpu_model"]


def test_a_ddp_run_read_back_words_its_collectives_as_the_recorded_run_does(runs, tmp_path, capsys, monkeypatch):
    """A DDP run's collectives are its gradient buckets' all-reduces: read back from the file dpprof exported, show,
    the Overview and the communication finding say "gradient all-reduce" as for the recorded run, where an imported
    trace of another job says "collectives (from the trace)" and names each. The finding's thresholds are set to
    nothing: its words are under test, and whether the all-reduce of the recorded run clears 20% of its step depends
    on the machine's load (CI once read it under)."""
    import dpprof.findings.ddp as ddp
    from dpprof.cli import main
    from dpprof.findings import run_findings

    monkeypatch.setattr(ddp, "COMM_SHARE_WARN", 0.0)
    monkeypatch.setattr(ddp, "worth_time", lambda *args: True)

    run = dpprof.load_run(runs.ids["ddp"], runs.dir)
    _, written, _ = _export(run, tmp_path)
    back = dpprof.load_run(import_traces([w.path for w in written], tmp_path / "back").id, tmp_path / "back")
    assert back.model.imported and not back.model.named_collectives and not run.model.named_collectives
    other = dpprof.load_run(runs.ids[next(iter(IMPORTED))], runs.dir)
    assert other.model.named_collectives
    said = {}
    for name, r, where in (("recorded", run, runs.dir), ("read back", back, tmp_path / "back")):
        capsys.readouterr()
        assert main(["--reports-dir", str(where), "show", r.id]) == 0
        said[name] = capsys.readouterr().out
    assert all("gradient all-reduce per step past the first:" in out and "(from the trace)" not in out
               for out in said.values()), said
    comm = [f for f in run_findings(back).table.to_dict("records") if f["kind"] == "communication_share"]
    assert comm and all(f["title"].startswith("gradient all-reduce is busy") for f in comm), comm


def test_a_run_read_back_says_its_trace_holds_no_operators_rather_than_how_to_profile(tmp_path, capsys):
    """The file dpprof exports holds a run's steps, phases and collectives, not torch.profiler's operators, kernels or
    memory events: the run read back says so (dpprof ops, kernels and memory: one line, exit 1; the pages alike), where
    it printed "(none)" and its pages asked for a trace profiled with ProfilerActivity.CPU and profile_memory=True."""
    from cpu_traces import single_process_trace
    from dpprof.views import kernels, memory, operators

    path = single_process_trace(tmp_path / "made", steps=3)
    reports, back_dir = tmp_path / "reports", tmp_path / "back"
    run = dpprof.load_run(import_traces([path], reports).id, reports)
    assert run.detail_missing is None and len(run.operators())
    _, written, _ = _export(run, tmp_path)
    back = dpprof.load_run(import_traces([w.path for w in written], back_dir).id, back_dir)
    why = back.detail_missing
    assert why is not None and "read back from a trace dpprof exported" in why
    for command in ("ops", "kernels", "memory"):
        capsys.readouterr()
        assert main(["--reports-dir", str(back_dir), command, back.id]) == 1
        out, err = capsys.readouterr()
        assert not out and err == f"dpprof: run {back.id}: {why}\n"
    for page in (operators, kernels, memory):
        assert page.missing_text(back) == why[0].upper() + why[1:] + "."
    assert "operators, kernels and memory events" in " ".join((ROOT / "docs" / "traces.md").read_text().split())

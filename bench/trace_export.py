"""dpprof runs as trace files (``dpprof export RUN --trace``): what Holistic Trace Analysis reads of them, and what a
long run's file costs.

    python bench/trace_export.py [--steps 4000,50000] [--details all,bounded] [--devices 8]
                                 [--hta-python .hta-venv/bin/python] [--parts hta,long] [--keep DIR]

1. ``hta``: records cifar-lenet on 2 CPU workers (30 steps) and tutorial-linear under DDP (2 ranks, 10 steps),
   exports each (the DDP run as a file per rank), reads each file back with ``dpprof import`` (the largest
   difference of a device's phase total, in %) and with HTA's ``hta.common.trace_parser.parse_trace_dataframe``
   (both its json and ijson back-ends) in HTA's own environment, printing its rows per event name, and loads the
   DDP run's directory with HTA's ``TraceAnalysis`` (rank files).
2. ``long``: synthesises CUDA-shaped runs of 8 devices (bench/dashboard.py's records: a step of two forward
   calls, allocator readings, NVML at 10 Hz) of each --steps, with each of --details, and exports each
   in a fresh process (no torch loaded): the steps written, events, JSON and .gz bytes, seconds and the
   process's peak RSS; a run over the viewers' limit writes its newest steps that fit (the line it prints is
   shown). The files are read back with ``dpprof import`` (seconds; phase totals).

The machine is shared: seconds move from run to run, sizes and events do not.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
DEFAULT_HTA = ROOT / ".hta-venv" / "bin" / "python"
if not DEFAULT_HTA.exists():
    DEFAULT_HTA = Path("/work/main/.hta-venv/bin/python")

print = partial(print, flush=True)  # noqa: A001

HTA_PARSE = r"""
import collections, json, logging, sys
logging.disable(logging.WARNING)
from hta.common.trace_parser import parse_trace_dataframe
from hta.configs.parser_config import ParserBackend, ParserConfig
out = {}
for backend in ("JSON", "IJSON_BATCH_AND_COMPRESS"):
    cfg = ParserConfig(); cfg.parser_backend = getattr(ParserBackend, backend)
    meta, df, symbols = parse_trace_dataframe(sys.argv[1], cfg)
    names = df["name"].map(lambda i: symbols.sym_table[i])
    counts = collections.Counter(n if not n.startswith("ProfilerStep#") else "ProfilerStep#N" for n in names)
    out[backend] = {"rows": len(df), "meta": sorted(meta), "names": dict(sorted(counts.items())),
                    "pids": sorted(int(p) for p in df["pid"].unique()),
                    "dur_us": {n: round(float(d), 1) for n, d in df.groupby(names)["dur"].sum().items()
                               if n.startswith("dpprof.")}}
print(json.dumps(out))
"""

HTA_ANALYSIS = r"""
import json, logging, sys
logging.disable(logging.WARNING)
from hta.trace_analysis import TraceAnalysis
analyzer = TraceAnalysis(trace_dir=sys.argv[1])
trace = analyzer.t
print(json.dumps({"ranks": sorted(int(r) for r in trace.traces), "rows": {int(r): len(df) for r, df in trace.traces.items()},
                  "iterations": {int(r): sorted(int(i) for i in df["iteration"].unique() if i >= 0)
                                 for r, df in trace.traces.items()}}))
"""

EXPORT = r"""
import json, sys, time
import dpprof
from dpprof.trace.export import export_trace
t = time.perf_counter()
run = dpprof.load_run(sys.argv[1])
plan, written = export_trace(run, sys.argv[2])
# VmHWM, not ru_maxrss: Linux keeps ru_maxrss across exec, so a child would report this bench's own peak
hwm = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
out = {"seconds": time.perf_counter() - t, "peak_rss_mib": hwm / 1024,
       "steps": int(len(plan.steps)), "held": plan.held, "run_steps": plan.run_steps, "cut": plan.cut,
       "why": plan.why(), "estimate": plan.events, "events": sum(w.events for w in written),
       "json_bytes": sum(w.json_bytes for w in written), "file_bytes": sum(w.file_bytes for w in written),
       "torch_loaded": "torch" in sys.modules}
print(json.dumps(out))
"""


def _totals_diff_pct(run, back) -> float:
    """The largest difference of a device's phase total between two runs, in % of the first's."""
    steps = set(back.steps["step"])
    a = run.phases[run.phases["step"].isin(steps)].groupby(["device", "phase"])["duration_ms"].sum()
    b = back.phases.groupby(["device", "phase"])["duration_ms"].sum()
    return float(((b.reindex(a.index) - a).abs() / a.where(a > 0)).max() * 100)


def part_hta(hta_python: Path, work: Path) -> None:
    import dpprof
    from dpprof.cli import main
    from dpprof.trace import import_traces
    from dpprof.trace.export import export_trace
    from recorded import record

    print("== HTA reads dpprof's exports")
    reports = work / "reports"
    dp = record(reports, "dp", workers=2, steps=30, batch_size=32)
    assert main(["--reports-dir", str(reports), "profile", "tutorial-linear", "--ddp", "--nproc", "2", "--steps", "10",
                 "--quiet"]) == 0
    listing = dpprof.list_runs(reports)
    ddp = dpprof.load_run(listing[listing["ranks"] == 2]["id"].iloc[0], reports)
    hta_ok = hta_python.exists() and subprocess.run([str(hta_python), "-c", "import hta.common.trace_parser"],
                                                    capture_output=True).returncode == 0
    if not hta_ok:
        print(f"HTA skipped: no python with HolisticTraceAnalysis at {hta_python} "
              "(python3 -m venv .hta-venv && .hta-venv/bin/pip install HolisticTraceAnalysis)")
    for label, run in (("DataParallel, 2 CPU workers, 30 steps", dp), ("DDP, 2 ranks, 10 steps", ddp)):
        directory = work / f"trace-{run.id}"
        directory.mkdir()
        plan, written = export_trace(run, directory / f"{run.id}.pt.trace.json.gz")
        print(f"\n{label}: {plan.why()}; " + ", ".join(f"{w.path.name}: {w.events} events, {w.file_bytes:,} bytes"
                                                      for w in written))
        back = dpprof.load_run(import_traces([w.path for w in written], work / "back").id, work / "back")
        print(f"dpprof import: {len(back.steps)} step rows ({back.model.kind}, devices {', '.join(back.model.devices)});"
              f" largest phase-total difference {_totals_diff_pct(run, back):.6f}%")
        if not hta_ok:
            continue
        for w in written:
            done = subprocess.run([str(hta_python), "-c", HTA_PARSE, str(w.path)], capture_output=True, text=True)
            if done.returncode:
                print(f"HTA parse_trace_dataframe({w.path.name}) FAILED: {done.stderr.strip().splitlines()[-1]}")
                continue
            for backend, r in json.loads(done.stdout.splitlines()[-1]).items():
                print(f"HTA parse_trace_dataframe({w.path.name}, {backend}): {r['rows']} rows, pids {r['pids']}, "
                      f"metadata {r['meta']}")
                print(f"    rows per name: {r['names']}")
            print(f"    dur (µs) per dpprof range: {r['dur_us']}")
        done = subprocess.run([str(hta_python), "-c", HTA_ANALYSIS, str(directory)], capture_output=True, text=True)
        if done.returncode:
            print(f"HTA TraceAnalysis({directory.name}) FAILED: {done.stderr.strip().splitlines()[-1]}")
        else:
            print(f"HTA TraceAnalysis(trace_dir): {done.stdout.strip().splitlines()[-1]}")


def part_long(steps_list: list[int], details: list[str], devices: int, work: Path) -> None:
    from dashboard import synthesise

    import dpprof
    from dpprof.trace import import_traces

    print(f"\n== long runs: {devices} devices, CUDA-shaped records (bench/dashboard.py)")
    print("| run | steps written | events | JSON | .json.gz | export s | export peak RSS | dpprof import s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for steps in steps_list:
        for detail in details:
            path = work / f"long-{steps}-{detail}.sqlite"
            t = time.perf_counter()
            synthesise(str(path), devices, steps, backend="cuda", detail=detail)
            made = time.perf_counter() - t
            out = work / f"long-{steps}-{detail}.json.gz"
            env = {**os.environ, "PYTHONPATH": str(ROOT)}
            done = subprocess.run([sys.executable, "-c", EXPORT, str(path), str(out)], capture_output=True, text=True,
                                  env=env)
            if done.returncode:
                print(f"export of {path.name} FAILED: {done.stderr.strip()[-2000:]}")
                continue
            r = json.loads(done.stdout.splitlines()[-1])
            t = time.perf_counter()
            imported = import_traces([out], work / "back", again=True)
            import_s = time.perf_counter() - t
            diff = _totals_diff_pct(dpprof.load_run(path), dpprof.load_run(imported.id, work / "back"))
            print(f"| {devices} x {steps:,}, detail {detail} (synthesised in {made:.0f} s) | {r['steps']:,} of "
                  f"{r['held']:,} held in full | {r['events']:,} (estimated {r['estimate']:,}) | "
                  f"{r['json_bytes'] / 2**20:.1f} MiB | {r['file_bytes'] / 2**20:.1f} MiB | {r['seconds']:.1f} | "
                  f"{r['peak_rss_mib']:.0f} MiB | {import_s:.1f} (phase totals within {diff:.4f}%) |")
            print(f"<!-- {path.name}: {r['why']}; torch loaded: {r['torch_loaded']} -->")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", default="4000,50000")
    parser.add_argument("--details", default="all,bounded")
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--hta-python", default=str(DEFAULT_HTA))
    parser.add_argument("--parts", default="hta,long")
    parser.add_argument("--keep", default=None, help="keep the runs and traces in this directory")
    args = parser.parse_args()
    parts = args.parts.split(",")
    sys.path.insert(0, str(ROOT / "tests"))
    with tempfile.TemporaryDirectory(prefix="dpprof-trace-export-") as tmp:
        work = Path(args.keep) if args.keep else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        if "hta" in parts:
            part_hta(Path(args.hta_python), work)
        if "long" in parts:
            part_long([int(s) for s in args.steps.split(",")], args.details.split(","), args.devices, work)


if __name__ == "__main__":
    main()

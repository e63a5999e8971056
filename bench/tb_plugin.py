"""dpprof's operator, kernel, GPU and memory figures beside the TensorBoard profiler plugin's (torch-tb-profiler
0.4.3, its last release) on the same torch.profiler trace (issue #33).

    python bench/tb_plugin.py [--trace PATH] [--tb-venv DIR] [--out DIR] [--top N] [--rounds N]
                              [--plugin-only] [--plugin-from DIR]

The trace defaults to the plugin's own sample, ResNet-50 on one V100 in the 2021 format
(../shared/traces/resnet50-1gpu-tb-sample.pt.trace.json.gz). Two sides, each in a process of its own:

- the plugin: TensorBoard with the plugin, from its own virtual environment, serves a log directory holding the
  trace as ``RUN/WORKER.pt.trace.json.gz`` (the layout the plugin scans for); this script GETs the JSON routes a
  browser's page would (``data/plugin/pytorch_profiler/overview``, ``operation/table``, ``kernel/table``,
  ``memory``, ``memory_curve``, ...) over HTTP and keeps them as they came (``OUT/plugin-routes/``) and as figures
  (``OUT/plugin.json``: per operator calls and host/device self/total in us, per kernel calls, total, mean blocks
  per SM, mean est. achieved occupancy and tensor cores, per GPU utilization, est. SM efficiency and est. achieved
  occupancy, the memory peaks, the step breakdown). Its load time is the plugin's own log, from "Load run" to
  "Run ... loaded" (a spawned worker process: its interpreter, imports, parsing and aggregating), and the CPU
  seconds of TensorBoard's process from start to exit;
- dpprof: ``python -m dpprof import TRACE`` into a temporary reports directory (the process's wall clock and CPU
  seconds), then ``dpprof ops RUN --json``, ``dpprof kernels RUN --json`` and ``dpprof memory RUN --json``.

It prints a table per view, the top rows by device time with dpprof's figure beside the plugin's and the
difference, and summary lines (how many operators and kernels match in calls exactly and in times to the
microsecond and within 0.1%). Then the why: each operator difference is checked against the plugin's rules,
recomputed from the trace's raw events with no code of either tool (``trace_facts``: the CUDA runtime calls it
takes out of host self time, the memcpy/memset it counts as device time, the same-named only children it
merges, the nccl:* annotations it nests, the launches it cannot read in a CUDA 12 trace); a difference no rule
accounts for is printed as unexplained. The GPU figures are recomputed over both step windows, the memory peaks
from the ``[memory]`` events. ``OUT/comparison.json`` holds both sides' figures matched by name, with the causes.
``--rounds N`` times both loads N times, taking turns, and says the machine's load while the rounds after the first
ran (bench/conditions.py). Write-up: docs/benchmarks.md, "dpprof beside the
TensorBoard plugin".

The plugin's environment, beside the checkout (or the main checkout's, from a worktree), made once with::

    python3 -m venv .tb-venv && .tb-venv/bin/pip install torch-tb-profiler==0.4.3 tensorboard==2.21.0 \
        protobuf==7.36.2 pandas==3.1.1 numpy==2.4.6 werkzeug==3.1.9

These are the versions tested with Python 3.11 (2026-11-26); no older protobuf or setuptools is needed:
TensorBoard 2.21 finds the plugin through importlib.metadata, not pkg_resources. The plugin is not a
requirement of dpprof and is not in its requirements files.
"""
from __future__ import annotations

import argparse
import gzip
import itertools
import json
import math
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from datetime import datetime
from pathlib import Path
from typing import Any

from conditions import Conditions

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT.parent / "shared" / "traces" / "resnet50-1gpu-tb-sample.pt.trace.json.gz"
TB_VENVS = [ROOT / ".tb-venv",  # the plugin in its own environment, beside the checkout
            ROOT.parent / "main" / ".tb-venv"]  # or the main checkout's, from a worktree
VENV_COMMAND = ("python3 -m venv .tb-venv && .tb-venv/bin/pip install torch-tb-profiler==0.4.3 tensorboard==2.21.0 "
                "protobuf==7.36.2 pandas==3.1.1 numpy==2.4.6 werkzeug==3.1.9")
PREFIX = "data/plugin/pytorch_profiler"
RUN_NAME = "trace"  # the plugin's run: the log directory's one subdirectory
LOAD_TIMEOUT_S = 600  # the plugin loads a 75,718-event trace in 7 to 22 s on the shared 2-core machine; a GB, minutes
SERVER_START_TIMEOUT_S = 120  # TensorBoard's imports (pandas, numpy, grpc) take a few seconds on a loaded machine
POLL_S = 0.2
REL_TOLERANCE = 0.001  # "within 0.1%": the issue's bound for means; sums should match exactly
ROUTES = {  # file name: (route, extra query); the queries the plugin's own pages send
    "overview": ("overview", {}),
    "operation_table": ("operation/table", {"group_by": "Operation"}),
    "operation_table_by_shape": ("operation/table", {"group_by": "OperationAndInputShape"}),
    "operation_pie": ("operation", {"group_by": "Operation"}),
    "kernel_table": ("kernel/table", {"group_by": "Kernel"}),
    "kernel_op_table": ("kernel/table", {"group_by": "KernelNameAndOpName"}),
    "kernel_pie": ("kernel", {}),
    "kernel_tc_pie": ("kernel/tc_pie", {}),
    "memory": ("memory", {"memory_metric": "B"}),
    "memory_curve": ("memory_curve", {"time_metric": "us", "memory_metric": "B"}),
    "memory_events": ("memory_events", {"time_metric": "us", "memory_metric": "B"}),
}


class BenchError(Exception):
    """A side could not run: the message says which and what to do."""


# ---------------------------------------------------------------- the plugin's side


def find_tb_venv(given: str | None) -> Path:
    """The plugin's virtual environment: --tb-venv, else .tb-venv beside the checkout or the main checkout's."""
    candidates = [Path(given)] if given else TB_VENVS
    for venv in candidates:
        if (venv / "bin" / "tensorboard").is_file():
            return venv
    raise BenchError(f"no TensorBoard plugin environment ({' or '.join(str(c) for c in candidates)} has no "
                     f"bin/tensorboard); make it once, from the checkout: {VENV_COMMAND}")


def _get(url: str) -> Any:
    """One GET, JSON decoded (the plugin gzips its larger answers: urllib does not undo that by itself)."""
    with urllib.request.urlopen(url, timeout=300) as response:
        body = response.read()
        if response.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
    return json.loads(body)


def _versions(venv: Path) -> dict[str, str]:
    code = ("import importlib.metadata as m, json, sys; print(json.dumps({n: m.version(n) for n in "
            "('torch-tb-profiler', 'tensorboard', 'protobuf', 'pandas', 'numpy')} | {'python': sys.version.split()[0]}))")
    done = subprocess.run([str(venv / "bin" / "python"), "-c", code], capture_output=True, text=True)
    return json.loads(done.stdout) if done.returncode == 0 else {"error": done.stderr.strip()[-200:]}


def _log_time(line: str) -> float | None:
    """Seconds of the day from an absl log line's head (``I1126 03:50:00.793279 ...``)."""
    m = re.match(r"[IWEF]\d{4} (\d\d):(\d\d):(\d\d\.\d+) ", line)
    return None if m is None else int(m[1]) * 3600 + int(m[2]) * 60 + float(m[3])


def run_plugin(trace: Path, venv: Path, out: Path) -> dict:
    """Serve the trace with TensorBoard and the plugin, GET its JSON routes; returns what they say, as figures."""
    logdir = Path(tempfile.mkdtemp(prefix="dpprof-tb-"))
    run_dir = logdir / RUN_NAME
    run_dir.mkdir()
    name = trace.name if re.search(r"\.pt\.trace\.json(\.gz)?$", trace.name) else (
        "worker0.pt.trace.json.gz" if trace.name.endswith(".gz") else "worker0.pt.trace.json")
    shutil.copyfile(trace, run_dir / name)  # a copy: the plugin's cache never touches the user's file
    worker = re.sub(r"(\.\d+)?\.pt\.trace\.json(\.gz)?$", "", name)
    out.mkdir(parents=True, exist_ok=True)
    log_path = out / "tensorboard.log"
    env = {**os.environ, "TORCH_PROFILER_LOG_LEVEL": "INFO"}
    cpu = _children_cpu_s()
    with open(log_path, "w") as log:
        server = subprocess.Popen([str(venv / "bin" / "tensorboard"), "--logdir", str(logdir), "--host", "127.0.0.1",
                                   "--port", "0", "--load_fast", "false", "--reload_interval", "0"],
                                  stdout=log, stderr=subprocess.STDOUT, env=env)
    wall = time.perf_counter()
    try:
        base = _wait_for_server(server, log_path)
        _wait_for_run(server, base, log_path)
        wall = time.perf_counter() - wall
        routes = {}
        query = {"run": RUN_NAME, "worker": worker, "span": "default"}
        views = _get(f"{base}/{PREFIX}/views?run={RUN_NAME}")
        if not views:  # the run is listed with no profile when its worker's file failed to parse
            failed = [line for line in log_path.read_text().splitlines() if "Failed to parse profile data" in line]
            said = failed[0].split("] ", 1)[-1] if failed else "no view"
            raise BenchError(f"the plugin could not read {trace.name}: {said} (its log: {log_path})")
        spans = _get(f"{base}/{PREFIX}/spans?run={RUN_NAME}&worker={urllib.parse.quote(worker)}")
        query["span"] = spans[0] if spans else "default"
        (out / "plugin-routes").mkdir(exist_ok=True)
        for key, (route, extra) in ROUTES.items():
            url = f"{base}/{PREFIX}/{route}?{urllib.parse.urlencode({**query, **extra})}"
            try:
                routes[key] = _get(url)
            except urllib.error.HTTPError as err:  # a view the plugin has no data for answers 404 or 500
                routes[key] = {"error": f"HTTP {err.code} from {route}"}
            (out / "plugin-routes" / f"{key}.json").write_text(json.dumps(routes[key], indent=1))
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        shutil.rmtree(logdir, ignore_errors=True)
    cpu = _children_cpu_s() - cpu
    figures = plugin_figures(routes)
    figures["tensorboard_cpu_s"] = cpu  # TensorBoard's process and the workers it reaped: start, load, the routes
    figures["views"] = views
    figures["load_s"] = _load_seconds(log_path.read_text())
    figures["serve_wall_s"] = wall  # from TensorBoard's start to the run being listed: its imports and the load
    figures["versions"] = _versions(venv)
    figures["worker"] = worker
    return figures


def _children_cpu_s() -> float:
    """CPU seconds of this process's waited-for children so far (user + system)."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _wait_for_server(server: subprocess.Popen, log_path: Path) -> str:
    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    while time.monotonic() < deadline:
        m = re.search(r"TensorBoard \S+ at (http://[^/\s]+)/", log_path.read_text())
        if m:
            return m[1]
        if server.poll() is not None:
            tail = log_path.read_text().strip().splitlines()[-1:] or [f"exit {server.returncode}"]
            raise BenchError(f"TensorBoard stopped before serving ({log_path}): {tail[0]}")
        time.sleep(POLL_S)
    raise BenchError(f"TensorBoard did not serve within {SERVER_START_TIMEOUT_S} s ({log_path})")


def _wait_for_run(server: subprocess.Popen, base: str, log_path: Path) -> None:
    deadline = time.monotonic() + LOAD_TIMEOUT_S
    while time.monotonic() < deadline:
        runs = _get(f"{base}/{PREFIX}/runs")
        if RUN_NAME in runs["runs"] and not runs["loading"]:
            return
        if not runs["loading"] and "Failed to parse profile data" in log_path.read_text():
            raise BenchError(f"the plugin could not parse the trace: see {log_path}")
        if server.poll() is not None:
            raise BenchError(f"TensorBoard stopped while loading the trace ({log_path})")
        time.sleep(POLL_S)
    raise BenchError(f"the plugin had not loaded the trace after {LOAD_TIMEOUT_S} s ({log_path})")


def _load_seconds(log: str) -> float | None:
    """The plugin's own load time, from its log: "Load run" to "Run ... loaded"."""
    start = end = None
    for line in log.splitlines():
        if "] Load run " in line:
            start = _log_time(line)
        elif re.search(r"\] Run .* loaded$", line):
            end = _log_time(line)
    if start is None or end is None:
        return None
    return (end - start) % 86400  # a load across midnight


def _pct(text: str) -> float | None:
    m = re.match(r"\s*([-\d.]+)\s*%", text)
    return float(m[1]) if m else None


def plugin_figures(routes: dict) -> dict:
    """The routes' figures in one shape: times in us as the plugin gives them (rounded to the us), percents."""
    ops = [{"name": r["name"], "calls": r["calls"], "host_self_us": r["host_self_duration"],
            "host_total_us": r["host_total_duration"], "device_self_us": r.get("device_self_duration"),
            "device_total_us": r.get("device_total_duration"), "tc_eligible": r.get("tc_eligible"),
            "tc_self_pct": r.get("tc_self_ratio"), "tc_total_pct": r.get("tc_total_ratio")}
           for r in routes["operation_table"]["data"]]
    kernels = []
    table = routes["kernel_table"]
    if "data" in table:
        cols = [c["name"] for c in table["data"]["columns"]]
        for row in table["data"]["rows"]:
            r = dict(zip(cols, row))
            kernels.append({"name": r["Name"], "calls": r["Calls"], "total_us": r["Total Duration (us)"],
                            "mean_us": r["Mean Duration (us)"], "max_us": r["Max Duration (us)"],
                            "min_us": r["Min Duration (us)"], "mean_blocks_per_sm": r.get("Mean Blocks Per SM"),
                            "mean_occupancy_pct": r.get("Mean Est. Achieved Occupancy (%)"),
                            "tensor_cores": r.get("Tensor Cores Used")})
    overview = routes["overview"]
    gpus: list[dict] = []
    for item in overview.get("gpu_metrics", {}).get("data", []):
        m = re.match(r"GPU (\d+):", item["title"])
        if m:
            gpus.append({"device": f"cuda:{m[1]}"})
        elif gpus:
            key = {"Name": "name", "Memory": "memory", "Compute Capability": "compute_capability",
                   "GPU Utilization": "utilization_pct", "Est. SM Efficiency": "sm_efficiency_pct",
                   "Est. Achieved Occupancy": "achieved_occupancy_pct",
                   "Kernel Time using Tensor Cores": "tensor_core_pct"}.get(item["title"], item["title"])
            gpus[-1][key] = _pct(item["value"]) if key.endswith("_pct") else item["value"]
    cols = [c.get("name") for c in overview["steps"]["columns"]]
    steps = []
    for row in overview["steps"]["rows"]:
        parts = {name: value for name, value in zip(cols, row) if name and name != "Step"}
        steps.append({"step": int(row[0]), "total_us": sum(parts.values()), **{f"{k}_us": v for k, v in parts.items()}})
    curve = routes["memory_curve"]
    peaks = {dev: text for dev, text in curve.get("metadata", {}).get("peaks", {}).items()}
    memory_stats = routes["memory"]
    return {"operators": ops, "kernels": kernels, "gpu": gpus, "steps": steps,
            "average_step": overview.get("performance", [{}])[0],
            "memory": {"peaks": peaks, "curve_devices": curve.get("metadata", {}).get("devices", []),
                       "operator_stats_devices": sorted(memory_stats.get("rows", {})),
                       "events_devices": sorted(routes["memory_events"].get("rows", {}))
                       if isinstance(routes["memory_events"].get("rows"), dict) else []},
            "recommendations": overview.get("recommendations", "")}


# ---------------------------------------------------------------- dpprof's side


def _dpprof(reports: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "dpprof", "--reports-dir", str(reports), *args], capture_output=True,
                          text=True, env=env, cwd=str(ROOT))


def time_dpprof_import(trace: Path) -> tuple[float, float]:
    """Wall and CPU seconds of one ``python -m dpprof import`` process (interpreter, imports, read, run file,
    findings)."""
    with tempfile.TemporaryDirectory(prefix="dpprof-tb-bench-") as tmp:
        cpu, wall = _children_cpu_s(), time.perf_counter()
        done = _dpprof(Path(tmp), "import", str(trace), "--quiet")
        wall, cpu = time.perf_counter() - wall, _children_cpu_s() - cpu
    if done.returncode != 0:
        raise BenchError(f"dpprof import failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
    return wall, cpu


def run_dpprof(trace: Path) -> dict:
    """Import the trace into a temporary reports directory and read the three commands' --json."""
    with tempfile.TemporaryDirectory(prefix="dpprof-tb-bench-") as tmp:
        reports = Path(tmp)
        cpu, wall = _children_cpu_s(), time.perf_counter()
        done = _dpprof(reports, "import", str(trace), "--quiet")
        wall, cpu = time.perf_counter() - wall, _children_cpu_s() - cpu
        if done.returncode != 0:
            raise BenchError(f"dpprof import failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
        m = re.search(r"imported run (\S+) ", done.stdout)
        if m is None:
            raise BenchError(f"dpprof import said no run id: {done.stdout.strip()[:200]}")
        run_id = m[1]
        figures: dict = {"import_s": wall, "import_cpu_s": cpu, "run": run_id, "import_output": done.stdout.strip()}
        for command, key in (("ops", "operators"), ("kernels", "kernels"), ("memory", "devices")):
            done = _dpprof(reports, command, run_id, "--json", "--top", "1000000")
            if done.returncode != 0:
                said = (done.stderr.strip().splitlines() or ["?"])[-1]
                if "invalid choice" in said:
                    raise BenchError(f"this dpprof has no `dpprof {command}` command yet (issue #33 adds `ops`, "
                                     f"`kernels` and `memory`), so only the plugin's side ran: {said}")
                raise BenchError(f"`dpprof {command} {run_id} --json` failed: {said}")
            answer = json.loads(done.stdout)
            figures.update(answer if isinstance(answer, dict) else {key: answer})
    return figures


# ---------------------------------------------------------------- the trace's own events, for the why


RUNTIME_CATS = {"runtime", "cuda_runtime", "cuda_driver"}  # launches: the 2021 name and the CUDA 12 ones
COPY_CATS = {"memcpy", "memset", "gpu_memcpy", "gpu_memset"}
# the plugin's operator table leaves these out (torch_tb_profiler/profiler/node.py, is_operator_node and
# create_operator_node): steps, DataLoader iterations and optimizer ranges are other node types
PLUGIN_COMM_NAMES = {f"{lib}:{op}" for lib in ("nccl", "gloo")  # trace.py, NcclOpNameSet and GlooOpNameSet
                     for op in ("broadcast", "reduce", "all_reduce", "all_gather", "reduce_scatter")}
PLUGIN_LEFT_OUT = re.compile(r"^(ProfilerStep#|enumerate\(DataLoader\)#|enumerate\(DataPipe\)#|Optimizer\.)"
                             r"|^(DataParallel|DistributedDataParallel)\.forward$")


def trace_facts(trace: Path) -> dict:
    """What the tools' rules act on, from the trace's raw events (json.load: a bench on sample-sized traces),
    with no code of either tool: per operator name, the time of its CUDA runtime calls (linked by External id),
    the memcpy/memset time it launched (by correlation; itself, and with its children by nesting on a thread),
    and the calls the plugin merges into their parent (a same-named only child, as torch.autograd.profiler's
    _remove_dup_nodes), with their host and device time; and the GPU figures over two windows: the
    ProfilerStep ranges, and those ranges with the last step stretched to the end of the device work launched
    inside it (the plugin's rule, event_parser.StepParser._update_steps_duration)."""
    opener = gzip.open if trace.name.endswith(".gz") else open
    with opener(trace, "rt") as fh:
        events = json.load(fh)["traceEvents"]
    x = [e for e in events if e.get("ph") == "X" and isinstance(e.get("dur"), (int, float))]
    cat = [str(e.get("cat", "")).lower() for e in x]
    ops = [e for e, c in zip(x, cat) if c in ("operator", "cpu_op")]
    runtimes = [e for e, c in zip(x, cat) if c in RUNTIME_CATS]
    kernels = [e for e, c in zip(x, cat) if c == "kernel"]
    copies = [e for e, c in zip(x, cat) if c in COPY_CATS]

    def ext(e: dict) -> object:
        a = e.get("args", {})
        return a.get("External id", a.get("external id"))

    rt_by_corr = {e["args"].get("correlation"): e for e in runtimes}
    copy_us_of_rt: dict[int, float] = {}
    kernel_us_of_rt: dict[int, float] = {}
    for table, devs in ((copy_us_of_rt, copies), (kernel_us_of_rt, kernels)):
        for d in devs:
            rt = rt_by_corr.get(d.get("args", {}).get("correlation"))
            if rt is not None:
                table[id(rt)] = table.get(id(rt), 0.0) + d["dur"]
    rts_of_ext: dict[object, list[dict]] = {}
    for r in runtimes:
        rts_of_ext.setdefault(ext(r), []).append(r)
    children = _nesting(ops)
    # the plugin also puts the nccl:*/gloo:* collectives' user annotations in its tree of operators (node.py,
    # create_operator_node): an op around one loses the annotation's time from its host self time
    comms = [e for e, c in zip(x, cat) if c == "user_annotation" and e.get("name") in PLUGIN_COMM_NAMES]
    with_comms = _nesting(ops + comms)
    device_total: dict[int, float] = {}
    copy_total: dict[int, float] = {}
    kernel_total: dict[int, float] = {}
    order = []  # post-order without recursion: a parent after all its children
    roots = {id(o) for o in ops} - {id(c) for cs in children.values() for c in cs}
    by_id = {id(o): o for o in ops}
    todo = [(by_id[i], False) for i in roots]
    while todo:
        o, done = todo.pop()
        if done:
            order.append(o)
            continue
        todo.append((o, True))
        todo.extend((c, False) for c in children.get(id(o), []))
    per_name: dict[str, dict[str, Any]] = {}
    for o in order:
        rts = rts_of_ext.get(ext(o), []) if ext(o) not in (None, 0) else []
        own_copy = sum(copy_us_of_rt.get(id(r), 0.0) for r in rts)
        own_kernel = sum(kernel_us_of_rt.get(id(r), 0.0) for r in rts)
        kids = children.get(id(o), [])
        copy_total[id(o)] = own_copy + sum(copy_total[id(c)] for c in kids)
        device_total[id(o)] = own_copy + own_kernel + sum(device_total[id(c)] for c in kids)
        kernel_total[id(o)] = own_kernel + sum(kernel_total[id(c)] for c in kids)
        f: dict[str, Any] = per_name.setdefault(o["name"], {"calls": 0, "runtime_us": 0.0, "copy_self_us": 0.0, "copy_total_us": 0.0,
                                            "kernel_self_us": 0.0, "kernel_total_us": 0.0, "comm_annotation_us": 0.0,
                                            "merged_calls": 0, "merged_host_us": 0.0, "merged_device_us": 0.0,
                                            "left_out_by_plugin": bool(PLUGIN_LEFT_OUT.search(o["name"]))})
        f["calls"] += 1
        f["runtime_us"] += sum(r["dur"] for r in rts)
        f["copy_self_us"] += own_copy
        f["copy_total_us"] += copy_total[id(o)]
        f["kernel_self_us"] += own_kernel
        f["kernel_total_us"] += kernel_total[id(o)]
        # host self with the annotations in the tree, against without them
        f["comm_annotation_us"] += (sum(c["dur"] for c in with_comms.get(id(o), []))
                                    - sum(c["dur"] for c in kids))
        if len(kids) == 1 and kids[0]["name"] == o["name"]:  # the plugin keeps one call of the two
            f["merged_calls"] += 1
            f["merged_host_us"] += kids[0]["dur"]
            f["merged_device_us"] += device_total[id(kids[0])]
    step_events = [e for e in x if str(e.get("name", "")).startswith("ProfilerStep#")]  # cpu_op, or user_annotation
    steps = sorted((e["ts"], e["ts"] + e["dur"]) for e in step_events)
    step_numbers = sorted((e["ts"], int(str(e["name"]).split("#")[1])) for e in step_events)
    memory: dict[str, dict] = {}  # per device, the peak of Total Allocated, else of the running sum of Bytes
    level: dict[str, int] = {}
    for e in sorted((e for e in events if e.get("name") == "[memory]"), key=lambda e: e.get("ts", 0)):
        a = e.get("args", {})
        dev = f"cuda:{a.get('Device Id')}" if a.get("Device Type") == 1 else "host"  # dpprof's name for it
        value = a.get("Total Allocated")
        level[dev] = level.get(dev, 0) + (a.get("Bytes") or 0)
        value = level[dev] if value is None else value
        if value > memory.get(dev, {}).get("peak_allocated_bytes", -1):
            step = [n for t, n in step_numbers if t <= e["ts"]]
            memory[dev] = {"peak_allocated_bytes": value, "peak_step": step[-1] if step else None,
                           "from": "running sum of Bytes" if a.get("Total Allocated") is None else "Total Allocated"}
    windows = {}
    if steps and kernels:
        lo, hi = steps[0][0], steps[-1][1]
        last_lo, last_hi = steps[-1]
        launched = [d["ts"] + d["dur"] for d in kernels + copies
                    if (rt := rt_by_corr.get(d.get("args", {}).get("correlation"))) is not None
                    and last_lo <= rt["ts"] and rt["ts"] + rt["dur"] <= last_hi]
        windows = {"ProfilerStep ranges": (lo, hi), "the plugin's (last step to its device work's end)":
                   (lo, max([hi, *launched]))}
    gpu = {name: _gpu_figures(kernels, lo, hi) for name, (lo, hi) in windows.items()}
    return {"operators": per_name, "gpu": gpu, "memory": memory,
            # the plugin's 0.4.3 knows a launch by the 2021 category "Runtime" only (trace.py, EventTypeMap)
            "plugin_sees_launches": any(c == "runtime" for c in cat),
            "windows_ms": {k: (hi - lo) / 1000 for k, (lo, hi) in windows.items()}}


def _nesting(events: list[dict]) -> dict[int, list[dict]]:
    """Each event's direct children: the events inside it on its thread, by time (a parent opens no later and
    closes no earlier), keyed by id()."""
    children: dict[int, list[dict]] = {}
    by_tid: dict[object, list[dict]] = {}
    for e in events:
        by_tid.setdefault(e.get("tid"), []).append(e)
    for lst in by_tid.values():
        lst.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[dict] = []
        for e in lst:
            while stack and e["ts"] + e["dur"] > stack[-1]["ts"] + stack[-1]["dur"]:
                stack.pop()
            if stack:
                children.setdefault(id(stack[-1]), []).append(e)
            stack.append(e)
    return children


def _gpu_figures(kernels: list[dict], lo: float, hi: float) -> dict:
    """GPU utilization, est. SM efficiency and est. achieved occupancy of all kernels in [lo, hi] (one GPU),
    by the definitions the plugin documents (consts.TOOLTIP_*)."""
    spans = sorted((max(k["ts"], lo), min(k["ts"] + k["dur"], hi)) for k in kernels)
    busy, end = 0.0, lo
    for a, b in spans:
        if b > max(a, end):
            busy += b - max(a, end)
            end = b
    points = sorted([(k["ts"], k["args"]["blocks per SM"]) for k in kernels if (k["args"].get("blocks per SM") or 0) > 0]
                    + [(k["ts"] + k["dur"], -k["args"]["blocks per SM"]) for k in kernels
                       if (k["args"].get("blocks per SM") or 0) > 0])
    sm, level, last = 0.0, 0.0, None
    for t, delta in points:
        if last is not None and t > last and level > 1e-12:
            sm += min(level, 1.0) * max(0.0, min(t, hi) - max(last, lo))
        level += delta
        last = t
    occ_w = occ_t = 0.0
    for k in kernels:
        o = k["args"].get("est. achieved occupancy %")
        d = min(k["ts"] + k["dur"], hi) - max(k["ts"], lo)
        if o is not None and d > 0:
            occ_w += o * d
            occ_t += d
    return {"utilization_pct": 100 * busy / (hi - lo), "sm_efficiency_pct": 100 * sm / (hi - lo),
            "achieved_occupancy_pct": occ_w / occ_t if occ_t else None}


# ---------------------------------------------------------------- the comparison


def _by_name(rows: list[dict], sums: tuple[str, ...], firsts: tuple[str, ...] = (),
             weighted: dict[str, str] | None = None) -> dict[str, dict]:
    """dpprof's rows (one per rank and device) as one per name, as the plugin shows one worker: sums added,
    weighted means re-weighted (by the named weight), the rest from the first row."""
    out: dict[str, dict] = {}
    for r in rows:
        o = out.setdefault(r["name"], {"devices": [], **{k: 0 for k in sums}, **{k: r.get(k) for k in firsts},
                                       **{f"_w_{k}": 0.0 for k in (weighted or {})}})
        o["devices"].append(f"{r.get('rank')}/{r.get('device')}")
        for k in sums:
            o[k] += r.get(k) or 0.0
        for k, weight in (weighted or {}).items():
            if r.get(k) is not None:
                o[f"_w_{k}"] += r[k] * (r.get(weight) or 0.0)
    for o in out.values():
        for k, weight in (weighted or {}).items():
            w = o.pop(f"_w_{k}")
            o[k] = w / o[weight] if o[weight] else None
    return out


def _close(a: float | None, b: float | None, rel: float = REL_TOLERANCE, abs_: float = 0.0) -> bool:
    if a is None or b is None:
        return a is b
    return abs(a - b) <= max(abs_, rel * max(abs(a), abs(b)))


def _cut(name: str, width: int) -> str:
    return name if len(name) <= width else name[: width - 1] + "…"


def _fmt(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


CAUSES = {  # what each rule moves (dpprof - plugin, ms), from trace_facts' figures for one operator name
    "runtime": "the plugin takes the op's CUDA runtime calls (launches, syncs) out of its host self time",
    "copies": "the plugin counts the memcpy/memset an op launched as its device time",
    "merged": "the plugin merges a same-named only child into its parent (torch.autograd.profiler's _remove_dup_nodes)",
    "comms": "the plugin nests nccl:*/gloo:* user annotations under an op, out of its host self time",
    "unlinked": "the plugin reads no cuda_runtime/cuda_driver launch (CUDA 12 names; kineto#1166 was never released), "
                "so it links no kernel to an operator: device time 0",
}
EXPLAIN_TOLERANCE_MS = 0.001  # the plugin rounds each sum to the us; the trace's times are whole us


def _candidates(field: str, f: dict, sees_launches: bool) -> dict[str, float]:
    """Per cause, how far (dpprof - plugin, ms) it moves this field of an operator name. Where the plugin sees no
    launch, it has no device time to copy or merge and no runtime call to take out of host self time."""
    if not sees_launches:
        return {"calls": {"merged": f["merged_calls"]},
                "host_total": {"merged": f["merged_host_us"] / 1000},
                "host_self": {"comms": f["comm_annotation_us"] / 1000},
                "device_self": {"unlinked": f["kernel_self_us"] / 1000},
                "device_total": {"unlinked": f["kernel_total_us"] / 1000}}[field]
    return {"calls": {"merged": f["merged_calls"]},
            "host_total": {"merged": f["merged_host_us"] / 1000},
            "host_self": {"runtime": f["runtime_us"] / 1000, "comms": f["comm_annotation_us"] / 1000},
            "device_self": {"copies": -f["copy_self_us"] / 1000},
            "device_total": {"merged": f["merged_device_us"] / 1000, "copies": -f["copy_total_us"] / 1000}}[field]


def explain(field: str, plugin_value: float, dpprof_value: float, f: dict | None,
            sees_launches: bool = True) -> list[str] | None:
    """The causes whose moves add up to the difference ([] where there is none), None where none do."""
    diff = dpprof_value - plugin_value
    if abs(diff) <= EXPLAIN_TOLERANCE_MS:
        return []
    if f is None:
        return None
    moves = [(k, v) for k, v in _candidates(field, f, sees_launches).items() if v]
    for n in range(1, len(moves) + 1):
        for combo in itertools.combinations(moves, n):
            if abs(sum(v for _, v in combo) - diff) <= EXPLAIN_TOLERANCE_MS * max(1, n):
                return [k for k, _ in combo]
    return None


def compare_operators(plugin: dict, dp: dict, top: int, facts: dict | None = None) -> dict:
    ours = _by_name(dp.get("operators", []), ("calls", "host_total_ms", "host_self_ms", "device_total_ms",
                                               "device_self_ms"))
    theirs = {o["name"]: o for o in plugin["operators"]}
    rows: list[dict[str, Any]] = []
    def device_self_ms(n: str) -> float:  # the larger side's: on a CUDA 12 trace the plugin's are all 0
        return max(((theirs.get(n) or {}).get("device_self_us") or 0) / 1000, (ours.get(n) or {}).get("device_self_ms") or 0)

    for name in sorted(set(ours) | set(theirs), key=lambda n: -device_self_ms(n)):
        t, o = theirs.get(name), ours.get(name)
        row: dict[str, Any] = {"name": name, "in": "both" if t and o else ("plugin" if t else "dpprof")}
        for field in ("calls", "host_self", "host_total", "device_self", "device_total"):
            pv = None if t is None else (t["calls"] if field == "calls" else
                                          None if t.get(f"{field}_us") is None else t[f"{field}_us"] / 1000)
            dv = None if o is None else (o["calls"] if field == "calls" else o[f"{field}_ms"])
            row[field] = {"plugin": pv, "dpprof": dv}
        rows.append(row)
    both = [r for r in rows if r["in"] == "both"]
    summary: dict[str, Any] = {"operators_in_plugin": len(theirs), "operators_in_dpprof": len(ours), "in_both": len(both),
               "only_in_plugin": sorted(r["name"] for r in rows if r["in"] == "plugin"),
               "only_in_dpprof": sorted(r["name"] for r in rows if r["in"] == "dpprof"),
               "calls_equal": sum(r["calls"]["plugin"] == r["calls"]["dpprof"] for r in both)}
    for field in ("host_self", "host_total", "device_self", "device_total"):
        # the plugin rounds each sum to the us: "to the us" allows that rounding and no more
        summary[f"{field}_to_the_us"] = sum(_close(r[field]["plugin"], r[field]["dpprof"], 0.0, 0.0005 + 1e-9)
                                            for r in both)
        summary[f"{field}_within_0.1pct"] = sum(_close(r[field]["plugin"], r[field]["dpprof"], REL_TOLERANCE,
                                                       0.0005 + 1e-9) for r in both)
    why: dict[str, dict[str, int]] = {}
    for r in both:
        f = (facts or {}).get("operators", {}).get(r["name"])
        for field in ("calls", "host_self", "host_total", "device_self", "device_total"):
            p, d = r[field]["plugin"], r[field]["dpprof"]
            if p is None or d is None:
                continue
            causes = explain(field, p, d, f, (facts or {}).get("plugin_sees_launches", True))
            r[field]["why"] = causes
            if causes:
                key = " + ".join(causes)
                why.setdefault(field, {}).setdefault(key, 0)
                why[field][key] += 1
            elif causes is None:
                why.setdefault(field, {}).setdefault("unexplained", 0)
                why[field]["unexplained"] += 1
    summary["differences_by_cause"] = why
    summary["only_in_dpprof_left_out_by_plugin"] = sum(
        bool((facts or {}).get("operators", {}).get(n, {}).get("left_out_by_plugin")) for n in summary["only_in_dpprof"])
    print(f"\nOperators: top {top} by device self time, the larger side's (ms; the plugin's figure, dpprof's, dpprof - "
          "plugin)")
    print(f"{'operator':<44} {'calls':>13} {'device self ms':>27} {'device total ms':>27} {'host self ms':>27}")
    for r in rows[:top]:
        cells = [f"{_cut(r['name'], 44):<44}", f"{_calls(r['calls']['plugin'])} {_calls(r['calls']['dpprof'])}"]
        for field in ("device_self", "device_total", "host_self"):
            p, d = r[field]["plugin"], r[field]["dpprof"]
            cells.append(f"{_fmt(p):>9} {_fmt(d):>9} {_fmt(None if p is None or d is None else d - p, '+.3f'):>7}")
        print(" ".join(cells))
    _print_summary("operators", summary, ("host_self", "host_total", "device_self", "device_total"))
    if facts:
        print(f"  only in dpprof and left out of the plugin's table by its rules (steps, DataLoader, optimizer): "
              f"{summary['only_in_dpprof_left_out_by_plugin']} of {len(summary['only_in_dpprof'])}")
        for field, counts in why.items():
            print(f"  {field.replace('_', ' ')} differs for {sum(counts.values())}: "
                  + "; ".join(f"{n} by {k}" for k, n in counts.items()))
        used = {c for counts in why.values() for key in counts for c in key.split(" + ")}
        for key, text in CAUSES.items():
            if key in used:
                print(f"    {key}: {text}")
        for r in both:
            if any(r[f].get("why") is None and r[f]["plugin"] is not None and r[f]["dpprof"] is not None
                   for f in ("calls", "host_self", "host_total", "device_self", "device_total")):
                print(f"    unexplained: {r['name']}: " + ", ".join(
                    f"{f} {r[f]['plugin']} / {r[f]['dpprof']}" for f in ("calls", "host_self", "host_total",
                                                                         "device_self", "device_total")
                    if r[f].get("why") is None))
    return {"rows": rows, "summary": summary}


def compare_kernels(plugin: dict, dp: dict, top: int) -> dict:
    ours = _by_name(dp.get("kernels", []), ("calls", "total_ms"), ("tensor_cores",),
                    {"mean_blocks_per_sm": "total_ms", "mean_occupancy_pct": "total_ms"})
    theirs = {k["name"]: k for k in plugin["kernels"]}
    rows: list[dict[str, Any]] = []
    def total_ms(n: str) -> float:
        return max(((theirs.get(n) or {}).get("total_us") or 0) / 1000, (ours.get(n) or {}).get("total_ms") or 0)

    for name in sorted(set(ours) | set(theirs), key=lambda n: -total_ms(n)):
        t, o = theirs.get(name), ours.get(name)
        rows.append({"name": name, "in": "both" if t and o else ("plugin" if t else "dpprof"),
                     "calls": {"plugin": t and t["calls"], "dpprof": o and o["calls"]},
                     "total_ms": {"plugin": t and t["total_us"] / 1000, "dpprof": o and o["total_ms"]},
                     "mean_blocks_per_sm": {"plugin": t and t["mean_blocks_per_sm"],
                                            "dpprof": o and o["mean_blocks_per_sm"]},
                     "mean_occupancy_pct": {"plugin": t and t["mean_occupancy_pct"],
                                            "dpprof": o and o["mean_occupancy_pct"]},
                     "tensor_cores": {"plugin": t and t["tensor_cores"], "dpprof": o and o["tensor_cores"]}})
    both = [r for r in rows if r["in"] == "both"]
    summary: dict[str, Any] = {"kernels_in_plugin": len(theirs), "kernels_in_dpprof": len(ours), "in_both": len(both),
               "only_in_plugin": sorted(r["name"] for r in rows if r["in"] == "plugin"),
               "only_in_dpprof": sorted(r["name"] for r in rows if r["in"] == "dpprof"),
               "calls_equal": sum(r["calls"]["plugin"] == r["calls"]["dpprof"] for r in both),
               "total_ms_to_the_us": sum(_close(r["total_ms"]["plugin"], r["total_ms"]["dpprof"], 0.0, 0.0005 + 1e-9)
                                         for r in both),
               "total_ms_within_0.1pct": sum(_close(r["total_ms"]["plugin"], r["total_ms"]["dpprof"]) for r in both),
               # the plugin rounds both means to 2 decimals
               "mean_blocks_per_sm_to_its_rounding": sum(_close(r["mean_blocks_per_sm"]["plugin"],
                                                                r["mean_blocks_per_sm"]["dpprof"], 0.0, 0.005 + 1e-9)
                                                         for r in both),
               "mean_occupancy_pct_to_its_rounding": sum(_close(r["mean_occupancy_pct"]["plugin"],
                                                                r["mean_occupancy_pct"]["dpprof"], 0.0, 0.005 + 1e-9)
                                                         for r in both),
               "mean_occupancy_pct_within_0.5_points": sum(_close(r["mean_occupancy_pct"]["plugin"],
                                                                  r["mean_occupancy_pct"]["dpprof"], 0.0, 0.5)
                                                           for r in both),
               "tensor_cores_equal": sum(_yes(r["tensor_cores"]["plugin"]) == _yes(r["tensor_cores"]["dpprof"])
                                         for r in both)}
    print(f"\nKernels: top {top} by total time, the larger side's (the plugin's figure, dpprof's)")
    print(f"{'kernel':<44} {'calls':>13} {'total ms':>27} {'mean blocks/SM':>15} {'mean occupancy %':>17} TC")
    for r in rows[:top]:
        p, d = r["total_ms"]["plugin"], r["total_ms"]["dpprof"]
        print(f"{_cut(r['name'], 44):<44} {_calls(r['calls']['plugin'])} {_calls(r['calls']['dpprof'])} "
              f"{_fmt(p):>9} {_fmt(d):>9} {_fmt(None if p is None or d is None else d - p, '+.3f'):>7} "
              f"{_fmt(r['mean_blocks_per_sm']['plugin'], '.2f'):>7} {_fmt(r['mean_blocks_per_sm']['dpprof'], '.2f'):>7} "
              f"{_fmt(r['mean_occupancy_pct']['plugin'], '.2f'):>8} {_fmt(r['mean_occupancy_pct']['dpprof'], '.2f'):>8} "
              f"{r['tensor_cores']['plugin'] or '-'}/{_yes_no(r['tensor_cores']['dpprof'])}")
    _print_summary("kernels", summary, ())
    return {"rows": rows, "summary": summary}


def _calls(n: float | None) -> str:
    return f"{'-' if n is None else int(n):>6}"


def _yes(v: object) -> bool | None:
    if v is None:
        return None
    if isinstance(v, str):
        return v.strip().lower() in ("yes", "true", "1")
    return bool(v)


def _yes_no(v: object) -> str:
    y = _yes(v)
    return "-" if y is None else ("Yes" if y else "No")


def _print_summary(what: str, summary: dict, fields: tuple[str, ...]) -> None:
    n = summary["in_both"]
    print(f"  {what}: {summary[f'{what}_in_plugin']} in the plugin, {summary[f'{what}_in_dpprof']} in dpprof, "
          f"{n} in both; only in the plugin: {len(summary['only_in_plugin'])}, only in dpprof: "
          f"{len(summary['only_in_dpprof'])}")
    for key, value in summary.items():
        if isinstance(value, int) and key != "only_in_dpprof_left_out_by_plugin" and key not in (f"{what}_in_plugin", f"{what}_in_dpprof", "in_both"):
            print(f"  {key.replace('_', ' ')}: {value} of {n}")
    for side in ("only_in_plugin", "only_in_dpprof"):
        if summary[side]:
            print(f"  {side.replace('_', ' ')}: {', '.join(_cut(x, 60) for x in summary[side][:8])}"
                  + (" …" if len(summary[side]) > 8 else ""))


def compare_gpu(plugin: dict, dp: dict, facts: dict | None = None) -> list[dict]:
    rows: list[dict[str, Any]] = []
    ours = {g["device"]: g for g in dp.get("gpu", []) if g.get("step") is None}
    facts = facts or {}
    windows = list(facts.get("gpu", {}))
    print("\nGPU, all steps (the plugin's figure, dpprof's, dpprof - plugin, in points"
          + ("; then the figure recomputed from the trace's kernels over each window: "
             + ", ".join(f"{w} {facts['windows_ms'][w]:.3f} ms" for w in windows) if windows else "") + ")")
    one_each = len(plugin["gpu"]) == 1 and len(ours) == 1  # one GPU: dpprof may label it by rank ("rank:0")
    for g in plugin["gpu"]:
        o = next(iter(ours.values())) if one_each else ours.get(g["device"], {})
        for key in ("utilization_pct", "sm_efficiency_pct", "achieved_occupancy_pct"):
            p, d = g.get(key), o.get(key)
            again = {w: facts["gpu"][w][key] for w in windows} if len(plugin["gpu"]) == 1 else {}
            rows.append({"device": g["device"], "figure": key, "plugin": p, "dpprof": d, "from_the_trace": again})
            print(f"  {g['device']} {key:<24} {_fmt(p, '.2f'):>7} {_fmt(d, '.2f'):>7} "
                  f"{_fmt(None if p is None or d is None else d - p, '+.2f'):>7}   "
                  + "  ".join(f"{_fmt(v, '.2f')}" for v in again.values()))
    for device in [] if one_each else sorted(set(ours) - {g["device"] for g in plugin["gpu"]}):
        print(f"  {device}: in dpprof only ({ours[device]})")
    return rows


def compare_memory(plugin: dict, dp: dict, facts: dict | None = None) -> list[dict]:
    rows: list[dict[str, Any]] = []
    print("\nMemory peaks (bytes)")
    peaks = plugin["memory"]["peaks"]
    from_trace = (facts or {}).get("memory", {})
    for d in dp.get("devices", []):
        dev = d["device"]
        key = f"GPU{dev.split(':')[1]}" if dev.startswith("cuda:") else "CPU"
        again = from_trace.get(dev, {})
        rows.append({"device": dev, "dpprof_peak_allocated_bytes": d.get("peak_allocated_bytes"),
                     "dpprof_peak_reserved_bytes": d.get("peak_reserved_bytes"), "dpprof_peak_step": d.get("peak_step"),
                     "plugin_peak": peaks.get(key), "from_the_trace": again})
        print(f"  {dev}: dpprof peak allocated {_fmt(d.get('peak_allocated_bytes'), ',')}, reserved "
              f"{_fmt(d.get('peak_reserved_bytes'), ',')}, at step {d.get('peak_step')}; the plugin: "
              f"{peaks.get(key) or 'no peak (its memory curve has no ' + key + ')'}; the trace's [memory] events: "
              f"{_fmt(again.get('peak_allocated_bytes'), ',')} at step {again.get('peak_step')} "
              f"({again.get('from', 'none for this device')})")
    for dev, again in from_trace.items():
        if dev not in {d["device"] for d in dp.get("devices", [])}:
            print(f"  {dev}: not in dpprof's table; the trace's [memory] events: "
                  f"{_fmt(again['peak_allocated_bytes'], ',')} at step {again['peak_step']} ({again['from']})")
    return rows


def print_plugin(plugin: dict, top: int) -> None:
    v = plugin["versions"]
    print(f"plugin: torch-tb-profiler {v.get('torch-tb-profiler')}, tensorboard {v.get('tensorboard')}, "
          f"python {v.get('python')}; views {', '.join(plugin['views'])}")
    print(f"  the plugin's load (its log, 'Load run' to 'Run loaded'): {_fmt(plugin['load_s'], '.2f')} s; "
          f"TensorBoard's start to the run listed: {plugin['serve_wall_s']:.2f} s; TensorBoard's CPU "
          f"{_fmt(plugin.get('tensorboard_cpu_s'), '.2f')} s")
    steps = ", ".join(f"{s['step']}: {s['total_us'] / 1000:.3f}" for s in plugin["steps"])
    print(f"  steps in its overview (ms): {steps}")
    for g in plugin["gpu"]:
        print(f"  {g['device']} ({g.get('name')}): GPU utilization {_fmt(g.get('utilization_pct'), '.2f')}%, "
              f"est. SM efficiency {_fmt(g.get('sm_efficiency_pct'), '.2f')}%, est. achieved occupancy "
              f"{_fmt(g.get('achieved_occupancy_pct'), '.2f')}%, tensor cores {_fmt(g.get('tensor_core_pct'), '.1f')}%")
    mem = plugin["memory"]
    print(f"  memory: peaks {mem['peaks'] or 'none'}; curve devices {mem['curve_devices'] or 'none'}; "
          f"per-operator statistics for {', '.join(mem['operator_stats_devices']) or 'none'}")
    print(f"  {len(plugin['operators'])} operators, {len(plugin['kernels'])} kernels; top operators by device self "
          "time (us):")
    for o in sorted(plugin["operators"], key=lambda o: -(o["device_self_us"] or 0))[:top]:
        print(f"    {_cut(o['name'], 50):<50} {o['calls']:>6} {o['device_self_us']!s:>8} {o['device_total_us']!s:>8} "
              f"{o['host_self_us']:>8} {o['host_total_us']:>8}")


def timing_rounds(args: argparse.Namespace, out: Path, plugin: dict, dp: dict) -> dict:
    """More rounds of the two loads alone, taking turns (dpprof first in odd rounds); the first round's too."""
    venv = find_tb_venv(args.tb_venv)
    times: dict[str, list[float | None]] = {"plugin_load_s": [plugin["load_s"]], "plugin_serve_wall_s": [plugin["serve_wall_s"]],
                                     "tensorboard_cpu_s": [plugin.get("tensorboard_cpu_s")],
                                     "dpprof_import_s": [dp["import_s"]], "dpprof_import_cpu_s": [dp["import_cpu_s"]],
                                     "load_average": [os.getloadavg()[0]]}
    with Conditions() as conditions:  # both sides run as this process's children
        for k in range(1, args.rounds):
            for side in (("dpprof", "plugin") if k % 2 else ("plugin", "dpprof")):
                if side == "dpprof":
                    wall, cpu = time_dpprof_import(args.trace)
                    times["dpprof_import_s"].append(wall)
                    times["dpprof_import_cpu_s"].append(cpu)
                else:
                    again = run_plugin(args.trace, venv, out / f"round-{k}")  # its log and routes kept there
                    times["plugin_load_s"].append(again["load_s"])
                    times["plugin_serve_wall_s"].append(again["serve_wall_s"])
                    times["tensorboard_cpu_s"].append(again["tensorboard_cpu_s"])
            times["load_average"].append(os.getloadavg()[0])
    median = {key: statistics.median([x for x in v if x is not None]) for key, v in times.items() if None not in v}
    print(f"\n{args.rounds} rounds, taking turns (seconds; median last):")
    for key, values in times.items():
        print(f"  {key:<22} {_list(values)}   median {_fmt(median.get(key), '.2f')}")
    print(f"  rounds after the first: {conditions.line()}")
    loaded = conditions.refusal() is not None  # no ratio is printed here: the load is said beside the seconds
    if loaded:
        print(f"  other processes took {conditions.other_cores:.2f} cores while these rounds ran: the seconds are "
              "the machine's load as much as the tools'")
    return {"times": times, "median": median, "conditions": conditions.line(), "loaded": loaded}


def _list(values: list) -> str:
    return ", ".join(_fmt(v, ".2f") for v in values)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", type=Path, default=TRACE, help="a torch.profiler trace (.json or .json.gz)")
    parser.add_argument("--tb-venv", default=None, help="the plugin's virtual environment (default: .tb-venv beside "
                        "the checkout, else the main checkout's)")
    parser.add_argument("--out", type=Path, default=None, help="where the routes and figures are written "
                        "(default: a new temporary directory, said at the end)")
    parser.add_argument("--top", type=int, default=15, help="rows printed a table")
    parser.add_argument("--plugin-only", action="store_true", help="run the plugin's side only")
    parser.add_argument("--rounds", type=int, default=1, help="times each side loads the trace (the comparison "
                        "uses the first; the rest time the two loads again, taking turns)")
    parser.add_argument("--plugin-from", type=Path, default=None, metavar="DIR",
                        help="take the plugin's figures from an earlier run's --out DIR instead of running it")
    args = parser.parse_args(argv)
    if not args.trace.is_file():
        print(f"tb_plugin: no trace at {args.trace}", file=sys.stderr)
        return 2
    out = args.out or Path(tempfile.mkdtemp(prefix="dpprof-tb-plugin-"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"{datetime.now().astimezone():%Y-%m-%d %H:%M %Z}, {os.cpu_count()} cores, load average "
          f"{os.getloadavg()[0]:.2f}; trace {args.trace} ({args.trace.stat().st_size / 2**20:.2f} MiB)")
    try:
        if args.plugin_from is not None:
            if not (args.plugin_from / "plugin.json").is_file():
                raise BenchError(f"no plugin.json in {args.plugin_from} (give the --out DIR of an earlier run)")
            plugin = json.loads((args.plugin_from / "plugin.json").read_text())
        else:
            plugin = run_plugin(args.trace, find_tb_venv(args.tb_venv), out)
    except BenchError as err:
        print(f"tb_plugin: {err}", file=sys.stderr)
        return 2
    (out / "plugin.json").write_text(json.dumps(plugin, indent=1))
    print_plugin(plugin, args.top)
    if args.plugin_only:
        print(f"\nthe plugin's routes and figures: {out}")
        return 0
    try:
        dp = run_dpprof(args.trace)
    except BenchError as err:
        print(f"\ntb_plugin: {err}\nthe plugin's routes and figures: {out}", file=sys.stderr)
        return 1
    print(f"\ndpprof: import {dp['import_s']:.2f} s, {dp['import_cpu_s']:.2f} CPU s (the process: interpreter, "
          f"imports, reading, the run file, findings), run {dp['run']}; the plugin's load {_fmt(plugin['load_s'], '.2f')} "
          f"s (a spawned worker: interpreter, imports, parsing), TensorBoard's CPU "
          f"{_fmt(plugin.get('tensorboard_cpu_s'), '.2f')} s (start, load, the routes)")
    facts = trace_facts(args.trace)
    comparison = {"plugin_load_s": plugin["load_s"], "dpprof_import_s": dp["import_s"],
                  "operators": compare_operators(plugin, dp, args.top, facts),
                  "kernels": compare_kernels(plugin, dp, args.top),
                  "gpu": compare_gpu(plugin, dp, facts), "memory": compare_memory(plugin, dp, facts),
                  "trace_facts": facts}
    if args.rounds > 1:
        comparison["timing_rounds"] = timing_rounds(args, out, plugin, dp)
    (out / "dpprof.json").write_text(json.dumps(dp, indent=1))
    (out / "comparison.json").write_text(json.dumps(comparison, indent=1))
    print(f"\nboth sides' figures and the comparison: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Importing torch.profiler traces: one ~1 GB file, dpprof against Holistic Trace Analysis's parser; and the four
rank files of one job, read one after another (``--jobs 1``) and at once (the default).

    python bench/trace_import.py [--size-mb 1024] [--rank-size-mb 1024] [--ranks 4] [--rounds 2] [--pairs 2]
                                 [--arms dpprof,dpprof-1,hta-json,jobs] [--hta-python .hta-venv/bin/python]
                                 [--keep DIR]
                                 [--allow-load]

Traces are made in a temporary directory (or ``--keep DIR``, reused when the files are there) by repeating
the steps of a shared real trace (../shared/traces/ddp-2ranks-rank0-nccl.json.gz: DDP on NCCL, 3 steps) with
shifted timestamps and step numbers: one of about --size-mb MB (uncompressed JSON), and --ranks files of about
--rank-size-mb MB each, the same events with ``distributedInfo`` saying rank k of --ranks. Each arm runs in a
fresh process of its own; arms take turns round by round, a different one first each round:

- dpprof: ``dpprof.trace.import_traces`` on the one file (read, convert, write the run file, findings), with the
  default jobs: one worker per core, each reading a part of the file (``dpprof.trace.jobs``);
- dpprof-1: the same with ``jobs=1``: the file read in the importing process alone;
- hta-json: ``hta.common.trace_parser.parse_trace_dataframe`` with HTA's default backend (json.load);
- hta-ijson: the same with ``ParserBackend.IJSON_BATCH_AND_COMPRESS`` (its streaming back-end; not run by
  default: slower than its default and longer than the rest of the bench together);
- jobs: the rank files as one run, ``jobs=1`` and the default (``jobs_for``: one per core, fewer where
  memory would not hold them), --pairs times a round, alternately.

Each arm prints its seconds (from the start of its process's imports to the end) and its peak RSS
(``ru_maxrss``: the whole process, interpreter and imports included, whose share alone is printed first;
for the dpprof and jobs arms also the largest worker's, which counts the pages a forked worker shares with its
parent), and the peak proportional set size of the arm's process and its workers together (sampled every 50 ms from
Linux's /proc: a page shared by n processes counts 1/n in each, so the sum is what the import held at once).
The load average is printed beside each figure, and the CPU seconds (the process's and its
workers'), which a shared machine moves less than the wall clock. Before the rounds, one process times
dpprof's stages on the one file, wall clock and CPU: reading the bytes, decoding the events, collecting
them, converting, writing the run file and its findings. HTA runs in its own virtual environment (it pins other versions);
without one its arms are skipped with a message.

The rounds end with the machine's load (bench/conditions.py): the load average before, and the cores the machine,
the bench's own processes and every other process kept busy during the rounds. Where other processes took more
than a quarter of a core on average, the means are printed but not the ratios (``--allow-load`` prints them anyway).
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from functools import partial
from pathlib import Path

from conditions import Conditions, process_tree

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT.parent / "shared" / "traces" / "ddp-2ranks-rank0-nccl.json.gz"
HTA_PYTHONS = [ROOT / ".hta-venv" / "bin" / "python",  # HTA in its own environment, beside the checkout
               ROOT.parent / "main" / ".hta-venv" / "bin" / "python"]  # or the main checkout's, from a worktree


def make_traces(source: Path, outs: list[tuple[Path, dict | None]], size_mb: float) -> int:
    """Write traces of about size_mb MB each: the source's events repeated with ts shifted by its span, the
    same events in every file, each with its own distributedInfo (None: the source's). Returns events a file."""
    with gzip.open(source, "rt") as f:
        doc = json.load(f)
    events = doc.pop("traceEvents")
    timed = [e for e in events if isinstance(e.get("ts"), (int, float)) and e.get("ph") != "M"]
    lo = min(e["ts"] for e in timed)
    hi = max(e["ts"] + e.get("dur", 0) for e in timed)
    span = hi - lo + 1000.0
    steps = [int(e["name"].split("#")[1]) for e in events if str(e.get("name", "")).startswith("ProfilerStep#")]
    nsteps = max(steps) - min(steps) + 1
    meta_events = [e for e in events if e.get("ph") == "M"]
    body = [json.dumps(e, separators=(",", ":")) for e in timed]
    per_copy = sum(len(b) + 2 for b in body)
    copies = max(1, int(size_mb * 2**20 / per_copy))
    files = [open(path, "w") for path, _ in outs]
    written = 0
    try:
        for f, (_, info) in zip(files, outs):
            # HTA's ijson back-end asserts on a top-level list of strings (Kineto's "INFO" log lines): left out
            # so that every arm can read the file
            head = {k: v for k, v in doc.items() if k != "INFO"}
            if info is not None:
                head["distributedInfo"] = {**head.get("distributedInfo", {}), **info}
            f.write("{\n" + ",\n".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in head.items())
                    + ',\n"traceEvents": [\n')
        first = True
        for e in meta_events:
            line = ("" if first else ",\n") + json.dumps(e)
            for f in files:
                f.write(line)
            first = False
            written += 1
        for k in range(copies):
            shift = k * span
            for e in timed:
                e2 = dict(e)
                e2["ts"] = e["ts"] + shift
                name = e2.get("name", "")
                if name.startswith("ProfilerStep#"):
                    e2["name"] = f"ProfilerStep#{int(name.split('#')[1]) + k * nsteps}"
                line = ("" if first else ",\n") + json.dumps(e2, separators=(",", ":"))
                for f in files:
                    f.write(line)
                first = False
                written += 1
        for f in files:
            f.write("\n]\n}\n")
    finally:
        for f in files:
            f.close()
    return written


ARM_CODE = {
    "dpprof": ("import dpprof.trace, tempfile\n"
               "{stop}"
               "with tempfile.TemporaryDirectory(prefix='dpprof-bench-') as reports:\n"
               "    run = dpprof.trace.import_traces(PATHS, reports)\n"
               "RESULT = f'{{run.steps}} steps'\n"),
    "dpprof-1": ("import dpprof.trace, tempfile\n"
                 "{stop}"
                 "with tempfile.TemporaryDirectory(prefix='dpprof-bench-') as reports:\n"
                 "    run = dpprof.trace.import_traces(PATHS, reports, jobs=1)\n"
                 "RESULT = f'{{run.steps}} steps, one process'\n"),
    "jobs-1": ("import dpprof.trace, tempfile\n"
               "{stop}"
               "with tempfile.TemporaryDirectory(prefix='dpprof-bench-') as reports:\n"
               "    run = dpprof.trace.import_traces(PATHS, reports, jobs=1)\n"
               "RESULT = f'{{len(run.devices)}} ranks, jobs 1'\n"),
    "jobs-default": ("import dpprof.trace, tempfile\n"
                     "from dpprof.trace.importer import jobs_for\n"
                     "{stop}"
                     "with tempfile.TemporaryDirectory(prefix='dpprof-bench-') as reports:\n"
                     "    run = dpprof.trace.import_traces(PATHS, reports)\n"
                     "RESULT = f'{{len(run.devices)}} ranks, jobs {{jobs_for(PATHS)}} (the default)'\n"),
    "hta-json": ("from hta.common.trace_parser import parse_trace_dataframe\n"
                 "from hta.configs.parser_config import ParserConfig, ParserBackend\n"
                 "{stop}"
                 "cfg = ParserConfig(); cfg.parser_backend = ParserBackend.JSON\n"
                 "meta, df, symbols = parse_trace_dataframe(PATHS[0], cfg)\n"
                 "RESULT = f'{{len(df)}} rows'\n"),
    "hta-ijson": ("from hta.common.trace_parser import parse_trace_dataframe\n"
                  "from hta.configs.parser_config import ParserConfig, ParserBackend\n"
                  "{stop}"
                  "cfg = ParserConfig(); cfg.parser_backend = ParserBackend.IJSON_BATCH_AND_COMPRESS\n"
                  "meta, df, symbols = parse_trace_dataframe(PATHS[0], cfg)\n"
                  "RESULT = f'{{len(df)}} rows'\n"),
}
WRAPPER = """
import json, logging, resource, sys, time
logging.disable(logging.WARNING)
PATHS = sys.argv[1:]
t = time.perf_counter()
{body}
seconds = time.perf_counter() - t
me, workers = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
print(json.dumps({{"seconds": seconds, "cpu_s": me.ru_utime + me.ru_stime + workers.ru_utime + workers.ru_stime,
                  "peak_rss_mb": me.ru_maxrss / 1024, "workers_peak_rss_mb": workers.ru_maxrss / 1024,
                  "result": RESULT}}))
"""
STAGES = """
import json, os, sys, tempfile, time
from pathlib import Path
path = Path(sys.argv[1])
out = {}


class stage:
    def __init__(self, name):
        self.name = name

    def __enter__(self):
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def __exit__(self, *exc):
        out[self.name] = (time.perf_counter() - self.wall, time.process_time() - self.cpu)


with stage("import dpprof.trace"):
    from dpprof.trace import importer
    from dpprof.trace.collect import collect
    from dpprof.trace.convert import convert
    from dpprof.trace.decode import CHUNK_BYTES, TraceFile
with stage("read the bytes (OS file cache)"):
    with open(path, "rb") as f:
        while f.read(CHUNK_BYTES):
            pass
with stage("decode the events (reader alone)"):
    n = sum(len(batch) for batch in TraceFile(path).batches())
with stage("decode + collect"):
    c = collect(TraceFile(path))
with stage("convert"):
    t0 = min([s[1] for s in c.steps] or [c.first_us])
    conv = convert(c, t0, c.rank)
with tempfile.TemporaryDirectory() as d:
    with stage("write the run file"):
        written = importer._write(Path(d), "bench", "bench", [c], [c.rank], [conv],
                                  t0 + importer._abs_offset_us(c), c.rank is not None)
    with stage("findings"):
        importer._store_findings(written)
print(json.dumps({"stages": out, "events": n}))
"""


def _pss_bytes(pid: int) -> int:
    """A process's proportional set size (a page shared by n processes counts 1/n), 0 where unknown."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class _TreePeak(threading.Thread):
    """The largest PSS a process and its workers held together, sampled every PSS_EVERY_S while it runs."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid, self.peak, self.done = pid, 0, threading.Event()

    def run(self) -> None:
        while not self.done.wait(PSS_EVERY_S):
            self.peak = max(self.peak, sum(_pss_bytes(p) for p in process_tree(self.pid)))


PSS_EVERY_S = 0.05


def run_code(code: str, python: str, paths: list[Path]) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    load = os.getloadavg()[0]
    wall = time.perf_counter()
    proc = subprocess.Popen([python, "-c", code, *map(str, paths)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, cwd=str(ROOT))
    peak = _TreePeak(proc.pid)
    peak.start()
    stdout, stderr = proc.communicate()
    peak.done.set()
    peak.join()
    wall = time.perf_counter() - wall
    load = max(load, os.getloadavg()[0])
    if proc.returncode != 0:
        return {"error": (stderr.strip().splitlines() or ["exit %d" % proc.returncode])[-1], "wall_s": wall,
                "load": load}
    out = json.loads(stdout.strip().splitlines()[-1])
    out["wall_s"], out["load"], out["tree_pss_mb"] = wall, load, peak.peak / 2**20
    return out


def run_arm(arm: str, python: str, paths: list[Path], baseline: bool = False) -> dict:
    body = ARM_CODE[arm]
    if baseline:  # stop right after the imports: the interpreter and libraries' share of the RSS
        body = body.split("{stop}")[0] + "RESULT = 'imports only'\n"
    else:
        body = body.format(stop="")
    return run_code(WRAPPER.format(body=body), python, paths)


print = partial(print, flush=True)  # noqa: A001  (a long run: every line as soon as it is known)


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=float, default=1024, help="the one file's size")
    parser.add_argument("--rank-size-mb", type=float, default=1024, help="each rank file's size")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--pairs", type=int, default=2, help="jobs 1 / default pairs a round")
    parser.add_argument("--hta-python", default=None, help="a python with holistictraceanalysis installed")
    parser.add_argument("--arms", default="dpprof,dpprof-1,hta-json,jobs",
                        help="of dpprof, dpprof-1, hta-json, hta-ijson, jobs")
    parser.add_argument("--keep", default=None, help="make the traces here and keep them (reused when there)")
    parser.add_argument("--allow-load", action="store_true",
                        help="print the ratios even where other processes took the processor during the rounds")
    args = parser.parse_args()

    arms = args.arms.split(",")
    hta = args.hta_python or next((str(p) for p in HTA_PYTHONS if p.exists()), str(HTA_PYTHONS[0]))
    hta_ok = Path(hta).exists() and subprocess.run([hta, "-c", "import hta.common.trace_parser"],
                                                   capture_output=True).returncode == 0
    if not hta_ok and any(a.startswith("hta") for a in arms):
        print(f"HTA arms skipped: no python with holistictraceanalysis at {hta} "
              "(python3 -m venv .hta-venv && .hta-venv/bin/pip install holistictraceanalysis ijson)")
        arms = [a for a in arms if not a.startswith("hta")]
    single = [a for a in arms if a != "jobs"]
    python = {a: (hta if a.startswith("hta") else sys.executable) for a in [*single, "jobs-1", "jobs-default"]}
    print(f"machine: {os.cpu_count()} cores, load average {', '.join(f'{x:.1f}' for x in os.getloadavg())} "
          f"(1, 5, 15 min) at the start")

    with tempfile.TemporaryDirectory(prefix="dpprof-trace-bench-") as tmp:
        where = Path(args.keep or tmp)
        where.mkdir(parents=True, exist_ok=True)
        one = where / f"big-{args.size_mb:.0f}mb.pt.trace.json"
        ranks = [where / f"job-{args.rank_size_mb:.0f}mb-rank{k}.pt.trace.json" for k in range(args.ranks)]
        if not one.exists():
            t = time.perf_counter()
            events = make_traces(SOURCE, [(one, None)], args.size_mb)
            print(f"made {one.name}: {events:,} events in {time.perf_counter() - t:.0f} s")
        if "jobs" in arms and not all(p.exists() for p in ranks):
            t = time.perf_counter()
            events = make_traces(SOURCE, [(p, {"rank": k, "world_size": args.ranks}) for k, p in enumerate(ranks)],
                                 args.rank_size_mb)
            print(f"made {len(ranks)} rank files: {events:,} events each in {time.perf_counter() - t:.0f} s")
        size_mb = one.stat().st_size / 2**20
        ranks_mb = sum(p.stat().st_size for p in ranks) / 2**20 if "jobs" in arms else 0
        print(f"one file: {size_mb:,.0f} MiB" + (f"; {len(ranks)} rank files: {ranks_mb:,.0f} MiB in all"
                                                  if "jobs" in arms else ""))

        stages = run_code(STAGES, sys.executable, [one])
        if "error" in stages:
            print(f"stages: failed: {stages['error']}")
        else:
            print(f"dpprof's stages on the one file ({stages['events']:,} events; load average {stages['load']:.1f}), "
                  "seconds and MiB/s of the file, wall clock and CPU (the process's threads):")
            for stage, (wall, cpu) in stages["stages"].items():
                rate = (f"  {size_mb / wall:6.0f} MiB/s wall, {size_mb / cpu:6.0f} MiB/s CPU" if wall > 0.5 else "")
                print(f"  {stage:34s} {wall:6.2f} s, CPU {cpu:6.2f} s{rate}")

        with Conditions() as conditions:  # the arms are this process's children: its own tree
            timed = [*single, *(["jobs-1", "jobs-default"] if "jobs" in arms else [])]
            paths = {a: ([one] if a in single else ranks) for a in timed}
            for arm in timed:
                base = run_arm(arm, python[arm], paths[arm], baseline=True)
                print(f"  {arm}: imports alone peak at {base.get('peak_rss_mb', float('nan')):.0f} MiB RSS")
            results: dict[str, list[dict]] = {a: [] for a in timed}
            turns = [*single, *(["jobs"] if "jobs" in arms else [])]
            for r in range(args.rounds):
                order = turns[r % len(turns):] + turns[:r % len(turns)]  # a different arm first each round
                for turn in order:
                    if turn == "jobs":
                        pair = ["jobs-1", "jobs-default"] if r % 2 == 0 else ["jobs-default", "jobs-1"]
                        batch = [a for k in range(args.pairs) for a in (pair if k % 2 == 0 else pair[::-1])]
                    else:
                        batch = [turn]
                    for arm in batch:
                        res = run_arm(arm, python[arm], paths[arm])
                        results[arm].append(res)
                        mb = size_mb if arm in single else ranks_mb
                        if "error" in res:
                            print(f"round {r + 1} {arm}: failed after {res['wall_s']:.0f} s: {res['error']}")
                        else:
                            workers = (f", largest worker {res['workers_peak_rss_mb']:,.0f} MiB"
                                       if arm in ("jobs-default", "dpprof") and res["workers_peak_rss_mb"] else "")
                            if res.get("tree_pss_mb"):
                                workers += f", the process tree's peak PSS {res['tree_pss_mb']:,.0f} MiB"
                            print(f"round {r + 1} {arm}: {res['seconds']:.1f} s (CPU {res['cpu_s']:.1f} s), "
                                  f"{mb / res['seconds']:.1f} MiB/s, peak RSS {res['peak_rss_mb']:,.0f} MiB{workers} "
                                  f"({res['result']}; load average {res['load']:.1f})")

        refused = None if args.allow_load else conditions.refusal()
        print(f"\n{conditions.line()}")
        print("mean over rounds:")
        means = {}
        for arm, rs in results.items():
            ok = [x for x in rs if "error" not in x]
            if not ok:
                print(f"  {arm}: no successful round")
                continue
            s = _mean([x["seconds"] for x in ok])
            rss = max(x["peak_rss_mb"] for x in ok)
            worker = max(x.get("workers_peak_rss_mb", 0) for x in ok)
            cpu = _mean([x["cpu_s"] for x in ok])
            means[arm] = (s, rss, cpu)
            mb = size_mb if arm in single else ranks_mb
            spread = f"{min(x['seconds'] for x in ok):.1f} to {max(x['seconds'] for x in ok):.1f} s"
            largest = f", largest worker {worker:,.0f} MiB" if worker and arm in ("dpprof", "jobs-default") else ""
            tree = max(x.get("tree_pss_mb", 0) for x in ok)
            largest += f", the process tree's peak PSS {tree:,.0f} MiB" if tree else ""
            print(f"  {arm}: {s:.1f} s ({spread}), {mb / s:.1f} MiB/s, CPU {cpu:.1f} s, peak RSS {rss:,.0f} MiB{largest} "
                  f"({len(ok)} runs, load average {min(x['load'] for x in ok):.1f} to {max(x['load'] for x in ok):.1f})")
        if refused:
            print(f"  ratios {refused}")
        else:
            for ours in ("dpprof", "dpprof-1"):
                for arm in ("hta-json", "hta-ijson"):
                    if ours in means and arm in means:
                        print(f"  {ours} against {arm}: {means[arm][0] / means[ours][0]:.1f}x its speed "
                              f"({means[arm][2] / means[ours][2]:.1f}x in CPU time), "
                              f"{means[ours][1] / means[arm][1]:.2f}x its peak RSS")
        if "jobs-1" in means and "jobs-default" in means and not refused:
            ones = [x["seconds"] for x in results["jobs-1"] if "error" not in x]
            defaults = [x["seconds"] for x in results["jobs-default"] if "error" not in x]
            pairs = [d / o for o, d in zip(ones, defaults)]
            print(f"  {len(ranks)} rank files, default jobs against jobs 1: {means['jobs-default'][0] / means['jobs-1'][0]:.2f}x "
                  f"the time (pair by pair: {', '.join(f'{p:.2f}' for p in pairs)}; median "
                  f"{statistics.median(pairs):.2f})")
        print(f"load average at the end: {', '.join(f'{x:.1f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()

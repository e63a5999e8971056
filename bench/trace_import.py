"""Importing a ~1 GB torch.profiler trace: dpprof's streaming import against Holistic Trace Analysis's parser.

    python bench/trace_import.py [--size-mb 1024] [--rounds 2] [--hta-python .hta-venv/bin/python]
                                 [--trace FILE]   # reuse a trace an earlier run made

A trace of about --size-mb MB (uncompressed JSON) is made in a temporary directory by repeating the
steps of a shared real trace (../shared/traces/ddp-2ranks-rank0-nccl.json.gz: DDP on NCCL, 3 steps)
with shifted timestamps and step numbers; it is deleted afterwards. Each arm reads the same file in
its own fresh process, arms interleaved round by round:

- dpprof: ``dpprof.trace.import_traces`` (read, convert, write the run file, findings);
- HTA json: ``hta.common.trace_parser.parse_trace_dataframe`` with HTA's default backend (json.load);
- HTA ijson: the same with ``ParserBackend.IJSON_BATCH_AND_COMPRESS`` (its streaming back-end).

Each arm prints its seconds and its own peak RSS (``ru_maxrss``: the whole process, interpreter and
imports included; the size of that baseline, measured by importing the same modules and stopping, is
printed too). HTA runs in its own virtual environment (it pins other pandas/numpy versions); without
one the HTA arms are skipped with a message.
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT.parent / "shared" / "traces" / "ddp-2ranks-rank0-nccl.json.gz"
DEFAULT_HTA = ROOT / ".hta-venv" / "bin" / "python"  # HTA in its own environment, beside the project


def make_trace(source: Path, out: Path, size_mb: float) -> int:
    """Write a trace of about size_mb MB: the source's events repeated with ts shifted by its span. Returns events."""
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
    written = 0
    with open(out, "w") as f:
        # HTA's ijson back-end asserts on a top-level list of strings (Kineto's "INFO" log lines): left out so
        # that every arm can read the file
        head = {k: v for k, v in doc.items() if k != "INFO"}
        f.write("{\n" + ",\n".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in head.items()) + ',\n"traceEvents": [\n')
        first = True
        for e in meta_events:
            f.write(("" if first else ",\n") + json.dumps(e))
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
                f.write(("" if first else ",\n") + json.dumps(e2, separators=(",", ":")))
                first = False
                written += 1
        f.write("\n]\n}\n")
    return written


ARM_CODE = {
    "dpprof": ("import dpprof.trace, tempfile\n"
               "{stop}"
               "with tempfile.TemporaryDirectory(prefix='dpprof-bench-') as reports:\n"
               "    run = dpprof.trace.import_traces([PATH], reports)\n"
               "RESULT = f'{{run.steps}} steps'\n"),
    "hta-json": ("from hta.common.trace_parser import parse_trace_dataframe\n"
                 "from hta.configs.parser_config import ParserConfig, ParserBackend\n"
                 "{stop}"
                 "cfg = ParserConfig(); cfg.parser_backend = ParserBackend.JSON\n"
                 "meta, df, symbols = parse_trace_dataframe(PATH, cfg)\n"
                 "RESULT = f'{{len(df)}} rows'\n"),
    "hta-ijson": ("from hta.common.trace_parser import parse_trace_dataframe\n"
                  "from hta.configs.parser_config import ParserConfig, ParserBackend\n"
                  "{stop}"
                  "cfg = ParserConfig(); cfg.parser_backend = ParserBackend.IJSON_BATCH_AND_COMPRESS\n"
                  "meta, df, symbols = parse_trace_dataframe(PATH, cfg)\n"
                  "RESULT = f'{{len(df)}} rows'\n"),
}
WRAPPER = """
import json, logging, resource, sys, time
logging.disable(logging.WARNING)
PATH = sys.argv[1]
t = time.perf_counter()
{body}
print(json.dumps({{"seconds": time.perf_counter() - t, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "result": RESULT}}))
"""


def run_arm(arm: str, python: str, path: Path, baseline: bool = False) -> dict:
    stop = "RESULT = 'imports only'\n" if baseline else ""
    body = ARM_CODE[arm].format(stop=stop)
    if baseline:  # stop right after the imports: the interpreter and libraries' share of the RSS
        body = body.split("RESULT = 'imports only'\n")[0] + "RESULT = 'imports only'\n"
    code = WRAPPER.format(body=body)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    wall = time.perf_counter()
    proc = subprocess.run([python, "-c", code, str(path)], capture_output=True, text=True, env=env, cwd=str(ROOT))
    wall = time.perf_counter() - wall
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["exit %d" % proc.returncode])[-1], "wall_s": wall}
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["wall_s"] = wall
    return out


print = partial(print, flush=True)  # noqa: A001  (a long run: every line as soon as it is known)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=float, default=1024)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--hta-python", default=str(DEFAULT_HTA), help="a python with holistictraceanalysis installed")
    parser.add_argument("--arms", default="dpprof,hta-ijson,hta-json")
    parser.add_argument("--trace", default=None, help="use this trace (made by an earlier run) instead of making one")
    args = parser.parse_args()

    arms = args.arms.split(",")
    hta_ok = Path(args.hta_python).exists() and subprocess.run(
        [args.hta_python, "-c", "import hta.common.trace_parser"], capture_output=True).returncode == 0
    if not hta_ok:
        print(f"HTA arms skipped: no python with holistictraceanalysis at {args.hta_python} "
              "(python3 -m venv .hta-venv && .hta-venv/bin/pip install holistictraceanalysis ijson)")
        arms = [a for a in arms if not a.startswith("hta")]
    python = {a: (args.hta_python if a.startswith("hta") else sys.executable) for a in arms}

    with tempfile.TemporaryDirectory(prefix="dpprof-trace-bench-") as tmp:
        if args.trace:
            path = Path(args.trace)
            size_mb = path.stat().st_size / 2**20
            print(f"trace: {path} ({size_mb:,.0f} MiB)")
        else:
            path = Path(tmp) / "big.pt.trace.json"
            t = time.perf_counter()
            events = make_trace(SOURCE, path, args.size_mb)
            size_mb = path.stat().st_size / 2**20
            print(f"trace: {size_mb:,.0f} MiB, {events:,} events, made in {time.perf_counter() - t:.0f} s from "
                  f"{SOURCE.name}")
        for arm in arms:
            base = run_arm(arm, python[arm], path, baseline=True)
            print(f"  {arm}: imports alone peak at {base.get('peak_rss_mb', float('nan')):.0f} MiB RSS")
        results: dict[str, list[dict]] = {a: [] for a in arms}
        for r in range(args.rounds):
            order = arms[r % len(arms):] + arms[:r % len(arms)]  # interleaved, a different arm first each round
            for arm in order:
                res = run_arm(arm, python[arm], path)
                results[arm].append(res)
                if "error" in res:
                    print(f"round {r + 1} {arm}: failed after {res['wall_s']:.0f} s: {res['error']}")
                else:
                    print(f"round {r + 1} {arm}: {res['seconds']:.1f} s, {size_mb / res['seconds']:.1f} MiB/s, "
                          f"peak RSS {res['peak_rss_mb']:,.0f} MiB ({res['result']})")
        print("\nmean over rounds:")
        means = {}
        for arm, rs in results.items():
            ok = [x for x in rs if "error" not in x]
            if not ok:
                print(f"  {arm}: no successful round")
                continue
            s = sum(x["seconds"] for x in ok) / len(ok)
            rss = max(x["peak_rss_mb"] for x in ok)
            means[arm] = (s, rss)
            print(f"  {arm}: {s:.1f} s, {size_mb / s:.1f} MiB/s, peak RSS {rss:,.0f} MiB ({len(ok)} rounds)")
        if "dpprof" in means:
            for arm, (s, rss) in means.items():
                if arm != "dpprof":
                    print(f"  dpprof / {arm}: time {means['dpprof'][0] / s:.2f}x, peak RSS {means['dpprof'][1] / rss:.2f}x")


if __name__ == "__main__":
    main()

"""Every benchmark in one command, one after another, into one markdown report that says where and when it ran.

    python bench/all.py [--quick] [--only overhead,fsdp] [--out bench-results.md] [--list]

Each benchmark runs as its own process with the arguments below (``--quick``: smaller sizes, for a look in
minutes rather than the hour the full set takes), never two at once. The report starts with the machine (processor,
cores, memory, Python, torch, the checkout's commit) and the date, then gives each benchmark its command, its wall
time, its exit code, the load average before and after it, and the last lines it printed (where each prints its
figures and, for those that judge their conditions with bench/conditions.py, the machine's load during the run).
Each benchmark's whole output is kept beside the report (``<out>.logs/<name>.log``). A benchmark that fails or is
interrupted is reported as such and the next one runs.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# log lines, not figures: Kineto's (USDT:), torch's glog (W1126 ...), Streamlit's bare-mode warnings (a timestamp)
_LOG_LINE = re.compile(r"USDT:|[WIE]\d{4} |\d{4}-\d\d-\d\d \d\d:\d\d:\d\d")

# name -> (script, full arguments, --quick arguments, what it measures)
BENCHES: dict[str, tuple[str, list[str], list[str], str]] = {
    "overhead": ("overhead.py", [], ["--only", "mlp", "--rounds", "8"],
                 "what recording adds to a DataParallel step on CPU workers, against torch.profiler"),
    "overhead-t1": ("overhead.py", ["--only", "mlp", "--threads", "1"], ["--only", "mlp", "--threads", "1", "--rounds", "8"],
                    "the same on the MLP with the calling thread on one intra-op thread (no OpenMP helper spinning on a"
                    " core): issue 35's measure"),
    "gc": ("gc_cost.py", [], ["--steps", "2000", "--rounds", "2"],
           "what recording adds in the garbage collector's collections over long runs"),
    "ddp": ("ddp_overhead.py", [], ["--rounds", "3", "--steps", "20"],
            "what recording adds to a DDP step (2 gloo ranks)"),
    "fsdp": ("fsdp_overhead.py", [], ["--rounds", "3", "--steps", "20"],
             "what recording adds to an FSDP2 step (2 gloo ranks), against torch.profiler"),
    "run": ("run_overhead.py", [], ["--rounds", "2", "--blocks", "6"],
            "what dpprof run costs an unchanged script"),
    "store": ("store.py", [], ["--records", "200000"], "the writer's records a second"),
    "writer": ("writer.py", [], ["--steps", "1000", "--rounds", "3"],
               "the writer thread's CPU per recorded step, with and without the aggregates"),
    "read_side": ("read_side.py", [], ["--runs", "2"], "the read side without torch: show, pages"),
    "long_run": ("long_run.py", [], ["--long", "30000", "--repeat", "1"],
                 "a long run's file size and its pages against a short run's"),
    "trace_import": ("trace_import.py", [], ["--size-mb", "128", "--rank-size-mb", "64", "--rounds", "1",
                                             "--pairs", "1"],
                     "importing torch.profiler traces: one large file, and four rank files at once"),
    "trace_pages": ("trace_pages.py", [], ["--size-mb", "128", "--repeat", "1"],
                    "the dashboard's pages on the run of a large imported trace"),
    "advise": ("advise.py", [], ["--rounds", "1"], "the advisor's predictions against measured runs"),
}


def _machine() -> list[str]:
    sys.path.insert(0, str(ROOT))  # this checkout's dpprof
    from dpprof.devices import cpu_info

    cpu = cpu_info()
    try:
        memory = f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.1f} GiB"
    except (ValueError, OSError, AttributeError):
        memory = "unknown"
    try:
        import torch

        torch_version = torch.__version__
    except ImportError:
        torch_version = "not installed"
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, check=False).stdout.strip() or "unknown"
    return [f"- date: {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}",
            f"- machine: {cpu['cpu_model'] or platform.machine()}, {cpu['cores']} cores ({cpu['threads']} threads), "
            f"{memory}, {platform.system()} {platform.release()}",
            f"- Python {platform.python_version()}, torch {torch_version}, dpprof at commit {commit}"]


def _load() -> str:
    return f"{os.getloadavg()[0]:.2f}" if hasattr(os, "getloadavg") else "unknown"


def run_one(name: str, quick: bool, logs: Path) -> list[str]:
    """Run one benchmark; its section of the report."""
    script, full, small, what = BENCHES[name]
    cmd = [sys.executable, f"bench/{script}", *(small if quick else full)]
    shown = " ".join(["python", *cmd[1:]])
    before = _load()
    print(f"bench/all.py: {name}: {shown}", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    log = logs / f"{name}.log"
    try:
        with open(log, "w", encoding="utf-8") as out:
            code = subprocess.call(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    except KeyboardInterrupt:
        code = None
    seconds = time.monotonic() - t0
    lines = [line for line in log.read_text(encoding="utf-8", errors="replace").splitlines()
             if line.strip() and not _LOG_LINE.match(line)]
    status = "interrupted" if code is None else ("ok" if code == 0 else f"exit code {code}")
    section = [f"## {name}: {what}", "", f"`{shown}`: {status}, {seconds:.0f} s; load average {before} before, "
               f"{_load()} after; whole output in `{log}`", "", "```text", *lines[-25:], "```", ""]
    if code is None:
        raise KeyboardInterrupt(section)
    return section


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes: minutes, not an hour")
    parser.add_argument("--only", help=f"comma-separated, of: {', '.join(BENCHES)}")
    parser.add_argument("--out", default="bench-results.md", help="the report (default: bench-results.md)")
    parser.add_argument("--list", action="store_true", help="list the benchmarks and their commands, run nothing")
    args = parser.parse_args()
    names = list(BENCHES) if not args.only else [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in BENCHES]
    if unknown:
        parser.error(f"--only: no benchmark named {', '.join(unknown)} (there are: {', '.join(BENCHES)})")
    if args.list:
        for name in names:
            script, full, small, what = BENCHES[name]
            print(f"{name:13s} python bench/{script} {' '.join(small if args.quick else full)}".rstrip()
                  + f"\n{'':13s} {what}")
        return
    out = Path(args.out)
    logs = out.with_name(out.name + ".logs")
    logs.mkdir(parents=True, exist_ok=True)
    report = [f"# dpprof benchmarks{' (--quick)' if args.quick else ''}", "", *_machine(), ""]
    try:
        for name in names:
            report += run_one(name, args.quick, logs)
            out.write_text("\n".join(report), encoding="utf-8")  # as far as it got, should a later one hang
    except KeyboardInterrupt as stop:
        report += [*(stop.args[0] if stop.args else []), "(interrupted: the benchmarks after this one did not run)"]
    out.write_text("\n".join(report) + "\n", encoding="utf-8")
    print(f"bench/all.py: the report is {out}", file=sys.stderr)


if __name__ == "__main__":
    main()

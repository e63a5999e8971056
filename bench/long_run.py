"""A long real run against a short one: its file, and how long each page and `dpprof show` take to open it.

    python bench/long_run.py [--short 3000] [--long 300000] [--reports DIR] [--repeat 3]

1. Record both runs as a user would, with the real command line (unless DIR already holds them, by name):
   ``dpprof profile tutorial-linear --devices cpu:2 --steps N --quiet`` (bounded detail, the default).
2. Print each file's size, how many step durations it holds, and how many steps kept full detail.
3. In this one process, taking turns run by run (each first every other round), --repeat times: each page of
   app.py under streamlit's AppTest with its caches emptied first, and ``dpprof show`` (the CLI's main, output
   discarded). Print
   the median seconds of each on each run and the long run's over the short run's (aim: at most 2x).

Exits 1 when the long run's file is over LONG_FILE_BUDGET_BYTES or any ratio is over RATIO_BUDGET.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import logging
import os
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dashboard import page_seconds  # this directory's bench, beside this file

ROOT = Path(__file__).resolve().parents[1]
LONG_FILE_BUDGET_BYTES = 25e6  # 300,000 steps of tutorial-linear on 2 workers in at most 25 MB
RATIO_BUDGET = 2.0  # each page of the long run within twice the short run's time
PAGES = ("overview", "load", "timeline", "compare", "export")


def _name(steps: int) -> str:
    return f"long-run bench {steps} steps"


def _find(reports: Path, steps: int) -> str | None:
    from dpprof.store.reader import list_runs

    runs = list_runs(reports)
    match = runs[(runs["name"] == _name(steps)) & (runs["status"] == "finished")]
    return None if match.empty else str(match.iloc[0]["id"])


def _record(reports: Path, steps: int) -> str:
    found = _find(reports, steps)
    if found:
        return found
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "dpprof", "--reports-dir", str(reports), "profile", "tutorial-linear",
                    "--devices", "cpu:2", "--steps", str(steps), "--name", _name(steps), "--quiet"],
                   check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    print(f"recorded {steps:,} steps in {time.perf_counter() - t0:.0f} s")
    return _find(reports, steps)


def _describe(reports: Path, run_id: str) -> str:
    from dpprof.store.reader import load_run

    run = load_run(run_id, reports)
    con = sqlite3.connect(run.path)
    try:
        durations = con.execute("SELECT COUNT(*) FROM steps").fetchone()[0]
        detailed = con.execute("SELECT COUNT(DISTINCT step) FROM phases").fetchone()[0]
    finally:
        con.close()
    size = run.path.stat().st_size
    return (f"{size / 1e6:6.2f} MB, {durations:,} step durations, {detailed:,} steps with full detail "
            f"({size / max(1, durations):.0f} bytes a step)")


def _show_seconds(reports: Path, run_id: str) -> float:
    from dpprof.cli import main

    out = io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(out):
        code = main(["--reports-dir", str(reports), "show", run_id])
    if code not in (0, 1):
        raise RuntimeError(f"dpprof show {run_id} exited {code}")
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--short", type=int, default=3_000)
    parser.add_argument("--long", type=int, default=300_000)
    parser.add_argument("--reports", default=os.path.join(tempfile.gettempdir(), "dpprof-long-run"),
                        help="where the two runs are kept (and found again by name)")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    logging.getLogger("streamlit").setLevel(logging.ERROR)  # AppTest outside a server warns on every run
    reports = Path(args.reports).absolute()
    reports.mkdir(parents=True, exist_ok=True)
    os.environ["DPPROF_REPORTS"] = str(reports)
    ids = {"short": _record(reports, args.short), "long": _record(reports, args.long)}
    for arm, run_id in ids.items():
        print(f"{arm:5s} {getattr(args, arm):>9,} steps ({run_id}): {_describe(reports, run_id)}")
    seconds: dict[tuple[str, str], list[float]] = {}
    for rep in range(args.repeat):
        for what in (*PAGES, "dpprof show"):
            # side by side, turn by turn, each arm first every other time (the first open of a page pays more)
            for arm in ("short", "long") if rep % 2 == 0 else ("long", "short"):
                other = ids["long" if arm == "short" else "short"]
                took = (_show_seconds(reports, ids[arm]) if what == "dpprof show"
                        else page_seconds(ids[arm], what, [ids[arm], other]))
                seconds.setdefault((what, arm), []).append(took)
    print(f"median of {args.repeat}, caches emptied before each (aim: long / short <= {RATIO_BUDGET:g}):")
    worst = 0.0
    for what in (*PAGES, "dpprof show"):
        short, long = (statistics.median(seconds[(what, arm)]) for arm in ("short", "long"))
        worst = max(worst, long / short)
        print(f"  {what:12s} short {short:6.2f} s   long {long:6.2f} s   {long / short:5.2f}x")
    size = Path(__import__("dpprof").load_run(ids["long"], reports).path).stat().st_size
    ok = size <= LONG_FILE_BUDGET_BYTES and worst <= RATIO_BUDGET
    print(f"long run's file {size / 1e6:.2f} MB (budget {LONG_FILE_BUDGET_BYTES / 1e6:.0f} MB); worst ratio {worst:.2f}x")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()

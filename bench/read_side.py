"""The read side's start-up cost: opening a stored run, the dashboard's first page, `dpprof show`.

    python bench/read_side.py [CHECKOUT ...] [--runs 5] [--steps 20]
    python bench/read_side.py /tmp/dpprof-base .     # before (a checkout of the base commit), after

Every figure comes from fresh processes started with PYTHONPATH (and the working directory) set to the
checkout measured; each is measured --runs times, the checkouts taking turns round by round, and the
median is printed with the range:

(a) ``import dpprof; dpprof.load_run(id)``: seconds inside the process (the import and the open, not the
    interpreter's start), its peak RSS (``ru_maxrss``), and whether torch was loaded;
(b) the dashboard: ``streamlit run app.py --server.headless true`` on a reports directory holding the run;
    seconds from starting the process until headless chromium (playwright, /usr/bin/chromium, started
    beforehand and not counted) shows the Overview's "Median step"; then the streamlit process's VmRSS
    and VmHWM (/proc/PID/status);
(c) ``python -m dpprof show ID``: wall seconds of the whole process.

The run is recorded once, by this script's checkout (``dpprof profile cifar-lenet --devices cpu:2``); the
run file's format is the same in every checkout compared. Without playwright or chromium, (b) is skipped.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's dpprof, wherever it is installed

from dpprof.processes import dashboard_server  # noqa: E402
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync"]
PAGE_TIMEOUT_S = 120

LOAD = """
import json, resource, sys, time
t0 = time.perf_counter()
import dpprof
run = dpprof.load_run(sys.argv[1], sys.argv[2])
seconds = time.perf_counter() - t0
print(json.dumps({"seconds": seconds, "maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "torch": "torch" in sys.modules, "steps": len(run.steps)}))
"""


def _env(checkout: Path, reports: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(checkout), "DPPROF_REPORTS": str(reports)}


def record_run(reports: Path, steps: int) -> str:
    """Record one run with this script's checkout; returns its id."""
    out = subprocess.run([sys.executable, "-m", "dpprof", "--reports-dir", str(reports), "profile", "cifar-lenet",
                          "--devices", "cpu:2", "--steps", str(steps), "--quiet"], cwd=ROOT,
                         env={**_env(ROOT, reports), "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                         check=True)
    return re.search(r"recorded run (\S+)", out.stdout).group(1)


def load_run(checkout: Path, reports: Path, run_id: str) -> dict:
    """(a): one fresh process importing dpprof and opening the run."""
    out = subprocess.run([sys.executable, "-c", LOAD, run_id, str(reports)], cwd=checkout,
                         env=_env(checkout, reports), capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def show(checkout: Path, reports: Path, run_id: str) -> dict:
    """(c): `dpprof show ID`, the whole process timed from outside."""
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "dpprof", "show", run_id], cwd=checkout, env=_env(checkout, reports),
                   stdout=subprocess.DEVNULL, check=True)
    return {"seconds": time.perf_counter() - t0}


def _status_mib(pid: int) -> dict[str, float]:
    values = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            values[key] = int(rest.split()[0]) / 1024  # kB
    return {"rss_mib": values["VmRSS"], "hwm_mib": values["VmHWM"]}


def dashboard(checkout: Path, reports: Path, browser: object, log: Path) -> dict:
    """(b): start streamlit, open its address in a fresh browser context, wait for the Overview's "Median step"."""
    t0 = time.perf_counter()
    with dashboard_server(checkout / "app.py", reports, log, env={"PYTHONPATH": str(checkout)},
                          start_timeout_s=PAGE_TIMEOUT_S) as served:
        context = browser.new_context(viewport={"width": 1400, "height": 1000})
        page = context.new_page()
        page.set_default_timeout(PAGE_TIMEOUT_S * 1000)
        page.goto(served.url)
        page.get_by_text("Median step", exact=True).first.wait_for()
        seconds = time.perf_counter() - t0
        figures = {"seconds": seconds, **_status_mib(served.pid)}
        context.close()
        return figures


def _launch_browser():
    """A headless chromium through playwright, or None (with the reason printed) when either is missing."""
    if not Path(CHROMIUM).exists():
        print(f"(b) skipped: {CHROMIUM} is missing")
        return None, None
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        print("(b) skipped: playwright is missing (pip install playwright)")
        return None, None
    manager = sync_playwright().start()
    return manager, manager.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)


def _summary(values: list[float], unit: str, digits: int) -> str:
    return (f"{statistics.median(values):.{digits}f} {unit} "
            f"({min(values):.{digits}f}-{max(values):.{digits}f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkouts", nargs="*", type=Path, default=[ROOT],
                        help="checkouts to measure (default: this one); two are printed as before, after")
    parser.add_argument("--runs", type=int, default=5, help="measurements of each figure per checkout (default: 5)")
    parser.add_argument("--steps", type=int, default=20, help="steps of the recorded run (default: 20)")
    args = parser.parse_args()
    checkouts = [c.resolve() for c in args.checkouts]
    with tempfile.TemporaryDirectory(prefix="dpprof-read-side-") as tmp:
        reports = Path(tmp) / "reports"
        run_id = record_run(reports, args.steps)
        print(f"run {run_id} ({args.steps} steps of cifar-lenet on 2 CPU workers); {args.runs} runs each, "
              f"median (min-max)")
        manager, browser = _launch_browser()
        results: dict[Path, dict[str, list[dict]]] = {c: {"load": [], "dashboard": [], "show": []} for c in checkouts}
        try:
            for i in range(args.runs):
                order = checkouts if i % 2 == 0 else checkouts[::-1]  # neither checkout always goes first
                for checkout in order:
                    results[checkout]["load"].append(load_run(checkout, reports, run_id))
                    results[checkout]["show"].append(show(checkout, reports, run_id))
                    if browser is not None:
                        results[checkout]["dashboard"].append(
                            dashboard(checkout, reports, browser, Path(tmp) / "streamlit.log"))
        finally:
            if browser is not None:
                browser.close()
                manager.stop()
    for label, checkout in zip(["before", "after"] if len(checkouts) == 2 else [""] * len(checkouts), checkouts):
        r = results[checkout]
        print(f"\n{label + ': ' if label else ''}{checkout}")
        load = r["load"]
        print(f"  (a) import dpprof + load_run: {_summary([x['seconds'] for x in load], 's', 2)}, "
              f"peak RSS {_summary([x['maxrss_mib'] for x in load], 'MiB', 0)}, "
              f"torch loaded: {sorted({x['torch'] for x in load})}")
        if r["dashboard"]:
            d = r["dashboard"]
            print(f"  (b) dashboard, start to Overview shown: {_summary([x['seconds'] for x in d], 's', 2)}, "
                  f"streamlit VmRSS {_summary([x['rss_mib'] for x in d], 'MiB', 0)}, "
                  f"VmHWM {_summary([x['hwm_mib'] for x in d], 'MiB', 0)}")
        print(f"  (c) dpprof show: {_summary([x['seconds'] for x in r['show']], 's', 2)}")


if __name__ == "__main__":
    main()

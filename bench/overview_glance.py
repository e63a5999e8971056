"""What the per-device first glance adds to opening the Overview of a large run (8 devices x 50,000 steps).

    python bench/overview_glance.py [--devices 8] [--steps 50000] [--blocks 5]

Two arms, interleaved in each block on the same synthesised run (bench/dashboard.py's records), no cache:
"before" builds what the Overview drew without the glance (run stats, phase totals, step times, phase
breakdown, findings and their figures); "after" is dpprof.views.overview with the glance and its figure too.
Prints each block's seconds and ratio, and the means over blocks; exits 1 when "after" reaches the
2 s page budget.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dashboard import PAGE_BUDGET_S, synthesise  # noqa: E402

from dpprof import charts  # noqa: E402
from dpprof.findings import run_findings  # noqa: E402
from dpprof.views import overview  # noqa: E402
from dpprof.store import queries  # noqa: E402
from dpprof.store.reader import load_run  # noqa: E402


def before(path: str) -> None:
    run = load_run(path)
    stats = queries.run_stats(run)
    totals = queries.phase_totals(run, stats)
    run_findings(run)
    charts.step_times(queries.step_times(run))
    charts.phase_breakdown(queries.phase_breakdown(run))
    charts.phase_shares(totals)


def after(path: str) -> None:
    data = overview.overview(load_run(path))
    g = data.glance
    charts.device_glance(g.devices, g.work_phase, g.memory_source, *g.marked())
    charts.step_times(data.steps)
    charts.phase_breakdown(data.breakdown)
    charts.phase_shares(data.totals)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--steps", type=int, default=50_000)
    parser.add_argument("--blocks", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "bench.sqlite")
        synthesise(path, args.devices, args.steps)
        rows = []
        for block in range(args.blocks):
            times = {}
            for name, arm in (("before", before), ("after", after)) if block % 2 == 0 else (("after", after),
                                                                                           ("before", before)):
                t = time.perf_counter()
                arm(path)
                times[name] = time.perf_counter() - t
            rows.append(times)
            print(f"block {block}: before {times['before']:.2f} s, after {times['after']:.2f} s, "
                  f"ratio {times['after'] / times['before']:.2f}", flush=True)
    b, a = statistics.mean(r["before"] for r in rows), statistics.mean(r["after"] for r in rows)
    ratio = statistics.median(r["after"] / r["before"] for r in rows)
    print(f"mean over blocks: before {b:.2f} s, after {a:.2f} s (+{a - b:.2f} s); median ratio {ratio:.2f}")
    sys.exit(1 if a >= PAGE_BUDGET_S else 0)


if __name__ == "__main__":
    main()

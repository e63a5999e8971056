"""The dashboard's pages on the run of a large imported trace: how long each takes to open, the operator, kernel and
memory pages included (issue 33's aim: each under 1 s on the run of a 1 GiB trace).

    python bench/trace_pages.py [--size-mb 1024] [--repeat 3] [--keep DIR] [--source ddp-2ranks|resnet50]

1. Make a trace as bench/trace_import.py makes its own (the steps of a shared trace repeated with shifted
   timestamps, about --size-mb MB of plain JSON; in --keep DIR, reused when there) and import it with
   ``dpprof.trace.import_traces`` (the default jobs) into a reports directory of its own. The source:
   ../shared/traces/ddp-2ranks-rank0-nccl.json.gz (DDP on NCCL: operators, kernels, collectives; no [memory] events),
   or the ResNet-50 sample (one GPU, with [memory] events: the memory page's curve and events).
2. --repeat times, each page of app.py under streamlit's AppTest, its caches emptied first: the run chosen, the
   page opened, and the seconds of that page's run. Print each page's median and slowest.

Exits 1 when a page's median is over PAGE_BUDGET_S or a page raised.
"""
from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from dashboard import page_seconds  # noqa: E402  (this directory's benches, beside this file)
from trace_import import make_traces  # noqa: E402

SOURCES = {"ddp-2ranks": "ddp-2ranks-rank0-nccl.json.gz", "resnet50": "resnet50-1gpu-tb-sample.pt.trace.json.gz"}

PAGE_BUDGET_S = 1.0
PAGES = ("overview", "load", "timeline", "operators", "kernels", "memory", "devices", "export")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=float, default=1024)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--keep", default=None, help="make the trace here and keep it (reused when there)")
    parser.add_argument("--source", choices=sorted(SOURCES), default="ddp-2ranks")
    args = parser.parse_args()
    logging.getLogger("streamlit").setLevel(logging.ERROR)  # AppTest outside a server warns on every run
    with tempfile.TemporaryDirectory(prefix="dpprof-trace-pages-") as tmp:
        where = Path(args.keep or tmp)
        where.mkdir(parents=True, exist_ok=True)
        prefix = "big" if args.source == "ddp-2ranks" else args.source  # "big": bench/trace_import.py's file
        trace = where / f"{prefix}-{args.size_mb:.0f}mb.pt.trace.json"
        if not trace.exists():
            make_traces(ROOT.parent / "shared" / "traces" / SOURCES[args.source], [(trace, None)], args.size_mb)
        reports = Path(tmp) / "reports"
        os.environ["DPPROF_REPORTS"] = str(reports)
        import dpprof.trace

        t0 = time.perf_counter()
        run = dpprof.trace.import_traces([trace], reports)
        print(f"{trace.name}: {trace.stat().st_size / 2**20:,.0f} MiB imported in {time.perf_counter() - t0:.1f} s "
              f"({run.steps} steps, devices {', '.join(run.devices)}); run file "
              f"{sum(p.stat().st_size for p in run.paths) / 1e6:.1f} MB")
        seconds: dict[str, list[float]] = {page: [] for page in PAGES}
        failed = []
        for _ in range(args.repeat):
            for page in PAGES:
                try:
                    seconds[page].append(page_seconds(run.id, page))
                except RuntimeError as err:
                    failed.append(str(err))
        print(f"each page opened {args.repeat} times, caches emptied before each (aim: under {PAGE_BUDGET_S:g} s):")
        over = []
        for page, took in seconds.items():
            if not took:
                continue
            median = statistics.median(took)
            if median > PAGE_BUDGET_S:
                over.append(page)
            print(f"  {page:10s} median {median:5.2f} s, slowest {max(took):5.2f} s")
        print(f"load average at the end: {', '.join(f'{x:.1f}' for x in os.getloadavg())}")
        for line in failed:
            print(f"FAILED {line}")
        if over:
            print(f"over {PAGE_BUDGET_S:g} s: {', '.join(over)}")
        return 1 if failed or over else 0


if __name__ == "__main__":
    sys.exit(main())

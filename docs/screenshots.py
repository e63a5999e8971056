"""Remake the dashboard's pictures in docs/img/ from runs this script records.

Records a few short runs with the CPU backend into a temporary reports directory (``dpprof profile ...
--devices cpu:2``, as a user would), calibrates the advisor there, starts ``streamlit run app.py`` headless on a
free loopback port reading them, and saves a PNG of each dashboard page with Debian's chromium driven by
playwright (the same browser tests/test_browser.py uses). Nothing outside the temporary directory and
docs/img/ is touched: your own reports/ and ~/.cache stay as they are.

The Operators, Kernels and Memory pages show the shared ResNet-50 trace (../shared/traces), imported with
``dpprof import``: a recorded run holds operators only from a deep capture.

Usage, from the checkout after set-up (about two minutes on two cores)::

    .venv/bin/python docs/screenshots.py            # [--out docs/img] [--steps 40] [--only operators.png,...]
"""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from playwright.sync_api import ViewportSize

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's dpprof, wherever it is installed

from dpprof.processes import DashboardError, dashboard_server  # noqa: E402

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
VIEWPORT: ViewportSize = {"width": 1280, "height": 900}
MAX_PNG_BYTES = 300 * 1024  # the docs' pictures are committed: each stays under 300 KB
SETTLE_S = 2.5  # plotly draws after streamlit's script ends; this is what its charts took here, with margin
TIMEOUT_MS = 60_000
# One intra-op thread for the runs, the calibration and the dashboard (which reads the calibration kept for this
# thread count): on a small shared machine an OpenMP team of 2 runs 10 to 30 times slower whenever another job holds
# a core (docs/advisor.md), and the Advisor then rightly refuses to predict from a calibration measured under load.
ENV = {"OMP_NUM_THREADS": "1"}

TRACE = ROOT.parent / "shared" / "traces" / "resnet50-1gpu-tb-sample.pt.trace.json.gz"
TRACE_PAGES = {"operators.png", "kernels.png", "memory.png"}  # these show the imported trace
# (file name, address path, text that shows the page has drawn its content)
PAGES = [
    ("runs.png", "runs", "Runs"),
    ("overview.png", "overview", "Step time"),
    ("load.png", "load", "Apply time per device"),
    ("timeline.png", "timeline", None),
    ("advisor.png", "advise", None),
    ("export.png", "export", "Download"),
    ("compare.png", "compare", None),
    ("devices.png", "devices", None),
    ("new_run.png", "new-run", None),
    ("operators.png", "operators", "Modules"),
    ("kernels.png", "kernels", "Kernels"),
    ("memory.png", "memory", "Memory events"),
]


def _dpprof(reports: Path, cache: Path, *args: str) -> None:
    """Run ``python -m dpprof ARGS`` against ``reports``, as a user would; stop on failure with its output."""
    env = {**os.environ, **ENV, "DPPROF_REPORTS": str(reports), "XDG_CACHE_HOME": str(cache)}
    done = subprocess.run([sys.executable, "-m", "dpprof", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          check=False)
    if done.returncode not in (0, 1):  # 1: findings, which a screenshot wants
        sys.exit(f"dpprof {' '.join(args)} failed ({done.returncode}):\n{done.stdout}{done.stderr}")


def _run_id(reports: Path, name: str) -> str:
    """The id of the run named ``name`` in ``reports`` (read from the store, not from printed text)."""
    import dpprof

    runs = dpprof.list_runs(reports)
    ids = runs.loc[runs["name"] == name, "id"].tolist()
    if len(ids) != 1:
        sys.exit(f"expected one run named {name!r} in {reports}, found {len(ids)}")
    return str(ids[0])


def record_runs(reports: Path, cache: Path, steps: int) -> str:
    """Record the runs the pictures show; return the id of the run the run pages open on."""
    _dpprof(reports, cache, "profile", "seg-fcn", "--devices", "cpu:3", "--steps", str(steps),
            "--name", "seg-fcn on 3 workers", "--quiet")
    _dpprof(reports, cache, "profile", "sorted-gru", "--devices", "cpu:2", "--steps", str(steps),
            "--name", "sorted-gru on 2 workers", "--quiet")
    _dpprof(reports, cache, "profile", "seg-fcn", "--devices", "cpu:2", "--steps", str(steps),
            "--name", "seg-fcn on 2 workers", "--quiet")
    shown = _run_id(reports, "seg-fcn on 2 workers")
    _dpprof(reports, cache, "advise", shown)  # calibrates this machine once (cached in the temporary cache)
    return shown


@contextlib.contextmanager
def streamlit(reports: Path, cache: Path, log: Path) -> Iterator[str]:
    """``streamlit run app.py`` headless on a free loopback port reading ``reports``; yields its address."""
    try:
        with dashboard_server(ROOT / "app.py", reports, log, env={**ENV, "XDG_CACHE_HOME": str(cache)}) as served:
            yield served.url
    except DashboardError as err:
        sys.exit(str(err))


def _settle(page) -> None:
    """Wait until streamlit has finished running the page's script, then for plotly to draw."""
    page.wait_for_selector('[data-testid="stMain"]', timeout=TIMEOUT_MS)
    deadline = time.monotonic() + TIMEOUT_MS / 1000
    quiet_since = None
    while time.monotonic() < deadline:
        # the script still runs (the status widget), or the page still shows its loading skeleton (a new session)
        running = page.locator('[data-testid="stStatusWidget"], [data-testid="stSkeleton"]').count() > 0
        if running:
            quiet_since = None
        elif quiet_since is None:
            quiet_since = time.monotonic()
        elif time.monotonic() - quiet_since > 1.0:
            break
        time.sleep(0.2)
    time.sleep(SETTLE_S)


def _small_png(data: bytes) -> bytes:
    """The PNG as it is when under MAX_PNG_BYTES, else quantised to 256 colours (Pillow comes with streamlit)."""
    if len(data) <= MAX_PNG_BYTES:
        return data
    from PIL import Image

    img = Image.open(io.BytesIO(data)).convert("RGB").quantize(colors=256)
    out = io.BytesIO()
    img.save(out, format="PNG", optimize=True)
    if out.tell() > MAX_PNG_BYTES:
        sys.exit(f"a screenshot stays at {out.tell():,} bytes after quantising: over {MAX_PNG_BYTES:,}")
    return out.getvalue()


def import_trace(reports: Path, cache: Path) -> str:
    """Import the shared ResNet-50 trace (operators, kernels, memory over time); return its run's id."""
    _dpprof(reports, cache, "import", str(TRACE), "--name", "ResNet-50 trace")
    return _run_id(reports, "ResNet-50 trace")


def shoot(base: str, run_id: str, out: Path, trace_id: str | None = None,
          only: set[str] | None = None) -> list[Path]:
    """Save one PNG per dashboard page into ``out`` (``only``: these files; the trace pages show ``trace_id``)."""
    from playwright.sync_api import sync_playwright

    out.mkdir(parents=True, exist_ok=True)
    saved = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport=VIEWPORT)
        page.set_default_timeout(TIMEOUT_MS)
        for name, path, marker in PAGES:
            if only is not None and name not in only:
                continue
            page.goto(f"{base}/{path}?run={trace_id if name in TRACE_PAGES else run_id}")
            if marker:
                page.get_by_text(marker, exact=True).first.wait_for()
            _settle(page)
            target = out / name
            target.write_bytes(_small_png(page.screenshot()))
            saved.append(target)
            print(f"{target.relative_to(ROOT) if target.is_relative_to(ROOT) else target}: "
                  f"{target.stat().st_size / 1024:.0f} KB")
        browser.close()
    return saved


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "img", help="where the PNGs go (default: docs/img)")
    parser.add_argument("--steps", type=int, default=40, help="steps per recorded run (default: 40)")
    parser.add_argument("--only", default=None, help="comma-separated file names of the pictures to make (default: all)")
    args = parser.parse_args(argv)
    only = set(args.only.split(",")) if args.only else None
    if not Path(CHROMIUM).exists():
        sys.exit(f"{CHROMIUM} is missing: apt-get install chromium")
    with tempfile.TemporaryDirectory(prefix="dpprof-screenshots-") as tmp:
        reports, cache = Path(tmp) / "reports", Path(tmp) / "cache"
        reports.mkdir()
        trace_id = import_trace(reports, cache)
        run_id = record_runs(reports, cache, args.steps) if only is None or only - TRACE_PAGES else trace_id
        with streamlit(reports, cache, Path(tmp) / "streamlit.log") as base:
            shoot(base, run_id, args.out.resolve(), trace_id, only)
    return 0


if __name__ == "__main__":
    sys.exit(main())

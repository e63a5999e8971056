"""The dashboard in a real browser: Debian's chromium, driven by playwright, against `streamlit run app.py`.

Opens a recorded run, switches runs and pages, and downloads a CSV whose content it checks against the run;
on an empty reports directory, presses the demo button a second time while its run goes.
Skips only when /usr/bin/chromium or the playwright package is missing (.ci/run installs both).
"""
from __future__ import annotations

import contextlib
import io
import re
import os
import signal
import time
from pathlib import Path

import pandas as pd
import pytest

from recorded import record

from dpprof.processes import dashboard_server

CHROMIUM = "/usr/bin/chromium"
ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_MS = 30_000

if not Path(CHROMIUM).exists():
    pytest.skip(f"{CHROMIUM} is missing (apt-get install chromium)", allow_module_level=True)
playwright = pytest.importorskip("playwright.sync_api", reason="playwright is missing (pip install playwright)")
PlaywrightTimeoutError = playwright.TimeoutError

pytestmark = pytest.mark.slow


@contextlib.contextmanager
def _streamlit(reports: Path):
    """`streamlit run app.py` on a free loopback port reading ``reports`` (processes.dashboard_server); yields its
    address."""
    with dashboard_server(ROOT / "app.py", reports, reports.parent / "streamlit.log") as served:
        yield served.url


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """Two recorded runs, and `streamlit run app.py` on a free loopback port reading them."""
    reports = tmp_path_factory.mktemp("reports")
    first = record(reports, "=first", workers=2, steps=5, batch_size=32)
    second = record(reports, "second", workers=3, steps=6, batch_size=33)
    with _streamlit(reports) as base:
        yield {"base": base, "first": first, "second": second}


@pytest.fixture(scope="module")
def browser():
    with playwright.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True,
                              args=["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                                    "--disable-component-update", "--disable-sync"])
        yield b
        b.close()


def _heading(page, text: str) -> None:
    page.get_by_role("heading", name=text, exact=True).first.wait_for(timeout=TIMEOUT_MS)


SETTLED_MS = 400  # the main area unchanged this long after the script's run ended: its last elements are drawn
# True once the main area's HTML has stayed the same for SETTLED_MS (polled; the state lives on the page, so a new
# page load starts it afresh)
_SETTLED_JS = """ms => {
    const main = document.querySelector('[data-testid="stMain"]');
    const html = main ? main.innerHTML : '';
    const now = performance.now();
    if (window.__dpprofLastHtml !== html) { window.__dpprofLastHtml = html; window.__dpprofSince = now; return false; }
    return now - window.__dpprofSince >= ms;
}"""


def _drawn(page) -> None:
    """Wait until Streamlit's script run is over (its status widget gone) and the main area has stopped changing:
    the page's last elements and charts are drawn (a condition, instead of a fixed wait)."""
    page.wait_for_function("() => !document.querySelector('[data-testid=\"stStatusWidget\"]')")
    page.wait_for_function(_SETTLED_JS, arg=SETTLED_MS, polling=100)


def test_open_a_run_switch_pages_and_download_a_csv(server, browser):
    first = server["first"]
    page = browser.new_page(accept_downloads=True, viewport={"width": 1400, "height": 1000})
    page.set_default_timeout(TIMEOUT_MS)
    page.goto(server["base"])
    _heading(page, "second")  # the dashboard opens on the newest run
    page.get_by_text("Step time", exact=True).first.wait_for()

    # open the other run from the sidebar's listing
    page.locator('[data-testid="stSidebar"] [data-testid="stSelectbox"]').click()
    page.get_by_role("option", name=f"=first · {first.id[-6:]} · finished").click()
    _heading(page, "=first")
    assert page.url.endswith(f"run={first.id}")

    # switch pages: each shows this run
    for title, heading in (("Per-GPU load", "Apply time per device"), ("Timeline", "=first"),
                           ("Runs", "Runs"), ("Export", "Download")):
        page.locator('[data-testid="stSidebarNav"]').get_by_role("link", name=title, exact=True).click()
        _heading(page, heading)
        if title == "Per-GPU load":
            page.get_by_text("This run used CPU workers: there are no GPUs to sample.").wait_for()

    # download the steps table and check it is the run's
    with page.expect_download() as info:
        page.get_by_role("button", name="⬇ steps.csv").click()
    download = info.value
    assert download.suggested_filename == f"{first.id}-steps.csv"
    steps = pd.read_csv(download.path())
    pd.testing.assert_frame_equal(steps, first.steps, check_dtype=False)
    with page.expect_download() as info:
        page.get_by_role("button", name="⬇ run.csv").click()
    meta = pd.read_csv(io.BytesIO(Path(info.value.path()).read_bytes()))
    assert meta.loc[0, "id"] == first.id and meta.loc[0, "name"] == "'=first"  # neutralised for spreadsheets
    page.close()


def _shot(page, tmp_path, name: str) -> Path:
    """A screenshot, also kept under $DPPROF_SCREENSHOTS when set (to look at what a user sees)."""
    path = tmp_path / f"{name}.png"
    page.screenshot(path=str(path))
    keep = os.environ.get("DPPROF_SCREENSHOTS")
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        (Path(keep) / path.name).write_bytes(path.read_bytes())
    return path


def test_the_first_screen_shows_each_device_and_the_worst_one(server, browser, tmp_path):
    from dpprof.report import summary_of
    from dpprof.views.overview import glance

    second = server["second"]
    summary = summary_of(second)
    seen = glance(second)  # the slowest device is named as such only where what it costs clears the floors
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.set_default_timeout(TIMEOUT_MS)
    page.goto(server["base"])
    _heading(page, "second")
    if seen.time_uneven:
        metric = page.locator('[data-testid="stMetric"]').filter(has_text="Slowest device").first
        metric.wait_for()
        assert seen.slowest in metric.inner_text()
    else:
        metric = page.locator('[data-testid="stMetric"]').filter(has_text="Median step").first
        page.get_by_text("No straggler: the slowest device").first.wait_for()
    chart = page.locator('[data-testid="stPlotlyChart"]').first
    chart.locator(".main-svg").first.wait_for()
    page.get_by_text("apply per step (ms, median)").first.wait_for()
    page.wait_for_timeout(500)  # let plotly finish its layout
    _shot(page, tmp_path, "first-screen")
    for element in (metric, chart):  # above the fold, without scrolling
        box = element.bounding_box()
        assert box is not None and box["y"] >= 0 and box["y"] + box["height"] <= 1000, box
    for device in summary.index:  # every device is on the first screen's chart
        assert chart.get_by_text(device, exact=False).count() >= 1, device
    page.close()


def test_new_run_starts_only_from_start_and_stops(server, browser, tmp_path):
    import dpprof

    reports = Path(server["first"].path).parent
    before = set(dpprof.list_runs(reports)["id"])
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.set_default_timeout(TIMEOUT_MS)
    page.goto(f"{server['base']}/new-run")
    _heading(page, "New run")
    page.locator('[data-testid="stSelectbox"]').filter(has_text="Workload").click()
    page.get_by_role("option", name="tutorial-linear").click()
    steps = page.get_by_label("Steps", exact=True)  # not the capture field's "Capture steps A:B"
    steps.fill("10000000")  # the page's most: the run must still be going when Stop is clicked
    steps.press("Enter")  # Enter in a field: no run starts
    name = page.get_by_label("Name (optional)")
    name.fill("from the browser")
    name.press("Enter")
    page.wait_for_timeout(2_000)
    assert set(dpprof.list_runs(reports)["id"]) == before and page.get_by_text("is running").count() == 0
    main = page.locator('[data-testid="stMain"]')  # not the header's own Stop button (a script still running)
    main.get_by_role("button", name="Start", exact=True).click()
    # a click that lands while Streamlit reruns after the Enter above can be lost: if no run has
    # appeared after 30 s, click once more (Start is disabled while a run started here is going, so
    # this cannot start a second one; the one-run assertion below still holds)
    deadline = time.monotonic() + 30
    while set(dpprof.list_runs(reports)["id"]) == before and time.monotonic() < deadline:
        time.sleep(0.5)
    if set(dpprof.list_runs(reports)["id"]) == before:
        main.get_by_role("button", name="Start", exact=True).click()
    progress = page.get_by_text(re.compile(r"step [\d,]+ of 10,000,000 · [\d.]+ steps/s")).first
    try:
        progress.wait_for(timeout=120_000)
    except PlaywrightTimeoutError:
        raise AssertionError(f"no progress line after Start; the page reads:\n{main.inner_text()[:3000]}") from None
    start = main.get_by_role("button", name="Start", exact=True)
    assert start.is_disabled()  # while it runs, a second start needs the confirmation below
    page.get_by_text(re.compile(r"Start another run while 1 started here is still running")).wait_for()
    _shot(page, tmp_path, "new-run-progress")
    main.get_by_role("button", name="Stop", exact=True).click()
    page.get_by_text(re.compile(r"was stopped \(SIGTERM")).first.wait_for(timeout=60_000)
    runs = dpprof.list_runs(reports)
    new = runs[~runs["id"].isin(before)]
    assert new["name"].tolist() == ["from the browser"]  # one run, from the one click
    assert new["status"].iloc[0] != "running" and new["steps"].iloc[0] >= 1  # ended, its steps kept
    page.close()


def test_the_demo_button_starts_one_run_when_pressed_again(browser, tmp_path):
    import dpprof

    reports = tmp_path / "reports"
    reports.mkdir()
    with _streamlit(reports) as base:
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.set_default_timeout(TIMEOUT_MS)
        page.goto(base)
        _heading(page, "No runs yet")
        demo = page.get_by_role("button", name="Record a demo run on 2 CPU workers")
        demo.click()
        page.get_by_text(re.compile(r"Process \d+ is running")).first.wait_for()
        demo.click(force=True)  # the second press of an impatient user, while the first run goes
        page.wait_for_timeout(2_000)
        try:
            assert demo.is_disabled()
            assert len(list((reports / ".logs").glob("*.log"))) == 1  # one start_run, one process
        finally:
            main = page.locator('[data-testid="stMain"]')
            for stop in main.get_by_role("button", name="Stop", exact=True).all():
                stop.click()  # the demo's own process: never left running after the test
            page.get_by_text(re.compile(r"Process \d+ (was stopped|finished)")).first.wait_for(timeout=60_000)
            for path in dpprof.list_runs(reports).query("status == 'running'")["path"]:  # one with no Stop button
                os.kill(dpprof.load_run(path).meta["pid"], signal.SIGTERM)
        page.close()


# Names with markdown, HTML and images pointing at an unroutable address (TEST-NET-2): a run's name, and a trace
# file's name (the name of the run imported from it, and of a file listed for import).
BEACON = "198.51.100.7"
HOSTILE_NAME = (f"**x** [y](javascript:alert(1)) beacon ![t](http://{BEACON}/p.png?who=viewer) "
                f"<img src=http://{BEACON}/i.png> :red[z] www.example.com")
HOSTILE_TRACE = f"beacon ![t](https:{BEACON}?who=trace) **x** [y](https:{BEACON}).json.gz"
RUN_PAGES = ("overview", "load", "timeline", "advise", "export", "compare")


@pytest.fixture(scope="module")
def hostile_server(tmp_path_factory):
    """Two runs named with markdown and HTML, a run imported from a trace file so named, and another such file
    waiting to be imported; `streamlit run app.py` reading them."""
    import shutil

    import dpprof
    from dpprof.trace import import_traces

    reports = tmp_path_factory.mktemp("hostile-reports")
    shared = ROOT.parent / "shared" / "traces"
    first = record(reports, HOSTILE_NAME, workers=2, steps=4, batch_size=16, workload="tutorial-linear")
    second = record(reports, HOSTILE_NAME + " 2", workers=3, steps=4, batch_size=16, workload="tutorial-linear")
    staged = tmp_path_factory.mktemp("traces") / HOSTILE_TRACE
    shutil.copyfile(shared / "ddp-128ranks-rank0-sampled.json.gz", staged)
    imported = import_traces([staged], reports)
    shutil.copyfile(shared / "ddp-128ranks-rank1-sampled.json.gz", reports / ("pending " + HOSTILE_TRACE))
    listed = dpprof.list_runs(reports).set_index("id")["name"]
    with _streamlit(reports) as base:
        yield {"base": base, "runs": [first.id, second.id, imported.id], "names": listed.to_dict()}


def test_names_with_markdown_and_images_fetch_nothing_and_make_no_element(hostile_server, browser, tmp_path):
    base, names = hostile_server["base"], hostile_server["names"]
    assert names[hostile_server["runs"][2]].startswith("beacon ![t](https:")  # the trace file's name, as the run's
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.set_default_timeout(TIMEOUT_MS)
    requested: list[str] = []
    page.on("request", lambda r: requested.append(r.url))
    visited = 0
    for run_id in hostile_server["runs"]:
        for path in RUN_PAGES:
            page.goto(f"{base}/{path}?run={run_id}")
            main = page.locator('[data-testid="stMain"]')
            if path != "compare":
                title = main.locator("h1").first
                title.wait_for()
                _drawn(page)
                assert title.inner_text().replace("\u2060", "").strip() == names[run_id], (path, title.inner_text())
            else:
                _heading(page, "Compare runs")
            page.locator('[data-testid="stMarkdownContainer"]').first.wait_for()
            _drawn(page)  # the page's last elements and charts drawn
            _no_element_from_a_name(page, path)
            visited += 1
    page.locator('[data-testid="stSidebar"] [data-testid="stSelectbox"]').click()  # the picker's options open
    page.get_by_role("option").first.wait_for()
    options = page.get_by_role("option").all_inner_texts()
    assert any(o.startswith(HOSTILE_NAME) for o in options), options  # each run's label, as text
    _no_element_from_a_name(page, "run picker")
    page.keyboard.press("Escape")
    page.goto(f"{base}/runs")
    _heading(page, "Runs")
    page.get_by_text("torch.profiler traces to import").wait_for()
    _drawn(page)
    _no_element_from_a_name(page, "runs")
    _shot(page, tmp_path, "hostile-names-runs")
    page.close()
    assert visited == len(RUN_PAGES) * 3
    assert not [u for u in requested if BEACON in u or "example.com" in u], requested


def _no_element_from_a_name(page, where: str) -> None:
    """No link, image or bold text on the page came from a name: none points at the beacon or javascript:, none
    is the name's [y] or **x**, and no image at all is on the page but the app's own."""
    links = page.eval_on_selector_all("a", "els => els.map(e => [e.getAttribute('href') || '', e.innerText])")
    assert not [l for l in links if BEACON in l[0] or l[0].startswith("javascript") or l[1].strip() == "y"], (where, links)
    images = page.eval_on_selector_all("img", "els => els.map(e => e.getAttribute('src') || '')")
    assert not [s for s in images if BEACON in s], (where, images)
    bold = page.eval_on_selector_all("strong, b", "els => els.map(e => e.innerText.trim())")
    assert "x" not in bold and "z" not in bold, (where, bold)
    colored = page.eval_on_selector_all("[data-testid='stMarkdownContainer'] span[style*='color']",
                                        "els => els.map(e => e.innerText.trim())")
    assert "z" not in colored, (where, colored)


@pytest.fixture(scope="module")
def trace_server(tmp_path_factory):
    """The shared ResNet-50 trace imported (operators, kernels, memory over time); `streamlit run app.py` on it."""
    from dpprof.trace import import_traces

    import dpprof
    from dpprof.workloads import build_workload, train

    reports = tmp_path_factory.mktemp("trace-reports")
    imported = import_traces([ROOT.parent / "shared" / "traces" / "resnet50-1gpu-tb-sample.pt.trace.json.gz"],
                             reports, name="resnet", jobs=1)
    captured = train(build_workload("cifar-lenet", 32), dpprof.cpu_devices(2), 5, name="captured",
                     reports_dir=str(reports), capture="2:4")
    with _streamlit(reports) as base:
        yield {"base": base, "id": imported.id, "captured": captured.id}


def test_operators_kernels_and_memory_pages_open_on_an_imported_trace_and_a_captured_run(trace_server, browser):
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.set_default_timeout(TIMEOUT_MS)
    for run, title, path, text, chart in (
            ("id", "resnet", "operators", "Top 15 operators by device self time", True),
            ("id", "resnet", "kernels", "What these figures mean", True),
            ("id", "resnet", "memory", "peaks at", True),
            ("captured", "captured", "operators", "Top 15 operators by host self time", True),
            ("captured", "captured", "kernels", "No GPU kernels in this run", False),
            ("captured", "captured", "memory", "No memory over time", False)):
        page.goto(f"{trace_server['base']}/{path}?run={trace_server[run]}")
        _heading(page, title)
        page.get_by_text(text).first.wait_for()
        if chart:
            page.locator('[data-testid="stPlotlyChart"]').first.wait_for()
        else:
            assert not page.locator('[data-testid="stPlotlyChart"]').count(), (run, path)
        assert not page.locator('[data-testid="stException"]').count(), (run, path)
    page.close()

"""What every page shares: the run listing, the chosen run, caching, live refresh, and starting runs.

Streamlit only. A run is chosen from the listing of the reports directory, by id, never from a
path the browser sends. Cached results are keyed by the run file's path and its modification
time (and its write-ahead log's, so a running run is re-read as it grows).
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd
import streamlit as st

from dpprof.capture import MAX_CAPTURE_STEPS, CaptureError
from dpprof.capture.request import answer_to, ask
from dpprof.csvfile import to_csv_bytes
from dpprof.launch import Profile, ProfileError
from dpprof.processes import Started, run_row
from dpprof.processes import progress_line as processes_progress_line
from dpprof import views
from dpprof.plaintext import markdown_code, markdown_text, markdown_words
from dpprof.views import export
from dpprof.views import opdiff
from dpprof.views.opdiff import Pick
from dpprof.views.text import display_table, dropped_records, finding_heading, run_label, status_sentence
from dpprof.store import detail_rows
from dpprof.store.faults import RecordingError
from dpprof.store.files import dir_signature, run_signature
from dpprof.store.reader import LISTING_COLUMNS, RunFileError, StoredRun, list_runs, load_run, reports_dir
from dpprof.store.staging import check_reports_dir
from dpprof.trace.importer import LEGACY_WORKLOAD
from dpprof.units import plural

REFRESH_S = 2.0  # a running run's pages re-read it this often (its writer commits every 0.5 s)
LISTING_TTL_S = 5.0  # "running" turns "incomplete" by time alone (heartbeat age), not by file changes
RUN_KEY = "chosen_run"  # session state: the chosen run's id (no widget has this key)
COMPARE_KEY = "compare_ids"  # session state: ids of runs to compare (no widget has this key)
KEPT_KEY = "kept_choices"  # session state: each kept_selectbox's last choice, by its key (no widget has this key)
STATUS_COLORS = {"running": "green", "finished": "blue", "failed": "red", "incomplete": "orange",
                 "interrupted": "orange", "disk_full": "red", "unreadable": "gray"}
DEMO_ARGS = {"workload": "cifar-lenet", "devices": "cpu:2", "steps": 30, "name": "demo"}


# -- reading, cached ---------------------------------------------------------------------------

@st.cache_data(ttl=LISTING_TTL_S, show_spinner=False)
def _listing(directory: str, signature: tuple) -> pd.DataFrame:
    try:
        return list_runs(directory)
    except RunFileError:  # a file where the directory should be: the Runs page says so (reports_dir_problem)
        return pd.DataFrame(columns=LISTING_COLUMNS)


def listing() -> pd.DataFrame:
    """Every file in the reports directory (list_runs), cached until a file changes (or LISTING_TTL_S)."""
    directory = reports_dir()
    return _listing(str(directory), dir_signature(directory))


def readable(runs: pd.DataFrame) -> pd.DataFrame:
    return runs[runs["reason"].isna()]


def _loaded(path: str, capture: int | None = None) -> StoredRun:
    run = load_run(path)
    run.capture = capture
    return run


@st.cache_data(show_spinner="Reading the run…", max_entries=128)
def _view(_fn: Callable[..., Any], name: str, path: str, signature: tuple, capture: int | None, *args: Any) -> Any:
    return _fn(_loaded(path, capture), *args)


def view(fn: Callable[..., Any], row: pd.Series, *args: Any, capture: int | None = None) -> Any:
    """``fn(run, *args)`` (a function of dpprof.views) for a run of the listing, its operator tables read from the
    deep capture starting at step ``capture`` (None: the latest), cached by the function, the run's files and their
    modification times."""
    path = Path(row["path"])
    return _view(fn, f"{fn.__module__}.{fn.__qualname__}", str(path), run_signature(path, row["id"]), capture, *args)


def capture_box(row: pd.Series) -> int | None:
    """The deep capture a page reads (its first step), picked where the run keeps more than one; None: the latest."""
    listed = view(detail_rows.captures, row)
    if len(listed) < 2:
        return None
    by_first = {c.first_step: c for c in listed}
    return kept_selectbox("Capture", list(reversed(by_first)), key=f"capture_{row['id']}",
                          format_func=lambda first: by_first[first].label + (" (latest)" if first == listed[-1].first_step
                                                                             else ""),
                          help="The run keeps each deep capture's operators, kernels and memory; the latest is shown "
                               "unless another is picked.")


@st.cache_data(show_spinner="Comparing…", max_entries=32)
def _operator_diff(path_a: str, sig_a: tuple, pick_a: Pick, path_b: str, sig_b: tuple, pick_b: Pick,
                   capture: int | None) -> pd.DataFrame:
    return opdiff.operator_diff(_loaded(path_a, capture if path_a == path_b else None), pick_a,
                                _loaded(path_b, capture), pick_b)


def operator_diff(row_a: pd.Series, pick_a: Pick, row_b: pd.Series, pick_b: Pick,
                  capture: int | None = None) -> pd.DataFrame:
    """dpprof.views.opdiff.operator_diff of two sides, each a run of the listing (the same or two) and a pick, B's
    run (and A's, where it is B's) read from the capture starting at step ``capture`` (None: the latest), cached by
    both runs' files and their modification times."""
    return _operator_diff(str(row_a["path"]), run_signature(Path(row_a["path"]), row_a["id"]), pick_a,
                          str(row_b["path"]), run_signature(Path(row_b["path"]), row_b["id"]), pick_b, capture)


def run_csv(row: pd.Series, table: str) -> Callable[[], bytes]:
    """A callable for st.download_button: the table's CSV, built when the button is clicked."""
    path = row["path"]
    return lambda: export.table_csv(load_run(path), table)


def run_zip(row: pd.Series) -> Callable[[], bytes]:
    path = row["path"]
    return lambda: export.run_zip(load_run(path))


def run_trace(row: pd.Series, per_rank: bool = False) -> Callable[[], bytes]:
    """A callable for st.download_button: the run's trace (.json.gz), or a zip of one per rank, built when clicked."""
    path = row["path"]
    return lambda: (export.rank_traces_zip if per_rank else export.run_trace)(load_run(path))


# -- the chosen run ----------------------------------------------------------------------------

PICKER_KEY = "run_picker"  # the sidebar selectbox's own state


def _picked() -> None:
    st.session_state[RUN_KEY] = st.session_state[PICKER_KEY]


def sidebar_picker() -> None:
    """The run picker in the sidebar (every page): readable runs, newest first."""
    runs = readable(listing())
    state = st.session_state
    ids = runs["id"].tolist()
    if state.get(RUN_KEY) not in ids:
        wanted = st.query_params.get("run")
        state[RUN_KEY] = wanted if wanted in ids else default_run(runs)
    with st.sidebar:
        st.caption(f"Runs in {markdown_code(reports_dir())}")
        if not ids:
            st.write("No runs yet.")
            return
        if state.get(PICKER_KEY) != state[RUN_KEY]:
            state[PICKER_KEY] = state[RUN_KEY]  # another page chose a run (set before the widget exists)
        labels = dict(zip(ids, (run_label(r, status=True) for _, r in runs.iterrows())))
        st.selectbox("Run", ids, format_func=labels.get, key=PICKER_KEY, on_change=_picked)
    if st.query_params.get("run") != state[RUN_KEY]:
        st.query_params["run"] = state[RUN_KEY]


def default_run(runs: pd.DataFrame) -> str | None:
    """The run the dashboard opens on: the newest that finished or is recording (a failed or killed one only
    when there is no other), never a run ``dpprof advise --check`` recorded while another run is there."""
    own = runs[runs["check_of"].isna()]
    runs = own if len(own) else runs
    good = runs[runs["status"].isin(["finished", "running"])]
    return (good if len(good) else runs)["id"].iloc[0] if len(runs) else None


def chosen_run() -> pd.Series | None:
    """The chosen run's row of the listing, or None (with a word on the page about what to do)."""
    runs = readable(listing())
    match = runs[runs["id"] == st.session_state.get(RUN_KEY)]
    if match.empty:
        if runs.empty:
            st.info("No runs yet. Record one on the **New run** page (or on **Runs**: a demo on CPU workers), "
                    "or from a shell: `python -m dpprof profile cifar-lenet --steps 30 --devices cpu:2`.")
        else:
            st.info("Choose a run in the sidebar or on the **Runs** page.")
        st.page_link("app_pages/runs.py", label="Go to Runs")
        return None
    return match.iloc[0]


def run_header(row: pd.Series) -> None:
    """The run's name, status and what it ran (each name as plain text: dpprof.plaintext)."""
    st.title(markdown_text(row["name"] or row["id"]), anchor=False)
    cols = st.columns([1, 6])
    with cols[0]:
        st.badge(markdown_text(row["status"]), color=STATUS_COLORS.get(row["status"], "gray"))
        if row.get("balanced"):
            st.badge("balanced", color="violet", help="DataParallelModel + DataParallelCriterion: each device "
                     "computes its share of the loss, nothing is gathered")
    created = str(row["created_at"] or "")[:19].replace("T", " ")
    steps = int(row["steps"]) if pd.notna(row["steps"]) else 0
    model = view(views.model_of, row)
    # an imported trace's workload is its job (dpprof.trace.importer.job_name); one imported before that had none
    workload = row["workload"] if isinstance(row["workload"], str) and row["workload"] else None
    workload = None if model.imported and workload == LEGACY_WORKLOAD else workload
    job = view(views.job_of, row)  # an imported rank's job: "rank 0 of a 128-rank job (nccl)"
    what = [model.title, workload or (None if model.imported else "your model"),
            f"{model.unit}s {', '.join(model.devices) or '-'}", job, plural(steps, "step"), f"started {created} UTC"]
    cols[1].caption(" · ".join([f"run {markdown_code(row['id'])}"] + [markdown_text(w) for w in what if w]))
    if model.kind == "empty" and row["status"] != "running":
        missing(model.empty_reason or "The run recorded no steps.")
    if row["status"] == "running":
        st.caption(f"Recording: this page re-reads the run every {REFRESH_S:.0f} s.")
    elif said := status_sentence(row["status"], row.get("error") if isinstance(row.get("error"), str) else None):
        sentence, verbatim = said
        st.warning(markdown_text(sentence))
        if verbatim:
            st.code(verbatim, language=None)  # a traceback keeps its lines and its ^^^^ markers
    if dropped := dropped_records(row):
        st.warning(f"{dropped}.")
    # below, the file's own words (names, values) go out as plain text (st.text), never as markdown
    if isinstance(row.get("copy_of"), str):
        st.text(f"A copy of run {row['copy_of']}, listed as a run of its own (file {Path(row['path']).name}).")
    damage = view(views.damage_of, row)
    if damage:  # values of the run file that are no usable figures: left out, so the rest can be shown
        st.warning("The run file is damaged: values that are no usable figures were read as missing and the rows "
                   "holding them left out. What could be read is shown.")
        st.text("\n".join(damage))


def capture_button(row: pd.Series) -> None:
    """On a running run's page: ask it to profile its next steps with torch.profiler (dpprof capture), and say when
    they are stored. Thin: dpprof.capture.request writes the request and reads the answer."""
    if row["status"] != "running" or isinstance(row.get("source"), str):
        return
    key = f"capture-{row['id']}"
    left, right = st.columns([1, 3], vertical_alignment="bottom")
    steps = left.number_input("Steps", min_value=1, max_value=MAX_CAPTURE_STEPS, value=5, key=f"{key}-steps")
    if right.button("Capture with torch.profiler", key=f"{key}-ask", help="Profile the run's next steps with "
                    "torch.profiler (shapes; every worker thread of a DataParallel run, a rank's memory and modules): "
                    "their operators are stored in the run per device, the raw trace beside it for Perfetto. Steps "
                    "outside the window cost what they did."):
        try:
            st.session_state[key] = ask(load_run(row["path"]), int(steps))
        except (CaptureError, RunFileError) as err:
            st.error("The run cannot capture:")
            st.text(str(err))
    asked = st.session_state.get(key)
    if asked is not None:
        answer = answer_to(asked)
        if answer is None:
            start = "its next step" if asked.first_step is None else f"step {asked.first_step}, on every rank"
            st.caption(f"Asked for {plural(asked.steps, 'step')}: the run starts at {start} and stores them.")
        elif answer.error:
            st.warning("The capture failed:")
            st.text(answer.error)
        else:
            traces = ", ".join(answer.traces or [answer.trace or ""])
            st.text(f"Captured steps {answer.first_step} to {(answer.end_step or 1) - 1}: raw trace"
                    f"{'s' if len(answer.traces) > 1 else ''} {traces}")


def live(body: Callable[[pd.Series], None]) -> None:
    """Run a page body for the chosen run; while the run is recording, re-run it every REFRESH_S."""
    row = chosen_run()
    if row is None:
        return
    if row["status"] != "running":
        try:
            body(row)
        except RunFileError as err:  # a file damaged past reading (or changed since it was listed): one line
            st.error("This run cannot be shown:")
            st.text(str(err))
        return
    run_id = row["id"]

    @st.fragment(run_every=REFRESH_S)
    def refreshing() -> None:
        current = readable(listing())
        match = current[current["id"] == run_id]
        if match.empty or match.iloc[0]["status"] != "running":
            st.rerun(scope="app")  # it finished (or went): one last full render, then no more refreshes
        body(match.iloc[0])

    refreshing()


def refreshing(active: bool, body: Callable[[], None]) -> None:
    """Run body; while ``active`` (something shown is still recording), re-run it every REFRESH_S."""
    if not active:
        body()
        return
    st.fragment(body, run_every=REFRESH_S)()


def rerun_on_change(signature: Callable[[], Any]) -> None:
    """Re-run the whole page when signature() changes (checked every REFRESH_S): for pages whose widgets
    must live outside a fragment, such as the Runs table and its selection."""
    before = signature()

    @st.fragment(run_every=REFRESH_S)
    def follow() -> None:
        if signature() != before:
            st.rerun(scope="app")

    follow()


# -- tables and words --------------------------------------------------------------------------

def table(df: pd.DataFrame, name: str, index: bool = False, **kwargs: Any) -> None:
    """st.dataframe as people read it (units in the headers, MiB, two decimals) plus a CSV download of the same
    rows in machine values (formula-like cells neutralised)."""
    shown = display_table(df.reset_index() if index else df)
    st.dataframe(shown, hide_index=True, **kwargs)
    csv_button(df, name, index)


def csv_button(df: pd.DataFrame, name: str, index: bool = False) -> None:
    """A CSV download of a table (formula-like cells neutralised: the built-in table download is off)."""
    st.download_button(f"⬇ {name}.csv", to_csv_bytes(df, index=index), file_name=f"{name}.csv",
                       mime="text/csv", key=f"csv-{name}", on_click="ignore")


def pick_box(label: str, picks: list[Any], key: str) -> Any:
    """A rank/device chooser of dpprof.views.opdiff.Pick values ("all devices" first where there are several), kept
    (kept_selectbox)."""
    options = ([Pick()] if len(picks) > 1 else []) + picks
    return kept_selectbox(label, options, key=key, format_func=lambda p: p.label())


def kept_selectbox(label: str, options: list[Any], key: str, default: int | None = 0, **kwargs: Any) -> Any:
    """st.selectbox whose choice is kept beside it (KEPT_KEY): Streamlit drops a widget's state while another page is
    open, so a rank, device or capture chosen on one page read as the first again on coming back. A kept choice the
    options no longer hold (another run's rank or device) gives way to the option at ``default`` (None: none)."""
    kept = st.session_state.setdefault(KEPT_KEY, {})
    index = options.index(kept[key]) if key in kept and kept[key] in options else default
    kept[key] = st.selectbox(label, options, index=index, key=key, **kwargs)
    return kept[key]


def kept_toggle(label: str, value: bool, key: str, **kwargs: Any) -> bool:
    """st.toggle whose state is kept beside it (KEPT_KEY), as kept_selectbox's choice: ``value`` until it is
    changed, then the user's choice, also after another page."""
    kept = st.session_state.setdefault(KEPT_KEY, {})
    kept[key] = bool(st.toggle(label, value=kept.get(key, value), key=key, **kwargs))
    return kept[key]


def missing(text: str) -> None:
    """Data this run does not have, said in words (never an empty chart); the names in them as plain text, the
    commands in backticks as code (dpprof.plaintext.markdown_words)."""
    st.info(markdown_words(text), icon="ℹ️")


_BOX = {"critical": st.error, "warning": st.warning, "info": st.info}


def finding_box(f: Any) -> None:
    """One finding (a FindingRecord or a row with its fields) as a box coloured by its severity; its words as
    plain text (they name devices, kernels and collectives from the run)."""
    heading = markdown_text(finding_heading(f.severity, f.device, f.title))
    _BOX.get(f.severity, st.info)(f"**{heading}**\n\nEvidence: {markdown_text(f.evidence)}\n\n"
                                  f"Advice: {markdown_text(f.advice)}")


def chart(fig: Any) -> None:
    st.plotly_chart(fig, width="stretch", config={"displaylogo": False})


# -- starting runs -----------------------------------------------------------------------------

@st.cache_resource
def processes() -> dict[int, Started]:
    """Runs started from this dashboard: pid -> dpprof.processes.Started (one registry per server)."""
    return {}


@st.cache_resource
def import_lock() -> threading.Lock:
    """Held while a trace import started from this dashboard runs (one per server)."""
    return threading.Lock()


def start_run(workload: str, devices: str, steps: int, batch_size: int | None = None,
              name: str | None = None, balanced: bool = False, capture: str | None = None) -> Started | None:
    """Start ``python -m dpprof profile ...`` in its own process (dpprof.launch.Profile.start), logging to
    reports/.logs/; None, with the reason on the page, when it cannot start."""
    directory = reports_dir()
    try:  # a read-only, full or missing reports directory: the one line `dpprof profile` would print
        check_reports_dir(directory)
        profile = Profile(workload=workload, devices=devices, steps=int(steps), batch_size=batch_size or None,
                          name=name, balanced=balanced, reports_dir=str(directory), capture=capture).with_run_id()
    except (RecordingError, ProfileError) as err:
        st.error(markdown_text(f"dpprof: {err}"))  # the path is the user's
        return None
    logs = directory / ".logs"  # a dot-directory: list_runs never lists it
    logs.mkdir(parents=True, exist_ok=True)
    log = logs / f"{profile.run_id}-{workload}.log"
    # a session of its own: not killed with the page; not Streamlit's thread
    started = profile.start(log=log, new_session=True)
    processes()[started.pid] = started
    st.session_state.setdefault("started", []).append(started.pid)
    st.session_state["watch"] = started.pid
    return started


def process_status(pid: int) -> tuple[str, int | None]:
    """("running", None) or ("exited", returncode) for a process started here."""
    started = processes().get(pid)
    return ("unknown", None) if started is None else started.status()


def running_processes() -> list[int]:
    """Processes started from this dashboard that are still running."""
    return [pid for pid, started in list(processes().items()) if started.running]


def stop_run(pid: int) -> None:
    """End a run started here with SIGTERM (its recorded steps stay in its file)."""
    started = processes().get(pid)
    if started is not None:
        started.stop()


def progress_line(pid: int, row: pd.Series | None) -> str | None:
    """"step 12 of 50 · 4.1 steps/s" for a run started here, from its listed steps and duration."""
    started = processes().get(pid)
    if started is None or row is None:
        return None
    return processes_progress_line(row["steps"], started.profile.steps, row["duration_s"])


def log_tail(pid: int) -> str:
    started = processes().get(pid)
    return "" if started is None else started.log_tail()


def run_of_process(pid: int) -> pd.Series | None:
    """The listed run a process started here is recording: the listing's row with the id it was given."""
    started = processes().get(pid)
    return None if started is None else run_row(readable(listing()), started.run_id)


def watch_started_run() -> None:
    """After a start: the process's state, its log, and a link to its run once it appears; refreshed
    every second until the process has exited and its run is no longer running."""
    pid = st.session_state.get("watch")
    if pid is None or pid not in processes():
        return

    def done() -> bool:
        row = run_of_process(pid)
        return process_status(pid)[0] != "running" and (row is None or row["status"] != "running")

    def render() -> None:
        status, code = process_status(pid)
        row = run_of_process(pid)
        command = " ".join(processes()[pid].cmd[1:])
        if status == "running":
            st.info(f"Process {pid} is running: {markdown_code(command)}")
            progress = progress_line(pid, row)
            c1, c2 = st.columns([1, 5])
            if c1.button("Stop", key=f"stop-{pid}", help="End the run (SIGTERM); the steps recorded so far are kept"):
                stop_run(pid)
            c2.markdown(f"**{progress}**" if progress else "Starting…")
        elif code == 0:
            st.success(f"Process {pid} finished: {markdown_code(command)}")
        elif processes()[pid].stopped:
            st.warning(f"Process {pid} was stopped (SIGTERM, exit code {code}); the steps it recorded are kept: "
                       f"{markdown_code(command)}")
        else:
            st.error(f"Process {pid} exited with code {code}: {markdown_code(command)}")
        if row is not None:
            st.session_state[RUN_KEY] = row["id"]
            st.markdown(f"Run **{markdown_text(row['name'] or row['id'])}** ({markdown_code(row['id'])}) is "
                        f"{markdown_text(row['status'])}.")
            st.page_link("app_pages/overview.py", label="Open it on Overview →")
        elif status == "running":
            st.caption("Waiting for the run file to appear…")
        tail = log_tail(pid)
        if tail:
            st.code(tail, language=None)

    if done():
        render()
        return

    @st.fragment(run_every=1.0)
    def watching() -> None:
        if done():
            st.rerun(scope="app")  # one last full render without the timer
        render()

    watching()

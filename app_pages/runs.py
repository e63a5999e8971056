"""Runs: every file in the reports directory with its status and what it ran; open one, compare several."""
from __future__ import annotations

from pathlib import Path

import streamlit as st

from app_pages import common
from dpprof.outputs import OutputError
from dpprof.plaintext import markdown_code, markdown_text
from dpprof.store.faults import RecordingError
from dpprof.store.reader import checks_under_their_runs, reports_dir, reports_dir_problem
from dpprof.trace import AlreadyImported, TraceError, import_traces, pending_traces
from dpprof.units import plural

IMPORT_ASKED = "trace_import_asked"  # session state: the file names the Import button was pressed on
IMPORT_SAID = "trace_import_said"  # session state: what the last import said, shown once: (kind, text)


def ask_import(names: list[str]) -> None:
    """The Import button's click: the files selected when it was pressed, whatever the listing holds by the rerun."""
    st.session_state[IMPORT_ASKED] = names


def import_asked(directory: Path) -> None:
    """Import the files the button was pressed on, one import at a time on this server; what it did is kept for
    the rerun that shows it."""
    state = st.session_state
    names = state.pop(IMPORT_ASKED)
    state.pop("traces_table", None)  # the rows selected were of the listing before this import: none selected after
    with common.import_lock():  # a second press waits for the first import, then finds its run
        try:
            run = import_traces([directory / name for name in names], directory)
        except AlreadyImported as err:
            state[common.RUN_KEY] = max(max(ids) for ids in err.runs.values())
            state[IMPORT_SAID] = ("warning", "Nothing imported: " + "; ".join(
                [f"{name} is already imported as run {', '.join(ids)}" for name, ids in err.runs.items()]
                + [f"{name} is not" for name in err.others]) + ".")
            return
        # what `dpprof import` says in one line (its exit 1): a file refused; a reports directory read-only or full
        except (TraceError, OutputError, RecordingError) as err:
            state[IMPORT_SAID] = ("error", f"Not imported: {err}")
            return
    state[common.RUN_KEY] = run.id
    state[IMPORT_SAID] = ("success", f"Imported run {run.id}: {plural(run.steps, 'step')} on {', '.join(run.devices)}.")


def traces_to_import() -> None:
    """Trace files in the reports directory not imported yet, imported on a click. The browser only picks
    rows of this listing: the files imported are the listing's, never a path it sends."""
    directory = reports_dir()
    asked = st.session_state.get(IMPORT_ASKED)
    pending = pending_traces(directory)
    if not pending.empty:
        st.subheader("torch.profiler traces to import")
        st.caption(f"Trace files (.json, .json.gz) in {markdown_code(directory)} that no run was imported from. Select one, or "
                   "the files of one job's ranks, and import them as one run (`dpprof import` does the same from a "
                   "shell).")
        shown = pending.assign(size_mb=pending["size_bytes"] / 2**20)[["file", "size_mb", "modified"]]
        event = st.dataframe(shown, hide_index=True, on_select="rerun", selection_mode="multi-row",
                             key="traces_table",
                             column_config={"size_mb": st.column_config.NumberColumn("size (MiB)", format="%.1f")})
        rows = [r for r in event.selection.rows or [] if r < len(pending)]  # not past a listing that shrank
        names = pending.iloc[rows]["file"].tolist()
        importing = asked is not None or common.import_lock().locked()
        hint = f"Import {markdown_text(', '.join(names))} as one run" if names else "Select trace files in the table"
        st.button("Import", disabled=not names or importing, key="import_traces", on_click=ask_import,
                  args=(names,), help="An import is under way" if importing else hint)
    if asked is not None:
        with st.spinner(f"Importing {len(asked)} trace file(s)…"):
            import_asked(directory)
        st.rerun()  # the listings drawn again with the new run, and what the import said
    said = st.session_state.pop(IMPORT_SAID, None)
    if said is not None:
        kind, text = said  # file names, the run's devices, the error: shown as they are, on one line
        {"success": st.success, "warning": st.warning, "error": st.error}[kind](markdown_text(text))


st.title("Runs")
runs = common.listing()
good = common.readable(runs)
bad = runs[runs["reason"].notna()]

if good.empty and (problem := reports_dir_problem()) is not None:  # a file where the directory should be
    st.error(markdown_text(f"No runs: {problem}. Point DPPROF_REPORTS at a directory (or leave it unset for ./reports)."))
elif good.empty:
    st.subheader("No runs yet")
    st.markdown(
        f"dpprof keeps one file per recorded run in {markdown_code(reports_dir())} and there is none yet. Record one from a "
        "shell (CPU workers stand in for GPUs, so this works on any machine):")
    st.code("python -m dpprof profile cifar-lenet --steps 30 --devices cpu:2", language="bash")
    st.markdown("or wrap your own model in `dpprof.DataParallel` inside `with dpprof.record():` (see the README), "
                "or start one here:")
    busy = common.running_processes()
    # a click sent before the button was drawn disabled (a double click, another tab) starts nothing either
    # (Streamlit discards such clicks itself only since streamlit/streamlit#16209, mid-2026)
    if st.button("Record a demo run on 2 CPU workers", type="primary", key="demo", disabled=bool(busy),
                 help="A run started from this dashboard is still going" if busy else None) and not busy:
        if common.start_run(**common.DEMO_ARGS):
            st.rerun()  # drawn again with the run going: the button disabled, the run's Stop button below
    common.watch_started_run()
else:
    good = checks_under_their_runs(good)  # the runs dpprof advise --check recorded, under the run they check
    shown = good[["status", "name", "workload", "balanced", "backend", "devices", "steps", "duration_s", "created_at",
                  "id", "check_of", "copy_of", "damage"]].copy()
    shown["created_at"] = shown["created_at"].str.slice(0, 19).str.replace("T", " ")
    st.caption("Select one run to open it, or several to compare them.")
    event = st.dataframe(
        shown, hide_index=True, on_select="rerun", selection_mode="multi-row", key="runs_table",
        column_config={"duration_s": st.column_config.NumberColumn("duration (s)", format="%.1f"),
                       "created_at": "started (UTC)", "steps": st.column_config.NumberColumn(format="%d"),
                       "balanced": st.column_config.CheckboxColumn(
                           "balanced", help="DataParallelModel + DataParallelCriterion: nothing gathered"),
                       "check_of": st.column_config.TextColumn(
                           "check of", help="recorded by dpprof advise RUN --check: a scenario of that run, run for "
                           "real; listed under it"),
                       "copy_of": st.column_config.TextColumn(
                           "copy of", help="a copy of that run's file, under another name: a run of its own"),
                       "damage": st.column_config.TextColumn(
                           "damage", help="values of the run's file that were no usable figures, read as missing")})
    selected = shown.iloc[list(event.selection.rows)]["id"].tolist() if event.selection.rows else []
    c1, c2, c3, _ = st.columns([1, 1, 1, 5])
    if c1.button("Open", disabled=len(selected) != 1, type="primary", key="open_run",
                 help="Select one run in the table"):
        st.session_state[common.RUN_KEY] = selected[0]
        st.switch_page("app_pages/overview.py")
    if c2.button("Compare", disabled=len(selected) < 2, key="compare_runs", help="Select two or more runs"):
        # oldest first: the baseline is the run before the change
        st.session_state[common.COMPARE_KEY] = good[good["id"].isin(selected)].sort_values("created_at")["id"].tolist()
        st.session_state.pop("compare_pick", None)  # the Compare page starts from this choice
        st.switch_page("app_pages/compare.py")
    with c3:
        common.csv_button(good.drop(columns=["path", "reason"]), "runs")
    if (good["status"] == "running").any():
        st.caption(f"A run is recording: this list refreshes every {common.REFRESH_S:.0f} s.")
        common.rerun_on_change(lambda: common.readable(common.listing())[["id", "status", "steps"]].values.tolist())
    common.watch_started_run()

traces_to_import()

if not bad.empty:
    st.subheader("Unreadable files")
    st.caption("Files in the reports directory that are not runs this dpprof can read, and what imports or merges "
               "interrupted before they finished left (status \"interrupted import\"), and why.")
    unreadable = bad.assign(file=bad["path"].map(lambda p: p.rsplit("/", 1)[-1]))[["file", "status", "reason"]]
    st.dataframe(unreadable, hide_index=True)

"""Compare: two or more runs side by side (step time, phase shares, per-device memory) and what differs."""
from __future__ import annotations

import numbers

import numpy as np
import pandas as pd
import streamlit as st

from dpprof import charts
from dpprof.plaintext import markdown_text, markdown_words
from dpprof.views import compare, operators, opdiff
from dpprof.views.opdiff import Pick
from dpprof.views.text import display_table, run_label
from app_pages import common

st.title("Compare runs")
runs = common.readable(common.listing())
ids = runs["id"].tolist()
labels = dict(zip(ids, (run_label(r, status=True) for _, r in runs.iterrows())))
state = st.session_state
need = None
if "compare_pick" not in state:  # first visit, or the Runs page chose the runs
    picked = [i for i in state.get(common.COMPARE_KEY, []) if i in ids]
    if not picked:  # the open run and the newest finished run of its workload
        picked, need = compare.default_compare(runs, state.get(common.RUN_KEY))
    state["compare_pick"] = picked
state["compare_pick"] = [i for i in state["compare_pick"] if i in ids]  # a run file may have gone
chosen = st.multiselect("Runs (the first is the baseline)", ids, format_func=labels.get, key="compare_pick")
state[common.COMPARE_KEY] = chosen


def _cell(value: object) -> str:
    """One cell of the transposed summary, as text (its rows mix numbers, words and flags)."""
    if isinstance(value, (bool, np.bool_)):
        return "yes" if value else "no"
    if value is None or (isinstance(value, numbers.Number) and pd.isna(value)) or value is pd.NA:
        return "-"
    if isinstance(value, numbers.Integral):
        return f"{value:,}"
    return f"{value:,.2f}" if isinstance(value, numbers.Real) else str(value)


def operator_side_by_side(rows: list[pd.Series]) -> None:
    """The first two runs' operators side by side (the Operators page's, all devices summed), where both have them."""
    why = [common.view(operators.missing_text, r) for r in rows]
    if all(why):  # runs recorded without a capture: no section
        return
    st.subheader("Operators")
    if len(rows) != 2:
        common.missing("Operators are set side by side for two runs: choose two to see them.")
        return
    base, other = rows
    if any(why):
        common.missing(next(w for w in why if w))
        return
    diff = common.operator_diff(base, Pick(), other, Pick())
    label_a, label_b = (str(r["name"] or r["id"]) for r in rows)
    # over the second run's steps: the first's totals scaled to them where its capture spans another count, said so
    st.markdown(markdown_words(opdiff.diff_sentence(diff, label_a, label_b)))
    common.chart(charts.operator_diff(diff, label_a, label_b))
    common.table(diff, "operator_diff")


def body() -> None:
    if len(chosen) < 2:
        common.missing(need or ("Choose two or more runs to compare (here, or select them on the Runs page)."
                                if len(ids) >= 2 else "Comparing needs two or more runs; record another on the "
                                "New run page."))
        return
    rows = [runs[runs["id"] == i].iloc[0] for i in chosen]
    data = compare.combine([common.view(compare.compare_part, r) for r in rows])
    st.subheader("What differs")
    st.caption(f"Against the baseline, {markdown_text(data.summary.iloc[0]['run'])}.")  # run names: plain text
    st.markdown("\n".join(f"- {markdown_text(line)}" for line in data.differences) or "Nothing to compare yet.")
    shown = display_table(data.summary).set_index("run").T
    st.dataframe(shown.map(_cell), width="stretch")
    common.csv_button(data.summary, "compare_summary")
    empty = [r["run"] for _, r in data.summary.iterrows() if not r["steps"]]
    if empty:
        whose = "its" if len(empty) == 1 else "their"
        common.missing(f"No steps recorded in {', '.join(empty)}: {whose} charts stay empty.")
    if data.steps.empty:
        return
    common.chart(charts.compare_step_times(data.steps))
    left, right = st.columns(2)
    with left:
        if data.shares.empty:
            common.missing("No phases recorded in these runs.")
        else:
            common.chart(charts.compare_phase_shares(data.shares))
    with right:
        if data.memory.empty:  # e.g. imported traces without the CUDA allocator's figures
            common.missing("None of these runs recorded memory per device (neither dpprof's accounting nor the "
                           "CUDA allocator's): there is no memory to compare.")
        else:
            common.chart(charts.compare_memory(data.memory))
    operator_side_by_side(rows)
    if data.memory["memory"].nunique() > 1:
        st.caption("Each run's memory is its Overview's figure: the CUDA allocator's peak allocated where the run "
                   "recorded it, else what dpprof accounts to each device in its peak step (chunk, outputs, "
                   "activations, gathered outputs, weights). The two are different measures: the table says which "
                   "each run's is.")


common.refreshing(bool((runs[runs["id"].isin(chosen)]["status"] == "running").any()), body)

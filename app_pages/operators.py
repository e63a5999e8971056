"""Operators: a run's operators per rank and device, the top ones by self time, its module tree, and two devices,
ranks or runs side by side."""
from __future__ import annotations

import pandas as pd
import streamlit as st

from app_pages import common
from dpprof import charts
from dpprof.plaintext import markdown_text, markdown_words
from dpprof.views import operators, opdiff
from dpprof.views.opdiff import Pick
from dpprof.views.text import run_label

ANOTHER_RUN = "another run…"
KEPT_KEY = "operators_kept"  # session state: the grouping and search last chosen (no widget has this key)


def side_by_side(row: pd.Series, picks: list[Pick], pick: Pick, capture: int | None = None,
                 chosen: bool = True) -> None:
    """A (another device, rank or run) against B: ``pick``, the device chosen above, or where all devices are chosen
    (``chosen`` False) the last of them, said so in B's label."""
    st.subheader("Side by side")
    st.caption("Operators of A and B with B's difference in self time (on the GPU where both ran kernels, else on "
               "the host), largest first; self time, so nested operators do not count one kernel twice.")
    c1, c2 = st.columns(2)
    runs = common.readable(common.listing())
    others = [p for p in picks if p != pick]
    choices: list[object] = [*others, ANOTHER_RUN]
    # another run is read only when asked for: with no other device here, nothing is chosen at first
    with c1:
        a = common.kept_selectbox("A (the reference)", choices, key="ops_a", default=0 if others else None,
                                  format_func=lambda p: p if isinstance(p, str) else p.label(),
                                  placeholder="choose another run…")
    c2.selectbox("B (explained: the device chosen above)" if chosen else
                 "B (explained: the last device, as all are chosen above; choose one there for another)", [pick],
                 format_func=lambda p: p.label(), key="ops_b", disabled=True)
    if a is None:
        return
    row_a = row
    if isinstance(a, str):
        ids = [i for i in runs["id"] if i != row["id"]]
        if not ids:
            common.missing("There is no other run to compare with.")
            return
        labels = {i: run_label(r) for i, r in runs.set_index("id", drop=False).iterrows()}
        other = common.kept_selectbox("Run A", ids, key="ops_run_a", format_func=labels.get)
        row_a = runs[runs["id"] == other].iloc[0]
        missing = common.view(operators.missing_text, row_a)
        if missing:
            common.missing(f"Run {other}: {missing}")
            return
        a = common.pick_box("A's rank or device", common.view(operators.picks, row_a), "ops_pick_a")
    assert isinstance(a, Pick)
    diff = common.operator_diff(row_a, a, row, pick, capture)
    label_a = a.label() if row_a is row else f"{row_a['name'] or row_a['id']} {a.label()}".strip()
    # over B's steps, as `dpprof ops --vs` says them: a side whose tables span another count is scaled to them
    st.markdown(markdown_words(opdiff.diff_sentence(diff, label_a, pick.label())))
    if diff.empty:
        return
    common.chart(charts.operator_diff(diff, label_a, pick.label()))
    common.table(diff, "operator_diff")


def body(row: pd.Series) -> None:
    common.run_header(row)
    missing = common.view(operators.missing_text, row)
    if missing:
        common.missing(missing)
        return
    capture = common.capture_box(row)
    picks = common.view(operators.picks, row, capture=capture)
    c1, c2, c3 = st.columns([2, 2, 3])
    with c1:
        pick = common.pick_box("Rank and device", picks, "ops_pick")
    # kept beside the widgets: Streamlit drops a widget's state while another page is open
    kept = st.session_state.setdefault(KEPT_KEY, {"by": "name", "search": ""})
    by = c2.radio("Group by", ["name", "shape"], index=["name", "shape"].index(kept["by"]), horizontal=True,
                  key="ops_by", format_func={"name": "name", "shape": "name + input shapes"}.get)
    search = c3.text_input("Search names", value=kept["search"], key="ops_search")
    kept.update(by=by, search=search)
    data = common.view(operators.operators_page, row, pick, by, search, capture=capture)
    common.chart(charts.top_operators(data.top, data.value))
    table = data.table
    st.caption(f"{len(table):,} rows. Host times: the ops' own durations (self: less their children). Device times: "
               "their kernels, linked op → launch → kernel (total: with their children's). tc eligible: an op that "
               "can use tensor cores; tc pct: the share of its device time on tensor-core kernels. Click a header "
               "to sort.")
    common.table(table, f"operators_{by}")
    tree = data.tree
    st.subheader("Modules")
    if tree.empty:
        common.missing("No module tree: the trace has no module ids (profile with with_stack=True and "
                       "with_modules=True).")
    else:
        common.table(tree, "modules")
    if len(picks) > 1 or len(common.readable(common.listing())) > 1:
        side_by_side(row, picks, pick if pick != Pick() else picks[-1], capture, chosen=pick != Pick())
    if data.notes:
        st.caption(markdown_text(" ".join(data.notes)))

common.live(body)

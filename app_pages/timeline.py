"""Timeline: a per-device Gantt of the phases over a chosen range of steps."""
from __future__ import annotations

import pandas as pd
import streamlit as st

from dpprof import charts
from dpprof.plaintext import markdown_text
from dpprof.views import timeline
from dpprof.store.queries import TIMELINE_MAX_STEPS
from app_pages import common

TIMELINE_FROM_KEY = "timeline_from"  # session state: each run's chosen first step (no widget has this key)
TIMELINE_COUNT_KEY = "timeline_count"  # session state: the steps to show, as last chosen (no widget has this key)


def body(row: pd.Series) -> None:
    common.run_header(row)
    first, last = common.view(timeline.step_bounds, row)
    if first is None:
        common.missing("No steps recorded yet: the run has not finished its first step." if row["status"] == "running"
                       else "The run recorded no steps: nothing to show on a timeline.")
        return
    follow = row["status"] == "running" and st.toggle("Follow the latest steps", value=True, key="tl_follow")
    c1, c2 = st.columns(2)
    # kept beside the widget, as the first step: Streamlit drops a widget's state while another page is open
    count = c2.slider("Steps to show", 1, TIMELINE_MAX_STEPS,
                      st.session_state.get(TIMELINE_COUNT_KEY, timeline.TIMELINE_DEFAULT_STEPS), key="tl_count")
    st.session_state[TIMELINE_COUNT_KEY] = count
    if follow:
        start = max(first, last - count + 1)
        c1.metric("From step", start)
    else:
        # keyed by the run: each run opens on its own last steps and keeps the step chosen on it, also while its
        # widget is not drawn (another run or page open), when Streamlit drops a widget's state
        chosen = st.session_state.setdefault(TIMELINE_FROM_KEY, {})
        start = int(c1.number_input(f"From step ({first}–{last})", min_value=0,
                                    value=chosen.get(row["id"], max(first, last - count + 1)),
                                    step=1, key=f"tl_from_{row['id']}"))
        chosen[row["id"]] = start
        if not first <= start <= last:
            st.warning(f"This run's steps are {first}–{last}; showing from step {min(max(start, first), last)}.")
            start = min(max(start, first), last)
    end = min(last, start + count - 1)
    phases, steps = common.view(timeline.timeline, row, start, end)
    st.caption(f"Steps {start}–{end} of {first}–{last}. {markdown_text(common.view(timeline.lanes_text, row))} "
               "Hover a bar for its times.")
    gaps = common.view(timeline.detail_gaps, row, start, end)
    if gaps:
        st.info(markdown_text(gaps))
    if phases.empty:
        common.missing(f"No phases recorded in steps {start}–{end}.")
        return
    many = end - start + 1 > charts.TIMELINE_LABELLED_STEPS  # the default: on for more steps than are labelled
    equal = common.kept_toggle("Every step the same width", value=many, key=f"tl_equal_{many}",
                               help="Each phase at its share of its step, so a few slow steps do not squash the "
                                    "others (hover for milliseconds)")
    common.chart(charts.timeline(phases, steps, equal_steps=equal))
    common.table(phases, f"timeline_steps_{start}_{end}")


common.live(body)

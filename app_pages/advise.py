"""Advisor: what switching would buy, predicted from this run and this machine's cached calibration (DDP, other
device counts, the balanced criterion, other batch sizes), each with the command that runs it for real."""
from __future__ import annotations

import pandas as pd
import streamlit as st

from app_pages import common
from dpprof import charts
from dpprof.advise.commands import CHECK_MAX_STEPS
from dpprof.plaintext import markdown_code, markdown_text, markdown_words
from dpprof.units import mib
from dpprof.views import advise

MEMORY_KEY = "advise_memory_gib"  # session state: the memory per CPU worker last given (no widget has this key)


def body(row: pd.Series) -> None:
    common.run_header(row)
    st.subheader("What would switching buy")
    memory_gib = None
    if row.get("backend") == "cpu":
        # kept beside the widget: Streamlit drops a widget's state while another page is open
        memory_gib = st.number_input("Memory per CPU worker (GiB), for the largest batch that fits", min_value=0.0,
                                     value=st.session_state.get(MEMORY_KEY, 0.0), step=1.0, key="advise-memory")
        st.session_state[MEMORY_KEY] = memory_gib
        memory_gib = memory_gib or None
    data = common.view(advise.page_advisor, row, memory_gib, advise.calibration_files())
    if data.advice is None:
        common.missing(data.reason)
        if data.command:  # no calibration: the page never measures, the command does (once)
            st.code(data.command, language="bash")
        return
    a = data.advice
    for line in a.said_first:  # stalls, a too noisy run, a loaded calibration: before any figure
        st.warning(markdown_text(line))
    st.caption(markdown_words(data.calibration_note))
    c = st.columns(3)
    c[0].metric("Measured median training step" if a.measured.training_only else "Measured median step",  # evaluation left out
                f"{a.measured_step_ms:.2f} ms")
    best = a.headline()
    if best is not None:
        c[1].metric("Fastest at this batch", f"{best.step_ms:.2f} ms", f"{best.step_ms / a.measured_step_ms - 1:+.0%}",
                    delta_color="inverse", help=markdown_text(best.label))
    if a.max_batch_size:
        c[2].metric("Largest batch that fits", f"{min(a.max_batch_size.values()):,}", help=markdown_text(a.max_batch_note))
    table = advise.scenario_table(a)
    if table["predicted"].any():
        common.chart(charts.advice_parts(advise.parts_table(a), table[table["predicted"]].reset_index(drop=True)))
    st.caption("* the recorded set-up. Each interval is the recorded median's 90% interval (both runs' sampling) "
               "widened by a quarter of the change the prediction makes; one spanning over "
               f"{advise.MAX_INTERVAL_RATIO:g}x is no prediction.")
    common.table(table.drop(columns=["scenario"]), "advice")
    st.subheader("Each scenario")
    for s in a.scenarios:
        with st.expander(markdown_text(advise.scenario_title(s)), expanded=s.scenario == "ddp"):
            if s.withheld is not None and a.withheld is None:
                st.caption(f"No prediction: {markdown_text(s.withheld)}.")
            for change in s.changes:
                st.markdown(f"- {markdown_text(change)}")
            st.markdown("Peak held: " + ", ".join(f"{markdown_text(d)} **{mib(b)}**" for d, b in s.peak_bytes.items()))
            if s.command:
                st.code(s.command, language="bash")
            elif s.no_command:
                st.caption(f"No command runs it: {markdown_text(s.no_command)}.")
    st.subheader("Memory per device")
    common.table(advise.memory_table(a), "advice_memory")
    if a.max_batch_size:
        st.markdown("Largest global batch that fits: " + ", ".join(f"{markdown_text(d)} **{b:,}**"
                                                                   for d, b in a.max_batch_size.items())
                    + f" ({markdown_text(a.max_batch_note)}).")
    else:
        common.missing(a.max_batch_note)
    st.subheader("Assumptions")
    for line in a.assumptions:
        st.markdown(f"- {markdown_text(line)}")
    st.caption(f"{markdown_code(f'dpprof advise {a.run_id}')} prints the same; `--check` runs every scenario for real (at most "
               f"{CHECK_MAX_STEPS} steps each) and sets the measured step beside the prediction.")


common.live(body)

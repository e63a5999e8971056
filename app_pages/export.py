"""Export: every table of the run as CSV, the whole run as a zip of CSVs, and the run as a trace file."""
from __future__ import annotations

import pandas as pd
import streamlit as st

from app_pages import common
from dpprof.plaintext import markdown_text, markdown_words
from dpprof.views import export


def body(row: pd.Series) -> None:
    common.run_header(row)
    st.subheader("Download")
    st.caption("CSV files are built when you click. A text cell that begins with = + - or @ (after any spaces or "
               "control characters), or with a tab or a line break, is prefixed with ' so that a spreadsheet shows "
               "it instead of running it.")
    st.download_button("⬇ The whole run (zip of CSVs)", common.run_zip(row), file_name=f"{row['id']}.zip",
                       mime="application/zip", type="primary", key="zip", on_click="ignore")
    c1, c2 = st.columns([2, 5])
    c1.download_button("⬇ Trace for Perfetto (.json.gz)", common.run_trace(row),
                       file_name=f"{row['id']}.pt.trace.json.gz", mime="application/gzip", key="trace",
                       on_click="ignore")
    if int(row.get("ranks") or 1) > 1:
        c1.download_button("⬇ A trace per rank (zip)", common.run_trace(row, per_rank=True),
                           file_name=f"{row['id']}-traces.zip", mime="application/zip", key="trace-ranks",
                           on_click="ignore")
    c2.caption(markdown_words(common.view(export.trace_text, row)))
    for t in common.view(export.export_tables, row).itertuples():
        c1, c2, c3 = st.columns([2, 1, 4])
        c1.download_button(f"⬇ {t.table}.csv", common.run_csv(row, t.table), file_name=f"{row['id']}-{t.table}.csv",
                           mime="text/csv", key=f"export-{t.table}", on_click="ignore")
        c2.write(f"{int(t.rows):,} row{'' if int(t.rows) == 1 else 's'}" if pd.notna(t.rows) else "")
        c3.caption(markdown_text(t.what))


common.live(body)

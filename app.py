"""dpprof's dashboard: ``streamlit run app.py``.

Layout only: the pages in app_pages/ lay out what dpprof.views computes and dpprof.charts draws.
With runs in the reports directory it opens on the newest that finished (or is recording); with none,
on Runs, which says what to do and offers a demo run on CPU workers.
"""
from __future__ import annotations

import sys
from pathlib import Path

import streamlit as st

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # pages.common, from whichever directory streamlit was started
    sys.path.insert(0, str(HERE))

from app_pages import common  # noqa: E402

st.set_page_config(page_title="dpprof", layout="wide")
common.sidebar_picker()


def home() -> None:
    """The address without a page: the Overview of the run the sidebar chose (common.default_run), or Runs (which
    says what to do) without runs."""
    has_runs = not common.readable(common.listing()).empty
    st.switch_page("app_pages/overview.py" if has_runs else "app_pages/runs.py")


st.navigation({
    "Recorded runs": [st.Page(home, title="Home", default=True, visibility="hidden"),
                      st.Page("app_pages/runs.py", title="Runs", url_path="runs")],
    "Run": [
        st.Page("app_pages/overview.py", title="Overview", url_path="overview"),
        st.Page("app_pages/load.py", title="Per-GPU load", url_path="load"),
        st.Page("app_pages/timeline.py", title="Timeline", url_path="timeline"),
        st.Page("app_pages/operators.py", title="Operators", url_path="operators"),
        st.Page("app_pages/kernels.py", title="Kernels", url_path="kernels"),
        st.Page("app_pages/memory.py", title="Memory", url_path="memory"),
        st.Page("app_pages/advise.py", title="Advisor", url_path="advise"),
        st.Page("app_pages/export.py", title="Export", url_path="export"),
    ],
    "Runs side by side": [st.Page("app_pages/compare.py", title="Compare", url_path="compare")],
    "This machine": [
        st.Page("app_pages/devices.py", title="Devices", url_path="devices"),
        st.Page("app_pages/new_run.py", title="New run", url_path="new-run"),
    ],
}).run()

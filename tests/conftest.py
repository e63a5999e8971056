"""Shared fixtures: every test records into its own reports directory, never the checkout's."""
from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def reports(tmp_path, monkeypatch):
    """A fresh reports directory, also set as $DPPROF_REPORTS for code under test."""
    path = tmp_path / "reports"
    monkeypatch.setenv("DPPROF_REPORTS", str(path))
    return path

"""CSV export of a stored run: one file per table plus the per-device summary."""
from __future__ import annotations

import os
from pathlib import Path

import pandas as pd

from dpprof.report import findings_of, summary_of
from dpprof.store.reader import TABLES, StoredRun

__all__ = ["to_csv_bytes", "export_run", "neutralize_formulas"]

_FORMULA_PREFIXES = ("=", "+", "-", "@")


def neutralize_formulas(df: pd.DataFrame) -> pd.DataFrame:
    """Prefix text cells that a spreadsheet would run as a formula (= + - @) with a quote."""
    out = df.copy()
    for col in out.columns:
        if out[col].dtype == object or pd.api.types.is_string_dtype(out[col].dtype):  # pandas 3: str dtype
            out[col] = out[col].map(
                lambda v: f"'{v}" if isinstance(v, str) and v.startswith(_FORMULA_PREFIXES) else v)
    return out


def to_csv_bytes(df: pd.DataFrame, index: bool = False) -> bytes:
    """A DataFrame as UTF-8 CSV, safe to open in a spreadsheet."""
    return neutralize_formulas(df.reset_index() if index else df).to_csv(index=False).encode()


def export_run(run: StoredRun, out_dir: str | os.PathLike[str]) -> list[Path]:
    """Write <table>.csv for every table and device_summary.csv into out_dir; returns the paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    meta = pd.DataFrame([{k: v for k, v in run.meta.items()}])
    tables = [(t, findings_of(run) if t == "findings" else run.table(t), False) for t in TABLES]
    for name, df, index in [("run", meta, False), *tables, ("device_summary", summary_of(run), True)]:
        path = out / f"{name}.csv"
        path.write_bytes(to_csv_bytes(df, index=index))
        written.append(path)
    return written

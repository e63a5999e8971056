"""CSV as dpprof writes it: safe to open in a spreadsheet, floats without binary noise, metadata as one row."""
from __future__ import annotations

import re

import pandas as pd

__all__ = ["to_csv_bytes", "formula_like", "neutralize_formulas", "meta_frame", "CSV_FLOAT_FORMAT"]

# OWASP's CSV-injection rule: a cell a spreadsheet may run as a formula begins with = + - @, or with TAB or CR
# (LF too: some spreadsheets drop leading whitespace and line breaks, then read the = after them).
_FORMULA_LIKE = re.compile(r"[\t\r\n]|[\s\x00-\x1f\x7f]*[=+\-@]")
# 15 significant digits: every digit a float64 holds exactly, without binary noise such as 19.649437600000006
# (written 19.6494376), and whole numbers (bytes) without ".0".
CSV_FLOAT_FORMAT = "%.15g"


def formula_like(value: object) -> bool:
    """Whether a spreadsheet may run a text cell as a formula: it begins with = + - or @, after any whitespace
    and control characters, or with a TAB, CR or LF (OWASP's CSV-injection guidance)."""
    return isinstance(value, str) and _FORMULA_LIKE.match(value) is not None


def neutralize_formulas(df: pd.DataFrame) -> pd.DataFrame:
    """Prefix text cells that a spreadsheet may run as a formula (formula_like) with a quote."""
    out = df.copy()
    for col in out.columns:
        if out[col].dtype == object or pd.api.types.is_string_dtype(out[col].dtype):  # pandas 3: str dtype
            out[col] = out[col].map(lambda v: f"'{v}" if formula_like(v) else v)
    return out


def to_csv_bytes(df: pd.DataFrame, index: bool = False) -> bytes:
    """A DataFrame as UTF-8 CSV, safe to open in a spreadsheet, floats without binary noise."""
    return neutralize_formulas(df.reset_index() if index else df).to_csv(
        index=False, float_format=CSV_FLOAT_FORMAT).encode()


def _flat(prefix: str, value: object) -> dict[str, object]:
    if isinstance(value, dict):
        return {k: v for key, item in value.items() for k, v in _flat(f"{prefix}.{key}", item).items()}
    if isinstance(value, (list, tuple)):
        return {prefix: ",".join(str(v) for v in value)}
    return {prefix: value}


def meta_frame(meta: dict[str, object]) -> pd.DataFrame:
    """A run's metadata as one CSV row: lists as comma-separated text (devices "cpu:0,cpu:1"), dicts as one
    column per key ("workload_args.batch_size"): no Python list or dict text in a cell."""
    row: dict[str, object] = {}
    for key, value in meta.items():
        row.update(_flat(key, value))
    return pd.DataFrame([row])

"""Tables and labels as people read them: units in headers, bytes in MiB, two decimals; a run's short label."""
from __future__ import annotations

import re
from typing import Any

import pandas as pd

from dpprof.plaintext import capitalized
from dpprof.units import bytes_unit, plural

__all__ = ["DISPLAY_DECIMALS", "batch_words", "display_table", "dropped_records", "finding_heading", "run_label", "sentence",
           "status_sentence"]

# Column-name endings and the unit people read them in: (ending, unit, scale).
_UNITS = (("_bytes_per_s", "MiB/s", 2**-20), ("_bytes", "MiB", 2**-20), ("_ms", "ms", 1.0), ("_pct", "%", 1.0),
          ("_per_s", "per s", 1.0),
          ("_s", "s", 1.0), ("_w", "W", 1.0), ("_c", "°C", 1.0), ("_mhz", "MHz", 1.0))
DISPLAY_DECIMALS = 2  # a table shows hundredths of a millisecond, a MiB or a percent; CSVs keep every digit
# Bytes per something (a step, a call): in KiB, MiB or GiB by size (dpprof.units.bytes_unit), "bytes per step (KiB)".
_BYTES_PER = re.compile(r"(?:.*_)?bytes_per_(?!s$)[a-z]+")


def display_table(df: pd.DataFrame) -> pd.DataFrame:
    """A table as people read it: headers in words with their unit ("apply mean (ms)"), bytes in MiB (GiB
    where a column reaches one, KiB where it stays under one MiB: dpprof.units.bytes_unit), numbers to
    DISPLAY_DECIMALS places, whole-number columns as integers."""
    out = pd.DataFrame(index=df.index)
    for col in df.columns:
        values, name = df[col], str(col)
        if values.dtype == object and values.map(lambda v: v is None or isinstance(v, (int, float))).all():
            values = pd.to_numeric(values)  # a column of None and numbers (an all-missing measurement) is numeric
        if _BYTES_PER.fullmatch(name) and pd.api.types.is_numeric_dtype(values) and not pd.api.types.is_bool_dtype(values):
            unit, scale = bytes_unit(float(values.abs().max()) if values.notna().any() else 0.0)
            values, name = values * scale, f"{name} ({unit})"
        for ending, unit, scale in _UNITS if not name.endswith(")") else ():
            if name.endswith(ending) and pd.api.types.is_numeric_dtype(values) and not pd.api.types.is_bool_dtype(values):
                if unit == "MiB":  # bytes in the unit the column reads best in: KiB, MiB or GiB by its largest
                    unit, scale = bytes_unit(float(values.abs().max()) if values.notna().any() else 0.0)
                values, name = values * scale, f"{name[: -len(ending)]} ({unit})"
                break
        if pd.api.types.is_float_dtype(values):
            finite = values.dropna()
            whole = len(finite) and (finite == finite.round()).all() and finite.abs().max() < 2**53
            values = values.round().astype("Int64") if whole and _unit_free(name) else values.round(DISPLAY_DECIMALS)
        out[name.replace("_", " ")] = values
    return out


def _unit_free(header: str) -> bool:
    """Whether a display header is a count (no unit in parentheses): such columns show as integers."""
    return not header.endswith(")")


def finding_heading(severity: str, device: object, title: str) -> str:
    """A finding's heading: its severity, its device where it has one that the title does not begin with, and
    the title: "WARNING · cpu:2: apply is slow", "WARNING: cpu:2 is the straggler" (not "cpu:2: cpu:2 is ...")."""
    if isinstance(device, str) and device and not title.startswith(device):
        return f"{severity.upper()} · {device}: {title}"
    return f"{severity.upper()}: {title}"


def run_label(meta: dict[str, Any] | pd.Series, status: bool = False) -> str:
    """A short, unique label for a run: its name and the random end of its id (and its status, for pickers)."""
    label = f"{meta.get('name') or meta['id']} · {meta['id'][-6:]}"
    return f"{label} · {meta['status']}" if status else label


def sentence(text: str) -> str:
    """Text as a sentence: a capital first letter and a full stop."""
    text = text.strip()
    return capitalized(text).rstrip(".") + "." if text else text


def dropped_records(meta: dict[str, Any] | pd.Series) -> str | None:
    """What a run lost to a full buffer or a full disk, in words ("1,200 records were dropped: the writer fell
    behind"); None when it dropped nothing. ``dpprof show`` and the dashboard's run header both say it so."""
    count = meta.get("dropped_records")
    if not count:
        return None
    why = "the disk was full" if meta.get("status") == "disk_full" else "the writer fell behind"
    return f"{int(count):,} records were dropped: {why}"


def status_sentence(status: str, error: str | None) -> tuple[str, str | None] | None:
    """What a run's status means for what is shown of it, for the dashboard's run header and ``dpprof show``:
    (the sentence, and the error to show verbatim below it where it is a traceback or a long line, else None);
    None for a finished run, or a running one (each place says how it follows a running run)."""
    if status == "disk_full":
        return ("The disk filled while this run recorded: the steps committed before are shown, the rest were not "
                "recorded." + (f" {error}" if error else ""), None)
    if status == "interrupted" and error:
        return f"The run was {error}.", None
    if status in ("failed", "incomplete") and error:
        return f"The run {'failed' if status == 'failed' else 'is incomplete'}:", error
    if status == "incomplete":
        return ("The run is incomplete: its process stopped without closing it (killed, or the machine went down). "
                "What it recorded until then is shown.", None)
    return None


def batch_words(stats: dict[str, Any], ranks: int = 1) -> str:
    """The run's batch (queries.batch_sizes), a distributed run's said to be its ranks' together, and where steps ran
    others, how many and their range: "16", "60 across 2 ranks", "16 (9 of 10 steps; 16 to 256)", "-" for none.
    ``dpprof show`` and the Overview's samples/s say it so."""
    batch = stats.get("batch_size")
    if batch is None:
        return "-"
    said = f"{batch:,}" + (f" across {ranks} ranks" if ranks > 1 else "")
    if stats.get("batch_size_min") == stats.get("batch_size_max"):
        return said
    return (f"{said} ({stats['batch_size_steps']:,} of {plural(stats['batch_steps'], 'step')}; "
            f"{stats['batch_size_min']:,} to {stats['batch_size_max']:,})")


# ranks named one by one where a run's step counts differ; more are counted ("on 127 of 128 ranks")
RANKS_NAMED = 4


def _ranks_words(named: list[int], ranks: int) -> str:
    """"rank 1", "ranks 0, 2", or "127 of 128 ranks" past RANKS_NAMED."""
    if len(named) > RANKS_NAMED:
        return f"{len(named):,} of {ranks:,} ranks"
    return f"rank{'s' if len(named) > 1 else ''} {', '.join(str(r) for r in named)}"


def steps_per_rank(stats: dict[str, Any], ranks: int) -> str:
    """Where a distributed run's steps are, after its step count (queries.run_stats): " on each of 2 ranks", or, where
    its ranks hold different counts (a rank's profiler cut short, a Join's uneven inputs), " on rank 0, 6 on rank 1";
    "" for one process. ``dpprof show`` and the Overview say it so."""
    if ranks < 2:
        return ""
    if stats.get("steps_fewest", stats["steps"]) == stats["steps"]:
        return f" on each of {ranks} ranks"
    most = stats.get("ranks_most") or []
    where = _ranks_words(most, ranks) if most else f"the most of {ranks} ranks"
    return f" on {where}, {stats['steps_fewest']:,} on {_ranks_words(stats['ranks_fewest'], ranks)}"

"""The Operators page of one run: its operators per rank and device (by name, or by name and input shapes), the
top operators by self time, the module tree where the run has one, and two devices, ranks or runs side by side
(dpprof.views.opdiff)."""
from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from dpprof.store import detail_rows
from dpprof.store.reader import StoredRun
from dpprof.views.opdiff import Pick, picks_of

__all__ = ["TOP_OPERATORS", "OperatorsPage", "operators_page", "missing_text", "picks", "operator_table",
           "top_operators", "module_tree", "notes"]

TOP_OPERATORS = 15  # bars in the top-N chart: more names than this no longer read on one screen


def missing_text(run: StoredRun) -> str | None:
    """Why the run has no operators and what to do (one sentence), or None where it has them."""
    why = detail_rows.detail_missing(run)
    if why is not None:
        return why[0].upper() + why[1:] + "."
    if detail_rows.operators(run, top=1).empty:
        return ("No operators in this run's trace: it holds no cpu_op events (profile with torch.profiler's "
                "default activities, ProfilerActivity.CPU included).")
    return None


def picks(run: StoredRun) -> list[Pick]:
    """Every (rank, device) that has operators."""
    return picks_of(run)


def operator_table(run: StoredRun, pick: Pick, by: str = "name", search: str | None = None) -> pd.DataFrame:
    """The pick's operators (detail_rows.operators), by host total time; the ``rank`` and ``device`` columns kept
    only where the pick covers several."""
    df = detail_rows.operators(run, by=by, rank=pick.rank, device=pick.device, search=search or None)
    return _drop_fixed(df, pick)


def _drop_fixed(df: pd.DataFrame, pick: Pick) -> pd.DataFrame:
    drop = [c for c, v in (("rank", pick.rank), ("device", pick.device)) if v is not None]
    return df.drop(columns=drop)


def top_operators(run: StoredRun, pick: Pick, top: int = TOP_OPERATORS) -> tuple[pd.DataFrame, str]:
    """The ``top`` operators by device self time (host self time on a run without kernels), and the column used:
    columns name, host_self_ms, device_self_ms, summed over the pick's ranks and devices."""
    ops = detail_rows.operators(run, rank=pick.rank, device=pick.device)
    summed = ops.groupby("name", sort=False)[["host_self_ms", "device_self_ms"]].sum(min_count=1).reset_index()
    value = "device_self_ms" if (summed["device_self_ms"].fillna(0) > 0).any() else "host_self_ms"
    return summed.nlargest(top, value, keep="first").reset_index(drop=True), value


def module_tree(run: StoredRun, pick: Pick) -> pd.DataFrame:
    """The nn.Module tree (detail_rows.modules) of the pick, each path indented by its depth in ``module_path``;
    empty where the trace has no module ids (profiled without with_stack and with_modules)."""
    df = detail_rows.modules(run, rank=pick.rank, device=pick.device)
    if df.empty:
        return df
    depth = df["path"].str.count("/")
    df.insert(df.columns.get_loc("path"), "module_path",
              ["\u2003" * int(d) + str(p).rsplit("/", 1)[-1] for d, p in zip(depth, df["path"])])
    return _drop_fixed(df.drop(columns=["parent"]), pick)


def notes(run: StoredRun) -> list[str]:
    """What the import left out of the operator, kernel and memory tables, one line each."""
    return detail_rows.detail_notes(run)


@dataclass
class OperatorsPage:
    """What the Operators page shows for one pick, read in one go (one opening of the run)."""

    top: pd.DataFrame  # top_operators
    value: str  # the column the top operators are chosen by
    table: pd.DataFrame  # operator_table
    tree: pd.DataFrame  # module_tree
    notes: list[str]


def operators_page(run: StoredRun, pick: Pick, by: str = "name", search: str | None = None) -> OperatorsPage:
    """The Operators page's data for a pick: its top operators, its table (``by``, ``search``), its module tree and
    the import's notes."""
    top, value = top_operators(run, pick)
    return OperatorsPage(top=top, value=value, table=operator_table(run, pick, by, search),
                         tree=module_tree(run, pick), notes=notes(run))

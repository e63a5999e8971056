"""Side by side: the operators and kernels of two devices, two ranks or two runs, and the difference per operator
and kernel, largest first (the TensorBoard plugin's Diff view, per device), with the sentence that says it.

A side is a run and a ``Pick`` (a rank, a device, or both; None: all of them summed). Times are the stored ones
(dpprof.store.detail_rows): ``delta_ms`` is B's self time less A's, on the device where both sides ran kernels,
else on the host. Self time, so that the deltas of nested operators do not count the same kernel twice: the
deltas sum to the difference of the two sides' whole time. Where the sides' tables span different step counts (two
ranks of an imported job whose profilers held different steps, two runs' captures of different lengths), each
rank's calls and times are scaled to side B's steps first (``at_steps``), and the sentence says so.
"""
from __future__ import annotations

import re

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import pandas as pd

from dpprof.store import detail_rows
from dpprof.store.reader import StoredRun
from dpprof.units import plural

__all__ = ["Pick", "DIFF_COLUMNS", "KERNEL_DIFF_COLUMNS", "SAME_CALLS_TOLERANCE", "operator_diff", "kernel_diff",
           "diff_rows", "side_of", "others_mean_of", "clock_of", "diff_sentence", "picks_of", "at_steps"]

# Two sides made "the same calls" when their counts differ by at most this share (a sampled trace drops a few)
SAME_CALLS_TOLERANCE = 0.01
DIFF_COLUMNS = ["name", "calls_a", "calls_b", "host_total_ms_a", "host_total_ms_b", "device_total_ms_a",
                "device_total_ms_b", "self_ms_a", "self_ms_b", "delta_ms", "ratio"]
KERNEL_DIFF_COLUMNS = ["name", "calls_a", "calls_b", "total_ms_a", "total_ms_b", "delta_ms", "ratio"]
_SUMMED = ["calls", "host_total_ms", "host_self_ms", "device_total_ms", "device_self_ms"]


@dataclass(frozen=True)
class Pick:
    """One side's rank and device (None: every rank, every device, summed)."""

    rank: int | None = None
    device: str | None = None

    def label(self, run: StoredRun | None = None) -> str:
        """"cuda:2", "rank 1 cuda:0", "rank 1" (a rank's own device, rank:1: a DDP or FSDP rank on CPU, an imported
        rank file), or the run's name where the pick is the whole run."""
        own = re.fullmatch(r"rank:(\d+)", self.device or "")  # a rank's own device: said as the rank
        if own and self.rank in (None, int(own[1])):
            return f"rank {own[1]}"
        parts = [f"rank {self.rank}" if self.rank is not None else "", self.device or ""]
        text = " ".join(p for p in parts if p)
        if run is not None and not text:
            return str(run.meta.get("name") or run.id)
        return text or "all devices"


def picks_of(run: StoredRun) -> list[Pick]:
    """Every (rank, device) of the run that holds operators, in order (the rank None in a run of one rank)."""
    ops = detail_rows.operators(run)
    pairs = ops[["rank", "device"]].drop_duplicates().sort_values(["rank", "device"])
    one = pairs["rank"].nunique() <= 1
    return [Pick(None if one else int(r), str(d)) for r, d in pairs.itertuples(index=False, name=None)]


def side_of(ops: pd.DataFrame, pick: Pick) -> pd.DataFrame:
    """One side from a frame of detail_rows.operators rows: the pick's operators by name, summed over the ranks and
    devices it covers (columns name, calls and the host and device times)."""
    sel = ops
    if pick.rank is not None:
        sel = sel[sel["rank"] == pick.rank]
    if pick.device is not None:
        sel = sel[sel["device"] == pick.device]
    return sel.groupby("name", sort=False)[_SUMMED].sum(min_count=1).reset_index()


def others_mean_of(ops: pd.DataFrame, pick: Pick) -> pd.DataFrame:
    """From a frame of detail_rows.operators rows: the mean per operator of every (rank, device) other than the
    pick's, by name, as one side (what a slow device is compared with). An operator a device lacks counts as 0
    there."""
    pairs = ops[["rank", "device"]].drop_duplicates().itertuples(index=False, name=None)
    others = [Pick(int(r), str(d)) for r, d in pairs
              if not ((pick.rank is None or r == pick.rank) and (pick.device is None or d == pick.device))]
    if not others:
        return pd.DataFrame({c: [] for c in ["name", *_SUMMED]})
    frames = [side_of(ops, p).set_index("name")[_SUMMED] for p in others]
    names = pd.Index(sorted(set().union(*[f.index for f in frames])), name="name")
    stacked = [f.reindex(names) for f in frames]
    summed = sum(f.astype(float).fillna(0.0) for f in stacked) / len(stacked)
    assert isinstance(summed, pd.DataFrame)
    device_any = pd.concat([f["device_total_ms"] for f in stacked], axis=1).notna().any(axis=1)
    for col in ("device_total_ms", "device_self_ms"):  # a CPU-only side keeps its device times missing
        summed[col] = summed[col].where(device_any)
    return summed.reset_index()


def clock_of(a: pd.DataFrame, b: pd.DataFrame) -> str:
    """"device" where both sides ran kernels, else "host": the time the difference is taken on."""
    def has_device(df: pd.DataFrame) -> bool:
        return bool(len(df)) and bool((df["device_self_ms"].fillna(0) > 0).any())
    return "device" if has_device(a) and has_device(b) else "host"


def diff_rows(a: pd.DataFrame, b: pd.DataFrame) -> pd.DataFrame:
    """Two sides' operators by name (columns name and detail_rows.operators' times) set side by side: DIFF_COLUMNS,
    largest difference first (by its size, slower or faster). An operator one side lacks has 0 calls and time there.
    """
    clock = clock_of(a, b)
    left = a.set_index("name")[_SUMMED].add_suffix("_a")
    right = b.set_index("name")[_SUMMED].add_suffix("_b")
    both = left.join(right, how="outer")
    for side in ("a", "b"):
        both[f"calls_{side}"] = both[f"calls_{side}"].fillna(0)
        both[f"self_ms_{side}"] = both[f"{clock}_self_ms_{side}"].fillna(0.0).astype(float)
    both["delta_ms"] = both["self_ms_b"] - both["self_ms_a"]
    both["ratio"] = np.where(both["self_ms_a"] > 0, both["self_ms_b"] / both["self_ms_a"].where(both["self_ms_a"] > 0),
                             np.nan)
    both = both.reset_index()
    both = both.loc[both["delta_ms"].abs().sort_values(ascending=False, kind="stable").index]
    out = both[DIFF_COLUMNS].reset_index(drop=True)
    out.attrs["clock"] = clock
    return out


def at_steps(ops: pd.DataFrame, held: Mapping[int, int], steps: int) -> pd.DataFrame:
    """Rows of detail_rows.operators (or kernels) with each rank's calls and times scaled from the steps its tables
    span (``held``: rank -> steps, detail_rows.detail_steps_of) to ``steps``, so that totals over different step
    counts are set side by side over as many; a rank ``held`` lacks is left as it is."""
    factor = ops["rank"].map(lambda r: steps / held[int(r)] if held.get(int(r)) else 1.0).astype(float)
    if (factor == 1.0).all():
        return ops
    summed = [c for c in (*_SUMMED, "total_ms") if c in ops.columns]
    return ops.assign(**{c: ops[c].astype(float) * factor for c in summed})


def _scaled_from(ops: pd.DataFrame, held: Mapping[int, int], steps: int) -> dict[int, int]:
    """The ranks of ``ops`` whose tables span another step count than ``steps``, with theirs."""
    ranks = sorted({int(r) for r in ops["rank"].dropna()})
    return {r: held[r] for r in ranks if held.get(r) and held[r] != steps}


def _side_steps(ops: pd.DataFrame, held: Mapping[int, int], fallback: int) -> int:
    """How many steps a side's tables span: its rank's (the most of its ranks' where they differ)."""
    return max((held[int(r)] for r in ops["rank"].dropna().unique() if held.get(int(r))), default=fallback)


def operator_diff(run_a: StoredRun, pick_a: Pick, run_b: StoredRun, pick_b: Pick | None = None,
                  against_others: bool = False) -> pd.DataFrame:
    """Operators of side A and side B by name, with B's difference from A: DIFF_COLUMNS, largest first.

    Args:
        run_a, pick_a: side A (the reference).
        run_b, pick_b: side B (the one explained: the slow device, the new run).
        against_others: A is the mean of every device of ``run_a`` other than ``pick_b`` (``pick_a`` unused).

    Returns:
        name, calls_a, calls_b, host_total_ms_a/_b, device_total_ms_a/_b (NaN on a CPU-only side), self_ms_a/_b
        (self time on the clock the difference is taken on: ``df.attrs["clock"]``, "device" or "host"),
        delta_ms (self_ms_b - self_ms_a), ratio (self_ms_b / self_ms_a; NaN where A has none). Every figure is
        over B's steps (``df.attrs["steps"]``): a rank whose tables span another count has its calls and times
        scaled to it (``df.attrs["scaled_a"]``, ``["scaled_b"]``: rank -> the steps it held; ``["ranks_a"]``,
        ``["ranks_b"]``: how many ranks each side covers), which diff_sentence says.

    Example:
        >>> operator_diff(run, Pick(device="cuda:0"), run, Pick(device="cuda:2")).head(3)
    """
    pick_b = pick_b or Pick()
    ops_b = detail_rows.operators(run_b, rank=pick_b.rank, device=pick_b.device)
    ops_a = detail_rows.operators(run_a) if against_others else \
        detail_rows.operators(run_a, rank=pick_a.rank, device=pick_a.device)
    held_b = detail_rows.detail_steps_of(run_b)
    held_a = held_b if run_a is run_b else detail_rows.detail_steps_of(run_a)
    steps = _side_steps(ops_b, held_b, detail_rows.detail_step_count(run_b))
    a = others_mean_of(at_steps(ops_a, held_a, steps), pick_b) if against_others else \
        side_of(at_steps(ops_a, held_a, steps), pick_a)
    out = diff_rows(a, side_of(at_steps(ops_b, held_b, steps), pick_b))
    if against_others:  # side A is every rank and device but B's
        ops_a = ops_a[~((pick_b.rank is None or ops_a["rank"] == pick_b.rank)
                        & (pick_b.device is None or ops_a["device"] == pick_b.device))]
    out.attrs.update(steps=steps, scaled_a=_scaled_from(ops_a, held_a, steps),
                     scaled_b=_scaled_from(ops_b, held_b, steps), ranks_a=int(ops_a["rank"].nunique()),
                     ranks_b=int(ops_b["rank"].nunique()))
    return out


def kernel_diff(run_a: StoredRun, pick_a: Pick, run_b: StoredRun, pick_b: Pick) -> pd.DataFrame:
    """Kernels of side A and side B by name: KERNEL_DIFF_COLUMNS (delta_ms = B's total less A's), largest first; over
    B's steps, as operator_diff's (``df.attrs["steps"]``, ``["scaled_a"]``, ``["scaled_b"]``)."""
    k_a = detail_rows.kernels(run_a, rank=pick_a.rank, device=pick_a.device)
    k_b = detail_rows.kernels(run_b, rank=pick_b.rank, device=pick_b.device)
    held_b = detail_rows.detail_steps_of(run_b)
    held_a = held_b if run_a is run_b else detail_rows.detail_steps_of(run_a)
    steps = _side_steps(k_b, held_b, detail_rows.detail_step_count(run_b))

    def side(k: pd.DataFrame, held: Mapping[int, int]) -> pd.DataFrame:
        k = at_steps(k, held, steps)
        return k.groupby("name", sort=False)[["calls", "total_ms"]].sum().reset_index().set_index("name")
    both = side(k_a, held_a).add_suffix("_a").join(side(k_b, held_b).add_suffix("_b"), how="outer")
    both = both.fillna(0).reset_index()
    both["delta_ms"] = both["total_ms_b"] - both["total_ms_a"]
    both["ratio"] = both["total_ms_b"] / both["total_ms_a"].where(both["total_ms_a"] > 0)
    both = both.loc[both["delta_ms"].abs().sort_values(ascending=False, kind="stable").index]
    out = both[KERNEL_DIFF_COLUMNS].reset_index(drop=True)
    out.attrs.update(steps=steps, scaled_a=_scaled_from(k_a, held_a, steps), scaled_b=_scaled_from(k_b, held_b, steps))
    return out


def _calls_text(a: float, b: float) -> str:
    if a == b or (a and abs(b - a) / a <= SAME_CALLS_TOLERANCE):
        return "same calls"
    return f"{b:,.0f} calls against {a:,.0f}"


def _scaled_text(label: str, scaled: Mapping[int, int] | None, ranks: int) -> str:
    """"rank 0's totals scaled from 2 steps" (a side of one rank), "job's totals with rank 1's scaled from 1 step"
    (a side of several): what operator_diff scaled to B's steps; "" where nothing was."""
    if not scaled:
        return ""
    if ranks <= 1 or (len(scaled) == ranks and len(set(scaled.values())) == 1):  # one count for the whole side
        return f"{label}'s totals scaled from {plural(next(iter(scaled.values())), 'step')}"
    return f"{label}'s totals with " + ", ".join(f"rank {r}'s scaled from {plural(n, 'step')}"
                                                 for r, n in scaled.items())


def diff_sentence(diff: pd.DataFrame, label_a: str, label_b: str, top: int = 3, quote: str = "`",
                  steps: int | None = None) -> str:
    """"cuda:2 is 4.1 ms slower than cuda:0 on the device: `aten::cudnn_convolution` +3.2 ms (same calls, 1.8x the
    time), ..." from ``operator_diff``: the whole difference, then the operators that explain most of it (each name
    between ``quote``s: backticks for markdown, quotes for plain text), or that a side has none; ``steps``: the
    sides' step count, said;
    without it, operator_diff's (``diff.attrs``), with the sides it scaled to them ("over 1 step (rank 0's totals
    scaled from 2 steps)")."""
    if diff.empty:
        return f"Neither {label_a} nor {label_b} has operators to compare."
    for label, side, other in ((label_b, "b", label_a), (label_a, "a", label_b)):
        if not (diff[f"calls_{side}"].fillna(0) > 0).any():  # not "faster" by all of the other's time
            return f"{label} has no operators to compare with {other}'s: its trace or capture holds none."
    clock = diff.attrs.get("clock", "host")
    total = float(diff["delta_ms"].sum())
    word = "slower" if total > 0 else "faster"
    steps = steps or diff.attrs.get("steps")
    over = f" over {plural(steps, 'step')}" if steps else ""
    scaled = [_scaled_text(label, diff.attrs.get(f"scaled_{side}"), diff.attrs.get(f"ranks_{side}", 1))
              for label, side in ((label_a, "a"), (label_b, "b"))]
    if any(scaled):
        over += f" ({'; '.join(t for t in scaled if t)})"
    lead = f"{label_b} is {abs(total):.1f} ms {word} than {label_a} in {clock} self time{over}"
    same_sign = diff[np.sign(diff["delta_ms"]) == np.sign(total)] if total else diff
    parts = []
    for row in same_sign.head(top).itertuples(index=False):
        if not row.self_ms_b:
            times = f"none in {label_b}"
        else:
            times = f"{row.ratio:.1f}x the time" if pd.notna(row.ratio) else f"none in {label_a}"
        parts.append(f"{quote}{row.name}{quote} {row.delta_ms:+.1f} ms ({_calls_text(row.calls_a, row.calls_b)}, {times})")
    return lead + (": " + ", ".join(parts) if parts else "") + "."

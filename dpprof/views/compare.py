"""The Compare page: two or more runs side by side (step time, phase shares, per-device memory) and what
differs, in sentences against the first run (the baseline)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pandas as pd

from dpprof.findings import imbalance
from dpprof.records import DP_TAX_PHASES
from dpprof.store import queries
from dpprof.store.reader import StoredRun
from dpprof.units import mib
from dpprof.views.text import run_label

__all__ = ["Comparison", "ComparePart", "compare_part", "combine", "compare", "default_compare"]


@dataclass
class Comparison:
    """Two or more runs side by side, and what differs, in sentences."""

    summary: pd.DataFrame  # one row per run
    steps: pd.DataFrame  # run, step, duration_ms
    shares: pd.DataFrame  # run, phase, share_pct, per_step_ms
    memory: pd.DataFrame  # run, device, output_device, peak_held_bytes, peak_allocated_bytes
    differences: list[str]


@dataclass
class ComparePart:
    """One run's share of a comparison (cached per run by the app)."""

    row: dict[str, Any]
    shares: pd.DataFrame
    memory: pd.DataFrame
    steps: pd.DataFrame


def _value(x: Any) -> Any:
    """A value or None: NaN, pandas' NA and numpy scalars made plain."""
    if x is None or (not isinstance(x, str) and pd.isna(x)):
        return None
    return x.item() if hasattr(x, "item") else x


def compare_part(run: StoredRun, max_points: int = 1_000) -> ComparePart:
    """What a comparison needs of one run: its summary row, phase shares, memory and step times."""
    model = run.model
    stats = queries.run_stats(run)
    totals = queries.phase_totals(run, stats)
    memory = queries.memory_peaks(run, detail=False)
    held = memory.dropna(subset=["peak_held_bytes"])
    samples = queries.work_samples(run, skip_first=True)
    found = imbalance(samples.pivot_table(index="step", columns="device", values="duration_ms")) if len(samples) else None
    label = run_label(run.meta)
    share = totals.set_index("phase")["share_pct"] if not totals.empty else pd.Series(dtype=float)
    median, batch = stats["median_step_ms"], stats["batch_size"]
    is_out = held["output_device"].astype(bool)
    row = {
        "run": label, "id": run.meta["id"], "kind": model.title, "status": run.meta["status"],
        "backend": model.backend_label, "devices": len(model.devices), "workload": run.meta.get("workload"),
        "steps": stats["steps"], "batch_size": batch, "median_step_ms": median, "mean_step_ms": stats["mean_step_ms"],
        "samples_per_s": batch / median * 1e3 if batch and median else None,
        "dp_tax_pct": (float(share.reindex(list(DP_TAX_PHASES)).fillna(0).sum())
                       if model.dataparallel and len(share) else None),
        "work": model.work.label,
        "imbalance_ratio": found.ratio if found is not None else None,
        "balanced": model.kind == "balanced",
        "fullest_device": held.loc[held["peak_held_bytes"].idxmax(), "device"] if len(held) else None,
        "fullest_device_peak_held_bytes": float(held["peak_held_bytes"].max()) if len(held) else None,
        "memory_most_to_least": (float(held["peak_held_bytes"].max() / held["peak_held_bytes"].min())
                                 if len(held) > 1 and held["peak_held_bytes"].min() > 0 else None),
        "output_device_peak_held_bytes": float(held.loc[is_out, "peak_held_bytes"].max()) if is_out.any() else None,
        "other_devices_peak_held_bytes": float(held.loc[~is_out, "peak_held_bytes"].mean()) if (~is_out).any() else None,
    }
    for phase, value in share.items():
        row[f"{phase}_share_pct"] = _value(float(value))
    return ComparePart(
        row=row, shares=totals.assign(run=label)[["run", "phase", "share_pct", "per_step_ms"]],
        memory=held.assign(run=label)[["run", "device", "output_device", "peak_held_bytes", "peak_allocated_bytes"]],
        steps=queries.step_times(run, max_points).assign(run=label)[["run", "step", "duration_ms"]])


def combine(parts: list[ComparePart]) -> Comparison:
    """Runs side by side, the differences stated against the first run (the baseline)."""
    summary = pd.DataFrame([p.row for p in parts])
    summary["batch_size"] = summary["batch_size"].astype("Int64")  # a batch is a count, also beside a run without one
    return Comparison(summary=summary, steps=pd.concat([p.steps for p in parts], ignore_index=True),
                      shares=pd.concat([p.shares for p in parts], ignore_index=True),
                      memory=pd.concat([p.memory for p in parts], ignore_index=True),
                      differences=_differences([p.row for p in parts]))


def compare(runs: list[StoredRun]) -> Comparison:
    """Two or more runs side by side: step time, phase shares, per-device memory, and what differs.

    The differences are stated against the first run (the baseline).
    """
    return combine([compare_part(run) for run in runs])


def default_compare(runs: pd.DataFrame, chosen: str | None) -> tuple[list[str], str | None]:
    """The pair Compare opens on: the run open in the sidebar and the newest finished run of the same workload
    (the older first, as the baseline); or no pair and what is needed, in words.

    Args:
        runs: the readable runs of dpprof.list_runs, newest first.
        chosen: the id of the run open in the sidebar.
    """
    match = runs[runs["id"] == chosen]
    if match.empty:
        return [], "Choose a run in the sidebar (or two or more below) to compare."
    row = match.iloc[0]
    if not row["steps"] or pd.isna(row["steps"]):
        return [], (f"The open run, {row['name'] or row['id']}, recorded no steps: there is nothing to compare. "
                    "Choose another run in the sidebar, or runs below.")
    others = runs[(runs["id"] != chosen) & (runs["status"] == "finished") & (runs["steps"].fillna(0) > 0)
                  & (runs["workload"].fillna("") == (row["workload"] or ""))]
    if others.empty:
        return [], (f"Comparing needs a second finished run of {row['workload'] or 'the same model'} besides "
                    f"{row['name'] or row['id']}: record one on the New run page (for example with --balanced or "
                    "another number of devices), or choose runs below.")
    pair = pd.concat([match, others.iloc[[0]]]).sort_values("created_at")
    return pair["id"].tolist(), None


def _times_text(a: float, b: float) -> str:
    """b's time against a's: "0.77x the time (23% faster)"."""
    r = b / a
    change = f" ({1 - r:.0%} faster)" if r < 0.995 else f" ({r - 1:.0%} slower)" if r > 1.005 else ""
    return f"{r:.2f}x the time{change}"


def _bytes_text(a: float, b: float) -> str:
    """b's bytes against a's: "1.20x (20% more)"."""
    r = b / a
    return f"{r:.2f}x" + (f" ({1 - r:.0%} less)" if r < 0.995 else f" ({r - 1:.0%} more)" if r > 1.005 else "")


_PHASE_NAMES = {"parallel_apply": "apply (all devices)", "rest": "the rest of the step",
                "backward_compute": "backward compute", "comm_wait": "the wait for the all-reduce"}


def _differences(rows: list[dict[str, Any]]) -> list[str]:
    """Sentences: how each run differs from the first. A figure one of the two runs does not have (an imported
    trace has no batch size) is left out, never written as nan."""
    if len(rows) < 2:
        return []
    base = {k: _value(v) for k, v in rows[0].items()}
    out = []
    for other in ({k: _value(v) for k, v in r.items()} for r in rows[1:]):
        a, b = base["run"], other["run"]
        if base["kind"] != other["kind"]:
            out.append(f"{b} is {other['kind']}, {a} {base['kind']}.")
        elif base["devices"] != other["devices"] or base["backend"] != other["backend"]:
            out.append(f"{b} runs on {other['devices']} {other['backend']} device(s), {a} on "
                       f"{base['devices']} {base['backend']} device(s).")
        if base["batch_size"] and other["batch_size"] and base["batch_size"] != other["batch_size"]:
            out.append(f"Batch size: {b} {int(other['batch_size']):,}, {a} {int(base['batch_size']):,}.")
        if base["median_step_ms"] and other["median_step_ms"]:
            out.append(f"Median step: {b} {other['median_step_ms']:.2f} ms, {a} {base['median_step_ms']:.2f} ms: "
                       f"{b} takes {_times_text(base['median_step_ms'], other['median_step_ms'])}.")
        if base["samples_per_s"] and other["samples_per_s"]:
            out.append(f"Throughput: {b} {other['samples_per_s']:,.0f} samples/s, {a} "
                       f"{base['samples_per_s']:,.0f} samples/s "
                       f"({other['samples_per_s'] / base['samples_per_s'] - 1:+.0%}).")
        deltas = []
        for col in sorted({c for c in (*base, *other) if c.endswith("_share_pct")}):
            x, y = base.get(col) or 0.0, other.get(col) or 0.0  # a phase one run does not have takes 0% of its step
            deltas.append((abs(y - x), col[: -len("_share_pct")], x, y))
        for _, phase, x, y in sorted(deltas, reverse=True)[:2]:
            if abs(y - x) >= 1.0:
                name = _PHASE_NAMES.get(phase, phase)
                out.append(f"{name[0].upper() + name[1:]}: {y:.1f}% of {b}'s step, {x:.1f}% of {a}'s "
                           f"({y - x:+.1f} points).")
        if base["dp_tax_pct"] is not None and other["dp_tax_pct"] is not None:
            out.append(f"DataParallel tax (scatter + replicate + gather): {b} {other['dp_tax_pct']:.1f}%, "
                       f"{a} {base['dp_tax_pct']:.1f}% of the step.")
        x, y = base["output_device_peak_held_bytes"], other["output_device_peak_held_bytes"]
        if x and y:
            out.append(f"The output device holds {mib(y)} in {b}, {mib(x)} in {a}: {_bytes_text(x, y)}.")
        elif base["fullest_device_peak_held_bytes"] and other["fullest_device_peak_held_bytes"]:
            # a balanced run gathers nothing, so it has no output device: compare the fullest devices
            x, y = base["fullest_device_peak_held_bytes"], other["fullest_device_peak_held_bytes"]
            role = lambda r: ", the output device" if r["output_device_peak_held_bytes"] else ""  # noqa: E731
            out.append(f"The fullest device holds {mib(y)} in {b} ({other['fullest_device']}{role(other)}), "
                       f"{mib(x)} in {a} ({base['fullest_device']}{role(base)}): {_bytes_text(x, y)}.")
        x, y = base["memory_most_to_least"], other["memory_most_to_least"]
        if x and y and abs(x - y) >= 0.05:
            out.append(f"Memory spread (the fullest device over the emptiest): {b} {y:.2f}x, {a} {x:.2f}x.")
        x, y = base["imbalance_ratio"], other["imbalance_ratio"]
        if x and y:
            work = base["work"] if base["work"] == other["work"] else "work"
            out.append(f"Slowest device's median {work} over the others': {b} {y:.2f}x, {a} {x:.2f}x.")
    return out

"""The Compare page: two or more runs side by side (step time, phase shares, per-device memory) and what
differs, in sentences against the first run (the baseline)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import pandas as pd

from dpprof.findings import run_findings
from dpprof.stepmodel import SHARED_OF, SHARED_PART_WORDS, SHARED_PARTS
from dpprof.store import queries
from dpprof.store.reader import StoredRun
from dpprof.units import mib, plural
from dpprof.workload_names import WORKLOAD_NAMES
from dpprof.views.overview import MEMORY_SOURCES, memory_figure
from dpprof.views.text import run_label

TAX = SHARED_OF["scatter"]  # "DataParallel tax": scatter + replicate + gather (records.DP_TAX_PHASES)

__all__ = ["Comparison", "ComparePart", "compare_part", "combine", "compare", "default_compare"]


@dataclass
class Comparison:
    """Two or more runs side by side, and what differs, in sentences."""

    summary: pd.DataFrame  # one row per run
    steps: pd.DataFrame  # run, step (its position in the run, from 0), duration_ms
    # run, phase, share_pct, per_step_ms: each run's parts of the step (dpprof.stepmodel), in its kind's phases
    # when every run is of one kind, else in the vocabulary every kind shares (stepmodel.SHARED_PARTS)
    shares: pd.DataFrame
    # run, device, output_device, peak_bytes (each device's memory figure, as the Overview reads it:
    # overview.memory_figure), memory (that figure in words), peak_held_bytes, peak_allocated_bytes
    memory: pd.DataFrame
    differences: list[str]


@dataclass
class ComparePart:
    """One run's share of a comparison (cached per run by the app)."""

    row: dict[str, Any]
    shares: pd.DataFrame  # its kind's parts of the step
    shared: pd.DataFrame  # the same in the vocabulary every kind shares
    memory: pd.DataFrame
    steps: pd.DataFrame
    parts: tuple[str, ...] = ()  # its kind's part names: runs compare by these when all have the same


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
    figure = memory_figure(memory)  # the Overview's: the allocator's peak allocated where recorded, else held
    peaks = memory.assign(peak_bytes=memory[figure], memory=MEMORY_SOURCES[figure]).dropna(subset=["peak_bytes"])
    peak = peaks["peak_bytes"]
    findings = run_findings(run)
    found = findings.straggler  # the one verdict on the slowest device (its ratio, as the Overview says it)
    label = run_label(run.meta)
    shared = _shared(totals)
    share = shared.set_index("phase")["share_pct"] if not shared.empty else pd.Series(dtype=float)
    median, batch = stats["median_step_ms"], stats["batch_size"]
    rate = queries.throughput(run)
    is_out = peaks["output_device"].fillna(False).astype(bool)
    row = {
        "run": label, "id": run.meta["id"], "kind": model.title, "status": run.meta["status"],
        "backend": model.backend_label, "devices": len(model.devices), "workload": run.meta.get("workload"),
        "steps": stats["steps"], "batch_size": batch, "median_step_ms": median, "mean_step_ms": stats["mean_step_ms"],
        "samples_per_s": rate.samples_per_s if rate is not None else None,  # the Overview's (queries.throughput)
        # the tax finding's figure, per step past the first (Findings.tax), as the Overview says it
        "dp_tax_pct": 100 * findings.tax.share if findings.tax is not None else None,
        "work": found.work if found is not None else model.work.label,  # what imbalance_ratio is the medians of
        # the slowest device's by work (dpprof.findings.imbalance), the Overview's ratio for a straggler it names from the
        # work: a rank named from the collectives is the one that waits least in them, and its own work may be the
        # shortest (an FSDP rank's, its collectives inside, or a rank late outside its work): its ratio read 0.16x for a
        # "slowest" device, and the Overview names such a rank with the others' wait, never a ratio
        "imbalance_ratio": found.found.ratio if found is not None else None,
        "balanced": model.kind == "balanced",
        "memory": MEMORY_SOURCES[figure] if len(peaks) else None,  # what the *_peak_bytes figures are
        "fullest_device": peaks.loc[peak.idxmax(), "device"] if len(peaks) else None,
        "fullest_device_peak_bytes": float(peak.max()) if len(peaks) else None,
        "memory_most_to_least": float(peak.max() / peak.min()) if len(peaks) > 1 and peak.min() > 0 else None,
        "output_device_peak_bytes": float(peak[is_out].max()) if is_out.any() else None,
        "other_devices_peak_bytes": float(peak[~is_out].mean()) if (~is_out).any() else None,
    }
    for phase, value in share.items():
        row[f"{phase}_share_pct"] = _value(float(value))
    steps = queries.step_times(run, max_points)
    # runs compare step by step by position: the first step each recorded is 0 (a trace's may be ProfilerStep#550)
    steps = steps.assign(step=steps["step"] - (stats["first_step"] or 0), run=label)
    cols = ["run", "phase", "share_pct", "per_step_ms"]
    return ComparePart(
        row=row, shares=totals.assign(run=label)[cols], shared=shared.assign(run=label)[cols],
        memory=peaks.assign(run=label)[["run", "device", "output_device", "peak_bytes", "memory", "peak_held_bytes",
                                        "peak_allocated_bytes"]],
        steps=steps[["run", "step", "duration_ms"]], parts=tuple(totals["phase"]) if len(totals) else ())


def _shared(totals: pd.DataFrame) -> pd.DataFrame:
    """A run's parts of the step (queries.phase_totals) in the vocabulary every kind shares (stepmodel.SHARED_OF),
    in SHARED_PARTS' order; parts sum as they did, so the shares still add up to the step."""
    cols = ["phase", "total_ms", "per_step_ms", "share_pct"]
    if totals.empty:
        return pd.DataFrame(columns=cols)
    named = totals.assign(phase=totals["phase"].map(lambda p: SHARED_OF.get(p, "compute")))
    out = named.groupby("phase", sort=False)[["total_ms", "per_step_ms", "share_pct"]].sum()
    return out.reindex([p for p in SHARED_PARTS if p in out.index]).reset_index()[cols]


def combine(parts: list[ComparePart]) -> Comparison:
    """Runs side by side, the differences stated against the first run (the baseline): their parts of the step
    in their own phases when every run has the same, else in the vocabulary every kind shares."""
    summary = pd.DataFrame([p.row for p in parts])
    summary["batch_size"] = summary["batch_size"].astype("Int64")  # a batch is a count, also beside a run without one
    alike = len({p.parts for p in parts}) == 1
    return Comparison(summary=summary, steps=pd.concat([p.steps for p in parts], ignore_index=True),
                      shares=pd.concat([p.shares if alike else p.shared for p in parts], ignore_index=True),
                      memory=pd.concat([p.memory for p in parts], ignore_index=True),
                      differences=_differences([p.row for p in parts]))


def compare(runs: list[StoredRun]) -> Comparison:
    """Two or more runs side by side: step time, phase shares, per-device memory, and what differs.

    The differences are stated against the first run (the baseline).
    """
    return combine([compare_part(run) for run in runs])


# Workloads that name no job: two runs of one of these are not runs of the same thing (any two imported traces).
UNNAMED_WORKLOADS = frozenset({"", "torch.profiler trace"})


def default_compare(runs: pd.DataFrame, chosen: str | None) -> tuple[list[str], str | None]:
    """The pair Compare opens on: the run open in the sidebar and the newest finished run of the same workload
    that is not a check ``dpprof advise --check`` recorded (the older first, as the baseline); or no pair and what
    is needed, in words.

    Args:
        runs: the readable runs of dpprof.list_runs, newest first.
        chosen: the id of the run open in the sidebar.
    """
    match = runs[runs["id"] == chosen]
    if match.empty:
        return [], "Choose a run in the sidebar (or two or more above) to compare."
    row = match.iloc[0]
    if not row["steps"] or pd.isna(row["steps"]):
        return [], (f"The open run, {row['name'] or row['id']}, recorded no steps: there is nothing to compare. "
                    "Choose another run in the sidebar, or runs above.")
    if (row["workload"] or "") in UNNAMED_WORKLOADS:
        return [], (f"{row['name'] or row['id']} does not say what job it was (an imported trace of no known job): "
                    "choose the runs to compare above.")
    others = runs[(runs["id"] != chosen) & (runs["status"] == "finished") & (runs["steps"].fillna(0) > 0)
                  & (runs["workload"].fillna("") == (row["workload"] or ""))
                  & runs["check_of"].isna()]  # not a run dpprof advise --check recorded
    if others.empty:
        builtin = row["workload"] in WORKLOAD_NAMES and row["source"] is None  # what the New run page records
        how = ("record one on the New run page (for example with --balanced or another number of devices), or "
               "choose runs above" if builtin else
               "record or import another run of it (the New run page records the built-in workloads only), or "
               "choose runs above")
        return [], (f"Comparing needs a second finished run of {row['workload'] or 'the same model'} besides "
                    f"{row['name'] or row['id']}: {how}.")
    pair = pd.concat([match, others.iloc[[0]]]).sort_values("created_at")
    return pair["id"].tolist(), None


def _ratio_text(r: float) -> str:
    """A ratio to two decimals, or two significant digits below 0.1: "0.77x", "0.0073x" (never "0.00x")."""
    decimals = 2 if r >= 0.1 or r <= 0 else min(8, 1 - math.floor(math.log10(r)))
    return f"{r:.{decimals}f}x"


def _less_text(r: float) -> str:
    """How much less a ratio under 1 is, in percent: "23%", "over 99%" (never "100%" of something not zero)."""
    return f"{1 - r:.0%}" if r >= 0.005 else "over 99%"


def _times_text(a: float, b: float) -> str:
    """b's time against a's: "0.77x the time (23% faster)"."""
    r = b / a
    change = f" ({_less_text(r)} faster)" if r < 0.995 else f" ({r - 1:.0%} slower)" if r > 1.005 else ""
    return f"{_ratio_text(r)} the time{change}"


def _bytes_text(a: float, b: float) -> str:
    """b's bytes against a's: "1.20x (20% more)"."""
    r = b / a
    return _ratio_text(r) + (f" ({_less_text(r)} less)" if r < 0.995 else f" ({r - 1:.0%} more)" if r > 1.005 else "")


# A run's status other than finished, in words after its name.
STATUS_WORDS = {"failed": "failed", "interrupted": "was interrupted", "running": "is still running",
                "incomplete": "is incomplete (its process stopped without closing it)",
                "disk_full": "filled the disk while it recorded"}


def _status_text(row: dict[str, Any]) -> list[str]:
    """The sentence on a run that did not finish, and what of it is compared; none for a finished run."""
    status = row["status"]
    if status == "finished":
        return []
    steps = row["steps"] or 0
    words = STATUS_WORDS.get(status, f"is {status}")
    said = (f": the {plural(steps, 'step')} it recorded{' so far' if status == 'running' else ''} "
            "are compared" if steps else "")
    return [f"{row['run']} {words}{said}."]


def _workload(row: dict[str, Any]) -> str | None:
    """The job a run says it ran (its workload or model), None where it names none."""
    name = row.get("workload") or ""
    return None if name in UNNAMED_WORKLOADS else name


def _workload_text(base: dict[str, Any], other: dict[str, Any]) -> list[str]:
    """The sentence on two runs of different jobs: their times and throughput are not of the same work."""
    wa, wb = _workload(base), _workload(other)
    if wa == wb or not (wa or wb):
        return []
    a, b = base["run"], other["run"]
    if wa and wb:
        return [f"{b} ran {wb}, {a} {wa}: different workloads, so their step times and throughput are of "
                "different work."]
    named, unnamed = (base, other) if wa else (other, base)
    return [f"{unnamed['run']} does not say which workload it ran ({named['run']} ran {_workload(named)}): they "
            "may not be the same work."]


def _kind_text(row: dict[str, Any]) -> str:
    """What a run is, after its name: "is DataParallel on 2 CPU workers", "is an imported torch.profiler trace ..."."""
    kind = str(row["kind"])
    return f"is {'an ' if kind.startswith('imported') else ''}{kind}"


def _timed_parts(row: dict[str, Any]) -> set[str]:
    """The share columns of the parts of the step a run times (its kind's parts, stepmodel.SHARED_OF)."""
    return {c for c, v in row.items() if c.endswith("_share_pct") and v is not None}


def _untimed(has: dict[str, Any], lacks: dict[str, Any]) -> list[str]:
    """The sentence on the parts of the step ``has`` times and ``lacks``'s kind does not time apart, with their
    shares of ``has``'s step: in ``lacks`` they are in the rest, never 0%."""
    parts = [p for p in SHARED_PARTS if f"{p}_share_pct" in _timed_parts(has) - _timed_parts(lacks)]
    out = []
    if TAX in parts and lacks["dp_tax_pct"] is None:  # a kind with no scatter, replicate or gather at all
        parts.remove(TAX)
        # the tax figure (Findings.tax: per step past the first), as the row, the Overview and the finding say it; the
        # share of every step only where the run has no step past the first
        said = (f"{has['dp_tax_pct']:.1f}% of the mean step past the first" if has["dp_tax_pct"] is not None
                else f"{has[f'{TAX}_share_pct']:.1f}% of its step")
        out.append(f"{lacks['run']} has no DataParallel tax (it does no scatter, replicate or gather): "
                   f"{has['run']}'s is {said}.")
    if not parts:
        return out
    words = [SHARED_PART_WORDS.get(p, p) for p in parts]
    names = " or ".join([", ".join(words[:-1]), words[-1]] if len(words) > 1 else words)
    shares = ", ".join(f"{has[f'{p}_share_pct']:.1f}% {SHARED_PART_WORDS.get(p, p)}" for p in parts)
    return [*out, f"{lacks['run']} does not time {names} apart (whatever of {'it' if len(parts) == 1 else 'them'} "
            f"runs inside its steps is in the rest of its step): {has['run']}'s step is {shares}."]


def _memory_differences(base: dict[str, Any], other: dict[str, Any]) -> list[str]:
    """The memory sentence: the output devices' figures, or the fullest devices' where a run has none; each run's
    figure said in its own words, and no ratio, where the two runs' figures are not the same measure."""
    a, b = base["run"], other["run"]
    if not (base["fullest_device_peak_bytes"] and other["fullest_device_peak_bytes"]):
        return []
    if base["memory"] != other["memory"]:  # an allocator's peak against dpprof's accounting: two measures
        return [f"Memory, measured differently: {b}'s fullest device ({other['fullest_device']}) "
                f"{mib(other['fullest_device_peak_bytes'])} {other['memory']}, {a}'s ({base['fullest_device']}) "
                f"{mib(base['fullest_device_peak_bytes'])} {base['memory']}."]
    x, y = base["output_device_peak_bytes"], other["output_device_peak_bytes"]
    if x and y:
        return [f"The output device holds {mib(y)} in {b}, {mib(x)} in {a}: {_bytes_text(x, y)}."]
    # a balanced run gathers nothing, so it has no output device: compare the fullest devices
    x, y = base["fullest_device_peak_bytes"], other["fullest_device_peak_bytes"]
    role = lambda r: ", the output device" if r["output_device_peak_bytes"] else ""  # noqa: E731
    return [f"The fullest device holds {mib(y)} in {b} ({other['fullest_device']}{role(other)}), "
            f"{mib(x)} in {a} ({base['fullest_device']}{role(base)}): {_bytes_text(x, y)}."]


def _differences(rows: list[dict[str, Any]]) -> list[str]:
    """Sentences: how each run differs from the first. A figure one of the two runs does not have (an imported
    trace has no batch size) is left out, never written as nan."""
    if len(rows) < 2:
        return []
    base = {k: _value(v) for k, v in rows[0].items()}
    out = _status_text(base)
    for other in ({k: _value(v) for k, v in r.items()} for r in rows[1:]):
        a, b = base["run"], other["run"]
        out += [*(_status_text(other) if other["id"] != base["id"] else []), *_workload_text(base, other)]
        if not base["steps"] and not other["steps"]:
            out.append(f"Neither {b} nor {a} recorded a step: there is no step time, share or memory to compare.")
            continue
        empty = [r["run"] for r in (other, base) if not r["steps"]]
        if empty:
            out.append(f"{empty[0]} recorded no steps: there is no step time or share of it to compare.")
        elif base["kind"] != other["kind"]:
            out.append(f"{b} {_kind_text(other)}, {a} {_kind_text(base)[len('is '):]}.")
        elif base["devices"] != other["devices"] or base["backend"] != other["backend"]:
            out.append(f"{b} runs on {other['devices']} {other['backend']} device(s), {a} on "
                       f"{base['devices']} {base['backend']} device(s).")
        if base["batch_size"] and other["batch_size"] and base["batch_size"] != other["batch_size"]:
            out.append(f"Batch size: {b} {int(other['batch_size']):,}, {a} {int(base['batch_size']):,}.")
        if base["median_step_ms"] and other["median_step_ms"]:
            out.append(f"Median step: {b} {other['median_step_ms']:.2f} ms, {a} {base['median_step_ms']:.2f} ms: "
                       f"{b} takes {_times_text(base['median_step_ms'], other['median_step_ms'])}.")
        if base["samples_per_s"] and other["samples_per_s"]:
            out.append(f"Throughput (samples over the time from the first step's end to the last's): {b} "
                       f"{other['samples_per_s']:,.0f} samples/s, {a} "
                       f"{base['samples_per_s']:,.0f} samples/s "
                       f"({other['samples_per_s'] / base['samples_per_s'] - 1:+.0%}).")
        deltas = []
        # a run with no steps has no shares at all, and a part one run's kind does not time apart (a DataParallel
        # run's data and optimizer are in its rest) is no 0% of its step: only the parts both time are set side by side
        timed = base["median_step_ms"] and other["median_step_ms"]
        for col in sorted(_timed_parts(base) & _timed_parts(other)) if timed else []:
            x, y = base[col], other[col]
            deltas.append((abs(y - x), col[: -len("_share_pct")], x, y))
        for _, phase, x, y in sorted(deltas, reverse=True)[:2]:
            if abs(y - x) >= 1.0:
                name = SHARED_PART_WORDS.get(phase, phase)
                out.append(f"{name[0].upper() + name[1:]}: {y:.1f}% of {b}'s step, {x:.1f}% of {a}'s "
                           f"({y - x:+.1f} points).")
        out += [*_untimed(base, other), *_untimed(other, base)] if timed else []
        taxed = any(d[1] == TAX for d in sorted(deltas, reverse=True)[:2] if abs(d[3] - d[2]) >= 1.0)
        if base["dp_tax_pct"] is not None and other["dp_tax_pct"] is not None and not taxed:
            out.append(f"DataParallel tax (scatter + replicate + gather): {b} {other['dp_tax_pct']:.1f}%, "
                       f"{a} {base['dp_tax_pct']:.1f}% of the mean step past the first.")
        out += _memory_differences(base, other)
        x, y = base["memory_most_to_least"], other["memory_most_to_least"]
        if x and y and abs(x - y) >= 0.05:
            out.append(f"Memory spread (the fullest device over the emptiest): {b} {y:.2f}x, {a} {x:.2f}x.")
        x, y = base["imbalance_ratio"], other["imbalance_ratio"]
        if x and y:
            work = base["work"] if base["work"] == other["work"] else "work"
            out.append(f"Slowest device's median {work} over the others': {b} {y:.2f}x, {a} {x:.2f}x.")
    return out

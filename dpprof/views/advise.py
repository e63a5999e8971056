"""The Advisor page of one run (and ``dpprof advise``'s text): what each other set-up would take, predicted from
the run and this machine's cached calibration (dpprof.advise). Torch-free: the page never measures; without a
calibration of a CPU run's device set it predicts nothing and gives the command that calibrates
(``dpprof advise RUN`` does, the first time)."""
from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from dpprof.advise import NotAdvisable
from dpprof.advise.calibration_cache import Calibration, cache_dir, cache_path, cached_calibration
from dpprof.advise.compute import ComputeProbe, cached_compute
from dpprof.advise.measured import Measured, measure
from dpprof.advise.predict import MAX_INTERVAL_RATIO, PART_ORDER, Advice, Scenario, advise
from dpprof.stepmodel import PHASE_WORDS
from dpprof.store.reader import StoredRun
from dpprof.units import mib, plural

__all__ = ["AdvisorView", "advisor", "page_advisor", "calibration_files", "calibration_for", "check_lines",
           "scenario_table", "scenario_title", "MAX_INTERVAL_RATIO", "parts_table", "memory_table", "text_lines", "GIB"]

GIB = 2**30


@dataclass
class AdvisorView:
    """The advisor's answer for one run, or why there is none."""

    advice: Advice | None
    reason: str | None  # why the run cannot be advised on (one line)
    calibration_note: str  # which calibration the predictions use, or how to make one
    command: str | None = None  # the command that makes the advice possible where it is not (a calibration)


def calibration_for(m: Measured) -> tuple[Calibration | None, str]:
    """The cached calibration of the run's device set on this host, and a sentence saying which (or how to make
    one). The run's own intra-op thread count picks the file: a run recorded with OMP_NUM_THREADS=1 is predicted
    with a calibration at one thread."""
    if m.backend != "cpu":
        return None, "GPU runs are not calibrated on this machine (it has no GPU): costs come from the run alone."
    cal, unused = cached_calibration("cpu", m.n, m.threads)
    if cal is None:
        why = f", the cached one not used: {unused}" if unused is not None else ""
        return None, (f"No calibration of this machine for {plural(m.n, 'CPU worker')} at {m.threads} intra-op thread(s) "
                      f"({cache_path('cpu', m.n, m.threads)}{why}): without one, DataParallel's own machinery, the hand-off "
                      f"to the workers and the all-reduce would count as free, so nothing is predicted. "
                      f"`dpprof advise {m.run_id}` calibrates this machine first (about half a minute, once) and "
                      "caches it.")
    return cal, _note(cal)


def _note(cal: Calibration) -> str:
    return (f"Calibration of {cal.host} for {plural(cal.devices, 'CPU worker')} at {cal.threads} thread(s), measured "
            f"{cal.measured_at} (`dpprof advise RUN --calibrate` measures again).")


def advisor(run: StoredRun, memory_gib: float | None = None, batch_sizes: list[int] | None = None,
            calibration: Calibration | None = None, compute: ComputeProbe | None = None) -> AdvisorView:
    """Every scenario for ``run``, from the cached calibration (or ``calibration``) and the cached measure of the
    run's model alone (or ``compute``; dpprof.advise.compute), where there is one; the reason where it has no
    calibration."""
    try:
        m = measure(run)
        if calibration is None:
            calibration, note = calibration_for(m)
            if calibration is None and m.backend == "cpu":  # the read side never measures: say how to
                return AdvisorView(None, note, note, f"dpprof advise {m.run_id}")
        else:
            note = _note(calibration)
        if compute is None:
            compute = cached_compute(m.run_id, calibration.torch_version if calibration is not None else None)
        advice = advise(m, calibration, batch_sizes=batch_sizes,
                        memory_bytes=int(memory_gib * GIB) if memory_gib else None, compute=compute)
    except NotAdvisable as err:
        return AdvisorView(None, str(err), "")
    return AdvisorView(advice, None, note)


def calibration_files() -> tuple[tuple[str, int], ...]:
    """The cached calibrations' names and modification times: what the page's cached answer depends on besides
    the run."""
    try:
        return tuple(sorted((p.name, p.stat().st_mtime_ns) for p in cache_dir().glob("*.json")))
    except OSError:
        return ()


def page_advisor(run: StoredRun, memory_gib: float | None, calibrations: tuple = ()) -> AdvisorView:
    """The Advisor page's call: advisor(run, memory_gib). ``calibrations`` (calibration_files()) only keys the
    page's cache, so that a new calibration is read."""
    return advisor(run, memory_gib)


def scenario_table(advice: Advice) -> pd.DataFrame:
    """One row per scenario: its step with interval, the change against the recorded median, the most any device
    holds.

    Returns:
        columns scenario, label, devices, batch_size, step_ms, step_ms_low, step_ms_high, vs_recorded_pct,
        peak_held_bytes (the fullest device), recorded, predicted (False where the scenario's step is withheld:
        its step_ms and vs_recorded_pct are then NaN, its interval kept).
    """
    rows = []
    for s in advice.scenarios:
        shown = s.withheld is None
        rows.append({"scenario": s.scenario, "label": s.label, "devices": s.devices, "batch_size": s.batch_size,
                     "step_ms": s.step_ms if shown else float("nan"), "step_ms_low": s.step_ms_low,
                     "step_ms_high": s.step_ms_high,
                     "vs_recorded_pct": 100 * (s.step_ms / advice.measured_step_ms - 1) if shown else float("nan"),
                     "peak_held_bytes": max(s.peak_bytes.values(), default=float("nan")), "recorded": s.recorded,
                     "predicted": shown})
    return pd.DataFrame(rows)


def scenario_title(s: Scenario) -> str:
    """One scenario in a line: "DDP on 2 ranks (gloo): 12.34 ms (10.00–15.00)", or "…: no prediction (…)"."""
    if s.withheld is not None:
        return f"{s.label}: no prediction ({s.step_ms_low:,.2f}–{s.step_ms_high:,.2f} ms)"
    return f"{s.label}: {s.step_ms:.2f} ms ({s.step_ms_low:.2f}–{s.step_ms_high:.2f})"


def parts_table(advice: Advice) -> pd.DataFrame:
    """Each predicted scenario's ms per part (columns ``<part>_ms`` in step order; parts no scenario has left out);
    scenarios without a prediction (Scenario.withheld) left out, as in scenario_table's rows with ``predicted``."""
    shown = [s for s in advice.scenarios if s.withheld is None]
    used = [p for p in PART_ORDER if any(s.parts_ms.get(p, 0.0) > 0 for s in shown)]
    rows = [{"label": s.label, **{f"{p}_ms": s.parts_ms.get(p, 0.0) for p in used}} for s in shown]
    return pd.DataFrame(rows)


def memory_table(advice: Advice) -> pd.DataFrame:
    """Predicted peak held bytes per device (rank) and scenario, long form: label, device, peak_held_bytes."""
    rows = [{"label": s.label, "device": d, "peak_held_bytes": b} for s in advice.scenarios for d, b in s.peak_bytes.items()]
    return pd.DataFrame(rows, columns=["label", "device", "peak_held_bytes"])


_SHORT = {**PHASE_WORDS, "apply": "apply on the caller"}


def _parts(parts: dict[str, float]) -> str:
    return ", ".join(f"{_SHORT.get(p, p)} {v:.2f}" for p, v in parts.items() if v > 0.0005)


def _over(m: Measured) -> str:
    """The measured median step and the steps it is of, in words, up to the parenthesis its interval is said in."""
    if not m.training_only:
        return f"step {m.step_ms:.2f} ms over {m.steps} steps ("
    return f"training step {m.step_ms:.2f} ms (the run's evaluation steps, with no backward, left out; "


def text_lines(view: AdvisorView) -> list[str]:
    """``dpprof advise RUN``'s report: the run, each scenario (step, interval, parts, memory, what changes, the
    command), the largest batch that fits, the assumptions."""
    a = view.advice
    if a is None:
        raise ValueError(f"no advice to print: {view.reason}")
    m = a.measured
    on = plural(m.n, "CPU worker" if m.backend == "cpu" else "GPU")
    out = [f"run {m.run_id}  {m.name!r}: {'balanced ' if m.kind == 'balanced' else ''}DataParallel on {on}, "
           f"batch {m.batch_size}, {m.threads} intra-op thread(s)",
           f"measured: median {_over(m)}90% interval of the median "
           f"{m.step_ms * m.median_interval[0]:.2f}-{m.step_ms * m.median_interval[1]:.2f} ms)",
           view.calibration_note, ""]
    recorded = next((s for s in a.scenarios if s.recorded), None)
    if recorded is not None:
        out.insert(2, f"its parts, from the typical step (ms): {_parts(recorded.parts_ms)}")
    out[:0] = [*a.said_first, ""] if a.said_first else []  # before any figure
    table = scenario_table(a)
    shown = pd.DataFrame({
        "scenario": table["label"],
        "step (ms)": table["step_ms"].map(lambda v: "no prediction" if pd.isna(v) else f"{v:,.2f}"),
        "interval (ms)": [f"{lo:,.2f}-{hi:,.2f}" for lo, hi in zip(table["step_ms_low"], table["step_ms_high"])],
        "vs recorded": table["vs_recorded_pct"].map(lambda v: "-" if pd.isna(v) else f"{v:+.0f}%"),
        "peak held, fullest": table["peak_held_bytes"].map(mib),
    })
    out += shown.to_string(index=False).splitlines() + [""]
    best = a.headline()
    if best is not None and not best.recorded:
        out += [f"fastest at batch {m.batch_size}: {scenario_title(best)}", ""]
    for s in a.scenarios:
        out.append(scenario_title(s).replace("–", "-"))
        if s.withheld is not None and a.withheld is None:
            out.append(f"  no prediction: {s.withheld}")
        out.append(f"  parts (ms): {_parts(s.parts_ms)}")
        out.append("  peak held: " + ", ".join(f"{d} {mib(b)}" for d, b in s.peak_bytes.items()))
        if s.allocator_peak_bytes:
            out.append("  allocator peak: " + ", ".join(f"{d} {mib(b)}" for d, b in s.allocator_peak_bytes.items()))
        for change in s.changes:
            out.append(f"  - {change}")
        out.append(f"  run it: {s.command}" if s.command else f"  run it: ({s.no_command})")
    out.append("")
    if a.max_batch_size:
        fits = ", ".join(f"{d} {b:,}" for d, b in a.max_batch_size.items())
        out.append(f"largest global batch that fits on {on}: {fits} ({a.max_batch_note})")
    else:
        out.append(f"largest batch that fits: {a.max_batch_note}")
    out.append("assumptions:")
    out += [f"  {line}" for line in a.assumptions]
    return out


def check_lines(checked: list) -> list[str]:
    """``dpprof advise RUN --check``'s table: each scenario predicted against what its run measured."""
    rows = []
    for c in checked:
        s = c.scenario
        fullest = max(c.measured_peak_bytes, key=c.measured_peak_bytes.get, default=None)
        rows.append({
            "scenario": s.label, "predicted (ms)": f"{s.step_ms:,.2f}" if s.withheld is None else "none",
            "interval (ms)": f"{s.step_ms_low:,.2f}-{s.step_ms_high:,.2f}",
            "measured (ms)": f"{c.measured_step_ms:,.2f}" if c.measured_step_ms else "-",
            "error": f"{c.step_error:+.1%}" if c.step_error is not None and s.withheld is None else "-",
            "inside": {True: "yes", False: "no", None: "-"}[c.inside if s.withheld is None else None],
            "peak held, fullest: predicted / measured": (
                f"{mib(s.peak_bytes.get(fullest, 0))} / {mib(c.measured_peak_bytes[fullest])}" if fullest else "-"),
            "check run": c.run_id or (c.error or "-")})
    out = ["predicted against measured (each scenario's command run on this machine):"]
    out += pd.DataFrame(rows).to_string(index=False).splitlines()
    capped = [(c.steps, c.scenario.profile.steps) for c in checked if c.capped]
    if capped:  # --check runs at most dpprof.advise.commands.CHECK_MAX_STEPS steps; the commands shown, the run's own
        ran, commands = max(capped)
        out.append(f"each check run recorded {plural(ran, 'step')}, not the {commands:,} of its command: --check runs "
                   f"at most {ran} (a median step and its interval are settled well before)")
    predicted = [c for c in checked if c.step_error is not None and c.scenario.withheld is None]
    errors = [abs(c.step_error) for c in predicted]
    withheld = sum(1 for c in checked if c.scenario.withheld is not None)
    said = f"; {withheld} scenario(s) had no prediction and are left out" if withheld else ""
    failed = [c for c in checked if c.error is not None]
    if failed:
        out.append(f"{len(failed)} of {len(checked)} check runs failed (the \"check run\" column says why)")
    if errors:
        inside = sum(1 for c in predicted if c.inside)
        out.append(f"median |error| of the step time {pd.Series(errors).median():.1%}; {inside} of {len(errors)} "
                   f"measured inside their interval{said}")
    elif withheld:
        out.append(f"no scenario had a prediction to check: {withheld} withheld")
    return out

"""Numbers you can trust: on every kind of run the code makes, the read side's figures hold their invariants.

The runs: DataParallel on 3 CPU workers with an uneven split, balanced, DDP on 2 gloo ranks, a thinned long run
(read from its aggregates), a failed run, every trace in ../shared/traces, and each of those exported with
``dpprof export --trace`` and imported back. On each: the parts of a step partition it (per step and over the
run, 100 +- 0.5%), nothing says more than 100% of a step (tables, findings, ``dpprof show``, the CSVs), every
stacked chart's data stacks to its step, the headline and the findings name the same slowest device with the same
wait, and a round trip keeps the steps and the phase totals. The step partition itself is checked against random
interval sets (hypothesis) and against an independent sweep of the raw rows.
"""
from __future__ import annotations

import io
import math
import re
import zipfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import dpprof
from dpprof.cli import main
from dpprof.findings import run_findings
from dpprof.records import FINDING_UNITS, SEVERITIES
from dpprof.stepmodel import GPU_PARTS, IDLE, PROCESS_PARTS, REST, partition, part_names
from dpprof.store import queries
from dpprof.trace import import_traces
from dpprof.views import compare, overview
from dpprof.views.export import run_zip
from recorded import record, record_failed, record_straggler
from test_retention import SMALL, STALLS

pytestmark = pytest.mark.slow  # its fixture records every kind of run, DDP under torchrun among them

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT.parent / "shared" / "traces"
SHARE_TOLERANCE_PCT = 0.5  # the bound: shares partition the step to 100 +- 0.5%
ROUND_TRIP_REL = 0.01  # a round trip keeps steps, phase totals and allocator peaks within 1%


@pytest.fixture(scope="module")
def runs(tmp_path_factory, profiled):
    """One run of each kind, and each trace exported and imported back: name -> run id, in one directory."""
    directory = tmp_path_factory.mktemp("invariants")
    out = {"dataparallel": record(directory, "dp3", workers=3, steps=6, batch_size=50).id,
           "balanced": record(directory, "bal", workers=2, steps=6, balanced=True).id,
           "failed": record_failed(directory).id,
           "thinned": Path(record_straggler(directory, 300, detail=SMALL, stall_steps=STALLS).path).name.split(".")[0]}
    # decoder-sized outputs (63 x 50,000 logits) gathered onto cpu:0: a run whose memory skews
    net = dpprof.DataParallel(nn.Linear(16, 50_000), device_ids=dpprof.cpu_devices(2))
    with dpprof.record(name="wide", reports_dir=str(directory)) as wide:
        for _ in range(4):
            with wide.step():
                net(torch.randn(63, 16)).sum().backward()
    out["wide outputs"] = wide.id
    profiled(directory, "cifar-lenet", "--ddp", "--nproc", "2", "--steps", "6", "--batch-size", "32")  # once a session
    listing = dpprof.list_runs(directory)
    out["ddp"] = listing[listing["ranks"] == 2]["id"].iloc[0]
    for trace in sorted(TRACES.glob("*.json.gz")):
        out[trace.name] = import_traces([trace], directory).id
    for name in [n for n in out if n.endswith(".json.gz")] + ["dataparallel"]:
        exported = directory.parent / f"{name}.exported.json.gz"
        assert main(["--reports-dir", str(directory), "export", out[name], "--trace", str(exported)]) == 0
        out[f"{name} (round trip)"] = import_traces([exported], directory).id
    return SimpleNamespace(dir=directory, ids=out)


NAMES = ["dataparallel", "balanced", "wide outputs", "failed", "thinned", "ddp", *sorted(p.name for p in TRACES.glob("*.json.gz"))]
ALL = NAMES + [f"{n} (round trip)" for n in NAMES if n.endswith(".json.gz")] + ["dataparallel (round trip)"]


def _load(runs, name):
    return dpprof.load_run(runs.ids[name], runs.dir)


def assert_parts_partition_the_steps(run, stats: dict | None = None) -> pd.DataFrame:
    """Each phase's share of the run sums to 100% (within SHARE_TOLERANCE_PCT) and lies in 0..100; each step's
    parts are never negative and stack to the step. Returns the phase totals (empty for a run with no step)."""
    totals = queries.phase_totals(run, stats) if stats is not None else queries.phase_totals(run)
    if len(totals):
        assert abs(totals["share_pct"].sum() - 100) <= SHARE_TOLERANCE_PCT, totals
        assert totals["share_pct"].between(0, 100).all() and (totals["total_ms"] >= 0).all()
    breakdown = queries.phase_breakdown(run)
    parts = [c for c in breakdown.columns if c.endswith("_ms") and c != "step_ms"]
    stacked = breakdown[parts].sum(axis=1)
    assert ((stacked - breakdown["step_ms"]).abs() <= SHARE_TOLERANCE_PCT / 100 * breakdown["step_ms"] + 1e-9).all()
    assert (breakdown[parts] >= 0).all().all()
    return totals


@pytest.mark.parametrize("name", ALL)
def test_the_parts_of_a_step_partition_it(runs, name):
    run = _load(runs, name)
    assert len(assert_parts_partition_the_steps(run, queries.run_stats(run)))  # every run here has steps


@pytest.mark.parametrize("name", [n for n in ALL if n != "thinned"])
def test_the_partition_agrees_with_an_independent_sweep_of_the_rows(runs, name):
    """Each part of each step, from the raw rows by a plain walk over elementary intervals (a different algorithm
    from stepmodel's vectorised sweep), for the runs read from their rows."""
    run = _load(runs, name)
    if run.model.aggregated or not len(run.steps):
        return
    names = queries.stacked_phases(run.model.phases)
    priority = [p for p in ("forward", "backward_compute", "comm_wait", "backward", "optimizer", "script_comm", "data")
                if p in names] if "forward" in names else names
    got = queries.step_parts(run).set_index(["rank", "step"])
    for step in run.steps.itertuples():
        lo, hi = step.start_ms, step.start_ms + step.duration_ms
        rows = run.phases[(run.phases["rank"] == step.rank) & (run.phases["step"] == step.step)
                          & run.phases["phase"].isin(names)]
        spans = [(r.phase, max(lo, r.start_ms), min(hi, r.start_ms + r.duration_ms)) for r in rows.itertuples()]
        cuts = sorted({lo, hi, *[a for _, a, _ in spans if lo < a < hi], *[b for _, _, b in spans if lo < b < hi]})
        want = dict.fromkeys([*names, REST], 0.0)
        for a, b in zip(cuts, cuts[1:]):
            running = {p for p, s, e in spans if s <= a and e >= b and e > s}
            owner = next((p for p in priority if p in running), REST)
            want[owner] += b - a
        for part, ms in want.items():
            assert got.at[(step.rank, step.step), part] == pytest.approx(ms, abs=1e-6), (step.step, part)


@pytest.mark.parametrize("name", ["dataparallel", "balanced", "ddp", "failed"])
def test_every_recorded_phase_lies_inside_its_step(runs, name):
    """Recorded phases never overlap one another's parts wrongly or spill out of their step: data loading is inside
    a DDP rank's step (its implicit step starts where the previous one ended)."""
    run = _load(runs, name)
    steps = run.steps.set_index(["rank", "step"])
    joined = run.phases.join(steps[["start_ms", "duration_ms"]].add_suffix("_step"), on=["rank", "step"])
    slack = 1e-6
    assert (joined["start_ms"] >= joined["start_ms_step"] - slack).all()
    assert (joined["start_ms"] + joined["duration_ms"]
            <= joined["start_ms_step"] + joined["duration_ms_step"] + slack).all()
    if name == "ddp":
        later = run.phases[(run.phases["phase"] == "data")]
        assert len(later) and (later["step"] > 0).all()  # every step after the first loads its data inside itself


def assert_values_in_their_units(found: pd.DataFrame) -> None:
    """Every finding's value says its unit (one of FINDING_UNITS), and a share is a fraction of a whole: 0 to 1; and
    the findings come worst first: by severity, then by unit in FINDING_UNITS' order (values of two units are never
    set against each other), then by value, largest first, those without one last."""
    valued = found[found["value"].notna()]
    assert valued["unit"].isin(list(FINDING_UNITS)).all(), valued[["kind", "value", "unit"]]
    shares = valued.loc[valued["unit"] == "share", "value"]
    assert ((shares >= 0) & (shares <= 1.0)).all(), valued[["kind", "value", "unit"]]
    units = list(FINDING_UNITS)
    keys = [(SEVERITIES.index(f.severity), units.index(f.unit) if f.unit in units else len(units),
             -f.value if pd.notna(f.value) else math.inf) for f in found.itertuples()]
    assert keys == sorted(keys), found[["severity", "kind", "unit", "value"]]


def _percents_of_a_step(text: str) -> list[float]:
    return [float(x) for x in re.findall(r"(\d+(?:\.\d+)?)% of (?:the |a |its )?(?:median )?step", text)]


@pytest.mark.parametrize("name", ALL)
def test_no_figure_says_more_than_a_whole_step(runs, name, capsys):
    run = _load(runs, name)
    found = run_findings(run).table
    assert_values_in_their_units(found)
    for text in (*found["title"], *found["evidence"]):
        assert all(p <= 100 for p in _percents_of_a_step(text)), text
    assert main(["--reports-dir", str(runs.dir), "show", runs.ids[name]]) == 0
    shown = capsys.readouterr().out
    assert all(p <= 100 for p in _percents_of_a_step(shown)), shown
    with zipfile.ZipFile(io.BytesIO(run_zip(run))) as z:
        csvs = {Path(n).name: pd.read_csv(z.open(n)) for n in z.namelist() if Path(n).name in
                ("phase_totals.csv", "device_summary.csv")}
    totals = csvs["phase_totals.csv"]
    assert abs(totals["share_pct"].sum() - 100) <= SHARE_TOLERANCE_PCT
    summary = csvs["device_summary.csv"]
    for col in [c for c in summary.columns if c.endswith("_share_of_step_pct")]:
        assert (summary[col].dropna() <= 100 + SHARE_TOLERANCE_PCT).all(), summary[col]
    gpu = queries.gpu_time(run)
    if len(gpu):  # every stacked GPU-time bar is its step
        stacked = gpu[list(queries.GPU_TIME_PARTS)].sum(axis=1)
        assert ((stacked - gpu["step_ms"]).abs() <= SHARE_TOLERANCE_PCT / 100 * gpu["step_ms"]).all(), gpu


@pytest.mark.parametrize("name", ALL)
def test_the_headline_and_the_findings_name_the_same_straggler_and_wait_and_fullest_device(runs, name):
    run = _load(runs, name)
    data = overview.overview(run)
    g, found = data.glance, data.findings.table
    stragglers = found[found["kind"].isin(["straggler", "straggler_rank"])]
    assert len(stragglers) <= 1
    assert g.time_uneven == (len(stragglers) == 1)
    if len(stragglers):
        row = stragglers.iloc[0]
        assert g.slowest == row["device"]
        wait = float(re.search(r"the others wait ([\d.]+) ms per step", row["evidence"]).group(1))
        assert f"they wait {wait:.2f} ms per step" in " ".join(g.sentences)
    skews = found[found["kind"] == "memory_skew"]  # the memory headline is the memory-skew finding, or nothing
    assert g.memory_uneven == (len(skews) == 1) and (not len(skews) or g.heaviest == skews.iloc[0]["device"])
    if name == "wide outputs":  # the case the mark is for: gathered logits on the output device
        assert g.memory_uneven and g.heaviest == "cpu:0"
    if g.slowest is not None:  # the bars are the verdict's medians, the wait their difference
        bars = g.devices.set_index("device")["work_ms"]
        others = bars.drop(g.slowest).dropna()
        verdict = data.findings.straggler
        if verdict is not None and verdict.collectives is not None:  # ranks' matched collectives: the wait inside them
            assert g.wait_ms == verdict.collectives.wait_ms and g.slowest == verdict.collectives.straggler
        elif not g.idle:
            assert g.wait_ms == pytest.approx(bars[g.slowest] - others.median(), rel=1e-9, abs=1e-9)
        said = " ".join(g.sentences)
        assert ("is the slowest" in said) == g.time_uneven and ("No straggler" in said) != g.time_uneven


@pytest.mark.parametrize("name", [n for n in NAMES if n.endswith(".json.gz")] + ["dataparallel"])
def test_a_round_trip_keeps_the_steps_phase_totals_and_allocator_peaks(runs, name):
    a, b = _load(runs, name), _load(runs, f"{name} (round trip)")
    assert len(b.steps) == len(a.steps)
    ta = queries.phase_totals(a).set_index("phase")["total_ms"]
    tb = queries.phase_totals(b).set_index("phase")["total_ms"]
    step_total = float(queries.run_stats(a)["total_ms"])
    for phase in ta.index:  # a part is kept within 1% of itself, or of the step where it is a sliver of it
        assert abs(tb.get(phase, 0.0) - ta[phase]) <= ROUND_TRIP_REL * max(ta[phase], step_total / 100), phase
    pa, pb = queries.memory_peaks(a).set_index("device"), queries.memory_peaks(b).set_index("device")
    for col in ("peak_allocated_bytes", "peak_reserved_bytes"):
        for device, value in pa[col].dropna().items():
            assert pb.at[device, col] == pytest.approx(value, rel=ROUND_TRIP_REL), (device, col)


def _union_ms(spans: list[tuple[float, float]], lo: float, hi: float) -> float:
    """The time covered by ``spans`` inside [lo, hi], by merging them in order (no sweep shared with the package)."""
    total, end = 0.0, lo
    for start, stop in sorted((max(a, lo), min(b, hi)) for a, b in spans):
        if stop > max(start, end):
            total += stop - max(start, end)
            end = stop
    return total


@pytest.mark.parametrize("name", ["ddp", "ddp-2ranks-rank0-nccl.json.gz"])
def test_the_collectives_busy_figure_is_their_union_over_the_steps_past_the_first(runs, name):
    """The collectives' busy time a step, per rank (dpprof show's table, the Overview's) and over the ranks (the
    communication finding's), from the run's rows: each step's collectives merged and clipped to their rank's step,
    over the steps past the first (the first is DDP's start-up: the ranks meeting, the model's broadcast)."""
    run = _load(runs, name)
    comms, steps = run.comms.copy(), run.steps.copy()
    for frame in (comms, steps):
        frame["rank"] = frame["rank"].fillna(0) if "rank" in frame else 0
    windows = {(r, s): (a, a + d) for r, s, a, d in zip(steps["rank"], steps["step"], steps["start_ms"],
                                                         steps["duration_ms"])}
    busy = {}
    for (rank, device, step), c in comms[comms["step"] > comms["step"].min()].groupby(["rank", "device", "step"]):
        spans = list(zip(c["launch_ms"], c["launch_ms"] + c["duration_ms"]))
        busy[(device, step)] = _union_ms(spans, *windows[(rank, step)])
    busy = pd.Series(busy)
    busy = busy[busy > 0]
    stats = overview.comm_stats(run).set_index("device")["busy_ms"]
    expected = busy.groupby(level=0).mean()
    assert stats.to_dict() == pytest.approx(expected.to_dict(), rel=1e-6), (stats, expected)
    found = run_findings(run).table.set_index("kind")
    if "communication_share" in found.index:
        said = re.search(r"busy ([\d.]+) ms per step per rank of a ([\d.]+) ms mean step past the first",
                         found.loc["communication_share", "evidence"])
        assert float(said.group(1)) == pytest.approx(busy.mean(), abs=0.006)
        # the job's step: the slowest rank's, as the data finding's "step on average" over the same steps
        job = steps.groupby("step")["duration_ms"].max().sort_index().iloc[1:]
        assert float(said.group(2)) == pytest.approx(job.mean(), abs=0.006)
    if name == "ddp":  # cifar-lenet's gradients, 242 KiB in one bucket: no smaller bucket_cap_mb is advised
        later = comms[comms["step"] > comms["step"].min()]
        assert later.groupby(["device", "step"])["bucket"].nunique().median() == 1
        assert later["bucket_bytes"].mean() < 2**20
        assert found.loc["bucket_size", "advice"].startswith("The gradients are small: their one all-reduce costs")


def test_compare_across_kinds_speaks_one_vocabulary(runs):
    parts = [compare.compare_part(_load(runs, n)) for n in ("dataparallel", "ddp")]
    both = compare.combine(parts)
    shares = both.shares.groupby("run")["share_pct"].sum()
    assert (shares.sub(100).abs() <= SHARE_TOLERANCE_PCT).all()
    assert set(both.shares["phase"]) <= {"compute", "exposed communication", "data", "optimizer", "DataParallel tax",
                                         "rest"}
    assert not any("backward" in line.lower().split(":")[0] for line in both.differences)
    assert (both.steps.groupby("run")["step"].min() == 0).all()  # steps aligned by position


# -- the partition itself ------------------------------------------------------------------------------------

_interval = st.tuples(st.sampled_from(["compute", "communication", "memcpy", "memset", "other"]),
                      st.floats(-50, 150, allow_nan=False), st.floats(0, 80, allow_nan=False))


@settings(max_examples=150, deadline=None)
@given(windows=st.lists(st.tuples(st.floats(0, 100, allow_nan=False), st.floats(0, 60, allow_nan=False)),
                        min_size=1, max_size=4),
       spans=st.lists(st.tuples(st.integers(0, 4), _interval), max_size=30))
def test_gpu_parts_sum_to_the_window_whatever_overlaps(windows, spans):
    """Overlapping collectives and kernels, copies during kernels, spans past the window's end or in no window:
    the parts always sum to the window, none is negative, and each is at most the union of its kinds."""
    win = pd.DataFrame({"step": range(len(windows)), "lo": [a for a, _ in windows],
                        "hi": [a + w for a, w in windows]})
    iv = pd.DataFrame([(k, kind, s, s + d) for k, (kind, s, d) in spans], columns=["step", "kind", "start", "end"])
    out = partition(win, iv, GPU_PARTS, ["step"], IDLE)
    names = part_names(GPU_PARTS, IDLE)
    assert np.allclose(out[names].sum(axis=1), out["window_ms"], atol=1e-9)
    assert (out[names] >= -1e-12).all().all()
    for i, row in out.iterrows():
        lo, hi = win.loc[i, "lo"], win.loc[i, "hi"]
        own = iv[iv["step"] == i]
        comm = own[own["kind"] == "communication"]
        reach = sum(max(0.0, min(e, hi) - max(s, lo)) for s, e in zip(comm["start"], comm["end"]))
        assert row["communication"] + row["overlap"] <= reach + 1e-9  # several in flight count once, never more


@settings(max_examples=100, deadline=None)
@given(spans=st.lists(st.tuples(st.sampled_from(["forward", "backward_compute", "comm_wait", "optimizer", "data"]),
                                st.floats(-20, 120, allow_nan=False), st.floats(0, 50, allow_nan=False)),
                      max_size=20))
def test_process_parts_sum_to_the_step(spans):
    win = pd.DataFrame({"step": [0], "lo": [0.0], "hi": [100.0]})
    iv = pd.DataFrame([(0, k, s, s + d) for k, s, d in spans], columns=["step", "kind", "start", "end"])
    out = partition(win, iv, PROCESS_PARTS, ["step"])
    assert out[part_names(PROCESS_PARTS)].sum(axis=1).iloc[0] == pytest.approx(100.0)

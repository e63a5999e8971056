"""dpprof.store.blocks: the aggregates the writer builds give the figures full detail gives.

One run recorded with detail="all" holds both every row and the aggregates; each query read from its rows
(load_run(read="rows")) and from its aggregates (read="aggregates") must agree: exactly where the aggregate is
exact (counts, sums, extremes, peaks), within the sketch's 1% where it is a quantile.
"""
from __future__ import annotations

import math
import sqlite3

import pandas as pd
import pytest

import dpprof
from dpprof.findings import imbalance
from dpprof.records import StepRecord
from dpprof.store import queries
from dpprof.store.retention import Retention
from dpprof.store.sketch import RELATIVE_ACCURACY
from dpprof.views import overview
from recorded import record_straggler

STEPS = 240
BLOCK = 10
RETENTION = Retention(mode="all", block_steps=BLOCK, outliers_per_chunk=STEPS)  # every outlier marked


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    run = record_straggler(tmp_path_factory.mktemp("blocks"), STEPS, detail=RETENTION, stall_steps=(77, 150))
    return dpprof.load_run(run.path, read="rows"), dpprof.load_run(run.path, read="aggregates")


def _close(a: float, b: float, rel: float = 1e-9) -> bool:
    return math.isclose(a, b, rel_tol=rel, abs_tol=1e-12) or (pd.isna(a) and pd.isna(b))


def test_the_run_holds_both(both):
    rows, agg = both
    assert not rows.model.aggregated and agg.model.aggregated and not agg.model.thinned
    assert len(rows.steps) == STEPS
    con = sqlite3.connect(rows.path)
    assert con.execute("SELECT SUM(steps) FROM step_blocks").fetchone()[0] == STEPS
    assert con.execute("SELECT COUNT(*) FROM step_blocks").fetchone()[0] == STEPS // BLOCK


def test_run_stats_and_median_step(both):
    rows, agg = both
    a, b = queries.run_stats(rows), queries.run_stats(agg)
    for key in ("steps", "first_step", "last_step", "batch_size", "devices_used"):
        assert a[key] == b[key], key
    for key in ("mean_step_ms", "total_ms"):
        assert _close(a[key], b[key]), key
    exact = float(rows.steps["duration_ms"].quantile(0.5, interpolation="lower"))
    assert abs(b["median_step_ms"] - exact) <= RELATIVE_ACCURACY * exact


def test_step_times_band(both):
    rows, agg = both
    a, b = queries.step_times(rows, max_points=12), queries.step_times(agg, max_points=12)  # 20 steps a point
    assert a["step"].tolist() == b["step"].tolist() and a["steps"].tolist() == b["steps"].tolist()
    for col in ("duration_ms", "min_duration_ms", "max_duration_ms"):
        assert all(_close(x, y) for x, y in zip(a[col], b[col])), col
    durations = rows.steps.sort_values("step")["duration_ms"].reset_index(drop=True)
    for i, median in enumerate(b["median_duration_ms"]):
        exact = durations.iloc[20 * i:20 * i + 20].quantile(0.5, interpolation="lower")
        assert abs(median - exact) <= RELATIVE_ACCURACY * exact
    marked = queries.outlier_steps(agg)
    assert {77, 150} <= set(marked["step"])  # the stalls are marked on the band ...
    durations = rows.steps.set_index("step")["duration_ms"]
    assert (marked["duration_ms"] > 2 * marked["median_ms"]).all()  # ... and every step marked is over 2x the median
    assert (marked["duration_ms"].to_numpy() == durations[marked["step"]].to_numpy()).all()


def test_phase_breakdown_and_totals(both):
    rows, agg = both
    a, b = queries.phase_breakdown(rows, max_points=12), queries.phase_breakdown(agg, max_points=12)
    assert list(a.columns) == list(b.columns) and a["step"].tolist() == b["step"].tolist()
    for col in a.columns[2:]:
        assert all(_close(x, y) for x, y in zip(a[col], b[col])), col
    ta, tb = queries.phase_totals(rows), queries.phase_totals(agg)
    assert ta["phase"].tolist() == tb["phase"].tolist()
    for col in ("total_ms", "per_step_ms", "share_pct"):
        assert all(_close(x, y) for x, y in zip(ta[col], tb[col])), col
    ma, mb = queries.phase_means(rows), queries.phase_means(agg)
    pd.testing.assert_frame_equal(ma, mb, check_exact=False, rtol=1e-9)


def test_work_stats_the_per_device_summary(both):
    rows, agg = both
    a, b = queries.work_stats(rows), queries.work_stats(agg)
    assert a["device"].tolist() == b["device"].tolist() == ["cpu:0", "cpu:1"]
    assert a["steps"].tolist() == b["steps"].tolist()
    for col in ("work_mean_ms", "work_min_ms", "work_max_ms", "work_share_of_step_pct"):
        assert all(_close(x, y) for x, y in zip(a[col], b[col])), col
    samples = queries.work_samples(rows, skip_first=True)  # the percentiles are of the steps past the first
    for device, p50, p95 in zip(b["device"], b["work_p50_ms"], b["work_p95_ms"]):
        values = samples.loc[samples["device"] == device, "duration_ms"]
        for q, got in ((0.5, p50), (0.95, p95)):
            exact = values.quantile(q, interpolation="lower")
            assert abs(got - exact) <= RELATIVE_ACCURACY * exact, (device, q)


def test_memory_peaks_and_chunks(both):
    rows, agg = both
    a, b = queries.memory_peaks(rows), queries.memory_peaks(agg)
    pd.testing.assert_frame_equal(a, b, check_exact=False, rtol=1e-9)
    pd.testing.assert_frame_equal(queries.chunk_counts(rows), queries.chunk_counts(agg))


def test_the_imbalance_sums_give_the_glances_figures(both):
    """The work rows' slowest_steps and wait_sum_ms are the imbalance's slowest share and wait, exactly."""
    rows, agg = both
    samples = queries.work_samples(rows, skip_first=True)
    found = imbalance(samples.pivot_table(index="step", columns="device", values="duration_ms"))
    work = agg.query("SELECT device, SUM(steps) AS steps, SUM(slowest_steps) AS slowest, SUM(wait_sum_ms) AS wait "
                     "FROM phase_blocks WHERE phase = 'work' GROUP BY device").set_index("device")
    assert found.slowest == "cpu:0" == overview.glance(rows).slowest
    assert work.loc["cpu:0", "slowest"] / (STEPS - 1) == found.slowest_share  # the first step left out, as there
    assert _close(work.loc["cpu:0", "wait"] / (STEPS - 1), float(found.excess_ms.mean()), rel=1e-9)


def test_a_commits_steps_are_settled_as_they_come():
    """A commit of many steps holds no more than SETTLE_STEPS of them unsettled at once: held all together until the
    commit's end, their accumulators lived through the garbage collector's collections into its oldest generation
    and set off full collections of the training process. The aggregates are those of settling once a commit."""
    from dpprof.store.blocks import SETTLE_STEPS, Aggregator

    run = record_straggler(None, 60)
    # in the order the writer receives them: a step's phases and memory, then the step itself when it closes
    records = sorted((r for table in ("steps", "phases", "memory") for r in run.sink.tables[table]),
                     key=lambda r: (r.step, isinstance(r, StepRecord)))
    assert sum(isinstance(r, StepRecord) for r in records) == 60
    most = 0

    class Watched(Aggregator):
        def _acc(self, step):
            nonlocal most
            acc = super()._acc(step)
            most = max(most, len(self._pending))
            return acc

    watched = Watched(RETENTION)
    watched.add(records)
    assert most <= SETTLE_STEPS + 1
    one_at_a_time = Aggregator(RETENTION)
    for record in records:  # each settled as late as the rule allows
        one_at_a_time.add([record])

    def phases(aggregator):
        return sorted((k, v.steps, v.calls, v.sum, v.min, v.max) for k, v in aggregator._phases.items())

    assert phases(watched) == phases(one_at_a_time) and phases(watched)

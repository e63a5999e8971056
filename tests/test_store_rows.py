"""The store's named reads (dpprof.store.advisor_rows, trace_rows, finding_rows, table_rows) on runs the CPU
backend records: what each reads, that a long run is read through its sample of steps (the retention rule applied
once, in the store), and that a name which is not the run's is refused before any SQL is written."""
from __future__ import annotations

import numpy as np
import pytest
from recorded import record_straggler

import dpprof
from dpprof.store import advisor_rows, finding_rows, table_rows, trace_rows
from dpprof.store.retention import Retention

# small enough that 60 steps are thinned: 10 first, 10 last, one in 7 between (and the outliers kept apart); one in 7
# of 60 steps is under SAMPLE_MIN_STEPS, so the run is read through every step it kept whole
SMALL = Retention(first_steps=10, last_steps=10, every=7, chunk_steps=10, block_steps=10)


@pytest.fixture(scope="module")
def thinned(tmp_path_factory):
    directory = tmp_path_factory.mktemp("rows")
    run = record_straggler(directory, 60, detail=SMALL, stall_steps=(33,))
    return dpprof.load_run(run.path), dpprof.load_run(run.path, read="rows")


def _sample(run) -> set[int]:
    """The steps whose detail stands for a thinned run too short for a systematic sample, by Retention's own rule
    (RunModel.whole_from): the first steps, one in ``every``, the newest."""
    r, whole = run.model.retention, run.model.whole_from
    return {s for s in range(run.model.steps) if s < r.first_steps or s >= whole or s % r.every == 0}


def test_a_thinned_run_is_read_through_its_sample_of_steps(thinned):
    run, rows = thinned
    assert run.model.aggregated and run.model.thinned and not rows.model.aggregated
    sample = _sample(run)
    assert set(advisor_rows.sampled_steps(run)["step"]) == sample
    assert set(finding_rows.sampled(run, "phases")["step"]) == sample
    # the sampler's condition on an aliased column (a join): the same steps, past the first
    joined = advisor_rows.model_applies_with_chunks(run)
    assert set(joined["step"]) == sample - {0}
    assert len(advisor_rows.sampled_model_applies(run)) == 2 * len(sample - {0})  # a model apply per device and step
    # read from its rows, every step that kept detail is read, outliers included (more than the sample)
    assert set(advisor_rows.sampled_steps(rows)["step"]) == set(range(run.model.steps))
    assert set(finding_rows.sampled(rows, "phases")["step"]) > sample


def test_the_steps_a_trace_holds_are_those_that_kept_their_detail(thinned):
    run, _ = thinned
    steps = np.arange(run.model.steps, dtype=np.int64)
    spans = trace_rows.held_step_spans(run)
    held = spans["step"].to_numpy()
    assert set(held.tolist()) == set(run.table("phases")["step"]) | set(run.table("memory")["step"])
    assert set(_sample(run)) <= set(held.tolist()) < set(steps.tolist())
    assert held.tolist() == sorted(held.tolist())  # each once, in order
    # with each step's longest row and the whole table's total: the steps table's own figures
    longest = run.table("steps").groupby("step")["duration_ms"].max()
    assert spans.set_index("step")["longest_ms"].to_dict() == longest[held].to_dict()
    assert trace_rows.steps_total_ms(run) == pytest.approx(run.table("steps")["duration_ms"].sum())
    rows = trace_rows.chunk_rows(run, 0, run.model.steps - 1)
    assert len(rows.phases) == len(run.table("phases"))
    assert set(rows.memory["step"]) == set(run.table("memory")["step"])


def test_row_counts_and_whole_tables_match_the_tables(thinned):
    run, _ = thinned
    for name in ("steps", "phases", "memory", "devices"):
        assert table_rows.row_count(run, name) == len(run.table(name)) == len(table_rows.whole_table(run, name))
    assert table_rows.row_count(run, "step_blocks") > 0  # an aggregate table: every 10 steps a block


@pytest.mark.parametrize("read", [
    lambda run: table_rows.whole_table(run, "steps; DROP TABLE steps"),
    lambda run: table_rows.row_count(run, "sqlite_master"),
    lambda run: finding_rows.sampled(run, "runs"),
    lambda run: finding_rows.from_step(run, "nope", 0),
])
def test_a_table_that_is_not_the_runs_is_refused_by_name(thinned, read):
    run, _ = thinned
    with pytest.raises(KeyError, match="no table"):
        read(run)
    assert len(run.table("steps")) == run.model.steps  # nothing was dropped


def test_a_column_that_is_not_a_name_is_refused(thinned):
    run, _ = thinned
    with pytest.raises(ValueError, match="step column"):
        run.model.sampled_steps_sql("step OR 1")
    with pytest.raises(ValueError, match="not a column name"):
        list(trace_rows.gpu_sample_batches(run, ["util_pct) FROM steps --"], 100))

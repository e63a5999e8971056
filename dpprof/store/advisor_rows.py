"""The rows the advisor reads from a run (dpprof.advise.measured, dpprof.advise.calibrate), as named reads.

Each function is one query against the run's files (each rank's rows, with a ``rank`` column, as
StoredRun.query gives them). Where a read stands for a long run, the retention rule is applied here, once
(RunModel.sampled_steps_sql: the steps whose detail stands for the run without bias); callers never see SQL.
"""
from __future__ import annotations

from collections.abc import Iterable

import pandas as pd

from dpprof.store.reader import StoredRun

__all__ = [
    "call_input_bytes",
    "durations_past_first",
    "memory_calls",
    "model_applies_with_chunks",
    "model_call_bytes",
    "model_chunks_of_steps",
    "phases_after",
    "phases_of_steps",
    "sampled_model_applies",
    "sampled_steps",
    "step_batch_maxima",
    "step_maxima",
    "step_spans",
    "steps_after",
    "trained_steps",
]

_PAST_FIRST = "step > (SELECT MIN(step) FROM steps)"  # the run's first step carries one-time costs


def _in_steps(steps: Iterable[int], column: str = "step") -> str:
    """``column IN (…)`` over step numbers (integers: written into the statement as numbers only)."""
    return f"{column} IN ({', '.join(str(int(s)) for s in steps)})"


def sampled_steps(run: StoredRun) -> pd.DataFrame:
    """The steps whose detail stands for the run, in step order.

    Returns:
        columns step, duration_ms, batch_size, devices_used, forward_calls, rank.
    """
    return run.query("SELECT step, duration_ms, batch_size, devices_used, forward_calls FROM steps "
                     f"WHERE {run.model.sampled_steps_sql()} ORDER BY step")


def durations_past_first(run: StoredRun) -> pd.Series:
    """Every step's duration_ms but the run's first step's (every step is kept, whatever the retention), by step."""
    return run.query(f"SELECT step, duration_ms FROM steps WHERE {_PAST_FIRST}").set_index("step")["duration_ms"]


def trained_steps(run: StoredRun) -> set[int]:
    """The steps a backward ran in, of those whose detail stands for the run (the others' phases may be thinned)."""
    rows = run.query(f"SELECT DISTINCT step FROM phases WHERE phase = 'backward' AND {run.model.sampled_steps_sql()}")
    return {int(s) for s in rows["step"]}


def phases_of_steps(run: StoredRun, steps: Iterable[int]) -> pd.DataFrame:
    """The phase rows of ``steps``: columns step, call, phase, device, duration_ms, rank."""
    return run.query(f"SELECT step, call, phase, device, duration_ms FROM phases WHERE {_in_steps(steps)}")


def model_chunks_of_steps(run: StoredRun, steps: Iterable[int]) -> pd.DataFrame:
    """The model's (forward call 0) chunk per device in ``steps``: columns step, device, chunk_size, rank."""
    return run.query(f"SELECT step, device, chunk_size FROM memory WHERE call = 0 AND {_in_steps(steps)}")


def model_call_bytes(run: StoredRun, steps: Iterable[int]) -> pd.DataFrame:
    """The model call's (call 0) inputs, outputs and samples over ``steps``, summed: columns input_bytes,
    output_bytes, samples, rank (one row per rank; NaN where none)."""
    return run.query("SELECT SUM(input_bytes) AS input_bytes, SUM(output_bytes) AS output_bytes, "
                     f"SUM(chunk_size) AS samples FROM memory WHERE call = 0 AND {_in_steps(steps)}")


def call_input_bytes(run: StoredRun, call: int, steps: Iterable[int]) -> pd.Series:
    """The inputs of forward call ``call`` (the loss's: the targets) over ``steps``, summed per rank."""
    return run.query(f"SELECT SUM(input_bytes) AS t FROM memory WHERE call = ? AND {_in_steps(steps)}", (call,))["t"]


def step_maxima(run: StoredRun) -> pd.Series:
    """Each step's longest duration over the run's ranks (ms), indexed by step in step order."""
    per = run.query("SELECT step, MAX(duration_ms) AS ms FROM steps GROUP BY step ORDER BY step")
    return per.set_index("step")["ms"]


def step_batch_maxima(run: StoredRun) -> pd.Series:
    """Each step's largest batch_size over the run's ranks, indexed by step in step order (NaN where none)."""
    per = run.query("SELECT step, MAX(batch_size) AS batch FROM steps GROUP BY step ORDER BY step")
    return per.set_index("step")["batch"]


def step_spans(run: StoredRun) -> pd.DataFrame:
    """Every step's start and duration: columns step, start_ms, duration_ms, rank, in step order."""
    return run.query("SELECT step, start_ms, duration_ms FROM steps ORDER BY step")


def sampled_model_applies(run: StoredRun) -> pd.DataFrame:
    """The model's apply (call 0) per device in the steps past the first whose detail stands for the run: columns
    step, device, duration_ms, rank."""
    return run.query("SELECT step, device, duration_ms FROM phases WHERE phase = 'apply' AND call = 0 AND "
                     f"{run.model.sampled_steps_sql()} AND {_PAST_FIRST}")


def model_applies_with_chunks(run: StoredRun) -> pd.DataFrame:
    """Per step past the first (of those whose detail stands for the run) and device: the model's apply (call 0)
    summed and the chunk it applied to: columns step, device, ms, chunk, rank."""
    return run.query("SELECT p.step, p.device, SUM(p.duration_ms) AS ms, m.chunk_size AS chunk FROM phases p "
                     "JOIN memory m ON m.step = p.step AND m.device = p.device AND m.call = 0 "
                     f"WHERE p.phase = 'apply' AND p.call = 0 AND p.{_PAST_FIRST} "
                     f"AND {run.model.sampled_steps_sql('p.step')} GROUP BY p.step, p.device")


def memory_calls(run: StoredRun, device: str, step: int) -> pd.DataFrame:
    """What dpprof accounted to ``device`` in ``step``, per forward call: columns call, chunk_size, input_bytes,
    output_bytes, activation_bytes, gathered_bytes, param_bytes, buffer_bytes, rank."""
    return run.query("SELECT call, chunk_size, input_bytes, output_bytes, activation_bytes, gathered_bytes, "
                     "param_bytes, buffer_bytes FROM memory WHERE device = ? AND step = ?", (device, step))


def phases_after(run: StoredRun, step: int) -> pd.DataFrame:
    """Every phase row after ``step``: columns step, phase, duration_ms, rank."""
    return run.query("SELECT step, phase, duration_ms FROM phases WHERE step > ?", (step,))


def steps_after(run: StoredRun, step: int) -> pd.DataFrame:
    """Every step after ``step``: columns step, duration_ms, rank."""
    return run.query("SELECT step, duration_ms FROM steps WHERE step > ?", (step,))

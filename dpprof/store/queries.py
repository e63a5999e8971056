"""Fast reads for the dashboard: aggregates computed in SQL, long series bucketed to a few thousand points.

A run of 8 devices x 50,000 steps holds about 700,000 phase rows; loading them into pandas to draw
one chart takes seconds, so every function here asks SQLite for what a chart needs (per-step phase
sums, per-device peaks, a sample of apply times, one range of steps) and returns a small DataFrame.
The run file's indices (dpprof.store.schema.INDEXES) let most of these read an index alone; files
written without them give the same answers, more slowly. Missing data is an empty DataFrame with
the documented columns, never an exception.

A long run (run.model.aggregated) is read from the per-block aggregates its writer built
(dpprof.store.blocks): sums, extremes and quantile sketches per block of steps, never a scan of its rows;
what needs rows (a sample of work times, a Timeline range) reads the detail the run kept
(dpprof.store.retention). Both ways give the same columns; ``load_run(..., read="rows")`` forces rows.
"""
from __future__ import annotations

import bisect
import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pandas as pd

from dpprof.records import DDP_PHASES, FSDP_ONLY_PHASES, MEMORY_BYTES, PHASES, device_key
from dpprof.store.blocks import EVALUATION, TRAINING, WORK
from dpprof.store.reader import StoredRun
from dpprof.store.sketch import grouped_quantile, quantiles
from dpprof.stepmodel import REST, partition, parts_for
from dpprof.units import plural

__all__ = ["MAX_POINTS", "WORK_SAMPLE_PER_DEVICE", "TIMELINE_MAX_STEPS", "GPU_METRICS", "bucket_width",
           "stacked_phases", "step_parts", "run_stats", "batch_sizes", "Throughput", "training_steps_of",
           "raised_steps_of", "throughput_of", "throughput", "raised_steps", "raised_last_step", "median_step_ms", "kind_medians", "step_times", "phase_breakdown", "phase_totals",
           "work_samples", "work_stats", "memory_peaks", "chunk_counts", "gpu_series", "timeline",
           "GPU_TIME_PARTS", "gpu_time", "phase_means", "phase_overlaps", "outlier_steps", "detail_steps", "step_span", "sampled_comm_rows"]

MAX_POINTS = 2_000  # points a chart draws per series; a browser stays responsive well past this
WORK_SAMPLE_PER_DEVICE = 4_000  # enough for box and violin shapes; exact mean, min and max come from SQL
TIMELINE_MAX_STEPS = 100  # a Gantt of more steps than this is unreadable (and slow to draw)

_HELD = " + ".join(MEMORY_BYTES)
_MEDIAN_ROWS = 200_000  # a run read from its rows gets each bucket's median from pandas up to this many steps


def bucket_width(first: int, last: int, max_points: int) -> int:
    """Steps per plotted point so that [first, last] fits in max_points points."""
    return max(1, math.ceil((last - first + 1) / max(1, max_points)))


def _one_row(df: pd.DataFrame, by: str | tuple[str, ...]) -> pd.Series:
    """The row of a one-row-per-file aggregate that has data (a device lives in one rank's file)."""
    if len(df) > 1:
        df = df.sort_values(list(by) if isinstance(by, tuple) else by, ascending=False, na_position="last")
    return df.drop(columns=["rank"]).iloc[0]


def stacked_phases(present: list[str] | tuple[str, ...]) -> list[str]:
    """The parts of this run's steps (dpprof.stepmodel.parts_for), in the order a step runs them.

    For DataParallel every phase but ``apply`` (each device's apply runs inside parallel_apply), apply too on one
    device (no parallel_apply around it);
    for a process's steps (DDP ranks, imported traces) data, forward, backward (or its parts) and optimizer.
    """
    names = {name for name, _ in parts_for(present)}
    order: dict[str, float] = {p: i for i, p in enumerate((*PHASES, *DDP_PHASES))}
    # FSDP's own phases after backward's, before the optimizer
    order.update({p: order["comm_wait"] + (i + 1) / 10 for i, p in enumerate(FSDP_ONLY_PHASES)})
    return sorted(names, key=lambda p: order.get(p, len(order)))


def _steps_per_file(run: StoredRun) -> pd.DataFrame:
    """Per run file (a distributed run's ranks, each with its ``rank``): step count, first and last step, mean and
    total step time and devices used (the batch is batch_sizes')."""
    if run.model.aggregated:
        # the blocks hold every settled step; a run killed while recording also holds up to SETTLE_STEPS steps past
        # the last block's (dpprof.store.blocks), counted from the steps table, which keeps every step
        return run.query(
            "WITH b AS (SELECT SUM(steps) AS steps, MIN(first_step) AS first_step, MAX(last_step) AS last_step, "
            "SUM(sum_ms) AS total_ms, MAX(devices_used) AS devices_used "
            "FROM step_blocks), "
            "t AS (SELECT COUNT(*) AS steps, MIN(step) AS first_step, MAX(step) AS last_step, "
            "SUM(duration_ms) AS total_ms, MAX(devices_used) AS devices_used "
            "FROM steps WHERE step > COALESCE((SELECT MAX(last_step) FROM step_blocks), -1)) "
            "SELECT COALESCE(b.steps, 0) + t.steps AS steps, COALESCE(b.first_step, t.first_step) AS first_step, "
            "COALESCE(t.last_step, b.last_step) AS last_step, "
            "(COALESCE(b.total_ms, 0) + COALESCE(t.total_ms, 0)) / NULLIF(COALESCE(b.steps, 0) + t.steps, 0) "
            "AS mean_step_ms, COALESCE(b.total_ms, 0) + COALESCE(t.total_ms, 0) AS total_ms, "
            "MAX(COALESCE(b.devices_used, t.devices_used), COALESCE(t.devices_used, b.devices_used)) AS devices_used "
            "FROM b, t")
    return run.query("SELECT COUNT(*) AS steps, MIN(step) AS first_step, MAX(step) AS last_step, "
                     "AVG(duration_ms) AS mean_step_ms, SUM(duration_ms) AS total_ms, "
                     "MAX(devices_used) AS devices_used FROM steps")


def run_stats(run: StoredRun) -> dict[str, Any]:
    """Step count, first and last step, mean, median and total step time, batch size and devices used."""
    per = _steps_per_file(run)
    # ranks of a distributed run step together: their steps are the same steps (their batches add up: batch_sizes)
    row = per.agg({"steps": "max", "first_step": "min", "last_step": "max", "mean_step_ms": "mean",
                   "total_ms": "mean", "devices_used": "sum"})
    stats = {k: (None if pd.isna(v) else v.item() if hasattr(v, "item") else v) for k, v in row.items()}
    stats["steps"] = int(stats["steps"] or 0)
    # a distributed run whose ranks hold different step counts (an imported job a rank's profiler cut short): the
    # fewest, and the ranks that hold them
    fewest = int(per["steps"].min() or 0) if len(per) else 0
    stats["steps_fewest"] = fewest
    ranked = "rank" in per and len(per) > 1
    stats["ranks_fewest"], stats["ranks_most"] = (
        sorted(int(r) for r in per.loc[per["steps"] == n, "rank"]) if ranked else [] for n in (fewest, stats["steps"]))
    stats.update(batch_sizes(run))
    stats["devices_used"] = int(stats["devices_used"]) if stats["devices_used"] else None
    stats["median_step_ms"] = median_step_ms(run) if stats["steps"] else None
    return stats


def batch_sizes(run: StoredRun) -> dict[str, int | None]:
    """The run's batch: the one definition ``dpprof show``, the Overview's samples/s and the Compare page share.

    ``batch_size`` is the batch most steps ran (the larger of a tie), a step's batch being its recorded batch_size
    summed over the ranks that ran it (a distributed run's ranks step together); ``batch_size_steps`` how many steps
    ran it, of ``batch_steps`` with a batch; ``batch_size_min`` and ``batch_size_max`` the smallest and largest. A
    loader's short last batch or one big batch leaves it the batch the run trains at (the largest read 256 for a run
    of nine 16-sample steps and one of 256). Every step with a batch counts, an empty one (a forward of a 0-sample
    batch: a sampler's empty tail) as 0, so the words say it ("16 (5 of 6 steps; 0 to 16)") as the per-device chunk
    sizes count it; the steps table is whole in every run file."""
    none: dict[str, int | None] = {"batch_size": None, "batch_size_steps": 0, "batch_steps": 0,
                                   "batch_size_min": None, "batch_size_max": None}
    per_step = "SELECT step, SUM(batch_size) AS batch FROM steps WHERE batch_size IS NOT NULL GROUP BY step"
    if run.ranks == 1:  # counted in SQLite: a 300,000-step run's steps do not come to pandas on every Overview
        rows = run.query(f"SELECT batch, COUNT(*) AS n FROM ({per_step}) WHERE batch >= 0 GROUP BY batch")
        counts = pd.Series(rows["n"].to_numpy(np.int64), index=rows["batch"].to_numpy(np.int64)) if not rows.empty \
            else pd.Series(dtype=np.int64)
    else:  # rank files are separate databases: each step's batch is summed over them here
        rows = run.query(per_step)
        summed = pd.to_numeric(rows.groupby("step")["batch"].sum(), errors="coerce").dropna() if not rows.empty \
            else pd.Series(dtype=float)
        counts = summed[summed >= 0].astype(np.int64).value_counts()
    if counts.empty:
        return none
    batch = int(counts[counts == counts.max()].index.max())
    return {"batch_size": batch, "batch_size_steps": int(counts[batch]), "batch_steps": int(counts.sum()),
            "batch_size_min": int(counts.index.min()), "batch_size_max": int(counts.index.max())}


@dataclass(frozen=True)
class Throughput:
    """What a run trains a second of the time it takes (throughput_of): ``samples`` of the ``steps`` past the first
    over the ``span_ms`` from the first step's end to the last step's end."""

    samples: int
    steps: int
    span_ms: float
    evaluation_steps: int = 0  # steps past the first whose samples are left out: forwards alone (training_steps_of)
    raised_steps: int = 0  # ... and steps past the first whose forward raised, left out as well (raised_steps_of)

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.span_ms * 1e3

    def words(self) -> str:
        """How the figure is made, for the words beside it."""
        evaluations = plural(self.evaluation_steps, "evaluation step")
        whose = "'s" if self.evaluation_steps == 1 else "'"  # "1 evaluation step's", "3 evaluation steps'"
        left_out = [f"the {evaluations}{whose}"] if self.evaluation_steps else []
        if self.raised_steps:
            left_out.append(f"those of the {plural(self.raised_steps, 'step')} whose forward raised")
        counted = self.steps - self.evaluation_steps - self.raised_steps
        # "training steps" beside the evaluation steps left out; beside failed forwards alone, the steps counted may be
        # an evaluation run's
        which = (f"the {plural(counted, 'training step' if self.evaluation_steps else 'step')} past the first "
                 f"(not {', nor '.join(left_out)})" if left_out else f"the {plural(self.steps, 'step')} past the first")
        return (f"{self.samples:,} samples of {which} in the {self.span_ms / 1e3:,.2f} s from the first step's end to "
                "the last's, slow steps and the time between steps included")


def training_steps_of(backward_steps: Iterable[int], steps: Iterable[int]) -> set[int] | None:
    """Of a run's ``steps``, those that trained (a backward ran in them, on any rank: ``backward_steps``) where the
    run mixes them with evaluation steps (forwards alone, under no_grad between them, as kind_medians splits them);
    None where every step is of one kind. The rule throughput and the between_steps finding share."""
    trains, every = {int(s) for s in backward_steps}, {int(s) for s in steps}
    return trains & every if trains and not every <= trains else None


def raised_steps_of(steps: pd.DataFrame, backward_steps: Iterable[int]) -> set[int]:
    """Of a run's ``steps`` (its steps table, every rank's rows), those whose forward raised (a call of it, on any
    rank: the script caught the error and went on, an out-of-memory batch skipped) and that ran no backward (on any
    rank: ``backward_steps``). Such a step trained nothing, and was no evaluation either: throughput counts neither its
    samples nor it among the evaluation steps, kind_medians neither kind's median, the writer neither kind's sketch
    (dpprof.store.blocks). A step that trained besides (a micro-batch of gradient accumulation skipped) is a training
    step. None is told apart in a file written before the steps' raised_calls, nor in an imported trace."""
    if "raised_calls" not in steps.columns:
        return set()
    raised = pd.to_numeric(steps["raised_calls"], errors="coerce").fillna(0) > 0
    return {int(s) for s in steps.loc[raised, "step"]} - {int(s) for s in backward_steps}


def throughput_of(steps: pd.DataFrame, training: set[int] | None = None,
                  raised: set[int] | None = None) -> Throughput | None:
    """The run's samples a second, from its steps table (every rank's rows: step, start_ms, duration_ms, batch_size):
    the one definition the Overview, ``dpprof show``, the Compare page and the between_steps finding share.

    The samples of the steps past the first (a step's batch summed over the ranks that ran it, as batch_sizes takes it)
    over the time from the first step's end to the last step's end (a step's end being its last rank's), so a step
    that stalls every k steps, an evaluation, a loader's fetch between steps all count, as the user pays them; the
    first step's one-time costs are left out, as the findings leave them. Where ``training`` names the steps that
    trained (training_steps_of: the run mixes them with evaluation steps) only their samples count, the evaluation
    steps' time still in the span; the samples of the ``raised`` steps (raised_steps_of) never count, their time in
    the span too. None without two steps, with a step of no recorded batch (an imported trace's), or with no time
    between the first step's end and the last's."""
    if steps.empty or not {"step", "start_ms", "duration_ms", "batch_size"} <= set(steps.columns):
        return None
    ends = (steps["start_ms"].astype(float) + steps["duration_ms"].astype(float)).groupby(steps["step"]).max() \
        .sort_index()
    if len(ends) < 2:
        return None
    batch = pd.to_numeric(steps["batch_size"], errors="coerce").groupby(steps["step"]).sum(min_count=1) \
        .reindex(ends.index).iloc[1:]
    span_ms = float(ends.iloc[-1] - ends.iloc[0])
    if batch.isna().any() or not span_ms > 0:
        return None
    failed = batch.index.isin(list(raised or ()))
    evaluation = ~batch.index.isin(list(training)) & ~failed if training is not None else np.zeros(len(batch), bool)
    return Throughput(samples=int(batch[~evaluation & ~failed].sum()), steps=len(batch), span_ms=span_ms,
                      evaluation_steps=int(evaluation.sum()), raised_steps=int(failed.sum()))


_TRAINS = "EXISTS (SELECT 1 FROM phases p WHERE p.step = s.step AND p.phase = 'backward')"  # the step s trained
_RAISED_CALLS = "COALESCE(s.raised_calls, 0) > 0"  # a forward call of the step s raised


def _columns(run: StoredRun, table: str) -> set[str]:
    """The columns of ``table`` in every file of the run (one added to the schema since a file was written is not)."""
    names = run.query(f"SELECT name FROM pragma_table_info('{table}')")["name"].value_counts()
    return set(names[names == run.ranks].index)


def _raised_sql(run: StoredRun) -> str:
    """SQL true where the step s is raised_steps_of's (its forward raised, it ran no backward), told from its phases;
    false throughout a file written before the steps' raised_calls."""
    return f"({_RAISED_CALLS} AND NOT {_TRAINS})" if "raised_calls" in _columns(run, "steps") else "0"


@dataclass(frozen=True)
class _BlockKinds:
    """A long run's steps by kind, read from its step blocks (dpprof.store.blocks) where its detail no longer tells
    every step's kind; a distributed run's samples are its ranks' summed."""

    later: int  # steps past the first
    trained: int  # steps past the first a backward ran in
    trained_samples: int  # their samples
    raised: int  # steps past the first whose forward raised and ran no backward (raised_steps_of)
    first_trained: bool
    first_raised: bool

    @property
    def mixed(self) -> bool:
        """training_steps_of's rule, over every step: some trained and some did not."""
        return 0 < self.trained + self.first_trained < self.later + 1


def _kinds_of_blocks(run: StoredRun) -> _BlockKinds | None:
    """A long run's steps by kind from its step blocks' trained_steps, trained_samples and raised_steps (0 in a file
    written before the last: none told apart there); the steps past the last block (a run killed while recording) and
    the first step's kind are read from their phases, which the retention keeps. None for a file written before the
    first two.

    A distributed run's ranks each count their own steps (a separate file each), and the blocks do not say which
    steps: a step a backward ran in on one rank and not on another would be a training step of the run (on any rank,
    training_steps_of) that the counts cannot place. DDP's gradient all-reduce has every rank backward in the same
    steps (an FSDP rank's reduce-scatter too), so the ranks' counts agree, and each rank's kinds are the run's, its
    training samples the ranks' sum. Ranks whose counts differ give None: the run's kinds are not known."""
    blocks = _columns(run, "step_blocks")
    if "trained_steps" not in blocks:
        return None
    raised = "COALESCE(SUM(raised_steps), 0)" if "raised_steps" in blocks else "0"
    failed = _raised_sql(run)
    rows = run.query(
        f"WITH b AS (SELECT COALESCE(SUM(steps), 0) AS steps, COALESCE(SUM(trained_steps), 0) AS trained, "
        f"COALESCE(SUM(trained_samples), 0) AS samples, {raised} AS raised, MAX(last_step) AS last FROM step_blocks), "
        f"t AS (SELECT COUNT(*) AS steps, COALESCE(SUM({_TRAINS}), 0) AS trained, "
        f"COALESCE(SUM(CASE WHEN {_TRAINS} THEN COALESCE(batch_size, 0) END), 0) AS samples, "
        f"COALESCE(SUM({failed}), 0) AS raised FROM steps s WHERE s.step > COALESCE((SELECT last FROM b), -1)), "
        f"f AS (SELECT COALESCE(MAX({_TRAINS}), 0) AS trained, COALESCE(MAX(CASE WHEN {_TRAINS} THEN batch_size END), "
        f"0) AS samples, COALESCE(MAX({failed}), 0) AS raised FROM steps s "
        "WHERE s.step = (SELECT MIN(step) FROM steps)) "
        "SELECT b.steps + t.steps - 1 AS later, b.trained + t.trained - f.trained AS trained, "
        "b.samples + t.samples - f.samples AS samples, b.raised + t.raised - f.raised AS raised, f.trained AS first, "
        "f.raised AS first_raised FROM b, t, f")
    kinds = rows[["later", "trained", "raised", "first", "first_raised"]].drop_duplicates()
    if len(kinds) != 1:
        return None
    row = rows.iloc[0]
    return _BlockKinds(later=int(row["later"]), trained=int(row["trained"]), trained_samples=int(rows["samples"].sum()),
                       raised=int(row["raised"]), first_trained=bool(row["first"]),
                       first_raised=bool(row["first_raised"]))


def throughput(run: StoredRun) -> Throughput | None:
    """throughput_of the run's steps table (whole in every run file, a long run's too: dpprof.store.retention), its
    evaluation steps' samples left out where the run mixes them with training steps, and those of the steps whose
    forward raised (raised_steps_of) always: told from its phases where they are whole, else (a long or thinned run)
    from its step blocks' counts of the steps that trained and that raised (a file written before those counts, or a
    distributed run whose ranks' counts differ: every step's samples count there). A run of one file is added up in
    SQLite, to the same figure: a 300,000-step run's rows took 1.5 s to come to pandas."""
    whole = not run.model.aggregated and run.model.kind != "empty"
    blocks = _kinds_of_blocks(run) if run.model.aggregated and run.model.kind != "empty" else None
    if run.ranks > 1:  # rank files are separate databases: the rows come to pandas (a step's end is its last rank's)
        raised_calls = ", raised_calls" if "raised_calls" in _columns(run, "steps") else ""
        steps = run.query(f"SELECT step, start_ms, duration_ms, batch_size{raised_calls} FROM steps")
        if whole:
            backward = run.query("SELECT DISTINCT step FROM phases WHERE phase = 'backward'")["step"]
            return throughput_of(steps, training_steps_of(backward, steps["step"]), raised_steps_of(steps, backward))
        if blocks is None or not blocks.mixed:  # one kind: a step that raised where none trained is raised_steps_of's
            untrained = blocks is not None and not blocks.trained + blocks.first_trained
            return throughput_of(steps, raised=raised_steps_of(steps, ()) if untrained else None)
        rate = throughput_of(steps)  # the span and the steps: the kinds and their samples are the blocks'
        if rate is None:
            return None
        return replace(rate, samples=blocks.trained_samples, raised_steps=blocks.raised,
                       evaluation_steps=blocks.later - blocks.trained - blocks.raised)
    trains, failed = _TRAINS, _raised_sql(run)
    mixed = False
    if whole:  # training_steps_of's rule: the backward's steps count where the run mixes them with others
        kinds = run.query(f"SELECT COUNT(DISTINCT step) AS steps, COUNT(DISTINCT CASE WHEN {trains} THEN step END) "
                          "AS trains FROM steps s").iloc[0]
        mixed = 0 < int(kinds["trains"]) < int(kinds["steps"])
    if blocks is not None and blocks.trained + blocks.first_trained == blocks.later + 1:
        failed = "0"  # every step trained, the phases thinned away or not: none is raised_steps_of's
    counted = trains if mixed else f"NOT {failed}"
    row = run.query(
        "WITH f AS (SELECT MIN(step) AS a, MAX(step) AS b FROM steps) SELECT "
        "(SELECT MAX(start_ms + duration_ms) FROM steps, f WHERE step = f.a) AS first_end, "
        "(SELECT MAX(start_ms + duration_ms) FROM steps, f WHERE step = f.b) AS last_end, "
        "(SELECT COUNT(DISTINCT step) FROM steps, f WHERE step > f.a) AS later, "
        "(SELECT COUNT(*) FROM steps, f WHERE step > f.a AND batch_size IS NULL) AS unknown, "
        f"(SELECT SUM(batch_size) FROM steps s, f WHERE s.step > f.a AND {counted}) AS samples, "
        f"(SELECT COUNT(DISTINCT s.step) FROM steps s, f WHERE s.step > f.a AND NOT {counted} AND NOT {failed}) "
        "AS evaluation, "
        f"(SELECT COUNT(DISTINCT s.step) FROM steps s, f WHERE s.step > f.a AND {failed}) AS raised").iloc[0]
    if pd.isna(row["first_end"]) or pd.isna(row["last_end"]) or not int(row["later"]) or int(row["unknown"]):
        return None
    span_ms = float(row["last_end"]) - float(row["first_end"])
    if not span_ms > 0:
        return None
    samples, evaluation = int(row["samples"]) if pd.notna(row["samples"]) else 0, int(row["evaluation"])
    raised = int(row["raised"])
    if blocks is not None and blocks.mixed:
        samples, raised = blocks.trained_samples, blocks.raised
        evaluation = blocks.later - blocks.trained - raised
    return Throughput(samples=samples, steps=int(row["later"]), span_ms=span_ms, evaluation_steps=evaluation,
                      raised_steps=raised)


def raised_steps(run: StoredRun) -> int:
    """How many of the run's steps raised_steps_of counts (a forward raised, no backward ran): told from the phases
    where they are whole, else from the step blocks (0 in a file written before either counted them, and in a
    distributed run whose ranks' counts differ: _kinds_of_blocks)."""
    if run.model.kind == "empty":
        return 0
    if run.model.aggregated:
        blocks = _kinds_of_blocks(run)
        return blocks.raised + blocks.first_raised if blocks is not None else 0
    if run.ranks > 1:  # rank files are separate databases: a step raised on one rank may have trained on another
        if "raised_calls" not in _columns(run, "steps"):
            return 0
        backward = run.query("SELECT DISTINCT step FROM phases WHERE phase = 'backward'")["step"]
        return len(raised_steps_of(run.query("SELECT step, raised_calls FROM steps"), backward))
    return int(run.query(f"SELECT COUNT(*) AS n FROM steps s WHERE {_raised_sql(run)}")["n"].iloc[0])


def raised_last_step(run: StoredRun) -> bool:
    """Whether the run's last step (a rank's, in a distributed run) is one raised_steps_of counts: its forward raised
    and it ran no backward. In a failed run that forward is the error the script died of, not one it went on from.
    False in a file written before the steps' raised_calls (the newest steps are always kept whole)."""
    if run.model.kind == "empty" or "raised_calls" not in _columns(run, "steps"):
        return False
    last = run.query(f"SELECT COUNT(*) AS n FROM steps s WHERE s.step = (SELECT MAX(step) FROM steps) AND "
                     f"{_raised_sql(run)}")
    return bool(last["n"].sum())


def median_step_ms(run: StoredRun) -> float | None:
    """The median of every recorded step's duration_ms (the mean of the middle two of an even count): the one
    definition the dashboard and ``dpprof show`` share. Equals ``load_run(...).steps["duration_ms"].median()``.
    A distributed run's rows of every rank count, as its steps table holds them. A long run's median comes from its
    blocks' quantile sketches, within 1% (dpprof.store.sketch)."""
    if run.model.aggregated:
        value = quantiles(run.query("SELECT sketch FROM run_sketches WHERE kind = 'step'")["sketch"], (0.5,))[0]
        return None if pd.isna(value) else float(value)
    if run.ranks > 1:  # rank files are separate databases: the rows come to pandas
        durations = run.query("SELECT duration_ms FROM steps")["duration_ms"]
        return float(durations.median()) if len(durations) else None
    middle = run.query("SELECT AVG(duration_ms) AS ms FROM (SELECT duration_ms FROM steps ORDER BY duration_ms "
                       "LIMIT 2 - (SELECT COUNT(*) FROM steps) % 2 OFFSET (SELECT (COUNT(*) - 1) / 2 FROM steps))")
    value = middle["ms"].iloc[0]
    return None if pd.isna(value) else float(value)


def kind_medians(run: StoredRun) -> dict[str, float] | None:
    """Where a run mixes training steps (a backward ran) and evaluation steps (none: forwards under no_grad between
    them), the median step of each kind as median_step_ms takes it, every rank's rows, a rank's step training where
    that rank recorded a backward in it, a step whose forward raised there and that ran no backward (raised_steps_of)
    of neither kind: {"training": ms, "evaluation": ms}. The header's median of every step is
    then one kind's, an evaluation step's where they are the more. A long or thinned run's (its phases not whole)
    come from the sketches of each kind the writer kept, within 1% as median_step_ms's (none in a file written
    before them). None where the steps are all of one kind."""
    if run.model.kind == "empty":
        return None
    if run.model.aggregated:
        sketches = run.query("SELECT kind, sketch FROM run_sketches WHERE kind IN (?, ?) AND device = ''",
                             (TRAINING, EVALUATION))
        medians = {kind: quantiles(sketches.loc[sketches["kind"] == kind, "sketch"], (0.5,))[0]
                   for kind in (TRAINING, EVALUATION)}
        if any(pd.isna(v) for v in medians.values()):
            return None
        return {kind: float(v) for kind, v in medians.items()}
    rows = run.query(f"SELECT s.duration_ms, {_TRAINS} AS trains FROM steps s WHERE NOT {_raised_sql(run)}")
    if rows.empty or rows["trains"].all() or not rows["trains"].any():
        return None
    trains = rows["trains"].astype(bool)
    return {"training": float(rows.loc[trains, "duration_ms"].median()),
            "evaluation": float(rows.loc[~trains, "duration_ms"].median())}


def step_times(run: StoredRun, max_points: int = MAX_POINTS) -> pd.DataFrame:
    """Step time over the run, one row per step or per bucket of consecutive steps: a band of min, median and
    max with the mean.

    Returns:
        columns step (first step of the bucket), steps (in the bucket), duration_ms (mean), min_duration_ms,
        median_duration_ms, max_duration_ms.
    """
    cols = ["step", "steps", "duration_ms", "min_duration_ms", "median_duration_ms", "max_duration_ms"]
    first, last = _span(run)
    if first is None:
        return pd.DataFrame(columns=cols)
    if run.model.aggregated:
        return _step_band(run, first, last, max_points)[cols]
    width = bucket_width(first, last, max_points)
    out = run.query(
        "SELECT (step - ?) / ? AS bucket, MIN(step) AS step, COUNT(*) AS steps, AVG(duration_ms) AS duration_ms, "
        "MIN(duration_ms) AS min_duration_ms, MAX(duration_ms) AS max_duration_ms "
        "FROM steps GROUP BY bucket ORDER BY bucket", (first, width))
    if run.ranks > 1:  # ranks step together: one point per bucket, the ranks' mean and their extremes
        out = out.groupby("bucket", as_index=False).agg(
            step=("step", "min"), steps=("steps", "max"), duration_ms=("duration_ms", "mean"),
            min_duration_ms=("min_duration_ms", "min"), max_duration_ms=("max_duration_ms", "max"))
    if width == 1:
        out["median_duration_ms"] = out["duration_ms"]
    elif run.model.steps <= _MEDIAN_ROWS:
        rows = run.query("SELECT step, duration_ms FROM steps")
        out["median_duration_ms"] = out["bucket"].map(rows.groupby((rows["step"] - first) // width)["duration_ms"].median())
    else:  # a long run of schema 1 (no sketches): the mean stands in
        out["median_duration_ms"] = out["duration_ms"]
    return out.reset_index(drop=True)[cols]


def _step_band(run: StoredRun, first: int, last: int, max_points: int) -> pd.DataFrame:
    """step_times from the step blocks: whole blocks per bucket, the median from their merged sketches."""
    blocks = run.query("SELECT block, first_step, steps, sum_ms, min_ms, max_ms, sketch FROM step_blocks")
    if run.ranks > 1:  # ranks step together: one band over every rank's steps
        blocks = blocks.sort_values("block", kind="stable")
    blocks["bucket"] = blocks["block"] // _blocks_per_bucket(run, first, last, max_points)
    out = blocks.groupby("bucket", sort=True).agg(step=("first_step", "min"), steps=("steps", "sum"),
                                                  sum_ms=("sum_ms", "sum"), min_duration_ms=("min_ms", "min"),
                                                  max_duration_ms=("max_ms", "max"))
    out["steps"] //= run.ranks
    out["duration_ms"] = out["sum_ms"] / (out["steps"] * run.ranks)
    found, medians = grouped_quantile(blocks["sketch"].tolist(), blocks["bucket"].to_numpy(), 0.5)
    out["median_duration_ms"] = pd.Series(medians, index=found).reindex(out.index)
    return out.reset_index(drop=True)


def _blocks_per_bucket(run: StoredRun, first: int, last: int, max_points: int) -> int:
    """Whole blocks per plotted point so that [first, last] fits in max_points points."""
    return max(1, math.ceil((last - first + 1) / run.model.retention.block_steps / max(1, max_points)))


def outlier_steps(run: StoredRun) -> pd.DataFrame:
    """The outlier steps the run kept in full (over twice the median step so far; dpprof.store.retention), for a
    step-time chart to mark. Empty for a run read from its rows (its chart shows every step).

    Returns:
        columns step, duration_ms, median_ms.
    """
    if not run.model.aggregated:
        return pd.DataFrame(columns=["step", "duration_ms", "median_ms"])
    out = run.query("SELECT step, duration_ms, median_ms FROM outlier_steps ORDER BY step")
    return out.drop(columns="rank").sort_values("step", kind="stable").reset_index(drop=True)


def step_span(run: StoredRun) -> tuple[int | None, int | None]:
    """The run's first and last step (None, None before its first step): a lookup, not a scan."""
    return _span(run)


def _span(run: StoredRun) -> tuple[int | None, int | None]:
    # a long run's steps were written in order: its first and last rows are its first and last steps (two lookups)
    span = run.query("SELECT (SELECT step FROM steps ORDER BY rowid LIMIT 1) AS a, "
                     "(SELECT step FROM steps ORDER BY rowid DESC LIMIT 1) AS b" if run.model.aggregated
                     else "SELECT MIN(step) AS a, MAX(step) AS b FROM steps")
    if span["a"].isna().all():
        return None, None
    return int(span["a"].min()), int(span["b"].max())


def step_parts(run: StoredRun, first: int | None = None, last: int | None = None) -> pd.DataFrame:
    """Each step of each rank split into its parts (dpprof.stepmodel: the phases by priority, clipped to the step,
    and the rest), in ms, from the run's rows: the parts of a step sum to its duration_ms.

    Returns:
        columns rank, step, window_ms (the step's duration_ms), one per part (stacked_phases' order), rest.
    """
    parts = parts_for(run.model.phases)
    names = [p for p in stacked_phases(run.model.phases)]
    lo, hi = (first, last) if first is not None else _span(run)
    if lo is None:
        return pd.DataFrame(columns=["rank", "step", "window_ms", *names, REST])
    steps = run.query("SELECT step, start_ms AS lo, start_ms + duration_ms AS hi FROM steps WHERE step BETWEEN ? AND ?",
                      (lo, hi))
    kinds = [k for _, ks in parts for k in ks]
    rows = run.query(f"SELECT step, phase AS kind, start_ms AS start, start_ms + duration_ms AS end FROM phases "
                     f"WHERE {_phase_in(kinds)} AND step BETWEEN ? AND ?", (*kinds, lo, hi)) if kinds else None
    if rows is None or rows.empty:
        rows = pd.DataFrame(columns=["rank", "step", "kind", "start", "end"])
    out = partition(steps, rows, parts, ["rank", "step"])
    return out[["rank", "step", "window_ms", *names, REST]]


def phase_breakdown(run: StoredRun, max_points: int = MAX_POINTS, steps: pd.DataFrame | None = None) -> pd.DataFrame:
    """Mean milliseconds per step of each part of the step (dpprof.stepmodel: the phases that follow one another,
    overlaps counted once, by priority) and the rest: the columns of a row sum to its step_ms.

    ``parallel_apply`` is the wall time of every device's apply together; ``rest_ms`` is the part of
    the step no recorded phase covers (the optimizer step, loading the batch, Python in between).

    Returns:
        columns step (first of the bucket), steps, step_ms, one ``<phase>_ms`` per stacked phase, rest_ms.
        ``steps``: step_times(run, max_points), if the caller has it already.
    """
    phases = stacked_phases(run.model.phases)
    cols = ["step", "steps", "step_ms", *[f"{p}_ms" for p in phases], "rest_ms"]
    steps = step_times(run, max_points) if steps is None else steps
    if steps.empty:
        return pd.DataFrame(columns=cols)
    first, last = _span(run)
    out = steps.rename(columns={"duration_ms": "step_ms"})[["step", "steps", "step_ms"]].copy()
    if run.model.aggregated:  # buckets of whole blocks, as step_times makes them; recorded phases never overlap
        per_bucket = _blocks_per_bucket(run, first, last, max_points)
        out.index = out["step"] // run.model.retention.block_steps // per_bucket
        sums = run.query(f"SELECT block / ? AS bucket, phase, SUM(sum_ms) AS ms FROM phase_blocks WHERE {_phase_in(phases)} "
                         "GROUP BY bucket, phase", (per_bucket, *phases)) if phases else None
        if phases:
            sums = sums.groupby(["bucket", "phase"], as_index=False)["ms"].sum()
            sums["ms"] /= run.ranks  # a distributed run: the ranks' mean
            table = sums.pivot(index="bucket", columns="phase", values="ms").reindex(columns=phases)
            per_step = table.reindex(out.index).fillna(0.0).div(out["steps"], axis=0)
        else:
            per_step = pd.DataFrame(index=out.index)
        for phase in phases:
            out[f"{phase}_ms"] = per_step[phase]
        out["rest_ms"] = (out["step_ms"] - per_step.sum(axis=1)).clip(lower=0.0)
        return out.reset_index(drop=True)[cols]
    width = bucket_width(first, last, max_points)
    out.index = (out["step"] - first) // width
    parts = step_parts(run, first, last)
    parts["bucket"] = (parts["step"] - first) // width
    # each bucket's mean step, as step_times gives it: the ranks' mean of their steps' mean
    means = parts.groupby(["bucket", "rank"])[["window_ms", *phases, REST]].mean().groupby("bucket").mean()
    means = means.reindex(out.index)
    out["step_ms"] = means["window_ms"].fillna(out["step_ms"])
    for phase in phases:
        out[f"{phase}_ms"] = means[phase].fillna(0.0)
    out["rest_ms"] = means[REST].fillna(0.0)
    return out.reset_index(drop=True)[cols]


def phase_totals(run: StoredRun, stats: dict[str, Any] | None = None) -> pd.DataFrame:
    """Each part of the step (dpprof.stepmodel): its total, its mean per step and its share of the step time; the
    parts and the rest sum to the run's step time, their shares to 100%.

    Args:
        stats: run_stats(run), if the caller has it already.

    Returns:
        columns phase, total_ms, per_step_ms, share_pct; one row per stacked phase and "rest".
    """
    stats = run_stats(run) if stats is None else stats
    cols = ["phase", "total_ms", "per_step_ms", "share_pct"]
    if not stats["steps"]:
        return pd.DataFrame(columns=cols)
    phases = stacked_phases(run.model.phases)
    if run.model.aggregated:  # recorded phases never overlap: their block sums are their parts
        sums = pd.Series(dtype=float)
        if phases:
            sums = run.query(f"SELECT phase, SUM(sum_ms) AS total_ms FROM phase_blocks WHERE {_phase_in(phases)} "
                             "GROUP BY phase", tuple(phases)).groupby("phase")["total_ms"].sum() / run.ranks
        totals = sums.reindex(phases).fillna(0.0)
        totals[REST] = max(0.0, stats["total_ms"] - totals.sum())
        per_step = totals / stats["steps"]
    else:
        parts = step_parts(run, stats["first_step"], stats["last_step"])
        totals = parts[[*phases, REST]].sum() / run.ranks  # a distributed run: the ranks' mean
        totals.index.name = None
        # each rank's mean over its own steps, then the ranks' mean: ranks may hold different step counts (an imported
        # job whose rank's profiler stopped early), whose totals over the most steps understated every part
        per_step = parts.groupby("rank")[[*phases, REST]].mean().mean() if len(parts) else totals
    out = totals.rename("total_ms").rename_axis("phase").reset_index()
    out["per_step_ms"] = out["phase"].map(per_step).astype(float)
    out["share_pct"] = 100 * out["total_ms"] / stats["total_ms"] if stats["total_ms"] else float("nan")
    return out[cols]


def _phase_in(phases: tuple[str, ...]) -> str:
    return f"phase IN ({', '.join('?' * len(phases))})"


def work_samples(run: StoredRun, per_device: int = WORK_SAMPLE_PER_DEVICE, skip_first: bool = False) -> pd.DataFrame:
    """Each device's work (run.model.work: DataParallel's apply, a rank's forward and backward compute) in ms per
    step, forward calls summed; past per_device steps, every k-th step only, so each device has about
    per_device values.

    Args:
        skip_first: leave the run's first step out (its one-time costs), as the imbalance and the findings do.

    Returns:
        columns step, device, duration_ms, devices in the run's order.
    """
    first, last = _span(run)
    if first is None:  # typed: p50 and p95 of no samples are NaN (a run whose steps were left out as damaged)
        return pd.DataFrame({"step": pd.Series(dtype="int64"), "device": pd.Series(dtype=object),
                             "duration_ms": pd.Series(dtype=float)})
    phases = run.model.work.phases
    if run.model.aggregated:  # the steps whose detail stands for the run, every m-th of them: index lookups
        steps = _sampled_steps(run, first, last, per_device)
        steps = steps[steps > first] if skip_first else steps
        out = run.query("SELECT step, device, SUM(duration_ms) AS duration_ms FROM phases "
                        f"WHERE {_phase_in(phases)} AND step IN (SELECT value FROM json_each(?)) GROUP BY device, step",
                        (*phases, json.dumps(steps.tolist())))
    else:
        stride = bucket_width(first, last, per_device)
        out = run.query("SELECT step, device, SUM(duration_ms) AS duration_ms FROM phases "
                        f"WHERE {_phase_in(phases)} AND step % ? = 0 AND step > ? GROUP BY device, step",
                        (*phases, stride, first if skip_first else first - 1))
    out = out.drop(columns=["rank"])
    order = {d: i for i, d in enumerate(run.model.devices)}
    return out.sort_values(["device", "step"], key=lambda s: s.map(order) if s.name == "device" else s,
                           kind="stable").reset_index(drop=True)


def _sampled_steps(run: StoredRun, first: int, last: int, per_device: int) -> np.ndarray:
    """About per_device steps from ``first`` to ``last``, evenly through the steps whose detail stands for a long run
    (RunModel.sample_ranges, the rule of its sampled_steps_sql)."""
    # ranges, never arrays of every step: a damaged file's step numbers may span far more steps than it holds
    parts = [p[bisect.bisect_left(p, first):] for p in run.model.sample_ranges(stop=last + 1)]
    total = sum(len(p) for p in parts)
    stride = max(1, math.ceil(total / max(1, per_device)))
    picked, offset = [], 0
    for part in parts:  # every stride-th step of the ranges one after another
        picked.extend(part[(-offset) % stride::stride])
        offset += len(part)
    return np.array(picked, dtype=np.int64)


def work_stats(run: StoredRun, samples: pd.DataFrame | None = None, percentiles: bool = True,
               stats: dict[str, Any] | None = None) -> pd.DataFrame:
    """Per device: work steps, mean, min and max over every step (forward calls summed), p50 and p95 over the steps
    past the first (of ``samples``, default work_samples(run, skip_first=True): exact up to WORK_SAMPLE_PER_DEVICE
    steps, from every k-th step beyond; a long run's from its quantile sketches, within 1%), and the mean's share of
    the mean step. The work is run.model.work (DataParallel's apply). The p50 is the findings' median work per step
    (the first step, with its one-time costs, left out: findings.imbalance's medians, the Overview's bars), so
    ``dpprof show`` and the straggler finding state one figure.

    Args:
        samples: work_samples(run), if the caller has it already (its first step is left out here).
        percentiles: False leaves p50 and p95 out (NaN), which saves reading the samples.
        stats: run_stats(run), if the caller has it already.

    Returns:
        columns device, steps, work_mean_ms, work_min_ms, work_max_ms, work_p50_ms, work_p95_ms,
        work_share_of_step_pct, sampled (True when the percentiles are not exact: from every k-th step, or
        from the sketches).
    """
    cols = ["device", "steps", "work_mean_ms", "work_min_ms", "work_max_ms", "work_p50_ms", "work_p95_ms",
            "work_share_of_step_pct", "sampled"]
    if run.model.aggregated:
        return _work_stats_of_blocks(run, percentiles, stats)[cols]
    rows = []
    phases = run.model.work.phases
    first, _ = _span(run)
    for device in run.model.devices:  # one device at a time: SQLite walks the index, never sorts
        r = _one_row(run.query("SELECT COUNT(*) AS steps, SUM(step > ?) AS later_steps, AVG(ms) AS work_mean_ms, "
                               "MIN(ms) AS work_min_ms, MAX(ms) AS work_max_ms FROM (SELECT step, "
                               f"SUM(duration_ms) AS ms FROM phases WHERE {_phase_in(phases)} AND device = ? "
                               "GROUP BY step)",
                               (first, *phases, device)), "steps")
        if r["steps"]:
            rows.append({"device": device, **r.to_dict()})
    if not rows:
        return pd.DataFrame(columns=cols)
    out = pd.DataFrame(rows)
    out["steps"] = out["steps"].astype(int)
    out["work_p50_ms"] = out["work_p95_ms"] = float("nan")
    out["sampled"] = False
    if percentiles:
        samples = work_samples(run, skip_first=True) if samples is None else samples
        samples = samples[samples["step"] != first].astype({"duration_ms": float})  # as the findings' medians
        q = (samples.groupby("device")["duration_ms"].quantile([0.5, 0.95]).unstack() if len(samples) else
             pd.DataFrame(columns=[0.5, 0.95], dtype=float))  # one step: none past the first
        out["work_p50_ms"] = out["device"].map(q[0.5])
        out["work_p95_ms"] = out["device"].map(q[0.95])
        out["sampled"] = out["device"].map(samples.groupby("device").size()).fillna(0) < out["later_steps"]
    out["work_share_of_step_pct"] = 100 * out["work_mean_ms"] / out["device"].map(_mean_step_of(run, stats))
    return out[cols]


def _mean_step_of(run: StoredRun, stats: dict[str, Any] | None) -> dict[str, float]:
    """Device -> the mean step its work is a share of: the run's, or in a run of several rank files each rank's own
    (ranks step together, but each measures its own steps: a rank that waited for a late one at the first collective
    has a longer first step)."""
    devices = list(run.model.devices)
    if run.ranks > 1:
        per = _steps_per_file(run)
        own = {f"rank:{int(r)}": float(ms) for r, ms in zip(per["rank"], per["mean_step_ms"]) if pd.notna(ms) and ms > 0}
        if all(d in own for d in devices):
            return own
    mean_step = (run_stats(run) if stats is None else stats)["mean_step_ms"]
    return {d: mean_step if mean_step else float("nan") for d in devices}


def _work_stats_of_blocks(run: StoredRun, percentiles: bool, stats: dict[str, Any] | None) -> pd.DataFrame:
    """work_stats from the work rows of phase_blocks (sums, extremes and sketches per block)."""
    blocks = run.query("SELECT device, SUM(steps) AS steps, SUM(sum_ms) AS sum_ms, MIN(min_ms) AS min_ms, "
                       "MAX(max_ms) AS max_ms FROM phase_blocks WHERE phase = ? GROUP BY device", (WORK,))
    blocks = blocks.groupby("device").agg(steps=("steps", "sum"), sum_ms=("sum_ms", "sum"), min_ms=("min_ms", "min"),
                                          max_ms=("max_ms", "max"))
    sketches = (run.query("SELECT device, sketch FROM run_sketches WHERE kind = ?", (WORK,))
                if percentiles else pd.DataFrame(columns=["device", "sketch"]))
    rows = []
    for device in run.model.devices:
        if device not in blocks.index or not blocks.at[device, "steps"]:
            continue
        b = blocks.loc[device]
        p50, p95 = (quantiles(sketches.loc[sketches["device"] == device, "sketch"], (0.5, 0.95)) if percentiles
                    else (float("nan"), float("nan")))
        rows.append({"device": device, "steps": int(b["steps"]), "work_mean_ms": float(b["sum_ms"] / b["steps"]),
                     "work_min_ms": float(b["min_ms"]), "work_max_ms": float(b["max_ms"]),
                     "work_p50_ms": p50, "work_p95_ms": p95, "sampled": percentiles})
    out = pd.DataFrame(rows, columns=["device", "steps", "work_mean_ms", "work_min_ms", "work_max_ms", "work_p50_ms",
                                      "work_p95_ms", "sampled"])
    out["work_share_of_step_pct"] = 100 * out["work_mean_ms"] / out["device"].map(_mean_step_of(run, stats))
    return out


def chunk_counts(run: StoredRun) -> pd.DataFrame:
    """How many forward calls gave each device each chunk size (None: a call without a batch
    dimension, such as a whole-batch loss).

    Returns:
        columns device, chunk_size, calls.
    """
    if run.model.aggregated:
        out = run.query("SELECT device, chunk_size, SUM(calls) AS calls FROM chunk_counts GROUP BY device, chunk_size")
        order = {d: i for i, d in enumerate(run.model.devices)}
        out = out.drop(columns=["rank"]).groupby(["device", "chunk_size"], as_index=False, dropna=False)["calls"].sum()
        out = out.sort_values(["device", "chunk_size"], key=lambda c: c.map(order) if c.name == "device" else c,
                              kind="stable").reset_index(drop=True)
        return out.astype({"chunk_size": float, "calls": int})
    parts = [run.query("SELECT ? AS device, chunk_size, COUNT(*) AS calls FROM memory WHERE device = ? "
                       "GROUP BY chunk_size ORDER BY chunk_size", (device, device)) for device in run.model.devices]
    parts = [p for p in parts if len(p)]
    if not parts:
        return pd.DataFrame(columns=["device", "chunk_size", "calls"])
    out = pd.concat(parts, ignore_index=True).drop(columns=["rank"])
    return out.astype({"chunk_size": float, "calls": int})


def memory_peaks(run: StoredRun, chunks: pd.DataFrame | None = None, detail: bool = True) -> pd.DataFrame:
    """Per device: its peak step (the most dpprof accounts to it in one step, forward calls summed),
    what it held then by kind, its chunk sizes, and the CUDA allocator's peaks.

    Args:
        chunks: chunk_counts(run), if the caller has it already.
        detail: False leaves the kinds and chunk sizes out (NaN): peaks and the output device only.

    Returns:
        columns device, output_device (True for the device gathered outputs landed on), peak_step,
        peak_held_bytes, one column per MEMORY_BYTES (at the peak step), chunk_size_mean,
        chunk_size_min, chunk_size_max (NaN without dpprof's accounting: imported traces),
        peak_allocated_bytes and peak_reserved_bytes (NaN without allocator records: CPU workers).
        A device with allocator figures only (an imported trace's GPU) has a row too.
    """
    cols = ["device", "output_device", "peak_step", "peak_held_bytes", *MEMORY_BYTES, "chunk_size_mean",
            "chunk_size_min", "chunk_size_max", "peak_allocated_bytes", "peak_reserved_bytes"]
    rows = []
    accounted = "memory" in run.model.has
    aggregated = run.model.aggregated
    if aggregated:  # every device's peak block in one query (SQLite's bare columns come from the MAX() row)
        peaks = run.query(f"SELECT device, peak_step AS step, MAX(peak_held_bytes) AS held, {', '.join(MEMORY_BYTES)} "
                          "FROM memory_blocks GROUP BY device").sort_values("held", ascending=False, kind="stable")
        peaks = peaks.drop_duplicates("device").set_index("device")
        gathered = run.query("SELECT device, MAX(gathered_bytes) AS gathered FROM memory_blocks GROUP BY device")
        gathered = gathered.groupby("device")["gathered"].max()
        allocs = run.query("SELECT device, MAX(peak_allocated_bytes) AS peak_allocated_bytes, MAX(reserved_max_bytes) "
                           "AS peak_reserved_bytes FROM allocator_blocks GROUP BY device")
        allocs = allocs.groupby("device")[["peak_allocated_bytes", "peak_reserved_bytes"]].max()
    for device in run.model.devices:
        row: dict[str, Any] = {"device": device, "peak_step": None, "peak_held_bytes": float("nan"),
                               **dict.fromkeys(MEMORY_BYTES, float("nan")), "_gathered": 0}
        if accounted and aggregated:
            # the block whose peak is the run's: its peak step and what was held then, by kind
            if device in peaks.index and pd.notna(peaks.at[device, "held"]):
                peak = peaks.loc[device]
                row.update({"peak_step": int(peak["step"]), "peak_held_bytes": float(peak["held"]),
                            **{c: float(peak[c]) if detail else float("nan") for c in MEMORY_BYTES},
                            "_gathered": gathered.get(device) or 0})
        elif accounted:
            # SQLite gives the bare column (step) of the row holding the one MAX(): the peak step
            peak = _one_row(run.query(
                f"SELECT step, MAX(held) AS held, SUM(gathered) AS gathered FROM (SELECT step, SUM({_HELD}) AS held, "
                "SUM(gathered_bytes) AS gathered FROM memory WHERE device = ? GROUP BY step)", (device,)), "held")
            if pd.notna(peak["held"]):
                kinds = (_one_row(run.query(f"SELECT {', '.join(f'SUM({c}) AS {c}' for c in MEMORY_BYTES)} "
                                            "FROM memory WHERE device = ? AND step = ?", (device, int(peak["step"]))),
                                  MEMORY_BYTES[0])
                         if detail else dict.fromkeys(MEMORY_BYTES, float("nan")))
                row.update({"peak_step": int(peak["step"]), "peak_held_bytes": float(peak["held"]),
                            **{c: float(kinds[c]) for c in MEMORY_BYTES}, "_gathered": peak["gathered"] or 0})
        if aggregated:
            alloc = (allocs.loc[device] if device in allocs.index else
                     pd.Series({"peak_allocated_bytes": float("nan"), "peak_reserved_bytes": float("nan")}))
        else:
            alloc = _one_row(run.query("SELECT MAX(peak_allocated_bytes) AS peak_allocated_bytes, MAX(reserved_bytes) "
                                       "AS peak_reserved_bytes FROM allocator WHERE device = ?", (device,)),
                             "peak_allocated_bytes")
        if row["peak_step"] is None and pd.isna(alloc["peak_allocated_bytes"]):
            continue  # nothing measured on this device (an idle device of a DataParallel run)
        rows.append({**row, **alloc.to_dict()})
    if not rows:
        return pd.DataFrame(columns=cols)
    out = pd.DataFrame(rows)
    # DataParallel's gather lands on one device; FSDP's gathered_bytes are its all-gathered parameters, on every rank
    out["output_device"] = (out["_gathered"] == out["_gathered"].max()) & (out["_gathered"] > 0) & (
        run.model.kind != "fsdp")
    if chunks is None:
        chunks = chunk_counts(run) if detail else pd.DataFrame(columns=["device", "chunk_size", "calls"])
    sized = chunks.dropna(subset=["chunk_size"]).astype({"chunk_size": float, "calls": float})
    weighted = sized.assign(total=sized["chunk_size"] * sized["calls"]).groupby("device")
    out["chunk_size_mean"] = out["device"].map(weighted["total"].sum() / weighted["calls"].sum())
    out["chunk_size_min"] = out["device"].map(sized.groupby("device")["chunk_size"].min())
    out["chunk_size_max"] = out["device"].map(sized.groupby("device")["chunk_size"].max())
    out = out.astype({"peak_held_bytes": float, "peak_allocated_bytes": float, "peak_reserved_bytes": float})
    out["peak_step"] = out["peak_step"].astype("Int64")
    return out[cols]


GPU_METRICS = ("gpu_util_pct", "memory_util_pct", "memory_used_bytes", "memory_total_bytes", "power_w",
               "power_limit_w", "temperature_c", "sm_clock_mhz")


def gpu_series(run: StoredRun, max_points: int = MAX_POINTS) -> pd.DataFrame:
    """NVML samples over time per GPU, averaged over buckets of time so each GPU has at most max_points.

    Returns:
        columns t_ms (bucket start), device, samples, and the mean of each GPU metric (NaN where NVML
        had no value); empty when the run has no GPU samples (CPU workers, no NVML).
    """
    span = run.query("SELECT MIN(t_ms) AS a, MAX(t_ms) AS b FROM gpu_samples")
    if span["a"].isna().all():
        return pd.DataFrame(columns=["t_ms", "device", "samples", *GPU_METRICS])
    width = max((span["b"].max() - span["a"].min()) / max(1, max_points), 1e-9)
    means = ", ".join(f"AVG({m}) AS {m}" for m in GPU_METRICS)
    out = run.query(f"SELECT MIN(t_ms) AS t_ms, device, COUNT(*) AS samples, {means} FROM gpu_samples "
                    "GROUP BY device, CAST((t_ms - ?) / ? AS INTEGER) ORDER BY device, t_ms",
                    (float(span["a"].min()), float(width)))
    if run.ranks > 1:  # each rank samples its own GPUs
        out["device"] = out["device"] + " (rank " + out["rank"].astype(str) + ")"
    out = out.drop(columns="rank")
    out = out.sort_values(["device", "t_ms"], key=lambda s: s.map(device_key) if s.name == "device" else s,
                          kind="stable").reset_index(drop=True)
    return out.astype({m: float for m in GPU_METRICS})


def timeline(run: StoredRun, first_step: int, last_step: int) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The phases and steps of steps first_step..last_step (at most TIMELINE_MAX_STEPS of them).

    Returns:
        (phases with step, call, phase, device, start_ms, duration_ms, end_ms;
         steps with step, start_ms, duration_ms, end_ms)
    """
    last_step = min(last_step, first_step + TIMELINE_MAX_STEPS - 1)
    phases = run.query("SELECT step, call, phase, device, start_ms, duration_ms FROM phases "
                       "WHERE step BETWEEN ? AND ? ORDER BY start_ms", (first_step, last_step))
    steps = run.query("SELECT step, start_ms, duration_ms FROM steps WHERE step BETWEEN ? AND ? ORDER BY step",
                      (first_step, last_step))
    if run.ranks > 1:  # ranks step together: each step from the first rank's start to the last's end
        steps["end_ms"] = steps["start_ms"] + steps["duration_ms"]
        steps = steps.groupby("step", as_index=False).agg(start_ms=("start_ms", "min"), end_ms=("end_ms", "max"))
        steps["duration_ms"] = steps["end_ms"] - steps["start_ms"]
        phases = phases.sort_values("start_ms", kind="stable").reset_index(drop=True)
    phases = phases.drop(columns="rank")
    phases["end_ms"] = phases["start_ms"] + phases["duration_ms"]
    steps["end_ms"] = steps["start_ms"] + steps["duration_ms"]
    return phases, steps[["step", "start_ms", "duration_ms", "end_ms"]]


def sampled_comm_rows(run: StoredRun) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """The collectives, the steps and each rank's backward compute, over the steps whose detail stands for the
    run (every step, or a long run's sample: RunModel.sampled_steps_sql), for dpprof.views.overview.comm_stats.

    Returns:
        (comms: step, device, bucket, bucket_bytes, launch_ms, duration_ms, collective, rank;
        steps: step, start_ms, duration_ms, rank; compute: the backward_compute phases' step, device, start_ms,
        duration_ms, rank).
    """
    sampled = run.model.sampled_steps_sql()
    comms = run.query("SELECT step, device, bucket, bucket_bytes, launch_ms, duration_ms, collective FROM comms "
                      f"WHERE {sampled}")
    steps = run.query(f"SELECT step, start_ms, duration_ms FROM steps WHERE {sampled}")
    compute = run.query("SELECT step, device, start_ms, duration_ms FROM phases "
                        f"WHERE phase = 'backward_compute' AND {sampled}")
    return comms, steps, compute


def detail_steps(run: StoredRun, first_step: int, last_step: int) -> list[int]:
    """The steps of first_step..last_step that kept their detail rows (every step of a run not thinned)."""
    if not run.model.thinned:
        return list(range(first_step, last_step + 1))
    kept = run.query("SELECT DISTINCT step FROM phases WHERE step BETWEEN ? AND ? UNION "
                     "SELECT DISTINCT step FROM memory WHERE step BETWEEN ? AND ?",
                     (first_step, last_step, first_step, last_step))
    return sorted(int(s) for s in kept["step"].unique())


GPU_TIME_PARTS = ("computation_ms", "overlapping_ms", "communication_ms", "memcpy_ms", "memset_ms", "idle_ms")


def gpu_time(run: StoredRun) -> pd.DataFrame:
    """Mean ms per step of each GPU (or rank's GPU) by what it ran, from an imported trace's gpu_time table:
    the TensorBoard plugin's Distributed view, a partition of the step (dpprof.stepmodel's GPU_PARTS):
    computation and communication without their overlap, the overlap, copies under no kernel, memsets under no
    kernel or copy, idle; the parts sum to step_ms. Empty for recorded runs.

    Returns:
        columns device, steps, step_ms, one column per GPU_TIME_PARTS, busy_ms (step_ms - idle_ms), idle_pct.
    """
    cols = ["device", "steps", "step_ms", *GPU_TIME_PARTS, "busy_ms", "idle_pct"]
    if "gpu_time" not in run.model.has:
        return pd.DataFrame(columns=cols)
    table = run.query("SELECT step, device, window_ms, compute_ms, communication_ms, overlap_ms, memcpy_ms, memset_ms, "
                      "idle_ms FROM gpu_time")  # one row per step and GPU: small
    t = table.assign(computation_ms=table["compute_ms"] - table["overlap_ms"], overlapping_ms=table["overlap_ms"],
                     communication_ms=table["communication_ms"] - table["overlap_ms"])
    per = t.groupby("device", as_index=False).agg(
        steps=("step", "count"), step_ms=("window_ms", "mean"), **{c: (c, "mean") for c in GPU_TIME_PARTS})
    order = {d: i for i, d in enumerate(run.model.devices)}
    per = per.sort_values("device", key=lambda s: s.map(lambda d: (order.get(d, len(order)), device_key(d))))
    per["busy_ms"] = per["step_ms"] - per["idle_ms"]
    per["idle_pct"] = 100 * per["idle_ms"] / per["step_ms"]
    return per.reset_index(drop=True)[cols]


# A phase's mean per step over its part of the step by more than this (and PHASE_OVERLAP_SHARE of the mean) runs
# during another phase: a recorded step's phases meet end to end, and clipping them to the step moves a few µs.
PHASE_OVERLAP_MS = 0.5
PHASE_OVERLAP_SHARE = 0.05


def phase_overlaps(run: StoredRun, means: pd.DataFrame) -> pd.DataFrame:
    """The phases of ``means`` (phase_means) that run during others: where a phase's mean per step is over its part
    of the step (step_parts: each moment of a step to one phase, the Overview's shares), by more than
    PHASE_OVERLAP_MS and PHASE_OVERLAP_SHARE of it, e.g. an imported trace's optimizer inside backward. Only a run
    with one device per rank (DDP, a trace's ranks) is compared: a DataParallel step's parts are its rank's, not a
    device's; FSDP's phases nest in forward and backward by design (their table names them); a run read from its
    blocks is not.

    Returns:
        columns device, phase, mean_ms, part_ms.
    """
    cols = ["device", "phase", "mean_ms", "part_ms"]
    devices = list(run.model.devices)
    if run.model.aggregated or run.model.fsdp_phases or len(devices) != run.ranks or means.empty:
        return pd.DataFrame(columns=cols)
    parts = step_parts(run)
    if parts.empty:
        return pd.DataFrame(columns=cols)
    steps = _device_steps(run)
    per_rank = parts.drop(columns=["step", "window_ms", REST]).groupby("rank").sum()
    rows = []
    for rank, part_sum in per_rank.iterrows():
        device = f"rank:{rank}" if f"rank:{rank}" in means.index else devices[0] if len(devices) == 1 else None
        if device not in means.index:
            continue
        part = part_sum / steps[(rank, device)]  # over the device's steps, as phase_means averages it
        for phase, part_ms in part.items():
            mean_ms = means.loc[device].get(f"{phase}_ms")
            if pd.notna(mean_ms) and mean_ms - part_ms > max(PHASE_OVERLAP_MS, PHASE_OVERLAP_SHARE * mean_ms):
                rows.append({"device": device, "phase": phase, "mean_ms": float(mean_ms), "part_ms": float(part_ms)})
    return pd.DataFrame(rows, columns=cols)


def _device_steps(run: StoredRun) -> pd.Series:
    """(rank, device) -> how many steps the device ran a phase in (a run read from its rows)."""
    return run.query("SELECT device, COUNT(DISTINCT step) AS steps FROM phases GROUP BY device") \
        .set_index(["rank", "device"])["steps"]


def phase_means(run: StoredRun) -> pd.DataFrame:
    """Mean milliseconds per step (every step, the first's one-time costs included, as the Overview's share of the
    step) of each phase on each device (devices as rows in the run's order, phases as
    ``<phase>_ms`` columns in step order); a phase run several times in one step is summed within the step.
    NaN where a device does not run a phase (only the output device scatters). Each device's means are over every
    step it took part in, a step without the phase counting 0 (an evaluation step's backward), as phase_totals'
    per_step_ms counts it; a device with no chunk in a step (a batch smaller than the devices) has no such step."""
    if run.model.aggregated:
        per = run.query("SELECT device, phase, SUM(sum_ms) AS ms, SUM(steps) AS steps FROM phase_blocks "
                        "WHERE phase != ? GROUP BY device, phase", (WORK,))
        # a device's steps: those of the phase it ran in most (the output device's scatter, each device's apply)
        steps = per.groupby(["rank", "device"])["steps"].transform("max")
    else:
        per = run.query("SELECT device, phase, SUM(duration_ms) AS ms FROM phases GROUP BY device, phase")
        steps = _device_steps(run).reindex(pd.MultiIndex.from_frame(per[["rank", "device"]])).to_numpy()
    per["ms"] /= steps
    table = per.pivot_table(index="device", columns="phase", values="ms", aggfunc="sum")
    table = table.reindex(index=[d for d in run.model.devices if d in table.index],
                          columns=[p for p in run.model.phases if p in table.columns])
    table.columns = [f"{c}_ms" for c in table.columns]
    table.index.name = "device"
    return table

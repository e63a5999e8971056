"""Per-block aggregates of a run, built by the writer as records arrive, never by re-reading the file.

A block is ``Retention.block_steps`` consecutive steps. For each block the writer keeps:

- ``step_blocks``: the steps' count, sum, min, max and a quantile sketch of their durations, the largest
  batch and the most devices a step used, the steps a backward ran in with their samples, and the steps whose
  forward raised and ran no backward;
- ``phase_blocks``: per device and phase, the per-step sums (forward calls summed): steps, calls, sum, min,
  max, the CUDA event sum; and a ``work`` row per device, with a sketch (the pages show quantiles of the work
  alone) (DataParallel's apply, a rank's forward
  + backward compute: dpprof.store.model.Work) with, across devices, how often each device was the
  slowest and how long the others waited for it (the imbalance's figures, dpprof.findings.floors);
- ``memory_blocks``: per device, the mean held and the peak step with what it held by kind;
- ``allocator_blocks``: per device and phase, the CUDA allocator's maxima;
- ``chunk_counts``: per device and chunk size, the forward calls (whole run);
- ``run_sketches``: the whole run's sketches of the step time and of each device's work past the first step
  (what a page's median and percentiles read; the findings' medians leave the first step out too);
- ``outlier_steps``: the outlier steps the retention keeps (dpprof.store.retention).

A step's records are added up once the step is settled: ``SETTLE_STEPS`` newer steps have been seen
(a CUDA phase's record arrives when its events complete, a step or two late), or at close. Open blocks
live in memory and are rewritten whole at each commit, in the commit's transaction, so a killed process
leaves aggregates that match its committed rows. A record for a block already written and let go (later
than SETTLE_STEPS: rare) is merged into the stored row in SQL.
"""
from __future__ import annotations

import math
from collections.abc import Iterable
from itertools import combinations
from typing import Any, cast

from dpprof.records import (MEMORY_BYTES, MEMORY_ROW, PHASE_ROW, STEP_ROW, AllocatorRecord, DeviceMemoryRecord,
                            GpuSampleRecord, PhaseRecord, Record, Row, StepRecord)
from dpprof.store.retention import DETAIL_TABLES, OUTLIER_RATIO, Retention
from dpprof.store.sketch import Sketch, bucket

__all__ = ["SETTLE_STEPS", "WORK", "WORK_PHASES", "TRAINING", "EVALUATION", "Aggregator", "SampleWindows"]

SETTLE_STEPS = 8  # CUDA phase records arrive when their events complete: a step or two late, seldom more
WORK = "work"  # the pseudo-phase of each device's own share of a step in phase_blocks
# run_sketches' kinds of the steps a backward ran in and of the others (evaluation forwards), a step whose forward
# raised and ran no backward being neither (dpprof.store.queries.raised_steps_of): each kind's median
TRAINING, EVALUATION = "training", "evaluation"
WORK_PHASES = ("apply", "forward", "backward_compute")  # summed per device and step: dpprof.store.model._work
_NO_STEP = 2**62  # a _Stat's first step before its first value: above every step
_MEDIAN_EVERY = 64  # settled steps between recomputations of the running median step (the outlier rule's)

Statement = tuple[str, Any]


class _Stat:
    """count, sum, min, max and a sketch of per-step values; the work row's imbalance sums."""

    __slots__ = ("first_step", "last_step", "steps", "calls", "sum", "min", "max", "device_sum", "sketch",
                 "slowest", "wait_sum", "late", "batch", "devices_used", "trained", "trained_samples", "raised")

    def __init__(self, late: bool = False, sketched: bool = True) -> None:
        # set by the first add (statements writes a stat once it has one): bounds no step number reaches
        self.first_step = _NO_STEP
        self.last_step = -1
        self.steps = self.calls = 0
        self.sum = 0.0
        self.min = math.inf
        self.max = -math.inf
        self.device_sum: float | None = None
        self.sketch = Sketch() if sketched else None
        self.slowest = 0
        self.wait_sum = 0.0
        self.late = late
        self.batch: int | None = None  # step blocks: the largest batch and most devices used
        self.devices_used = 0
        self.trained = self.trained_samples = 0  # step blocks: the steps a backward ran in, and their batches
        self.raised = 0  # step blocks: the steps whose forward raised and ran no backward

    def add(self, step: int, value: float, calls: int = 1, device_value: float | None = None,
            key: int | None = None) -> None:
        """Count one step's ``value``; ``key``, where given, is its sketch bucket (``bucket(value)``)."""
        if step < self.first_step:
            self.first_step = step
        if step > self.last_step:
            self.last_step = step
        self.steps += 1
        self.calls += calls
        self.sum += value
        if value < self.min:
            self.min = value
        if value > self.max:
            self.max = value
        if device_value is not None:
            self.device_sum = (self.device_sum or 0.0) + device_value
        if self.sketch is not None:  # Sketch.add_bucket, inlined: the writer adds some ten values a step
            counts = self.sketch.counts
            key = bucket(value) if key is None else key
            counts[key] = counts.get(key, 0) + 1

    def sketch_bytes(self) -> bytes | None:
        return self.sketch.to_bytes() if self.sketch is not None else None


class _Memory:
    __slots__ = ("first_step", "last_step", "steps", "calls", "held_sum", "peak_step", "peak", "kinds", "late")

    def __init__(self, late: bool = False) -> None:
        self.first_step: int | None = None
        self.last_step: int | None = None
        self.peak_step: int | None = None
        self.steps = self.calls = 0
        self.held_sum = 0
        self.peak = -1
        self.kinds: list[int] = [0] * len(MEMORY_BYTES)
        self.late = late


class _Allocator:
    __slots__ = ("rows", "allocated", "peak", "reserved", "peak_step", "late")

    def __init__(self, late: bool = False) -> None:
        self.rows = 0
        self.allocated = self.peak = self.reserved = -1
        self.peak_step: int | None = None
        self.late = late


class _StepAcc:
    """What one step's records add up to, until the step settles."""

    __slots__ = ("duration", "batch", "devices_used", "raised", "phases", "memory", "allocator")

    def __init__(self) -> None:
        self.duration: float | None = None
        self.raised = False  # a forward call of the step raised
        self.batch: int | None = None
        self.devices_used = 0
        self.phases: dict[tuple[str, str], list[Any]] = {}  # (phase, device) -> [ms, calls, device ms or None]
        self.memory: dict[str, list[int]] = {}  # device -> [calls, *MEMORY_BYTES summed]
        self.allocator: dict[tuple[str, str], list[int]] = {}  # (device, phase) -> [rows, allocated, peak, reserved]


def _upsert(table: str, key: tuple[str, ...], columns: tuple[str, ...], merge: dict[str, str]) -> tuple[str, str]:
    """(replace, merge) INSERT statements for one aggregate table: an open block is written whole; a late one
    is merged into the stored row with ``merge``'s expressions (``old`` is the stored row, ``excluded`` the new)."""
    names = (*key, *columns)
    insert = f"INTO {table} ({', '.join(names)}) VALUES ({', '.join('?' * len(names))})"
    sets = ", ".join(f"{c} = {merge.get(c, f'excluded.{c}')}" for c in columns)
    return f"INSERT OR REPLACE {insert}", f"INSERT {insert} ON CONFLICT ({', '.join(key)}) DO UPDATE SET {sets}"


_ADD = "{c} + excluded.{c}"
_STAT_COLUMNS = ("first_step", "last_step", "steps", "calls", "sum_ms", "min_ms", "max_ms", "device_sum_ms",
                 "slowest_steps", "wait_sum_ms", "sketch")
_STAT_MERGE = {"first_step": "MIN(first_step, excluded.first_step)", "last_step": "MAX(last_step, excluded.last_step)",
               "steps": "steps + excluded.steps", "calls": "calls + excluded.calls",
               "sum_ms": "sum_ms + excluded.sum_ms", "min_ms": "MIN(min_ms, excluded.min_ms)",
               "max_ms": "MAX(max_ms, excluded.max_ms)",
               "device_sum_ms": "COALESCE(device_sum_ms, 0) + COALESCE(excluded.device_sum_ms, 0)",
               "slowest_steps": "slowest_steps + excluded.slowest_steps",
               "wait_sum_ms": "wait_sum_ms + excluded.wait_sum_ms",
               "sketch": "sketch || excluded.sketch"}  # a sketch is a list of (bucket, count) pairs: concatenation merges
_STEP_SQL = _upsert("step_blocks", ("block",), ("first_step", "last_step", "steps", "sum_ms", "min_ms", "max_ms",
                                               "batch_size", "devices_used", "sketch", "trained_steps",
                                               "trained_samples", "raised_steps"),
                    {**_STAT_MERGE, "batch_size": "MAX(batch_size, excluded.batch_size)",
                     "devices_used": "MAX(devices_used, excluded.devices_used)",
                     "trained_steps": _ADD.format(c="trained_steps"),
                     "trained_samples": _ADD.format(c="trained_samples"),
                     "raised_steps": _ADD.format(c="raised_steps")})
_PHASE_SQL = _upsert("phase_blocks", ("phase", "device", "block"), _STAT_COLUMNS, _STAT_MERGE)
_PEAK_IS_NEW = "excluded.peak_held_bytes > peak_held_bytes"
_MEMORY_COLUMNS = ("first_step", "last_step", "steps", "calls", "held_sum_bytes", "peak_step", "peak_held_bytes",
                   *MEMORY_BYTES)
_MEMORY_SQL = _upsert("memory_blocks", ("device", "block"), _MEMORY_COLUMNS, {
    **{c: _STAT_MERGE[c] for c in ("first_step", "last_step", "steps", "calls")},
    "held_sum_bytes": "held_sum_bytes + excluded.held_sum_bytes",
    **{c: f"CASE WHEN {_PEAK_IS_NEW} THEN excluded.{c} ELSE {c} END" for c in ("peak_step", *MEMORY_BYTES)},
    "peak_held_bytes": "MAX(peak_held_bytes, excluded.peak_held_bytes)"})
_ALLOCATOR_COLUMNS = ("rows", "allocated_max_bytes", "peak_allocated_bytes", "reserved_max_bytes", "peak_step")
_ALLOCATOR_SQL = _upsert("allocator_blocks", ("device", "phase", "block"), _ALLOCATOR_COLUMNS, {
    "rows": "rows + excluded.rows", "allocated_max_bytes": "MAX(allocated_max_bytes, excluded.allocated_max_bytes)",
    "peak_step": "CASE WHEN excluded.peak_allocated_bytes > peak_allocated_bytes THEN excluded.peak_step "
                 "ELSE peak_step END",
    "peak_allocated_bytes": "MAX(peak_allocated_bytes, excluded.peak_allocated_bytes)",
    "reserved_max_bytes": "MAX(reserved_max_bytes, excluded.reserved_max_bytes)"})


def _or(value: int | None, none: int = -1) -> int:
    return none if value is None else value


def _none_below_zero(value: int) -> int | None:
    return None if value < 0 else value


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


class Aggregator:
    """Adds up a run's records into blocks and decides which steps keep their detail (see the module's
    docstring and dpprof.store.retention). Used by the writer thread only."""

    def __init__(self, retention: Retention) -> None:
        self.retention = retention
        self._block_steps = retention.block_steps
        self._pending: dict[int, _StepAcc] = {}
        self._newest = -1  # the newest step whose StepRecord arrived
        self._settled_to = 0  # steps below this are settled
        self._first_step: int | None = None
        self._steps: dict[int, _Stat] = {}
        self._phases: dict[tuple[str, str, int], _Stat] = {}
        self._memory: dict[tuple[str, int], _Memory] = {}
        self._allocator: dict[tuple[str, str, int], _Allocator] = {}
        # the blocks changed since the last statements(), by table
        self._dirty_steps: set[int] = set()
        self._dirty_phases: set[int] = set()  # blocks: every row of the block is written (_fold)
        self._dirty_memory: set[int] = set()
        self._dirty_allocator: set[tuple[str, str, int]] = set()
        self._chunks: dict[tuple[str, int | None], int] = {}
        self._chunks_dirty = False
        self._run_sketch = Sketch()  # every settled step's duration but the first: the outlier rule's median
        self._median: float | None = None
        self._since_median = 0
        self._median_steps = 0  # steps the outlier rule has seen
        self._outliers: dict[int, list[tuple[float, int, float]]] = {}  # chunk -> [(ms, step, median)], slowest first
        self._outlier_sql: list[Statement] = []
        self._peaks: dict[str, tuple[int, int]] = {}  # device -> (held bytes, step): the current peak step
        self._alloc_peaks: dict[str, tuple[int, int]] = {}
        self._totals: dict[tuple[str, str], Sketch] = {}  # run_sketches: ("step", "") and ("work", device)
        self._totals_dirty = False
        # a step's kind (TRAINING, EVALUATION, None for a step whose forward raised) -> the sketches it adds to
        self._step_totals: dict[str | None, tuple[dict[int, int], ...]] = {}
        self._evicted_to = 0  # chunks below this step have had their detail thinned
        self.detail_from = 0  # every step from here on still has all its detail

    # records in
    def add(self, records: Iterable[Record | Row]) -> None:
        pending = self._pending
        settled = self._settled_to
        for r in records:  # type(r) is X written out in each test: mypy narrows r by it, and it costs what `cls is X` did
            if isinstance(r, tuple):  # a row (dpprof.records.Row): a phase's is (PHASE_ROW, step, call, phase, device,
                # start_ms, duration_ms, device_duration_ms); a collective's has no aggregate; a step's and a memory
                # row's fields are read in place, as their records' are (_add_step, _add_memory)
                if r[0] != PHASE_ROW:
                    if r[0] == STEP_ROW:  # step, start_ms, duration_ms, batch_size, devices_used, forward_calls,
                        # explicit, raised_calls, loader_ms
                        self._add_step(r[1], r[3], r[4], r[5], bool(r[8]))
                    elif r[0] == MEMORY_ROW:  # step, call, device, chunk_size, then MEMORY_BYTES' six in order
                        self._add_memory(r[1], r[3], r[4], r[5:11])
                    continue  # else COMM_ROW, the one row kind left
                step, key, ms, device_ms = r[1], (r[3], r[4]), r[6], r[7]
            elif type(r) is PhaseRecord:
                step, key, ms, device_ms = r.step, (r.phase, r.device), r.duration_ms, r.device_duration_ms
            else:
                self._add_other(r)
                continue
            acc = pending.get(step) if step >= settled else None
            if acc is None:
                acc = self._acc(step)
            cell = acc.phases.get(key)
            if cell is None:
                acc.phases[key] = [ms, 1, device_ms]
            else:
                cell[0] += ms
                cell[1] += 1
                if device_ms is not None:
                    cell[2] = (cell[2] or 0.0) + device_ms
        self._settle(self._newest - SETTLE_STEPS + 1)

    def _add_other(self, r: Record) -> None:
        """A record other than a phase: a step's duration and batch, a device's memory, the allocator's counters."""
        if type(r) is StepRecord:
            self._add_step(r.step, r.duration_ms, r.batch_size, r.devices_used, bool(r.raised_calls))
        elif type(r) is DeviceMemoryRecord:
            self._add_memory(r.step, r.device, r.chunk_size, (r.input_bytes, r.output_bytes, r.activation_bytes,
                                                              r.gathered_bytes, r.param_bytes, r.buffer_bytes))
        elif type(r) is AllocatorRecord:  # an imported trace may lack a figure: -1 stands for none
            acc = self._acc(r.step)
            held = (_or(r.allocated_bytes), _or(r.peak_allocated_bytes), _or(r.reserved_bytes))
            cell = acc.allocator.get((r.device, r.phase))
            if cell is None:
                acc.allocator[(r.device, r.phase)] = [1, *held]
            else:
                cell[0] += 1
                cell[1] = max(cell[1], held[0])
                cell[2] = max(cell[2], held[1])
                cell[3] = max(cell[3], held[2])

    def _add_step(self, step: int, duration_ms: float, batch_size: int | None, devices_used: int,
                  raised: bool) -> None:
        """A step's record (or row): its duration, batch and devices, and whether a forward call of it raised."""
        acc = self._acc(step)
        acc.duration, acc.batch, acc.devices_used, acc.raised = duration_ms, batch_size, devices_used, raised
        if step > self._newest:
            self._newest = step
            # settled as the steps come, not once a commit: a commit's hundreds of steps waiting together here
            # lived through the garbage collector's collections into its oldest generation, and set off full
            # collections of the training process (~200 ms each, about one per 10,000 steps of the MLP)
            self._settle(step - SETTLE_STEPS + 1)

    def _add_memory(self, step: int, device: str, chunk_size: int | None, held: tuple[int | None, ...]) -> None:
        """A device's memory record (or row): ``held`` is its bytes in MEMORY_BYTES' order, None for none."""
        acc = self._acc(step)
        cell = acc.memory.get(device)
        if cell is None:
            acc.memory[device] = [1, *cast("tuple[int, ...]", held)] if None not in held \
                else [1, *(0 if v is None else v for v in held)]
        else:
            cell[0] += 1
            for i, v in enumerate(held, 1):
                if v is not None:
                    cell[i] += v
        chunk = (device, chunk_size)
        self._chunks[chunk] = self._chunks.get(chunk, 0) + 1
        self._chunks_dirty = True

    def _acc(self, step: int) -> _StepAcc:
        acc = self._pending.get(step)
        if acc is None:
            acc = self._pending[step] = _StepAcc()
        return acc

    # settling: a step's values into its block
    def _settle(self, below: int) -> None:
        """Fold every pending step below ``below`` into its block."""
        pending = self._pending
        if below <= self._settled_to and not any(s < below for s in pending):
            return
        ready = [s for s in pending if s < below]  # one step, as steps arrive in order
        if len(ready) > 1:
            ready.sort()
        for step in ready:
            self._fold(step, pending.pop(step))
        self._settled_to = max(self._settled_to, below)

    def _block(self, step: int) -> int:
        return step // self.retention.block_steps

    def _late(self, block: int) -> bool:
        """Whether a block was written whole and let go (a record arrived for it later than SETTLE_STEPS)."""
        return block < self._retired_below

    @property
    def _retired_below(self) -> int:
        return max(0, self._settled_to // self.retention.block_steps - 1)

    def _stat(self, table: dict, key: Any, block: int) -> Any:
        stat = table.get(key)
        if stat is None:
            late = self._late(block)
            if table is self._steps:
                stat = _Stat(late)
            elif table is self._phases:  # the pages show quantiles of the work only: other phases keep no sketch
                stat = _Stat(late, sketched=key[0] == WORK)
            else:
                stat = (_Memory if table is self._memory else _Allocator)(late)
            table[key] = stat
        return stat

    def _fold(self, step: int, acc: _StepAcc) -> None:
        """Add a settled step's values to its block. The writer thread runs this once a step, holding the GIL the
        training threads want: the phases' sums are inlined (_Stat.add's, less its sketch), and the tables' rows are
        marked changed once per block, not once per row (statements writes every row of a changed block)."""
        block = step // self._block_steps
        first = self._first_step is None
        if first:
            self._first_step = step
        work: dict[str, float] = {}
        trained = False  # a backward ran in the step: queries.training_steps_of's rule
        phases = self._phases
        for (phase, device), (ms, calls, device_ms) in acc.phases.items():
            key = (phase, device, block)
            s = phases.get(key)  # the block's row, made by _stat at its first step
            if s is None:
                s = self._stat(phases, key, block)
            if s.sketch is None:  # s.add(step, ms, calls, device_ms), inlined: some ten phases a step
                s.steps += 1
                s.calls += calls
                s.sum += ms
                if ms < s.min:
                    s.min = ms
                if ms > s.max:
                    s.max = ms
                if step < s.first_step:
                    s.first_step = step
                if step > s.last_step:
                    s.last_step = step
                if device_ms is not None:
                    s.device_sum = (s.device_sum or 0.0) + device_ms
            else:  # an imported phase named as the work rows are
                s.add(step, ms, calls, device_ms)
            if phase in WORK_PHASES:
                work[device] = work.get(device, 0.0) + ms
            elif phase == "backward":
                trained = True
        if acc.phases:
            self._dirty_phases.add(block)
        if acc.duration is not None:
            s = self._steps.get(block) or self._stat(self._steps, block, block)
            duration_bucket = bucket(acc.duration)  # for the block's sketch, the run's and the outlier rule's
            s.add(step, acc.duration, key=duration_bucket)
            if acc.batch is not None and (s.batch is None or acc.batch > s.batch):
                s.batch = acc.batch
            if acc.devices_used and acc.devices_used > s.devices_used:
                s.devices_used = acc.devices_used
            if trained:
                s.trained += 1
                s.trained_samples += acc.batch or 0
                kind: str | None = TRAINING
            elif acc.raised:  # neither kind: it trained nothing, and was no evaluation (queries.raised_steps_of)
                s.raised += 1
                kind = None
            else:
                kind = EVALUATION
            totals = self._step_totals.get(kind)
            if totals is None:  # kind_medians' sketch of the step's kind, and every step's
                every = self._total("step", "").counts
                totals = self._step_totals[kind] = (every,) if kind is None else (self._total(kind, "").counts, every)
            for counts in totals:
                counts[duration_bucket] = counts.get(duration_bucket, 0) + 1
            self._totals_dirty = True
            self._dirty_steps.add(block)
            if not first:
                self._outlier(step, acc.duration, duration_bucket)
        for device, ms in work.items():
            key = (WORK, device, block)
            ms_bucket = bucket(ms)
            s = phases.get(key)
            if s is None:
                s = self._stat(phases, key, block)
            s.add(step, ms, key=ms_bucket)
            if not first:  # the run's p50 and p95 of the work leave the first step out, as the findings' medians do
                counts = self._total(WORK, device).counts
                counts[ms_bucket] = counts.get(ms_bucket, 0) + 1
        if work:
            self._dirty_phases.add(block)
            if len(work) > 1 and step != self._first_step:  # the imbalance leaves the first step out
                self._imbalance(work, block)
        for device, (calls, *kinds) in acc.memory.items():
            m = self._memory.get((device, block)) or self._stat(self._memory, (device, block), block)
            held = sum(kinds)
            m.first_step = step if m.first_step is None else min(m.first_step, step)
            m.last_step = step if m.last_step is None else max(m.last_step, step)
            m.steps += 1
            m.calls += calls
            m.held_sum += held
            if held > m.peak:
                m.peak, m.peak_step, m.kinds = held, step, kinds
            if held > self._peaks.get(device, (-1, 0))[0]:
                self._peaks[device] = (held, step)
        if acc.memory:
            self._dirty_memory.add(block)
        for (device, phase), (rows, allocated, peak, reserved) in acc.allocator.items():
            a = self._stat(self._allocator, (device, phase, block), block)
            a.rows += rows
            a.allocated = max(a.allocated, allocated)
            a.reserved = max(a.reserved, reserved)
            if peak > a.peak:
                a.peak, a.peak_step = peak, step
            if peak > self._alloc_peaks.get(device, (-1, 0))[0]:
                self._alloc_peaks[device] = (peak, step)
            self._dirty_allocator.add((device, phase, block))

    def _total(self, kind: str, device: str) -> Sketch:
        self._totals_dirty = True
        sketch = self._totals.get((kind, device))
        if sketch is None:
            sketch = self._totals[(kind, device)] = Sketch()
        return sketch

    def _imbalance(self, work: dict[str, float], block: int) -> None:
        """Per step: which device was slowest, and for each device how long, on average, the others waited
        for it (its time minus each other's, at least 0): dpprof.findings.floors.imbalance's figures."""
        if len(work) == 2:  # two devices (the common case), without the pairs' bookkeeping below
            (a, ta), (b, tb) = work.items()
            stat_a, stat_b = self._phases[(WORK, a, block)], self._phases[(WORK, b, block)]
            if ta > tb:
                stat_a.wait_sum += ta - tb
            elif tb > ta:
                stat_b.wait_sum += tb - ta
            (stat_a if ta >= tb else stat_b).slowest += 1  # max()'s choice: the first of equals
            return
        n = len(work) - 1
        waits = dict.fromkeys(work, 0.0)
        for (a, ta), (b, tb) in combinations(work.items(), 2):
            if ta > tb:
                waits[a] += ta - tb
            elif tb > ta:
                waits[b] += tb - ta
        slowest = max(work, key=work.__getitem__)
        for device, wait in waits.items():
            stat = self._phases[(WORK, device, block)]
            stat.wait_sum += wait / n
            if device == slowest:
                stat.slowest += 1

    # outliers and retention
    def _outlier(self, step: int, ms: float, key: int) -> None:
        """``key``: the step's duration's sketch bucket."""
        sketch = self._run_sketch
        sketch.add_bucket(key)
        self._since_median += 1
        self._median_steps += 1
        # recomputed as often as the steps seen so far double, then every _MEDIAN_EVERY steps: a median read from
        # the first step alone (the slowest: it carries one-time costs) would hide a run's early stalls
        if self._median is None or self._since_median >= min(_MEDIAN_EVERY, self._median_steps // 2):
            self._median, self._since_median = sketch.quantile(0.5), 0
        if not self._median or ms <= OUTLIER_RATIO * self._median:
            return
        chunk = step // self.retention.chunk_steps
        kept = self._outliers.setdefault(chunk, [])
        if len(kept) >= self.retention.outliers_per_chunk:
            if ms <= kept[-1][0]:
                return
            _, dropped, _ = kept.pop()
            self._outlier_sql.append(("DELETE FROM outlier_steps WHERE step = ?", (dropped,)))
        kept.append((ms, step, self._median))
        kept.sort(reverse=True)
        self._outlier_sql.append(("INSERT OR REPLACE INTO outlier_steps (step, duration_ms, median_ms) VALUES (?, ?, ?)",
                                  (step, ms, self._median)))

    def _kept(self, lo: int, hi: int) -> set[int]:
        """Steps in [lo, hi) kept for a reason other than the sample: outliers and their neighbours, peaks."""
        keep: set[int] = set()
        chunk_steps = self.retention.chunk_steps
        for chunk in range((lo - 1) // chunk_steps, (hi + 1) // chunk_steps + 1):
            for _, step, _ in self._outliers.get(chunk, ()):
                keep.update((step - 1, step, step + 1))
        keep.update(step for _, step in self._peaks.values())
        keep.update(step for _, step in self._alloc_peaks.values())
        return {s for s in keep if lo <= s < hi}

    def _evictions(self, final: bool) -> list[Statement]:
        """Deletions of the detail no reason keeps, chunk by chunk, once a chunk is last_steps behind."""
        r = self.retention
        if not r.bounded:
            return []
        out: list[Statement] = []
        horizon = (self._newest + 1 if final else self._settled_to) - r.last_steps
        while True:
            lo = max(self._evicted_to, r.first_steps)
            hi = (lo // r.chunk_steps + 1) * r.chunk_steps
            if hi > horizon:
                break
            kept = sorted(self._kept(lo, hi))
            extra = f" AND step NOT IN ({', '.join('?' * len(kept))})" if kept else ""
            for table in DETAIL_TABLES:
                out.append((f"DELETE FROM {table} WHERE step >= ? AND step < ? AND step % ? != 0{extra}",
                            (lo, hi, r.every, *kept)))
            self._evicted_to = hi
            self.detail_from = hi
        return out

    # statements out
    def statements(self, final: bool = False) -> list[Statement]:
        """The SQL that brings the file's aggregates up to the records added so far (and thins the detail),
        to run in the same transaction as those records. ``final``: the run is closing, settle everything."""
        if final:
            self._settle(max([self._newest + 1, *(s + 1 for s in self._pending)]))
        out: list[Statement] = self._outlier_sql
        self._outlier_sql = []
        for block in self._dirty_steps:
            s = self._steps[block]
            out.append((_STEP_SQL[s.late], (block, s.first_step, s.last_step, s.steps, s.sum, _finite(s.min),
                                            _finite(s.max), s.batch, s.devices_used, s.sketch_bytes(), s.trained,
                                            s.trained_samples, s.raised)))
        for key, s in self._phases.items() if self._dirty_phases else ():
            if key[-1] not in self._dirty_phases:
                continue
            out.append((_PHASE_SQL[s.late], (*key, s.first_step, s.last_step, s.steps, s.calls, s.sum,
                                             _finite(s.min), _finite(s.max), s.device_sum, s.slowest, s.wait_sum,
                                             s.sketch_bytes())))
        for mkey, m in self._memory.items() if self._dirty_memory else ():
            if mkey[-1] not in self._dirty_memory:
                continue
            out.append((_MEMORY_SQL[m.late], (*mkey, m.first_step, m.last_step, m.steps, m.calls, m.held_sum,
                                              m.peak_step, m.peak, *m.kinds)))
        for akey in self._dirty_allocator:
            a = self._allocator[akey]
            out.append((_ALLOCATOR_SQL[a.late], (*akey, a.rows, _none_below_zero(a.allocated),
                                                 _none_below_zero(a.peak), _none_below_zero(a.reserved),
                                                 a.peak_step if a.peak >= 0 else None)))
        for dirty in (self._dirty_steps, self._dirty_phases, self._dirty_memory, self._dirty_allocator):
            dirty.clear()
        if self._totals_dirty:
            out += [("INSERT OR REPLACE INTO run_sketches (kind, device, sketch) VALUES (?, ?, ?)",
                     (kind, device, sketch.to_bytes())) for (kind, device), sketch in self._totals.items()]
            self._totals_dirty = False
        if self._chunks_dirty:
            out.append(("DELETE FROM chunk_counts", ()))
            out.append(("INSERT INTO chunk_counts (device, chunk_size, calls) VALUES " +
                        ", ".join(["(?, ?, ?)"] * len(self._chunks)),
                        tuple(v for (device, size), n in self._chunks.items() for v in (device, size, n))))
            self._chunks_dirty = False
        out += self._evictions(final)
        self._retire()
        return out

    def _retire(self) -> None:
        """Let go of blocks no settled step can reach any more (written whole already); late ones always."""
        below = self._retired_below
        tables: tuple[dict[Any, Any], ...] = (self._steps, self._phases, self._memory, self._allocator)
        for table in tables:
            for key in [k for k, v in table.items() if v.late or (k if isinstance(k, int) else k[-1]) < below]:
                del table[key]


_SAMPLE_MAX = ("memory_used_bytes", "memory_total_bytes", "power_limit_w", "other_process_memory_bytes")
_SAMPLE_MEAN = tuple(f for f in GpuSampleRecord.__dataclass_fields__
                     if f not in ("t_ms", "device", "throttle_reasons", *_SAMPLE_MAX))


class SampleWindows:
    """NVML samples past ``Retention.samples_full_s`` as one record per GPU per ``sample_window_s``: the window's
    means, the maxima of the memory figures and the union of the throttle reasons, timed at the window's first
    sample. A window is written once the next one starts (or at close): a killed run loses at most one."""

    def __init__(self, retention: Retention) -> None:
        self.full_ms = retention.samples_full_s * 1e3
        self.window_ms = retention.sample_window_s * 1e3
        self._open: dict[str, tuple[int, list[GpuSampleRecord]]] = {}

    def thin(self, records: list[Record | Row], final: bool = False) -> list[Record | Row]:
        """``records`` with the samples past the first minutes replaced by their windows' records."""
        if not any(type(r) is GpuSampleRecord for r in records) and not (final and self._open):
            return records
        out: list[Record | Row] = []
        for r in records:
            if type(r) is not GpuSampleRecord or r.t_ms < self.full_ms:
                out.append(r)
                continue
            window = int((r.t_ms - self.full_ms) // self.window_ms)
            current = self._open.get(r.device)
            if current is not None and current[0] != window:
                out.append(_merge(current[1]))
                current = None
            if current is None:
                current = self._open[r.device] = (window, [])
            current[1].append(r)
        if final:
            out += [_merge(samples) for _, samples in self._open.values()]
            self._open.clear()
        return out


def _merge(samples: list[GpuSampleRecord]) -> GpuSampleRecord:
    def values(name: str) -> list[Any]:
        return [v for v in (getattr(s, name) for s in samples) if v is not None]

    fields: dict[str, Any] = {"t_ms": samples[0].t_ms, "device": samples[0].device}
    for name in _SAMPLE_MEAN:
        v = values(name)
        fields[name] = sum(v) / len(v) if v else None
    for name in _SAMPLE_MAX:
        v = values(name)
        fields[name] = max(v) if v else None
    reasons = sorted({x for s in values("throttle_reasons") for x in s.split(",") if x})
    fields["throttle_reasons"] = ",".join(reasons) if reasons else None
    for name in ("memory_used_bytes", "memory_total_bytes", "other_process_memory_bytes"):
        if fields[name] is not None:
            fields[name] = int(fields[name])
    return GpuSampleRecord(**fields)

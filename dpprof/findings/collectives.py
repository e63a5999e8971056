"""The straggler from the collectives themselves: which rank the others wait for inside their collectives.

Every collective is matched across ranks by its place in the step: (step, collective, ordinal), the ordinal
counting that collective's calls in the step in launch order on each rank (the traces dpprof reads carry no
``Seq`` of the process group, and a recorded DDP run's buckets are reduced in the same order on every rank).
Each rank's time inside a matched collective splits in two, clock-free (ranks on different machines need no
common clock): **data**, the shortest duration of that collective among the ranks (the time to move its data
once everyone has arrived), and **wait**, the rest of the rank's duration (the time it sat inside the
collective waiting for a rank that came later). A rank's wait in a step is the union of its waits, each from
its collective's launch (collectives in flight together wait once). The rank that waits least, step after step,
is the one the others wait for: the straggler; the others' wait is what it costs.

The matching streams: ``match_collectives`` reads one rank's collectives at a time, twice (a running minimum
per collective, then each rank's waits), so a 128-rank job needs memory for one rank's table and the minima.
A rank with a different number of collectives is said, and its collectives are matched where the others
have them; a collective that only one rank has says nothing about waiting and is left out (counted). A step in which
the ranks that have it hold different collectives (a subgroup's, from ``dist.new_group``) is left out and said: its
order would pair calls that never met.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from dpprof.findings.base import MEDIAN_STEP, Tables
from dpprof.findings.floors import STEP_SHARE_FLOOR, TIME_FLOOR_MS, total_text, worth_time

__all__ = ["KEY", "STRAGGLER_WAIT_SHARE", "STRAGGLER_WAIT_SHARE_CPU", "STRAGGLER_STEP_SHARE", "STRAGGLER_CHANCE", "by_chance",
           "CollectiveWaits", "CollectiveVerdict", "keyed", "match_collectives", "collective_waits",
           "collective_verdict", "wait_heatmap"]

KEY = ["step", "collective", "ordinal"]  # what matches one collective across ranks
# A rank is the straggler when the others wait for it at least 10% of the median step: below that, which rank
# arrives last at a collective is launch jitter and the host's scheduling, not a rank that holds the job up ...
STRAGGLER_WAIT_SHARE = 0.10
# ... or 20% where ranks share the host's cores (gloo ranks on CPUs): balanced CPU workers on a 2-core machine
# measured up to 17% apart in their work (the measure behind STRAGGLER_RATIO_CPU), so a wait under 20% is noise.
STRAGGLER_WAIT_SHARE_CPU = 0.20
# ... and it waited least in at least 60% of the steps (consistently, not one bad step; as STRAGGLER_CONSISTENCY) ...
STRAGGLER_STEP_SHARE = 0.6
# ... and in more steps than chance gives one rank of the k more than this often (were each rank as likely to wait
# least in each step, 1/k): with 2 ranks one of them always waits least, so 3 steps of 5 (60%) is what launch jitter
# and the host's scheduling give some rank every time, and 3 of 4 five times in eight; 4 of 4 or of 5, 8 of 11, or
# 13 of 20 pass; with 4 ranks, 3 of 4.
STRAGGLER_CHANCE = 0.2


def by_chance(least: int, steps: int, ranks: int) -> float:
    """The chance that a given rank waits least in ``least`` or more of ``steps`` steps, were each of the ``ranks``
    as likely to in each step: the binomial tail."""
    p = 1 / ranks
    return sum(math.comb(steps, j) * p ** j * (1 - p) ** (steps - j) for j in range(least, steps + 1))


def keyed(frame: pd.DataFrame) -> pd.DataFrame:
    """One rank's collectives with their matching key: step, collective (a recorded DDP bucket's: all-reduce),
    ordinal (that collective's calls in the step, in launch order), launch_ms, duration_ms."""
    f = frame[["step", "launch_ms", "duration_ms", "collective"]].copy()
    f = f.sort_values(["step", "launch_ms"], kind="stable").reset_index(drop=True)
    f["ordinal"] = f.groupby(["step", "collective"]).cumcount()
    return f


@dataclass
class CollectiveWaits:
    """The collectives of a run matched across its ranks.

    ``per_step``: rank, step, wait_ms (the union of its waits in the step), data_ms, collectives (matched in the
    step), least (how many of them it waited least in). ``counts``: rank, collectives (all of the rank's),
    matched. ``rows`` (when asked for): rank, step, collective, ordinal, launch_ms, duration_ms, data_ms, wait_ms.
    """

    per_step: pd.DataFrame
    counts: pd.DataFrame
    rows: pd.DataFrame | None = None
    notes: list[str] = field(default_factory=list)


def _union_from_launch(k: pd.DataFrame) -> pd.Series:
    """Per step, the union of [launch_ms, launch_ms + wait_ms] (k sorted by step, launch_ms)."""
    start = k["launch_ms"].to_numpy(dtype=float)
    end = start + k["wait_ms"].to_numpy(dtype=float)
    reach = pd.Series(end).groupby(k["step"].to_numpy()).cummax().to_numpy()
    prev = pd.Series(reach).groupby(k["step"].to_numpy()).shift(1).to_numpy()
    begin = np.where(np.isnan(prev), start, np.maximum(start, np.nan_to_num(prev, nan=-np.inf)))
    return pd.Series(np.clip(end - begin, 0, None)).groupby(k["step"].to_numpy()).sum()


def _ragged_steps(calls: list[pd.Series]) -> list[int]:
    """The steps in which the ranks that have the step hold different collectives (by name and number of calls): there
    the k-th call of a collective on one rank may be another collective on the next (a subgroup's, from
    dist.new_group), so matching by order would pair calls that never met."""
    if len(calls) < 2:
        return []
    table = pd.concat(calls, axis=1).fillna(0)  # (step, collective) x rank: calls, 0 where the rank has none
    present = pd.concat([c.groupby(level=0).sum() for c in calls], axis=1).reindex(
        table.index.get_level_values(0)).notna().to_numpy()  # the rank has the step at all
    values = table.to_numpy(dtype=float)
    lo = np.where(present, values, np.inf).min(axis=1)
    hi = np.where(present, values, -np.inf).max(axis=1)
    odd = (lo != hi) & (present.sum(axis=1) >= 2)
    return sorted({int(s) for s in table.index.get_level_values(0)[odd]})


def match_collectives(ranks: Callable[[], Iterable[tuple[int, pd.DataFrame]]], keep_rows: bool = False
                      ) -> CollectiveWaits:
    """Each rank's wait and data time in every collective it shares with another rank, streamed one rank at a time.

    Args:
        ranks: called twice; each time gives (rank, that rank's comms rows: step, launch_ms, duration_ms,
            collective) one rank after another.
        keep_rows: keep every matched collective's row (``rows``; memory grows with the ranks).

    Returns:
        the waits per rank and step, each rank's count of collectives, and what the matching had to leave out.
    """
    best: pd.Series | None = None  # (step, collective, ordinal) -> the shortest duration among the ranks
    held: pd.Series | None = None  # ... -> how many ranks have it
    calls: list[pd.Series] = []  # per rank: (step, collective) -> its calls (a few numbers a step)
    counts: dict[int, int] = {}
    for rank, frame in ranks():
        k = keyed(frame).set_index(KEY)["duration_ms"]
        counts[rank] = len(k)
        best = k if best is None else pd.concat([best, k]).groupby(level=[0, 1, 2]).min()
        ones = pd.Series(1, index=k.index)
        held = ones if held is None else held.add(ones, fill_value=0)
        calls.append(k.groupby(level=[0, 1]).size())
    ragged = _ragged_steps(calls)
    if held is not None and ragged:
        held = held[~held.index.get_level_values(0).isin(ragged)]
    steps, rows = [], []
    matched: dict[int, int] = {}
    for rank, frame in ranks():
        k = keyed(frame)
        if best is None or held is None or k.empty:
            matched[rank] = 0
            continue
        index = pd.MultiIndex.from_frame(k[KEY])
        shared = (held.reindex(index).to_numpy() >= 2) & ~k["step"].isin(ragged).to_numpy()
        k = k[shared].reset_index(drop=True)
        k["data_ms"] = best.reindex(pd.MultiIndex.from_frame(k[KEY])).to_numpy()
        k["wait_ms"] = (k["duration_ms"] - k["data_ms"]).clip(lower=0)
        matched[rank] = len(k)
        if k.empty:
            continue
        per = k.groupby("step").agg(data_ms=("data_ms", "sum"), collectives=("wait_ms", "size"),
                                    least=("wait_ms", lambda w: int((w <= 0).sum())))
        per["wait_ms"] = _union_from_launch(k)
        steps.append(per.reset_index().assign(rank=rank))
        if keep_rows:
            rows.append(k.assign(rank=rank))
    per_step = (pd.concat(steps, ignore_index=True) if steps else
                pd.DataFrame(columns=["step", "data_ms", "collectives", "least", "wait_ms", "rank"]))
    per_step = per_step[["rank", "step", "wait_ms", "data_ms", "collectives", "least"]]
    count_table = pd.DataFrame({"rank": list(counts), "collectives": list(counts.values()),
                                "matched": [matched.get(r, 0) for r in counts]})
    notes = []
    if len(set(counts.values())) > 1:
        usual = int(pd.Series(list(counts.values())).mode().max())  # the most common count (a tie: the larger)
        odd = [f"rank {r}: {n:,}" for r, n in counts.items() if n != usual]
        notes.append(f"ranks hold different numbers of collectives ({usual:,} on most; {', '.join(odd[:8])}"
                     f"{', ...' if len(odd) > 8 else ''}): each is matched where other ranks have it")
    if ragged:
        listed = ", ".join(str(int(s)) for s in ragged[:8]) + (", ..." if len(ragged) > 8 else "")
        notes.append(f"{len(ragged):,} step{'s' if len(ragged) > 1 else ''} in which the ranks hold different "
                     f"collectives left out (step{'s' if len(ragged) > 1 else ''} {listed}): their order in the step "
                     "cannot pair them (a collective on a subgroup of the ranks, one cut by a profiler's window, or a "
                     "rank's shadow collectives under Join)")
    alone = int(held[held < 2].sum()) if held is not None else 0
    if alone:
        notes.append(f"{alone:,} collective{'s' if alone > 1 else ''} held by one rank alone left out (nothing "
                     "to match them with)")
    return CollectiveWaits(per_step=per_step, counts=count_table,
                           rows=pd.concat(rows, ignore_index=True) if rows else None, notes=notes)


def collective_waits(comms: pd.DataFrame, keep_rows: bool = False) -> CollectiveWaits:
    """``match_collectives`` over a comms table already read (every rank's rows, with a ``rank`` column)."""
    return match_collectives(lambda: ((int(r), c) for r, c in comms.groupby("rank", sort=True)), keep_rows)


@dataclass(frozen=True)
class CollectiveVerdict:
    """Which rank the others wait for inside their collectives, and what it costs them (the module's rule)."""

    straggler: str  # its device label ("rank:3")
    ranks: int  # ranks whose collectives were matched
    wait_ms: float  # per step: others_wait_ms less own_wait_ms (the difference of the medians the evidence states)
    others_wait_ms: float  # the others' mean wait per step (median)
    own_wait_ms: float  # the straggler's own wait per step (median)
    share: float  # the share of later steps in which it waited least
    steps: int  # later steps compared
    collectives: float  # matched collectives per step and rank (median)
    threshold: float  # the share of the median step its cost needs (STRAGGLER_WAIT_SHARE[_CPU])
    step_ms: float  # the median of the compared steps, the wait's steps (not of evaluation steps between them)
    reason: str | None  # None: a straggler; else the test it failed, in words
    notes: tuple[str, ...] = ()
    step_words: str = MEDIAN_STEP  # what step_ms is, in words

    @property
    def reported(self) -> bool:
        return self.reason is None

    def evidence(self, later_steps: int) -> str:
        """The finding's evidence: the rule's figures."""
        return (f"matched {self.collectives:.0f} collective{'s' if self.collectives != 1 else ''} per step across "
                f"{self.ranks} ranks: {self.straggler} waits {self.own_wait_ms:.2f} ms per step inside them, the "
                f"others {self.others_wait_ms:.2f} ms; it waited least in {self.share:.0%} of {self.steps} steps; the "
                f"others wait {self.wait_ms:.2f} ms per step for it, {total_text(self.wait_ms * later_steps)} over "
                f"the run ({self.wait_ms / self.step_ms:.0%} of the {self.step_words})"
                + "".join(f"; {n}" for n in self.notes))


def wait_heatmap(per_step: pd.DataFrame, devices: dict[int, str] | None = None) -> pd.DataFrame:
    """Wait per rank (rows, labelled ``devices[rank]`` or "rank:N") and step (columns), in ms: what a heatmap draws."""
    if per_step.empty:
        return pd.DataFrame()
    table = per_step.pivot_table(index="rank", columns="step", values="wait_ms", aggfunc="sum").sort_index()
    table.index = [(devices or {}).get(int(r), f"rank:{int(r)}") for r in table.index]
    table.index.name, table.columns.name = "rank", "step"
    return table


# Another rank that waited least in at least this share of the compared steps is said beside the straggler (one
# rank late early in the run, another later: the verdict names the one of most steps, and the other is not hidden)
MOVED_STEP_SHARE = 0.25


def _least_waiting(table: pd.DataFrame) -> tuple[pd.Series, int, float, float]:
    """Over a step x rank table of waits: the rank that waited least in each step, the one that did most often, the
    others' wait (each step their median: a second late rank, which waits less, does not pull it down; then the
    median over the steps) and its own median wait."""
    least = table.idxmin(axis=1)
    rank = int(least.mode().sort_values().iloc[0])
    return least, rank, float(table.drop(columns=rank).median(axis=1).median()), float(table[rank].median())


def _consistency(least: pd.Series, rank: int, ranks: int) -> tuple[float, int, float]:
    """How consistently ``rank`` waited least (``least``: each step's rank that did, of ``ranks``): the share of the
    steps, their count, and the chance one rank does so that often (by_chance), as the straggler rule weighs them."""
    count = int((least == rank).sum())
    return count / len(least), count, by_chance(count, len(least), ranks)


def _second_late_rank(table: pd.DataFrame, slow: int, devices: dict[int, str], threshold: float,
                      step_ms: float) -> str | None:
    """Another rank the others wait for beside the straggler (two late ranks): the straggler's rule again over the
    ranks but the straggler, said in words; None where none clears it (or fewer than 3 ranks)."""
    rest = table.drop(columns=slow)
    if rest.shape[1] < 2 or not step_ms or pd.isna(step_ms):
        return None
    least, late, theirs, own = _least_waiting(rest)
    cost, (share, _, chance) = theirs - own, _consistency(least, late, rest.shape[1])
    if (share < STRAGGLER_STEP_SHARE or chance > STRAGGLER_CHANCE
            or cost < threshold * step_ms or not worth_time(cost, step_ms)):
        return None
    name, first = devices.get(late, f"rank:{late}"), devices.get(slow, f"rank:{slow}")
    return (f"{name} comes late too: it waits {own:.2f} ms per step where the ranks but {first} and it wait "
            f"{theirs:.2f} ms; without {first}, they would still wait {cost:.2f} ms per step for it")


def collective_verdict(t: Tables) -> CollectiveVerdict | None:
    """The straggler from the collectives (the module's rule); None where fewer than two ranks have matched
    collectives in two later steps (the first step left out: DDP rebuilds its buckets after it)."""
    comms = t.collectives  # the script's own too: a rank late to its metric's all-reduce holds the others there
    if comms.empty or "rank" not in comms or comms["rank"].nunique() < 2:
        return None
    devices = {int(r): str(d) for r, d in comms.groupby("rank")["device"].first().items()}
    waits = collective_waits(comms)
    per = waits.per_step
    if per.empty:
        return None
    first = t.first_step if t.first_step is not None else per["step"].min()
    # a step counts where two ranks or more have it: a rank done early (uneven inputs under Join) or profiled over
    # fewer steps is left out of the steps it lacks, not those steps out of the run
    table = per[per["step"] != first].pivot_table(index="step", columns="rank", values="wait_ms").dropna(thresh=2)
    if table.shape[1] < 2 or len(table) < 2:
        return None
    # the others' wait (their median each step: their mean said 250 ms where two of the three others waited 300 ms for
    # the straggler) less the straggler's own: the difference of the two figures the evidence states beside it, as the
    # work-based verdict's wait is the difference of its medians (a median of the per-step differences said 39.00 ms
    # beside "waits 15.60 ms ..., the others 55.56 ms")
    least, slow, others_ms, own_ms = _least_waiting(table)
    cost = others_ms - own_ms
    # weighed against the steps it is paid in: evaluation steps between training steps run no collectives, and their
    # median (0.82 ms against training steps of 36-46 ms) made a 30 ms wait 3692% of the step
    later = t.later_steps
    compared = later[later.index.isin(table.index)]
    step_ms, step_words = t.median_step_ms, MEDIAN_STEP
    if len(compared) and len(compared) < len(later):
        step_ms, step_words = float(compared.median()), f"{MEDIAN_STEP} that ran collectives"
    on_gpus = t.model.backend == "cuda" or bool({"allocator", "gpu_samples", "gpu_time"} & t.model.has)
    threshold = STRAGGLER_WAIT_SHARE if on_gpus else STRAGGLER_WAIT_SHARE_CPU
    share, count, chance = _consistency(least, slow, table.shape[1])
    reason = None
    if share < STRAGGLER_STEP_SHARE:
        reason = (f"it waited least in only {share:.0%} of {len(table)} steps, under the {STRAGGLER_STEP_SHARE:.0%} "
                  "a straggler needs")
    elif chance > STRAGGLER_CHANCE:
        reason = (f"it waited least in {count} of {len(table)} steps, which one of {table.shape[1]} ranks does "
                  f"by chance {chance:.0%} of the time (over the {STRAGGLER_CHANCE:.0%} a straggler allows): "
                  "too few steps to tell a late rank from launch jitter")
    elif not step_ms or pd.isna(step_ms) or cost < threshold * step_ms:
        shared = " where ranks share the host's cores" if not on_gpus else ""
        reason = (f"the others wait {cost:.2f} ms per step for it, under the {threshold:.0%} of the "
                  f"{step_ms:.2f} ms {step_words} a straggler needs{shared}")
    elif not worth_time(cost, step_ms):
        reason = (f"{cost:.2f} ms a step is under the {TIME_FLOOR_MS} ms floor a finding needs" if cost < TIME_FLOOR_MS
                  else f"{cost / step_ms:.1%} of the {step_words} is under the {STEP_SHARE_FLOOR:.0%} floor")
    matched = per[per["step"] != first].groupby("rank")["collectives"].median()
    notes = [*waits.notes]
    # a straggler that moved: another rank the others waited for in a share of the steps of its own, said with them
    for rank, steps in least[least != slow].groupby(least[least != slow]).groups.items():
        if len(steps) >= max(2, MOVED_STEP_SHARE * len(table)):
            notes.append(f"{devices.get(int(rank), f'rank:{int(rank)}')} waited least in {len(steps)} of the "
                         f"{len(table)} steps (steps {', '.join(str(int(s)) for s in sorted(steps))}): the others "
                         "waited for it there")
    second = _second_late_rank(table, slow, devices, threshold, float(step_ms))
    if reason is None and second is not None:
        notes.append(second)
    world = t.model.world_size
    if world and comms["rank"].nunique() < world:
        notes.insert(0, f"{comms['rank'].nunique()} of {world} ranks present: each wait is among them (a rank "
                        "whose file is not here may be the one they all wait for)")
    return CollectiveVerdict(straggler=devices.get(slow, f"rank:{slow}"), ranks=int(table.shape[1]), wait_ms=cost,
                             others_wait_ms=others_ms, own_wait_ms=own_ms,
                             share=share, steps=len(table), collectives=float(matched.median()), threshold=threshold,
                             step_ms=float(step_ms), reason=reason, notes=tuple(notes), step_words=step_words)

"""Rules over the steps alone, for every kind of run: steps that stall far beyond the median; and a recorded rank's
step time that none of its recorded parts covers."""
from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import pandas as pd

from dpprof.findings.base import MEDIAN_STEP, Tables, finding
from dpprof.findings.detail import workers_advice
from dpprof.findings.floors import cost_text, total_text, worth_time
from dpprof.loaders import none_iterated
from dpprof.stepmodel import PHASE_WORDS, REST
from dpprof.store.queries import raised_steps_of, throughput_of, training_steps_of
from dpprof.units import plural

__all__ = ["OUTLIER_STEP_RATIO", "OUTLIER_TIME_SHARE", "OUTLIER_WARN_SHARE", "OUTLIER_STEPS_LISTED", "Stalls", "stalls",
           "step_kinds", "thinned_kinds", "THINNED", "bigger_batches", "outlier_steps", "EVERY_MIN_STEPS", "EVERY_SHARE", "REST_SHARE_WARN", "RANKS_LISTED", "rest_of_steps",
           "unrecorded_time", "BETWEEN_STEPS_WARN", "between_steps"]

# A step (past the first) over 2x the run's median step is an outlier: a stall or contention from
# outside the step (another process on the same cores or GPU, data loading, swapping), not the
# model's own variation, which stays well within 2x on a steady machine ...
OUTLIER_STEP_RATIO = 2.0
# ... worth a finding when the outliers' time beyond the median is over 5% of the run's step time ...
OUTLIER_TIME_SHARE = 0.05
# ... and a warning from 20%: a fifth of the run then went to stalls, enough to distort every other figure.
OUTLIER_WARN_SHARE = 0.20
# Outlier steps listed in the evidence (the slowest first).
OUTLIER_STEPS_LISTED = 8
# A recorded DDP or FSDP rank's step is its parts (data, forward, backward, the exposed collectives, the optimizer)
# and the rest: the loss and the script's own code between them. Over a quarter of the step in the rest is more than
# the loss and Python between the parts take in the built-in workloads (2 gloo ranks on a loaded 2-core machine:
# 5-17% on tutorial-linear's 12-31 ms DDP and FSDP steps, 1-2% on cifar-lenet's DDP), so something there is worth
# looking at ...
REST_SHARE_WARN = 0.25
# ... and the ranks named in its evidence (the most rest first).
RANKS_LISTED = 8
# Slow steps at a regular interval (every N steps): at least this many of them, and at least this share of the steps
# at that interval slow (an evaluation or a checkpoint every N steps lands in every one; stalls from outside do not)
EVERY_MIN_STEPS = 4
EVERY_SHARE = 0.75
# Time between one recorded step's end and the next's start over a quarter of the two together, in most gaps: more
# than a loop's own Python between steps (fetching an in-memory batch, zero_grad outside the step) takes, the same
# bound as the rest within a step (REST_SHARE_WARN); a DataParallel loop's DataLoader waits there.
BETWEEN_STEPS_WARN = REST_SHARE_WARN
# The DataLoader's share of the time between steps under which that time is said as the script's own work, not loading
LOADER_GAP_SHARE = 0.5


@dataclass(frozen=True)
class Stalls:
    """Steps far beyond the run's median, as the stall rule counts them (outlier_steps raises its finding on these;
    dpprof advise says them before any prediction)."""

    median_ms: float  # the median of the steps past the first (of the kind with the most time: training's)
    slow_ms: pd.Series  # step -> ms of each step over OUTLIER_STEP_RATIO x its kind's median, the slowest first
    excess_ms: float  # their time beyond their kind's median, summed
    share: float  # excess_ms over the run's step time (steps past the first)
    steps: int  # steps past the first
    medians: dict[str, float] | None = None  # kind -> its median, where steps of kinds were told apart

    @property
    def severity(self) -> str:
        return "warning" if self.share >= OUTLIER_WARN_SHARE else "info"


def stalls(step_ms: pd.Series, kinds: pd.Series | None = None, medians: dict[str, float] | None = None
           ) -> Stalls | None:
    """The stall rule over the steps past the first (ms by step, in step order): steps over OUTLIER_STEP_RATIO x
    the median whose time beyond it is over OUTLIER_TIME_SHARE of the run's and clears the time floors; None
    where there are none (or fewer than 3 steps). With ``kinds`` (step -> "training" or "evaluation"), each step
    against the median of its kind (a kind of under 3 steps is not judged): training steps between shorter evaluation
    steps are no stalls for being longer. With ``medians`` (kind -> ms), each kind is judged against that median rather
    than its steps' here (a thinned run's: the writer's median of every step of the kind), the first kind named being
    the one reported; a kind it does not name is not judged."""
    if len(step_ms) < 3:
        return None
    kinds = pd.Series("", index=step_ms.index) if kinds is None else kinds.reindex(step_ms.index)
    given = medians is not None
    if medians is None:
        medians = {str(k): float(ms.median()) for k, ms in step_ms.groupby(kinds) if len(ms) >= 3}
    if not medians:
        return None
    median_of = kinds.map(medians).astype(float)
    slow = step_ms[step_ms > OUTLIER_STEP_RATIO * median_of]
    excess = float((slow - median_of[slow.index]).sum())
    share = excess / float(step_ms.sum()) if step_ms.sum() else 0.0
    # the kind the run's time goes to, or the first named
    main = next(iter(medians)) if given else max(medians, key=lambda k: float(step_ms[kinds == k].sum()))
    median = medians[main]
    if slow.empty or share < OUTLIER_TIME_SHARE or not worth_time(excess / len(step_ms), median):
        return None
    return Stalls(median, slow.sort_values(ascending=False), excess, share, len(step_ms),
                  medians if len(medians) > 1 or "" not in medians else None)


def step_kinds(t: Tables, steps: pd.Index) -> pd.Series | None:
    """Of ``steps``, step -> "training" (it ran a backward) or "evaluation" (none: forwards under no_grad between
    training steps); None where they are all one kind, or the run's phases do not cover every step (a thinned run)."""
    backward = t.backward_steps
    if backward is None:
        return None
    trains = steps.isin(backward.unique())
    if trains.all() or not trains.any():
        return None
    return pd.Series(["training" if x else "evaluation" for x in trains], index=steps)


THINNED = "thinned"  # a step of a thinned run whose detail was not kept: its kind (a backward ran or not) unknown


def thinned_kinds(steps: pd.Index, trained: pd.Series, medians: dict[str, float]
                  ) -> tuple[pd.Series, dict[str, float]]:
    """A thinned run that evaluates between its training steps: each of ``steps``'s kind, and the median each kind is
    judged against (stalls' ``kinds`` and ``medians``). A step's kind is known where its detail was kept (``trained``:
    step -> whether a backward ran in it); a thinned step's is not, and it is judged against the larger of the kinds'
    medians (``medians``: every step's of each kind, the writer's sketches, queries.kind_medians), over which it is a
    stall whatever its kind. Training is named first: the kind stalls reports."""
    known = trained.reindex(steps)
    kinds = known.map({True: "training", False: "evaluation"}).fillna(THINNED)
    return kinds, {"training": medians["training"], "evaluation": medians["evaluation"],
                   THINNED: max(medians.values())}


def outlier_steps(t: Tables) -> list[dict]:
    """Steps far beyond the run's median (stalls, contention from other load), named with their times."""
    per = t.every_step.groupby("step")["duration_ms"].max().sort_index().iloc[1:]  # the first step's costs are no stall
    kinds = step_kinds(t, per.index)
    medians = None
    if kinds is None and t.kind_medians is not None and t.kept_trained is not None:  # thinned, of both kinds
        kinds, medians = thinned_kinds(per.index, t.kept_trained, t.kind_medians)
    found = stalls(per, kinds, medians)
    if found is None:
        return []
    median, excess, share, worst = found.median_ms, found.excess_ms, found.share, found.slow_ms
    of_median, of_kind = f"{MEDIAN_STEP} {median:.2f} ms", ""
    if found.medians is not None:  # a training step against the training steps, an evaluation step against its own
        of_median = "; ".join(f"a step whose detail was thinned (its kind unknown) against the larger, {m:.2f} ms"
                              if k == THINNED else f"median {k} step past the first {m:.2f} ms"
                              + (" (no backward)" if k == "evaluation" else "")
                              for k, m in sorted(found.medians.items(), reverse=True))
        of_kind = " of its kind"
    listed = ", ".join(f"{s} ({ms:.0f} ms)" for s, ms in worst.head(OUTLIER_STEPS_LISTED).items())
    more = f" and {len(worst) - OUTLIER_STEPS_LISTED} more" if len(worst) > OUTLIER_STEPS_LISTED else ""
    outside = ("Steps that stall like this come from outside the model: another process on the same cores or GPU "
               "(another run started alongside), data loading, swapping or garbage collection. Check what else ran "
               "at those steps; the per-device findings of such a run are less certain.")
    grown = _grown_part(t, worst.index)
    where = ""
    if grown is not None:
        part, slow_ms, usual_ms = grown
        words = ("the rest of the step (in none of its recorded parts: the script's own code in it, not the model's)"
                 if part == REST else PHASE_WORDS.get(part, part))
        where = (f"; their extra time is in {words}: {slow_ms:.2f} ms a step in them against {usual_ms:.2f} ms in the "
                 f"others (median)")
    every = _every(worst.index, per.index)
    if every is not None:
        first = int(min(worst.index))
        outside = (f"The slow steps come every {every} steps: work the script does every {every} steps (an evaluation, "
                   "a checkpoint, logging or a metric synchronised with .item()) lands in them. Do it less often, or "
                   "make it cheaper (checkpoints written in the background, metrics kept on the device and "
                   f"synchronised rarely); dpprof run --capture {first}:{first + 1} train.py, then dpprof ops RUN, "
                   f"shows step {first}'s by operator.")
    bigger, against = _bigger_batches(t, worst.index, kinds)
    advice, batches = outside, ""
    if bigger:  # the step's own work grew with its batch (dynamic shapes): no stall from outside
        listed_big = ", ".join(f"{s} ({b:,} samples)" for s, b in list(bigger.items())[:OUTLIER_STEPS_LISTED])
        batches = f"; {len(bigger)} of them had a bigger batch than {against}: steps {listed_big}"
        advice = (f"{'These steps' if len(bigger) == len(worst) else 'The steps with bigger batches'} took longer "
                  "because they had more samples to work on (batches of varying size, dynamic shapes), not from a "
                  "stall: their time follows their batch. Bucket batches by size or pad to fixed shapes for steady "
                  "steps" + ("." if len(bigger) == len(worst) else f". For the others: {outside}"))
    return [finding("outlier_steps", found.severity, None,
                    f"{len(worst)} of {found.steps} steps took over {OUTLIER_STEP_RATIO:g}x the median step{of_kind}",
                    f"{of_median}; steps {listed}{more}; {total_text(excess)} beyond the median{of_kind}, "
                    f"{share:.0%} of the run's step time past the first{where}{batches}", advice, share, "share")]


def _grown_part(t: Tables, slow: pd.Index) -> tuple[str, float, float] | None:
    """The part of the step (dpprof.stepmodel) that holds most of the ``slow`` steps' extra time: its name, its mean ms
    a step in them and its median in the other steps past the first (each step's parts the mean over its ranks, so
    they still sum to its mean window); None where the rows do not cover both, or no part holds half the extra."""
    parts = t.later_step_parts
    if parts.empty:
        return None
    names = [c for c in parts.columns if c not in ("rank", "step", "window_ms")]
    per = parts.groupby("step")[["window_ms", *names]].mean()
    hit = per.index.isin(slow)
    if not hit.any() or hit.all():
        return None
    excess = per.loc[hit, names].mean() - per.loc[~hit, names].median()
    total = float(per.loc[hit, "window_ms"].mean() - per.loc[~hit, "window_ms"].median())
    part = str(excess.idxmax())
    if total <= 0 or excess[part] < 0.5 * total:
        return None
    return part, float(per.loc[hit, part].mean()), float(per.loc[~hit, part].median())


def _every(slow: Iterable[int], steps: Iterable[int]) -> int | None:
    """The period of slow steps that come every N steps (N >= 2): at least EVERY_MIN_STEPS of them, all the same
    step modulo N (N the greatest common divisor of their distances), and at least EVERY_SHARE of the run's steps
    past the first that fall there; None otherwise (stalls at no regular interval)."""
    found = sorted(int(s) for s in slow)
    if len(found) < EVERY_MIN_STEPS:
        return None
    every = 0
    for a, b in zip(found, found[1:]):
        every = math.gcd(every, b - a)
    if every < 2:
        return None
    there = [s for s in steps if s % every == found[0] % every]
    return every if len(found) >= EVERY_SHARE * len(there) else None


def _bigger_batches(t: Tables, steps: pd.Index, kinds: pd.Series | None = None) -> tuple[dict[int, int], str]:
    """bigger_batches over the run's steps past the first (a step's batch: its largest recorded batch_size), and the
    median they were set against, in words. Where ``kinds`` (step_kinds) mixes training and evaluation steps, each step
    is set against the steps of its kind, as its time is (stalls): an evaluation batch, often bigger than a training
    one, is no sign that a slow evaluation step's time grew with it."""
    if "batch_size" not in t.every_step:
        return {}, ""
    batch = t.every_step.groupby("step")["batch_size"].max().sort_index().iloc[1:]
    if kinds is None:
        bigger, median = bigger_batches(batch, steps)
        return bigger, f"the median step's {median:,g} samples"
    found: dict[int, int] = {}
    against = []
    for kind in sorted(set(kinds[steps]), reverse=True):  # training, then evaluation
        mine, median = bigger_batches(batch[batch.index.isin(kinds.index[kinds == kind])],
                                      [s for s in steps if kinds[s] == kind])
        if mine:
            found.update(mine)
            against.append(f"the median {kind} step's {median:,g} samples")
    return {int(s): found[s] for s in steps if s in found}, " and ".join(against)


def bigger_batches(batch: pd.Series, steps: Iterable[int]) -> tuple[dict[int, int], float]:
    """Of ``steps``, those whose batch is bigger than the median batch of the steps past the first, step -> batch,
    and that median; none where the run records no batch sizes. ``batch``: each step past the first's batch (its
    largest recorded batch_size), by step. The outlier_steps finding and dpprof advise's note of slow steps put the
    steps it returns down to their batch, not to a stall."""
    batch = pd.to_numeric(batch, errors="coerce")
    if batch.isna().all():
        return {}, 0.0
    median = float(batch.median())
    return {int(s): int(batch[s]) for s in steps if s in batch.index and batch[s] > median}, median


def rest_of_steps(t: Tables) -> pd.DataFrame:
    """Per rank (its device label) over the steps past the first: steps, mean step (window_ms), mean rest (the part
    of the step the step model gives no recorded part: dpprof.stepmodel.partition over the run's phases), ms, and
    steps_over, the steps whose own rest is over REST_SHARE_WARN of that step."""
    cols = ["device", "steps", "window_ms", REST, "steps_over"]
    parts = t.later_step_parts
    if parts.empty:
        return pd.DataFrame(columns=cols)
    parts = parts.assign(over=parts[REST] > REST_SHARE_WARN * parts["window_ms"])
    ph = t.phases
    label = ph.drop_duplicates("rank").set_index("rank")["device"]  # a rank's device label ("rank:1")
    per = parts.groupby("rank").agg(steps=("step", "count"), window_ms=("window_ms", "mean"), rest=(REST, "mean"),
                                    steps_over=("over", "sum"))
    per = per[per.index.isin(label.index)]
    return per.assign(device=per.index.map(label)).reset_index(drop=True)[cols]


def unrecorded_time(t: Tables) -> list[dict]:
    """A recorded DDP or FSDP rank whose step is over REST_SHARE_WARN outside its recorded parts, over the run and in
    most of its steps: the loss and the script's own code between the parts (logging, metrics and the collectives
    that reduce them, .item(), checkpoints, an evaluation between steps beside its DataLoader's calls), none of which
    dpprof times. One finding for the job, on the rank with the largest share; the value is that share. A few steps
    whose rest a stall lengthened (another process took the core between two parts) are the stall finding's, not
    this one's."""
    if t.model.imported or t.model.kind not in ("ddp", "fsdp"):
        return []
    per = rest_of_steps(t)
    per = per[per["window_ms"] > 0]
    per = per.assign(share=per[REST] / per["window_ms"]).sort_values("share", ascending=False, kind="stable")
    mostly = per[2 * per["steps_over"] > per["steps"]]
    if mostly.empty:
        return []
    worst = mostly.iloc[0]
    share, rest_ms, step_ms = float(worst["share"]), float(worst[REST]), float(worst["window_ms"])
    if share <= REST_SHARE_WARN or not worth_time(rest_ms, step_ms):
        return []
    device, steps = str(worst["device"]), int(worst["steps"])
    rest = per[per["device"] != device]
    others = [f"{r.device} {getattr(r, REST):.2f} ms ({r.share:.0%})" for r in rest.iloc[:RANKS_LISTED - 1].itertuples()]
    more = f" and {len(rest) - RANKS_LISTED + 1} more" if len(rest) >= RANKS_LISTED else ""
    parts = "data loading, forward, backward, the exposed collectives, the optimizer step and the script's collectives"
    over = int(worst["steps_over"])
    evidence = (f"{rest_ms:.2f} ms of {device}'s {step_ms:.2f} ms mean step past the first ({plural(steps, 'step')}) "
                f"is in none of its recorded parts ({parts}), over {REST_SHARE_WARN:.0%} of the step in {over} of "
                f"them"
                + (f"; the other ranks: {', '.join(others)}{more}" if others else "")
                + f". It holds the loss and the script's own code between the parts: logging and metrics, "
                f".item() and other synchronisations, checkpoints and evaluation between steps (the DataLoader's calls "
                f"are the data part, the script's own collectives a part of their own, script_comm). It "
                f"{cost_text(rest_ms, steps, device + chr(39) + 's')}")
    advice = ("See what runs there: record a window of steps with torch.profiler (dpprof run --capture 5:8 "
              "train.py, then dpprof ops RUN), or profile the script with torch.profiler and dpprof import its "
              "rank files. Log metrics every N steps rather than every step, and move checkpoints and evaluation "
              "off the step.")
    return [finding("unrecorded_time", "warning", device,
                    f"{share:.0%} of the step is outside the parts dpprof records", evidence, advice, share,
                    "share")]


def _loader_in_gaps(steps: pd.DataFrame, order: pd.Index) -> float | None:
    """The DataLoader's time (ms) in the gaps before the steps past the first of ``order``, from the steps'
    loader_ms; None where the steps do not say it (a DDP or FSDP rank's, whose DataLoader time is its data part, an
    imported trace's, a file written before the column, or no DataLoader made a batch)."""
    if "loader_ms" not in steps:
        return None
    loader = pd.to_numeric(steps["loader_ms"], errors="coerce").groupby(steps["step"]).max().reindex(order).iloc[1:]
    return None if loader.isna().any() else float(loader.sum())


def between_steps(t: Tables) -> list[dict]:
    """A recorded run whose steps leave over BETWEEN_STEPS_WARN of the time they span between them, and still do
    without their longest gap (not one stall): the script's time from one step's end to the next's start (a DataParallel loop's fetch of the next batch
    from its DataLoader, the script's own code), which no step or median step holds (the run's samples/s does:
    dpprof.store.queries.throughput, which the evidence gives). Imported traces'
    steps tile their window and are left out. The value is that share of the time from the first step's end to the
    last step's end. A run recorded with the DataLoader watch on that iterated none is told it is the script's own
    work there, with no DataLoader advice. Where the steps say how much of each gap their thread spent in the
    DataLoader's batches (StepRecord.loader_ms: a recorded DataParallel run's), the evidence splits the gap into that
    and the script's own work, and the advice follows the larger: under LOADER_GAP_SHARE of the gap in the DataLoader
    is the script's own work's advice."""
    if t.model.imported:
        return []
    s = t.every_step
    if s.empty or "start_ms" not in s:
        return []
    ends = (s["start_ms"] + s["duration_ms"]).groupby(s["step"]).max().sort_index()
    starts = s.groupby("step")["start_ms"].min().reindex(ends.index)
    durations = t.every_step.groupby("step")["duration_ms"].max().reindex(ends.index)
    if len(ends) < 3 or (ends.index.to_series().diff().iloc[1:] != 1).any():  # a thinned table: gaps unknown
        return []
    gaps = (starts.shift(-1) - ends).iloc[:-1].clip(lower=0.0)  # before each step past the first
    later = durations.iloc[1:].to_numpy()
    each = gaps.to_numpy() / (gaps.to_numpy() + later)
    gap_ms, step_ms = float(gaps.mean()), float(later.mean())
    span_ms = float(ends.iloc[-1] - ends.iloc[0])
    share = float(gaps.sum()) / span_ms if span_ms > 0 else 0.0
    # not one stall between two steps: the share stays over the line without the longest gap (a DataLoader with N
    # workers keeps the loop waiting before one step in N, so most gaps may be short)
    longest = float(gaps.max())
    without = (float(gaps.sum()) - longest) / (span_ms - longest) if span_ms > longest else 0.0
    if share <= BETWEEN_STEPS_WARN or without <= BETWEEN_STEPS_WARN or not worth_time(gap_ms, step_ms):
        return []
    evidence = (f"{gap_ms:.2f} ms passes between one step's end and the next's start against a {step_ms:.2f} ms "
                f"step (means over the {plural(len(gaps), 'step')} past the first): {share:.0%} of the time from the "
                f"first step's end to the last's is in no step, over {BETWEEN_STEPS_WARN:.0%} of it before "
                f"{int((each > BETWEEN_STEPS_WARN).sum())} of them. The step time and its median leave this time out")
    # the Overview's samples/s (dpprof.store.queries.throughput): a run read from its aggregates has no whole phases
    backward = t.backward_steps
    rate = throughput_of(s, training_steps_of(backward, s["step"]) if backward is not None else None,
                         raised_steps_of(s, backward) if backward is not None else None)
    if rate is not None:
        evidence += (f": the steps past the first trained {rate.samples:,} samples in {rate.span_ms / 1e3:,.2f} s, "
                     f"{rate.samples_per_s:,.0f} samples/s (the run's samples/s), against "
                     f"{rate.samples / later.sum() * 1e3:,.0f} samples/s over the steps' own time")
    capture = ("Record a window with torch.profiler (dpprof run --capture 5:8 train.py, then dpprof ops RUN) to see "
               "it by operator.")
    # a run whose DataLoader watch saw none iterated has none of its time (an earlier run's in the process is no part)
    loading_ms = None if none_iterated(t.data_loaders) else _loader_in_gaps(s, ends.index)
    if loading_ms is not None:
        loaded = min(1.0, loading_ms / float(gaps.sum())) if float(gaps.sum()) > 0 else 0.0
        evidence += (f"; the DataLoader made the next batch in {loaded:.0%} of the time between steps "
                     f"({loading_ms / len(gaps):.2f} ms a step, its iterators' time on the steps' thread), the script's "
                     f"own work took the other {max(0.0, gap_ms - loading_ms / len(gaps)):.2f} ms")
    if none_iterated(t.data_loaders) or (loading_ms is not None and loaded < LOADER_GAP_SHARE):
        # recorded with the watch on, and no DataLoader ran (dpprof.loaders), or it took the smaller part of the gaps
        if loading_ms is None:
            evidence += "; no DataLoader was iterated while the run was recorded"
        where = ("no DataLoader loads there" if loading_ms is None else "its DataLoader loads in none of that time"
                 if loading_ms == 0 else "its DataLoader takes the smaller part of that time")
        advice = (f"See what the script does between steps: {where}, so it is the script's own work "
                  "(building or reading the next batch in the loop, logging and metrics, checkpointing, evaluation, "
                  "a host synchronisation such as .item()). Move it off the step loop: log and checkpoint every N "
                  "steps rather than every step, evaluate less often, build batches in the background. " + capture)
    else:
        said, left = workers_advice([d for found in t.data_loaders.values() for d in found], t.on_gpus)
        evidence += said
        pin = ", pin_memory" if t.on_gpus else ""
        loading = f" (load in worker processes: num_workers, persistent_workers{pin})" if left is None else ""
        advice = ("See what the script does between steps: in a training loop that is fetching the next batch from its "
                  f"DataLoader{loading}, then logging, metrics and checkpoints. "
                  + ("" if left is None else f"Its DataLoader already loads in workers that do not keep up; what is "
                                             f"left: {left}. ")
                  + capture)
    # half the run between steps: every step figure (median, samples/s) is off by 2x or more
    return [finding("between_steps", "critical" if share >= 2 * BETWEEN_STEPS_WARN else "warning", None,
                    f"{share:.0%} of the run's time is between its steps", evidence, advice, share, "share")]

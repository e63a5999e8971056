"""Rules for FSDP ranks (runs recorded by dpprof.parallel.fsdp): all-gathers and reduce-scatters the ranks waited for,
the extra all-gathers of resharding after forward, and shards of uneven size.

Every figure is per rank and step, the first step left out (it carries one-time costs); each rule reads the
recorded phases (the exposed parts: ``all_gather_wait``, ``reduce_scatter_wait``), the collectives (``comms``, whose
``collective`` names them) and the memory records (each rank's sharded parameter bytes).
"""
from __future__ import annotations

import pandas as pd

from dpprof.findings.base import MEDIAN_STEP, Tables, finding, per_step
from dpprof.findings.floors import cost_text, critical_share_or, worth_bytes, worth_time
from dpprof.units import mib, plural

__all__ = ["EXPOSED_SHARE_WARN", "UNEVEN_SHARD_RATIO", "fsdp_collectives", "all_gather_exposed",
           "reduce_scatter_exposed", "reshard_after_forward", "uneven_shards", "FSDP_RULES"]

# A collective the ranks wait for more than 10% of the step is worth acting on: FSDP's design goal is that the
# all-gather of the next layer and the reduce-scatter of the last one run under compute, so exposed time is what
# prefetching (or fewer, larger groups) buys back; under 10% is within what a step's compute can vary by.
EXPOSED_SHARE_WARN = 0.10
# Shards differ when a parameter's first dimension does not divide by the ranks (FSDP2 shards on dim 0, the last
# rank's shard is short); a rank holding 10% more parameters than another does 10% more optimizer work and keeps
# 10% more optimizer state, beyond a step's variation.
UNEVEN_SHARD_RATIO = 1.10

_WAIT = {"all-gather": "all_gather_wait", "reduce-scatter": "reduce_scatter_wait"}

# Issued and exposed time are sums of the same waits read from two tables (the collectives and the *_wait phases): they
# differ by float rounding where every collective blocked the host (gloo). Below a nanosecond, the host clock's
# resolution, the difference is that rounding, not time hidden behind compute.
HIDDEN_FLOOR_MS = 1e-6


def _hidden_pct(issued_ms: float, exposed_ms: float) -> float:
    """The share of a collective's issued time the rank did not wait for, in %: 0 where it waited for all of it."""
    if not issued_ms > 0:
        return float("nan")
    hidden_ms = issued_ms - exposed_ms
    return 100 * hidden_ms / issued_ms if hidden_ms >= HIDDEN_FLOOR_MS else 0.0


def fsdp_collectives(t: Tables) -> pd.DataFrame:
    """Per rank and collective (all-gather, reduce-scatter), means per step over the steps after the first.

    Returns:
        columns device, collective, per_step (how many), bytes_per_step, issued_ms (launch to completion, summed over
            those in a forward or backward),
        exposed_ms (the rank's host blocked in them: the ``*_wait`` phases), hidden_pct (the share of issued time
        that was not exposed: ran while the rank computed), forward_per_step and backward_per_step (each in
        the first of its step's forwards and backwards not ended at its launch: a micro-batch's own, gradient
        accumulation running several of each a step; one launched after all of them, such as FSDP1 gathering a full
        state dict after the last step, is in neither).
    """
    cols = ["device", "collective", "per_step", "bytes_per_step", "issued_ms", "exposed_ms", "hidden_pct",
            "forward_per_step", "backward_per_step", "rank"]
    comms = t.comms
    if comms.empty or "collective" not in comms or t.first_step is None:
        return pd.DataFrame(columns=cols)
    comms = comms[comms["collective"].isin(list(_WAIT)) & (comms["step"] != t.first_step)]
    steps = t.steps[t.steps["step"] != t.first_step].groupby("rank")["step"].nunique()
    # each collective belongs to the first forward or backward of its step (and device) not ended when it was launched
    # (a micro-batch's own: gradient accumulation runs several of each a step), even launched just before it began:
    # the root's pre-forward all-gather, or the unshard for a backward launched between the loss and its first
    # gradient; one launched after the step's last forward and backward (a full state dict's) is in neither
    passes = t.phases[t.phases["phase"].isin(["forward", "backward"])]
    passes = passes.assign(end_ms=passes["start_ms"] + passes["duration_ms"]).sort_values("end_ms")[
        ["step", "device", "phase", "end_ms"]]
    comms = pd.merge_asof(comms.reset_index(drop=True).assign(_row=lambda d: range(len(d))).sort_values("launch_ms"),
                          passes, left_on="launch_ms", right_on="end_ms", by=["step", "device"],
                          direction="forward").sort_values("_row")
    comms["in_forward"] = comms["phase"].eq("forward")
    comms["in_backward"] = comms["phase"].eq("backward")
    rows = []
    for (device, what), c in comms.groupby(["device", "collective"]):
        n = int(steps.get(int(c["rank"].iloc[0]), c["step"].nunique())) or 1
        in_forward, in_backward = int(c["in_forward"].sum()), int(c["in_backward"].sum())
        waits = per_step(t, [_WAIT[what]])
        exposed = float(waits[device].sum()) / n if device in waits else 0.0
        # issued over the collectives inside a forward or backward, where the rank could compute under them: one in
        # neither (FSDP1's full state dict gathered after the last backward) blocked the host outside the step's parts,
        # so it is no wait the rank's parts hold, and would read as time hidden behind compute (21% of FSDP1's
        # all-gathers on gloo, where none can be)
        issued = float(c.loc[c["in_forward"] | c["in_backward"], "duration_ms"].sum()) / n
        rows.append({"device": device, "collective": what, "per_step": len(c) / n,
                     "bytes_per_step": float(c["bucket_bytes"].sum()) / n, "issued_ms": issued,
                     "exposed_ms": exposed,
                     "hidden_pct": _hidden_pct(issued, exposed),
                     "forward_per_step": in_forward / n, "backward_per_step": in_backward / n,
                     "rank": int(c["rank"].iloc[0])})
    return pd.DataFrame(rows, columns=cols)


def _exposed(t: Tables, what: str, advice: str) -> list[dict]:
    table = fsdp_collectives(t)
    table = table[table["collective"] == what]
    step_ms = t.median_step_ms
    if table.empty or not step_ms or pd.isna(step_ms):
        return []
    worst = table.loc[table["exposed_ms"].idxmax()]
    cost = float(worst["exposed_ms"])
    share = cost / step_ms
    if share < EXPOSED_SHARE_WARN or not worth_time(cost, step_ms):
        return []
    name = what.replace("-", "_")
    severity = critical_share_or("warning", share)
    gloo = t.model.dist_backend == "gloo"
    return [finding(f"{name}_exposed", severity, str(worst["device"]),
                    f"{what} exposed: {worst['device']} waits {100 * share:.0f}% of the step for it",
                    f"{worst['device']} waits {cost:.2f} ms a step for {_count(worst['per_step'], what)} of "
                    f"{mib(worst['bytes_per_step'])} a step ({worst['issued_ms']:.2f} ms issued, "
                    f"{worst['hidden_pct']:.0f}% of it hidden behind compute), of a {step_ms:.2f} ms {MEDIAN_STEP}; "
                    f"{cost_text(cost, t.later_step_count)}"
                    + ("; on gloo every FSDP collective blocks the host, so none of it can overlap" if gloo else ""),
                    advice + (" On gloo (CPU) collectives are synchronous: only fewer, larger groups or a bigger batch "
                              "per rank help here; NCCL on GPUs overlaps them." if gloo else ""), share, "share")]


def _count(per_step: float, noun: str) -> str:
    """A mean count per step, whole as the findings say it, with its noun: "1 reduce-scatter", "2 all-gathers"."""
    return plural(int(round(float(per_step))), noun)


def all_gather_exposed(t: Tables) -> list[dict]:
    """The all-gathers a rank waited for, over EXPOSED_SHARE_WARN of the step (prefetching off or too late)."""
    return _exposed(t, "all-gather",
                    "Prefetch the next layer's parameters earlier: FSDP2 prefetches one layer ahead implicitly; "
                    "set_modules_to_forward_prefetch / set_modules_to_backward_prefetch start it sooner, and "
                    "wrapping fewer, larger modules with fully_shard makes fewer, larger all-gathers (FSDP1: "
                    "forward_prefetch=True and backward_prefetch=BackwardPrefetch.BACKWARD_PRE, and a coarser "
                    "auto_wrap_policy).")


def reduce_scatter_exposed(t: Tables) -> list[dict]:
    """The reduce-scatters a rank waited for, over EXPOSED_SHARE_WARN of the step."""
    return _exposed(t, "reduce-scatter",
                    "Let the reduce-scatter run under the next layer's backward: fewer, larger fully_shard groups, "
                    "set_requires_gradient_sync(False) on accumulation micro-batches, or a reduce dtype of bf16 "
                    "(MixedPrecisionPolicy(reduce_dtype=...)) to halve the bytes (FSDP1: no_sync() on accumulation "
                    "micro-batches, MixedPrecision(reduce_dtype=...)).")


def reshard_after_forward(t: Tables) -> list[dict]:
    """All-gathers in backward of parameters gathered in forward: resharding after forward (FSDP2's default) costs
    another all-gather per group per step, traded for the memory of the gathered parameters."""
    table = fsdp_collectives(t)
    table = table[(table["collective"] == "all-gather") & (table["backward_per_step"] > 0)]
    step_ms = t.median_step_ms
    if table.empty or not step_ms or pd.isna(step_ms):
        return []
    worst = table.loc[table["backward_per_step"].idxmax()]
    share_of_gathers = worst["backward_per_step"] / worst["per_step"]
    extra_bytes = worst["bytes_per_step"] * share_of_gathers
    extra_ms = worst["issued_ms"] * share_of_gathers  # the backward all-gathers' share of the all-gather time
    peak = _gathered_peak(t, str(worst["device"]))
    severity = "warning" if worth_time(extra_ms, step_ms) and extra_ms / step_ms >= EXPOSED_SHARE_WARN else "info"
    return [finding("reshard_after_forward", severity, str(worst["device"]),
                    f"resharding after forward costs {_count(worst['backward_per_step'], 'more all-gather')} a step",
                    f"{worst['device']} gathers its parameters again in backward: {worst['backward_per_step']:.0f} "
                    f"of its {_count(worst['per_step'], 'all-gather')} a step ({mib(extra_bytes)}), about "
                    f"{extra_ms:.2f} ms of a {step_ms:.2f} ms {MEDIAN_STEP}"
                    + (f"; the gathered parameters it held at once peaked at {mib(peak)}" if peak else ""),
                    "fully_shard(..., reshard_after_forward=False) keeps each group's gathered parameters from "
                    "forward to backward (no second all-gather) at the cost of holding them all at once; an int "
                    "reshards to a smaller group instead (FSDP1: sharding_strategy=ShardingStrategy.SHARD_GRAD_OP "
                    "keeps them, HYBRID_SHARD gathers within a node). Worth it when the memory is there.",
                    extra_ms, "ms")]


def _gathered_peak(t: Tables, device: str) -> float | None:
    mem = t.memory[t.memory["device"] == device] if len(t.memory) else t.memory
    return float(mem["gathered_bytes"].max()) if len(mem) else None


def uneven_shards(t: Tables) -> list[dict]:
    """Ranks holding different numbers of parameter bytes (shards cut on dim 0 that does not divide by the ranks),
    over UNEVEN_SHARD_RATIO and the memory floor."""
    mem = t.memory
    if mem.empty or mem["device"].nunique() < 2:
        return []
    held = mem.groupby("device")["param_bytes"].max()
    most, least = held.idxmax(), held.idxmin()
    if held[least] <= 0 or held[most] / held[least] < UNEVEN_SHARD_RATIO or not worth_bytes(held[most] - held[least]):
        return []
    listing = ", ".join(f"{d} {mib(b)}" for d, b in held.items())
    return [finding("uneven_shards", "warning", str(most),
                    f"uneven shards: {most} holds {held[most] / held[least]:.2f}x the parameters of {least}",
                    f"sharded parameter bytes per rank: {listing}; {mib(held[most] - held[least])} more on "
                    f"{most}, and as much more optimizer state and optimizer work",
                    "FSDP2 shards each parameter on dim 0: a dim-0 size that does not divide by the number of ranks "
                    "leaves the last ranks short. Pad such dimensions to a multiple of the ranks, or pass "
                    "shard_placement_fn to shard those parameters on a dimension that divides.",
                    float(held[most] - held[least]), "bytes")]


FSDP_RULES = (all_gather_exposed, reduce_scatter_exposed, reshard_after_forward, uneven_shards)

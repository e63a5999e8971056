"""The advisor's calibration: a few seconds of measurement on this machine, cached per host and device set.

Imports torch and torch.distributed: only ``dpprof advise`` (the command line) imports this module, never the
read side. Measures, each as the median of repeated timings:

- the hand-off of a no-op task to k CPU workers and back, for k = 2 .. 2n (what parallel_apply pays per call);
- a copy on the calling thread per MiB (replicate's copies, gather's concatenation, the gradients' sum) and
  one small tensor op;
- the gloo all-reduce across n ranks on this host at 4 KiB .. 4 MiB (n processes, one intra-op thread each, as
  ``dpprof profile --ddp`` runs them), fitted as latency + MiB x ms per MiB;
- a real ``dpprof profile tutorial-linear --ddp`` on n ranks (torchrun, as users start it): how long a rank waits
  at the end of backward for its one small all-reduce, and what a step holds beyond its phases;
- with more than one intra-op thread, a conv's forward + backward on all of them against one;
- the cores this process gets now: the work of one single-threaded CPU worker per core at once over one alone
  (fewer than the host's where other jobs run);
- DataParallel's own costs on k = 1 .. 2n CPU workers, plain and balanced: a model with no compute to speak of
  trained and recorded in memory, each phase's median per step (scatter, replicate, the dispatch beyond the
  slowest apply, gather, loss, backward; the balanced criterion's scatter, replicate, dispatch and reduce).
"""
from __future__ import annotations

import os
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import datetime, timezone

import torch

from dpprof.advise.calibration_cache import Calibration, measured_torch, save_calibration
from dpprof.records import ALL_REDUCE

__all__ = ["calibrate", "effective_cores", "refresh_load", "ALLREDUCE_SIZES_BYTES"]

ALLREDUCE_SIZES_BYTES = (4 << 10, 64 << 10, 1 << 20, 4 << 20)  # small buckets to DDP's first bucket and beyond
_GLOO_ATTEMPTS = 2  # a port taken between choosing and binding it, or a rank lost at start-up: try once more
_ALLREDUCE_WARMUP = 20
_ALLREDUCE_BURST = 5
_COPY_BYTES = 1 << 20  # a parameter tensor of a mid-sized layer; large enough that the copy's fixed cost is noise


def _times_ms(fn: Callable[[], object], reps: int, warmup: int = 3) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        fn()
        out.append((time.perf_counter_ns() - t0) / 1e6)
    return out


def _median_spread(times: list[float]) -> tuple[float, float]:
    """The median and the interquartile range over the median."""
    q = statistics.quantiles(times, n=4) if len(times) >= 4 else [min(times), 0, max(times)]
    med = statistics.median(times)
    return med, (q[2] - q[0]) / med if med > 0 else 0.0


def _handoff_ms(k: int) -> tuple[float, float]:
    from dpprof.parallel.workers import run_on_workers

    tasks = [lambda: None] * k
    return _median_spread(_times_ms(lambda: run_on_workers(list(range(k)), tasks, kind="calibrate"), 300, 20))


def _fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least squares ms = latency + MiB x per_mib, both at least 0."""
    xs = [b / 2**20 for b, _ in points]
    ys = [ms for _, ms in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0
    slope = max(0.0, slope)
    return max(0.0, my - slope * mx), slope


def _rank_main(rank: int, world: int, port: int, out_path: str) -> None:
    """One gloo rank of the calibration: all-reduce timings and the recorded DDP step's overhead."""
    import json

    import torch.distributed as dist

    torch.set_num_threads(1)  # as dpprof profile --ddp runs each rank (OMP_NUM_THREADS=1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        points, spreads = [], []
        warm = torch.zeros(ALLREDUCE_SIZES_BYTES[0] // 4)
        for _ in range(_ALLREDUCE_WARMUP):  # the first collectives set gloo's connections up
            dist.all_reduce(warm)
        for nbytes in ALLREDUCE_SIZES_BYTES:
            t = torch.zeros(nbytes // 4)

            def burst() -> None:  # back to back, so one rank's late start is shared by the burst
                for _ in range(_ALLREDUCE_BURST):
                    dist.all_reduce(t)

            dist.barrier()
            times = [ms / _ALLREDUCE_BURST for ms in _times_ms(burst, 15, 1)]
            med, spread = _median_spread(times)
            points.append((nbytes, med))
            spreads.append(spread)
        latency, per_mib = _fit(points)
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump({"points": points, "latency": latency, "per_mib": per_mib,
                           "allreduce_spread": statistics.median(spreads)}, f)
        dist.barrier()  # no rank leaves while another still talks to it
    finally:
        dist.destroy_process_group()
    # gloo's threads and DDP's reducer, torn down at interpreter exit after the group is gone, abort the process
    # now and then ("terminate called without an active exception"): the measurement is written, leave at once
    os._exit(0)


MACHINERY_STEPS = 40  # steps of the tiny model per k: medians settle, and all k together take about a second
MACHINERY_SKIP = 5  # the first steps start the workers and fill caches


def _machinery_ms(k: int, balanced: bool) -> dict[str, float]:
    """Median ms per step of each phase of a tiny model (Linear(8, 8), 4 samples a worker) trained on k CPU workers
    under a recording kept in memory: DataParallel's own costs at k, compute aside."""
    from torch import nn

    import dpprof
    from dpprof.parallel.balanced import MeasuredLoss

    torch.manual_seed(0)
    model = nn.Linear(8, 8)
    devices = dpprof.cpu_devices(k)
    net: torch.nn.Module
    criterion: torch.nn.Module
    if balanced:
        net = dpprof.DataParallelModel(model, device_ids=devices)
        criterion = dpprof.DataParallelCriterion(nn.MSELoss(), device_ids=devices)
    else:
        net = dpprof.DataParallel(model, device_ids=devices)
        criterion = MeasuredLoss(nn.MSELoss(), output_device=devices[0])
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    x, y = torch.randn(4 * k, 8), torch.randn(4 * k, 8)
    with dpprof.record(name="calibration", store=False) as run:
        for _ in range(MACHINERY_STEPS):
            with run.step():
                opt.zero_grad(set_to_none=True)
                criterion(net(x), y).backward()
                opt.step()
    frames = run.frames()
    phases = frames["phases"]
    phases = phases[phases["step"] >= MACHINERY_SKIP]
    per = phases.groupby(["step", "call", "phase"])["duration_ms"].agg(["sum", "max"]).reset_index()

    def median(call: int, phase: str, how: str = "sum") -> float:
        rows = per[(per["call"] == call) & (per["phase"] == phase)]
        return float(rows[how].median()) if len(rows) else 0.0

    def dispatch(call: int) -> float:
        pa = per[(per["call"] == call) & (per["phase"] == "parallel_apply")].set_index("step")["sum"]
        ap = per[(per["call"] == call) & (per["phase"] == "apply")].set_index("step")["max"]
        return float((pa - ap).dropna().median()) if len(pa) else 0.0

    out = {"scatter": median(0, "scatter"), "replicate": median(0, "replicate"), "dispatch": dispatch(0),
           "apply": median(0, "apply", "max"), "backward": median(0, "backward")}
    if balanced:
        out.update(criterion_scatter=median(1, "scatter"), criterion_replicate=median(1, "replicate"),
                   criterion_dispatch=dispatch(1), criterion_apply=median(1, "apply", "max"), reduce=median(1, "reduce"))
    else:
        out.update(gather=median(0, "gather"), loss=median(1, "loss"))
    steps = frames["steps"]
    out["step"] = float(steps[steps["step"] >= MACHINERY_SKIP]["duration_ms"].median())
    # what the step spends outside its phases (the recording's own bookkeeping per device, Python between phases)
    stacked = [p for p in out if p not in ("apply", "criterion_apply", "step", "dispatch", "criterion_dispatch")]
    out["rest"] = max(0.0, out["step"] - sum(out[p] for p in stacked) - out["apply"] - out["dispatch"]
                      - (out.get("criterion_apply", 0.0) + out.get("criterion_dispatch", 0.0)))
    return {p: round(ms, 5) for p, ms in out.items()}


DDP_STEPS = 25  # steps of the real DDP run: 24 past the first, 48 rank-steps for the medians


def _ddp_step(world: int) -> tuple[float, float, float]:
    """A real ``dpprof profile tutorial-linear --ddp`` (a model with no compute to speak of, 15 samples a rank) run
    as users start it (torchrun, its ranks, the progress read from their output): the median time a rank waits at
    the end of backward for its one small all-reduce, and what a step holds beyond its phases. On a host where
    the ranks share cores, the wait is a scheduler's turn, not the wire.

    Returns:
        (sync_ms, overhead_ms, spread of the waits)
    """
    from dpprof.launch import LaunchError, Profile
    from dpprof.store.reader import load_run

    from dpprof.store import advisor_rows

    with tempfile.TemporaryDirectory() as tmp:
        profile = Profile(workload="tutorial-linear", ddp=True, nproc=world, steps=DDP_STEPS, batch_size=15,
                          name="calibration", reports_dir=tmp).with_run_id()
        try:
            run_id = profile.run_ddp()
        except LaunchError as err:
            raise RuntimeError(f"the calibration's DDP run failed ({profile.command()}): {err}") from None
        run = load_run(run_id, tmp)
        phases = advisor_rows.phases_after(run, 0)
        steps = advisor_rows.steps_after(run, 0)
    per = phases.pivot_table(index=["rank", "step"], columns="phase", values="duration_ms", aggfunc="sum")
    step = steps.set_index(["rank", "step"])["duration_ms"]
    waits = per["comm_wait"].dropna().tolist()
    beyond = (step - per["forward"] - per["backward"] - per.get("optimizer", 0.0)).dropna().clip(lower=0).tolist()
    sync, spread = _median_spread(waits)
    return sync, statistics.median(beyond) if beyond else 0.0, spread


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gloo(world: int) -> dict:
    import json

    import torch.multiprocessing as mp
    from torch.multiprocessing.spawn import ProcessException

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "gloo.json")
        for attempt in range(_GLOO_ATTEMPTS):
            try:
                mp.start_processes(_rank_main, args=(world, _free_port(), out), nprocs=world, start_method="spawn")
            except ProcessException:  # a rank failed (gloo's rendezvous on a busy port): tried again
                if attempt == _GLOO_ATTEMPTS - 1:
                    raise
                continue
            with open(out) as f:
                return json.load(f)
    raise AssertionError("unreachable")


CORES_ROUNDS = 9  # rounds of one worker against all of them, alternating: the median rides out other jobs' bursts
_CORES_MATMUL = 160  # a product of this size: GIL-free work, repeated to make a burst
_CORES_BURST_MS = 10.0  # a burst's length on one thread: the rounds span about half a second, not one blip


def effective_cores() -> tuple[float, float]:
    """How many cores this process gets now: the work k single-threaded CPU workers do at once (k = the host's
    cores) over what one does alone, the median of CORES_ROUNDS alternating rounds. On an idle host it is the core
    count; where other jobs run (other sessions get their fair share first: Linux's autogroup), fewer.

    Returns:
        (cores, spread: the interquartile range of the rounds over their median).
    """
    from dpprof.parallel.workers import run_on_workers

    k = os.cpu_count() or 1
    if k < 2:
        return 1.0, 0.0
    a = torch.randn(_CORES_MATMUL, _CORES_MATMUL)

    reps = 1

    def burst() -> None:
        for _ in range(reps):
            torch.mm(a, a)

    saved = torch.get_num_threads()
    torch.set_num_threads(1)  # each worker's share: one thread
    try:
        run_on_workers(list(range(k)), [burst] * k, kind="cores")  # start the workers, warm their caches
        one_mm = min(_times_ms(lambda: torch.mm(a, a), 20, 5))
        reps = max(1, round(_CORES_BURST_MS / max(one_mm, 1e-3)))
        ratios = []
        for _ in range(CORES_ROUNDS):
            one = min(_times_ms(lambda: run_on_workers([0], [burst], kind="cores"), 2, 0))
            many = min(_times_ms(lambda: run_on_workers(list(range(k)), [burst] * k, kind="cores"), 2, 0))
            ratios.append(k * one / many if many > 0 else float(k))
    finally:
        torch.set_num_threads(saved)
    cores, spread = _median_spread(ratios)
    return min(float(k), max(0.1, cores)), spread


def refresh_load(calibration: Calibration, save: bool = True) -> Calibration:
    """The calibration with what the machine's load changes measured again (a few seconds): the cores this job
    gets and a real DDP run's wait at its all-reduce."""
    from dataclasses import replace

    cores, spread = effective_cores()
    sync, overhead, sync_spread = _ddp_step(max(2, calibration.devices))
    fresh = replace(calibration, effective_cores=round(cores, 3), cores_measured_at=_now(), ddp_sync_ms=sync,
                    ddp_overhead_ms=overhead,
                    spread={**calibration.spread, "cores": round(spread, 3), "ddp wait": round(sync_spread, 3)})
    if save:
        save_calibration(fresh)
    return fresh


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _thread_speedup(threads: int) -> tuple[float | None, float]:
    if threads <= 1:
        return None, 0.0
    from torch import nn

    conv = nn.Conv2d(3, 16, 5)
    x = torch.randn(64, 3, 32, 32)

    def step() -> None:
        conv(x).sum().backward()

    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one, s1 = _median_spread(_times_ms(step, 15))
        torch.set_num_threads(threads)
        many, s2 = _median_spread(_times_ms(step, 15))
    finally:
        torch.set_num_threads(saved)
    return one / many, max(s1, s2)


def calibrate(devices: int, save: bool = True, progress: bool = False) -> Calibration:
    """Measure this machine for ``devices`` CPU workers / gloo ranks (half a minute or so) and cache the result.

    Args:
        devices: the device set's size.
        save: write it to the cache (dpprof.advise.calibration_cache.save_calibration).
        progress: a progress bar on stderr (tqdm), one tick per measurement.
    """
    if devices < 1:
        raise ValueError(f"devices must be positive, got {devices}")
    from tqdm import tqdm

    threads = torch.get_num_threads()
    spread: dict[str, float] = {}
    handoff = {1: 0.0}
    ks = range(1, 2 * devices + 1)
    bar = tqdm(total=(2 * devices - 1) + 4 + 2 * len(ks) + 2, desc=f"calibrating for {devices} CPU worker(s)",
               unit="measurement", file=sys.stderr, disable=not progress, leave=False)

    def tick(what: str) -> None:
        bar.set_postfix_str(what, refresh=False)
        bar.update(1)

    with bar:
        for k in range(2, 2 * devices + 1):
            handoff[k], spread[f"hand-off x{k}"] = _handoff_ms(k)
            tick(f"hand-off x{k}")
        src = torch.randn(_COPY_BYTES // 4)
        copy_ms, spread["copy"] = _median_spread(_times_ms(src.clone, 200, 20))
        tick("copy")
        small = torch.ones(4)
        op_ms, spread["small op"] = _median_spread(_times_ms(lambda: small.add(1.0), 500, 50))
        tick("small op")
        speedup, spread["threads"] = _thread_speedup(threads)
        tick("threads")
        cores, spread["cores"] = effective_cores()
        tick("cores")
        dataparallel, balanced = {}, {}
        for k in ks:
            dataparallel[k] = _machinery_ms(k, False)
            tick(f"DataParallel x{k}")
        for k in ks:
            balanced[k] = _machinery_ms(k, True)
            tick(f"balanced x{k}")
        gloo = _gloo(max(2, devices))
        tick("gloo all-reduce")
        spread[ALL_REDUCE] = gloo["allreduce_spread"]
        sync, overhead, spread["ddp wait"] = _ddp_step(max(2, devices))
        tick("DDP step")
    calibration = Calibration(
        host=socket.gethostname(), backend="cpu", devices=devices, threads=threads, cores=os.cpu_count() or 1,
        measured_at=_now(), torch_version=measured_torch(), effective_cores=round(cores, 3), cores_measured_at=_now(),
        handoff_ms=handoff, copy_ms_per_mib=copy_ms / (_COPY_BYTES / 2**20), op_ms=op_ms,
        allreduce_latency_ms=gloo["latency"], allreduce_ms_per_mib=gloo["per_mib"],
        allreduce_points=[(int(b), float(ms)) for b, ms in gloo["points"]], ddp_sync_ms=sync, ddp_overhead_ms=overhead,
        thread_speedup=speedup, dataparallel_ms=dataparallel, balanced_ms=balanced, spread={k: round(v, 3) for k, v in spread.items()})
    if save:
        save_calibration(calibration)
    return calibration


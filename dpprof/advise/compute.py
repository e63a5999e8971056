"""The run's own model measured alone: for each split of the batch the scenarios need, DataParallel's own steps
(replicas, the batch scattered, the outputs gathered, backward from the loss on the calling thread) with each
chunk's forward run on its CPU worker by itself, one after the other, at one intra-op thread, so that nothing runs
beside it.

A recorded run shows what each chunk cost on its worker beside the others, and its backward over n replicas' graphs;
it cannot show what the same model costs on other chunks: a matrix product over 32 samples is not half of one over
64 (smaller products run less efficiently), and backward over k graphs adds k - 1 sums of the weights' gradients.
These are the model's own, not the machine's, so the calibration (a model with no compute) cannot hold them either.
``dpprof advise`` measures them here, for runs dpprof can rebuild (``dpprof profile WORKLOAD`` or ``--model``), in a
few seconds, and caches them beside the calibration (one file per run, host and torch). The read side (the Advisor
page) only reads the cache. The dataclasses are torch-free; measure_compute imports torch.
"""
from __future__ import annotations

import json
import math
import socket
import statistics
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dpprof.advise.calibration_cache import cache_dir, measured_torch, write_cache_file
from dpprof.advise.measured import chunk_sizes

if TYPE_CHECKING:
    from dpprof.advise.measured import Measured

__all__ = ["ChunkTimes", "ComputeProbe", "cached_compute", "compute_path", "measure_compute", "save_compute"]

# 2: a layout whose batch the workload cannot yield is refused (measure_compute); a version-1 file may hold one,
# measured on the batch the workload yielded (tutorial-linear's 100 taken for 10**9): measured again, not read
COMPUTE_VERSION = 2
WARMUP = 1  # passes not timed: the first allocates what later ones reuse
# timed passes per split: at least MIN_PASSES (a model whose pass takes seconds pays (WARMUP + MIN_PASSES) passes a
# split, no more), then more while the split has taken under PASS_BUDGET_S, up to MAX_PASSES (a small model's)
MIN_PASSES = 3
MAX_PASSES = 30
PASS_BUDGET_S = 0.25


@dataclass(frozen=True)
class ChunkTimes:
    """One layout (a batch split over k chunks as DataParallel splits it), on one thread, alone."""

    batch: int
    k: int
    forward_ms: tuple[float, ...]  # each chunk's forward on its worker, alone (grad on), the median over passes
    backward_ms: float  # backward of the k replicas' graphs from the loss on their gathered outputs (the sums of
    # their gradients onto the model's included), on the calling thread, the median
    passes: int

    def to_json(self) -> dict[str, Any]:
        return {"batch": self.batch, "k": self.k, "forward_ms": list(self.forward_ms),
                "backward_ms": self.backward_ms, "passes": self.passes}


@dataclass(frozen=True)
class ComputeProbe:
    """The run's model measured alone on this host (measure_compute)."""

    run_id: str
    host: str
    torch_version: str
    measured_at: str
    layouts: dict[tuple[int, int], ChunkTimes]  # by (batch, k)

    def covers(self, needed: list[tuple[int, int]]) -> bool:
        return all(key in self.layouts for key in needed)

    def get(self, batch: int, k: int) -> ChunkTimes:
        """The layout of ``batch`` on k devices: measured as on the devices torch.chunk gives a chunk (batch 6 on 4
        is 6 on 3: [2, 2, 2]), one measure for one split (layout_key)."""
        return self.layouts[layout_key(batch, k)]

    def to_json(self) -> dict[str, Any]:
        return {"version": COMPUTE_VERSION, "run_id": self.run_id, "host": self.host,
                "torch_version": self.torch_version, "measured_at": self.measured_at,
                "layouts": [t.to_json() for t in self.layouts.values()]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ComputeProbe:
        layouts = {}
        for row in data["layouts"]:
            times = ChunkTimes(int(row["batch"]), int(row["k"]), tuple(float(v) for v in row["forward_ms"]),
                               float(row["backward_ms"]), int(row["passes"]))
            if len(times.forward_ms) != len(chunk_sizes(times.batch, times.k)):
                raise ValueError(f"layout {times.batch}/{times.k} does not hold one forward time per chunk")
            if not all(math.isfinite(v) and v >= 0 for v in (*times.forward_ms, times.backward_ms)):
                raise ValueError(f"layout {times.batch}/{times.k} holds a time that is no finite number of at least 0")
            layouts[(times.batch, times.k)] = times
        return cls(str(data["run_id"]), str(data["host"]), str(data["torch_version"]), str(data["measured_at"]),
                   layouts)


def layout_key(batch: int, k: int) -> tuple[int, int]:
    """The layout ``batch`` on k devices is measured as: (batch, the devices torch.chunk gives a chunk), the same
    chunks (its chunks of ceil(batch / k) run out before the last devices where the batch is small)."""
    return batch, len(chunk_sizes(batch, k)) or k


def compute_path(run_id: str, host: str | None = None) -> Path:
    return cache_dir() / f"compute-{host or socket.gethostname()}-{run_id}.json"


def cached_compute(run_id: str, torch_version: str | None = None) -> ComputeProbe | None:
    """This host's cached measure of the run's model; None where there is none, it cannot be read, or it was
    measured with another torch (``torch_version``, where given)."""
    path = compute_path(run_id)
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or data.get("version") != COMPUTE_VERSION:
            return None
        probe = ComputeProbe.from_json(data)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if probe.run_id != run_id or probe.host != socket.gethostname():
        return None
    if torch_version is not None and probe.torch_version != torch_version:
        return None
    return probe


def save_compute(probe: ComputeProbe) -> Path:
    """Write the measure to its cache file (whole); returns the path.

    Raises:
        OSError: the cache cannot be written.
    """
    return write_cache_file(compute_path(probe.run_id, probe.host), probe.to_json())


def measure_compute(m: Measured, needed: list[tuple[int, int]], known: ComputeProbe | None = None,
                    progress: bool = False) -> ComputeProbe | None:
    """Each layout (batch, k) of ``needed`` that ``known`` lacks: the run's model rebuilt as its command builds it
    (the same weights, synthetic batches of its shapes), replicated and its batch scattered as DataParallel does on
    k CPU workers, each chunk's forward timed on its worker alone at one intra-op thread (on the calling thread
    where k is 1, as DataParallel on one device runs it), then backward timed from the loss on the gathered outputs.

    None for a run dpprof cannot rebuild (recorded from a script) or one on GPUs (they do not share cores).

    Raises:
        ValueError: the workload yields another batch than a layout's (a batch over its data set's samples)."""
    if m.backend != "cpu" or m.source not in ("builtin", "model"):
        return None
    import torch
    from tqdm import tqdm

    from dpprof.parallel.replicate import replicate
    from dpprof.parallel.scatter_gather import gather, scatter
    from dpprof.parallel.workers import run_on_workers
    from dpprof.workloads import Workload, build_workload, user_workload

    layouts = dict(known.layouts) if known is not None else {}
    todo = [key for key in dict.fromkeys(needed) if key not in layouts]

    def build(batch: int) -> Workload:
        if m.source == "builtin":
            return build_workload(str(m.workload), batch_size=batch)
        shape = tuple(int(d) for d in m.workload_args["input_shape"])
        return user_workload(str(m.workload), shape, batch_size=batch)

    def timed(module: torch.nn.Module, chunk: Any) -> tuple[Any, float]:
        t0 = time.perf_counter_ns()
        output = module(*chunk)
        return output, (time.perf_counter_ns() - t0) / 1e6

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with tqdm(total=len(todo), desc="measuring the model alone", unit="layout", leave=False,
                  disable=not progress) as bar:
            for batch in sorted({b for b, _ in todo}):
                workload = build(batch)
                model, criterion = workload.model, workload.criterion
                inputs, target = next(workload.batches())
                first = next(iter(inputs), None)
                if isinstance(first, torch.Tensor) and first.dim() > 0 and first.size(0) != batch:
                    # tutorial-linear's data set holds 100 samples: asked for more, it yields 100
                    raise ValueError(f"{m.workload} yields batches of {first.size(0)} samples when asked for "
                                     f"{batch}: batch {batch} cannot be measured")
                for k in sorted(k for b, k in todo if b == batch):
                    devices = [torch.device("cpu", i) for i in range(k)]
                    chunks = scatter(inputs, devices) if k > 1 else [inputs]
                    forward: list[list[float]] = [[] for _ in chunks]
                    backward: list[float] = []
                    started, passes = time.perf_counter(), 0
                    while passes < MIN_PASSES + WARMUP or (
                            passes < MAX_PASSES + WARMUP and time.perf_counter() - started < PASS_BUDGET_S):
                        outputs = []
                        replicas = replicate(model, devices[:len(chunks)]) if len(chunks) > 1 else [model]
                        for i, (replica, chunk) in enumerate(zip(replicas, chunks)):
                            if len(chunks) > 1:  # on its worker, nothing beside it
                                [(output, ms)] = run_on_workers([i], [partial(timed, replica, chunk)], "measure")
                            else:
                                output, ms = timed(model, chunk)
                            outputs.append(output)
                            if passes >= WARMUP:
                                forward[i].append(ms)
                        del replicas
                        loss = criterion(gather(outputs, devices[0]) if len(outputs) > 1 else outputs[0], target)
                        t0 = time.perf_counter_ns()
                        loss.backward()
                        if passes >= WARMUP:
                            backward.append((time.perf_counter_ns() - t0) / 1e6)
                        model.zero_grad(set_to_none=True)
                        del outputs, loss
                        passes += 1
                    layouts[(batch, k)] = ChunkTimes(batch, k, tuple(statistics.median(f) for f in forward),
                                                     statistics.median(backward), passes - WARMUP)
                    bar.update(1)
    finally:
        torch.set_num_threads(threads)
    return ComputeProbe(m.run_id, socket.gethostname(), measured_torch(),
                        datetime.now(timezone.utc).isoformat(timespec="seconds"), layouts)

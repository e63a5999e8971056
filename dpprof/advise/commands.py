"""The command that runs each scenario for real: ``dpprof profile`` with the recorded workload (torch-free)."""
from __future__ import annotations

import shlex
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dpprof.advise.measured import Measured

__all__ = ["command_for", "DEFAULT_STEPS"]

DEFAULT_STEPS = 30  # a run recorded without its step count: enough steps past the first for a median


def _workload(m: Measured) -> list[str] | None:
    args = m.workload_args
    if m.source == "builtin":
        return [str(m.workload)]
    if m.source == "model":
        return ["--model", str(m.workload), "--input-shape", ",".join(str(d) for d in args["input_shape"])]
    return None


def _devices(m: Measured, k: int) -> str:
    if m.backend == "cpu":
        return f"cpu:{k}"
    return ",".join(str(i) for i in range(k))


def command_for(m: Measured, scenario: str, k: int, batch: int, steps: int | None = None) -> str | None:
    """``dpprof profile ...`` for one scenario (None for a run recorded from a script: dpprof cannot rebuild it).

    DDP takes the per-rank batch (``--batch-size`` is each rank's under ``--ddp``). The recorded run's
    OMP_NUM_THREADS, where it set one, is set again, so that the threads are those the prediction assumed.
    """
    workload = _workload(m)
    if workload is None:
        return None
    steps = steps or int(m.workload_args.get("steps") or DEFAULT_STEPS)
    cmd = ["dpprof", "profile", *workload]
    if scenario == "ddp":
        cmd += ["--ddp", "--nproc", str(k), "--batch-size", str(max(1, batch // k))]
        if m.backend == "cuda":
            cmd += ["--devices", "cuda"]
    else:
        cmd += ["--devices", _devices(m, k), "--batch-size", str(batch)]
        if scenario == "balanced":
            cmd.append("--balanced")
    cmd += ["--steps", str(steps)]
    omp = m.workload_args.get("omp_num_threads")
    prefix = f"OMP_NUM_THREADS={int(omp)} " if omp else ""
    return prefix + shlex.join(cmd)

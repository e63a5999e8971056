"""The command that runs each scenario for real: ``dpprof profile`` with the recorded workload (torch-free)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from dpprof.launch import Profile
from dpprof.workload_names import WORKLOAD_SAMPLES

if TYPE_CHECKING:
    from dpprof.advise.measured import Measured

__all__ = ["CHECK_MAX_STEPS", "DEFAULT_STEPS", "command_for", "no_command", "profile_for", "scenario_steps"]

# The most steps a check run records (dpprof.advise.check): a median step and its interval are settled well before (a
# run of 100,000 steps would make --check take hours). The commands shown run the run's own steps; only --check is
# capped. Here, beside the commands, for the help and the Advisor page to say it without importing the check.
CHECK_MAX_STEPS = 100
DEFAULT_STEPS = 30  # a run recorded without its step count: enough steps past the first for a median


def _devices(m: Measured, k: int) -> str:
    if m.backend == "cpu":
        return f"cpu:{k}"
    return ",".join(str(i) for i in range(k))


def scenario_steps(m: Measured) -> int:
    """The steps each scenario's command runs: those the run recorded (fewer than it asked for where it did not
    finish), so the command shown reproduces the run. ``dpprof advise --check`` runs at most
    CHECK_MAX_STEPS of them."""
    asked = int(m.workload_args.get("steps") or DEFAULT_STEPS)
    return max(1, min(asked, m.steps or asked))


def _process_batch(scenario: str, k: int, batch: int) -> int:
    """The batch each process trains on: DDP's ranks torch.chunk's biggest chunk of ``batch``, ceil(batch / k) (batch
    // k gave 5 on 3 ranks 1 sample each against a prediction of 2); DataParallel's process the global batch."""
    return -(-batch // k) if scenario == "ddp" else batch


def no_command(m: Measured, scenario: str, k: int, batch: int) -> str | None:
    """Why no command runs one scenario for real (None where one does): a run recorded from a script, which dpprof
    cannot rebuild, or a batch over a built-in's data set (its loader would yield every sample, another batch)."""
    if m.source not in ("builtin", "model"):
        return "recorded from a script: change the script"
    most = WORKLOAD_SAMPLES.get(str(m.workload)) if m.source == "builtin" else None
    if most is not None and _process_batch(scenario, k, batch) > most:
        each = f" ({_process_batch(scenario, k, batch):,} a rank)" if scenario == "ddp" else ""
        return f"{m.workload}'s data set holds {most} samples: no run of it has batch {batch:,}{each}"
    return None


def profile_for(m: Measured, scenario: str, k: int, batch: int, steps: int | None = None) -> Profile | None:
    """The profile that runs one scenario for real (None where no_command says why not: a run recorded from a
    script, a batch the built-in cannot yield).

    DDP takes the per-rank batch (``batch_size`` is each rank's under ``ddp``): torch.chunk's biggest chunk of
    ``batch``, which the prediction's step waits for. The recorded run's
    OMP_NUM_THREADS, where it set one, is set again, so that the threads are those the prediction assumed.
    """
    if no_command(m, scenario, k, batch) is not None:
        return None
    args = m.workload_args
    if m.source == "builtin":
        what: dict = {"workload": str(m.workload)}
    else:
        what = {"model": str(m.workload), "input_shape": tuple(int(d) for d in args["input_shape"])}
    steps = steps or scenario_steps(m)
    omp = args.get("omp_num_threads")
    env = {"OMP_NUM_THREADS": str(int(omp))} if omp else {}
    if scenario == "ddp":  # each rank torch.chunk's biggest chunk: the prediction's step waits for it
        return Profile(**what, ddp=True, nproc=k, batch_size=_process_batch(scenario, k, batch),
                       devices="cuda" if m.backend == "cuda" else None, steps=steps, env=env)
    return Profile(**what, devices=_devices(m, k), batch_size=batch, balanced=scenario == "balanced", steps=steps,
                   env=env)


def command_for(m: Measured, scenario: str, k: int, batch: int, steps: int | None = None) -> str | None:
    """``dpprof profile ...`` for one scenario, as a user types it (profile_for's command)."""
    profile = profile_for(m, scenario, k, batch, steps)
    return None if profile is None else profile.command()

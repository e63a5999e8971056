"""``dpprof advise RUN --check``: run each scenario's command on this machine and set what it measured beside the
prediction. Torch-free itself: each scenario runs as ``python -m dpprof profile ...`` in its own process (its
runs go into the reports directory, named after the run they check and marked as its checks: ``check_of`` in their
workload_args, dpprof.records.CHECK_OF_ENV), and is read back as any run is."""
from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from dpprof.advise.commands import CHECK_MAX_STEPS
from dpprof.advise.predict import Advice, Scenario
from dpprof.launch import LaunchError, Profile
from dpprof.records import CHECK_OF_ENV
from dpprof.store import queries
from dpprof.store.reader import load_run

__all__ = ["CHECK_MAX_STEPS", "CHECK_TIMEOUT_S", "Checked", "check", "check_profile", "failed_reason", "run_scenario"]

CHECK_TIMEOUT_S = 900  # one scenario's run; a DDP run starts torchrun and its ranks
# A line dpprof itself says why it failed in: "dpprof: ..." or "dpprof profile: error: ...", never the hint under
# it ("  dpprof show ID", printed after a workload that failed while training)
_OWN_ERROR_LINE = re.compile(r"dpprof(?: [a-z]+)?: ")


@dataclass
class Checked:
    """One scenario predicted and run for real."""

    scenario: Scenario
    run_id: str | None
    measured_step_ms: float | None
    measured_peak_bytes: dict[str, int]
    error: str | None = None  # why the scenario could not be run
    steps: int | None = None  # the steps its check run recorded (at most CHECK_MAX_STEPS); None: no command

    @property
    def capped(self) -> bool:
        """Whether the check ran fewer steps than the scenario's command (CHECK_MAX_STEPS)."""
        profile = self.scenario.profile
        return profile is not None and self.steps is not None and self.steps < profile.steps

    @property
    def step_error(self) -> float | None:
        """(predicted - measured) / measured."""
        if not self.measured_step_ms:
            return None
        return (self.scenario.step_ms - self.measured_step_ms) / self.measured_step_ms

    @property
    def inside(self) -> bool | None:
        if self.measured_step_ms is None:
            return None
        return self.scenario.step_ms_low <= self.measured_step_ms <= self.scenario.step_ms_high

    def peak_errors(self) -> dict[str, float]:
        """Per device: (predicted - measured) / measured peak held bytes."""
        out = {}
        for device, measured in self.measured_peak_bytes.items():
            predicted = self.scenario.peak_bytes.get(device)
            if predicted is not None and measured:
                out[device] = (predicted - measured) / measured
        return out

    def to_json(self) -> dict:
        return {**self.scenario.to_json(), "check_run": self.run_id, "measured_step_ms": self.measured_step_ms,
                "step_error": self.step_error, "inside": self.inside, "measured_peak_bytes": self.measured_peak_bytes,
                "peak_errors": self.peak_errors(), "check_error": self.error, "check_steps": self.steps}


def run_scenario(profile: Profile, reports_dir: str | os.PathLike[str], name: str,
                 env: dict[str, str] | None = None, timeout_s: float = CHECK_TIMEOUT_S) -> str:
    """Run one scenario's profile in its own process (``python -m dpprof profile``), recording into
    ``reports_dir`` under ``name``; returns the run id, chosen before the start.

    Raises:
        LaunchError: the process failed; the message is its command and last lines.
        subprocess.TimeoutExpired: it ran past ``timeout_s`` (and was killed).
    """
    profile = replace(profile, reports_dir=os.fspath(reports_dir), name=name, run_id=None).with_run_id()
    return profile.run_child(timeout_s=timeout_s, env=env)


def measured(run_id: str, reports_dir: str | os.PathLike[str]) -> tuple[float | None, dict[str, int]]:
    """A checked run's median step and each device's (rank's) peak held bytes."""
    run = load_run(run_id, reports_dir)
    peaks = queries.memory_peaks(run, detail=False)
    held = {str(r["device"]): int(r["peak_held_bytes"]) for _, r in peaks.iterrows() if r["peak_held_bytes"] == r["peak_held_bytes"]}
    return queries.median_step_ms(run), held


def check_profile(profile: Profile) -> Profile:
    """The profile --check runs for a scenario: its command's, at most CHECK_MAX_STEPS steps."""
    return profile if profile.steps <= CHECK_MAX_STEPS else replace(profile, steps=CHECK_MAX_STEPS)


def check(advice: Advice, reports_dir: str | os.PathLike[str], scenarios: Sequence[Scenario] | None = None,
          progress: Callable[[Scenario, Profile | None], None] | None = None, env: dict[str, str] | None = None
          ) -> list[Checked]:
    """Run each scenario (default: every one of ``advice``) for real, one after another; what each measured.

    Each runs its command's profile with at most CHECK_MAX_STEPS steps (check_profile), the profile ``progress``
    is told before it starts. A scenario without a command (a run recorded from a script) or whose command fails is
    kept with its error. Every run recorded carries ``check_of``: the id of ``advice``'s run
    (dpprof.records.CHECK_OF_ENV).
    """
    out = []
    env = {**(env or {}), CHECK_OF_ENV: advice.run_id}  # each run recorded is marked as a check of this one
    Path(reports_dir).mkdir(parents=True, exist_ok=True)
    for scenario in scenarios if scenarios is not None else advice.scenarios:
        profile = None if scenario.profile is None else check_profile(scenario.profile)
        if progress is not None:
            progress(scenario, profile)
        if profile is None:
            out.append(Checked(scenario, None, None, {}, f"no command: {scenario.no_command}"))
            continue
        name = f"check of {advice.run_id}: {scenario.label}"
        try:
            run_id = run_scenario(profile, reports_dir, name, env)
            step, held = measured(run_id, reports_dir)
            out.append(Checked(scenario, run_id, step, held, steps=profile.steps))
        except (LaunchError, subprocess.TimeoutExpired, ValueError) as err:
            out.append(Checked(scenario, None, None, {}, failed_reason(err), steps=profile.steps))
    return out


def failed_reason(err: Exception) -> str:
    """Why one check run failed, in a line: for a child that exited with an error, its exit status and its own
    last error line (``dpprof profile: error: ...``, ``dpprof: ...``), else its last line of output."""
    if isinstance(err, subprocess.TimeoutExpired):
        return f"ran past {err.timeout:g} s and was stopped"
    if isinstance(err, LaunchError):
        said = [line.strip() for line in err.lines if line.strip()]
        own = [line for line in said if _OWN_ERROR_LINE.match(line)]
        last = (own or said or [type(err).__name__])[-1]
        return f"exited with {err.returncode}: {last}"
    return str(err).splitlines()[0] if str(err) else type(err).__name__

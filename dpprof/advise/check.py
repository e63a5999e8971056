"""``dpprof advise RUN --check``: run each scenario's command on this machine and set what it measured beside the
prediction. Torch-free itself: each scenario runs as ``python -m dpprof profile ...`` in its own process (its
runs go into the reports directory, named after the run they check and marked as its checks: ``check_of`` in their
workload_args, dpprof.records.CHECK_OF_ENV), and is read back as any run is."""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from dpprof.advise.model import Advice, Scenario
from dpprof.records import CHECK_OF_ENV
from dpprof.store import queries
from dpprof.store.reader import load_run

__all__ = ["Checked", "check", "run_scenario", "CHECK_TIMEOUT_S"]

CHECK_TIMEOUT_S = 900  # one scenario's run; a DDP run starts torchrun and its ranks
_RECORDED = re.compile(r"recorded run (\S+) ")
_ENV = re.compile(r"^([A-Z_][A-Z0-9_]*)=(\S*)$")


@dataclass
class Checked:
    """One scenario predicted and run for real."""

    scenario: Scenario
    run_id: str | None
    measured_step_ms: float | None
    measured_peak_bytes: dict[str, int]
    error: str | None = None  # why the scenario could not be run

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
                "peak_errors": self.peak_errors(), "check_error": self.error}


def _argv(command: str) -> tuple[dict[str, str], list[str]]:
    """A scenario's command as environment assignments and the arguments after ``dpprof``."""
    words = shlex.split(command)
    env = {}
    while words and _ENV.match(words[0]):
        key, value = _ENV.match(words[0]).groups()
        env[key] = value
        words = words[1:]
    if not words or words[0] != "dpprof":
        raise ValueError(f"not a dpprof command: {command}")
    return env, words[1:]


def run_scenario(command: str, reports_dir: str | os.PathLike[str], name: str,
                 env: dict[str, str] | None = None, timeout_s: float = CHECK_TIMEOUT_S) -> str:
    """Run one scenario's ``dpprof profile`` command in its own process, recording into ``reports_dir``; returns
    the run id.

    Raises:
        RuntimeError: the command failed; the message is its last lines.
    """
    extra, argv = _argv(command)
    cmd = [sys.executable, "-m", "dpprof", "--reports-dir", str(reports_dir), *argv, "--quiet", "--name", name]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, cwd=os.getcwd(),
                          env={**os.environ, **(env or {}), **extra})
    found = _RECORDED.search(done.stdout)
    if done.returncode != 0 or not found:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-5:])
        raise RuntimeError(f"{command} exited with {done.returncode}: {tail}")
    return found.group(1)


def measured(run_id: str, reports_dir: str | os.PathLike[str]) -> tuple[float | None, dict[str, int]]:
    """A checked run's median step and each device's (rank's) peak held bytes."""
    run = load_run(run_id, reports_dir)
    peaks = queries.memory_peaks(run, detail=False)
    held = {str(r["device"]): int(r["peak_held_bytes"]) for _, r in peaks.iterrows() if r["peak_held_bytes"] == r["peak_held_bytes"]}
    return queries.median_step_ms(run), held


def check(advice: Advice, reports_dir: str | os.PathLike[str], scenarios: Sequence[Scenario] | None = None,
          progress: Callable[[Scenario], None] | None = None, env: dict[str, str] | None = None) -> list[Checked]:
    """Run each scenario (default: every one of ``advice``) for real, one after another; what each measured.

    A scenario without a command (a run recorded from a script) or whose command fails is kept with its error.
    Every run recorded carries ``check_of``: the id of ``advice``'s run (dpprof.records.CHECK_OF_ENV).
    """
    out = []
    env = {**(env or {}), CHECK_OF_ENV: advice.run_id}  # each run recorded is marked as a check of this one
    Path(reports_dir).mkdir(parents=True, exist_ok=True)
    for scenario in scenarios if scenarios is not None else advice.scenarios:
        if progress is not None:
            progress(scenario)
        if scenario.command is None:
            out.append(Checked(scenario, None, None, {}, "no command: the run was recorded from a script"))
            continue
        name = f"check of {advice.run_id}: {scenario.label}"
        try:
            run_id = run_scenario(scenario.command, reports_dir, name, env)
            step, held = measured(run_id, reports_dir)
            out.append(Checked(scenario, run_id, step, held))
        except (RuntimeError, subprocess.TimeoutExpired, ValueError) as err:
            out.append(Checked(scenario, None, None, {}, str(err).splitlines()[0] if str(err) else type(err).__name__))
    return out

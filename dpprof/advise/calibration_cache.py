"""This machine's measured costs, as the advisor's model reads them: cached per host and device set, never
measured here (dpprof.advise.calibrate measures; this module only reads and writes the cache, without torch).

The cache lives in ``$XDG_CACHE_HOME/dpprof/advise/`` (default ``~/.cache/dpprof/advise/``), one JSON file per
host, backend, device count and intra-op thread count: ``vm-cpu2-t2.json``.
"""
from __future__ import annotations

import json
import math
import os
import socket
from collections.abc import Callable
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

__all__ = ["Calibration", "cache_dir", "cache_path", "cached_calibration", "load_calibration", "measured_torch", "save_calibration", "write_cache_file",
           "device_set_key",
           "CALIBRATION_VERSION", "LOADED_THREAD_SPEEDUP"]

CALIBRATION_VERSION = 3  # bumped when what is measured changes: an older file is measured again
# A calibration whose conv ran at under half its one-thread speed on its T intra-op threads was measured on a
# loaded machine: on cores of their own, more threads never make a conv's forward + backward slower than one
# thread by that much (they speed it up, towards T x). It happens when OpenMP's threads wait at their barriers for
# a sibling another job has descheduled: 0.13-0.42 on this 2-core machine while two other test runs held it, 0.19
# in the calibration behind issue 35, whose predictions were 4x off once the machine was quiet. Every predicted
# figure that moves with threads (each worker's share of them, the caller's backward) carries that factor.
LOADED_THREAD_SPEEDUP = 0.5


@dataclass(frozen=True)
class Calibration:
    """What a short calibration measured on one host for one device set (medians of repeated timings)."""

    host: str
    backend: str  # "cpu": CPU workers and gloo ranks
    devices: int  # the device set's size: n CPU workers, n gloo ranks
    threads: int  # torch's intra-op threads in the calibrating process (OMP_NUM_THREADS)
    cores: int  # os.cpu_count() of the host
    measured_at: str  # ISO time
    torch_version: str
    handoff_ms: dict[int, float]  # k -> a no-op task handed to each of k CPU workers and back (0 for k = 1)
    copy_ms_per_mib: float  # cloning a tensor on the calling thread (replicate's copies, gather's cat)
    op_ms: float  # one small tensor op from Python (dispatch and the op's fixed cost)
    allreduce_latency_ms: float  # gloo all-reduce across ``devices`` ranks on this host: ms = latency + MiB x per_mib
    allreduce_ms_per_mib: float
    allreduce_points: list[tuple[int, float]]  # (bytes, median ms) the fit is made from
    ddp_sync_ms: float  # a real DDP run's wait at the end of backward for one small bucket (ranks meeting, not the wire)
    ddp_overhead_ms: float  # what that run's steps held beyond their forward, backward and optimizer
    thread_speedup: float | None  # a conv's forward + backward on ``threads`` threads against one; None at 1 thread
    # k -> phase -> median ms per step of a tiny model (no compute to speak of) recorded on k CPU workers: what
    # DataParallel's own machinery costs at each k (scatter, replicate, dispatch = parallel_apply beyond the
    # slowest apply, gather, loss, backward), and the balanced pair's (criterion_scatter, criterion_replicate,
    # criterion_dispatch, reduce, backward)
    dataparallel_ms: dict[int, dict[str, float]] = field(default_factory=dict)
    # the cores this process got when measured: k single-threaded workers' work at once over one's alone (the
    # host's cores when idle; fewer where other jobs hold them), and when
    effective_cores: float | None = None
    cores_measured_at: str | None = None
    balanced_ms: dict[int, dict[str, float]] = field(default_factory=dict)
    spread: dict[str, float] = field(default_factory=dict)  # measurement -> relative spread (IQR / median)
    version: int = CALIBRATION_VERSION

    def machinery(self, balanced: bool, k: int, phase: str) -> float:
        """DataParallel's own cost of ``phase`` on k workers (dataparallel_ms or balanced_ms), extrapolated
        linearly in k beyond what was measured; 0 where not measured."""
        table = self.balanced_ms if balanced else self.dataparallel_ms
        if not table:
            return 0.0
        if k in table:
            return table[k].get(phase, 0.0)
        top = max(table)
        below = table.get(top - 1, table[top])
        return max(0.0, table[top].get(phase, 0.0) + (table[top].get(phase, 0.0) - below.get(phase, 0.0)) * (k - top))

    def loaded_reason(self) -> str | None:
        """Why this calibration's own figures say the machine was loaded while it measured (LOADED_THREAD_SPEEDUP),
        in a sentence; None where they do not."""
        if self.thread_speedup is None or self.thread_speedup >= LOADED_THREAD_SPEEDUP:
            return None
        return (f"this machine was loaded while it was calibrated ({self.measured_at}): a conv ran "
                f"{self.thread_speedup:.2f}x as fast on {self.threads} threads as on one (on cores of its own, at "
                f"least {LOADED_THREAD_SPEEDUP:g}x; under that, the threads waited on each other while other jobs "
                "held the cores), so every figure that moves with threads would be off by that factor")

    def handoff(self, k: int) -> float:
        """The hand-off to k workers: measured for k up to twice the device count, extrapolated linearly beyond."""
        if k <= 1:
            return 0.0
        if k in self.handoff_ms:
            return self.handoff_ms[k]
        top = max(self.handoff_ms)
        per = (self.handoff_ms[top] - self.handoff_ms.get(2, self.handoff_ms[top])) / max(1, top - 2)
        return self.handoff_ms[top] + per * (k - top)

    def allreduce_ms(self, nbytes: float) -> float:
        return self.allreduce_latency_ms + self.allreduce_ms_per_mib * nbytes / 2**20

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        for name in ("handoff_ms", "dataparallel_ms", "balanced_ms"):
            out[name] = {str(k): v for k, v in getattr(self, name).items()}
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Calibration:
        known = {f.name for f in fields(cls)}
        data = {k: v for k, v in data.items() if k in known}
        data["handoff_ms"] = {int(k): float(v) for k, v in data["handoff_ms"].items()}
        for name in ("dataparallel_ms", "balanced_ms"):
            data[name] = {int(k): {p: float(ms) for p, ms in v.items()} for k, v in data.get(name, {}).items()}
        data["allreduce_points"] = [(int(b), float(ms)) for b, ms in data.get("allreduce_points", [])]
        return cls(**data)

    def lines(self) -> list[str]:
        """What was measured, in words (``dpprof advise --calibrate`` prints these)."""
        hand = ", ".join(f"{k} workers {ms * 1e3:.0f} us" for k, ms in sorted(self.handoff_ms.items()) if k > 1)
        points = ", ".join(f"{b / 1024:,.0f} KiB {ms:.3f} ms" for b, ms in self.allreduce_points)
        out = [f"calibration of {self.host}, {self.backend} x{self.devices}, {self.threads} intra-op thread(s), "
               f"{self.cores} cores, torch {self.torch_version}, measured {self.measured_at}",
               f"  hand-off of a no-op task to k CPU workers and back: {hand}",
               f"  copy on the calling thread: {self.copy_ms_per_mib:.3f} ms per MiB; one small tensor op: "
               f"{self.op_ms * 1e3:.1f} us",
               f"  gloo all-reduce across {self.devices} ranks: {points} -> {self.allreduce_latency_ms:.3f} ms + "
               f"{self.allreduce_ms_per_mib:.3f} ms per MiB",
               f"  a real DDP run of a model with no compute (dpprof profile tutorial-linear --ddp): each step waits "
               f"{self.ddp_sync_ms:.3f} ms for its one small all-reduce, and holds {self.ddp_overhead_ms:.3f} ms beyond "
               "its phases"]
        for title, table in (("DataParallel", self.dataparallel_ms), ("balanced", self.balanced_ms)):
            for k, parts in sorted(table.items()):
                shown = ", ".join(f"{p} {ms:.3f}" for p, ms in parts.items())
                out.append(f"  {title}'s own costs on {k} worker(s), a model with no compute (ms): {shown}")
        if self.thread_speedup is not None:
            out.append(f"  a conv's forward + backward on {self.threads} threads: {self.thread_speedup:.2f}x one thread")
        if self.effective_cores is not None:
            out.append(f"  cores this job gets: {self.effective_cores:.2f} of {self.cores} (one single-threaded worker "
                       f"per core at once against one alone), measured {self.cores_measured_at}")
        if self.loaded_reason() is not None:
            out.append(f"  rejected: {self.loaded_reason()}")
        noisy = [f"{k} {v:.0%}" for k, v in self.spread.items() if v > 0.25]
        if noisy:
            out.append(f"  noisy (interquartile range over median above 25%): {', '.join(noisy)}")
        return out


def device_set_key(backend: str, devices: int, threads: int, host: str | None = None) -> str:
    """The cache key of one device set on one host: ``vm-cpu2-t2``."""
    host = host or socket.gethostname()
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in host)
    return f"{safe}-{backend}{devices}-t{threads}"


def cache_dir() -> Path:
    """``$XDG_CACHE_HOME/dpprof/advise``, default ``~/.cache/dpprof/advise``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "dpprof" / "advise"


def cache_path(backend: str, devices: int, threads: int, host: str | None = None) -> Path:
    return cache_dir() / f"{device_set_key(backend, devices, threads, host)}.json"


def cached_calibration(backend: str, devices: int, threads: int,
                       host: str | None = None) -> tuple[Calibration | None, str | None]:
    """The cached calibration of this device set on ``host`` (default: this host), or None and why the cached file
    was not used, in a few words (None where there is no file: nothing to say)."""
    path = cache_path(backend, devices, threads, host)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None, None
    except (OSError, ValueError) as err:
        return None, f"it cannot be read ({type(err).__name__}: {err})"
    why = _not_a_calibration(data)
    host = host or socket.gethostname()
    if why is None and data["host"] != host:  # a file copied from another machine under this one's name
        why = f"it is of host {data['host']!r}, not {host!r}"
    if why is None and (data["backend"], data["devices"], data["threads"]) != (backend, devices, threads):
        why = (f"it is of {data['backend']} x{data['devices']} at {data['threads']} thread(s), not {backend} "
               f"x{devices} at {threads}")
    installed = installed_torch()
    if why is None and installed is not None and data["torch_version"] != installed:
        why = f"it was measured with torch {data['torch_version']}, and torch {installed} is installed now"
    if why is not None:
        return None, why
    return Calibration.from_json(data), None


def installed_torch() -> str | None:
    """The installed torch's version, read from its package metadata (torch is not imported); None where it cannot
    be read."""
    from importlib import metadata

    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None


def measured_torch() -> str:
    """The torch version a calibration or a model's measure records: the installed package's, as the reader compares
    it (installed_torch), else torch's own. The two can differ: a build's ``torch.__version__`` may carry a local tag
    that its package metadata lacks (2.11.0+cu130 against 2.11.0), and a file written with one and read against the
    other would be refused as another torch's every time."""
    installed = installed_torch()
    if installed is not None:
        return installed
    import torch

    return str(torch.__version__)


def load_calibration(backend: str, devices: int, threads: int, host: str | None = None) -> Calibration | None:
    """The cached calibration of this device set on ``host`` (default: this host), or None (none, unreadable,
    older, damaged: cached_calibration says why)."""
    return cached_calibration(backend, devices, threads, host)[0]


def save_calibration(calibration: Calibration) -> Path:
    """Write the calibration to its cache file (whole, through a temporary name); returns the path.

    Raises:
        OSError: the cache cannot be written (its directory is a file, the file a directory, no permission).
    """
    return write_cache_file(cache_path(calibration.backend, calibration.devices, calibration.threads,
                                       calibration.host), calibration.to_json())


def write_cache_file(path: Path, value: dict[str, Any]) -> Path:
    """``value`` as JSON at ``path`` in the cache, whole, through a temporary name (a reader never sees half).

    Raises:
        OSError: the cache cannot be written.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(value, indent=1))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


# -- what a cache file must hold ------------------------------------------------------------------------------


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _text(value: Any) -> str | None:
    return None if isinstance(value, str) else "is not text"


def _count(value: Any) -> str | None:
    """A device, thread or core count: a whole number, at least 1."""
    return None if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else \
        f"is {value!r}, not a whole number of at least 1"


def _ms(value: Any) -> str | None:
    """A duration (or a rate): a finite number, not below 0."""
    return None if _number(value) and value >= 0 else f"is {value!r}, not a finite number of at least 0"


def _ratio_or_none(value: Any) -> str | None:
    """A speed-up or a core count measured: a finite number above 0, or null where not measured."""
    return None if value is None or (_number(value) and value > 0) else f"is {value!r}, not a finite number above 0"


def _text_or_none(value: Any) -> str | None:
    return None if value is None or isinstance(value, str) else "is not text"


def _by_k(value: Any, check: Callable[[Any], str | None]) -> str | None:
    """A table keyed by a worker count ("1", "2", ...) whose every value passes ``check``."""
    if not isinstance(value, dict):
        return "is not a table"
    for k, v in value.items():
        if not (str(k).isascii() and str(k).isdigit()) or int(k) < 1:  # "²" is a digit int() does not read
            return f"has a key {k!r} that is no worker count"
        why = check(v)
        if why is not None:
            return f"[{k}] {why}"
    return None


def _phases(value: Any) -> str | None:
    """phase -> ms."""
    if not isinstance(value, dict):
        return "is not a table"
    return next((f"[{p!r}] {why}" for p, ms in value.items() if (why := _ms(ms)) is not None), None)


def _points(value: Any) -> str | None:
    """(bytes, ms) pairs."""
    if not isinstance(value, list) or not all(isinstance(p, list) and len(p) == 2 for p in value):
        return "is not a list of (bytes, ms) pairs"
    return next((f"holds {p!r}" for p in value if _ms(p[0]) is not None or _ms(p[1]) is not None), None)


_FIELD_CHECKS: dict[str, Callable[[Any], str | None]] = {
    "host": _text, "backend": _text, "devices": _count, "threads": _count, "cores": _count, "measured_at": _text,
    "torch_version": _text, "handoff_ms": lambda v: _by_k(v, _ms), "copy_ms_per_mib": _ms, "op_ms": _ms,
    "allreduce_latency_ms": _ms, "allreduce_ms_per_mib": _ms, "allreduce_points": _points, "ddp_sync_ms": _ms,
    "ddp_overhead_ms": _ms, "thread_speedup": _ratio_or_none, "dataparallel_ms": lambda v: _by_k(v, _phases),
    "effective_cores": _ratio_or_none, "cores_measured_at": _text_or_none, "balanced_ms": lambda v: _by_k(v, _phases),
    "spread": _phases, "version": lambda v: None,
}


def _not_a_calibration(data: Any) -> str | None:
    """Why a cache file's JSON is no calibration of this version, in a few words (a field missing, of the wrong
    type, not finite or out of range); None where it is one."""
    if not isinstance(data, dict):
        return f"it holds a JSON {type(data).__name__}, not an object"
    if data.get("version") != CALIBRATION_VERSION:
        return f"it is of version {data.get('version')!r}, not {CALIBRATION_VERSION} (what is measured has changed)"
    for f in fields(Calibration):
        if f.name not in data:
            if f.default is MISSING and f.default_factory is MISSING:
                return f"{f.name} is missing"
            continue
        why = _FIELD_CHECKS[f.name](data[f.name])
        if why is not None:
            return f"{f.name} {why}"
    return None

"""The machine's load around a benchmark: said before and after, and a ratio refused when other processes took
the processor while it ran.

Ratios between interleaved arms survive a steady load but not one that comes and goes, and a single number hides
which it was. Each benchmark that prints a ratio wraps its measured part in ``Conditions``:

- before: the load average and the processes already busy (the CPU they took in the last half second);
- during: how many cores the whole machine kept busy (``/proc/stat``), how many this benchmark's own process tree
  did, and how many the rest took: every other process's CPU time over the run (the processes alive at both ends),
  or what the machine kept busy beyond this benchmark, whichever is more (the latter also holds processes that
  started or ended while it ran);
- ``refusal()``: a sentence when the other processes took more than ``max_other_cores`` on average while it ran
  (the load average before is said, not judged: it still counts a job that just ended). The benchmark then prints its figures with that
  sentence in place of its ratios, unless run with ``--allow-load`` (the sentence is printed either way).

Linux only (``/proc``); elsewhere the conditions say they were not measured and nothing is refused.
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from types import TracebackType

__all__ = ["Conditions", "process_cpu_s", "process_tree"]

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _proc_stat(pid: str) -> tuple[int, float] | None:
    """(parent pid, CPU seconds so far) of one process, from /proc/<pid>/stat; None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()  # after the command name, which may hold spaces
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / _TICK


def process_cpu_s() -> dict[int, tuple[int, float]]:
    """Every process's (parent pid, CPU seconds so far)."""
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            found = _proc_stat(entry)
            if found is not None:
                out[int(entry)] = found
    return out


def _tree(processes: dict[int, tuple[int, float]], root: int) -> set[int]:
    """``root`` and every process below it."""
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in processes.items():
        children.setdefault(ppid, []).append(pid)
    tree, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid not in tree:
            tree.add(pid)
            todo.extend(children.get(pid, ()))
    return tree


def process_tree(root: int) -> set[int]:
    """``root`` and every process below it now (Linux's /proc)."""
    return _tree(process_cpu_s(), root)


def _busy_jiffies() -> tuple[int, int]:
    """(busy, total) jiffies of all cores since boot, from /proc/stat's first line."""
    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle and iowait
    total = sum(values[:8])  # guest time is counted in user already
    return total - idle, total


class Conditions:
    """``with Conditions(root=pid) as c: ...`` around a benchmark's measured part; then ``c.line()`` and
    ``c.refusal()``.

    Args:
        root: the process whose tree is the benchmark's own (default: this process).
        max_other_cores: the most cores other processes may take on average while it runs.
    """

    def __init__(self, root: int | None = None, max_other_cores: float = 0.25) -> None:
        self.root = os.getpid() if root is None else root
        self.cores = os.cpu_count() or 1
        self.max_other_cores = max_other_cores
        self.supported = Path("/proc/stat").exists()
        self.load_before: float | None = None
        self.busy_before: list[str] = []
        self.machine_cores: float | None = None
        self.own_cores: float | None = None
        self.other_cores: float | None = None
        self.load_after: float | None = None

    def __enter__(self) -> Conditions:
        if not self.supported:
            return self
        self.load_before = os.getloadavg()[0]
        first = process_cpu_s()
        time.sleep(0.5)
        self._start = process_cpu_s()
        own = _tree(self._start, self.root)
        busy = sorted(((cpu - first[pid][1], pid) for pid, (_, cpu) in self._start.items()
                       if pid in first and pid not in own), reverse=True)
        self.busy_before = [f"pid {pid} {share / 0.5:.2f} cores" for share, pid in busy[:3] if share / 0.5 >= 0.05]
        self._jiffies = _busy_jiffies()
        self._times = os.times()
        self._t0 = time.monotonic()
        return self

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None,
                 tb: TracebackType | None) -> None:
        if not self.supported:
            return
        wall = max(time.monotonic() - self._t0, 1e-9)
        busy0, total0 = self._jiffies
        busy1, total1 = _busy_jiffies()
        self.machine_cores = self.cores * (busy1 - busy0) / max(total1 - total0, 1)
        end = process_cpu_s()
        own = _tree(end, self.root) | _tree(self._start, self.root)
        own_cpu = sum(end[p][1] - self._start[p][1] for p in own if p in end and p in self._start)
        if self.root == os.getpid():  # children that ended while it ran: their CPU, once waited for, is this one's
            t0, t1 = self._times, os.times()
            own_cpu += (t1.children_user - t0.children_user) + (t1.children_system - t0.children_system)
        self.own_cores = own_cpu / wall
        alive = sum(end[p][1] - cpu for p, (_, cpu) in self._start.items() if p in end and p not in own) / wall
        # what the machine kept busy beyond this benchmark: it also holds the processes that started or ended while it
        # ran, which the processes alive at both ends miss (a run of other benchmarks took 0.75 of a core unseen)
        self.other_cores = max(alive, self.machine_cores - self.own_cores)
        self.load_after = os.getloadavg()[0]

    def line(self) -> str:
        """The conditions in one line."""
        if not self.supported:
            return "machine load: not measured (no /proc)"
        before = f"load average {self.load_before:.2f} before"
        if self.busy_before:
            before += f" (busy then: {', '.join(self.busy_before)})"
        if self.other_cores is None:
            return f"machine load: {before}"
        return (f"machine load: {before}; during the run the machine kept {self.machine_cores:.2f} of {self.cores} "
                f"cores busy, this benchmark {self.own_cores:.2f}, other processes {self.other_cores:.2f}; "
                f"load average {self.load_after:.2f} after")

    def refusal(self) -> str | None:
        """Why the run's ratios are not to be reported, or None."""
        if not self.supported or self.other_cores is None:
            return None
        if self.other_cores > self.max_other_cores:
            return (f"not reported: other processes took {self.other_cores:.2f} cores on average during the run (at "
                    f"most {self.max_other_cores:.2f} expected); rerun on a quiet machine, or pass --allow-load")
        return None

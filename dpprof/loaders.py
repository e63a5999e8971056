"""What a run's DataLoaders were set to: whether they load in worker processes, and how (the data_loading finding's
advice follows it, never advising what the job already does).

A recorded run notes each DataLoader the recording process iterates (``DataLoader.__iter__``, once an epoch) into
its workload_args' ``data_loaders``: ``num_workers``, ``persistent_workers``, ``pin_memory``, ``prefetch_factor``.
A run recorded since the watch says so from its start (``data_loaders: []``), so ``[]`` read back is "watched, none
iterated" (the script built its batches itself), and no ``data_loaders`` at all is "not said" (a file written
before, an imported trace without DataLoader ranges).
An imported trace says only which iterator ran (torch.profiler names the range
``enumerate(DataLoader)#_MultiProcessingDataLoaderIter.__next__`` or ``..._SingleProcessDataLoaderIter...``): workers
or none, not how many. Importing this module loads no torch (the read side uses it).
"""
from __future__ import annotations

import functools
import threading
from collections.abc import Iterable
from typing import Any, Callable

__all__ = ["MAX_LOADERS", "WORKERS_ITER", "NO_WORKERS_ITER", "describe", "of_iterators", "stored", "said_in",
           "none_iterated", "exported_loaders", "install_watch"]

MAX_LOADERS = 4  # distinct settings kept a process: a training, a validation and a test loader, and one more
WORKERS_ITER = "_MultiProcessingDataLoaderIter"  # torch.utils.data.dataloader's iterator with num_workers > 0
NO_WORKERS_ITER = "_SingleProcessDataLoaderIter"  # and with num_workers=0

_installed: list[Callable[..., Any]] = []
_lock = threading.Lock()


def describe(loader: Any) -> dict[str, Any]:
    """One DataLoader's settings that decide how it loads (what ``data_loaders`` holds for a recorded run)."""
    workers = int(getattr(loader, "num_workers", 0) or 0)
    prefetch = getattr(loader, "prefetch_factor", None)
    return {"workers": workers > 0, "num_workers": workers,
            "persistent_workers": bool(getattr(loader, "persistent_workers", False)),
            "pin_memory": bool(getattr(loader, "pin_memory", False)),
            "prefetch_factor": int(prefetch) if workers > 0 and isinstance(prefetch, int) else None}


def of_iterators(names: Iterable[str]) -> list[dict[str, Any]]:
    """What a trace's ``enumerate(DataLoader)#...`` ranges say of its loaders: workers or none (not how many)."""
    seen = {WORKERS_ITER in n for n in names if WORKERS_ITER in n or NO_WORKERS_ITER in n}
    return [{"workers": w} for w in sorted(seen, reverse=True)]


def stored(value: Any) -> list[dict[str, Any]]:
    """The ``data_loaders`` of a run file's workload_args, as far as they are readable (a damaged or hand-edited
    file's are left out, never raised on): each a dict with a bool ``workers``."""
    if not isinstance(value, list):
        return []
    return [d for d in value[:MAX_LOADERS] if isinstance(d, dict) and isinstance(d.get("workers"), bool)]


def said_in(args: Any) -> list[dict[str, Any]] | None:
    """The DataLoaders a run file's workload_args say (``stored``): [] where the recorder watched and none was
    iterated, None where the file does not say (no ``data_loaders``: written before the watch, or a trace)."""
    if not isinstance(args, dict) or not isinstance(args.get("data_loaders"), list):
        return None
    return stored(args["data_loaders"])


def none_iterated(by_rank: dict[int, list[dict[str, Any]]], ranks: Iterable[int] | None = None) -> bool:
    """Whether the run's files say that no DataLoader was iterated in the processes of ``ranks`` (default: every rank
    in ``by_rank``, at least one): each watched and noted none (a rank that does not say is no such rank)."""
    chosen = list(by_rank) if ranks is None else [int(r) for r in ranks]
    return bool(chosen) and all(r in by_rank and not by_rank[r] for r in chosen)


def exported_loaders(info: Any, rank: int | None) -> list[dict[str, Any]] | None:
    """The DataLoaders a file dpprof export wrote says of ``rank`` (its export info's ``data_loaders``, rank ->
    settings), or of every rank in it where the file has none (a one-file run's): each once; [] where the run it
    was written from watched and none was iterated, None where it does not say."""
    by_rank = info.get("data_loaders") if isinstance(info, dict) else None
    if not isinstance(by_rank, dict):
        return None
    chosen = [by_rank.get(str(rank))] if rank is not None else list(by_rank.values())
    if not any(isinstance(found, list) for found in chosen):
        return None
    out: list[dict[str, Any]] = []
    for found in chosen:
        out += [d for d in stored(found) if d not in out]
    return out[:MAX_LOADERS]


def install_watch(note: Callable[[Any], None]) -> None:
    """Call ``note(loader)`` each time a DataLoader is iterated (``DataLoader.__iter__``), from now on in this
    process; installed once (the first caller's ``note``), as torch's optimizer hooks are global."""
    with _lock:
        if _installed:
            return
        from torch.utils.data import DataLoader

        original = DataLoader.__iter__

        @functools.wraps(original)
        def __iter__(self: Any) -> Any:
            try:
                note(self)
            except Exception:  # noting must never break the script's loop
                pass
            return original(self)

        DataLoader.__iter__ = __iter__  # type: ignore[method-assign]
        _installed.append(original)

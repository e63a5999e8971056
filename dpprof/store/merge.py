"""Gather the rank files of distributed runs, written on several machines, into one reports directory."""
from __future__ import annotations

import filecmp
import secrets
import shutil
from collections.abc import Iterable
from pathlib import Path

from dpprof.store.faults import cause_of
from dpprof.store.publish import Stage, recover
from dpprof.store.files import RANK_FILE
from dpprof.store.reader import RUN_SUFFIX, RunFileError, read_run_file, why_not_regular

__all__ = ["merge_rank_files"]


def _rank_files(sources: Iterable[str | Path]) -> list[Path]:
    files = []
    for source in map(Path, sources):
        if source.is_dir():
            files += sorted(p for p in source.iterdir() if RANK_FILE.match(p.name))
        elif source.is_file():
            if not RANK_FILE.match(source.name):
                raise RunFileError(f"{source}: not a rank file (<run id>.rank<N>{RUN_SUFFIX})")
            files.append(source)
        else:  # say what is there: a FIFO, a device, a dangling symlink, or nothing
            raise RunFileError(f"{source}: {why_not_regular(source) or 'no such file or directory'}")
    return files


def merge_rank_files(sources: Iterable[str | Path], out_dir: str | Path) -> dict[str, list[int]]:
    """Copy every rank file found in ``sources`` into ``out_dir`` so each run reads as one.

    Files are checked before anything is copied: each must be a readable dpprof rank file, and a
    (run, rank) found twice must be the same file. Nothing in ``out_dir`` is ever overwritten
    (an identical file already there is left as it is). The copies are made in a staging directory and
    published together (dpprof.store.publish).

    Returns:
        run id -> the ranks now in ``out_dir``.

    Raises:
        RunFileError: a source is missing, unreadable, or conflicts with another (nothing copied); or ``out_dir``
            cannot take the copies (a full disk: nothing of them is left).
    """
    out = Path(out_dir)
    chosen: dict[tuple[str, int], Path] = {}
    for path in _rank_files(sources):
        try:
            meta, _ = read_run_file(path)
        except RunFileError as err:
            raise RunFileError(f"{path}: {err}") from None
        key = (meta["id"], int(meta["rank"]))
        if key in chosen and not filecmp.cmp(chosen[key], path, shallow=False):
            raise RunFileError(f"run {key[0]} rank {key[1]} is in both {chosen[key]} and {path}, and they differ")
        chosen.setdefault(key, path)
        target = out / path.name
        if target.exists() and target.resolve() != path.resolve() and not filecmp.cmp(target, path, shallow=False):
            raise RunFileError(f"{target} already exists and differs from {path}; nothing was copied")
    if not chosen:
        raise RunFileError("no rank files found in the sources")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:  # a file where the directory goes, no permission: one line, nothing copied
        why = "an existing file, not a directory" if out.is_file() else err.strerror or err
        raise RunFileError(f"--out {out}: {why}; nothing was copied") from None
    recover(out)  # what an import or merge killed here left: published whole, or removed
    merged: dict[str, list[int]] = {}
    # copied into a staging directory, then published together (dpprof.store.publish): a kill mid-copy leaves no
    # half file, and one mid-publish a run listed as incomplete until the next command publishes the rest
    try:
        with Stage(out, f".merge-{secrets.token_hex(6)}") as stage:
            copies = []
            for (run_id, rank), path in sorted(chosen.items()):
                if not (out / path.name).exists():
                    shutil.copyfile(path, stage.path / path.name)
                    copies.append(stage.path / path.name)
                merged.setdefault(run_id, []).append(rank)
            stage.publish(copies)
    except OSError as err:  # a full disk, say: one line, and nothing of the merge is left
        raise RunFileError(f"cannot write {out}: {cause_of(err, out)}; nothing was merged") from None
    return merged

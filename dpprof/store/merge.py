"""Gather the rank files of distributed runs, written on several machines, into one reports directory."""
from __future__ import annotations

import filecmp
import secrets
import shutil
import sqlite3
import tempfile
from collections.abc import Iterable
from pathlib import Path

from dpprof.store.faults import cause_of, symlink_loop
from dpprof.store.publish import Stage, recover
from dpprof.store.files import RANK_FILE, fold_log, remove_files
from dpprof.store.reader import RUN_SUFFIX, RunFileError, integrity_problem, read_run_file, why_not_regular
from dpprof.store.status import effective_status

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


# What the rank files of one run agree on (rank 0's values are every rank's): files of one id that differ here are
# of two runs (a reused --run-id), never one
_SAME_RUN = ("world_size", "name", "workload")


def _check(path: Path, meta: dict) -> None:
    """RunFileError, in one line, for a rank file merge must not copy: named for another run or rank than it holds,
    still being recorded, or damaged inside (SQLite's quick_check)."""
    named = RANK_FILE.match(path.name)
    assert named is not None  # _rank_files takes rank files only
    if (named.group(1), int(named.group(2))) != (meta["id"], int(meta["rank"])):
        raise RunFileError(f"{path}: named as run {named.group(1)} rank {named.group(2)}, but it holds run "
                           f"{meta['id']} rank {meta['rank']}; nothing was copied")
    if effective_status(meta, path) == "running":
        raise RunFileError(f"{path}: run {meta['id']} rank {meta['rank']} is still being recorded: merge it once it "
                           "has ended; nothing was copied")
    found = integrity_problem(path)
    if found is not None:
        raise RunFileError(f"{path}: damaged inside ({found}); nothing was copied")


def _whole(path: Path, into: Path) -> Path:
    """The rank file as one file: ``path`` itself, or, where its write-ahead log beside it holds steps not yet in it
    (a rank killed while recording), a copy in the new directory ``into`` with the log folded in (the source is left as
    it is)."""
    wal = Path(f"{path}-wal")
    if not wal.is_file() or wal.stat().st_size == 0:
        return path
    into.mkdir()
    copy = into / path.name
    shutil.copyfile(path, copy)
    shutil.copyfile(wal, f"{copy}-wal")
    try:
        fold_log(copy)
    except sqlite3.Error as err:
        raise RunFileError(f"{path}: its write-ahead log cannot be folded into a copy ({err}); nothing was "
                           "copied") from None
    remove_files(f"{copy}-wal", f"{copy}-shm")
    return copy


def merge_rank_files(sources: Iterable[str | Path], out_dir: str | Path) -> dict[str, list[int]]:
    """Copy every rank file found in ``sources`` into ``out_dir`` so each run reads as one.

    Files are checked before anything is copied: each must be a readable dpprof rank file, named for the run and
    rank it holds, no longer being recorded and sound inside; a (run, rank) found twice must be the same file; the
    ranks of one run must agree on its world size, name and workload. A rank killed while recording has its
    write-ahead log folded into its copy (its last committed steps). Nothing in ``out_dir`` is ever overwritten
    (an identical file already there is left as it is). The copies are made in a staging directory and published
    together (dpprof.store.publish).

    Returns:
        run id -> the ranks now in ``out_dir``.

    Raises:
        RunFileError: a source is missing, unreadable, damaged, still recording, or conflicts with another (nothing
            copied); or ``out_dir`` cannot take the copies (a full disk: nothing of them is left).
    """
    out = Path(out_dir)
    with tempfile.TemporaryDirectory(prefix="dpprof-merge-") as folded:
        return _merge(sources, out, Path(folded))


def _merge(sources: Iterable[str | Path], out: Path, folded: Path) -> dict[str, list[int]]:
    chosen: dict[tuple[str, int], Path] = {}
    runs: dict[str, tuple[Path, dict]] = {}
    for i, path in enumerate(_rank_files(sources)):
        try:
            meta, _ = read_run_file(path)
        except RunFileError as err:
            raise RunFileError(f"{path}: {err}") from None
        _check(path, meta)
        first = runs.setdefault(meta["id"], (path, meta))
        differ = [k for k in _SAME_RUN if meta.get(k) != first[1].get(k)]
        if differ:
            raise RunFileError(f"{first[0]} and {path} are two runs of one id ({meta['id']}): their "
                               f"{', '.join(differ)} differ; nothing was copied")
        key = (meta["id"], int(meta["rank"]))
        whole = _whole(path, folded / str(i))  # a directory per file: two copies of one rank never meet
        if key in chosen and not filecmp.cmp(chosen[key], whole, shallow=False):
            raise RunFileError(f"run {key[0]} rank {key[1]} is in both {chosen[key]} and {path}, and they differ")
        chosen.setdefault(key, whole)
        target = out / path.name
        if target.exists() and target.resolve() != path.resolve() and not filecmp.cmp(target, whole, shallow=False):
            raise RunFileError(f"{target} already exists and differs from {path}; nothing was copied")
    if not chosen:
        raise RunFileError("no rank files found in the sources")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:  # a file where the directory goes, no permission: one line, nothing copied
        loop = symlink_loop(out)
        why = ("an existing file, not a directory" if out.is_file() else f"{loop}, not a directory" if loop
               else cause_of(err, out))
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

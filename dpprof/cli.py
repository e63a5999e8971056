"""The dpprof command: profile, run, check, merge, import, runs, show, ops, kernels, memory, advise, export.

Exit codes: 0 ok, 1 failure (or findings, for commands that report them), 2 usage error.
"""
from __future__ import annotations

import argparse
import math
import os
import re
import sys
import textwrap
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import pandas as pd

from dpprof.advise.commands import CHECK_MAX_STEPS
from dpprof.launch import (DEFAULT_WORKLOAD, LaunchError, Profile, ProfileError, parse_devices,
                           parse_input_shape)
from dpprof.units import plural, steps_words
from dpprof.workload_names import WORKLOAD_NAMES

if TYPE_CHECKING:
    from pathlib import Path

    from dpprof.advise.calibration_cache import Calibration
    from dpprof.advise.compute import ComputeProbe
    from dpprof.advise.measured import Measured
    from dpprof.advise.predict import Scenario

__all__ = ["main", "parse_devices"]

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2


class UsageError(Exception):
    """Bad arguments: reported with exit code 2."""


def _input_shape(text: str) -> list[int]:
    """--input-shape: positive sizes separated by commas (or x): 3,224,224 or 3x224x224."""
    try:
        return list(parse_input_shape(text))
    except ProfileError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least 1")
    return value


def _positive_seconds(text: str) -> float:
    """A time in seconds: a finite number over 0 (``capture --timeout``)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds over 0")
    return value


def _step_index(text: str) -> int:
    """A step index: a whole number from 0 (``--capture A``, a capture's first step)."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a step (a whole number from 0)")
    return value


# --memory-gib: one device's memory. Past a pebibyte no device exists, and 2**30 times the number stays finite.
MAX_MEMORY_GIB = 2.0**20


def _memory_gib(text: str) -> float:
    """--memory-gib: a positive, finite number of GiB up to MAX_MEMORY_GIB (nan, inf, 1e308, 0 and -1 refused)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of GiB") from None
    if not math.isfinite(value) or not 0 < value <= MAX_MEMORY_GIB:
        raise argparse.ArgumentTypeError(f"{text!r} is not a memory size: give a positive number of GiB up to "
                                         f"{MAX_MEMORY_GIB:,.0f} (1 PiB)")
    return value


def _terminal(value: object) -> object:
    """Text a terminal shows as written: control and format characters (ESC, BEL, U+202E...) as their escapes, not
    obeyed; anything else as it is."""
    if not isinstance(value, str):
        return value
    import unicodedata

    return "".join(repr(ch)[1:-1] if unicodedata.category(ch)[0] == "C" else ch for ch in value)


# The most characters a text cell takes in a printed table. A C++ kernel's name runs to 2,000 (its template arguments
# and whole signature: an fbgemm embedding kernel of a shared trace, 1,700) and pandas pads its column to the longest,
# so every row of `dpprof kernels` was as wide; torch.profiler's own table cuts names at 55. --json and
# `dpprof export` keep them whole.
CELL_CHARS = 60
ELLIPSIS = "..."  # ASCII: a log or a C-locale terminal shows it as written


def _cell(value: object, width: int = CELL_CHARS, middle: tuple[int, int] | None = None) -> object:
    """Text over ``width`` characters as its start and end around "...", ``width`` in all (the start the longer: a
    kernel's name and template, an operator's namespace; the end: its last arguments, a shape's last dimensions);
    ``middle`` (from, to): characters kept between them too, each gap shown as "..." (_shortened)."""
    if not isinstance(value, str) or len(value) <= width:
        return value
    tail = (width - len(ELLIPSIS)) // 3
    kept = sorted([(0, width - len(ELLIPSIS) - tail), *([middle] if middle else []), (len(value) - tail, len(value))])
    pieces, at = [], 0
    for lo, hi in kept:
        if lo > at:
            pieces.append(ELLIPSIS)
        pieces.append(value[max(lo, at):hi])
        at = max(at, hi)
    return "".join(pieces)


# Where two texts would read the same shortened, the characters of each kept from just before where they differ:
# enough to show how (a template's first argument, a shape's dimension), short beside CELL_CHARS.
DIFFER_CHARS = 12
DIFFER_BEFORE = 4


def _shortened(values: Iterable[object]) -> list[object]:
    """Each of ``values`` as _cell shortens it, except that texts that would read the same (the start and end of two
    fbgemm kernels' 1,500-character names, which differ at their 72nd character) also keep the few characters where
    they differ, between the start and the end: no two different texts read alike."""
    values = list(values)
    middles: dict[str, tuple[int, int] | None] = {v: None for v in values if isinstance(v, str)}
    while True:
        cells = {v: _cell(v, middle=middle) for v, middle in middles.items()}
        shown: dict[object, list[str]] = {}
        for v, cell in cells.items():
            shown.setdefault(cell, []).append(v)
        alike = [group for group in shown.values() if len(group) > 1]
        if not alike:
            return [cells[v] if isinstance(v, str) else v for v in values]
        for group in alike:
            differ = len(os.path.commonprefix(group))
            for v in group:  # a later difference each time, in texts that share more than the others of their group
                lo, hi = middles[v] or (max(differ - DIFFER_BEFORE, 0), 0)
                middles[v] = (min(lo, max(differ - DIFFER_BEFORE, 0)), max(hi + 1, differ + DIFFER_CHARS))


def _too_long(values: Iterable[object]) -> bool:
    """Whether any of ``values`` is text over CELL_CHARS characters."""
    return any(isinstance(v, str) and len(v) > CELL_CHARS for v in values)


def _escaped(values: Iterable[object]) -> bool:
    """Whether any of ``values`` is text with a character _terminal escapes."""
    return any(isinstance(v, str) and _terminal(v) != v for v in values)


def _table(df: pd.DataFrame, float_format: str = "{:.3f}", whole: str = "--json and dpprof export give it whole") -> str:
    """``df`` as a terminal table: text cells with their control characters escaped (_terminal: an operator's or a
    kernel's name is a trace's), those over CELL_CHARS characters shortened, a line under the table saying so and where
    ``whole`` text is to be read."""
    if df.empty:
        return "(none)"
    texts = [c for c in df.columns if not pd.api.types.is_numeric_dtype(df[c].dtype)]
    if any(_escaped(df[c]) for c in texts) or (not pd.api.types.is_numeric_dtype(df.index.dtype)
                                               and _escaped(df.index)):
        df = df.copy()
        for c in texts:
            df[c] = df[c].map(_terminal)
        if not pd.api.types.is_numeric_dtype(df.index.dtype):
            df.index = df.index.map(_terminal)
    long = [c for c in texts if _too_long(df[c])]
    index_long = not pd.api.types.is_numeric_dtype(df.index.dtype) and _too_long(df.index)
    if long or index_long:
        df = df.copy()
        for c in long:
            df[c] = _shortened(df[c])
        if index_long:
            df.index = pd.Index(_shortened(df.index), name=df.index.name)
    text = df.to_string(float_format=float_format.format, na_rep="-")
    return text + (f"\n(text over {CELL_CHARS} characters is shortened to its start and end; {whole})"
                   if long or index_long else "")


def _cmd_profile(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from dpprof.outputs import OutputError
    from dpprof.store.faults import RecordingError
    from dpprof.store.reader import RunFileError

    profile = Profile.from_args(args).with_run_id()
    # a bar on a terminal only: into a log (nohup, a job scheduler) it would be ten lines a second, a day-long
    # run's tens of MB, as import and advise --calibrate do
    quiet = args.quiet or not sys.stderr.isatty()
    if profile.distributed:
        return _profile_ddp(profile, quiet)
    progress = lambda it: tqdm(it, total=profile.steps,  # noqa: E731
                               desc=f"{profile.workload_name} on {profile.devices_text}", unit="step",
                               disable=quiet)
    try:
        run = profile.record(progress)
    except (ProfileError, UsageError, RecordingError, RunFileError, OutputError):
        raise  # main says these in their own line
    except Exception as err:  # noqa: BLE001 - the workload failed while training (out of memory, the model's own
        # error): one line, as any failure; its run is kept, failed, with the steps before it (dpprof.record)
        from dpprof.plaintext import error_line

        say(f"the workload failed while training: {error_line(err)}")
        print(f"  dpprof show {profile.run_id}", file=sys.stderr)
        return EXIT_FAILURE
    if run.recording_failed:  # training finished; the one line on stderr said what was not recorded
        if os.path.exists(run.path):
            print(f"  dpprof show {run.id}")
        return EXIT_FAILURE
    print(f"recorded run {run.id} ({plural(profile.steps, 'step')}) in {os.path.abspath(run.path)}")
    print(f"  dpprof show {run.id}")
    # a deep capture asked for and not stored (its line on stderr says why): the run is kept, the command failed
    return EXIT_FAILURE if any(w.error is not None for w in run.capture.captured) else EXIT_OK


def _profile_ddp(profile: Profile, quiet: bool) -> int:
    """Run the profile under torchrun, one process per rank, with rank 0's steps as the progress bar."""
    from tqdm import tqdm

    bar = tqdm(total=profile.steps, desc=f"{profile.workload_name} on {profile.nproc} ranks", unit="step",
               disable=quiet)
    try:
        run_id = profile.run_ddp(on_step=lambda: bar.update(1))
    except LaunchError as err:
        bar.close()
        print("\n".join(err.lines), file=sys.stderr)
        say(f"{err}; the ranks' records so far are kept")
        return EXIT_FAILURE
    bar.close()
    print(f"recorded run {run_id} ({profile.steps} steps on {profile.nproc} ranks)")
    if profile.capture is None:
        return EXIT_OK
    from dpprof.capture.session import NOT_STORED
    from dpprof.store.reader import load_run

    notes = load_run(run_id, profile.reports_dir).notes
    missed = notes[(notes["source"] == "capture") & notes["message"].str.contains(NOT_STORED, regex=False)]
    for rank, message in zip(missed["rank"], missed["message"]):  # each rank's line (its own stderr went unread)
        say(f"rank {rank}: {message}")
    # a deep capture asked for and not stored on some rank: the run is kept, the command failed
    return EXIT_FAILURE if len(missed) else EXIT_OK


def _cmd_run(args: argparse.Namespace) -> int:
    """Run a script (or -m module) as python would, with torch's DataParallel, DDP and FSDP2 recording."""
    import os
    import runpy

    from dpprof.device_ids import MAX_CPU_WORKERS, MAX_DEVICE_INDEX
    from dpprof.instrument import instrumented
    from dpprof.store.reader import reports_dir

    if args.target[:1] == ["--"]:  # the end of dpprof's options, as python and torchrun take it: not the script
        args.target = args.target[1:]
    if not args.target:
        raise UsageError("run needs a script (dpprof run train.py ARGS...) or a module (dpprof run -m MODULE ARGS...)")
    for flag, value in (("--cpu-workers", args.cpu_workers), ("--steps", args.steps)):
        if value is not None and value < 1:
            raise UsageError(f"{flag} must be positive, got {value}")
    if args.cpu_workers is not None and args.cpu_workers > MAX_CPU_WORKERS:  # as profile's --devices cpu:N
        raise UsageError(f"--cpu-workers {args.cpu_workers:,}: at most {MAX_CPU_WORKERS} CPU workers exist (cpu:0 to "
                         f"cpu:{MAX_DEVICE_INDEX}: torch numbers a device 0 to {MAX_DEVICE_INDEX})")
    if args.no_record:  # what only a recorded run has: refused, never dropped without a word
        dropped = [flag for flag, given in (("--name", args.name is not None), ("--capture", args.capture is not None),
                                            ("--detail all", args.detail == "all")) if given]
        if dropped:
            raise UsageError(f"--no-record records nothing, so {' and '.join(dropped)} would do nothing: leave "
                             f"{'them' if len(dropped) > 1 else 'it'} out, or record without --no-record")
    capture = _capture_window(args.capture, args.steps)
    target, script_args = args.target[0], args.target[1:]
    saved_argv, saved_path0 = sys.argv, sys.path[0]
    if args.module:
        import importlib.util

        sys.path[0] = os.getcwd()  # as python -m does, before looking the module up there
        try:
            found = importlib.util.find_spec(target) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            sys.path[0] = saved_path0
            raise UsageError(f"-m {target}: no module named {target!r}")
    else:
        if not os.path.exists(target):
            raise UsageError(f"{target}: no such file")
        if os.path.isdir(target) and not os.path.isfile(os.path.join(target, "__main__.py")):
            raise UsageError(f"{target}: a directory with no __main__.py (python runs a directory's __main__.py)")
        try:  # before anything is recorded: a script that does not compile leaves no run behind
            code = _script_code(target)
        except (SyntaxError, ValueError) as err:  # ValueError: a null byte in the source
            sys.excepthook(type(err), err.with_traceback(None), None)  # as python prints it: none of dpprof's frames
            return EXIT_FAILURE
        if os.path.isfile(target) and not target.endswith(".zip"):  # a directory or zip: runpy puts it first
            sys.path[0] = os.path.dirname(os.path.abspath(target))  # as python script.py does
    shown = (f"-m {target}" if args.module else os.path.basename(target))
    name = args.name or " ".join([shown, *script_args])
    sys.argv = [target, *script_args]
    run_args = {"command": "dpprof run", "argv": [shown, *script_args], "cpu_workers": args.cpu_workers,
                "steps": args.steps}
    # the reports directory made absolute before the script runs: a script that changes directory records
    # into the same place, and the line on stderr names it whole
    record_args = None if args.no_record else dict(name=name, reports_dir=reports_dir(args.reports_dir).absolute(),
                                                   workload=shown, workload_args=run_args, detail=args.detail,
                                                   capture=capture)
    session = None
    try:
        with instrumented(record_args, args.cpu_workers, args.steps, yields=True) as session:
            session.on_hard_exit = lambda: _tell_recorded(session)
            if args.module:
                runpy.run_module(target, run_name="__main__", alter_sys=True)
            else:
                _run_path(target, code)
    except SystemExit:
        _tell_recorded(session)
        raise  # the script's exit code
    except BaseException as err:  # noqa: BLE001 - printed as python prints an uncaught exception
        _tell_recorded(session)
        err = err.with_traceback(_script_frames(err.__traceback__))
        sys.excepthook(type(err), err, err.__traceback__)
        return 130 if isinstance(err, KeyboardInterrupt) else EXIT_FAILURE
    finally:
        sys.argv, sys.path[0] = saved_argv, saved_path0
    _tell_recorded(session)
    return EXIT_OK


def _capture_window(text: str | None, steps: int | None):
    """--capture A:B of ``dpprof run``, checked before the script starts (a UsageError in one line)."""
    from dpprof.capture import CaptureError, parse_capture

    try:
        window = parse_capture(text)
    except CaptureError as err:
        raise UsageError(f"--capture {text}: {err.reason}") from None
    if window is not None and steps is not None and window.end_step > steps:
        raise UsageError(f"--capture {text}: --steps {steps} records steps 0 to {steps - 1}; the window must end "
                         f"by {steps}")
    return window


def _cmd_capture(args: argparse.Namespace) -> int:
    """Ask a running run to capture its next N steps with torch.profiler, and wait until they are stored."""
    from dpprof.capture import MAX_CAPTURE_STEPS, CaptureError
    from dpprof.capture.request import ask, wait_for_answer
    from dpprof.store.reader import load_run

    if args.steps > MAX_CAPTURE_STEPS:  # a usage error before the run is looked for, as --steps 0 is
        raise UsageError(f"--steps {args.steps}: at most {MAX_CAPTURE_STEPS:,} steps in one capture (a longer trace "
                         "opens in no viewer)")
    run = load_run(args.run, args.reports_dir)
    try:
        asked = ask(run, args.steps)
        if not args.quiet:
            print(f"asked run {run.id} to capture its next {plural(args.steps, 'step')}; waiting for them",
                  file=sys.stderr, flush=True)
        answer = wait_for_answer(asked, args.timeout)
    except CaptureError as err:
        say(str(err))
        return EXIT_FAILURE
    if answer.error is not None:
        say(f"run {run.id}: {answer.error}")
        return EXIT_FAILURE
    traces = [os.path.join(asked.directory, t) for t in (answer.traces or [answer.trace]) if t]
    got = (answer.end_step or 0) - (answer.first_step or 0)
    short = "" if got >= args.steps else f" ({got} of the {plural(args.steps, 'step')} asked: the run stopped stepping)"
    print(f"captured {steps_words(answer.first_step, answer.end_step or 0)} of run {run.id}{short}: operators in the "
          f"run, raw trace{'s' if len(traces) > 1 else ''} {', '.join(traces) or None}")
    return EXIT_OK


def _script_code(target: str):
    """The script's code object (a compiled .pyc as python runs one), or None for a directory or zip, which
    runpy.run_path compiles. Raises SyntaxError (or ValueError) as python would on a script that does not compile."""
    import io
    from pkgutil import read_code

    if not os.path.isfile(target) or target.endswith(".zip"):
        return None
    filename = os.path.abspath(target)
    with io.open_code(filename) as f:
        code = read_code(f)
    if code is None:
        with io.open_code(filename) as f:
            code = compile(f.read(), filename, "exec", dont_inherit=True)
    return code


def _run_path(target: str, code) -> None:
    """Run a script as python 3.9+ does: in a fresh __main__, __file__ absolute, sys.argv[0] as given
    (runpy.run_path sets both to the path it is handed). A directory or zip (``code`` None) goes to runpy.run_path."""
    import runpy
    import types

    if code is None:  # a directory or zip with a __main__.py
        runpy.run_path(target, run_name="__main__")
        return
    filename = os.path.abspath(target)
    module = types.ModuleType("__main__")
    module.__dict__.update(__file__=filename, __cached__=None, __loader__=None, __package__=None, __spec__=None)
    saved = sys.modules.get("__main__")
    sys.modules["__main__"] = module  # what the script pickles as __main__ resolves to its own module
    try:
        exec(code, module.__dict__)
    finally:
        sys.modules["__main__"] = saved


def _script_frames(tb):
    """The traceback from the script's first frame on (dpprof's and runpy's own frames left out)."""
    import os
    import runpy

    ours = {os.path.abspath(__file__), os.path.abspath(runpy.__file__), "<frozen runpy>"}
    while tb is not None and tb.tb_next is not None and tb.tb_frame.f_code.co_filename in ours:
        tb = tb.tb_next
    return tb


def _tell_recorded(session) -> None:
    """One line on stderr (the script's stdout is left as it is) saying where the run went."""
    run = session.run if session is not None else None
    if run is None or run.path is None or run.rank not in (None, 0):
        return
    print(f"dpprof: recorded run {run.id} ({plural(run.steps_started, 'step')}) in {run.path}; dpprof show {run.id}",
          file=sys.stderr, flush=True)


def _cmd_merge(args: argparse.Namespace) -> int:
    from dpprof.store.merge import merge_rank_files
    from dpprof.store.reader import reports_dir

    out = args.out or reports_dir(args.reports_dir)
    for run_id, ranks in merge_rank_files(args.sources, out).items():
        print(f"run {run_id}: ranks {', '.join(map(str, ranks))} in {out}")
    return EXIT_OK


def _cmd_import(args: argparse.Namespace) -> int:
    """Import torch.profiler traces as one run, with a progress bar of bytes read per file on a terminal."""
    from tqdm import tqdm

    from dpprof.trace import TraceError, import_traces, trace_files

    bars: dict[object, tqdm] = {}
    quiet = args.quiet or not sys.stderr.isatty()

    def read(path: object, nbytes: int) -> None:
        bar = bars.get(path)
        if bar is None:  # made at the file's first bytes: the files read at once have a bar each
            bar = bars[path] = tqdm(total=path.stat().st_size, unit="B", unit_scale=True, unit_divisor=1024,
                                    desc=path.name, position=len(bars), leave=True)
        bar.update(nbytes)

    try:
        trace_files(args.sources)  # a missing file is said before any bar
        try:
            run = import_traces(args.sources, args.reports_dir, name=args.name, again=args.again, jobs=args.jobs,
                                file_progress=None if quiet else read)
        finally:
            for bar in bars.values():
                bar.close()
    except TraceError as err:
        say(str(err))
        return EXIT_FAILURE
    print(f"imported run {run.id} ({plural(run.steps, 'step')}, {', '.join(run.devices)}) in "
          f"{', '.join(str(p) for p in run.paths)}")
    for note in run.notes:  # events left out, repeated or overlapping steps (dpprof.trace.numbers)
        print(f"  note: {note}")
    print(f"  dpprof show {run.id}")
    return EXIT_OK


def _cmd_runs(args: argparse.Namespace) -> int:
    from dpprof.store.reader import checks_under_their_runs, list_runs, reports_dir, reports_dir_problem

    problem = reports_dir_problem(args.reports_dir)
    if problem is not None:  # a file given for the directory: not "no runs yet"
        say(str(problem))
        return EXIT_FAILURE
    runs = list_runs(args.reports_dir)
    if runs.empty:
        where = reports_dir(args.reports_dir)
        # a directory that is not there yet is said by its path: a mistyped --reports-dir is seen at once
        print(f"no runs yet{'' if where.is_dir() else f' ({where} does not exist)'}: record one with "
              "`dpprof profile cifar-lenet --devices cpu:2`")
        return EXIT_OK
    readable = checks_under_their_runs(runs[runs["reason"].isna()])
    cols = ["id", "name", "status", "workload", "backend", "devices", "steps", "duration_s", "created_at"]
    shown = readable[cols].copy()
    # the runs dpprof advise --check recorded, under the run they check
    shown["id"] = [f"└ {i}" if pd.notna(of) else i for i, of in zip(readable["id"], readable["check_of"])]
    # names are the users' (and a file's): _table escapes them, shown, never obeyed
    print(_table(shown.set_index("id"), "{:.1f}", whole="dpprof show RUN gives a run's name whole"))
    for _, short in readable[(readable["status"] == "incomplete") & readable["error"].notna()].iterrows():
        print(_terminal(f"incomplete: {short['id']}: {short['error']}"))
    for _, copy in readable[readable["copy_of"].notna()].iterrows():
        print(_terminal(f"copy: {copy['id']} is a copy of run {copy['copy_of']} ({copy['path']})"))
    for _, damaged in readable[readable["damage"].notna()].iterrows():
        print(_terminal(f"damaged: {damaged['id']}: {damaged['damage']}"))
    for _, bad in runs[runs["reason"].notna()].iterrows():  # "unreadable", "interrupted import" (a staging directory)
        print(_terminal(f"{bad['status']}: {bad['path']}: {bad['reason']}"))
    return EXIT_OK


def _cmd_show(args: argparse.Namespace) -> int:
    """A run's summary in its kind's terms: per device, per phase, the kind's own table, findings, what it lacks."""
    from dpprof.findings import run_findings
    from dpprof.report import summary_columns, summary_of
    from dpprof.store import queries
    from dpprof.store.reader import load_run
    from dpprof.views import job_of
    from dpprof.views.fsdp import fsdp_collective_table
    from dpprof.views.overview import comm_stats
    from dpprof.views.text import batch_words, display_table, dropped_records, status_sentence, steps_per_rank

    run = load_run(args.run, args.reports_dir)
    m, model = run.meta, run.model
    said = status_sentence(m["status"], m.get("error"))
    error = f" ({m['error']})" if m.get("error") and said is None else ""  # else the sentence below says it
    print(f"run {m['id']}  {m['name']!r}  status {m['status']}{error}")
    if said is not None:
        print(said[0])
        if said[1]:
            print(textwrap.indent(said[1].rstrip("\n"), "  "))
    from dpprof.trace.importer import LEGACY_WORKLOAD

    shown = m.get("workload") if not (model.imported and m.get("workload") == LEGACY_WORKLOAD) else None
    facts = [model.title, f"workload {shown}" if shown else None,
             f"{model.unit}s {', '.join(model.devices)}" if model.devices else None, job_of(run),
             f"torch {m['torch_version']}" if m.get("torch_version") else None,
             f"host {m['host']}" if m.get("host") else None]
    print("  " + "  ".join(f for f in facts if f))
    if dropped := dropped_records(m):
        print(f"  warning: {dropped}")
    if m.get("copy_of"):
        print(f"  a copy of run {m['copy_of']} (file {run.path.name})")
    for damage in run.damage:  # values that were no usable figures, left out (dpprof.store.validation)
        print(f"  damaged: {damage}")
    if model.kind == "empty":
        print(f"  no steps recorded: {model.empty_reason}")
        _print_notes(run, skip={model.empty_reason})
        return EXIT_OK
    stats = queries.run_stats(run)
    ranks = steps_per_rank(stats, run.ranks)
    kinds = queries.kind_medians(run)  # an evaluation-heavy run's median is an evaluation step's: each kind's too
    of_kinds = f" (training steps {kinds['training']:.2f} ms, evaluation steps {kinds['evaluation']:.2f} ms)" \
        if kinds else ""
    print(f"  {plural(stats['steps'], 'step')}{ranks}, median {stats['median_step_ms']:.2f} ms{of_kinds}, "
          f"batch {batch_words(stats, run.ranks)}")
    rate = queries.throughput(run)  # the Overview's samples/s
    if rate is not None:
        print(f"  {rate.samples_per_s:,.0f} samples/s: {rate.words()}")
    raised = queries.raised_steps(run)
    # a failed run's last step whose forward raised: the error the script died of, not one it went on from
    died = int(bool(raised) and m["status"] == "failed" and queries.raised_last_step(run))
    if raised - died:  # the script caught its forward's error and went on: these trained nothing, evaluated nothing
        whose = "'s" if raised - died == 1 else "'"  # "1 step's", "3 steps'"
        print(f"  {plural(raised - died, 'step')}{whose} forward raised, the script going on (an out-of-memory batch "
              "skipped): neither training nor evaluation steps, their samples not in samples/s")
    if died:
        print("  its last step's forward raised the error the run failed with: a step of neither kind, its samples not "
              "in samples/s")
    if model.detail_text():
        print(f"  {model.detail_text()}")
    if model.nothing_to_balance:
        print(f"  {model.nothing_to_balance}")
    summary = summary_of(run)
    columns = summary_columns(run, summary)
    if columns:  # units in the headers: `dpprof export` keeps machine values
        print(f"\nper {model.unit} ({model.work.label}):")
        print(_table(display_table(summary[columns].reset_index()).set_index("device"), "{:,.2f}"))
        if stats["steps"] > 1 and any(c.endswith("_p50_ms") for c in columns):
            print("  (mean and share over every step, the first's one-time costs included; p50 and p95 over the steps past the "
                  "first, as the findings)")
    else:  # no figure per device: why, once, in words (never a table of nothing)
        print(f"\nper {model.unit}: {model.missing.get('work') or 'no figures per ' + model.unit + ' recorded.'}")
    means = queries.phase_means(run)
    if len(means):
        print("\nmean ms per step (every step, the first's one-time costs included, as the Overview's shares), by phase:"
              if stats["steps"] > 1 else "\nms in the step, by phase:")
        print(_table(display_table(means.reset_index()).set_index("device"), "{:,.2f}"))
        overlaps = queries.phase_overlaps(run, means)
        if len(overlaps):  # the table's phases add up to more than the step; the Overview's shares to the step
            said = "; ".join(f"{r.phase.replace('_', ' ')} on {r.device} {r.mean_ms:,.2f} ms, {r.part_ms:,.2f} ms of it "
                             "outside the others" for r in overlaps.itertuples())
            print(f"  (phases overlap in the steps, so they add up to more than the step: {said}; the Overview's "
                  "shares count each moment once)")
    if "comms" in model.has and model.fsdp_phases:
        print("\nFSDP collectives per step past the first, as the findings weigh them (issued: launch to "
              "completion; exposed: the rank waited for it):")
        print(_table(display_table(fsdp_collective_table(run).drop(columns="rank")).set_index("device"), "{:,.2f}"))
    elif "comms" in model.has and (model.kind == "ddp" or model.imported):
        print("\ncollectives per step past the first (from the trace):" if model.named_collectives
              else "\ngradient all-reduce per step past the first:")
        print(_table(display_table(comm_stats(run)).set_index("device"), "{:,.2f}"))
    if "gpu_time" in model.has:
        print("\nGPU time, mean ms per step (from the trace):")
        print(_table(display_table(queries.gpu_time(run)).set_index("device"), "{:,.2f}"))
    found = run_findings(run)
    print(f"\nfindings: {len(found.table) or 'none'} ({found.scope})")
    _print_findings(found.table.to_dict("records"))
    lacks = [text for key, text in model.missing.items() if key != "work"]  # work: said where its table would be
    if lacks:
        print("\nnot in this run:")
        for text in lacks:
            print(f"  {text}")
    _print_notes(run, skip=set(lacks))  # a note "not in this run" already quotes is not said again
    return EXIT_OK


def _print_notes(run, skip: set | None = None) -> None:
    """The notes the recorder left (why some data is missing), each once."""
    for message in dict.fromkeys(run.notes["message"]):
        if not skip or not any(s and message.rstrip(".") in s for s in skip):
            print(f"note: {message}")


def _print_findings(findings: list[dict]) -> None:
    from dpprof.views.text import finding_heading

    for f in findings:
        print(f"  {finding_heading(f['severity'], f.get('device'), f['title'])}")
        print(f"    evidence: {f['evidence']}")
        print(f"    advice:   {f['advice']}")


def _cmd_check(args: argparse.Namespace) -> int:
    import json
    from dataclasses import asdict

    import dpprof

    device_ids = None
    if args.device_ids:  # "0,1" are GPU indices, as torch takes them; "cuda:0" and "cpu:0" are names
        device_ids = [int(d) if d.isdigit() else d for d in (p.strip() for p in args.device_ids.split(","))]
        if len(device_ids) == 1 and re.fullmatch(r"cpu:[1-9]\d*", str(device_ids[0])):
            # `profile --devices cpu:3` means three workers; here cpu:3 would be the one worker named cpu:3 (cpu:0
            # alone is one worker either way)
            n = int(str(device_ids[0])[4:])
            listed = ",".join(f"cpu:{i}" for i in range(n))
            raise UsageError(f"--device-ids {device_ids[0]} is ambiguous: name every worker, e.g. --device-ids "
                             f"{listed} for {plural(n, 'worker')} (as `dpprof profile --devices cpu:{n}` means)")
    try:
        findings = dpprof.check_balance(device_ids, args.batch_size)
    except (ValueError, TypeError) as err:
        raise UsageError(str(err)) from None
    args.status = EXIT_FAILURE if findings else EXIT_OK  # kept when a reader closes the pipe early (main)
    if args.json:
        print(json.dumps([asdict(f) for f in findings], indent=2))
        return EXIT_FAILURE if findings else EXIT_OK
    for line in _checked_devices(device_ids):
        print(line)
    if findings:
        print(f"{len(findings)} finding(s):")
        _print_findings([asdict(f) for f in findings])
    else:
        print("no findings: these devices look balanced")
    return EXIT_FAILURE if findings else EXIT_OK


def _checked_devices(device_ids: list | None) -> list[str]:
    """One line per device `dpprof check` looked at (none when there is no GPU to default to)."""
    import torch

    from dpprof.device_ids import resolve_devices
    from dpprof.devices import inventory

    if device_ids is None:
        if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
            return []
        device_ids = list(range(torch.cuda.device_count()))
    records = inventory(resolve_devices(device_ids))
    if records[0].kind == "cpu":
        r = records[0]
        return [f"checked {plural(len(records), 'CPU worker')}, {', '.join(x.device for x in records)}, on "
                f"{r.cpu_model or 'a CPU'}"
                f" ({r.cores} cores, {r.threads} threads)"]
    return [f"checked {r.device}: {r.name}, {r.total_memory_bytes / 2**30:.1f} GiB, {r.multiprocessor_count} SMs, "
            f"compute capability {r.capability}" for r in records]


def _cmd_export(args: argparse.Namespace) -> int:
    from dpprof.outputs import Outputs
    from dpprof.store.reader import load_run
    from dpprof.views.export import export_run

    if (args.steps is not None or args.one_file) and args.trace is None:
        raise UsageError("--steps and --one-file choose what --trace FILE writes: give --trace")
    if args.trace is not None and not args.trace.lower().endswith((".json", ".json.gz")):
        raise UsageError(f"--trace {args.trace}: the name must end in .json or .json.gz (gzip'd)")
    from dpprof.trace.export import parse_steps

    try:
        steps = parse_steps(args.steps)
    except ValueError as err:
        raise UsageError(str(err)) from None
    run = load_run(args.run, args.reports_dir)
    # the CSV files and the trace file(s) whole, or nothing at all (an OutputError: one line, exit 1)
    with Outputs() as files:
        csvs = export_run(run, args.out or f"{run.id}-csv", files) if args.trace is None or args.out else []
        traces, note = (_export_trace(run, args.trace, steps, args.one_file, args.steps, files) if args.trace
                        else ([], None))
    for path in [*csvs, *traces]:
        print(path)
    if note:
        say(str(note))
    return EXIT_OK


def _export_trace(run: object, path: str, steps: tuple[int | None, int | None] | None, one_file: bool,
                  args_steps: str | None, files: object) -> tuple[list[object], str | None]:
    """--trace: the trace file(s) into ``files``: their paths, and the line for stderr when the file holds less than
    every step (a thinned run's steps held in full, a range cut to fit a viewer) or more than a viewer opens."""
    from dpprof.trace.export import MAX_EVENTS, export_trace, plan_trace

    plan = plan_trace(run, steps)
    if steps is not None and not len(plan.steps):  # a run with no step at all still gets its devices and samples
        held = f"steps {plan.held_ranges}" if plan.held_ranges else "no step"
        raise UsageError(f"--steps {args_steps} picks no step run {run.id} holds in full (it holds {held}); "
                         "nothing written")
    plan, written = export_trace(run, path, steps, one_file=one_file, plan=plan, files=files)
    events = max(w.events for w in written)
    note = None
    if plan.cut or plan.thinned or not len(plan.steps):
        note = f"the trace holds {plan.why()}"
    elif plan.over:
        note = (f"--steps {args_steps} made {events:,} events{' in a file' if len(written) > 1 else ''}, more than "
                f"chrome://tracing opens ({MAX_EVENTS:,}); the Perfetto UI (ui.perfetto.dev) opens more")
    left_out = "; ".join(dict.fromkeys(w.left_out for w in written if w.left_out))  # the file's dpprofLeftOut
    if left_out:
        note = f"{note}; the trace: {left_out}" if note else f"the trace: {left_out}"
    return [w.path for w in written], note


def _batch_sizes(text: str) -> list[int]:
    """--batch-sizes: positive global batch sizes separated by commas."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of positive batch sizes like 128,512")
    return [int(p) for p in parts]


DEVICE_NAME = re.compile(r"(cpu|cuda|mps|xpu|rank|host)(:\d+)?")  # what --vs names as a device, not a run

# The fields of each command's --json, as issue #33 gives them (dpprof.store.detail_rows has every column).
OPS_JSON = ["rank", "device", "name", "calls", "host_total_ms", "host_self_ms", "device_total_ms", "device_self_ms"]
KERNELS_JSON = ["rank", "device", "name", "calls", "total_ms", "mean_blocks_per_sm", "mean_occupancy_pct",
                "tensor_cores"]
GPU_JSON = ["rank", "device", "utilization_pct", "sm_efficiency_pct", "achieved_occupancy_pct"]
MEMORY_JSON = ["rank", "device", "peak_allocated_bytes", "peak_reserved_bytes", "peak_step"]


def _records(df: pd.DataFrame, columns: list[str]) -> list[dict[str, object]]:
    """Rows as JSON objects: NaN and NA as null, numpy numbers as Python's."""
    out = []
    for row in df[columns].itertuples(index=False, name=None):
        out.append({c: (None if v is None or v is pd.NA or (isinstance(v, float) and math.isnan(v))
                        else v.item() if hasattr(v, "item") else v) for c, v in zip(columns, row)})
    return out


def _detail_run(args: argparse.Namespace) -> object:
    """The run of ops / kernels / memory, or None after saying on stderr why it has no operator data."""
    from dpprof.store.detail_rows import captures, chosen_capture, detail_devices, detail_missing
    from dpprof.store.reader import load_run

    run = load_run(args.run, args.reports_dir)
    why = detail_missing(run)
    if why is not None:
        say(f"run {run.id}: {why}")
        return None
    ranked = re.fullmatch(r"rank:(\d+)", args.device or "")
    if ranked and args.device not in set(run.operators()["device"]):
        # --device rank:N names a rank, whatever its device is called in its tables (cpu:0, cuda:0); an imported
        # trace's tables may call their devices rank:N themselves
        if args.rank is not None and args.rank != int(ranked.group(1)):
            say(f"--device {args.device} and --rank {args.rank} name two ranks")
            return None
        args.rank, args.device = int(ranked.group(1)), None
    held = run.model.ranks or (0,)  # a one-file run's tables are rank 0's
    if args.rank is not None and args.rank not in held:  # an empty table would read as "nothing ran"
        print(f"dpprof: run {run.id} has no rank {args.rank}: it holds rank{'s' if len(held) > 1 else ''} "
              f"{', '.join(str(r) for r in held)}", file=sys.stderr)
        return None
    run.capture = args.capture
    try:
        listed, chosen = captures(run), chosen_capture(run)
    except ValueError as err:
        say(str(err))
        return None
    named = detail_devices(run, args.rank) if args.device is not None else []
    if args.device is not None and args.device not in named:  # as a rank: not "no kernels in this run"
        where = f"rank {args.rank} of run {run.id}" if args.rank is not None else f"run {run.id}"
        print(f"dpprof: {where} has no device {args.device}{f' in its capture of {chosen.label}' if chosen else ''}: "
              f"its operator, kernel and memory tables name {', '.join(named) or 'none'}", file=sys.stderr)
        return None
    if chosen is not None and len(listed) > 1 and not args.json:  # which of them the tables below are
        others = ", ".join(str(c.first_step) for c in listed if c.first_step != chosen.first_step)
        print(f"capture of {chosen.label}{' (the latest)' if args.capture is None else ''}; "
              f"the run's other capture{'s start' if len(listed) > 2 else ' starts'} at step {others} (--capture A)\n")
    return run


def _none_here(args: argparse.Namespace, what: str, whole: pd.DataFrame) -> str | None:
    """"no kernels on host in this run: its kernels are cuda:0's" where --device or --rank leave none of the run's
    ``whole`` table (it has rows elsewhere); None otherwise (no filter, or the run has none at all)."""
    if whole.empty or (args.device is None and args.rank is None):
        return None
    where = " of ".join(w for w in (args.device, None if args.rank is None else f"rank {args.rank}") if w)
    many = whole["rank"].nunique() > 1
    holders = sorted({f"rank {r} {d}" if many else str(d) for r, d in zip(whole["rank"], whole["device"])})
    return f"no {what} on {where} in this run: its {what} are {', '.join(holders)}'s"


def _print_json(doc: dict[str, object]) -> None:
    import json

    print(json.dumps(doc, indent=1))


def _cmd_ops(args: argparse.Namespace) -> int:
    """The top operators of a run (imported traces, deep captures), per rank and device."""
    from dpprof.store.detail_rows import operators

    if args.vs and args.by == "shape":  # the difference is by name (dpprof.views.opdiff): never dropped unsaid
        raise UsageError("--vs compares operators by name: leave out --by shape, or read the shapes without --vs")
    run = _detail_run(args)
    if run is None:
        return EXIT_FAILURE
    if args.vs:
        return _ops_vs(args, run)
    df = operators(run, by=args.by, rank=args.rank, device=args.device, top=args.top)  # type: ignore[arg-type]
    if args.json:
        _print_json({"operators": _records(df, OPS_JSON + (["input_shapes"] if args.by == "shape" else []))})
        return EXIT_OK
    if df.empty and operators(run, top=1).empty:  # none in the whole run: why, as the Operators page says it
        from dpprof.views.operators import missing_text

        print(missing_text(run))
        return EXIT_OK
    none_here = _none_here(args, "operators", operators(run)) if df.empty else None
    if none_here is not None:
        print(none_here)
        return EXIT_OK
    print(_table(df.drop(columns=["tc_eligible", "tc_pct"] if df["tc_pct"].isna().all() else [])))
    return EXIT_OK


def _latest_capture(run: object) -> int | None:
    """The first step of the run's latest deep capture (what --vs reads of a run named again), None without one."""
    from dpprof.store.detail_rows import captures
    from dpprof.store.reader import StoredRun

    assert isinstance(run, StoredRun)
    listed = captures(run)
    return listed[-1].first_step if listed else None


def _ops_vs(args: argparse.Namespace, run: object) -> int:
    """``dpprof ops RUN --vs DEVICE|RUN2``: the run's operators (--rank, --device) against another device of it, or
    against another run (all its devices), the difference per operator largest first (dpprof.views.opdiff)."""
    from dpprof.store.detail_rows import detail_missing
    from dpprof.store.reader import RunFileError, StoredRun, load_run
    from dpprof.views.opdiff import Pick, diff_sentence, operator_diff

    assert isinstance(run, StoredRun)
    pick_b = Pick(args.rank, args.device)
    devices = set(run.operators()["device"])
    ranked = re.fullmatch(r"rank:(\d+)", args.vs)
    if args.vs in devices:  # a device of the tables' own name first (an imported trace's may be rank:N)
        other, pick_a = run, Pick(None, args.vs)
        label_a = pick_a.label(run)
    elif ranked and int(ranked.group(1)) in run.model.ranks:  # another rank of this run, by its rank
        other, pick_a = run, Pick(int(ranked.group(1)), None)
        label_a = pick_a.label(run)
    else:
        try:
            other = load_run(args.vs, args.reports_dir)
        except RunFileError:
            if not DEVICE_NAME.fullmatch(args.vs):
                raise
            # a device the run does not have, not "no run 'cpu:9'"
            held = sorted(devices) + [f"rank:{r}" for r in run.model.ranks if f"rank:{r}" not in devices]
            print(f"dpprof: --vs {args.vs}: run {run.id} has no device {args.vs} (its operator tables name "
                  f"{', '.join(held)}) and no run is called so", file=sys.stderr)
            return EXIT_FAILURE
        why = detail_missing(other)
        if why is not None:
            say(f"run {other.id}: {why}")
            return EXIT_FAILURE
        if other.id == run.id and pick_b == Pick() and args.capture in (None, _latest_capture(run)):
            raise UsageError(f"--vs {args.vs} names the run itself: compare another run, a device or rank of it "
                             "(--vs rank:0), or another of its captures (--capture A)")
        pick_a, label_a = Pick(), str(other.meta.get("name") or other.id)
    label_b = pick_b.label(run) if other is run or args.device or args.rank is not None \
        else str(run.meta.get("name") or run.id)
    if other is run and label_a == pick_b.label(run):
        raise UsageError(f"--vs {args.vs} names the device the run's side already is: compare two devices")
    # over B's steps (its capture's, its rank's): a side whose tables span another count is scaled to them, said so
    diff = operator_diff(other, pick_a, run, pick_b)
    if other is not run and diff.attrs["ranks_a"] != diff.attrs["ranks_b"]:  # one rank beside a job's sum: said
        label_a, label_b = (f"{label} ({n} ranks summed)" if n > 1 else label
                            for label, n in ((label_a, diff.attrs["ranks_a"]), (label_b, diff.attrs["ranks_b"])))
    sentence = diff_sentence(diff, label_a, label_b, quote="")
    # a side with no operators (a rank whose trace holds none): the sentence says so, no table of the other's alone
    empty = any(not (diff[f"calls_{side}"].fillna(0) > 0).any() for side in ("a", "b"))
    top = diff.head(0 if empty else args.top)
    if args.json:
        _print_json({"sentence": sentence, "clock": diff.attrs["clock"],
                     "operators": _records(top, list(top.columns))})
        return EXIT_OK
    print(sentence)
    if len(top):
        print()
        print(_table(top))
    return EXIT_OK


def _cmd_kernels(args: argparse.Namespace) -> int:
    """The top kernels of a run and each GPU's utilization, SM efficiency and occupancy."""
    from dpprof.store.detail_rows import gpu_summary, kernels

    run = _detail_run(args)
    if run is None:
        return EXIT_FAILURE
    df = kernels(run, by=args.by, rank=args.rank, device=args.device, top=args.top)  # type: ignore[arg-type]
    gpu = gpu_summary(run, rank=args.rank, device=args.device)  # type: ignore[arg-type]
    if args.json:
        _print_json({"kernels": _records(df, KERNELS_JSON), "gpu": _records(gpu, GPU_JSON)})
        return EXIT_OK
    if df.empty:
        print(_none_here(args, "kernels", kernels(run)) or "no kernels in this run (a CPU-only trace or capture)")
        return EXIT_OK
    print(_table(gpu.drop(columns=["window_ms", "busy_ms"])))
    print()
    print(_table(df))
    return EXIT_OK


def _cmd_memory(args: argparse.Namespace) -> int:
    """Each device's memory peak and step, and the operators that allocated most."""
    from dpprof.store.detail_rows import memory_peaks, operator_memory

    run = _detail_run(args)
    if run is None:
        return EXIT_FAILURE
    peaks = memory_peaks(run, rank=args.rank, device=args.device)  # type: ignore[arg-type]
    if args.json:
        _print_json({"devices": _records(peaks, MEMORY_JSON)})
        return EXIT_OK
    none_here = _none_here(args, "[memory] events", memory_peaks(run)) if peaks.empty else None
    if none_here is not None:
        print(none_here)
        return EXIT_OK
    if peaks.empty:  # none in the whole run: why, as the Memory page says it (an imported trace's, a capture's)
        from dpprof.views.memory import missing_text

        print(missing_text(run))
        return EXIT_OK
    print(_table(peaks, "{:.1f}"))
    ops = operator_memory(run, rank=args.rank, device=args.device, top=args.top)  # type: ignore[arg-type]
    if not ops.empty:
        print()
        print(_table(ops))
    return EXIT_OK


def _detail_options(p: argparse.ArgumentParser, by: tuple[str, ...] | None) -> None:
    p.add_argument("run", metavar="RUN", help="run id (or a unique prefix) or path to a run file")
    p.add_argument("--rank", type=int, default=None, metavar="N", help="only this rank")
    p.add_argument("--device", default=None, metavar="D", help="only this device (cuda:0, cpu:1, rank:2)")
    p.add_argument("--top", type=_positive_int, default=20, metavar="N", help="the first N rows (default 20)")
    p.add_argument("--capture", type=_step_index, default=None, metavar="A",
                   help="a recorded run's deep capture that starts at step A (default: its latest)")
    if by:
        p.add_argument("--by", choices=by, default=by[0], help=f"group by {' or '.join(by)} (default {by[0]})")
    p.add_argument("--json", action="store_true", help="print JSON (the fields docs/cli.md lists)")


def _calibrate_and_cache(devices: int, progress: bool) -> tuple[Calibration, Path | None]:
    """dpprof advise's calibration of this machine for ``devices`` CPU workers, and where it was cached: None, said
    in one line on stderr, where the cache cannot be written (the calibration is then used, not kept)."""
    from dpprof.advise.calibrate import calibrate
    from dpprof.advise.calibration_cache import save_calibration

    calibration = calibrate(devices, save=False, progress=progress)
    try:
        return calibration, save_calibration(calibration)
    except OSError as err:
        print(f"dpprof: the calibration cannot be cached ({type(err).__name__}: {err}): it is used this once and "
              "measured again next time", file=sys.stderr)
        return calibration, None


def _cmd_advise(args: argparse.Namespace) -> int:
    """Predict other set-ups from one recorded DataParallel run; --calibrate measures this machine first, --check
    runs every scenario for real."""
    import json

    from dpprof.advise import NotAdvisable
    from dpprof.advise.measured import measure
    from dpprof.store.reader import load_run, reports_dir
    from dpprof.views.advise import advisor, calibration_for, text_lines

    if args.memory_gib is not None and args.memory_gib <= 0:
        raise UsageError(f"--memory-gib must be positive, got {args.memory_gib}")
    if args.check_dir is not None and not args.check:
        raise UsageError("--check-dir is where --check records its runs: give --check too")
    if args.run is None:
        if not args.calibrate:
            raise UsageError("advise needs a run (dpprof advise RUN), or --calibrate to measure this machine")
        devices = args.devices or "cpu:2"
        match = re.fullmatch(r"cpu:(\d+)", devices.strip())
        if not match or int(match.group(1)) < 1:
            raise UsageError(f"--devices {devices!r}: the calibration is of CPU workers, cpu:N")
        calibration, cached = _calibrate_and_cache(int(match.group(1)), progress=sys.stderr.isatty())
        print("\n".join(calibration.lines()))
        if calibration.loaded_reason():
            print(f"dpprof: {calibration.loaded_reason()}: dpprof advise predicts nothing with it; measure again "
                  "(dpprof advise --calibrate) once the machine is quieter", file=sys.stderr)
        if cached is not None:
            print(f"cached in {cached}")
        return EXIT_OK
    if args.devices is not None:
        raise UsageError(f"--devices {args.devices!r} is for --calibrate without a run: a run is predicted on its "
                         "own devices (and on 1 to twice their count)")
    run = load_run(args.run, args.reports_dir)
    try:
        m = measure(run)
    except NotAdvisable as err:
        say(str(err))
        return EXIT_FAILURE
    calibration, _ = calibration_for(m)
    if m.backend == "cpu" and (args.calibrate or calibration is None):
        import torch

        from dpprof.advise.calibration_cache import cache_path, cached_calibration

        _, unused = cached_calibration("cpu", m.n, m.threads)
        if unused is not None and not args.calibrate:
            print(f"dpprof: the cached calibration {cache_path('cpu', m.n, m.threads)} was not used: {unused}; "
                  "measuring again", file=sys.stderr)
        torch.set_num_threads(m.threads)  # the calibration of the run's own thread count
        print(f"dpprof: calibrating this machine for {plural(m.n, 'CPU worker')} at {m.threads} intra-op "
              f"thread(s) (half a minute, once; cached in {cache_path('cpu', m.n, m.threads)})", file=sys.stderr,
              flush=True)
        # a bar where someone watches: not under --json, nor into a file or a pipe
        calibration, _ = _calibrate_and_cache(m.n, progress=not args.json and sys.stderr.isatty())
        if args.calibrate:
            print("\n".join(calibration.lines()), file=sys.stderr if args.json else sys.stdout)
    view = advisor(run, args.memory_gib, args.batch_sizes, calibration=calibration,
                   compute=_measure_compute(m, args.batch_sizes, calibration,
                                            progress=not args.json and sys.stderr.isatty()))
    if view.advice is None:
        say(view.reason)
        return EXIT_FAILURE
    checked = None
    if args.check and all(s.profile is None for s in view.advice.scenarios):
        say(f"--check has nothing to run: run {run.id} was recorded from a script, so no scenario has a command "
            "(change the script to run one)")
        return EXIT_FAILURE
    if args.check:
        from dpprof.advise.check import check
        from dpprof.store.faults import RecordingError
        from dpprof.store.staging import check_reports_dir

        out_dir = args.check_dir or reports_dir(args.reports_dir)
        try:  # a directory the check's runs cannot go to: the line a run would give, before any scenario runs
            check_reports_dir(out_dir)
        except RecordingError as err:
            say(f"--check-dir: {err}")
            return EXIT_FAILURE
        def progress(scenario: Scenario, profile: Profile | None) -> None:
            """The command each check runs (its steps at most CHECK_MAX_STEPS), as it starts."""
            command = scenario.command if profile is None else profile.command()
            print(f"dpprof: running {scenario.label}: {command}", file=sys.stderr, flush=True)

        checked = check(view.advice, out_dir, progress=None if args.quiet else progress)
    failed = EXIT_FAILURE if checked is not None and any(c.error is not None for c in checked) else EXIT_OK
    if args.json:
        data = view.advice.to_json()
        if checked is not None:
            data["check"] = [c.to_json() for c in checked]
        print(json.dumps(data, indent=1))
        return failed
    print("\n".join(text_lines(view)))
    if checked is not None:
        from dpprof.views.advise import check_lines

        print()
        print("\n".join(check_lines(checked)))
    return failed


def _measure_compute(m: Measured, batch_sizes: list[int] | None, calibration: Calibration | None,
                     progress: bool) -> ComputeProbe | None:
    """The run's model measured alone for every split of its batch the scenarios need (dpprof.advise.compute),
    measured here where this host's cache lacks a split (or holds another torch's than the calibration's) and
    cached; None for a run dpprof cannot rebuild, or one whose model cannot be built here (said on stderr: the
    predictions then go by the recorded figures). Read from the cache, torch is not imported."""
    if m.backend != "cpu" or m.source == "script":
        return None
    from dpprof.advise.compute import (MAX_PASSES, MIN_PASSES, WARMUP, cached_compute, compute_path, measure_compute,
                                       save_compute)
    from dpprof.advise.predict import compute_layouts
    from dpprof.plaintext import error_line

    known = cached_compute(m.run_id, calibration.torch_version if calibration is not None else None)
    needed = compute_layouts(m, batch_sizes)
    if known is not None and known.covers(needed):
        return known
    splits = len({key for key in needed if known is None or key not in known.layouts})
    print(f"dpprof: measuring {m.workload} alone for each split of its batch ({plural(splits, 'split')}, "
          f"{WARMUP + MIN_PASSES} to {WARMUP + MAX_PASSES} passes each; once, cached in {compute_path(m.run_id)})",
          file=sys.stderr, flush=True)
    try:
        probe = measure_compute(m, needed, known, progress=progress)
    except Exception as err:  # noqa: BLE001 - the user's model factory, its import, its forward: said, not raised
        print(f"dpprof: {m.workload} could not be measured alone ({error_line(err)}): the predictions go by the "
              "recorded figures alone", file=sys.stderr)
        return None
    if probe is not None:
        try:
            save_compute(probe)
        except OSError as err:
            say(f"the measure was not cached ({error_line(err)})")
    return probe


_CAPTURE_HELP = ("profile steps A to B-1 with torch.profiler (every thread; CUDA too on a GPU): their operators, "
                 "kernels and memory stored in the run per device, the raw trace beside it for Perfetto")


# Python 3.11's argparse reads "-3:2" as an option (its negative numbers are "-3" and "-.5" alone), so
# `--steps -3:2` said "argument --steps: expected one argument" and never named the value; the commands that take a
# window A:B take it as a value, as Python 3.13's argparse does, and say what is wrong with it.
_NEGATIVE_OR_WINDOW = re.compile(r"^-\d+$|^-\d*\.\d+$|^-\d+:-?\d*$")


def _takes_negative_windows(p: argparse.ArgumentParser) -> None:
    """Let ``p``'s options take a value such as ``-3:2`` (then refused by what parses it, naming it)."""
    p._negative_number_matcher = _NEGATIVE_OR_WINDOW  # type: ignore[attr-defined]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dpprof", description="Profile PyTorch data-parallel training, "
                                     "device by device and phase by phase.")
    parser.add_argument("--reports-dir", default=None, metavar="DIR",
                        help="where runs are kept (default: $DPPROF_REPORTS, else ./reports)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("profile", help="train a built-in workload (or your model) and record it")
    p.add_argument("workload", nargs="?", default=None, choices=list(WORKLOAD_NAMES),
                   help=f"built-in workload (default: {DEFAULT_WORKLOAD}); not with --model")
    p.add_argument("--devices", default=None, help="cpu:N (N CPU workers), cpu:0,cpu:1 (those workers), cuda "
                   "(every GPU) or 0,1,2 (default: cpu:2)")
    p.add_argument("--steps", type=int, default=50, metavar="N", help="training steps to record (default: 50)")
    p.add_argument("--batch-size", type=int, default=None, metavar="N", help="batch size (default: the workload's)")
    p.add_argument("--name", default=None, help="a name for the run")
    p.add_argument("--model", default=None, metavar="PKG.MODULE:FACTORY",
                   help="profile your own model: a factory returning an nn.Module, on random inputs")
    p.add_argument("--input-shape", type=_input_shape, default=None, metavar="D1,D2,...",
                   help="with --model: the shape of one sample, e.g. 3,224,224")
    p.add_argument("--balanced", action="store_true",
                   help="compute the loss on every device (DataParallelModel + DataParallelCriterion) "
                   "instead of gathering outputs onto one")
    p.add_argument("--ddp", action="store_true",
                   help="run under torchrun with dpprof.DistributedDataParallel, one process per rank: on the "
                   "CPU over gloo, or with --devices cuda on GPU local_rank %% GPUs (NCCL; gloo when ranks "
                   "share GPUs)")
    p.add_argument("--fsdp", action="store_true",
                   help="train under torchrun with FSDP2 (fully_shard on each top-level child module and the root), "
                        "--nproc ranks (gloo on CPU, NCCL on GPUs), each rank recorded")
    p.add_argument("--nproc", type=int, default=None, metavar="N", help="with --ddp or --fsdp: ranks to start (default: 2)")
    p.add_argument("--bucket-cap-mb", type=float, default=None, metavar="MB",
                   help="with --ddp: DDP's bucket_cap_mb, the gradient bucket size (default: torch's 25)")
    p.add_argument("--detail", choices=["bounded", "all"], default="bounded",
                   help="bounded (default): every step's time and per-block aggregates, full detail for the first and "
                   "last 1,000 steps, one step in 100 and outliers, so a day-long run stays small; all: every record")
    p.add_argument("--run-id", default=None, metavar="ID",
                   help="the run's id, chosen by whoever starts it (default: a new one; dpprof.launch)")
    p.add_argument("--capture", default=None, metavar="A:B", help=_CAPTURE_HELP)
    _takes_negative_windows(p)
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_profile, parser=p)

    p = sub.add_parser("check", help="pre-flight check: are these devices (and this batch size) balanced?",
                       description="Exit code 0: no findings; 1: findings (do not start training blind); "
                       "2: usage error.")
    p.add_argument("--device-ids", default=None, metavar="IDS",
                   help="devices DataParallel will use: 0,1,2 or cuda:0,cuda:1 or cpu:0,cpu:1 (every worker named; "
                   "default: every GPU)")
    p.add_argument("--batch-size", type=int, default=None, metavar="N", help="check how torch.chunk splits this batch")
    p.add_argument("--json", action="store_true", help="print the findings as JSON")
    p.set_defaults(func=_cmd_check, parser=p)

    p = sub.add_parser("run", help="run a training script unchanged, its DataParallel, DDP and FSDP recorded",
                       usage="dpprof run [-h] [--name NAME] [--cpu-workers N] [--steps N] [--no-record] [--detail bounded|all] "
                       "[--capture A:B] "
                       "(SCRIPT.py | -m MODULE) [ARGS...]",
                       description="Runs SCRIPT.py (or -m MODULE) as python would: same sys.argv, __main__, "
                       "working directory, exit code and exceptions, with torch.nn.DataParallel, "
                       "data_parallel, DistributedDataParallel, fully_shard (FSDP2) and FullyShardedDataParallel "
                       "(FSDP1) recording into one run. A step ends at each "
                       "optimizer.step() (at the last of several stepped back to back). Under torchrun: torchrun --nproc_per_node=N -m dpprof run train.py")
    p.add_argument("--name", default=None, help="a name for the run (default: the script and its arguments)")
    p.add_argument("--cpu-workers", type=int, default=None, metavar="N",
                   help="with no GPU, a DataParallel built with no device_ids runs on N CPU workers instead of "
                   "torch's pass-through (a script that calls .cuda() still needs a GPU)")
    p.add_argument("--steps", type=int, default=None, metavar="N",
                   help="stop recording after N steps (at the forward that would start one more); the script goes on, "
                   "unrecorded")
    p.add_argument("--no-record", action="store_true",
                   help="record nothing: torch's classes are still dpprof's and --cpu-workers still applies "
                   "(what bench/run_overhead.py compares recording against)")
    p.add_argument("--detail", choices=["bounded", "all"], default="bounded",
                   help="bounded (default): every step's time and per-block aggregates, full detail for the first and "
                   "last 1,000 steps, one step in 100 and outliers, so a day-long run stays small; all: every record")
    p.add_argument("--capture", default=None, metavar="A:B", help=_CAPTURE_HELP)
    _takes_negative_windows(p)
    p.add_argument("-m", dest="module", action="store_true", help="run a module, as python -m does")
    p.add_argument("target", nargs=argparse.REMAINDER, metavar="SCRIPT.py|MODULE [ARGS...]",
                   help="the script (or, with -m, the module) and its own arguments")
    p.set_defaults(func=_cmd_run, parser=p)

    p = sub.add_parser("capture", help="profile the next N steps of a running run with torch.profiler",
                       description="Asks a run being recorded now to profile its next N steps with torch.profiler (from "
                       "its next step boundary, within about a second; every rank of a distributed run the same steps, a few "
                       "seconds ahead) and waits until its operators are stored in the run and its raw trace (one per "
                       "rank) beside it. Exit 1, in one line, for a run that has ended, was imported, or does not "
                       "answer within --timeout.")
    p.add_argument("run", metavar="RUN", help="run id (or a unique prefix) or path to a run file")
    p.add_argument("--steps", type=_positive_int, default=5, metavar="N", help="steps to capture (default: 5)")
    p.add_argument("--timeout", type=_positive_seconds, default=600.0, metavar="S",
                   help="give up after S seconds without an answer (default: 600)")
    p.add_argument("--quiet", action="store_true", help="no line on stderr while waiting")
    p.set_defaults(func=_cmd_capture, parser=p)

    p = sub.add_parser("merge", help="gather distributed runs' rank files from several machines into one run")
    p.add_argument("sources", nargs="+", metavar="DIR_OR_FILE", help="rank files (<run id>.rank<N>.sqlite) or directories holding them")
    p.add_argument("--out", default=None, metavar="DIR", help="where to gather them (default: the reports directory)")
    p.set_defaults(func=_cmd_merge, parser=p)

    p = sub.add_parser("import", help="read torch.profiler traces (.json, .json.gz) as one run",
                       description="Several files of one job become one run with one rank per file (rank from "
                       "distributedInfo, else from the file name, else the order given). Exit 1, with nothing "
                       "written, when a file is not a readable trace, the files are of different jobs, or a run "
                       "in the reports directory was imported from one of them (same name and size) without "
                       "--again.")
    p.add_argument("sources", nargs="+", metavar="TRACE_OR_DIR", help="trace files, or directories of them")
    p.add_argument("--name", default=None, help="a name for the run (default: the name of the run dpprof export "
                   "wrote the files of, else the first file's name)")
    p.add_argument("--again", action="store_true",
                   help="import files a run in the reports directory was imported from already, as another run")
    p.add_argument("--jobs", type=_positive_int, default=None, metavar="N",
                   help="files read at once, each in a process of its own (default: one per core, fewer where "
                        "memory would not hold them; a plain .json of 64 MiB or more is read in parts where there are "
                        "fewer files than workers; 1: one after another; never more than the cores or the files and "
                        "parts, said in a warning line)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=_cmd_import, parser=p)

    p = sub.add_parser("runs", help="list the recorded runs")
    p.set_defaults(func=_cmd_runs, parser=p)

    p = sub.add_parser("show", help="the per-device phase summary of one run")
    p.add_argument("run", metavar="RUN", help="run id (or a unique prefix) or path to a run file")
    p.set_defaults(func=_cmd_show, parser=p)

    p = sub.add_parser("ops", help="a run's top operators per rank and device (imported traces, deep captures)",
                       description="Operators by host total time: calls, host and device total and self time, "
                       "tensor-core eligibility and share. Exit 1, in one line, for a run without operator data.")
    _detail_options(p, ("name", "shape"))
    p.add_argument("--vs", default=None, metavar="DEVICE|RUN",
                   help="set the operators (of --rank/--device) beside another device of the run, or another run: "
                        "the difference per operator, largest first")
    p.set_defaults(func=_cmd_ops, parser=p)

    p = sub.add_parser("kernels", help="a run's top kernels and each GPU's utilization, SM efficiency, occupancy",
                       description="Kernels by total time, and per GPU its utilization, estimated SM efficiency and "
                       "achieved occupancy over all steps (the TensorBoard plugin's definitions: docs/traces.md). "
                       "Exit 1, in one line, for a run without operator data.")
    _detail_options(p, ("name", "operator"))
    p.set_defaults(func=_cmd_kernels, parser=p)

    p = sub.add_parser("memory", help="each device's memory peak and step, and the operators that allocated most",
                       description="Per device the peak allocated and reserved bytes and the step of the peak, then "
                       "the operators by bytes allocated. Exit 1, in one line, for a run without operator data.")
    _detail_options(p, None)
    p.set_defaults(func=_cmd_memory, parser=p)

    p = sub.add_parser("advise", help="predict DDP, other device counts, the balanced criterion and other batch sizes "
                       "from one DataParallel run", description="Predicts, from one recorded DataParallel run and a "
                       "short calibration of this machine (cached per host and device set), each scenario's median "
                       "step with an interval, its parts and each device's peak held memory, and prints the command "
                       "that runs it. Exit 1, in one line, for a run it cannot predict from (DDP and FSDP runs, "
                       "imported traces, runs of fewer than 3 steps).")
    p.add_argument("run", nargs="?", default=None, metavar="RUN", help="run id (or a unique prefix) or path to a run file")
    p.add_argument("--json", action="store_true", help="print the prediction (and the check) as JSON")
    p.add_argument("--calibrate", action="store_true",
                   help="measure this machine first (without RUN: for --devices); cached in "
                   "$XDG_CACHE_HOME/dpprof/advise (default ~/.cache/dpprof/advise)")
    p.add_argument("--devices", default=None, help="with --calibrate and no RUN: the CPU workers to calibrate for "
                   "(default: cpu:2); a run is calibrated for its own")
    p.add_argument("--check", action="store_true",
                   help=f"run every scenario's command on this machine (at most {CHECK_MAX_STEPS} steps each) and "
                   "print predicted against measured")
    p.add_argument("--check-dir", default=None, metavar="DIR", help="where --check records its runs (default: the reports directory)")
    p.add_argument("--memory-gib", type=_memory_gib, default=None, metavar="GIB",
                   help="each CPU worker's memory, for the largest batch that fits (a GPU's is its own)")
    p.add_argument("--batch-sizes", type=_batch_sizes, default=None, metavar="B1,B2",
                   help="other global batch sizes to predict (default: half and twice the recorded one)")
    p.add_argument("--quiet", action="store_true", help="with --check, no line per scenario on stderr")
    p.set_defaults(func=_cmd_advise, parser=p)

    p = sub.add_parser("export", help="write a run's tables as CSV files, or the run as a trace for Perfetto",
                       description="Without --trace: every table as CSV in --out. With --trace FILE.json[.gz]: the run "
                       "as a Chrome Trace Event file in torch.profiler's form, for Perfetto, chrome://tracing and "
                       "Holistic Trace Analysis (and dpprof import); a distributed run as a file per rank, "
                       "FILE.rank<N>.json[.gz]. It holds the steps the run keeps in full (a thinned run's say "
                       "which in the file), at most what a viewer opens: a run over ~1M events exports its newest "
                       "steps that fit and says which on one line.")
    p.add_argument("run", metavar="RUN", help="run id (or a unique prefix) or path to a run file")
    p.add_argument("--out", default=None, metavar="DIR", help="output directory for the CSV files (default: ./<run id>-csv; "
                   "with --trace, CSV files only when given)")
    p.add_argument("--trace", default=None, metavar="FILE.json[.gz]",
                   help="write the run as a trace file (gzip'd when the name ends in .gz)")
    _takes_negative_windows(p)
    p.add_argument("--steps", default=None, metavar="A:B",
                   help="with --trace: steps A to B-1 (A: or :B open at one end; N: step N) instead of every step held "
                   "in full, or the newest that fit")
    p.add_argument("--one-file", action="store_true",
                   help="with --trace, for a distributed run: every rank in FILE, side by side (for viewing; "
                   "dpprof import and HTA's TraceAnalysis read the per-rank files)")
    p.set_defaults(func=_cmd_export, parser=p)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)  # exits 2 on usage errors, 0 on --help
    if extra:  # said with the subcommand's usage, as its other errors, not the top-level one
        hint = ("; --reports-dir goes before the command: dpprof --reports-dir DIR "
                f"{args.command} ..." if any(a.split("=")[0] == "--reports-dir" for a in extra) else "")
        args.parser.error(f"unrecognized arguments: {' '.join(extra)}{hint}")
    from dpprof.outputs import OutputError
    from dpprof.store.faults import RecordingError
    from dpprof.store.reader import RunFileError

    if args.command == "run":  # the script's exceptions and exit code are its own
        try:
            return args.func(args)
        except UsageError as err:
            args.parser.error(str(err))
    code = EXIT_OK
    try:
        code = args.func(args)
        sys.stdout.flush()  # inside the try: a pipe closed early breaks here, not in the interpreter's last flush
        return code
    except (UsageError, ProfileError) as err:
        args.parser.error(str(err))  # the subcommand's usage and the message; exits 2
    except BrokenPipeError:  # `dpprof runs | head`: the reader has what it wanted
        _quiet_stdout()
        # the command's own status where it finished, or had decided before printing (`dpprof check | head`: 1 on
        # findings, so that a job script with pipefail still refuses to start)
        return getattr(args, "status", code)
    except (RunFileError, RecordingError, OutputError) as err:  # one line: what could not be read or written, why
        say(str(err))
        return EXIT_FAILURE
    except KeyboardInterrupt:  # a run being recorded said what it kept
        print("dpprof: interrupted", file=sys.stderr)
        return EXIT_FAILURE
    return EXIT_OK


def say(message: str) -> None:
    """One line on stderr: ``dpprof: message``, a line break inside it (a file named with one) written as ``\\n``."""
    print(f"dpprof: {one_line(message)}", file=sys.stderr)


def one_line(message: str) -> str:
    """``message`` on one line: a line break inside it (a file named with one) written as ``\\n``, as Python writes it.

    Example:
        >>> print(one_line("the reports directory /tmp/a\\nb is a file"))
        the reports directory /tmp/a\\nb is a file
    """
    return message.replace("\r", "\\r").replace("\n", "\\n")


def _quiet_stdout() -> None:
    """Point stdout at /dev/null, so that the interpreter's final flush into a closed pipe says nothing."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # stdout is no file (pytest's capture): nothing will flush into the pipe
        pass


if __name__ == "__main__":
    sys.exit(main())

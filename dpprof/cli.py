"""The dpprof command: profile, check, merge, import, runs, show, export.

Exit codes: 0 ok, 1 failure (or findings, for commands that report them), 2 usage error.
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import pandas as pd

__all__ = ["main", "parse_devices"]

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2


class UsageError(Exception):
    """Bad arguments: reported with exit code 2."""


def parse_devices(text: str) -> list:
    """--devices: "cpu:N" (N CPU workers), "cuda" (every GPU) or "0,1,2" (those GPUs)."""
    import torch

    import dpprof

    text = text.strip()
    if text.startswith("cpu:"):
        count = text[4:]
        if not count.isdigit() or int(count) < 1:
            raise UsageError(f"--devices {text!r}: cpu:N needs a positive number of workers")
        return dpprof.cpu_devices(int(count))
    if text == "cuda":
        if not torch.cuda.is_available():
            raise UsageError("--devices cuda: no CUDA GPU is visible here; use cpu:N for CPU workers")
        return list(range(torch.cuda.device_count()))
    parts = [p.strip() for p in text.split(",")]
    if not all(p.isdigit() for p in parts):
        raise UsageError(f"--devices {text!r}: expected cpu:N, cuda, or GPU indices like 0,1,2")
    return [int(p) for p in parts]


def _input_shape(text: str) -> list[int]:
    try:
        return [int(d) for d in text.replace("x", ",").split(",") if d.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a shape like 3,224,224") from None


def _table(df: pd.DataFrame, float_format: str = "{:.3f}") -> str:
    if df.empty:
        return "(none)"
    return df.to_string(float_format=float_format.format, na_rep="-")


def _cmd_profile(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from dpprof.parallel.devices import resolve_devices
    from dpprof.workloads import build_workload, train, user_workload

    if args.steps < 1:
        raise UsageError(f"--steps must be positive, got {args.steps}")
    if args.ddp:
        return _profile_ddp(args)
    devices = parse_devices(args.devices)
    try:
        resolve_devices(devices)
        if args.model:
            if not args.input_shape:
                raise UsageError("--model needs --input-shape (the shape of one sample, e.g. 3,224,224)")
            workload = user_workload(args.model, args.input_shape, args.batch_size)
        else:
            workload = build_workload(args.workload, args.batch_size)
    except ValueError as err:
        raise UsageError(str(err)) from None
    progress = lambda it: tqdm(it, total=args.steps, desc=f"{workload.name} on {args.devices}",  # noqa: E731
                               unit="step", disable=args.quiet)
    run = train(workload, devices, args.steps, name=args.name, reports_dir=args.reports_dir, progress=progress,
                balanced=args.balanced)
    print(f"recorded run {run.id} ({args.steps} steps) in {run.path}")
    print(f"  dpprof show {run.id}")
    return EXIT_OK


def _profile_ddp(args: argparse.Namespace) -> int:
    """Run the workload under torchrun, one process per rank, with rank 0's steps as the progress bar."""
    import collections
    import os
    import subprocess

    from tqdm import tqdm

    if args.model or args.balanced:
        raise UsageError("--ddp runs the built-in workloads (no --model, no --balanced)")
    if args.nproc < 1:
        raise UsageError(f"--nproc must be positive, got {args.nproc}")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
           "-m", "dpprof.ddp_worker", args.workload, "--steps", str(args.steps)]
    for flag, value in (("--batch-size", args.batch_size), ("--name", args.name), ("--reports-dir", args.reports_dir)):
        if value is not None:
            cmd += [flag, str(value)]
    tail: collections.deque[str] = collections.deque(maxlen=30)
    bar = tqdm(total=args.steps, desc=f"{args.workload} on {args.nproc} ranks", unit="step", disable=args.quiet)
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}) as proc:
        for line in proc.stdout:
            tail.append(line.rstrip())
            if line.startswith("rank 0 step "):
                bar.update(1)
            elif line.startswith("recorded run "):
                bar.close()
                print(line.rstrip())
    bar.close()
    if proc.returncode != 0:
        print("\n".join(tail), file=sys.stderr)
        print(f"dpprof: torchrun exited with {proc.returncode}; the ranks' records so far are kept", file=sys.stderr)
        return EXIT_FAILURE
    return EXIT_OK


def _cmd_merge(args: argparse.Namespace) -> int:
    from dpprof.store.merge import merge_rank_files
    from dpprof.store.reader import reports_dir

    out = args.out or reports_dir(args.reports_dir)
    for run_id, ranks in merge_rank_files(args.sources, out).items():
        print(f"run {run_id}: ranks {', '.join(map(str, ranks))} in {out}")
    return EXIT_OK


def _cmd_import(args: argparse.Namespace) -> int:
    """Import torch.profiler traces as one run, with a progress bar of bytes read on a terminal."""
    from tqdm import tqdm

    from dpprof.trace import TraceError, import_traces, trace_files

    try:
        total = sum(p.stat().st_size for p in trace_files(args.sources))
        with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="reading traces",
                  disable=args.quiet or not sys.stderr.isatty()) as bar:
            run = import_traces(args.sources, args.reports_dir, name=args.name, progress=bar.update)
    except TraceError as err:
        print(f"dpprof: {err}", file=sys.stderr)
        return EXIT_FAILURE
    print(f"imported run {run.id} ({run.steps} steps, {', '.join(run.devices)}) in "
          f"{', '.join(str(p) for p in run.paths)}")
    print(f"  dpprof show {run.id}")
    return EXIT_OK


def _cmd_runs(args: argparse.Namespace) -> int:
    import dpprof

    runs = dpprof.list_runs(args.reports_dir)
    if runs.empty:
        print("no runs yet: record one with `dpprof profile cifar-lenet --devices cpu:2`")
        return EXIT_OK
    readable = runs[runs["reason"].isna()]
    cols = ["id", "name", "status", "workload", "backend", "devices", "steps", "duration_s", "created_at"]
    print(_table(readable[cols].set_index("id"), "{:.1f}"))
    for _, bad in runs[runs["reason"].notna()].iterrows():
        print(f"unreadable: {bad['path']}: {bad['reason']}")
    return EXIT_OK


def _cmd_show(args: argparse.Namespace) -> int:
    import dpprof
    from dpprof.analysis import phase_table
    from dpprof.report import SUMMARY_COLUMNS, findings_of, summary_of

    run = dpprof.load_run(args.run, args.reports_dir)
    m = run.meta
    print(f"run {m['id']}  {m['name']!r}  status {m['status']}"
          + (f" ({m['error']})" if m.get("error") else ""))
    print(f"  workload {m.get('workload') or '-'}  backend {m.get('backend') or '-'}  devices "
          f"{', '.join(m['devices']) or '-'}  torch {m['torch_version']}  host {m['host']}")
    steps = run.steps
    if steps.empty:
        print("  no steps recorded")
        return EXIT_OK
    ranks = f" on each of {steps['rank'].nunique()} ranks" if "rank" in steps.columns else ""
    count = steps.groupby("rank").size().max() if ranks else len(steps)
    print(f"  {count} steps{ranks}, median {steps['duration_ms'].median():.2f} ms, "
          f"batch {int(steps['batch_size'].median()) if steps['batch_size'].notna().any() else '-'}")
    if m.get("dropped_records"):
        print(f"  warning: {m['dropped_records']} records were dropped (the writer fell behind)")
    print("\nper device:")
    print(_table(summary_of(run)[SUMMARY_COLUMNS]))
    print("\nmean ms per step, by phase:")
    print(_table(phase_table(run.phases)))
    from dpprof.views import gpu_time

    per_gpu = gpu_time(run)
    if not per_gpu.empty:
        print("\nGPU time, mean ms per step (from the trace):")
        print(_table(per_gpu.set_index("device")))
    findings = findings_of(run)
    print(f"\nfindings: {len(findings) or 'none'}")
    _print_findings(findings.to_dict("records"))
    notes = run.notes
    for message in notes["message"] if not notes.empty else []:
        print(f"note: {message}")
    return EXIT_OK


def _print_findings(findings: list[dict]) -> None:
    for f in findings:
        where = f" [{f['device']}]" if isinstance(f.get("device"), str) else ""
        print(f"  {f['severity'].upper()}{where} {f['title']}")
        print(f"    evidence: {f['evidence']}")
        print(f"    advice:   {f['advice']}")


def _cmd_check(args: argparse.Namespace) -> int:
    import json
    from dataclasses import asdict

    import dpprof

    device_ids = None
    if args.device_ids:  # "0,1" are GPU indices, as torch takes them; "cuda:0" and "cpu:0" are names
        device_ids = [int(d) if d.isdigit() else d for d in (p.strip() for p in args.device_ids.split(","))]
    try:
        findings = dpprof.check_balance(device_ids, args.batch_size)
    except (ValueError, TypeError) as err:
        raise UsageError(str(err)) from None
    if args.json:
        print(json.dumps([asdict(f) for f in findings], indent=2))
    elif findings:
        print(f"{len(findings)} finding(s):")
        _print_findings([asdict(f) for f in findings])
    else:
        print("no findings: these devices look balanced")
    return EXIT_FAILURE if findings else EXIT_OK


def _cmd_export(args: argparse.Namespace) -> int:
    import dpprof
    from dpprof.export import export_run

    run = dpprof.load_run(args.run, args.reports_dir)
    out = args.out or f"{run.id}-csv"
    for path in export_run(run, out):
        print(path)
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dpprof", description="Profile PyTorch data-parallel training, "
                                     "device by device and phase by phase.")
    parser.add_argument("--reports-dir", default=None,
                        help="where runs are kept (default: $DPPROF_REPORTS, else ./reports)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    from dpprof.workloads import WORKLOADS

    p = sub.add_parser("profile", help="train a built-in workload (or your model) and record it")
    p.add_argument("workload", nargs="?", default="cifar-lenet", choices=list(WORKLOADS),
                   help="built-in workload (default: cifar-lenet)")
    p.add_argument("--devices", default="cpu:2", help="cpu:N (CPU workers), cuda (every GPU) or 0,1,2 "
                   "(default: cpu:2)")
    p.add_argument("--steps", type=int, default=50, help="training steps to record (default: 50)")
    p.add_argument("--batch-size", type=int, default=None, help="batch size (default: the workload's)")
    p.add_argument("--name", default=None, help="a name for the run")
    p.add_argument("--model", default=None, metavar="PKG.MODULE:FACTORY",
                   help="profile your own model: a factory returning an nn.Module, on random inputs")
    p.add_argument("--input-shape", type=_input_shape, default=None, metavar="D1,D2,...",
                   help="with --model: the shape of one sample, e.g. 3,224,224")
    p.add_argument("--balanced", action="store_true",
                   help="compute the loss on every device (DataParallelModel + DataParallelCriterion) "
                   "instead of gathering outputs onto one")
    p.add_argument("--ddp", action="store_true",
                   help="run under torchrun with dpprof.DistributedDataParallel, one process per rank "
                   "(gloo on CPU, NCCL on GPUs)")
    p.add_argument("--nproc", type=int, default=2, help="with --ddp: ranks to start (default: 2)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_profile)

    p = sub.add_parser("check", help="pre-flight check: are these devices (and this batch size) balanced?",
                       description="Exit code 0: no findings; 1: findings (do not start training blind); "
                       "2: usage error.")
    p.add_argument("--device-ids", default=None, metavar="IDS",
                   help="devices DataParallel will use: 0,1,2 or cuda:0,cuda:1 or cpu:0,cpu:1 (default: every GPU)")
    p.add_argument("--batch-size", type=int, default=None, help="check how torch.chunk splits this batch")
    p.add_argument("--json", action="store_true", help="print the findings as JSON")
    p.set_defaults(func=_cmd_check)

    p = sub.add_parser("merge", help="gather distributed runs' rank files from several machines into one run")
    p.add_argument("sources", nargs="+", help="rank files (<run id>.rank<N>.sqlite) or directories holding them")
    p.add_argument("--out", default=None, help="where to gather them (default: the reports directory)")
    p.set_defaults(func=_cmd_merge)

    p = sub.add_parser("import", help="read torch.profiler traces (.json, .json.gz) as one run",
                       description="Several files of one job become one run with one rank per file (rank from "
                       "distributedInfo, else from the file name, else the order given). Exit 1, with nothing "
                       "written, when a file is not a readable trace or the files are of different jobs.")
    p.add_argument("sources", nargs="+", metavar="TRACE_OR_DIR", help="trace files, or directories of them")
    p.add_argument("--name", default=None, help="a name for the run (default: the first file's name)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_import)

    p = sub.add_parser("runs", help="list the recorded runs")
    p.set_defaults(func=_cmd_runs)

    p = sub.add_parser("show", help="the per-device phase summary of one run")
    p.add_argument("run", help="run id (or a unique prefix) or path to a run file")
    p.set_defaults(func=_cmd_show)

    p = sub.add_parser("export", help="write a run's tables as CSV files")
    p.add_argument("run", help="run id (or a unique prefix) or path to a run file")
    p.add_argument("--out", default=None, help="output directory (default: ./<run id>-csv)")
    p.set_defaults(func=_cmd_export)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)  # exits 2 on usage errors, 0 on --help
    from dpprof.store.reader import RunFileError

    try:
        return args.func(args)
    except UsageError as err:
        parser.error(str(err))  # prints usage and exits 2
    except RunFileError as err:
        print(f"dpprof: {err}", file=sys.stderr)
        return EXIT_FAILURE
    except KeyboardInterrupt:
        print("dpprof: interrupted; the run recorded so far is kept", file=sys.stderr)
        return EXIT_FAILURE
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())

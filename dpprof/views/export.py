"""The Export page of one run: every table as CSV, the summaries, the whole run as a zip of CSVs, and the run as
a trace file for Perfetto, chrome://tracing and Holistic Trace Analysis (dpprof.trace.export)."""
from __future__ import annotations

import io
import os
import zipfile
from pathlib import Path

import numpy as np
import pandas as pd

from dpprof.csvfile import meta_frame, to_csv_bytes
from dpprof.findings import run_findings
from dpprof.outputs import Outputs
from dpprof.report import summary_of
from dpprof.store import detail_rows, queries, table_rows
from dpprof.store.reader import TABLES, StoredRun
from dpprof.store.schema import AGGREGATE_TABLES
from dpprof.store.sketch import grouped_quantile
from dpprof.views.fsdp import fsdp_collective_table
from dpprof.trace.export import plan_trace, rank_path, trace_bytes, write_trace

__all__ = ["TABLE_DESCRIPTIONS", "AGGREGATE_DESCRIPTIONS", "DETAIL_DESCRIPTIONS", "EXTRA_TABLES", "KIND_TABLES", "export_tables", "table_csv", "run_zip",
           "export_table", "export_run", "EXPORTED", "EXPORTABLE", "exported", "trace_text", "run_trace", "rank_traces_zip"]

TABLE_DESCRIPTIONS = {
    "steps": "one row per step: start, duration, batch size",
    "phases": "one row per phase of each forward call on each device",
    "memory": "what each device held in each forward call",
    "allocator": ("the CUDA caching allocator after each replica's apply (its device) and after backward "
                  "(every device); peaks count from the step's start (CUDA runs only)"),
    "devices": "the run's devices",
    "gpu_samples": "NVML readings over time (CUDA runs with NVML only)",
    "findings": "the run's findings, worst first",
    "notes": "why some data is missing",
    "comms": "each gradient bucket's all-reduce (DistributedDataParallel runs), or each collective (imported traces)",
    "gpu_time": "per step and GPU: compute, communication, overlap, memcpy, memset and idle time (imported traces)",
}
# The same tables described in the terms of a run that is not DataParallel (DDP ranks, imported traces).
PROCESS_DESCRIPTIONS = {
    "phases": "one row per phase of each step on each rank or process: data, forward, backward, optimizer",
    "memory": "what each rank held in each step (its batch, outputs, activations, weights)",
    "allocator": "the CUDA caching allocator of each rank's (or the trace's) GPU, per step",
    "devices": "the run's ranks or devices",
}
# The per-block aggregates the writer keeps (dpprof.store.blocks), in a run file of schema 2 and later; each
# quantile sketch is exported as the block's p50 and p95.
AGGREGATE_DESCRIPTIONS = {
    "step_blocks": ("per block of steps: count, sum, min, max, p50 and p95 of the step time; the steps a backward ran "
                    "in and their samples; the steps whose forward raised and ran no backward"),
    "phase_blocks": ("per block, device and phase: the per-step sums' count, sum, min and max; the work rows also "
                     "p50, p95, how often the device was the slowest and how long the others waited for it"),
    "memory_blocks": "per block and device: the mean held, the peak step and what was held then",
    "allocator_blocks": "per block, device and phase: the CUDA allocator's maxima",
    "chunk_counts": "per device and chunk size: the forward calls",
    "outlier_steps": "the outlier steps kept in full, with the median step when each came",
    "run_sketches": "the whole run's step time and each device's work: p50 and p95",
}
# A trace's operators, kernels, GPU metrics and memory (dpprof.trace.detail), in runs that hold them: imported
# traces, deep captures.
DETAIL_DESCRIPTIONS = {
    "operators": "per rank, device and operator: calls, host and device total and self time, tensor cores",
    "kernels": "per rank, device and kernel: calls, total, mean, min, max, blocks per SM, occupancy, tensor cores",
    "gpu_metrics": ("per rank, device and step (and all steps: step empty): GPU utilization, estimated SM "
                    "efficiency and achieved occupancy"),
    "memory_timeline": "per rank and device: allocated and reserved bytes over time (each bucket's maximum)",
    "memory_events": "each allocation paired with its free: operator, bytes, when, how long it lived",
}
# Tables made from the run rather than stored in it.
EXTRA_TABLES = {"run": "the run's metadata", "device_summary": "per device or rank: its work's time and its memory",
                "phase_totals": "each phase's share of the step"}
# Made tables only some kinds of run have, with the kind
KIND_TABLES = {"fsdp_collectives": ("fsdp", "per FSDP rank and collective: per step, bytes, issued and exposed ms, "
                                            "hidden %, in forward and in backward")}


def _of_kind(run: StoredRun, kind: str) -> bool:
    """Whether the run has what a kind's own tables are made of (FSDP's: its phases, recorded or read back)."""
    return run.model.fsdp_phases if kind == "fsdp" else run.model.kind == kind


def export_tables(run: StoredRun) -> pd.DataFrame:
    """The run's tables and their row counts (what the Export page offers), then the made ones."""
    counts: dict[str, int | None] = {t: table_rows.row_count(run, t) for t in TABLES if t != "findings"}
    counts["findings"] = None  # computed (or stored) when asked for
    words = TABLE_DESCRIPTIONS if run.model.dataparallel else {**TABLE_DESCRIPTIONS, **PROCESS_DESCRIPTIONS}
    if run.model.fsdp_phases:
        words = {**words, "comms": "each all-gather and reduce-scatter of each FSDP rank: bytes, launch, duration"}
    rows = [{"table": t, "rows": counts[t], "what": words.get(t, "")} for t in TABLES]
    rows += [{"table": t, "rows": table_rows.row_count(run, t),
              "what": AGGREGATE_DESCRIPTIONS[t]} for t in _aggregates(run)]
    rows += [{"table": t, "rows": 1 if t == "run" else None, "what": what} for t, what in EXTRA_TABLES.items()]
    rows += [{"table": t, "rows": len(export_table(run, t)), "what": DETAIL_DESCRIPTIONS[t]} for t in _details(run)]
    rows += [{"table": t, "rows": None, "what": what} for t, (kind, what) in KIND_TABLES.items()
             if _of_kind(run, kind)]
    return pd.DataFrame(rows)


def _details(run: StoredRun) -> tuple[str, ...]:
    """The operator, kernel, GPU-metric and memory tables, where the run holds them (dpprof.store.detail_rows)."""
    return tuple(DETAIL_DESCRIPTIONS) if detail_rows.detail_missing(run) is None else ()


def _detail_table(run: StoredRun, name: str) -> pd.DataFrame:
    """One of DETAIL_DESCRIPTIONS' tables, every row."""
    if name == "operators":
        return detail_rows.operators(run)
    if name == "kernels":
        return detail_rows.kernels(run)
    if name == "gpu_metrics":
        return pd.concat([detail_rows.gpu_metrics(run), detail_rows.gpu_summary(run).assign(step=pd.NA)],
                         ignore_index=True)
    if name == "memory_timeline":
        return detail_rows.memory_timeline(run)
    return detail_rows.memory_events(run)


def _aggregates(run: StoredRun) -> tuple[str, ...]:
    """The aggregate tables a run file holds (none before schema 2); chunk counts for DataParallel runs only
    (a rank's or a trace's calls have no chunks)."""
    if run.model.retention is None:
        return ()
    return tuple(t for t in AGGREGATE_TABLES if t != "chunk_counts" or run.model.dataparallel)


def _with_quantiles(table: pd.DataFrame) -> pd.DataFrame:
    """A table with a sketch column, each row's sketch as its p50_ms and p95_ms."""
    if "sketch" not in table:
        return table
    out = table.drop(columns="sketch")
    rows = range(len(table))
    for q, col in ((0.5, "p50_ms"), (0.95, "p95_ms")):
        found, values = grouped_quantile(table["sketch"].tolist(), np.arange(len(table)), q)
        out[col] = pd.Series(values, index=found).reindex(rows).to_numpy()
    return out


def export_table(run: StoredRun, name: str) -> pd.DataFrame:
    """One table of the run as exported: a stored table (findings as run_findings gives them), or a made one."""
    if name == "findings":
        return run_findings(run).table
    if name == "run":
        return meta_frame(run.meta)
    if name == "device_summary":
        return summary_of(run).reset_index()
    if name == "phase_totals":
        return queries.phase_totals(run)
    if name in KIND_TABLES and _of_kind(run, KIND_TABLES[name][0]):
        return fsdp_collective_table(run)
    if name in TABLES:
        return table_rows.whole_table(run, name)
    if name in _aggregates(run):
        return _with_quantiles(table_rows.whole_table(run, name))
    if name in _details(run):
        return _detail_table(run, name)
    raise KeyError(f"no table {name!r}")


def table_csv(run: StoredRun, name: str) -> bytes:
    """One table of the run as CSV bytes (formula-like cells neutralised)."""
    return to_csv_bytes(export_table(run, name))


# What an export writes, in order: the metadata, every stored table, the made summaries (and, for a run file of
# schema 2, the aggregates: ``exported``).
EXPORTED = ("run", *TABLES, "device_summary", "phase_totals")


# Every table an export of some run writes: those of an earlier export into the same directory (another run's, of
# another kind) that this one does not write go, so that the directory holds one run's tables
EXPORTABLE = (*EXPORTED, *KIND_TABLES, *AGGREGATE_TABLES, *DETAIL_DESCRIPTIONS)


def exported(run: StoredRun) -> tuple[str, ...]:
    """The tables an export of this run writes: EXPORTED, its kind's own tables, then its aggregate tables, then its
    operators, kernels, GPU metrics and memory where it holds them."""
    own = tuple(t for t, (kind, _) in KIND_TABLES.items() if _of_kind(run, kind))
    return (*EXPORTED, *own, *_aggregates(run), *_details(run))


def export_run(run: StoredRun, out_dir: str | os.PathLike[str], files: Outputs | None = None) -> list[Path]:
    """Write <table>.csv for every table and summary (``exported``) into out_dir (made if missing); returns the
    paths. Whole or not at all: into ``files`` (dpprof.outputs), given their names when it ends well.

    Raises:
        OutputError: out_dir or a file in it cannot be written (one line: the path and why); nothing was left.
    """
    if files is None:
        with Outputs() as own:
            return export_run(run, out_dir, own)
    files.directory(out_dir)
    out = Path(out_dir)
    earlier = (out / "run.csv").is_file()  # an earlier export is there: its tables this run has none of go
    written = []
    names = exported(run)
    for name in names:
        path = out / f"{name}.csv"
        files.open(path).write(table_csv(run, name))
        written.append(path)
    for name in EXPORTABLE if earlier else ():  # (its fsdp_collectives.csv, operators.csv, ...)
        stale = out / f"{name}.csv"
        if name not in names and stale.is_file() and not stale.is_symlink():
            files.remove(stale)
    return written


def run_zip(run: StoredRun) -> bytes:
    """The whole run as a zip of CSVs: run.csv, one per table, device_summary.csv, phase_totals.csv."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        for name in exported(run):
            z.writestr(f"{run.id}/{name}.csv", table_csv(run, name))
    return buf.getvalue()


def trace_text(run: StoredRun) -> str:
    """What the run's trace download holds, in one sentence: its steps and about how many events."""
    plan = plan_trace(run)
    ranks = (" Every rank is in the file, side by side; the per-rank files are what `dpprof import` and HTA's "
             "TraceAnalysis read as ranks." if run.ranks > 1 else "")
    return (f"The trace holds {plan.why()}, about {plan.events:,} events. Open it at ui.perfetto.dev or in "
            f"chrome://tracing; `dpprof export {run.id} --trace FILE.json.gz --steps A:B` picks other steps.{ranks}")


def run_trace(run: StoredRun) -> bytes:
    """The run as one gzip'd trace file (a distributed run's ranks side by side): the steps ``plan_trace`` picks."""
    return trace_bytes(run)


def rank_traces_zip(run: StoredRun) -> bytes:
    """A distributed run as a zip of one gzip'd trace per rank (as torch.profiler writes them)."""
    plan = plan_trace(run)
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:  # each file is gzip'd already
        for path in run.paths:
            rank = run._file_rank(path)
            name = rank_path(f"{run.id}.pt.trace.json.gz", rank).name
            with z.open(f"{run.id}/{name}", "w") as f:
                write_trace(run, f, plan, ranks=[rank], gz=True)
    return buf.getvalue()

"""dpprof.views: what each dashboard page shows, on runs the CPU backend records."""
from __future__ import annotations

import io
import re
import zipfile
from pathlib import Path

import pandas as pd
import pytest
import torch

import dpprof
import dpprof.findings
from dpprof.findings import FINDING_COLUMNS, run_findings
from dpprof.store.reader import TABLES
from dpprof.store.schema import AGGREGATE_TABLES
from dpprof.views import compare, export, load, overview
from dpprof.views.text import display_table, run_label
from dpprof.trace import import_traces
from dpprof.units import mib
from recorded import RunningRun, record, record_failed, record_failed_before_a_step

TRACES = Path(__file__).resolve().parents[1].parent / "shared" / "traces"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    directory = tmp_path_factory.mktemp("reports")
    return {"plain": record(directory, "=plain", workers=2, steps=6, batch_size=32),
            "balanced": record(directory, "balanced", workers=3, steps=6, batch_size=33, balanced=True)}


def test_overview_has_the_tax_and_the_findings_of_all_steps(runs):
    run = runs["plain"]
    data = overview.overview(run)
    assert data.stats["steps"] == 6 and len(data.steps) == 6 and len(data.breakdown) == 6
    pd.testing.assert_frame_equal(data.findings.table, run_findings(run).table)
    assert data.findings.scope == "from all 6 steps"


def _tax_of_records(run) -> tuple[float, float]:
    """(share of the mean step, ms a step) of scatter + replicate + gather over the steps past the first, from the
    run's own rows: an independent computation of the one tax figure."""
    later = run.steps[run.steps["step"] > run.steps["step"].min()]
    phases = run.phases[run.phases["step"].isin(later["step"]) & run.phases["phase"].isin(["scatter", "replicate",
                                                                                              "gather"])]
    ms = phases["duration_ms"].sum() / len(later)
    return ms / later["duration_ms"].mean(), ms


@pytest.mark.parametrize("kind", ["plain", "balanced"])
def test_the_dataparallel_tax_is_one_figure_on_the_overview_in_its_finding_and_in_compare(runs, kind, monkeypatch):
    """The Overview's section and metric said the tax over every step (13.2%) while its finding, on the same page,
    said it over the steps past the first (11%): one figure now, the finding's, wherever it is said."""
    run = runs[kind]
    share, ms = _tax_of_records(run)
    data = overview.overview(run)
    assert data.tax_pct == pytest.approx(100 * share) and data.tax_ms == pytest.approx(ms)
    assert compare.compare_part(run).row["dp_tax_pct"] == pytest.approx(100 * share)
    # the finding states it (its floors lowered so that it is raised on these few-ms steps)
    monkeypatch.setattr(dpprof.findings.dataparallel, "DP_TAX_WARN", 0.0)
    monkeypatch.setattr(dpprof.findings.dataparallel, "worth_time", lambda *a: True)
    [tax] = [f for f in run_findings(run).table.itertuples() if f.kind == "dataparallel_tax"]
    assert tax.value == pytest.approx(share) and f"take {share:.0%} of the step" in tax.title
    assert f"of a {run.steps['duration_ms'].iloc[1:].mean():.2f} ms mean step" in tax.evidence
    # a long finished run's Overview reads the stored findings' steps: the same figure (every step's detail kept here)
    monkeypatch.setattr(dpprof.findings, "FINDINGS_FULL_STEPS", 3)
    assert overview.overview(run).tax_pct == pytest.approx(100 * share)


def test_findings_of_a_large_finished_run_are_the_stored_ones(runs, monkeypatch):
    monkeypatch.setattr(dpprof.findings, "FINDINGS_FULL_STEPS", 3)
    found = run_findings(runs["plain"])
    assert found.scope == "stored when the run finished, from all 6 steps"
    pd.testing.assert_frame_equal(found.table, runs["plain"].findings.drop(columns="rank"))


def test_findings_of_a_large_running_run_use_its_last_steps(reports, monkeypatch):
    monkeypatch.setattr(dpprof.findings, "FINDINGS_FULL_STEPS", 3)
    with RunningRun(reports) as live:
        run = dpprof.load_run(live.path)
        assert run.meta["status"] == "running"
        found = run_findings(run)
    assert found.scope.startswith("from the last 3 of ") and list(found.table.columns) == FINDING_COLUMNS


def test_load_says_in_words_what_a_cpu_run_does_not_have(runs):
    data = load.load(runs["plain"])
    assert set(data.missing) == {"allocator", "gpu_samples"}
    assert "CPU workers" in data.missing["allocator"] and "CPU workers" in data.missing["gpu_samples"]
    why = "the GPUs here are not sampled" if torch.cuda.is_available() else "no CUDA GPU visible"
    assert why in data.missing["gpu_samples"]  # the recorder's own note
    assert data.gpu.empty and not data.work_stats.empty and not data.memory.empty


def test_compare_states_the_differences_against_the_first_run(runs):
    data = compare.compare([runs["plain"], runs["balanced"]])
    assert data.summary["devices"].tolist() == [2, 3]
    text = "\n".join(data.differences)
    b, a = run_label(runs["balanced"].meta), run_label(runs["plain"].meta)
    assert (f"{b} is DataParallel, balanced (DataParallelModel + DataParallelCriterion) on 3 CPU workers, {a} "
            "DataParallel on 2 CPU workers.") in text
    assert f"Batch size: {b} 33, {a} 32." in text
    assert "Median step:" in text and "DataParallel tax" in text
    assert set(data.shares["run"]) == {a, b} and set(data.memory["run"]) == {a, b}
    shares = data.shares.groupby("run")["share_pct"].sum()
    assert shares.round(6).tolist() == [100.0, 100.0]


def test_compare_names_the_work_its_imbalance_ratio_is_of(tmp_path, profiled):
    """A DDP rank's verdict weighs data + forward + backward compute (the straggler verdict's work), not the run's
    work phases alone: Compare names what it measured, as the Overview does."""
    profiled(tmp_path, "tutorial-linear", "--ddp", "--nproc", "2", "--steps", "4")  # recorded once a session
    run = dpprof.load_run(dpprof.list_runs(tmp_path)["id"].iloc[0], tmp_path)
    verdict = run_findings(run).straggler
    assert verdict is not None and verdict.work != run.model.work.label  # the test's point
    data = compare.compare([run, run])
    assert data.summary["work"].tolist() == [verdict.work] * 2 == [overview.glance(run).work_phase] * 2
    assert data.differences[-1].startswith(f"Slowest device's median {verdict.work} over the others': ")


def test_compares_slowest_device_ratio_is_the_slowest_by_work_where_no_straggler_is_named(tmp_path, profiled):
    """An FSDP rank's work holds its collectives, so the rank that waits least in them (the collectives' verdict) is
    the fastest by work: where the verdict names no straggler, Compare's "slowest device's median work over the
    others'" is the slowest device's by work (at least 1x), not that rank's (0.54x); a named one is the Overview's."""
    profiled(tmp_path, "tutorial-linear", "--fsdp", "--nproc", "2", "--steps", "4")  # recorded once a session
    run = dpprof.load_run(dpprof.list_runs(tmp_path)["id"].iloc[0], tmp_path)
    verdict = run_findings(run).straggler
    assert verdict is not None and verdict.collectives is not None
    ratio = compare.compare([run, run]).summary["imbalance_ratio"].tolist()
    # named or not, the slowest device's by work (a named rank from the collectives: test_collectives)
    assert ratio == [verdict.found.ratio] * 2 and ratio[0] >= 1.0, (ratio, verdict.slowest, verdict.found.slowest)

def test_compare_reads_each_device_s_memory_as_the_overview_does(runs, tmp_path):
    """An imported GPU trace's memory is the CUDA allocator's peak allocated (dpprof accounts nothing to its device):
    Compare sets it beside a recorded run's, each run's figure as its Overview reads it, and no ratio of the two."""
    trace = dpprof.load_run(import_traces([TRACES / "resnet50-1gpu-tb-sample.pt.trace.json.gz"], tmp_path).id,
                            tmp_path)
    data = compare.compare([trace, runs["plain"]])
    for run in (trace, runs["plain"]):
        seen = overview.glance(run)
        shown = data.memory[data.memory["run"] == run_label(run.meta)]
        assert shown.set_index("device")["peak_bytes"].to_dict() == seen.devices.set_index("device")["peak_bytes"].to_dict()
        assert set(shown["memory"]) == {seen.memory_source} and len(shown)
    peak = float(data.summary.loc[0, "fullest_device_peak_bytes"])
    assert peak == overview.glance(trace).devices["peak_bytes"].max() > 2**30  # the 2.60 GiB the Overview says
    said = next(line for line in data.differences if line.startswith("Memory"))
    assert said.startswith("Memory, measured differently: ")
    assert f"({trace.model.devices[0]}) {mib(peak)} peak allocated (CUDA allocator)" in said
    assert f"{mib(peak)} in" not in said and "x (" not in said  # no ratio of two measures


def test_compare_says_a_part_a_run_does_not_time_as_not_timed_never_zero(runs, tmp_path):
    """A DataParallel run's data and optimizer are inside its rest: against an imported trace that times them, they
    are said as not timed apart, never as 0.0% of its step."""
    trace = dpprof.load_run(import_traces([TRACES / "resnet50-1gpu-tb-sample.pt.trace.json.gz"], tmp_path).id,
                            tmp_path)
    plain = runs["plain"]
    for pair in ([plain, trace], [trace, plain]):
        data = compare.compare(pair)
        said = "\n".join(data.differences)
        assert not re.search(r"(?<![\d.])0\.0%", said)  # 0.0% alone, not the end of 70.0%
        assert not any(line.startswith(("Data:", "Optimizer:")) for line in data.differences)
        shares = data.summary.set_index("id").loc[trace.id]
        assert (f"{run_label(plain.meta)} does not time data or optimizer apart (whatever of them runs inside its "
                f"steps is in the rest of its step): {run_label(trace.meta)}'s step is "
                f"{shares['data_share_pct']:.1f}% data, {shares['optimizer_share_pct']:.1f}% optimizer.") in said
        assert "Compute: " in said  # a part both time is still set side by side


def test_compare_says_the_dataparallel_tax_a_run_has_and_the_other_lacks_as_the_tax_figure(runs, tmp_path):
    """Against a run with no DataParallel tax (an imported trace), Compare's sentence states the DataParallel run's tax
    as its row, the Overview and the tax finding do: per step past the first, over the mean step past the first. It
    said the phase table's share over every step, one-time costs of the first step included (2.3% beside the 2.15 of
    its own row)."""
    trace = dpprof.load_run(import_traces([TRACES / "resnet50-1gpu-tb-sample.pt.trace.json.gz"], tmp_path).id,
                            tmp_path)
    plain = runs["plain"]
    share, _ = _tax_of_records(plain)
    for pair in ([plain, trace], [trace, plain]):
        data = compare.compare(pair)
        row = data.summary.set_index("id").loc[plain.id]
        assert row["dp_tax_pct"] == pytest.approx(100 * share) == overview.overview(plain).tax_pct
        assert (f"{run_label(trace.meta)} has no DataParallel tax (it does no scatter, replicate or gather): "
                f"{run_label(plain.meta)}'s is {100 * share:.1f}% of the mean step past the first.") in data.differences


def test_compare_says_first_when_runs_ran_different_workloads_or_did_not_finish(runs, tmp_path):
    """Two models' step times are not set side by side without a word; a failed run (with steps or none) is said
    failed; a run with no steps is said so in a sentence, and two such runs get one."""
    plain, label = runs["plain"], lambda r: run_label(r.meta)  # noqa: E731
    linear = record(tmp_path, "linear", workload="tutorial-linear")
    said = compare.compare([plain, linear]).differences
    assert said[0] == (f"{label(linear)} ran tutorial-linear, {label(plain)} cifar-lenet: different workloads, so "
                       "their step times and throughput are of different work.")
    assert not re.search(r"(?<![\d.])0\.00x", " ".join(said))  # 0.00x alone, not the end of 10.00x
    failed = record_failed(tmp_path)
    assert compare.compare([plain, failed]).differences[0] == f"{label(failed)} failed: the 2 steps it recorded are compared."
    early, late = record_failed_before_a_step(tmp_path), record_failed_before_a_step(tmp_path, "failed late")
    said = compare.compare([plain, early]).differences
    assert said[0] == f"{label(early)} failed."
    assert f"{label(early)} recorded no steps: there is no step time or share of it to compare." in said
    assert " is no steps" not in " ".join(said)
    said = compare.compare([early, late]).differences
    assert said == [f"{label(early)} failed.", f"{label(late)} failed.",
                    f"Neither {label(late)} nor {label(early)} recorded a step: there is no step time, share or memory "
                    "to compare."]


def test_table_csv_is_the_table_with_formulas_neutralised(runs):
    run = runs["plain"]
    steps = pd.read_csv(io.BytesIO(export.table_csv(run, "steps")))
    pd.testing.assert_frame_equal(steps, run.steps, check_dtype=False)
    meta = pd.read_csv(io.BytesIO(export.table_csv(run, "run")))
    assert meta.loc[0, "name"] == "'=plain"  # a spreadsheet shows it instead of running it
    with pytest.raises(KeyError):
        export.table_csv(run, "sqlite_master")


def test_the_run_zip_holds_every_table(runs):
    run = runs["plain"]
    z = zipfile.ZipFile(io.BytesIO(export.run_zip(run)))
    names = {n.split("/")[-1][:-4] for n in z.namelist()}
    assert names == {*TABLES, "run", "device_summary", "phase_totals", *AGGREGATE_TABLES}  # a schema-2 file's
    steps = pd.read_csv(z.open(f"{run.id}/step_blocks.csv"))
    assert steps["steps"].sum() == len(run.steps) and {"p50_ms", "p95_ms"} <= set(steps.columns)
    phases = pd.read_csv(z.open(f"{run.id}/phases.csv"))
    assert len(phases) == len(run.phases)
    listing = export.export_tables(run).set_index("table")
    assert listing.loc["phases", "rows"] == len(run.phases) and listing.loc["memory", "rows"] == len(run.memory)


def test_display_tables_put_units_in_words_and_bytes_in_mib(runs):
    from dpprof.report import summary_of

    summary = summary_of(runs["plain"]).reset_index()
    shown = display_table(summary)
    assert "apply mean (ms)" in shown and "peak held (MiB)" in shown and "apply share of step (%)" in shown
    assert not [c for c in shown.columns if "_" in c]  # no snake_case header left
    assert shown["peak held (MiB)"].tolist() == (summary["peak_held_bytes"] / 2**20).round(2).tolist()
    assert shown["steps"].dtype.kind == "i" and str(shown["chunk size min"].dtype) == "Int64"  # counts as integers
    assert shown["apply mean (ms)"].tolist() == summary["apply_mean_ms"].round(2).tolist()
    big = display_table(pd.DataFrame({"reserved_bytes": [3 * 2**30, 2**29]}))
    assert big["reserved (GiB)"].tolist() == [3.0, 0.5]


def test_bytes_per_step_read_in_a_unit_and_a_finding_names_its_device_once(tmp_path):
    """An imported NCCL trace: its collectives table's bytes sent per step in MiB (the CSV keeps bytes), and its GPU's
    idle finding headed "WARNING: rank:0's GPU is idle ...", not "rank:0: rank:0's GPU ..."."""
    from pathlib import Path

    from dpprof.cli import main
    from dpprof.trace import import_traces
    from dpprof.views.text import finding_heading

    trace = Path(__file__).resolve().parents[1].parent / "shared" / "traces" / "ddp-2ranks-rank0-nccl.json.gz"
    run = dpprof.load_run(import_traces([trace], tmp_path).id, tmp_path)
    comms = overview.overview(run).comms
    shown = display_table(comms)
    sent = comms["sent_per_step_bytes"]
    assert "sent per step" not in shown and "sent_per_step_bytes" not in shown  # no raw bytes under a bare header
    unit = "GiB" if sent.max() >= 2**30 else "MiB" if sent.max() >= 2**20 else "KiB"
    scale = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[unit]
    assert shown[f"sent per step ({unit})"].tolist() == (sent / scale).round(2).tolist()
    assert (sent > 2**20).all()  # the test's point: a figure worth a unit
    found = run_findings(run).table
    assert len(found) and found["device"].notna().any()
    for f in found.itertuples():
        heading = finding_heading(f.severity, f.device, f.title)
        assert heading.count(f.device) == f.title.count(f.device) and heading.endswith(f.title)
        assert heading.startswith(f.severity.upper()) and f"{f.device}: {f.device}" not in heading
    assert main(["--reports-dir", str(tmp_path), "show", run.id]) == 0


def test_compare_opens_on_the_open_run_and_the_newest_finished_one_of_its_workload(runs):
    listing = dpprof.list_runs(runs["plain"].path.parent)
    plain, balanced = runs["plain"].id, runs["balanced"].id
    assert compare.default_compare(listing, balanced) == ([plain, balanced], None)  # the older is the baseline
    failed = listing.assign(status=["failed", "finished"] if listing.loc[0, "id"] == balanced else
                            ["finished", "failed"])
    ids, need = compare.default_compare(failed, plain)
    assert ids == [] and "needs a second finished run of cifar-lenet" in need and "on the New run page (for" in need
    ids, need = compare.default_compare(listing, None)
    assert ids == [] and "Choose a run" in need and "above" in need  # the picker is above the message

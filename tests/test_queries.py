"""dpprof.store.queries: what SQL aggregates equals what pandas computes from the whole tables of a run."""
from __future__ import annotations

import shutil
import sqlite3
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

import dpprof
from dpprof.records import MEMORY_BYTES
from dpprof.store import queries
from dpprof.store.schema import INDEXES, LEGACY_INDEXES
from recorded import record, record_skipped_batches, record_with_gpu_samples


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    directory = tmp_path_factory.mktemp("reports")
    return {"plain": record(directory, "plain", workers=2, steps=7, batch_size=32),
            "balanced": record(directory, "balanced", workers=3, steps=5, batch_size=33, balanced=True),
            "uneven": record(directory, "uneven", workers=3, steps=4, batch_size=5, workload="tutorial-linear")}


def _per_step(run, phase):
    p = run.phases[run.phases["phase"] == phase]
    return p.groupby(["device", "step"])["duration_ms"].sum()


@pytest.mark.parametrize("name", ["plain", "balanced", "uneven"])
def test_phase_means_are_per_step_sums_over_every_step_and_say_so(runs, name, capsys):
    """show's phase table: each phase's per-step sum, averaged over every step (as the Overview's shares of the step),
    computed here from the raw rows; show's table has the same figures and its heading says what they are over (a
    6-step DDP run's table gave a 9.98 ms backward beside the all-reduce table's 5.71 ms busy per step past the
    first, unsaid)."""
    from dpprof.cli import main

    run = runs[name]
    steps = run.phases.groupby("device")["step"].nunique()  # every step the device took part in
    expected = run.phases.groupby(["device", "phase"])["duration_ms"].sum() / steps
    means = queries.phase_means(run)
    for (device, phase), ms in expected.items():
        assert means.loc[device, f"{phase}_ms"] == pytest.approx(ms, rel=1e-9), (device, phase)
    assert means.notna().sum().sum() == len(expected)
    assert main(["--reports-dir", str(run.path.parent), "show", run.meta["id"]]) == 0
    out = capsys.readouterr().out
    assert "(mean and share over every step, the first's one-time costs included; p50 and p95 over the steps past" in out
    shown = out.split("mean ms per step (every step, the first's one-time costs included, as the Overview's shares), "
                      "by phase:\n")[1].split("\n\n")[0]
    row = next(line for line in shown.splitlines() if line.startswith(means.index[0]))
    first = means.iloc[0].dropna().iloc[0]
    assert f"{first:,.2f}" in row


def test_phase_means_count_an_evaluation_step_without_backward_as_the_overviews_shares_do(tmp_path, capsys):
    """Training steps and evaluation steps under no_grad (no backward): show's backward was averaged over the steps that
    ran one (56.88 ms a step on a run of 14 training and 2 evaluation steps, beside the Overview's 49.77) under a
    heading saying every step, as the Overview's shares; now over every step, as phase_totals' per_step_ms. A device
    left without a chunk (the last evaluation's batch of 1) is averaged over the steps it took part in, as the
    per-device summary's apply mean."""
    import torch
    from torch import nn

    from dpprof.cli import main

    net = dpprof.DataParallel(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 4)),
                              device_ids=dpprof.cpu_devices(2))
    with dpprof.record(name="train-and-eval", reports_dir=str(tmp_path)) as recording:
        for i in range(6):
            with recording.step():
                if i % 3 == 2:
                    with torch.no_grad():
                        net(torch.randn(32 if i < 5 else 1, 64))
                else:
                    net(torch.randn(32, 64)).sum().backward()
    run = dpprof.load_run(recording.path)
    backward = run.phases[run.phases["phase"] == "backward"]
    assert backward["step"].nunique() == 4 and len(run.steps) == 6
    means = queries.phase_means(run)
    expected = backward["duration_ms"].sum() / 6
    assert means.loc["cpu:0", "backward_ms"] == pytest.approx(expected, rel=1e-9)
    totals = queries.phase_totals(run).set_index("phase")
    assert means.loc["cpu:0", "backward_ms"] == pytest.approx(totals.loc["backward", "per_step_ms"], rel=1e-6)
    apply = run.phases[(run.phases["phase"] == "apply") & (run.phases["device"] == "cpu:1")]
    assert apply["step"].nunique() == 5
    work = queries.work_stats(run).set_index("device")
    assert means.loc["cpu:1", "apply_ms"] == pytest.approx(apply["duration_ms"].sum() / 5, rel=1e-9)
    assert means.loc["cpu:1", "apply_ms"] == pytest.approx(work.loc["cpu:1", "work_mean_ms"], rel=1e-9)
    capsys.readouterr()
    assert main(["--reports-dir", str(tmp_path), "show", run.meta["id"]]) == 0
    row = next(line for line in capsys.readouterr().out.split("by phase:\n")[1].splitlines() if line.startswith("cpu:0"))
    assert row.split()[-1] == f"{expected:,.2f}"


def test_show_says_where_its_phases_overlap_and_by_how_much_with_the_overviews_share(tmp_path, capsys):
    """A real trace whose optimizer steps inside backward (optimizer in backward): show's table read optimizer ~200 ms
    a step beside backward's, under a heading 'as the Overview's shares', whose share gives it none; show now says
    the phases overlap, with the Overview's figure."""
    from cpu_traces import optimizer_in_backward_trace

    from dpprof.cli import main
    from dpprof.trace import import_traces

    run = dpprof.load_run(import_traces([optimizer_in_backward_trace(tmp_path / "t")], tmp_path, jobs=1).id, tmp_path)
    means, totals = queries.phase_means(run), queries.phase_totals(run).set_index("phase")
    overlaps = queries.phase_overlaps(run, means)
    assert overlaps["phase"].tolist() == ["optimizer"]
    row = overlaps.iloc[0]
    assert row["mean_ms"] == pytest.approx(means.loc["cpu:0", "optimizer_ms"]) and row["mean_ms"] > 0
    assert row["part_ms"] == pytest.approx(totals.loc["optimizer", "per_step_ms"], abs=1e-9)
    assert row["part_ms"] < 0.05 * row["mean_ms"]
    capsys.readouterr()
    assert main(["--reports-dir", str(tmp_path), "show", run.id]) == 0
    out = capsys.readouterr().out
    assert (f"(phases overlap in the steps, so they add up to more than the step: optimizer on cpu:0 "
            f"{row['mean_ms']:,.2f} ms, {row['part_ms']:,.2f} ms of it outside the others; the Overview's shares count "
            "each moment once)") in out


@pytest.mark.parametrize("name", ["plain", "balanced", "uneven"])
def test_run_stats_equal_the_steps_table(runs, name):
    run = runs[name]
    stats = queries.run_stats(run)
    steps = run.steps
    assert stats["steps"] == len(steps) and (stats["first_step"], stats["last_step"]) == (0, len(steps) - 1)
    assert stats["mean_step_ms"] == pytest.approx(steps["duration_ms"].mean())
    assert stats["total_ms"] == pytest.approx(steps["duration_ms"].sum())
    assert stats["median_step_ms"] == pytest.approx(steps["duration_ms"].median())  # the mean of the middle two
    counts = steps["batch_size"].value_counts()
    assert stats["batch_size"] == counts[counts == counts.max()].index.max()  # the batch most steps ran


def test_the_runs_batch_is_the_one_most_steps_ran_on_every_surface(tmp_path, capsys):
    """A loader of 16-sample batches with one of 256: show said "batch 256" (the largest step's) and the Overview's
    and the Compare page's samples/s were 256 over the median step, 16 times the run's; every surface now says the
    batch most steps ran, as steps.csv counts it, and show says the others' range."""
    import torch
    from torch import nn

    from dpprof.cli import main
    from dpprof.views.compare import compare

    net = dpprof.DataParallel(nn.Linear(8, 4), device_ids=dpprof.cpu_devices(2))
    with dpprof.record(name="batches", reports_dir=str(tmp_path)) as recording:
        for size in [16, 16, 16, 16, 256, 16, 16, 16, 16, 16]:
            with recording.step():
                net(torch.randn(size, 8)).sum().backward()
    run = dpprof.load_run(recording.path)
    assert main(["--reports-dir", str(tmp_path), "export", run.id, "--out", str(tmp_path / "csv")]) == 0
    steps_csv = pd.read_csv(tmp_path / "csv" / "steps.csv")
    assert steps_csv["batch_size"].mode().tolist() == [16] and steps_csv["batch_size"].max() == 256
    stats = queries.run_stats(run)
    assert (stats["batch_size"], stats["batch_size_steps"], stats["batch_size_min"], stats["batch_size_max"]) == \
        (16, 9, 16, 256)
    capsys.readouterr()
    assert main(["--reports-dir", str(tmp_path), "show", run.id]) == 0
    assert "batch 16 (9 of 10 steps; 16 to 256)" in capsys.readouterr().out
    row = compare([run]).summary.iloc[0]
    # samples/s counts each step's own batch, the 256 too (queries.throughput): the words say the batch most ran
    ends = run.steps["start_ms"] + run.steps["duration_ms"]
    assert row["batch_size"] == 16 and row["samples_per_s"] == pytest.approx(
        (16 * 8 + 256) / (ends.iloc[-1] - ends.iloc[0]) * 1e3, rel=1e-9)


def test_an_empty_batch_is_a_step_of_batch_0_on_every_surface(tmp_path, capsys):
    """A forward of a 0-sample batch (a sampler's empty tail) in the fourth of six steps: steps.csv and the per-device
    chunk sizes count it (chunk size mean 6.67 = 40 / 6), but show said "batch 16" as if every step ran 16 (the batch
    count left it out without a word); it is now a step of batch 0, said as such."""
    import torch
    from torch import nn

    from dpprof.cli import main
    from dpprof.views.compare import compare
    from dpprof.views.text import batch_words

    net = dpprof.DataParallel(nn.Linear(8, 4), device_ids=dpprof.cpu_devices(2))
    with dpprof.record(name="empty", reports_dir=str(tmp_path), sample_hz=None) as recording:
        for size in [16, 16, 16, 0, 16, 16]:
            with recording.step():
                net(torch.randn(size, 8)).sum().backward()
    run = dpprof.load_run(recording.path)
    assert main(["--reports-dir", str(tmp_path), "export", run.id, "--out", str(tmp_path / "csv")]) == 0
    assert pd.read_csv(tmp_path / "csv" / "steps.csv")["batch_size"].tolist() == [16, 16, 16, 0, 16, 16]
    stats = queries.run_stats(run)
    assert (stats["batch_size"], stats["batch_size_steps"], stats["batch_steps"], stats["batch_size_min"],
            stats["batch_size_max"]) == (16, 5, 6, 0, 16)
    assert batch_words(stats) == "16 (5 of 6 steps; 0 to 16)"  # the Overview's samples/s says it so
    capsys.readouterr()
    assert main(["--reports-dir", str(tmp_path), "show", run.id]) == 0
    assert "batch 16 (5 of 6 steps; 0 to 16)" in capsys.readouterr().out
    assert compare([run]).summary.iloc[0]["batch_size"] == 16


def test_step_times_is_every_step_until_it_must_bucket(runs):
    run = runs["plain"]
    full = queries.step_times(run)
    assert full["step"].tolist() == run.steps["step"].tolist() and (full["steps"] == 1).all()
    assert np.allclose(full["duration_ms"], run.steps["duration_ms"])
    bucketed = queries.step_times(run, max_points=3)  # 7 steps in buckets of 3: 0-2, 3-5, 6
    assert bucketed["step"].tolist() == [0, 3, 6] and bucketed["steps"].tolist() == [3, 3, 1]
    means = run.steps.groupby(run.steps["step"] // 3)["duration_ms"].agg(["mean", "min", "max"])
    assert np.allclose(bucketed["duration_ms"], means["mean"])
    assert np.allclose(bucketed["min_duration_ms"], means["min"])
    assert np.allclose(bucketed["max_duration_ms"], means["max"])


@pytest.mark.parametrize("name, stacked", [
    ("plain", ["scatter", "replicate", "parallel_apply", "gather", "loss", "backward"]),
    ("balanced", ["scatter", "replicate", "parallel_apply", "reduce", "backward"]),
])
def test_phase_breakdown_stacks_the_sequential_phases_and_the_rest_of_the_step(runs, name, stacked):
    run = runs[name]
    breakdown = queries.phase_breakdown(run)
    assert [c[:-3] for c in breakdown.columns if c.endswith("_ms") and c != "step_ms"] == [*stacked, "rest"]
    sums = run.phases.groupby(["step", "phase"])["duration_ms"].sum().unstack().fillna(0)
    for phase in stacked:
        assert np.allclose(breakdown[f"{phase}_ms"], sums[phase]), phase
    parts = breakdown[[f"{p}_ms" for p in stacked]].sum(axis=1)
    assert np.allclose(breakdown["rest_ms"], run.steps["duration_ms"] - parts)
    assert (breakdown["rest_ms"] >= 0).all()


def test_phase_totals_are_shares_of_the_step_that_add_up_to_100(runs):
    run = runs["plain"]
    totals = queries.phase_totals(run).set_index("phase")
    assert totals["share_pct"].sum() == pytest.approx(100)
    backward = run.phases.loc[run.phases["phase"] == "backward", "duration_ms"].sum()
    assert totals.loc["backward", "total_ms"] == pytest.approx(backward)
    assert totals.loc["backward", "per_step_ms"] == pytest.approx(backward / len(run.steps))


@pytest.mark.parametrize("balanced", [False, True])
def test_one_devices_apply_is_a_part_of_its_step_not_its_rest(tmp_path, balanced):
    """On one device torch's DataParallel calls the module itself, with no parallel_apply around it: its apply is a
    part of the step (it was counted in the rest), as show's apply share says; the balanced pair's loss likewise."""
    run = dpprof.load_run(record(tmp_path, "one", workers=1, steps=5, workload="tutorial-linear",
                                 balanced=balanced).path)
    totals = queries.phase_totals(run).set_index("phase")
    assert "parallel_apply" not in totals.index and totals["share_pct"].sum() == pytest.approx(100)
    for phase in ("apply", "loss"):
        recorded = run.phases.loc[run.phases["phase"] == phase, "duration_ms"].sum()
        assert recorded > 0 and totals.loc[phase, "total_ms"] == pytest.approx(recorded), phase
    breakdown = queries.phase_breakdown(run)
    assert np.allclose(breakdown["apply_ms"] + breakdown["rest_ms"] <= breakdown["step_ms"] + 1e-9, True)


@pytest.mark.parametrize("name", ["plain", "balanced", "uneven"])
def test_work_stats_are_per_step_sums_of_every_device(runs, name):
    run = runs[name]
    assert run.model.work.phases == ("apply",)  # a DataParallel run's work is each device's apply
    stats = queries.work_stats(run).set_index("device")
    per_step = _per_step(run, "apply").groupby("device")
    assert stats.index.tolist() == sorted(per_step.groups, key=run.meta["devices"].index)
    assert np.allclose(stats["work_mean_ms"], per_step.mean()[stats.index])
    assert np.allclose(stats["work_max_ms"], per_step.max()[stats.index])
    later = _per_step(run, "apply").drop(run.steps["step"].min(), level="step").groupby("device")
    assert np.allclose(stats["work_p95_ms"], later.quantile(0.95)[stats.index])  # the percentiles: past the first
    assert (stats["steps"] == per_step.size()[stats.index]).all() and not stats["sampled"].any()


@pytest.mark.parametrize("name", ["plain", "balanced", "uneven"])
def test_the_p50_of_show_is_the_findings_median_work(runs, name, capsys):
    """One figure: each device's p50 in dpprof show (and the Load page, device_summary.csv) is the median per step past
    the first that the straggler verdict weighs and the Overview draws (the first step's one-time costs left out)."""
    from dpprof.cli import main
    from dpprof.findings import run_findings
    from dpprof.report import summary_of

    run = runs[name]
    medians = run_findings(run).straggler.found.medians
    p50 = summary_of(run)["apply_p50_ms"]
    assert p50.to_dict() == pytest.approx(medians.to_dict(), rel=1e-12)
    assert main(["--reports-dir", str(run.path.parent), "show", run.id]) == 0
    shown = capsys.readouterr().out
    assert all(f"{ms:,.2f}" in shown for ms in medians)


def test_work_samples_take_every_kth_step_past_the_limit(runs):
    run = runs["plain"]
    samples = queries.work_samples(run, per_device=3)  # 7 steps, at most ~3 per device: steps 0, 3, 6
    assert sorted(set(samples["step"])) == [0, 3, 6]
    stats = queries.work_stats(run, samples)
    assert stats["sampled"].all()
    exact = _per_step(run, "apply").groupby("device")
    assert np.allclose(stats.set_index("device")["work_mean_ms"], exact.mean()[stats["device"]])  # still exact


def test_memory_peaks_are_the_largest_per_step_sums_with_the_output_device_marked(runs):
    run = runs["plain"]
    peaks = queries.memory_peaks(run).set_index("device")
    cols = list(MEMORY_BYTES)
    per = run.memory.groupby(["device", "step"])[cols].sum()
    held = per.sum(axis=1)
    assert np.allclose(peaks["peak_held_bytes"], held.groupby("device").max()[peaks.index])
    for device, row in peaks.iterrows():
        assert per.loc[(device, row["peak_step"]), cols].tolist() == row[cols].tolist()
    assert peaks["output_device"].to_dict() == {"cpu:0": True, "cpu:1": False}
    assert peaks["peak_allocated_bytes"].isna().all()  # CPU workers have no caching allocator
    assert (peaks["chunk_size_mean"] == 16).all()
    balanced = queries.memory_peaks(runs["balanced"])
    assert not balanced["output_device"].any()  # nothing is gathered: no output device holds more


def test_chunk_counts_show_uneven_chunks(runs):
    counts = queries.chunk_counts(runs["uneven"])  # batch 5 on 3 workers: torch.chunk gives 2, 2, 1
    model = counts.dropna(subset=["chunk_size"])
    assert model.groupby("device")["chunk_size"].apply(list).to_dict() == {"cpu:0": [2], "cpu:1": [2], "cpu:2": [1]}
    assert (model["calls"] == 4).all()
    peaks = queries.memory_peaks(runs["uneven"]).set_index("device")
    assert peaks["chunk_size_max"].tolist() == [2, 2, 1]


def test_timeline_is_one_range_of_steps_and_capped(runs):
    run = runs["plain"]
    phases, steps = queries.timeline(run, 2, 4)
    expected = run.phases[run.phases["step"].between(2, 4)]
    assert len(phases) == len(expected) and set(phases["step"]) == {2, 3, 4}
    assert phases["start_ms"].is_monotonic_increasing
    assert np.allclose(phases["end_ms"], phases["start_ms"] + phases["duration_ms"])
    assert steps["step"].tolist() == [2, 3, 4]
    phases, steps = queries.timeline(run, 0, 10_000)
    assert len(steps) == min(len(run.steps), queries.TIMELINE_MAX_STEPS)


def test_no_gpu_samples_on_cpu_workers_is_an_empty_frame(runs):
    series = queries.gpu_series(runs["plain"])
    assert series.empty and "gpu_util_pct" in series.columns


def test_gpu_series_averages_samples_per_gpu(reports, fake_gpus):
    import fake_pynvml
    from recorded import BUS

    fake_gpus([fake_pynvml.gpu(BUS[0]), fake_pynvml.gpu(BUS[1], util=30)])
    run = record_with_gpu_samples(reports)
    series = queries.gpu_series(run)
    assert series.groupby("device")["samples"].sum().to_dict() == run.gpu_samples.groupby("device").size().to_dict()
    assert series.groupby("device")["gpu_util_pct"].mean().to_dict() == {"cuda:0": 90.0, "cuda:1": 30.0}
    few = queries.gpu_series(run, max_points=2)
    assert (few.groupby("device").size() <= 3).all()


def test_a_file_without_the_dashboard_indices_reads_the_same(runs, tmp_path):
    run = runs["plain"]
    copy = tmp_path / run.path.name
    shutil.copy(run.path, copy)
    con = sqlite3.connect(copy)
    for name in INDEXES:
        con.execute(f"DROP INDEX IF EXISTS {name}")
    con.commit()
    con.close()
    bare = dpprof.load_run(copy)
    for fn in (queries.phase_breakdown, queries.work_stats, queries.memory_peaks, queries.chunk_counts,
               queries.phase_totals):
        pd.testing.assert_frame_equal(fn(bare), fn(run), check_dtype=False)


def test_a_new_run_file_has_the_dashboard_indices(runs):
    con = sqlite3.connect(f"file:{runs['plain'].path}?mode=ro", uri=True)
    names = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'index'")}
    con.close()
    assert set(INDEXES) <= names and not set(LEGACY_INDEXES) & names  # the aggregates made those redundant


def test_the_read_side_never_imports_streamlit():
    code = ("import sys, dpprof.store.queries, dpprof.store.model, dpprof.views, dpprof.views.overview, "
            "dpprof.views.load, dpprof.views.timeline, dpprof.views.compare, dpprof.views.export, "
            "dpprof.views.text, dpprof.charts; print('streamlit' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stderr


def test_the_read_side_imports_nothing_of_the_collect_side():
    """The fast half of test_read_side: every module the read side's surfaces import (the slow test then reads
    every kind of run through them), in a fresh interpreter, loads no torch, pynvml, streamlit or dpprof.parallel."""
    code = ("import sys, dpprof, dpprof.charts, dpprof.report, dpprof.cli, dpprof.findings, dpprof.advise, "
            "dpprof.advise.measured, dpprof.advise.predict, dpprof.store.reader, dpprof.views.advise, "
            "dpprof.views.overview, dpprof.views.load, dpprof.views.timeline, dpprof.views.compare, "
            "dpprof.views.export, dpprof.views.text; "
            "print(sorted(m for m in sys.modules if m in ('torch', 'pynvml', 'streamlit') "
            "or m.startswith('dpprof.parallel')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


def test_samples_per_s_is_what_the_run_trained_a_second_on_every_surface(tmp_path, capsys):
    """A loop with a 0.2 s stall inside every 4th step (a DataLoader's refill) and 30 ms of the script's own work
    between steps: the Overview's and the Compare page's samples/s were the batch over the median step (a run with a
    50 ms stall every 4th step: 10,619 samples/s, against 1,867 it trained a second, 5.7x), the median hiding the
    steps that pay for the stalls, and `dpprof show` gave none. One definition,
    queries.throughput, is now read by the Overview, Compare, `dpprof show` and the between_steps finding: the samples
    of the steps past the first over the time from the first step's end to the last's, computed here from the steps
    table itself; a run read from its aggregates gives the same figure."""
    import time

    import torch
    from torch import nn

    from dpprof.cli import main
    from dpprof.findings import run_findings
    from dpprof.store.retention import Retention
    from dpprof.views.compare import compare
    from dpprof.views.overview import overview

    net = dpprof.DataParallel(nn.Linear(8, 4), device_ids=dpprof.cpu_devices(2))
    with dpprof.record(name="stalls", reports_dir=str(tmp_path), sample_hz=None,
                       detail=Retention(mode="all", block_steps=4)) as recording:
        for i in range(16):
            with recording.step():
                if i % 4 == 3:
                    time.sleep(0.2)
                net(torch.randn(16, 8)).sum().backward()
            time.sleep(0.03)
    run = dpprof.load_run(recording.path)
    steps = run.steps.sort_values("step")
    ends = steps["start_ms"] + steps["duration_ms"]
    paid = steps["batch_size"].iloc[1:].sum() / (ends.iloc[-1] - ends.iloc[0]) * 1e3  # samples a second of the run
    stats = queries.run_stats(run)
    assert 16 / stats["median_step_ms"] * 1e3 > 1.5 * paid  # what the median hides: the stalls and the gaps
    assert compare([run]).summary.iloc[0]["samples_per_s"] == pytest.approx(paid, rel=1e-9)
    rate = queries.throughput(run)
    assert rate is not None and rate.samples == 15 * 16 and rate.samples_per_s == pytest.approx(paid, rel=1e-9)
    assert queries.throughput_of(run.steps) == rate  # SQLite's sums for one file, the definition's on the rows
    aggregated = dpprof.load_run(recording.path, read="aggregates")
    assert aggregated.model.aggregated
    assert queries.throughput(aggregated) == rate
    assert overview(run).throughput == rate == overview(aggregated).throughput
    assert compare([aggregated]).summary.iloc[0]["samples_per_s"] == pytest.approx(paid, rel=1e-9)
    capsys.readouterr()
    assert main(["--reports-dir", str(tmp_path), "show", run.id]) == 0
    assert f"\n  {paid:,.0f} samples/s: 240 samples of the 15 steps past the first in the " in capsys.readouterr().out
    between = run_findings(run).table.set_index("kind").loc["between_steps"]  # headline = finding
    assert f"{paid:,.0f} samples/s (the run's samples/s)" in between["evidence"]


def test_samples_per_s_counts_the_training_steps_samples_not_the_evaluations(tmp_path, capsys):
    """An evaluation forward of 256 samples under no_grad after every third training step of 32, each in a step of
    its own: samples/s counted the evaluations' samples as trained (a run of this kind: 1,376 samples where the
    training steps past the first ran 352, 1,178 samples/s against 301). It now counts the samples of the steps a
    backward ran in, over the whole time (the evaluations' included), and says how many evaluation steps it left
    out; a run of training steps alone counts every step, as before."""
    import torch
    from torch import nn

    from dpprof.cli import main

    net = dpprof.DataParallel(nn.Linear(8, 4), device_ids=dpprof.cpu_devices(2))
    with dpprof.record(name="evaluations", reports_dir=str(tmp_path), sample_hz=None) as recording:
        for i in range(9):
            with recording.step():
                net(torch.randn(32, 8)).sum().backward()
            if i % 3 == 2:
                with torch.no_grad(), recording.step():
                    net(torch.randn(256, 8))
    run = dpprof.load_run(recording.path)
    steps = run.steps.sort_values("step")
    ends = steps["start_ms"] + steps["duration_ms"]
    trains = steps["step"].isin(run.phases.loc[run.phases["phase"] == "backward", "step"])
    assert trains.sum() == 9 and (~trains).sum() == 3
    later = steps.iloc[1:]
    trained = later.loc[trains.iloc[1:], "batch_size"].sum()
    assert trained == 8 * 32
    rate = queries.throughput(run)
    assert rate is not None and rate.samples == trained and rate.evaluation_steps == 3
    # SQLite's sums for one file, the definition's on the rows
    assert queries.throughput_of(run.steps, queries.training_steps_of(steps.loc[trains, "step"], steps["step"])) == rate
    assert rate.samples_per_s == pytest.approx(trained / (ends.iloc[-1] - ends.iloc[0]) * 1e3, rel=1e-9)
    capsys.readouterr()
    assert main(["--reports-dir", str(tmp_path), "show", run.id]) == 0
    assert (f"  {rate.samples_per_s:,.0f} samples/s: 256 samples of the 8 training steps past the first (not the 3 "
            "evaluation steps') in the ") in capsys.readouterr().out
    aggregated = dpprof.load_run(recording.path, read="aggregates")
    assert queries.throughput(aggregated) == rate  # the blocks' counts
    assert queries.kind_medians(aggregated) == pytest.approx(queries.kind_medians(run), rel=0.01)  # the sketches'


@pytest.mark.parametrize("first", ["training", "evaluation"])
def test_samples_per_s_leaves_out_evaluations_after_their_detail_is_thinned(tmp_path, first):
    """A long run keeps only some steps' phases (dpprof.store.retention): samples/s read from its aggregates counted
    every step's samples, the evaluations' too, as trained. Each block of steps now counts the steps a backward ran in
    and their samples as the writer adds them up, so the run read from its aggregates, the phases of most of its
    evaluation steps deleted, gives what the script trained: counted here from the order the script ran its steps in.
    The first step's kind counts in telling the run mixes its kinds, not in its samples, either way round. Each kind's
    median step, which `dpprof show` gives beside the median of every step, was none for such a run: it now comes
    from the writer's sketch of each kind."""
    import torch
    from torch import nn

    from dpprof.store.retention import Retention

    net = dpprof.DataParallel(nn.Linear(8, 4), device_ids=dpprof.cpu_devices(2))
    kinds = []  # the script's own account of what each step did
    thin = Retention(first_steps=2, last_steps=2, every=1000, chunk_steps=4, block_steps=4, outliers_per_chunk=1)
    with dpprof.record(name="evaluations", reports_dir=str(tmp_path), sample_hz=None, detail=thin) as recording:
        for i in range(30):
            evaluation = (i % 3 == 2) if first == "training" else (i % 3 == 0)
            with recording.step():
                if evaluation:
                    with torch.no_grad():
                        net(torch.randn(256, 8))
                else:
                    net(torch.randn(32, 8)).sum().backward()
            kinds.append("evaluation" if evaluation else "training")
    run = dpprof.load_run(recording.path, read="aggregates")
    assert run.model.aggregated
    steps = run.steps.sort_values("step").reset_index(drop=True)
    assert len(steps) == 30 and steps["batch_size"].tolist() == [256 if k == "evaluation" else 32 for k in kinds]
    kept = set(dpprof.load_run(recording.path, read="rows").phases["step"])
    assert len(kept) < 20  # most steps' phases are gone: their kinds are no longer in the detail
    later = pd.Series(kinds[1:])
    trained = int((later == "training").sum())
    ends = steps["start_ms"] + steps["duration_ms"]
    rate = queries.throughput(run)
    assert rate is not None and rate.samples == 32 * trained and rate.evaluation_steps == 29 - trained
    assert rate.samples_per_s == pytest.approx(32 * trained / (ends.iloc[-1] - ends.iloc[0]) * 1e3, rel=1e-9)
    # each kind's median step too, from the writer's sketches of each kind: a sketch's quantile is within 1% of the
    # lower middle step's, and the two medians are those of the script's own kinds of steps
    medians = queries.kind_medians(run)
    assert medians is not None
    for kind in ("training", "evaluation"):
        durations = steps.loc[[k == kind for k in kinds], "duration_ms"]
        assert medians[kind] == pytest.approx(float(np.quantile(durations, 0.5, method="lower")), rel=0.01)


@pytest.mark.parametrize("kinds", ["TTRTTETRTTETTRTE", "TTRTTTTRTTTTTRTT"])
@pytest.mark.parametrize("detail", ["all", "thinned"])
def test_a_step_whose_forward_raised_is_neither_a_training_nor_an_evaluation_step(tmp_path, capsys, kinds, detail):
    """A script that skips a batch whose forward raised out of memory (try: forward, backward; except: zero_grad, go
    on) leaves a step of forward phases and no backward, which counted as an evaluation step: samples/s said "not the
    3 evaluation steps'" of a run that evaluated nothing, and `dpprof show` gave the failed forwards' median as the
    evaluation steps'. Each step now records its forward calls that raised; a step with one that ran no backward is
    neither kind: its samples are not counted, its time is in the span, it is in neither kind's median, and `dpprof
    show` says how many there were. The figures are the script's own account of its steps ("T" trained, "E"
    evaluated, "R" raised), read from the rows and from the aggregates alike, a thinned run's from its blocks."""
    from dpprof.cli import main
    from dpprof.store.retention import Retention

    retention = (Retention(mode="all", block_steps=4) if detail == "all" else
                 Retention(first_steps=2, last_steps=2, every=1000, chunk_steps=4, block_steps=4, outliers_per_chunk=1))
    path = record_skipped_batches(tmp_path, kinds, detail=retention)
    def reads_of(file):  # a thinned run's rows no longer tell its steps' kinds
        return [dpprof.load_run(file, read="aggregates"), *([dpprof.load_run(file, read="rows")] if detail == "all" else [])]

    reads = reads_of(path)
    steps = reads[0].steps.sort_values("step").reset_index(drop=True)
    assert len(steps) == len(kinds)
    later = kinds[1:]
    ends = steps["start_ms"] + steps["duration_ms"]
    for run in reads:
        rate = queries.throughput(run)
        assert rate is not None
        assert rate.evaluation_steps == later.count("E"), run.model.aggregated
        assert rate.raised_steps == later.count("R") and rate.samples == 32 * later.count("T")
        assert rate.samples_per_s == pytest.approx(32 * later.count("T") / (ends.iloc[-1] - ends.iloc[0]) * 1e3,
                                                   rel=1e-9)
        assert queries.raised_steps(run) == kinds.count("R")
        medians = queries.kind_medians(run)
        if "E" not in kinds:  # training steps and failed forwards: one kind of step
            assert medians is None
            continue
        assert medians is not None
        for kind, letter in (("training", "T"), ("evaluation", "E")):
            durations = steps.loc[[k == letter for k in kinds], "duration_ms"]
            # a sketch's quantile is within 1% of the lower middle step's
            expected = np.quantile(durations, 0.5, method="lower") if run.model.aggregated else durations.median()
            assert medians[kind] == pytest.approx(float(expected), rel=0.01), kind
    capsys.readouterr()
    assert main(["--reports-dir", str(tmp_path), "show", str(path)]) == 0
    out = capsys.readouterr().out
    counted, evaluations = ("training steps", "the 3 evaluation steps', nor ") if "E" in kinds else ("steps", "")
    assert (f" samples/s: {32 * later.count('T'):,} samples of the {later.count('T')} {counted} past the first "
            f"(not {evaluations}those of the 3 steps whose forward raised) in the ") in out
    assert "\n  3 steps' forward raised, the script going on (an out-of-memory batch skipped): " in out
    # a file written before the columns that tell such steps apart reads as before: they are evaluation steps
    old = tmp_path / "older" / "older.sqlite"
    old.parent.mkdir()
    shutil.copyfile(path, old)
    con = sqlite3.connect(old)
    con.execute("ALTER TABLE steps DROP COLUMN raised_calls")
    con.execute("ALTER TABLE step_blocks DROP COLUMN raised_steps")
    con.commit()
    con.close()
    for run in reads_of(old):
        rate = queries.throughput(run)
        assert rate is not None and (rate.evaluation_steps, rate.raised_steps) == (later.count("E") + 3, 0)
        assert queries.raised_steps(run) == 0


def test_samples_per_s_words_say_one_evaluation_steps_samples_in_the_singular(tmp_path, capsys):
    """A run with one evaluation step past the first said "(not the 1 evaluation step')": the plural's apostrophe
    after the singular noun. One evaluation step is now "step's", several "steps'"."""
    import torch
    from torch import nn

    from dpprof.cli import main

    net = dpprof.DataParallel(nn.Linear(8, 4), device_ids=dpprof.cpu_devices(2))
    with dpprof.record(name="one evaluation", reports_dir=str(tmp_path), sample_hz=None) as recording:
        for i in range(4):
            with recording.step():
                net(torch.randn(16, 8)).sum().backward()
            if i == 1:
                with torch.no_grad(), recording.step():
                    net(torch.randn(64, 8))
    run = dpprof.load_run(recording.path)
    rate = queries.throughput(run)
    assert rate is not None and rate.evaluation_steps == 1
    assert main(["--reports-dir", str(tmp_path), "show", run.id]) == 0
    out = capsys.readouterr().out
    assert "48 samples of the 3 training steps past the first (not the 1 evaluation step's) in the " in out
    assert "step')" not in out

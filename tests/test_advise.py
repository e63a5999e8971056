"""dpprof advise on runs the CPU backend records: each scenario's arithmetic, the memory split, the commands, the
JSON, the runs it cannot predict from, --check on one scenario, and the Advisor page."""
from __future__ import annotations

import json
import math
import shlex
import shutil
import sys
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from streamlit.testing.v1 import AppTest

import dpprof
from dpprof.advise import NotAdvisable
from dpprof.advise.calibration_cache import load_calibration
from dpprof.advise.check import check
from dpprof.advise.measured import MIN_STEPS, chunk_sizes, measure
from dpprof.advise.predict import advise
from dpprof.cli import build_parser, main
from dpprof.plaintext import shown_text
from dpprof.store import queries
from dpprof.trace import import_traces
from dpprof.views.advise import scenario_title
from recorded import record, record_thinned_evaluation

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT.parent / "shared" / "traces" / "resnet50-1gpu-tb-sample.pt.trace.json.gz"
MODEL_FILE = "import torch\ndef make():\n    return torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))\n"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """DataParallel runs on CPU workers: plain (cifar-lenet, 2 workers, batch 32) and half (the same at batch 16),
    balanced (3 workers, batch 33), uneven (3 workers, batch 32: chunks of 11, 11 and 10), tutorial-linear (its
    epoch's last batch of 10 gives a second chunk size), and one of 2 steps."""
    directory = tmp_path_factory.mktemp("advise")
    return SimpleNamespace(
        dir=directory,
        plain=record(directory, "plain", workers=2, steps=6, batch_size=32),
        half=record(directory, "half", workers=2, steps=6, batch_size=16),
        balanced=record(directory, "balanced", workers=3, steps=6, batch_size=33, balanced=True),
        uneven=record(directory, "uneven", workers=3, steps=6, batch_size=32),
        linear=record(directory, "linear", workers=2, steps=14, batch_size=30, workload="tutorial-linear"),
        short=record(directory, "short", workers=2, steps=MIN_STEPS - 1, batch_size=16))


def _record_with_pauses(directory: Path, name: str, pauses_s: list[float]) -> dpprof.StoredRun:
    """DataParallel of a Linear on 2 CPU workers, recorded, each step also sleeping its pause inside the step:
    another job holding the machine, made to order (a sleep lasts at least its time however loaded the machine)."""
    torch.manual_seed(0)
    net = dpprof.DataParallel(torch.nn.Linear(16, 4), device_ids=dpprof.cpu_devices(2))
    with dpprof.record(name=name, reports_dir=str(directory)) as run:
        for pause in pauses_s:
            with run.step():
                net(torch.randn(32, 16)).sum().backward()
                time.sleep(pause)
    return dpprof.load_run(run.path)


@pytest.fixture(scope="module")
def paused(tmp_path_factory):
    """Two runs whose steps pause: stalled (2 of 15 steps past the first take 0.5 s, the rest 20 ms) and noisy
    (every other step 0.5 s, the others 5 ms: the middle half of its steps spans 5 ms to 0.5 s)."""
    directory = tmp_path_factory.mktemp("advise-paused")
    return SimpleNamespace(
        stalled=_record_with_pauses(directory, "stalled", [0.02] * 5 + [0.5] + [0.02] * 5 + [0.5] + [0.02] * 4),
        noisy=_record_with_pauses(directory, "noisy", [0.005, 0.5] * 8))


@pytest.fixture
def calibrated(calibration_home, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(calibration_home))
    cal = load_calibration("cpu", 2, __import__("torch").get_num_threads())
    assert cal is not None
    return cal


def _advice(run, **kwargs):
    """advise() as the Advisor page and dpprof advise give it: this machine's cached calibration, and the cached
    measure of the run's model alone where an earlier dpprof advise made one."""
    from dpprof.advise.compute import cached_compute

    m = measure(run)
    cal = load_calibration("cpu", m.n, m.threads)
    return advise(m, cal, **{"compute": cached_compute(m.run_id, cal.torch_version if cal else None), **kwargs})


ADVISABLE = ["plain", "balanced", "linear"]


@pytest.mark.parametrize("name", ADVISABLE)
def test_every_scenario_is_the_sum_of_its_parts_inside_its_interval(runs, calibrated, name):
    advice = _advice(getattr(runs, name))
    kinds = {(s.scenario, s.devices, s.batch_size) for s in advice.scenarios}
    n, batch = advice.measured.n, advice.measured.batch_size
    assert ("ddp", n, batch) in kinds and ("balanced", n, batch) in kinds
    assert {k for kind, k, b in kinds if kind == "dataparallel" and b == batch} == set(range(1, 2 * n + 1))
    assert {b for kind, k, b in kinds if k == n and b != batch} == {batch // 2, batch * 2}
    for s in advice.scenarios:
        assert math.isclose(s.step_ms, sum(s.parts_ms.values()), rel_tol=1e-12), s.label
        assert all(v >= 0 for v in s.parts_ms.values()), (s.label, s.parts_ms)
        assert s.step_ms_low <= s.step_ms <= s.step_ms_high, s.label


def test_ddp_is_each_ranks_own_chunk_and_the_allreduce_backward_does_not_hide(runs, calibrated):
    advice = _advice(runs.plain)
    m = advice.measured
    [ddp] = [s for s in advice.scenarios if s.scenario == "ddp"]
    assert set(ddp.parts_ms) == {"forward", "loss", "backward_compute", "comm_wait", "rest"}  # no scatter, ...
    assert math.isclose(ddp.step_ms, sum(ddp.parts_ms.values()), rel_tol=1e-12)
    # each rank runs the chunk its device ran, one intra-op thread, alone on its core: its forward is that
    # device's apply (the typical step's, scaled to the median step); the step waits for the slowest rank
    scale = m.step_ms / m.typical_step_ms
    if m.threads // m.n == 1 and m.cores >= m.n:
        assert math.isclose(ddp.parts_ms["forward"], max(m.apply_ms.values()) * scale, rel_tol=1e-9)
    # one bucket (the gradients of cifar-lenet's 62k weights, under DDP's 1 MiB first bucket), launched when
    # backward ends: nothing hides its all-reduce
    assert m.param_bytes < 1 << 20
    # said in the unit that shows it: cifar-lenet's 242 KiB of gradients, not "0.23 MiB"
    assert f"1 gradient bucket of {m.param_bytes / 1024:,.1f} KiB all-reduced" in ddp.changes[1]
    wait = calibrated.ddp_sync_ms + calibrated.allreduce_ms_per_mib * m.param_bytes / 2**20
    # plus the ranks' skew: each step waits for the slower of two ranks whose compute moves as the recorded applies
    # did (each device's apply over its mean, every step past the first, clipped to the 5th-95th percentiles)
    applies = runs.plain.query("SELECT step, device, duration_ms FROM phases WHERE phase = 'apply' AND call = 0 "
                               "AND step > 0")
    ratios = applies["duration_ms"] / applies.groupby("device")["duration_ms"].transform("mean")
    ratios = ratios.clip(*ratios.quantile([0.05, 0.95]))
    assert sorted(m.apply_ratios) == pytest.approx(sorted(ratios), rel=1e-12)
    r = ratios.to_numpy()
    skew = np.maximum.outer(r, r).mean() / r.mean() - 1  # E[max of 2 draws] over every pair, against the model's sum
    assert skew > 0 and any("slowest of 2" in c for c in ddp.changes)
    # all of it where each rank has a core of its own, none where the two share one (the shared core takes both
    # ranks' work whatever its order), linear between
    for cores, weight in ((2.0, 1.0), (1.0, 0.0), (4 / 3, 0.5)):
        [shared] = [s for s in advise(m, replace(calibrated, effective_cores=cores)).scenarios if s.scenario == "ddp"]
        compute = shared.parts_ms["forward"] + shared.parts_ms["loss"] + shared.parts_ms["backward_compute"]
        assert shared.parts_ms["comm_wait"] - wait == pytest.approx(weight * skew * compute, rel=1e-9, abs=1e-12)
    weight = min(1.0, max(0.0, 2 - max(1.0, 2 / calibrated.effective_cores)))
    compute = ddp.parts_ms["forward"] + ddp.parts_ms["loss"] + ddp.parts_ms["backward_compute"]
    assert ddp.parts_ms["comm_wait"] - wait == pytest.approx(weight * skew * compute, rel=1e-9, abs=1e-12)
    # the step's own work outside DataParallel (its bookkeeping, as the calibration measured it, left out), and
    # what a recorded DDP step adds
    own = max(0.0, m.parts_ms["rest"] * scale - calibrated.machinery(False, 2, "rest"))
    # and, where the two ranks share fewer than 2 cores, the other rank's loading of its batch (half the recorded gap)
    others = (max(1.0, 2 / calibrated.effective_cores) - 1) * m.gap_ms / 2
    assert m.gap_ms > 0 and ddp.parts_ms["rest"] == pytest.approx(own + calibrated.ddp_overhead_ms + others, rel=1e-9)
    assert ddp.peak_bytes == {f"rank:{i}": m.memory[d].held_bytes - m.memory[d].gathered_bytes - m.memory[d].loss_bytes
                              for i, d in enumerate(m.devices)}  # as dpprof accounts a rank: no gather, no loss
    assert ddp.command == "dpprof profile cifar-lenet --ddp --nproc 2 --batch-size 16 --steps 6"


@pytest.mark.parametrize("name", ADVISABLE)
def test_the_recorded_set_up_reproduces_the_measured_step_and_peaks(runs, calibrated, name):
    run = getattr(runs, name)
    advice = _advice(run)
    [same] = [s for s in advice.scenarios if s.recorded]
    assert same.scenario == ("balanced" if name == "balanced" else "dataparallel")
    measured = queries.median_step_ms(run)
    assert advice.measured_step_ms == measured
    assert math.isclose(same.step_ms, measured, rel_tol=1e-9)
    assert same.step_ms_low <= measured <= same.step_ms_high
    peaks = queries.memory_peaks(run)
    assert same.peak_bytes == {d: int(b) for d, b in zip(peaks["device"], peaks["peak_held_bytes"])}


def test_memory_splits_into_what_scales_with_the_batch_and_what_does_not(runs, calibrated):
    advice = _advice(runs.plain)
    m = advice.measured
    worker = m.devices[1]  # not the output device: its chunk, outputs and activations, and its weights
    fixed = m.memory[worker].fixed_bytes
    recorded = m.memory[worker].held_bytes
    twice = next(s for s in advice.scenarios if s.batch_size == 2 * m.batch_size)
    half = next(s for s in advice.scenarios if s.batch_size == m.batch_size // 2)
    assert twice.peak_bytes[worker] - fixed == 2 * (recorded - fixed)
    assert half.peak_bytes[worker] - fixed == (recorded - fixed) // 2
    out = m.output_device  # plus the gathered outputs and the whole batch's loss, both with the batch
    grows = m.memory[out].gathered_bytes + m.memory[out].loss_bytes
    assert twice.peak_bytes[out] == pytest.approx(recorded + (recorded - fixed) + 2 * grows, abs=4)
    [one] = [s for s in advice.scenarios if s.scenario == "dataparallel" and s.devices == 1]
    assert set(one.peak_bytes) == {out} and one.parts_ms["replicate"] == one.parts_ms["gather"] == 0
    assert one.parts_ms["apply"] > 0 and one.parts_ms["parallel_apply"] == 0
    [balanced] = [s for s in advice.scenarios if s.scenario == "balanced"]
    assert balanced.parts_ms["gather"] == 0 and balanced.parts_ms["reduce"] > 0
    assert balanced.peak_bytes[out] < m.memory[out].held_bytes  # no gathered outputs on the output device
    assert any("gather vanishes" in c for c in balanced.changes)


def test_chunks_follow_torch_chunk():
    assert chunk_sizes(10, 3) == [4, 4, 2] and chunk_sizes(10, 8) == [2, 2, 2, 2, 2] and chunk_sizes(5, 4) == [2, 2, 1]


def test_a_per_chunk_cost_is_measured_where_the_run_had_two_chunk_sizes(runs):
    linear = measure(runs.linear)  # batches of 30, 30, 30, 10: chunks of 15 and 5
    assert linear.fixed_apply_ms > 0 and "2 sizes" in linear.fixed_apply_source
    plain = measure(runs.plain)
    assert plain.fixed_apply_ms == 0 and "one size" in plain.fixed_apply_source


def test_largest_batch_that_fits_is_the_last_whose_peak_fits(runs, calibrated):
    cap = 64 * 2**20
    advice = _advice(runs.plain, memory_bytes=cap)
    m = advice.measured
    from dpprof.advise.predict import _Model

    model = _Model(m, calibrated)
    for device, batch in advice.max_batch_size.items():
        assert model.memory(m.n, batch, False)[device] <= cap < model.memory(m.n, batch + 1, False)[device]
    assert advice.max_batch_size[m.output_device] <= advice.max_batch_size[m.devices[1]]
    assert "--memory-gib" in _advice(runs.plain).max_batch_note


def test_json_holds_every_scenario(runs, calibrated, capsys):
    assert main(["--reports-dir", str(runs.dir), "advise", runs.plain.id, "--json", "--memory-gib", "1"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["run"] == runs.plain.id
    assert data["measured_step_ms"] == pytest.approx(queries.median_step_ms(runs.plain), abs=1e-4)  # 4 decimals
    assert data["measured_training_only"] is False  # every step trained: the median is every step's
    assert {s["scenario"] for s in data["scenarios"]} == {"ddp", "dataparallel", "balanced"}
    for s in data["scenarios"]:
        assert set(s) >= {"scenario", "devices", "batch_size", "step_ms", "step_ms_low", "step_ms_high", "peak_bytes",
                          "parts_ms"}
        assert s["step_ms"] == pytest.approx(sum(s["parts_ms"].values()), abs=1e-3)
    assert set(data["max_batch_size"]) == {"cpu:0", "cpu:1"} and all(b > 32 for b in data["max_batch_size"].values())


def test_text_names_each_scenario_its_changes_and_command(runs, calibrated, capsys):
    assert main(["--reports-dir", str(runs.dir), "advise", runs.plain.id]) == 0
    out = capsys.readouterr().out
    for words in ("DDP on 2 ranks (gloo)", "DataParallel on 1 CPU worker", "DataParallel on 4 CPU workers",
                  "DataParallelModel + DataParallelCriterion", "batch 64 on 2 CPU workers", "gather vanishes",
                  "run it: dpprof profile cifar-lenet --ddp --nproc 2 --batch-size 16", "4 workers share",
                  "assumptions:", "Calibration of"):
        assert words in out, words


def test_every_command_is_one_dpprof_profile_can_run(runs, calibrated):
    for name in ADVISABLE:
        for s in _advice(getattr(runs, name)).scenarios:
            argv = shlex.split(s.command)
            while "=" in argv[0]:
                argv = argv[1:]
            assert argv[0] == "dpprof"
            args = build_parser().parse_args(argv[1:])
            assert args.command == "profile" and args.ddp == (s.scenario == "ddp")
            assert args.balanced == (s.scenario == "balanced")
            per_rank = -(-s.batch_size // s.devices) if s.scenario == "ddp" else s.batch_size
            assert args.batch_size == per_rank


def test_the_ddp_command_of_a_batch_the_ranks_do_not_divide_runs_the_chunk_the_prediction_waits_for(tmp_path):
    # batch 5 on 3 workers: the DDP scenario predicts ranks of torch.chunk's 2, 2, 1 samples, its step waiting for a
    # rank of 2; its command ran --batch-size 1 (5 // 3), a rank of half the work, which --check set against it
    m = measure(record(tmp_path, "odd", workers=3, steps=4, batch_size=5, workload="tutorial-linear"))
    [ddp] = [s for s in advise(m, None).scenarios if s.scenario == "ddp"]
    assert ddp.label.endswith("2 samples each") and ddp.profile is not None and ddp.profile.batch_size == 2
    assert ddp.command.endswith("--ddp --nproc 3 --batch-size 2 --steps 4")
    assert ("5 does not split evenly over 3 ranks: the prediction gives them torch.chunk's [2, 2, 1], the command "
            "each rank 2 samples (6 a step)") in "\n".join(ddp.changes)


def test_a_scenario_that_leaves_devices_idle_says_so_and_shares_cores_among_the_devices_that_work(tmp_path):
    # batch 5 on 4 workers: torch.chunk gives 2, 2, 1 and cpu:3 nothing, so 3 workers run; the 4-worker scenario was
    # predicted for 3 threads but its note said "4 workers share the ... cores: each apply runs ...x", the factor of 4
    m = measure(record(tmp_path, "odd", workers=3, steps=4, batch_size=5, workload="tutorial-linear"))
    advice = advise(m, None, batch_sizes=[2])
    four = next(s for s in advice.scenarios if s.scenario == "dataparallel" and s.devices == 4)
    assert four.changes[0] == "torch.chunk splits batch 5 into [2, 2, 1]: 1 CPU worker of 4 gets no chunk and runs nothing"
    assert not any(c.startswith("4 workers share") for c in four.changes)
    assert four.peak_bytes["cpu:3"] == 0
    # batch 2 on the recorded 3: [1, 1]
    [two] = [s for s in advice.scenarios if s.batch_size == 2]
    assert two.changes[0] == "torch.chunk splits batch 2 into [1, 1]: 1 CPU worker of 3 gets no chunk and runs nothing"
    assert not any(c.startswith("3 workers share") for c in two.changes)
    # every device given a chunk: no such note
    assert not any("no chunk" in c for s in advice.scenarios if s.devices in (3, 5) and s.batch_size == 5
                   for c in s.changes)


def test_without_a_calibration_the_read_side_predicts_nothing_and_gives_the_command(runs, tmp_path, monkeypatch):
    from dpprof.views.advise import advisor

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "empty-cache"))
    view = advisor(runs.plain)
    assert view.advice is None and view.command == f"dpprof advise {runs.plain.id}"
    assert view.reason.startswith("No calibration of this machine for 2 CPU workers") and "nothing is predicted" in view.reason
    # the arithmetic itself still runs without one (a GPU run's, or a caller's choice), and says what it left out
    assert any("taken as free" in a for a in advise(measure(runs.plain), None).assumptions)


@pytest.mark.slow
def test_advise_calibrates_itself_the_first_time_and_then_reads_the_cache(runs, tmp_path, monkeypatch, capsys):
    one = record(tmp_path / "reports", "one", workers=1, steps=4, batch_size=16)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)  # someone watching: the progress bar (tqdm) is drawn
    assert main(["--reports-dir", str(tmp_path / "reports"), "advise", one.id]) == 0
    first = capsys.readouterr()
    assert "calibrating this machine for 1 CPU worker at" in first.err
    assert "calibrating for 1 CPU worker(s)" in first.err and "/11 [" in first.err  # 11 measurements at n = 1
    cal = load_calibration("cpu", 1, torch.get_num_threads())
    assert cal is not None and set(cal.dataparallel_ms) == {1, 2}  # measured and cached
    assert f"Calibration of {cal.host}" in first.out and "taken as free" not in first.out
    assert main(["--reports-dir", str(tmp_path / "reports"), "advise", one.id, "--json"]) == 0
    second = capsys.readouterr()
    assert "calibrating" not in second.err  # the cache, not a second measurement
    assert json.loads(second.out)["calibration"]["measured_at"] == cal.measured_at


def test_a_calibration_measured_under_load_predicts_nothing_and_says_why_first(runs, calibrated, tmp_path, monkeypatch):
    from dpprof.advise.calibration_cache import LOADED_THREAD_SPEEDUP, save_calibration
    from dpprof.views.advise import advisor, text_lines

    assert (calibrated.loaded_reason() is None) == (calibrated.thread_speedup >= LOADED_THREAD_SPEEDUP)
    # the calibration behind issue 35: a conv at 0.19x its one-thread speed on 2 threads
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    save_calibration(replace(calibrated, thread_speedup=0.19))
    view = advisor(runs.plain)
    a = view.advice
    assert a.headline() is None and a.withheld.startswith("No predictions: this machine was loaded")
    assert "0.19x as fast on" in a.withheld and f"dpprof advise {runs.plain.id} --calibrate" in a.withheld
    assert all(s.withheld for s in a.scenarios if not s.recorded)
    lines = text_lines(view)
    assert lines[0] == a.withheld and "fastest at batch" not in "\n".join(lines)
    assert sum("no prediction" in line for line in lines) >= len(a.scenarios) - 1


def test_a_thinned_runs_stalls_between_evaluation_steps_are_counted_from_every_step(tmp_path):
    """A run that evaluates (a no_grad forward, its own step) after every other training step, its detail thinned
    (a small Retention), 8 training steps stalled 0.1 s in its middle, where most steps keep no detail. The stall note
    judged the training steps alone, told from their backward: those of the sample whose detail stands for the run,
    so it said "2 of 41 training steps stalled" of this run's 8 of 119 (180 steps in all). It
    counts every step now: each kept step by its kind, a thinned one against the larger kind's median (every step's),
    over which it is a stall whatever its kind, and the training steps from every step's blocks."""
    from dpprof.store.retention import Retention

    small = Retention(first_steps=20, last_steps=20, every=10, chunk_steps=50, outliers_per_chunk=2, block_steps=10)
    stall_at = {40, 48, 56, 64, 72, 80, 88, 97}  # training iterations, all past the first 20 steps
    stored, training = record_thinned_evaluation(tmp_path, small, 120, lambda i: int(i % 2 == 0), stall_at, 0.01, 0.1,
                                                 "thinned-eval")
    assert stored.model.thinned
    per = stored.steps.set_index("step")["duration_ms"].sort_index().iloc[1:]
    trains = per[per.index.isin(training)]
    over = per > 2 * trains.median()
    kept = set(stored.query("SELECT DISTINCT step FROM phases")["step"])
    # the note's count: the training steps over twice their median, and any evaluation step slower than that whose
    # detail was thinned (its kind unknown, a stall either way; none on an idle machine)
    expected = int((over & per.index.isin(training)).sum() + (over & ~per.index.isin(set(training) | kept)).sum())
    stalled_kept = int((over & per.index.isin(training) & per.index.isin(kept)).sum())
    assert expected >= 8 and stalled_kept < expected  # most stalls lost their detail: the note cannot read them there
    note = measure(stored).stall_note
    assert note is not None
    assert note.startswith(f"{expected} of {len(training) - 1} training steps stalled (over 2x the median training "
                           "step of "), note


def test_stalled_steps_are_said_before_the_prediction(paused):
    from dpprof.findings import run_findings
    from dpprof.views.advise import AdvisorView, text_lines

    m = measure(paused.stalled)
    found = run_findings(paused.stalled).table
    assert "outlier_steps" in set(found["kind"])  # the stall finding fires: the advisor uses its rule
    # the rule, computed here from the stored steps past the first: the two 0.5 s pauses are stalls, and a 20 ms step
    # a loaded machine held up past 2x the median is one too (the note counts what the steps say, not the plan)
    steps = paused.stalled.steps.sort_values("step")["duration_ms"].iloc[1:]
    stalled = steps[steps > 2 * steps.median()]
    assert len(steps) == 15 and (steps >= 500).sum() == 2 and (stalled >= 500).sum() == 2
    assert m.stall_note.startswith(f"{len(stalled)} of 15 steps stalled (over 2x the median step")
    a = advise(m, None)
    assert a.said_first == [m.stall_note] and a.withheld is None  # predicted, the stalls said first
    assert text_lines(AdvisorView(a, None, ""))[0] == m.stall_note
    # the typical step the parts come from leaves the two 0.5 s steps out
    assert m.typical_step_ms < 250 and a.headline() is not None


class _PerSample(torch.nn.Module):
    """A Linear whose forward sleeps 2 ms a sample of its chunk: a step's time follows its batch."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(5, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.002 * len(x))
        return self.lin(x)


def test_steps_slow_from_their_own_bigger_batch_are_said_as_the_finding_says_them(tmp_path):
    from dpprof.findings import run_findings

    # dynamic shapes: steps 4 and 8 carry 60 samples, the others 4 (30 ms of apply against 4 ms on each worker): the
    # outlier finding puts them down to their batch; the advisor's note said "stalled: something else ran"
    net = dpprof.DataParallel(_PerSample(), device_ids=dpprof.cpu_devices(2))
    with dpprof.record(name="dynamic", reports_dir=str(tmp_path)) as recording:
        for i in range(10):
            with recording.step():
                net(torch.randn(60 if i in (4, 8) else 4, 5)).pow(2).mean().backward()
    run = dpprof.load_run(recording.path)
    outliers = run_findings(run).table.set_index("kind").loc["outlier_steps"]
    assert "bigger batch than the median step's 4 samples" in outliers["evidence"]
    note = measure(run).stall_note
    assert note is not None and "a bigger batch than the median step's 4 samples" in note
    assert "4 (60 samples)" in note and "8 (60 samples)" in note and "not a stall" in note
    # a step over 2x the median with 4 samples (a loaded machine) is a stall in both
    assert ("something else ran" in note) == ("another process" in outliers["advice"])


def test_a_script_that_evaluates_between_epochs_is_advised_from_its_training_steps(tmp_path):
    """A training script with an evaluation pass under no_grad after each epoch, at the training batch: 8 training
    steps (20 ms of their own work each) and 12 evaluation steps (forwards alone, ~1 ms). The advisor mixed the two
    kinds: its median step was an evaluation step's, its typical step mostly evaluation steps (backward diluted), and
    every training step past the first was "stalled: something else ran on this machine" against that median."""
    from dpprof.views.advise import AdvisorView, text_lines

    torch.manual_seed(0)
    with dpprof.instrument(name="train and evaluate", reports_dir=str(tmp_path), cpu_workers=2) as recording:
        model = torch.nn.DataParallel(torch.nn.Linear(16, 4))  # the script's own torch name, recorded
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):
            for _ in range(4):
                model(torch.randn(8, 16)).pow(2).mean().backward()
                time.sleep(0.02)  # the training step's own work, inside the step (which ends at optimizer.step)
                optimizer.step()
                optimizer.zero_grad()
            with torch.no_grad():
                for _ in range(6):
                    model(torch.randn(8, 16))
    run = dpprof.load_run(recording.path)
    training = set(run.phases.loc[run.phases["phase"] == "backward", "step"])
    assert len(run.steps) == 20 and len(training) == 8 and set(run.steps["batch_size"]) == {8}
    m = measure(run)
    assert m.step_ms == queries.kind_medians(run)["training"] >= 20
    assert m.stall_note is None  # no training step is 2x the training steps' median
    assert m.typical_step_ms >= 20 and m.parts_ms["backward"] > 0
    assert m.typical_steps <= 7 and m.steps == 20
    header = text_lines(AdvisorView(advise(m, None), None, ""))[1]
    assert header.startswith(f"measured: median training step {m.step_ms:.2f} ms (the run's evaluation steps, with no "
                             "backward, left out; 90% interval of the median "), header
    data = advise(m, None).to_json()  # --json says whose median measured_step_ms is
    assert data["measured_training_only"] is True and data["measured_step_ms"] == round(m.step_ms, 4)
    # two training steps beside evaluation steps are too few, said of them
    with dpprof.instrument(name="evaluation mostly", reports_dir=str(tmp_path), cpu_workers=2) as recording:
        model = torch.nn.DataParallel(torch.nn.Linear(16, 4))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):
            model(torch.randn(8, 16)).pow(2).mean().backward()
            optimizer.step()
            with torch.no_grad():
                for _ in range(3):
                    model(torch.randn(8, 16))
    mostly = dpprof.load_run(recording.path)
    with pytest.raises(NotAdvisable, match=f"run {mostly.id} keeps 2 training step\\(s\\) beside its evaluation steps: "
                                           "the advisor needs 3"):
        measure(mostly)


def test_a_run_too_noisy_to_predict_from_headlines_nothing_and_says_its_spread(paused):
    from dpprof.advise.predict import MAX_INTERVAL_RATIO
    from dpprof.views.advise import AdvisorView, scenario_table, text_lines

    m = measure(paused.noisy)
    lo, q25, q75, hi = m.step_spread_ms
    assert q75 / q25 > MAX_INTERVAL_RATIO  # every other step pauses 0.5 s, the others 5 ms
    a = advise(m, None)
    [recorded] = [s for s in a.scenarios if s.recorded]
    assert recorded.interval_ratio > MAX_INTERVAL_RATIO
    assert a.withheld.startswith(f"No predictions: run {m.run_id} is too noisy to predict from")
    assert f"the middle half {q25:,.2f} to {q75:,.2f} ms" in a.withheld and a.headline() is None
    table = scenario_table(a)
    assert table["predicted"].tolist() == table["recorded"].tolist()  # only the measured set-up has a figure
    assert table.loc[~table["predicted"], "step_ms"].isna().all()
    lines = text_lines(AdvisorView(a, None, ""))
    assert a.withheld in lines[:3]


def test_an_interval_over_ten_times_its_low_end_is_no_prediction(runs, calibrated):
    from dpprof.advise.predict import MAX_INTERVAL_RATIO

    a = _advice(runs.plain)
    for s in a.scenarios:
        wide = not s.recorded and s.interval_ratio > MAX_INTERVAL_RATIO
        assert (s.withheld is not None) == (wide or (a.withheld is not None and not s.recorded)), s.label
    best = a.headline()
    if a.withheld is None:
        assert best is not None and best.withheld is None and best.batch_size == a.measured.batch_size
        # the fastest whose whole interval lies under the recorded set-up's step; the recorded one where none does
        [recorded] = [s for s in a.scenarios if s.recorded]
        faster = [s for s in a.scenarios if s.batch_size == best.batch_size and s.withheld is None
                  and not s.recorded and s.step_ms_high < recorded.step_ms]
        assert best.step_ms == min((s.step_ms for s in faster), default=recorded.step_ms)


def test_batch_size_moves_the_compute_that_scales_with_samples(runs, calibrated):
    # chunks of 11, 11 and 10 on three devices: a line through different devices' applies is no per-chunk cost
    m = measure(runs.uneven)
    assert m.chunks == (11, 11, 10) and m.fixed_apply_ms == 0 and "one size" in m.fixed_apply_source
    a = advise(m, calibrated, batch_sizes=[16, 64])
    by_batch = {s.batch_size: s for s in a.scenarios if s.scenario == "dataparallel" and s.devices == 3}
    apply = {b: by_batch[b].parts_ms["parallel_apply"] for b in (16, 32, 64)}
    # each device's compute is per sample: at 64 each device gets twice its samples (22, 22, 20), so the slowest
    # apply gains once more what the recorded one took (the dispatch around it and the run's own level stay)
    assert apply[64] - apply[32] == pytest.approx(max(m.apply_ms.values()) * m.step_ms / m.typical_step_ms, rel=1e-9)
    assert apply[16] < apply[32] < apply[64]
    assert by_batch[64].step_ms > by_batch[32].step_ms > by_batch[16].step_ms
    # a batch asked twice (--batch-sizes 16,16,64) is one scenario, not two rows of the same prediction
    again = advise(m, calibrated, batch_sizes=[16, 16, 64])
    assert [s.batch_size for s in again.scenarios if s.devices == 3 and not s.recorded and s.scenario == "dataparallel"
            ] == [16, 64]
    # a run recorded at B / 2 predicts B: up, by what its compute (apply, backward, loss) is, at most twice its step
    half = measure(runs.half)
    assert half.batch_size == 16 and half.fixed_apply_ms == 0
    a = advise(half, calibrated, batch_sizes=[32])
    [at32] = [s for s in a.scenarios if s.batch_size == 32 and s.scenario == "dataparallel"]
    [at16] = [s for s in a.scenarios if s.recorded]
    grows = {p: at32.parts_ms[p] - at16.parts_ms[p] for p in at16.parts_ms}
    assert half.step_ms < at32.step_ms <= 2 * half.step_ms
    assert grows["parallel_apply"] > 0 and grows["backward"] > 0 and grows["scatter"] == grows["rest"] == 0
    # the slowest device's apply, once more: its chunk doubles (8 -> 16), the dispatch around it does not
    assert grows["parallel_apply"] == pytest.approx(max(half.apply_ms.values()) * half.step_ms / half.typical_step_ms,
                                                    rel=1e-9)
    # and what it holds, against the run really recorded at 32: each worker's activations scale with its chunk
    measured = queries.memory_peaks(runs.plain).set_index("device")["peak_held_bytes"]
    assert at32.peak_bytes["cpu:1"] == pytest.approx(int(measured["cpu:1"]), rel=0.01)


def _recorded_onto_the_host(directory: Path) -> dpprof.StoredRun:
    """DataParallel on 2 CPU workers with torch's output_device=-1 (outputs gathered onto the host), recorded."""
    torch.manual_seed(0)
    net = dpprof.DataParallel(torch.nn.Linear(16, 4), device_ids=dpprof.cpu_devices(2), output_device=-1)
    with dpprof.record(name="onto the host", reports_dir=str(directory)) as run:
        for _ in range(MIN_STEPS + 1):
            with run.step():
                net(torch.randn(32, 16)).sum().backward()
    return dpprof.load_run(run.path)


def test_a_run_gathered_onto_the_host_is_titled_by_the_workers_it_spread_over(tmp_path):
    run = _recorded_onto_the_host(tmp_path)
    assert run.model.devices == ("cpu:0", "cpu:1", "cpu")  # the host's lane holds the gather
    assert run.model.spread == ("cpu:0", "cpu:1") and run.model.title == "DataParallel on 2 CPU workers"
    gathers = run.phases[run.phases["phase"] == "gather"]
    assert len(gathers) == MIN_STEPS + 1 and set(gathers["device"]) == {"cpu"}


@pytest.fixture(scope="module")
def refused(tmp_path_factory, runs, profiled):
    """Runs the advisor cannot predict from: a DDP run, an FSDP run, an imported trace, a run of 2 steps."""
    directory = runs.dir
    profiled(directory, "tutorial-linear", "--ddp", "--nproc", "2", "--steps", "4")  # recorded once a session
    profiled(directory, "tutorial-linear", "--fsdp", "--nproc", "2", "--steps", "4")
    listing = dpprof.list_runs(directory)
    ranks = [dpprof.load_run(run_id, directory) for run_id in listing[listing["ranks"] == 2]["id"]]
    idle = record(directory, "idle", workers=3, steps=4, batch_size=2, workload="tutorial-linear")
    # a batch of at least the devices that still leaves one idle: torch.chunk's chunks of 2 run out at the third
    idle4 = record(directory, "idle4", workers=3, steps=4, batch_size=4, workload="tutorial-linear")
    out = {"ddp": (next(r.id for r in ranks if r.model.kind == "ddp"), "is a DistributedDataParallel run: "),
           "fsdp": (next(r.id for r in ranks if r.model.kind == "fsdp"), "is an FSDP run: "),
           "short": (runs.short.id, f"at least {MIN_STEPS}"),
           "idle": (idle.id, "gave no chunk to cpu:2: torch.chunk splits its batch of 2 into [1, 1] over its 3 "
                    "devices; the advisor predicts from runs whose every device works: record it with a batch 3 "
                    "divides evenly (3)"),
           "idle4": (idle4.id, "gave no chunk to cpu:2: torch.chunk splits its batch of 4 into [2, 2] over its 3 "
                     "devices; the advisor predicts from runs whose every device works: record it with a batch 3 "
                     "divides evenly (3 or 6)"),
           "host": (_recorded_onto_the_host(directory).id, "gathered its outputs onto the host (output_device=-1)")}
    if TRACE.exists():
        out["trace"] = (import_traces([TRACE], directory).id, "imported torch.profiler trace")
    return out


@pytest.mark.parametrize("kind", ["ddp", "fsdp", "trace", "short", "idle", "idle4", "host"])
def test_runs_it_cannot_predict_from_say_why_in_one_line_and_exit_1(runs, refused, kind, capsys):
    if kind not in refused:
        pytest.skip(f"no {TRACE}")
    run_id, words = refused[kind]
    assert main(["--reports-dir", str(runs.dir), "advise", run_id]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    [line] = captured.err.strip().splitlines()
    assert line.startswith(f"dpprof: run {run_id}") and words in line
    with pytest.raises(NotAdvisable):
        measure(dpprof.load_run(run_id, runs.dir))


def test_advise_without_a_run_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["advise"])
    assert exit_.value.code == 2 and "advise needs a run" in capsys.readouterr().err


@pytest.mark.parametrize("given, said", [
    (["--devices", "cpu:3"], "--devices 'cpu:3' is for --calibrate without a run"),
    (["--check-dir", "elsewhere"], "--check-dir is where --check records its runs: give --check too")])
def test_an_option_advise_on_a_run_would_drop_is_a_usage_error(runs, calibrated, given, said, capsys):
    """Not a prediction that leaves the option out (on the run's 2 workers, not the 3 asked for; no check run)."""
    with pytest.raises(SystemExit) as exit_:
        main(["--reports-dir", str(runs.dir), "advise", runs.plain.id, *given])
    captured = capsys.readouterr()
    assert exit_.value.code == 2 and said in captured.err and captured.out == ""


@pytest.mark.slow
def test_calibrate_measures_this_machine_says_what_and_caches_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert main(["advise", "--calibrate", "--devices", "cpu:1"]) == 0
    out = capsys.readouterr().out
    assert "hand-off of a no-op task" in out and "gloo all-reduce across" in out and "cached in" in out
    [path] = (tmp_path / "cache" / "dpprof" / "advise").glob("*-cpu1-t*.json")
    cal = load_calibration("cpu", 1, __import__("torch").get_num_threads())
    assert cal is not None and cal.allreduce_points and set(cal.handoff_ms) == {1, 2}
    assert set(cal.dataparallel_ms) == {1, 2} and cal.dataparallel_ms[2]["replicate"] > 0


def test_check_runs_a_scenario_and_reads_what_it_measured(runs, calibrated, tmp_path, capsys):
    advice = _advice(runs.linear, steps=4)
    [one] = [s for s in advice.scenarios if s.scenario == "dataparallel" and s.devices == 1]
    [checked] = check(advice, tmp_path / "checks", scenarios=[one])
    assert checked.error is None and checked.measured_step_ms > 0 and checked.step_error is not None
    run = dpprof.load_run(checked.run_id, tmp_path / "checks")
    assert run.meta["name"] == f"check of {runs.linear.id}: {one.label}" and run.model.devices == ("cpu:0",)
    assert run.meta["workload_args"]["check_of"] == runs.linear.id  # marked as a check of the run it checks
    assert checked.measured_peak_bytes == {"cpu:0": int(queries.memory_peaks(run)["peak_held_bytes"].iloc[0])}
    # tutorial-linear's memory is all of its batch's size or none of it: the prediction is the accounting
    assert checked.peak_errors()["cpu:0"] == pytest.approx(0, abs=0.01)
    # beside the run it checks: listed under it, never the run the dashboard or Compare opens on
    from app_pages.common import default_run
    from dpprof.views.compare import default_compare

    for path in runs.linear.paths:
        shutil.copy(path, tmp_path / "checks")
    listing = dpprof.list_runs(tmp_path / "checks")
    assert listing["id"].tolist() == [checked.run_id, runs.linear.id]  # newest first: the check
    assert listing.set_index("id")["check_of"].dropna().to_dict() == {checked.run_id: runs.linear.id}
    assert default_run(listing) == runs.linear.id
    ids, need = default_compare(listing, runs.linear.id)
    assert ids == [] and "needs a second finished run of tutorial-linear" in need
    capsys.readouterr()
    assert main(["--reports-dir", str(tmp_path / "checks"), "runs"]) == 0
    # the rows, not the line under the table that says where a shortened name is whole (the check's name is long)
    rows = [line.split()[0:2] for line in capsys.readouterr().out.splitlines()[2:] if not line.startswith("(")]
    assert rows == [[runs.linear.id, "linear"], ["└", checked.run_id]]


def test_a_run_longer_than_a_check_shows_its_own_steps_and_only_check_runs_fewer(calibrated, tmp_path):
    """A finished run of 120 steps: every command shown runs 120 steps, as the run did; --check runs
    CHECK_MAX_STEPS of them, starts the command with those steps, and says so under its table."""
    from dpprof.advise.check import CHECK_MAX_STEPS
    from dpprof.views.advise import check_lines

    steps = CHECK_MAX_STEPS + 20
    long = record(tmp_path / "reports", "long", workers=2, steps=steps, batch_size=30, workload="tutorial-linear")
    advice = _advice(long)
    assert all(s.profile.steps == steps and s.command.endswith(f"--steps {steps}") for s in advice.scenarios)
    [one] = [s for s in advice.scenarios if s.scenario == "dataparallel" and s.devices == 1]
    started = []
    [checked] = check(advice, tmp_path / "checks", scenarios=[one],
                      progress=lambda s, profile: started.append(profile.command()))
    assert started == [one.command.replace(f"--steps {steps}", f"--steps {CHECK_MAX_STEPS}")]
    assert checked.error is None and checked.steps == CHECK_MAX_STEPS and checked.capped
    assert len(dpprof.load_run(checked.run_id, tmp_path / "checks").steps) == CHECK_MAX_STEPS
    assert checked.to_json()["check_steps"] == CHECK_MAX_STEPS
    assert (f"each check run recorded {CHECK_MAX_STEPS} steps, not the {steps} of its command: --check runs at most "
            f"{CHECK_MAX_STEPS} (a median step and its interval are settled well before)") in check_lines([checked])


@pytest.mark.slow
def test_profile_ddp_runs_a_users_model_and_advise_runs_it_too(tmp_path, monkeypatch, calibrated):
    (tmp_path / "advisemodels.py").write_text(MODEL_FILE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    reports = tmp_path / "reports"
    assert main(["--reports-dir", str(reports), "profile", "--model", "advisemodels:make", "--input-shape", "12", "--ddp",
                 "--nproc", "2", "--steps", "3", "--batch-size", "8", "--quiet"]) == 0
    [ddp] = dpprof.list_runs(reports)["id"]
    run = dpprof.load_run(ddp, reports)
    assert run.model.kind == "ddp" and run.meta["workload"] == "advisemodels:make"
    assert run.meta["workload_args"]["input_shape"] == [12] and len(run.paths) == 2
    assert main(["--reports-dir", str(reports), "profile", "--model", "advisemodels:make", "--input-shape", "12",
                 "--devices", "cpu:2", "--steps", "4", "--batch-size", "16", "--quiet"]) == 0
    plain = dpprof.list_runs(reports)
    plain_id = plain[plain["ranks"] == 1]["id"].iloc[0]
    [command] = [s.command for s in _advice(dpprof.load_run(plain_id, reports)).scenarios if s.scenario == "ddp"]
    assert command == ("dpprof profile --model advisemodels:make --input-shape 12 --ddp --nproc 2 --batch-size 8 "
                       "--steps 4")


def test_profile_ddp_with_a_model_that_cannot_take_the_shape_is_a_usage_error(tmp_path, monkeypatch, capsys):
    (tmp_path / "advisemodels.py").write_text(MODEL_FILE)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        main(["profile", "--model", "advisemodels:make", "--input-shape", "5", "--ddp", "--quiet"])
    assert exit_.value.code == 2 and "fails on --input-shape 5" in capsys.readouterr().err


# -- the Advisor page -----------------------------------------------------------------------------------------

APP = ROOT / "app.py"


def _page(run_id: str) -> AppTest:
    at = AppTest.from_file(str(APP), default_timeout=120)
    at.session_state["chosen_run"] = run_id
    at.run()
    at.switch_page("app_pages/advise.py").run()
    assert not at.exception, [e.message for e in at.exception]
    return at


def test_the_advisor_page_shows_every_scenario_with_its_command(runs, calibrated, monkeypatch):
    monkeypatch.setenv("DPPROF_REPORTS", str(runs.dir))
    at = _page(runs.plain.id)
    advice = _advice(runs.plain)
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["Measured median step"] == f"{advice.measured_step_ms:.2f} ms"
    assert len(at.get("plotly_chart")) == 1
    labels = [shown_text(e.label) for e in at.expander]  # sent as plain text (dpprof.plaintext)
    assert labels == [scenario_title(s) for s in advice.scenarios]
    codes = [c.value for c in at.code]
    assert [s.command for s in advice.scenarios] == codes
    assert any("Calibration of" in shown_text(c.value) for c in at.caption)
    best = advice.headline()  # none where the fixture's calibration was measured under load (then said first)
    assert ("Fastest at this batch" in metrics) == (best is not None)
    if best is None:
        assert advice.withheld in [shown_text(w.value) for w in at.warning]
    else:
        assert metrics["Fastest at this batch"] == f"{best.step_ms:.2f} ms"


def test_the_advisor_page_without_a_calibration_headlines_nothing_and_shows_the_command(runs, tmp_path, monkeypatch):
    monkeypatch.setenv("DPPROF_REPORTS", str(runs.dir))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "empty-cache"))
    at = _page(runs.plain.id)
    assert not at.metric and not at.get("plotly_chart") and not at.expander
    assert any("No calibration of this machine" in shown_text(i.value) for i in at.info)
    assert [c.value for c in at.code] == [f"dpprof advise {runs.plain.id}"]


def test_the_advisor_page_says_why_for_a_run_it_cannot_predict_from(runs, refused, monkeypatch):
    monkeypatch.setenv("DPPROF_REPORTS", str(runs.dir))
    run_id, words = refused["ddp"]
    at = _page(run_id)
    assert any(words in shown_text(i.value) for i in at.info) and not at.get("plotly_chart")


@pytest.mark.cuda
@pytest.mark.skipif(__import__("torch").cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_a_run_on_gpus_is_predicted_from_its_own_transfers(tmp_path):
    """Not run where this was built (no GPU): the GPU arithmetic's own checks, for a machine that has two."""
    from dpprof.workloads import build_workload, train

    run = dpprof.load_run(train(build_workload("cifar-lenet", 64), [0, 1], 6, reports_dir=str(tmp_path)).path)
    advice = advise(measure(run), None, memory_bytes=None)
    [same] = [s for s in advice.scenarios if s.recorded]
    assert math.isclose(same.step_ms, queries.median_step_ms(run), rel_tol=1e-9)
    for s in advice.scenarios:
        assert math.isclose(s.step_ms, sum(s.parts_ms.values()), rel_tol=1e-12)
    assert set(advice.max_batch_size) == {"cuda:0", "cuda:1"} and "total memory" in advice.max_batch_note
    assert any("not been checked against GPU runs" in a for a in advice.assumptions)


def test_check_on_a_run_recorded_from_a_script_says_in_one_line_it_has_nothing_to_run(paused, calibrated, capsys):
    """Not a table of every scenario and "8 of 8 check runs failed" where none was run."""
    run = paused.stalled
    assert main(["--reports-dir", str(Path(run.path).parent), "advise", run.id, "--check"]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and "check runs failed" not in captured.err
    assert captured.err.strip().splitlines()[-1] == (
        f"dpprof: --check has nothing to run: run {run.id} was recorded from a script, so no scenario has a command "
        "(change the script to run one)")


def test_a_check_directory_that_is_a_file_is_one_line_before_any_scenario_runs(runs, calibrated, tmp_path, capsys):
    target = tmp_path / "a-file"
    target.write_text("mine")
    assert main(["--reports-dir", str(runs.dir), "advise", runs.plain.id, "--check", "--check-dir", str(target)]) == 1
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("dpprof:")]
    assert len(lines) == 1 and lines[0].startswith("dpprof: --check-dir: ") and "Traceback" not in err, err
    assert "running" not in err and target.read_text() == "mine"


def _profiled_model(tmp_path, monkeypatch, module: str) -> tuple[Path, str]:
    """MODEL_FILE as ``module``.py in tmp_path (the working directory, on sys.path), profiled on 2 CPU workers for 4
    steps: (the reports directory, the run's id)."""
    (tmp_path / f"{module}.py").write_text(MODEL_FILE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    reports = tmp_path / "reports"
    assert main(["--reports-dir", str(reports), "profile", "--model", f"{module}:make", "--input-shape", "12",
                 "--devices", "cpu:2", "--steps", "4", "--batch-size", "16", "--quiet"]) == 0
    [run_id] = dpprof.list_runs(reports)["id"]
    return reports, run_id


@pytest.mark.slow
def test_check_runs_that_fail_say_the_childs_own_error_and_exit_1(tmp_path, monkeypatch, calibrated, capsys):
    """A run of a user's model whose module is gone by the time of --check (another directory, a renamed file):
    every check run fails, each row says the child's own error line (not argparse's usage text), the table says
    how many failed, and the exit status is 1."""
    reports, run_id = _profiled_model(tmp_path, monkeypatch, "gonemodels")
    (tmp_path / "gonemodels.py").unlink()
    monkeypatch.delitem(sys.modules, "gonemodels", raising=False)
    capsys.readouterr()
    assert main(["--reports-dir", str(reports), "advise", run_id, "--check", "--quiet"]) == 1
    out = capsys.readouterr().out
    scenarios = len(_advice(dpprof.load_run(run_id, reports)).scenarios)
    assert f"{scenarios} of {scenarios} check runs failed" in out
    said = "exited with 2: dpprof profile: error: cannot load model factory 'gonemodels:make'"
    assert out.count(said) == scenarios and "[--nproc NPROC]" not in out


@pytest.mark.slow
def test_a_check_run_whose_model_fails_while_training_says_the_models_error(tmp_path, monkeypatch, calibrated):
    """A check run that starts and fails in a step says the model's own error, not the hint printed under it
    ("  dpprof show ID", the child's last line)."""
    reports, run_id = _profiled_model(tmp_path, monkeypatch, "failingmodels")
    # the same model, failing on a chunk over 2 samples: the pre-flight pass (a batch of two) goes through
    (tmp_path / "failingmodels.py").write_text(
        MODEL_FILE + "class Failing(torch.nn.Module):\n    def forward(self, x):\n        if len(x) > 2:\n"
        "            raise RuntimeError('the model went wrong')\n        return x\n"
        "def make():\n    return torch.nn.Sequential(Failing(), torch.nn.Linear(12, 4))\n")
    advice = _advice(dpprof.load_run(run_id, reports))
    [checked] = check(advice, reports, scenarios=[s for s in advice.scenarios if s.recorded])
    assert checked.run_id is None and checked.error is not None
    assert checked.error.startswith("exited with 1: dpprof: the workload failed while training: RuntimeError: ")
    assert "the model went wrong" in checked.error


def _damaged(cal: dict, how: str):
    """A cache file's JSON damaged one way (the JSON text written)."""
    if how == "a list":
        return "[]"
    if how == "not JSON":
        return "{"
    damaged = {**cal, **{"NaN copy": {"copy_ms_per_mib": float("nan")}, "no cores": {"cores": 0},
                         "cores in words": {"cores": "two"}, "a negative hand-off": {"handoff_ms": {"2": -1.0}},
                         "a superscript count": {"handoff_ms": {**cal["handoff_ms"], "²": 0.1}},
                         "another host's": {"host": "gpu-box-7"},
                         "older": {"version": 1}, "another torch": {"torch_version": "1.13.1"}}.get(how, {})}
    if how == "host missing":
        del damaged["host"]
    return json.dumps(damaged)


@pytest.mark.parametrize("how, why", [
    ("a list", "it holds a JSON list"), ("not JSON", "it cannot be read"), ("NaN copy", "copy_ms_per_mib is nan"),
    ("no cores", "cores is 0"), ("cores in words", "cores is 'two'"), ("a negative hand-off", "handoff_ms [2] is -1.0"),
    ("a superscript count", "handoff_ms has a key '²' that is no worker count"),
    ("another host's", f"it is of host 'gpu-box-7', not {__import__('socket').gethostname()!r}"),
    ("host missing", "host is missing"), ("older", "it is of version 1"),
    ("another torch", f"it was measured with torch 1.13.1, and torch {torch.__version__} is installed now")])
def test_a_damaged_calibration_cache_is_none_and_says_why(runs, calibrated, tmp_path, monkeypatch, how, why):
    from dpprof.advise.calibration_cache import cache_path, cached_calibration
    from dpprof.views.advise import advisor

    threads = torch.get_num_threads()
    data = json.loads(cache_path("cpu", 2, threads).read_text())
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    cache_path("cpu", 2, threads).parent.mkdir(parents=True)
    cache_path("cpu", 2, threads).write_text(_damaged(data, how))
    cal, said = cached_calibration("cpu", 2, threads)
    assert cal is None and said.startswith(why)
    view = advisor(runs.plain)  # the read side: no prediction, and why the cached file was not used
    assert view.advice is None and f"the cached one not used: {said}" in view.reason


@pytest.mark.slow
def test_an_unreadable_and_unwritable_cache_is_measured_again_and_the_advice_printed(runs, tmp_path, monkeypatch,
                                                                                       capsys):
    from dpprof.advise.calibration_cache import cache_path

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = cache_path("cpu", 2, torch.get_num_threads())
    path.mkdir(parents=True)  # the cache file's name is a directory: neither read nor written
    assert main(["--reports-dir", str(runs.dir), "advise", runs.plain.id]) == 0
    captured = capsys.readouterr()
    [unused] = [line for line in captured.err.splitlines() if "was not used" in line]
    assert unused.startswith(f"dpprof: the cached calibration {path} was not used: it cannot be read")
    [uncached] = [line for line in captured.err.splitlines() if "cannot be cached" in line]
    assert uncached.startswith("dpprof: the calibration cannot be cached (IsADirectoryError")
    assert "Traceback" not in captured.err and "DDP on 2 ranks" in captured.out and path.is_dir()


def test_a_run_recorded_with_dpprof_record_carries_its_threads_and_advise_reads_them(paused):
    """dpprof.record (dpprof run's recording too) stores torch's intra-op threads with the run, as dpprof profile
    does: the advisor reads them rather than taking the cores."""
    assert paused.stalled.meta["workload_args"]["threads"] == torch.get_num_threads()
    m = measure(paused.stalled)
    assert (m.threads, m.threads_source) == (torch.get_num_threads(), "recorded with the run")


def test_the_headline_names_only_a_scenario_whose_interval_lies_below_the_recorded_step(runs, calibrated, tmp_path):
    """On one device the balanced pair is the recorded set-up again (nothing to balance): it is not proposed. Any
    scenario headlined has its interval's high end under the recorded median step; none else is."""
    one = record(tmp_path, "one", workers=1, steps=6, batch_size=16)
    advice = advise(measure(one), calibrated)
    assert {s.scenario for s in advice.scenarios} == {"ddp", "dataparallel"}
    for a in (advice, *(_advice(getattr(runs, name)) for name in ADVISABLE)):
        recorded = next(s for s in a.scenarios if s.recorded)
        best = a.headline()
        if best is None:  # withheld: a calibration measured under load
            continue
        faster = [s for s in a.scenarios if s.batch_size == recorded.batch_size and s.withheld is None
                  and s.step_ms_high < recorded.step_ms]
        assert best is (min(faster, key=lambda s: s.step_ms) if faster else recorded)


@pytest.mark.slow
def test_a_killed_run_is_said_incomplete_and_its_commands_run_the_steps_it_recorded(calibrated, tmp_path):
    """dpprof profile asked for 100,000 steps, killed (SIGKILL) once it has recorded some: advise says the run is
    incomplete, and every command runs the steps it recorded, not the 100,000 asked for."""
    import subprocess

    child = subprocess.Popen([sys.executable, "-m", "dpprof", "--reports-dir", str(tmp_path), "profile",
                              "tutorial-linear", "--devices", "cpu:2", "--steps", "100000", "--quiet"])
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            listing = dpprof.list_runs(tmp_path)
            if len(listing) and listing["steps"].fillna(0).iloc[0] >= 20:
                break
            time.sleep(0.5)
    finally:
        child.kill()
        child.wait(60)
    run = dpprof.load_run(dpprof.list_runs(tmp_path)["id"].iloc[0], tmp_path)
    advice = advise(measure(run), calibrated)
    [said] = [line for line in advice.said_first if "incomplete" in line]
    assert said.startswith(f"Run {run.id} is incomplete") and "of the 100,000 asked for" in said
    assert said.endswith(f"recorded {run.model.steps:,} steps of the 100,000 asked for. The predictions start from "
                         "the steps it recorded, and each command runs as many.")
    assert all(s.command.endswith(f"--steps {run.model.steps}") for s in advice.scenarios)


def test_one_device_is_said_in_the_singular_and_an_empty_run_once(calibrated, tmp_path):
    from dpprof.views.advise import AdvisorView, text_lines

    one = record(tmp_path, "one", workers=1, steps=6, batch_size=16)
    text = "\n".join(text_lines(AdvisorView(advise(measure(one), calibrated), None, "")))
    assert "DDP on 1 rank (gloo)" in text and "DataParallel on 1 CPU worker (recorded)" in text
    assert "batch 32 on 1 CPU worker" in text and "1 ranks" not in text and "1 CPU workers" not in text
    with dpprof.record(name="empty", reports_dir=str(tmp_path)) as run:
        pass
    with pytest.raises(NotAdvisable) as refused:
        measure(dpprof.load_run(run.path))
    assert str(refused.value) == f"run {run.id} has nothing to predict from: the run recorded no steps"


# -- the model measured alone (dpprof.advise.compute) -------------------------------------------------------------


@pytest.fixture(scope="module")
def measured_alone(runs):
    """The plain run's model (cifar-lenet, batch 32) measured alone for every split its scenarios need."""
    from dpprof.advise.compute import measure_compute
    from dpprof.advise.predict import compute_layouts

    m = measure(runs.plain)
    return m, measure_compute(m, compute_layouts(m))


def test_the_model_is_measured_alone_for_every_split_the_scenarios_need(measured_alone):
    from dpprof.advise.compute import MIN_PASSES, ComputeProbe
    from dpprof.advise.predict import compute_layouts

    m, probe = measured_alone
    needed = compute_layouts(m)
    # the recorded batch on 1 to 2n workers, each DDP rank's chunk alone, half and twice the batch on n
    assert set(needed) == {(32, k) for k in range(1, 5)} | {(16, 1), (16, 2), (64, 2)}
    assert probe.covers(needed) and set(probe.layouts) == set(needed)
    for (batch, k), times in probe.layouts.items():
        assert len(times.forward_ms) == len(chunk_sizes(batch, k)) and all(ms > 0 for ms in times.forward_ms)
        assert times.backward_ms > 0 and times.passes >= MIN_PASSES
    assert ComputeProbe.from_json(json.loads(json.dumps(probe.to_json()))) == probe  # the cache's round trip exact


def test_one_split_on_more_devices_than_it_has_chunks_is_measured_once_and_predicted_alike(tmp_path):
    from dpprof.advise.compute import measure_compute
    from dpprof.advise.predict import compute_layouts

    # batch 5 on 3 workers; on 4, torch.chunk makes the same [2, 2, 1] and the fourth runs nothing. Each was measured
    # apart, so the same work was predicted twice, apart by the measures' noise (sorted-gru batch 6 on 3 and 4
    # workers: apply 53.86 and 48.87 ms, backward 1,000 and 768 ms)
    m = measure(record(tmp_path, "odd", workers=3, steps=4, batch_size=5, workload="tutorial-linear"))
    needed = compute_layouts(m)
    assert (5, 4) not in needed and (5, 6) not in needed and needed.count((5, 3)) == 1
    assert {(5, 1), (5, 2), (5, 3), (5, 5), (2, 1), (1, 1), (2, 2), (10, 3)} == set(needed)  # batch 2 on 3: [1, 1]
    probe = measure_compute(m, needed)
    assert probe is not None and probe.get(5, 4) is probe.get(5, 3)
    advice = advise(m, None, compute=probe)
    three, four = (next(s for s in advice.scenarios if s.scenario == "dataparallel" and s.devices == k) for k in (3, 4))
    assert four.parts_ms == three.parts_ms


def test_measured_alone_the_prediction_is_the_measure_at_the_runs_level(measured_alone, calibrated):
    """One device's apply is the whole batch's forward measured alone, on the caller's threads; its backward the
    measured one-graph backward at the level the run's own backward shows over the measured two-graph one; a DDP
    rank's forward its chunk's measure at the contention the recorded chunks showed over their measures; and the
    recorded set-up is still exactly its recorded parts. The threads and cores as docs/advise.md works them."""
    m, probe = measured_alone
    advice = advise(m, calibrated, compute=probe)
    assert advice.compute is probe and advice.to_json()["compute"] == probe.to_json()
    assert any(a.startswith("Compute per chunk from the model itself") for a in advice.assumptions)
    by = {(s.scenario, s.devices, s.batch_size): s for s in advice.scenarios}
    recorded = by[("dataparallel", 2, 32)]
    assert recorded.recorded
    plain = advise(m, calibrated)  # the recorded set-up does not depend on how the others are predicted
    assert recorded.parts_ms == pytest.approx(next(s for s in plain.scenarios if s.recorded).parts_ms, rel=1e-9)

    T, C, n = m.threads, calibrated.effective_cores, m.n
    top = calibrated.thread_speedup if calibrated.thread_speedup is not None else float(T)
    speed = lambda t: 1.0 if t <= 1 or T <= 1 else 1 + (top - 1) * (min(t, T) - 1) / (T - 1)  # noqa: E731
    over = lambda k, share: max(1.0, k * share / C)  # noqa: E731
    share_n = max(1, T // n)
    caller = over(1, T) / speed(T)  # the caller's time per ms of one thread's work alone
    scale = m.step_ms / m.typical_step_ms
    parts = {p: v * scale for p, v in m.parts_ms.items()}
    machinery = lambda phase, k: calibrated.machinery(False, k, phase)  # noqa: E731
    alone = [m.apply_ms[d] * scale * speed(share_n) / over(n, share_n) for d in m.devices]
    contention = float(np.median([a / f for a, f in zip(alone, probe.get(32, 2).forward_ms)]))
    one = by[("dataparallel", 1, 32)]
    assert one.parts_ms["apply"] == pytest.approx(probe.get(32, 1).forward_ms[0] * caller, rel=1e-9)
    level = (parts["backward"] - machinery("backward", 2)) / (probe.get(32, 2).backward_ms * caller)
    assert one.parts_ms["backward"] == pytest.approx(
        level * probe.get(32, 1).backward_ms * caller + machinery("backward", 1), rel=1e-9)
    assert f"({level:.2f}x the measure)" in " ".join(advice.assumptions)
    [ddp] = [s for s in advice.scenarios if s.scenario == "ddp"]
    ranks = over(n, 1)  # n ranks of one thread on the cores this job gets
    assert ddp.parts_ms["forward"] == pytest.approx(probe.get(16, 1).forward_ms[0] * contention * ranks, rel=1e-9)
    assert ddp.parts_ms["backward_compute"] == pytest.approx(
        level * probe.get(16, 1).backward_ms * contention * ranks, rel=1e-9)
    for s in advice.scenarios:
        assert math.isclose(s.step_ms, sum(s.parts_ms.values()), rel_tol=1e-12)


def test_a_measure_that_lacks_a_split_is_not_used_and_the_assumptions_say_so(measured_alone, calibrated):
    m, probe = measured_alone
    advice = advise(m, calibrated, batch_sizes=[24], compute=probe)  # batch 24 on 2 workers was not measured
    assert advice.compute is None
    assert any("was not measured alone on this host" in a and f"dpprof advise {m.run_id}" in a
               for a in advice.assumptions)


def test_the_measure_is_cached_per_run_and_another_torch_s_is_not_read(measured_alone, tmp_path, monkeypatch):
    from dpprof.advise.compute import cached_compute, compute_path, save_compute

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    m, probe = measured_alone
    assert cached_compute(m.run_id) is None
    save_compute(probe)
    assert cached_compute(m.run_id, probe.torch_version) == probe
    assert cached_compute(m.run_id, "0.0.1") is None
    compute_path(m.run_id).write_text("{not json")
    assert cached_compute(m.run_id) is None
    compute_path(m.run_id).write_text("[]")  # JSON, not an object: no measure, not a crash
    assert cached_compute(m.run_id) is None
    data = probe.to_json()
    compute_path(m.run_id).write_text(json.dumps({**data, "version": 1}))  # may hold a batch measured as another
    assert cached_compute(m.run_id) is None
    data["layouts"][0]["backward_ms"] = float("nan")  # a time that is no number would print as "nan" and as NaN,
    compute_path(m.run_id).write_text(json.dumps(data))  # which --json's reader cannot parse
    assert cached_compute(m.run_id) is None


def test_advise_measures_the_model_alone_once_and_the_page_reads_it(runs, calibrated, monkeypatch, capsys):
    from dpprof.advise.compute import cached_compute
    from dpprof.advise.predict import compute_layouts
    from dpprof.views.advise import advisor

    run = runs.linear
    assert main(["--reports-dir", str(runs.dir), "advise", run.id]) == 0
    err = capsys.readouterr().err
    assert "measuring tutorial-linear alone for each split of its batch" in err
    probe = cached_compute(run.id)
    assert probe is not None and probe.covers(compute_layouts(measure(run)))
    assert main(["--reports-dir", str(runs.dir), "advise", run.id]) == 0
    assert "measuring" not in capsys.readouterr().err  # read from the cache
    assert advisor(run).advice.compute == probe  # the Advisor page, which never measures, reads it


def test_a_run_recorded_from_a_script_is_not_measured_alone(paused):
    from dpprof.advise.compute import measure_compute
    from dpprof.advise.predict import compute_layouts

    m = measure(paused.stalled)
    assert m.source == "script" and measure_compute(m, compute_layouts(m)) is None
    assert not any("measured alone" in a for a in advise(m, None).assumptions)


def test_a_batch_the_workload_cannot_yield_is_not_measured_as_another(tmp_path):
    from dpprof.advise.compute import measure_compute
    from dpprof.advise.predict import compute_layouts

    # tutorial-linear's data set holds 100 samples: asked for 1,000,000,000 it yields 100, whose forward (0.047 ms)
    # was cached as the billion's, and advise predicted batch 10**9's apply at 3.77 ms (3.74 at the recorded 30)
    m = measure(record(tmp_path, "linear", workers=2, steps=4, batch_size=30, workload="tutorial-linear"))
    with pytest.raises(ValueError, match="yields batches of 100 samples when asked for 1000000000"):
        measure_compute(m, compute_layouts(m, [10**9]))
    assert measure_compute(m, compute_layouts(m, [60])) is not None
    # nor is such a batch's command given: `dpprof profile tutorial-linear --batch-size 1000000000` ran batch 100
    shown = {s.batch_size: s for s in advise(m, None, [10**9, 60]).scenarios
             if s.scenario == "dataparallel" and s.devices == 2}
    assert shown[10**9].command is None and shown[10**9].profile is None
    assert shown[10**9].no_command == "tutorial-linear's data set holds 100 samples: no run of it has batch 1,000,000,000"
    assert shown[60].command.endswith("--devices cpu:2 --batch-size 60 --steps 4") and shown[60].no_command is None


def test_a_split_of_fewer_chunks_than_devices_is_measured_and_cached_as_it_runs(tmp_path, monkeypatch):
    """Batch 3 on 4 workers runs 3 replicas of 1 (torch.chunk): its measure holds 3 forward times, and the cache
    reads it back (a check of one time per device would refuse it, and measure again every time)."""
    from dpprof.advise.compute import cached_compute, measure_compute, save_compute
    from dpprof.advise.predict import compute_layouts

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    m = measure(record(tmp_path, "small", workers=2, steps=4, batch_size=3, workload="tutorial-linear"))
    probe = measure_compute(m, compute_layouts(m))
    assert len(probe.get(3, 4).forward_ms) == len(chunk_sizes(3, 4)) == 3
    save_compute(probe)
    assert cached_compute(m.run_id) == probe


def test_a_torch_whose_package_lacks_its_local_tag_keeps_its_calibration_and_measure(tmp_path, calibrated,
                                                                                        monkeypatch):
    """A build's torch.__version__ can carry a local tag its package metadata lacks (2.11.0+cu130 against 2.11.0, as
    on a GPU image): what a calibration and a model's measure record is the version the reader compares, so neither
    is refused as another torch's, and measured again, on every read."""
    from importlib import metadata

    from dpprof.advise.calibration_cache import cached_calibration, measured_torch, save_calibration
    from dpprof.advise.compute import cached_compute, measure_compute, save_compute
    from dpprof.advise.predict import compute_layouts

    package = torch.__version__.split("+")[0] if "+" in torch.__version__ else f"{torch.__version__}+local"
    real_version = metadata.version
    monkeypatch.setattr(metadata, "version", lambda name: package if name == "torch" else real_version(name))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert measured_torch() == package != torch.__version__

    m = measure(record(tmp_path, "tagged", workers=2, steps=4, batch_size=8, workload="tutorial-linear"))
    probe = measure_compute(m, compute_layouts(m))
    assert probe.torch_version == package
    save_compute(probe)
    assert cached_compute(m.run_id, measured_torch()) == probe

    save_calibration(replace(calibrated, torch_version=measured_torch()))
    assert cached_calibration(calibrated.backend, calibrated.devices, calibrated.threads) == (
        replace(calibrated, torch_version=package), None)
    save_calibration(replace(calibrated, torch_version=torch.__version__))  # what calibrate recorded before
    cal, why = cached_calibration(calibrated.backend, calibrated.devices, calibrated.threads)
    assert cal is None and why == f"it was measured with torch {torch.__version__}, and torch {package} is installed now"

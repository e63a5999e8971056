"""dpprof run / dpprof.instrument on unchanged scripts (tests/scripts, which never import dpprof).

The scripts run in their own processes, as users start them: `python -m dpprof run ...` against
plain `python ...`, on CPU workers (forked from a server that imported torch once: tests/forked.py).
"""
from __future__ import annotations

import copy
import functools
import os
import pickle
import subprocess
import sys
import zipfile
from pathlib import Path

import forked
import pytest
import torch
from torch import nn

import dpprof
from dpprof.cli import main
from dpprof.device_ids import DeviceSet
from dpprof.instrument import _TORCH_DP, FAILED_BUILD_NOTE, NO_PARALLEL_NOTE, SPAWNED_NOTE, instrument
from dpprof.store import queries
from recorded import assert_phases_inside_steps, train_distillation, train_gan

pytestmark = pytest.mark.slow  # most tests run `dpprof run` (or torchrun) in a fresh process that imports torch

SCRIPTS = Path(__file__).parent / "scripts"
ROOT = Path(__file__).parent.parent
# the scripts here are written for a machine with no GPU (--cpu-workers applies only there): hide any
ENV = {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
needs_no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="asserts behaviour without a GPU")
TORCH_NAMES = {
    ("torch.nn", "DataParallel"), ("torch.nn.parallel", "DataParallel"),
    ("torch.nn.parallel.data_parallel", "DataParallel"), ("torch.nn.parallel", "data_parallel"),
    ("torch.nn.parallel.data_parallel", "data_parallel"), ("torch.nn.parallel", "DistributedDataParallel"),
    ("torch.nn.parallel.distributed", "DistributedDataParallel"),
}


def _python(*args, cwd=None, env=None, timeout=240, fresh=False):
    """Run python with these arguments (forked.run; in a fresh interpreter that has imported nothing if ``fresh``);
    returns the CompletedProcess."""
    return (subprocess.run if fresh else forked.run)([sys.executable, *map(str, args)], capture_output=True, text=True, timeout=timeout,
                          cwd=cwd, env={**os.environ, **ENV, **(env or {})})


def _dpprof_run(*args, **kw):
    return _python("-m", "dpprof", "run", *args, **kw)


def _only_run():
    runs = dpprof.list_runs()
    assert len(runs) == 1, runs
    return dpprof.load_run(runs.loc[0, "id"])


def _torch_names():
    import importlib

    return {(m, a): getattr(importlib.import_module(m), a) for m, a in TORCH_NAMES}


# (a) a plain loop with gradient accumulation, on CPU workers
REFERENCE = """
import runpy, sys, torch, dpprof
DataParallel = dpprof.DataParallel  # loaded (subclassing torch's) before torch's name is replaced
torch.nn.DataParallel = lambda module: DataParallel(module, device_ids=dpprof.cpu_devices(2))
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_a_training_loop_with_accumulation_records_steps_calls_and_workers_and_trains_bit_identically(tmp_path):
    script = SCRIPTS / "train_accum.py"
    out = _dpprof_run("--cpu-workers", "2", script, "--batches", "8", "--save", tmp_path / "recorded.pt")
    assert out.returncode == 0, out.stderr
    # the same script under plain python, dpprof's own DataParallel on 2 CPU workers, nothing recorded
    ref = _python("-c", REFERENCE, script, "--batches", "8", "--save", tmp_path / "reference.pt")
    assert ref.returncode == 0, ref.stderr
    assert out.stdout == ref.stdout and out.stdout.count("step ") == 4
    recorded, reference = (torch.load(tmp_path / f) for f in ("recorded.pt", "reference.pt"))
    assert list(recorded) == list(reference)
    for key in reference:
        assert torch.equal(recorded[key], reference[key]), key

    run = _only_run()
    assert run.meta["status"] == "finished"
    assert run.meta["name"] == f"train_accum.py --batches 8 --save {tmp_path}/recorded.pt"
    assert run.meta["devices"] == ["cpu:0", "cpu:1"]
    steps = run.steps
    assert steps["step"].tolist() == [0, 1, 2, 3]  # 8 batches, an optimizer step every 2
    assert steps["forward_calls"].tolist() == [2, 2, 2, 2] and steps["batch_size"].tolist() == [32] * 4
    applies = run.phases[run.phases["phase"] == "apply"].groupby(["step", "device"]).size()
    assert applies.to_dict() == {(s, d): 2 for s in range(4) for d in ("cpu:0", "cpu:1")}
    backward = run.phases[run.phases["phase"] == "backward"].groupby("step").size()
    assert backward.tolist() == [2, 2, 2, 2]
    assert f"recorded run {run.id} (4 steps)" in out.stderr


@needs_no_gpu
def test_accumulation_whose_loss_uses_the_models_second_output_is_one_step_from_the_first():
    """A model returning (features, logits), the loss on the logits alone, two micro-batches an optimizer step: the
    first step was split in two (5 steps for 4 optimizer steps, step 0 of batch 8), as the backward was watched
    on the first output needing grad only, which no gradient reached. Every such output is watched now."""

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body, self.head = nn.Linear(10, 16), nn.Linear(16, 3)

        def forward(self, x):
            features = torch.relu(self.body(x))
            return features, self.head(features)

    torch.manual_seed(0)
    with instrument(store=False, cpu_workers=2) as run:
        model = nn.DataParallel(Net())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(4):
            for _ in range(2):
                _, logits = model(torch.randn(8, 10))
                (nn.functional.cross_entropy(logits, torch.randint(0, 3, (8,))) / 2).backward()
            optimizer.step()
            optimizer.zero_grad()
    steps = run.frames()["steps"]
    assert steps["forward_calls"].tolist() == [2] * 4 and steps["batch_size"].tolist() == [16] * 4


def _sam(model, optimizer, x, y):
    """Sharpness-aware minimization's step (davda54/sam): a pass to perturb the weights, a second on the same batch."""
    loss_fn = nn.functional.mse_loss
    loss_fn(model(x), y).backward()
    with torch.no_grad():
        eps = [0.05 * p.grad / (p.grad.norm() + 1e-12) for p in model.parameters()]
        for p, e in zip(model.parameters(), eps):
            p.add_(e)
    optimizer.zero_grad()
    loss_fn(model(x), y).backward()
    with torch.no_grad():
        for p, e in zip(model.parameters(), eps):
            p.sub_(e)
    optimizer.step()
    optimizer.zero_grad()


def _lbfgs(model, optimizer, x, y):
    def closure():
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    optimizer.step(closure)


def _buffer_reused(model, optimizer, x, y):
    """Two micro-batches copied into one input buffer, as a pinned staging buffer is: new samples each time."""
    buffer = torch.empty_like(x[:8])
    for i in range(2):
        buffer.copy_(x[8 * i:8 * (i + 1)])
        nn.functional.mse_loss(model(buffer), y[8 * i:8 * (i + 1)]).backward()
    optimizer.step()
    optimizer.zero_grad()


@needs_no_gpu
@pytest.mark.parametrize("train, make_optimizer, batch", [
    (_sam, lambda p: torch.optim.SGD(p, lr=0.1), 16),
    (_lbfgs, lambda p: torch.optim.LBFGS(p, max_iter=3), 16),
    (_buffer_reused, lambda p: torch.optim.SGD(p, lr=0.1), 16),
], ids=["sam", "lbfgs", "buffer-reused"])
def test_passes_again_over_the_same_batch_do_not_count_its_samples_again(train, make_optimizer, batch):
    """SAM's two passes and an LBFGS closure's evaluations over one batch each added its samples again (batch 32
    and 48 for 16 samples, samples/s twice and three times what the run trained on). A call on the tensor an earlier
    call of the step took, unchanged, adds none; a buffer the script refills (its version moves) is new samples."""
    torch.manual_seed(0)
    with instrument(store=False, cpu_workers=2) as run:
        model = nn.DataParallel(nn.Linear(6, 1))
        optimizer = make_optimizer(model.parameters())
        for _ in range(3):
            train(model, optimizer, torch.randn(16, 6), torch.randn(16, 1))
    steps = run.frames()["steps"]
    assert len(steps) == 3 and (steps["forward_calls"] >= 2).all()
    assert steps["batch_size"].tolist() == [batch] * 3


@needs_no_gpu
def test_the_dropout_warning_of_torchs_dataparallel_on_cpu_workers_names_the_scripts_line():
    """Under dpprof run (torch's DataParallel is the stand-in) the warning about dropout on CPU workers named
    torch/nn/modules/module.py, not the script's line the docs promise: the stand-in's forward is one frame more
    than dpprof.DataParallel's fixed stacklevel allowed for."""
    import warnings

    with instrument(store=False, cpu_workers=2):
        model = nn.DataParallel(nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.1)))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            line = sys._getframe().f_lineno + 1
            model(torch.randn(8, 4))
    [said] = [w for w in caught if "share the CPU's one generator" in str(w.message)]
    assert (said.filename, said.lineno) == (__file__, line)


def test_steps_stops_recording_not_training(tmp_path):
    script = SCRIPTS / "train_accum.py"
    plain = _python(script, "--batches", "8")
    limited = _dpprof_run("--steps", "2", script, "--batches", "8")
    assert limited.returncode == plain.returncode == 0, limited.stderr
    assert limited.stdout == plain.stdout and plain.stdout.count("step ") == 4
    run = _only_run()
    assert run.meta["status"] == "finished" and run.steps["step"].tolist() == [0, 1]
    assert set(run.phases["step"]) == {0, 1}
    assert "recording stopped after 2 steps (--steps); the script went on" in run.notes["message"].tolist()


def test_steps_stops_recording_without_holding_up_the_script(tmp_path):
    """--steps closes the run mid-script, at the forward that would start one step more. The close ran the run's close
    hooks there, storing its findings: the script's step waited for them (dpprof run --steps 3 of a Linear on 2 CPU
    workers: that iteration 137-289 ms in 3 runs, the others 1-12 ms; the findings hook most of it, the rest the
    writer's close; now 10-48 ms). They run on a thread now, which the block's end waits for: here a close hook that
    takes 1 s (a slow disk, a big run's findings) holds up the stopping step no more, the run file is whole at once
    (finished, its 2 steps), and the hook has run when the block ends."""
    import threading
    import time

    from dpprof.recording import CLOSE_HOOKS

    ran = []

    def slow_hook(run):
        time.sleep(1.0)
        ran.append(threading.current_thread() is threading.main_thread())

    CLOSE_HOOKS.append(slow_hook)
    took = []
    try:
        with instrument(reports_dir=tmp_path, cpu_workers=2, steps=2, sample_hz=None) as run:
            model = nn.DataParallel(nn.Linear(6, 1))
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            for i in range(4):
                t0 = time.perf_counter()
                model(torch.randn(16, 6)).sum().backward()
                optimizer.step()
                optimizer.zero_grad()
                took.append(time.perf_counter() - t0)
                if i == 2:  # the step --steps stopped at: the run is closed and stored whole
                    stored = dpprof.load_run(run.path)
                    assert stored.meta["status"] == "finished" and stored.steps["step"].tolist() == [0, 1]
    finally:
        CLOSE_HOOKS.remove(slow_hook)
    assert took[2] < 0.8, took  # before: over the hook's 1 s
    assert ran == [False]  # run, on a thread, by the block's end
    assert "recording stopped after 2 steps (--steps); the script went on" in dpprof.load_run(run.path).notes[
        "message"].tolist()


# (b) DDP under torchrun
@pytest.mark.slow
def test_b_a_ddp_script_under_torchrun_records_both_ranks_into_one_run():
    out = _python("-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "dpprof", "run",
                  SCRIPTS / "train_ddp.py", "--steps", "3")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert out.stdout.count("step ") == 3  # rank 0 prints
    run = _only_run()
    assert run.meta["ranks"] == [0, 1] and run.meta["devices"] == ["rank:0", "rank:1"]
    assert run.meta["name"] == "train_ddp.py --steps 3" and run.meta["status"] == "finished"
    assert run.steps.groupby("rank")["step"].apply(list).to_dict() == {0: [0, 1, 2], 1: [0, 1, 2]}
    per = run.phases.groupby(["rank", "step", "phase"]).size().unstack()
    for phase in ("forward", "backward", "comm_wait", "optimizer"):  # the optimizer in the step it ends
        assert per[phase].tolist() == [1] * 6, phase
    assert len(run.comms) >= 6


def _optimizers_ms(stdout: str) -> dict[tuple[int, int], float]:
    """tests/scripts/train_two_optimizers.py's own timing of each step's two optimizer steps: (rank, step) -> ms."""
    words = [line.split() for line in stdout.splitlines() if line.startswith("rank ")]
    return {(int(w[1]), int(w[3])): float(w[5]) for w in words}


@pytest.mark.parametrize("wrap", ["dp", "ddp"])
def test_two_optimizers_stepped_back_to_back_are_both_in_the_step(wrap):
    """loss.backward(); opt_embedding.step(); opt_dense.step(), no forward between (an embedding's optimizer beside
    the dense layers'; the dense one sleeps 30 ms). The first optimizer step ended the step, so the second's time was in
    none: DataParallel steps of ~12 ms for ~42 ms of optimizers, and under DDP an optimizer part of 44.6 ms a step, its
    second row after its step's end, over a 25.4 ms median step. The step now ends at the last optimizer step before the
    next forward (DDP: --steps 3 of the script's 4, so the last recorded step is closed by --steps' stop, not by the
    script's end), its optimizer part both optimizers' time and no more than the script measured."""
    from dpprof.store import queries

    sleep_ms = 30.0
    script = [SCRIPTS / "train_two_optimizers.py", "--steps", "4", "--sleep-ms", sleep_ms]
    if wrap == "dp":
        out = _dpprof_run("--cpu-workers", "2", *script)
    else:
        out = _python("-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "dpprof", "run",
                      "--steps", "3", *script, env={"WRAP": "ddp"})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    measured = _optimizers_ms(out.stdout)
    run = _only_run()
    assert run.meta["status"] == "finished"
    ranks = [0] if wrap == "dp" else [0, 1]
    recorded = 4 if wrap == "dp" else 3
    steps = run.steps.set_index(["rank", "step"]).sort_index()
    assert list(steps.index) == [(r, s) for r in ranks for s in range(recorded)]
    joined = run.phases.join(steps[["start_ms", "duration_ms"]].add_suffix("_step"), on=["rank", "step"])
    assert (joined["start_ms"] >= joined["start_ms_step"] - 1e-6).all()  # every part inside its step
    assert (joined.eval("start_ms + duration_ms") <= joined.eval("start_ms_step + duration_ms_step") + 1e-6).all()
    per_phase = run.phases.groupby(["rank", "step", "phase"])["duration_ms"].sum().unstack()
    assert (per_phase.le(steps["duration_ms"], axis=0) | per_phase.isna()).all().all()  # no part over its step
    parts = queries.step_parts(run).set_index(["rank", "step"]).sort_index()
    for (rank, step), row in steps.iterrows():
        if wrap == "dp":  # DataParallel times no optimizer phase: both are in the step's rest, after its last phase
            ends = run.phases[run.phases["step"] == step].eval("start_ms + duration_ms")
            assert row["start_ms"] + row["duration_ms"] - ends.max() >= sleep_ms, (step, row)
            assert parts.at[(rank, step), "rest"] >= sleep_ms
        else:  # the optimizer part is both optimizers' rows, whole inside the step, within the script's own timing
            optimizer = per_phase.at[(rank, step), "optimizer"]
            assert parts.at[(rank, step), "optimizer"] == pytest.approx(optimizer, abs=1e-6)
            assert sleep_ms <= optimizer <= measured[(rank, step)], (rank, step, optimizer)
            assert len(run.phases.query("rank == @rank and step == @step and phase == 'optimizer'")) == 2


def test_a_plain_models_optimizer_step_before_the_next_forward_is_no_part_of_the_step():
    """A DataParallel trained beside a plain module (not recorded), whose optimizer steps after loading the next batch
    (30 ms) and before the DataParallel's forward: an optimizer step after the step ended, with no recorded forward
    between, as a second optimizer stepped back to back is. It moved the step's end over the loading and the plain
    model's work (steps of 36 to 44 ms, the last 2 ms); only an optimizer of a recorded model's weights does now."""
    out = _dpprof_run("--cpu-workers", "2", SCRIPTS / "train_beside_a_plain_model.py", "--load-ms", "30")
    assert out.returncode == 0, out.stderr
    steps = _only_run().steps.sort_values("step")
    assert steps["step"].tolist() == [0, 1, 2, 3]
    ends = (steps["start_ms"] + steps["duration_ms"]).to_numpy()
    gaps = steps["start_ms"].to_numpy()[1:] - ends[:-1]
    assert (gaps >= 30).all(), gaps  # each loading lies between two steps


def test_a_batch_whose_forward_raised_and_the_script_skipped_is_a_step_of_its_own(tmp_path, capsys):
    """A DataParallel script that catches its forward's error on batch 3 (of 6) and goes on: once an optimizer had
    stepped, the next batch's forward joined the failed one's step, a step of 2 forward calls and 32 samples that
    trained (its backward), so no step was the failed forward's and its 16 samples were counted as trained
    (queries.raised_steps 0, samples/s of 80 samples). A step whose forward raised and ran no backward is joined by
    none now: 6 steps, the failed one neither kind, its samples not counted, as dpprof.record's steps have it."""
    script = SCRIPTS / "train_skip.py"
    out = _dpprof_run("--cpu-workers", "2", script, "--save", tmp_path / "recorded.pt")
    plain = _dpprof_run("--no-record", "--cpu-workers", "2", script, "--save", tmp_path / "plain.pt")
    assert out.returncode == plain.returncode == 0, out.stderr
    assert out.stdout == plain.stdout and "step 3 skipped" in plain.stdout
    recorded, unrecorded = torch.load(tmp_path / "recorded.pt"), torch.load(tmp_path / "plain.pt")
    assert all(torch.equal(recorded[k], unrecorded[k]) for k in unrecorded)
    run = _only_run()
    steps = run.steps.sort_values("step")
    assert steps["forward_calls"].tolist() == [1] * 6 and steps["batch_size"].tolist() == [16] * 6
    assert steps["raised_calls"].tolist() == [0, 0, 0, 1, 0, 0]
    rate = queries.throughput(run)
    assert queries.raised_steps(run) == 1
    assert rate is not None and (rate.samples, rate.evaluation_steps, rate.raised_steps) == (16 * 4, 0, 1)
    capsys.readouterr()
    assert main(["show", dpprof.list_runs().loc[0, "id"]]) == 0
    assert "\n  1 step's forward raised, the script going on" in capsys.readouterr().out


@pytest.mark.slow
def test_a_ddp_script_whose_rank_raises_says_that_ranks_error_not_the_others():
    """Rank 1 raises; rank 0 then fails in its all-reduce (its peer gone) or is stopped by torchrun, later. The run's
    error is rank 1's, named by its rank: the cause, not what the other rank died of after it."""
    out = _python("-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "dpprof", "run",
                  SCRIPTS / "train_ddp.py", "--steps", "4", "--raise-at", "1:2")
    assert out.returncode != 0 and "ValueError: a bad batch on rank 1 at step 2" in out.stderr
    run = _only_run()
    assert run.meta["status"] == "failed"
    assert run.meta["error"] == "rank 1: ValueError: a bad batch on rank 1 at step 2"
    assert dpprof.list_runs().loc[0, "error"] == run.meta["error"]


# (c) a script that dies
def test_c_a_script_that_raises_keeps_its_run_failed_with_its_steps_and_its_own_traceback():
    out = _dpprof_run("--cpu-workers", "2", SCRIPTS / "train_crash.py")
    plain = _python(SCRIPTS / "train_crash.py")
    assert out.returncode == plain.returncode == 1
    assert out.stdout == plain.stdout
    traceback = out.stderr[out.stderr.index("Traceback"):]
    assert traceback == plain.stderr[plain.stderr.index("Traceback"):]  # the script's frames only
    run = _only_run()
    assert run.meta["status"] == "failed" and "loss is nan at step 3" in run.meta["error"]
    assert run.steps["step"].tolist() == [0, 1, 2] and run.steps["forward_calls"].tolist() == [1, 1, 1]


def test_c_a_script_whose_forward_raises_uncaught_is_not_said_to_go_on(capsys):
    """The forward that killed the script is its run's last step, a step whose forward raised and ran no backward, as
    a step skipped by a script that catches an out-of-memory error is: dpprof show said of it "1 step's forward
    raised, the script going on (an out-of-memory batch skipped)", of a script that died there."""
    out = _dpprof_run("--cpu-workers", "2", SCRIPTS / "train_crash.py", "forward")
    assert out.returncode == 1 and "mat1 and mat2 shapes cannot be multiplied" in out.stderr
    run = _only_run()
    assert run.meta["status"] == "failed"
    assert run.steps["raised_calls"].tolist() == [0, 0, 0, 1]
    capsys.readouterr()
    assert main(["show", run.id]) == 0
    shown = capsys.readouterr().out
    assert "going on" not in shown
    assert ("\n  its last step's forward raised the error the run failed with: a step of neither kind, its samples not "
            "in samples/s\n") in shown


# (d) evaluation only
@pytest.mark.parametrize("mode", [[], ["inference"]], ids=["no_grad", "inference_mode"])
def test_d_an_evaluation_script_gets_one_step_per_forward_call(mode):
    """Under torch.inference_mode too: its batches are inference tensors, which keep no version counter, and reading
    one's to tell a new batch from the same one again raised in the script's first forward (exit 1, a failed run of
    1 step, its batch unrecorded)."""
    out = _dpprof_run("--cpu-workers", "2", SCRIPTS / "evaluate.py", *mode)
    assert out.returncode == 0, out.stderr
    assert out.stdout == _python(SCRIPTS / "evaluate.py", *mode).stdout
    run = _only_run()
    assert run.meta["status"] == "finished"
    assert run.steps["step"].tolist() == [0, 1, 2, 3, 4] and run.steps["forward_calls"].tolist() == [1] * 5
    assert run.steps["batch_size"].tolist() == [20] * 5 and run.steps["raised_calls"].tolist() == [0] * 5
    assert set(run.phases["phase"]) == {"scatter", "replicate", "parallel_apply", "apply", "gather"}  # no backward
    assert run.steps["devices_used"].tolist() == [2] * 5


@needs_no_gpu
def test_torchs_warning_on_gathering_scalars_names_the_scripts_line_not_dpprofs():
    """A loss computed inside forward: gathering the replicas' scalar losses gives torch's "all input tensors were
    scalars" UserWarning, which named dpprof/parallel/scatter_gather.py:185 (a fixed stacklevel, another line of it
    for a dict's scalar), so the script's own line was nowhere and dpprof looked at fault."""
    script = SCRIPTS / "train_loss_inside.py"
    out = _dpprof_run("--cpu-workers", "2", script)
    assert out.returncode == 0, out.stderr
    line = next(i for i, text in enumerate(script.read_text().splitlines(), 1) if "the line torch's warning" in text)
    warned = [text for text in out.stderr.splitlines() if "UserWarning" in text]
    assert warned == [f"{script}:{line}: UserWarning: Was asked to gather along dimension 0, but all input tensors "
                      "were scalars; will instead unsqueeze and return a vector."], out.stderr
    assert str(ROOT / "dpprof") not in out.stderr
    assert _only_run().steps["batch_size"].tolist() == [14] * 3


# (e) type, isinstance and checkpoints
LOAD = """
import sys, torch
m = torch.load(sys.argv[1], weights_only=False)
print(type(m).__module__, type(m).__qualname__, sorted(m.__dict__), m.device_ids, "dpprof" in sys.modules)
"""


@pytest.mark.parametrize("workers", [[], ["--cpu-workers", "2"]], ids=["pass-through", "cpu-workers"])
def test_e_type_isinstance_and_checkpoints_are_torchs(tmp_path, workers):
    plain = _python(SCRIPTS / "checkpoint.py", tmp_path / "plain")
    out = _dpprof_run(*workers, SCRIPTS / "checkpoint.py", tmp_path / "dpprof")
    assert plain.returncode == out.returncode == 0, out.stderr
    assert out.stdout == plain.stdout
    assert "type DataParallel torch.nn.parallel.data_parallel DataParallel" in out.stdout
    assert "isinstance True True True True" in out.stdout and "loaded DataParallel True True" in out.stdout
    # the whole-module checkpoint names torch's class only, and loads without dpprof as torch's
    pickles = []
    for name in ("plain", "dpprof"):
        with zipfile.ZipFile(tmp_path / f"{name}.whole.pt") as archive:
            [pkl] = [n for n in archive.namelist() if n.endswith("data.pkl")]
            pickles.append(archive.read(pkl))
    assert b"dpprof" not in pickles[1] and b"torch.nn.parallel.data_parallel" in pickles[1]
    loads = [_python("-c", LOAD, tmp_path / f"{name}.whole.pt", fresh=True).stdout for name in ("plain", "dpprof")]
    assert loads[0] == loads[1] and loads[0].startswith("torch.nn.parallel.data_parallel DataParallel [")
    assert loads[0].strip().endswith("[] False")
    assert len(_only_run().steps) == 1


@pytest.mark.parametrize("workers", [[], ["--cpu-workers", "2"]], ids=["pass-through", "cpu-workers"])
def test_a_compiled_data_parallel_is_compiled_once_and_trains_as_unrecorded(tmp_path, workers):
    """torch.compile of the script's nn.DataParallel: dynamo runs dpprof's code as it is (dpprof.compiled), so no
    frame is compiled again (the script sets error_on_recompile; dynamo traced into the probe and the writer and
    recompiled on most steps, 38 to 300 ms a step against 1), and the weights are the unrecorded run's."""
    script = SCRIPTS / "train_compiled.py"
    plain = _dpprof_run("--no-record", *workers, script, tmp_path / "plain.pt", fresh=True)
    assert plain.returncode == 0, plain.stderr[-3000:]
    out = _dpprof_run(*workers, script, tmp_path / "recorded.pt", fresh=True)
    assert out.returncode == 0, out.stderr[-3000:]
    for (name, a), (_, b) in zip(torch.load(tmp_path / "plain.pt").items(), torch.load(tmp_path / "recorded.pt").items(),
                                 strict=True):
        assert torch.equal(a, b), name
    assert len(_only_run().steps) == 6


# a script that builds nothing, the start of a script, and a reports directory that cannot be written
def test_a_script_that_builds_no_data_parallel_says_so_and_keeps_its_exit_code():
    out = _dpprof_run(SCRIPTS / "no_parallel.py")
    assert out.returncode == 3 and out.stdout == "sum 3.0\n"
    run = _only_run()
    assert NO_PARALLEL_NOTE in run.notes["message"].tolist() and run.steps.empty


@pytest.mark.parametrize("build", ["torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))",
                                   "torch.distributed.fsdp.FullyShardedDataParallel(torch.nn.Linear(2, 2))"],
                         ids=["ddp", "fsdp1"])
def test_a_script_whose_data_parallel_raises_as_it_is_built_is_told_so_not_that_it_built_none(tmp_path, build):
    """DDP and FSDP1 built with no process group raise in torch's constructor: the run fails with that error, and its
    note names what raised as it was built (it said the script built no DataParallel, DDP or FSDP)."""
    script = tmp_path / "raises.py"
    script.write_text(f"import torch, torch.distributed.fsdp\n{build}\n")
    out = _dpprof_run(script)
    assert out.returncode == 1 and "Error" in out.stderr.splitlines()[-1]
    run = _only_run()
    name = build.split("(")[0].rsplit(".", 1)[1]
    assert run.meta["status"] == "failed" and run.steps.empty
    assert run.notes["message"].tolist().count(FAILED_BUILD_NOTE.format(name)) == 1
    assert NO_PARALLEL_NOTE not in run.notes["message"].tolist()


def test_a_script_that_trains_in_spawned_processes_is_told_they_are_out_of_reach():
    """torch.multiprocessing.spawn's processes are fresh interpreters without dpprof's stand-ins: the run's note says
    the script started them and how to record them, not that the script built nothing."""
    out = _dpprof_run(SCRIPTS / "train_spawn.py")
    assert out.returncode == 0, out.stderr
    assert sorted(out.stdout.splitlines()) == ["rank 0 trained", "rank 1 trained"]
    run = _only_run()
    notes = run.notes["message"].tolist()
    assert SPAWNED_NOTE.format("2 processes", "torch.multiprocessing.spawn") in notes, notes
    assert NO_PARALLEL_NOTE not in notes and run.steps.empty


OWN_INSTRUMENT = ("import torch, dpprof\n"
                  "with dpprof.instrument(name='mine', cpu_workers=2) as run:\n"
                  "    model = torch.nn.DataParallel(torch.nn.Linear(5, 2))\n"
                  "    opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
                  "    for _ in range(3):\n"
                  "        model(torch.randn(6, 5)).sum().backward(); opt.step(); opt.zero_grad()\n"
                  "print('mine', len(run.frames()['steps']), model.device_ids)\n")
OWN_RECORD = ("import torch, dpprof\n"
              "model = dpprof.DataParallel(torch.nn.Linear(5, 2), device_ids=dpprof.cpu_devices(2))\n"
              "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
              "with dpprof.record(name='mine') as run:\n"
              "    for _ in range(3):\n"
              "        with run.step():\n"
              "            model(torch.randn(6, 5)).sum().backward(); opt.step(); opt.zero_grad()\n"
              "print('mine', len(run.frames()['steps']), model.device_ids)\n")


@pytest.mark.parametrize("body", [OWN_INSTRUMENT, OWN_RECORD], ids=["instrument", "record"])
def test_a_script_that_records_itself_runs_as_under_python_and_the_run_says_where(tmp_path, body):
    """dpprof.instrument in the script (as the docs show for a notebook), or dpprof.record: under dpprof run it runs as
    under python, into its own run, and dpprof run's run says where the steps went. (The instrument block raised:
    blocks cannot be nested; both left dpprof run's run saying the script built no DataParallel.)"""
    from dpprof.instrument import OWN_RUN_NOTE

    script = tmp_path / "records_itself.py"
    script.write_text(body)
    out = _dpprof_run(script)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "mine 3 [0, 1]\n"
    runs = dpprof.list_runs().set_index("name")
    own, outer = dpprof.load_run(runs.loc["mine", "id"]), dpprof.load_run(runs.loc["records_itself.py", "id"])
    assert len(own.steps) == 3 and outer.steps.empty
    assert OWN_RUN_NOTE.format(own.id) in outer.notes["message"].tolist()


def test_os_exit_inside_the_scripts_own_instrument_block_closes_both_runs(tmp_path):
    """os._exit inside the script's own block (dpprof run's block around it): the script's run keeps its steps and
    dpprof run's is closed too, saying where the steps went (it was left incomplete, with no note)."""
    from dpprof.instrument import OWN_RUN_NOTE

    script = tmp_path / "records_itself.py"
    script.write_text(OWN_INSTRUMENT.replace("opt.zero_grad()\n", "opt.zero_grad()\n    import os; os._exit(0)\n"))
    out = _dpprof_run(script)
    assert out.returncode == 0 and out.stdout == "", out.stderr
    runs = dpprof.list_runs().set_index("name")
    own, outer = dpprof.load_run(runs.loc["mine", "id"]), dpprof.load_run(runs.loc["records_itself.py", "id"])
    assert own.meta["status"] == outer.meta["status"] == "finished"
    assert len(own.steps) == 3 and OWN_RUN_NOTE.format(own.id) in outer.notes["message"].tolist()


def test_a_script_that_builds_dpprofs_own_dataparallel_is_recorded_without_the_nothing_built_note():
    out = _dpprof_run(SCRIPTS / "own_dataparallel.py")
    assert out.returncode == 0, out.stderr
    run = _only_run()
    assert len(run.steps) == 5 and NO_PARALLEL_NOTE not in run.notes["message"].tolist()


@pytest.mark.parametrize("module", [False, True], ids=["script", "-m"])
def test_the_script_sees_what_python_would_show_it(module):
    target = ["-m", "argv_echo"] if module else ["argv_echo.py"]
    plain = _python(*target, "a", "--b", cwd=SCRIPTS)
    out = _dpprof_run(*target, "a", "--b", cwd=SCRIPTS)
    assert plain.returncode == out.returncode == 0, out.stderr
    assert out.stdout == plain.stdout and "name __main__" in out.stdout
    assert _only_run().meta["name"] == ("-m argv_echo a --b" if module else "argv_echo.py a --b")



def test_a_double_dash_ends_dpprofs_options_as_it_ends_pythons():
    """`dpprof run -- train.py ARGS` (python's and torchrun's way to end their options) was "--: no such file": the
    `--` before the script is dpprof's, as python takes it; one after the script is the script's, as in python."""
    plain = _python("--", "argv_echo.py", "a", "--", "b", cwd=SCRIPTS)
    out = _dpprof_run("--", "argv_echo.py", "a", "--", "b", cwd=SCRIPTS)
    assert plain.returncode == out.returncode == 0, out.stderr
    assert out.stdout == plain.stdout and "argv ['argv_echo.py', 'a', '--', 'b']" in out.stdout
    assert _only_run().meta["name"] == "argv_echo.py a -- b"

_SHOWS_ITSELF = ("import os, sys\n"
                 "print('file', __file__)\n"
                 "print('argv0', sys.argv[0])\n"
                 "print('path0', sys.path[0])\n"
                 "print('name', __name__)\n")


def _console_dpprof(tmp_path, *args, cwd, env=None):
    """dpprof as its console script starts it: sys.path[0] is the script's folder (bin/), not the current one."""
    entry = tmp_path / "bin" / "dpprof_entry.py"
    entry.parent.mkdir(exist_ok=True)
    entry.write_text("import sys\nfrom dpprof.cli import main\nsys.exit(main())\n")
    return _python(entry, *args, cwd=cwd, env=env)


def test_a_module_in_the_current_directory_runs_with_dash_m_as_python_runs_it(tmp_path):
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "mymodule.py").write_text(_SHOWS_ITSELF)
    plain = _python("-m", "mymodule", cwd=folder)
    out = _console_dpprof(tmp_path, "run", "-m", "mymodule", cwd=folder)
    assert plain.returncode == out.returncode == 0, out.stderr
    assert out.stdout == plain.stdout and f"path0 {folder}\n" in out.stdout
    assert _only_run().meta["name"] == "-m mymodule"


def test_a_script_named_by_a_relative_path_gets_an_absolute_file_as_from_python(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "shows.py").write_text(_SHOWS_ITSELF + "raise ValueError('the end')\n")
    plain = _python("sub/shows.py", cwd=tmp_path)
    out = _dpprof_run("sub/shows.py", cwd=tmp_path)
    assert plain.returncode == out.returncode == 1
    assert out.stdout == plain.stdout and f"file {tmp_path}/sub/shows.py\n" in out.stdout
    assert "argv0 sub/shows.py\n" in out.stdout
    traceback = out.stderr[out.stderr.index("Traceback"):]
    assert traceback == plain.stderr[plain.stderr.index("Traceback"):]


def test_the_line_on_stderr_names_the_run_by_its_absolute_path(tmp_path):
    (tmp_path / "elsewhere").mkdir()
    script = tmp_path / "moves.py"
    script.write_text("import os, torch\nos.chdir('elsewhere')\n"
                      "torch.nn.DataParallel(torch.nn.Linear(2, 2))(torch.ones(3, 2)).sum().backward()\n")
    out = _dpprof_run("moves.py", cwd=tmp_path, env={"DPPROF_REPORTS": "reports"})  # relative: ./reports
    assert out.returncode == 0, out.stderr
    [run_id] = [p.name.removesuffix(".sqlite") for p in (tmp_path / "reports").glob("*.sqlite")]
    said = [line for line in out.stderr.splitlines() if line.startswith("dpprof: recorded run")]
    assert said == [f"dpprof: recorded run {run_id} (1 step) in {tmp_path}/reports/{run_id}.sqlite; "
                    f"dpprof show {run_id}"], out.stderr
    assert not (tmp_path / "elsewhere" / "reports").exists()  # the script's chdir moved nothing


def test_an_unwritable_reports_directory_is_said_once_and_the_script_goes_on(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    out = _dpprof_run("--cpu-workers", "2", SCRIPTS / "evaluate.py",
                      env={"DPPROF_REPORTS": str(tmp_path / "file" / "r")})
    assert out.returncode == 0
    assert out.stdout == _python(SCRIPTS / "evaluate.py").stdout
    said = [line for line in out.stderr.splitlines() if line.startswith("dpprof:")]
    assert len(said) == 1 and said[0].startswith("dpprof: cannot record (") and "unrecorded" in said[0]
    assert (tmp_path / "file").read_text() == "not a directory"


@pytest.mark.parametrize("argv, message", [
    ([], "run needs a script"),
    (["--"], "run needs a script"),
    (["no/such/script.py"], "no/such/script.py: no such file"),
    (["-m", "no_such_module_here"], "no module named 'no_such_module_here'"),
    (["--steps", "0", "x.py"], "--steps must be positive"),
    (["--cpu-workers", "0", "x.py"], "--cpu-workers must be positive"),
    # more workers than torch numbers devices: the script ran and died at its DataParallel (a traceback into
    # dpprof's cpu_devices, exit 1, a failed run of 0 steps)
    (["--cpu-workers", "129", str(SCRIPTS / "evaluate.py")],
     "--cpu-workers 129: at most 128 CPU workers exist (cpu:0 to cpu:127: torch numbers a device 0 to 127)"),
])
def test_bad_run_arguments_are_usage_errors(argv, message, capsys):
    """A clear one-line error and exit code 2, before anything runs."""
    with pytest.raises(SystemExit) as exit_:
        main(["run", *argv])
    assert exit_.value.code == 2 and message in capsys.readouterr().err
    assert dpprof.list_runs().empty  # nothing recorded


def test_instrument_refuses_more_cpu_workers_than_devices_before_the_block_runs():
    with pytest.raises(ValueError, match="cpu_workers=129: at most 128 CPU workers exist"):
        with instrument(store=False, cpu_workers=129):
            pytest.fail("the block ran")


def test_run_help(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["run", "--help"])
    assert exit_.value.code == 0 and "(SCRIPT.py | -m MODULE) [ARGS...]" in capsys.readouterr().out


# dpprof.instrument in a running process
def test_instrument_swaps_torchs_names_and_puts_them_back_even_on_error():
    before = _torch_names()
    with pytest.raises(ZeroDivisionError):
        with instrument(store=False) as run:
            assert run is not None and dpprof.current_run() is run
            during = _torch_names()
            assert all(during[k] is not before[k] for k in TORCH_NAMES)
            with pytest.raises(RuntimeError, match="cannot be nested"):
                with instrument(store=False):
                    pass
            1 / 0
    assert _torch_names() == before and dpprof.current_run() is None
    assert run.status == "failed" and run.error.startswith("ZeroDivisionError")


def test_fsdp_is_patched_when_the_script_imports_it_and_put_back_after_the_block():
    """torch.distributed.fsdp (a second of imports) is not imported by the block: importing it inside gives the
    stand-in under each of fully_shard's names and FSDP2's steps wrapped; leaving puts torch's back."""
    out = _python("-c", """
import sys, dpprof
from dpprof.instrument import fully_shard as stand_in
from dpprof.parallel import fsdp
with dpprof.instrument(store=False):
    from dpprof.instrument import _torch_fully_shard
    print("imported inside before", "torch.distributed.fsdp" in sys.modules)
    from torch.distributed.fsdp import fully_shard
    import torch.distributed._composable.fsdp as composable
    fsdp_doc = _torch_fully_shard().__doc__
    print("stand-in", fully_shard is stand_in, composable.fully_shard is stand_in, fsdp.installed())
    print("looks like torch's", fully_shard.__name__, fully_shard.__module__, fully_shard.__doc__ == fsdp_doc)
import torch.distributed.fsdp as after
# the block's own waits are gone (dpprof.compiled's, for torch._dynamo, stays until a script compiles)
print("after", after.fully_shard is stand_in, fsdp.installed(),
      [f.name for f in sys.meta_path if "WhenImported" in repr(f) and f.name != "torch._dynamo"])
with dpprof.instrument(store=False):
    print("again", after.fully_shard is stand_in, fsdp.installed())
print("after again", after.fully_shard is stand_in, fsdp.installed())
""")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "imported inside before False", "stand-in True True True",
        "looks like torch's fully_shard torch.distributed.fsdp True",
        "after False False []", "again True True", "after again False False"]


def test_fully_shard_imported_first_from_its_composable_path_is_the_stand_in_and_torchs_after():
    """`from torch.distributed._composable.fsdp import fully_shard` imports torch.distributed.fsdp inside its own import:
    the patch made then must not look at the half-imported module, which takes the stand-in as it finishes."""
    out = _python("-c", """
import sys, dpprof
from dpprof.instrument import fully_shard as stand_in
with dpprof.instrument(store=False):
    from torch.distributed._composable.fsdp import fully_shard
    import torch.distributed.fsdp as public
    print("stand-in", fully_shard is stand_in, public.fully_shard is stand_in)
import torch.distributed._composable.fsdp as composable
from torch.distributed.fsdp._fully_shard._fully_shard import fully_shard as torchs
print("after", composable.fully_shard is torchs, public.fully_shard is torchs)
""")
    assert out.returncode == 0, out.stderr
    assert "cannot record FSDP" not in out.stderr
    assert out.stdout.splitlines() == ["stand-in True True", "after True True"]


@needs_no_gpu
@pytest.mark.parametrize("kwargs", [{"device_ids": [0, 1], "output_device": 1}, {"device_ids": []},
                                    {"output_device": 0}])
def test_gpu_device_ids_on_a_machine_without_gpus_run_as_torch_runs_them(kwargs):
    """torch's DataParallel passes through to the module where it finds no GPU, whatever device_ids and output_device
    name: the stand-in does as torch does, and with CPU workers asked for runs on them, its output on the first."""
    torch.manual_seed(0)
    model, x = nn.Linear(4, 2), torch.randn(6, 4)
    theirs = _TORCH_DP(model, **kwargs)
    with instrument(store=False) as run:
        ours = nn.DataParallel(model, **kwargs)
        assert ours.device_ids == theirs.device_ids == [] and torch.equal(ours(x), theirs(x))
    assert run.frames()["steps"]["devices_used"].tolist() == [1]
    with instrument(store=False, cpu_workers=2) as run:
        ours = nn.DataParallel(model, **kwargs)
        assert ours.device_ids == [0, 1] and torch.allclose(ours(x), model(x))
    assert run.devices == ["cpu:0", "cpu:1"]


def test_isinstance_holds_both_ways_and_only_for_torchs_class():
    made_before = nn.DataParallel(nn.Linear(2, 2))
    with instrument(store=False):
        made_inside = nn.DataParallel(nn.Linear(2, 2))

        class Custom(nn.DataParallel):  # a user's subclass, defined while instrumented
            pass

        custom = Custom(nn.Linear(2, 2))
        assert isinstance(made_before, nn.DataParallel) and issubclass(type(made_before), nn.DataParallel)
        assert isinstance(made_inside, type(made_before)) and isinstance(custom, nn.DataParallel)
        assert not isinstance(made_before, Custom)
        assert type(made_inside).__name__ == "DataParallel" and type(made_inside) is nn.DataParallel
    assert isinstance(made_inside, nn.DataParallel) and type(made_inside) is not nn.DataParallel


@needs_no_gpu
def test_a_module_built_inside_pickles_and_copies_as_torchs_class_after_the_block():
    with instrument(store=False, cpu_workers=2):
        model = nn.DataParallel(nn.Linear(3, 2))
        inside = pickle.loads(pickle.dumps(model))  # while instrumented: the stand-in again
        assert type(inside) is nn.DataParallel and list(inside.state_dict()) == ["module.weight", "module.bias"]
    data = pickle.dumps(model)
    assert b"dpprof" not in data
    plain = pickle.loads(data)
    assert type(plain) is nn.DataParallel and plain.device_ids == []  # torch's pass-through without a GPU
    assert sorted(plain.__dict__) == sorted(nn.DataParallel(nn.Linear(3, 2)).__dict__)
    twin = copy.deepcopy(model)
    assert type(twin) is nn.DataParallel and torch.equal(twin(torch.ones(1, 3)), model(torch.ones(1, 3)))


@pytest.mark.parametrize("output_device, index", [(None, 0), ("cpu:1", 1), (-1, -1)])
def test_a_stand_in_on_named_cpu_workers_pickles_back_onto_them(output_device, index):
    """Built inside on CPU workers the script names: unpickled while instrumented, it is on the same workers with the
    same output device (its device_ids, indices as torch keeps them, are not read as CUDA devices)."""
    torch.manual_seed(0)
    with instrument(store=False):
        model = nn.DataParallel(nn.Linear(3, 2), device_ids=dpprof.cpu_devices(2), output_device=output_device)
        twin = pickle.loads(pickle.dumps(model))
        assert twin.__dict__["_devices"] == DeviceSet("cpu", (0, 1), index)
        assert twin.output_device == model.output_device and twin.device_ids == [0, 1]
        x = torch.randn(6, 3)
        assert torch.allclose(twin(x), model.module(x))


@needs_no_gpu
def test_the_functional_form_records_on_cpu_workers_and_steps_follow_the_optimizer():
    net = nn.Linear(4, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with instrument(store=False, cpu_workers=2) as run:
        for _ in range(2):  # two accumulated calls, then the optimizer: one step
            nn.parallel.data_parallel(net, torch.randn(6, 4)).sum().backward()
        opt.step()
        with torch.no_grad():  # then evaluation: a step per call
            nn.parallel.data_parallel(net, torch.randn(6, 4))
            nn.parallel.data_parallel(net, torch.randn(6, 4))
    steps = run.frames()["steps"]
    assert steps["forward_calls"].tolist() == [2, 1, 1] and steps["devices_used"].tolist() == [2, 2, 2]
    with pytest.raises(RuntimeError, match="device type could not be determined"):
        nn.parallel.data_parallel(net, torch.randn(6, 4))  # torch's own again, with no GPU


@needs_no_gpu
def test_a_gans_generator_backward_is_in_the_step_it_runs_in():
    """A GAN, steps ended by its two optimizers: the generator's forward is in the discriminator's step, its backward
    runs in the generator's step (through the discriminator's). That backward is a phase of the step it ran in, so
    every phase lies inside its step (it was written under the closed step of its forward, after that step's end)."""
    with instrument(store=False, cpu_workers=2) as run:
        train_gan(nn.DataParallel(nn.Linear(4, 8)), nn.DataParallel(nn.Linear(8, 1)))
    frames = run.frames()
    steps, phases = frames["steps"].set_index("step"), frames["phases"]
    assert_phases_inside_steps(steps, phases)
    backward = phases[phases["phase"] == "backward"].groupby("step").size()
    last_generator_step = steps.index.max()  # the discriminator's backward and the generator's, in one pass
    assert backward[last_generator_step] == 2 and backward.sum() == 3 * 4


@needs_no_gpu
def test_a_distillation_iteration_is_one_step_and_evaluation_still_a_step_a_forward():
    """Knowledge distillation: the teacher under no_grad, then the student with grad, its backward and optimizer
    step. The teacher's no_grad forward opened a step of its own and the student's forward another: 6 steps for 3
    iterations, the median step half an iteration. A forward with grad of another model now joins the step a no_grad
    forward opened; the student's own evaluation after training is still a step a forward, and its first training
    forward after that evaluation starts a step (the same model: not joined)."""
    with instrument(store=False, cpu_workers=2) as run:
        train_distillation(nn.DataParallel(nn.Linear(4, 3)), nn.DataParallel(nn.Linear(4, 3)))
    steps = run.frames()["steps"]
    assert steps["forward_calls"].tolist() == [2, 2, 2, 1, 1, 2]
    backward = run.frames()["phases"].query("phase == 'backward'").groupby("step").size()
    assert backward.to_dict() == {0: 1, 1: 1, 2: 1, 5: 1}


@needs_no_gpu
def test_without_recording_the_stand_ins_still_run_on_cpu_workers(reports):
    from dpprof.instrument import instrumented

    with instrumented(None, cpu_workers=3) as session:
        model = nn.DataParallel(nn.Linear(4, 2))
        model(torch.randn(9, 4)).sum().backward()
        assert session.run is None and dpprof.current_run() is None
    assert model.device_ids == [0, 1, 2] and not reports.exists()


def test_a_ddp_built_inside_pickles_as_torchs_ddp_with_its_own_comm_hooks_only(tmp_path):
    import io

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with instrument(store=False) as run:
            ddp = nn.parallel.DistributedDataParallel(nn.Linear(3, 2))
            opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
            ddp(torch.ones(2, 3)).sum().backward()
            opt.step()
        assert run.frames()["phases"].groupby("phase").size()[["forward", "backward", "optimizer"]].tolist() == [1] * 3
        buffer = io.BytesIO()
        torch.save(ddp, buffer)  # after the block: torch's class, without dpprof's timing hook
        assert b"dpprof" not in buffer.getvalue()
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False)
        assert type(loaded) is nn.parallel.DistributedDataParallel and loaded._comm_hooks == []
        plain = nn.parallel.DistributedDataParallel(nn.Linear(3, 2))
        assert sorted(loaded.__dict__) == sorted(plain.__dict__)
        loaded(torch.ones(2, 3)).sum().backward()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("body, code, status", [
    ("raise SystemExit(0)", 0, "finished"),
    ("raise SystemExit(4)", 4, "failed"),
    ("raise KeyboardInterrupt", 130, "interrupted"),
], ids=["exit-0", "exit-4", "interrupt"])
def test_the_scripts_exit_is_the_commands_and_the_runs_status(tmp_path, body, code, status, capsys):
    script = tmp_path / "ends.py"
    script.write_text("import torch\nmodel = torch.nn.DataParallel(torch.nn.Linear(2, 2))\nmodel(torch.ones(3, 2))\n"
                      + body + "\n")
    try:
        returned = main(["run", str(script)])
    except SystemExit as exit_:
        returned = exit_.code
    assert returned == code
    run = _only_run()
    assert run.meta["status"] == status and len(run.steps) == 1
    if code == 130:
        assert capsys.readouterr().err.rstrip().endswith("KeyboardInterrupt")


@pytest.mark.parametrize("code, status", [(0, "finished"), (5, "failed")])
def test_a_script_that_ends_with_os_exit_keeps_its_steps_and_its_exit_code(tmp_path, code, status):
    """os._exit (what scripts call to skip gloo's or NCCL's teardown) runs no finally block: the run is closed first,
    every step kept, and the line on stderr said; a DataLoader's forked workers, which end with os._exit too, leave it
    alone."""
    script = tmp_path / "hard_exit.py"
    script.write_text(
        "import os, torch\nfrom torch.utils.data import DataLoader, TensorDataset\n"
        "data = DataLoader(TensorDataset(torch.randn(24, 4)), batch_size=8, num_workers=2)\n"
        "model = torch.nn.DataParallel(torch.nn.Linear(4, 2))\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "for (x,) in data:\n"
        "    model(x).sum().backward(); opt.step(); opt.zero_grad()\n"
        f"os._exit({code})\n")
    out = _dpprof_run("--cpu-workers", "2", script, env={"DPPROF_REPORTS": str(tmp_path / "reports")})
    assert out.returncode == code, out.stderr
    run = dpprof.load_run(dpprof.list_runs(tmp_path / "reports").loc[0, "id"], tmp_path / "reports")
    assert run.meta["status"] == status and len(run.steps) == 3, out.stderr
    assert f"recorded run {run.id} (3 steps)" in out.stderr


def test_a_script_with_no_optimizer_says_its_steps_could_not_be_told_apart():
    """Weights updated by hand: no optimizer.step() ends a step, and the run's notes say why it holds so few."""
    from dpprof.instrument import NO_OPTIMIZER_NOTE

    model = nn.Linear(8, 2)
    with instrument(store=False, cpu_workers=2) as run:
        net = nn.DataParallel(model)
        for _ in range(4):
            loss = net(torch.randn(10, 8)).pow(2).mean()
            model.zero_grad()
            loss.backward()
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.1 * p.grad
    frames = run.frames()
    assert len(frames["steps"]) == 1 and frames["steps"]["forward_calls"].tolist() == [4]
    assert NO_OPTIMIZER_NOTE.format(4) in frames["notes"]["message"].tolist()


@needs_no_gpu
def test_an_iteration_a_grad_scaler_skips_is_a_step_of_its_own():
    """Mixed precision with a GradScaler whose scale is too high: scaler.step() finds inf gradients and skips
    optimizer.step(), which ended the steps. Each skipped iteration joined the next as if accumulated (8 iterations
    were one step of 8 forward calls, batch 256); now every scaler.step() ends its iteration's step, and the one that
    does step the optimizer ends it once."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 40)
    skipped = []
    with instrument(store=False, cpu_workers=2) as run:
        net = nn.DataParallel(model)
        for i in range(6):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.cross_entropy(net(torch.randn(32, 16)).float(), torch.randint(0, 4, (32,)))
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            skipped.append(sum(v.item() for v in scaler._found_inf_per_device(opt).values()) > 0)
            scaler.update(2.0 ** 40 if i < 3 else 1.0)  # four skipped steps, then two taken
    assert skipped == [True] * 4 + [False] * 2
    steps = run.frames()["steps"]
    assert steps["forward_calls"].tolist() == [1] * 6 and steps["batch_size"].tolist() == [32] * 6


@needs_no_gpu
@pytest.mark.parametrize("call", ["module", "functional"])
def test_a_backbone_and_a_head_of_their_own_are_one_step_from_the_first_iteration(call):
    """Two DataParallel models in a pipeline, one optimizer: the head takes the backbone's output. Before the first
    optimizer step a forward with grad and no backward since the last one started a step (an evaluation script's
    rule), so the first iteration was split in two: 6 steps for 5 iterations, the first two of one call each. A
    forward whose inputs carry autograd history joins the step; evaluation batches (data, no history) still do not."""
    backbone, head = nn.Sequential(nn.Linear(12, 16), nn.Tanh()), nn.Linear(16, 3)
    opt = torch.optim.SGD([*backbone.parameters(), *head.parameters()], lr=0.1)
    with instrument(store=False, cpu_workers=2) as run:
        if call == "module":
            first, second = nn.DataParallel(backbone), nn.DataParallel(head)
        else:
            first, second = (functools.partial(nn.parallel.data_parallel, m) for m in (backbone, head))
        for _ in range(2):  # evaluation with grad on, before training: a step per call
            first(torch.randn(8, 12))
        for _ in range(5):
            loss = second(first(torch.randn(8, 12))).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    steps = run.frames()["steps"]
    assert steps["forward_calls"].tolist() == [1, 1] + [2] * 5 and steps["batch_size"].tolist() == [8] * 7

"""Gradient accumulation and evaluation passes under `dpprof run`, on two gloo ranks: DDP (its model returning a
dataclass), FSDP2 (fully_shard imported from torch.distributed._composable.fsdp) and FSDP1 (tests/scripts/
train_accum_eval.py). A step is an optimizer step, whatever the number of micro-batches; an evaluation batch is a
step of its own; a step's memory is one micro-batch's, its weights counted once."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import forked
import numpy as np
import pandas as pd
import pytest
import torch

import dpprof
from dpprof.cli import main
from dpprof.findings import run_findings
from dpprof.findings.ddp import overlapped_ms
from dpprof.views.overview import comm_stats

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).parent / "scripts" / "train_accum_eval.py"
ROOT = Path(__file__).parent.parent
EPOCHS, STEPS, ACCUM, EVAL = 2, 3, 3, 2  # the script's defaults
MICRO_BATCH, EVAL_BATCH = 8, 12
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
JOBS = {"ddp": {"WRAP": "ddp", "OUTPUT": "dataclass"}, "fsdp2": {"WRAP": "fsdp2", "IMPORT": "composable"},
        "fsdp2 bf16": {"WRAP": "fsdp2", "MP": "bf16"}, "fsdp1": {"WRAP": "fsdp1"}}
# the script's Net: Linear(20, 48), two Linear(48, 48), Linear(48, 5), float32
WEIGHT_BYTES = 4 * (20 * 48 + 48 + 2 * (48 * 48 + 48) + 48 * 5 + 5)


def _torchrun(args, env):
    out = forked.run(TORCHRUN + [str(a) for a in args], capture_output=True, text=True, timeout=300,
                     env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": "",
                          **env})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """Each job recorded by `dpprof run`; DDP's and FSDP2's also run without dpprof, their weights saved."""
    base = tmp_path_factory.mktemp("accumulation")
    out = {}
    for name, env in JOBS.items():
        reports = base / name.replace(" ", "-")
        recorded = _torchrun(["-m", "dpprof", "run", SCRIPT], {**env, "DPPROF_REPORTS": str(reports),
                                                                 "OUT": str(base / f"{name}-recorded.pt")})
        plain = None
        if name in ("ddp", "fsdp2"):
            plain = _torchrun([SCRIPT], {**env, "OUT": str(base / f"{name}-plain.pt")})
        [run_id] = dpprof.list_runs(reports)["id"]
        out[name] = {"run": dpprof.load_run(run_id, reports), "reports": reports, "recorded": recorded,
                     "plain": plain, "weights": (base / f"{name}-recorded.pt", base / f"{name}-plain.pt")}
    return out


@pytest.mark.parametrize("name", list(JOBS))
def test_a_step_is_an_optimizer_step_and_an_evaluation_batch_a_step_of_its_own(jobs, name):
    run = jobs[name]["run"]
    assert run.meta["status"] == "finished"
    expected = [(ACCUM, ACCUM * MICRO_BATCH)] * STEPS + [(1, EVAL_BATCH)] * EVAL
    for rank, steps in run.steps.groupby("rank"):
        got = list(zip(steps.sort_values("step")["forward_calls"], steps.sort_values("step")["batch_size"]))
        assert got == expected * EPOCHS, (rank, got)


@pytest.mark.parametrize("name", list(JOBS))
def test_a_steps_memory_is_one_micro_batch_and_its_weights_once(jobs, name):
    run = jobs[name]["run"]
    memory = run.table("memory")
    # one row a step and rank, whatever the micro-batches: the first pass's
    assert memory.groupby(["step", "device"]).size().eq(1).all()
    assert len(memory) == 2 * EPOCHS * (STEPS + EVAL)
    training = memory["step"].map(lambda s: s % (STEPS + EVAL) < STEPS)
    assert (memory.loc[training, "chunk_size"] == MICRO_BATCH).all()
    assert (memory.loc[~training, "chunk_size"] == EVAL_BATCH).all()
    per_rank = memory.groupby("device")["param_bytes"].agg(["min", "max"])
    assert (per_rank["min"] == per_rank["max"]).all()  # never multiplied by the micro-batches
    if name == "ddp":
        assert (per_rank["max"] == WEIGHT_BYTES).all()
    else:  # each rank holds a shard: about half, the two together at least the whole (shards are padded)
        assert per_rank["max"].sum() >= WEIGHT_BYTES and (per_rank["max"] < WEIGHT_BYTES).all()


def test_a_ddp_model_returning_a_dataclass_has_its_backward_recorded(jobs):
    run = jobs["ddp"]["run"]
    phases = run.phases
    training = phases["step"].map(lambda s: s % (STEPS + EVAL) < STEPS)
    counts = phases[training].groupby(["phase"]).size()
    for phase in ("backward", "backward_compute", "comm_wait"):  # one a micro-batch, on each rank
        assert counts[phase] == 2 * EPOCHS * STEPS * ACCUM, phase
    assert not phases[~training]["phase"].isin(["backward", "backward_compute", "comm_wait", "optimizer"]).any()


def _inside_ms(spans, within):
    """The length of the union of ``spans`` inside the union of ``within``, by walking every boundary: a computation
    of its own, not the one findings.ddp makes."""
    cuts = sorted({t for span in spans + within for t in span})
    total = 0.0
    for a, b in zip(cuts, cuts[1:]):
        mid = (a + b) / 2
        if any(s <= mid < e for s, e in spans) and any(s <= mid < e for s, e in within):
            total += b - a
    return total


def test_the_all_reduce_overlap_is_its_time_inside_each_micro_batchs_backward(jobs):
    run = jobs["ddp"]["run"]
    comms, phases = run.comms, run.phases
    compute = phases[phases["phase"] == "backward_compute"]
    got = overlapped_ms(comms, compute)
    assert len(got) == comms.groupby(["step", "device"]).ngroups
    for (step, device), ms in got.items():
        c = comms[(comms["step"] == step) & (comms["device"] == device)]
        b = compute[(compute["step"] == step) & (compute["device"] == device)]
        assert len(b) == ACCUM  # each micro-batch's backward
        expected = _inside_ms(list(zip(c["launch_ms"], c["launch_ms"] + c["duration_ms"])),
                              list(zip(b["start_ms"], b["start_ms"] + b["duration_ms"])))
        assert ms == pytest.approx(expected, abs=1e-9)
    stats = comm_stats(run)
    assert len(stats) == 2 and stats["overlap_pct"].between(0, 100).all()


@pytest.mark.parametrize("name", list(JOBS))
def test_show_and_export_read_every_such_run(jobs, name, tmp_path, capsys, monkeypatch):
    job = jobs[name]
    monkeypatch.setenv("DPPROF_REPORTS", str(job["reports"]))
    assert main(["show", job["run"].id]) == 0
    assert main(["export", job["run"].id, "--out", str(tmp_path / "csv")]) == 0
    said = capsys.readouterr().out
    assert f"{EPOCHS * (STEPS + EVAL)} steps" in said
    assert (tmp_path / "csv" / "device_summary.csv").exists()


@pytest.mark.parametrize("name", ["ddp", "fsdp2"])
def test_the_trained_weights_are_the_unprofiled_scripts(jobs, name):
    job = jobs[name]
    assert job["recorded"].stdout == job["plain"].stdout
    recorded, plain = (torch.load(p) for p in job["weights"])
    assert list(recorded) == list(plain)
    for key in plain:
        assert torch.equal(recorded[key], plain[key]), key
    assert np.isfinite([float(v.float().sum()) for v in plain.values()]).all()


def test_parameters_gathered_in_bfloat16_count_at_its_size(jobs):
    """Under a MixedPrecisionPolicy FSDP2 gathers parameters in param_dtype: the gathered parameters a rank holds
    at its peak are half the float32 run's, which gathers the same groups."""
    def gathered(name):
        memory = jobs[name]["run"].table("memory")
        return memory.groupby("device")["gathered_bytes"].max()

    assert (gathered("fsdp2") > 0).all()
    assert (gathered("fsdp2 bf16") * 2 == gathered("fsdp2")).all()


@pytest.mark.parametrize("name", ["fsdp2", "fsdp1"])
def test_each_micro_batchs_all_gathers_count_in_its_own_forward_or_backward(jobs, name):
    """A collective is in the forward or backward of its own micro-batch: each micro-batch's backward re-gathers the
    three layers (their parameters freed after forward); only those gathered after the last forward (FSDP1's full
    state dict, in the run's last step) are in neither."""
    from dpprof.views.fsdp import fsdp_collective_table

    run = jobs[name]["run"]
    table = fsdp_collective_table(run).set_index(["device", "collective"])
    later = EPOCHS * (STEPS + EVAL) - 1  # the steps after the first, over which the table's means are
    training = EPOCHS * STEPS - 1
    for device in ("rank:0", "rank:1"):
        row = table.loc[(device, "all-gather")]
        forwards = run.phases[(run.phases["device"] == device) & (run.phases["phase"] == "forward")]
        comms = run.comms[(run.comms["device"] == device) & (run.comms["collective"] == "all-gather")]
        after = int((comms["launch_ms"] > (forwards["start_ms"] + forwards["duration_ms"]).max()).sum())
        unplaced = row["per_step"] - row["in_forward_per_step"] - row["in_backward_per_step"]
        assert unplaced * later == pytest.approx(after, abs=1e-9)
        assert row["in_backward_per_step"] * later == pytest.approx(3 * ACCUM * training)


def test_a_rank_that_joins_early_records_its_own_steps_and_no_shadow_all_reduce(tmp_path):
    """DDP under Join: the rank out of inputs shadows the others' all-reduces after its last step; those belong to no
    step of its own (they were filed in its last step, after it ended)."""
    reports = tmp_path / "reports"
    _torchrun(["-m", "dpprof", "run", SCRIPT.parent / "train_join.py"], {"DPPROF_REPORTS": str(reports)})
    [run_id] = dpprof.list_runs(reports)["id"]
    run = dpprof.load_run(run_id, reports)
    assert run.steps.groupby("rank").size().to_dict() == {0: 9, 1: 6}
    windows = run.steps.set_index(["rank", "step"])
    ends = (windows["start_ms"] + windows["duration_ms"]).rename("step_end_ms")
    comms = run.comms.join(ends, on=["rank", "step"])
    assert len(comms) and comms["step_end_ms"].notna().all()
    assert (comms["launch_ms"] <= comms["step_end_ms"]).all()


def test_ranks_holding_the_same_memory_are_said_so_not_compared_with_themselves(jobs):
    from dpprof.views.overview import overview

    run = jobs["ddp"]["run"]
    peaks = run.table("memory").groupby("device").apply(lambda m: (m["param_bytes"] + m["input_bytes"]
                                                                   + m["output_bytes"] + m["activation_bytes"]).max())
    assert peaks.nunique() == 1  # both ranks: the same model, the same micro-batch shapes
    said = " ".join(overview(run).glance.sentences)
    assert "Memory: " in said and " on each rank" in said and "1.00x" not in said, said


def test_the_all_reduce_share_counts_the_evaluation_steps_that_ran_none(jobs, monkeypatch):
    """The evaluation steps between training steps run no all-reduce. The communication finding took the mean busy
    time of the steps that ran one and set it against the mean of every step, and its cost over the run counted the
    steps that ran none (a DDP script with evaluation each epoch: 43% of the step said, 27% paid). Its figure per step
    is now the busy time over every step from the first compared one on (the first step left out), each rank's."""
    import dpprof.findings.ddp as ddp
    from dpprof.findings import tables_of

    monkeypatch.setattr(ddp, "COMM_SHARE_WARN", 0.0)  # the figures, on a run too small to clear the floors
    monkeypatch.setattr(ddp, "worth_time", lambda *args: True)
    t = tables_of(jobs["ddp"]["run"])
    [row] = [f for f in ddp.communication(t) if f["kind"] == "communication_share"]
    busy = ddp.collective_busy(ddp.later_collectives(t.comms), t.steps)
    steps = EPOCHS * (STEPS + EVAL) - 1  # every step past the first: training steps 1, 2, 5, 6, 7 ran all-reduces
    assert sorted(busy["step"].unique()) == [1, 2, 5, 6, 7]
    per_step_ms = busy["busy_ms"].sum() / (2 * steps)
    assert row["value"] == pytest.approx(per_step_ms / t.later_steps.mean())
    assert f"busy {per_step_ms:.2f} ms per step per rank" in row["evidence"]
    assert f"(none in 4 of those {steps} steps)" in row["evidence"]
    assert f"{steps} steps" in row["evidence"].split("the rest ")[1]


def test_the_bucket_advice_says_the_run_already_accumulates_under_no_sync(jobs, monkeypatch):
    """A DDP script accumulating 3 micro-batches a step under no_sync() was told to 'accumulate gradients over
    micro-batches under no_sync()' by the one-bucket finding; the advice now says it already accumulates 3. A step
    whose micro-batches each reduce their gradients (no no_sync()) is advised as before."""
    import dpprof.findings.ddp as ddp
    from dpprof.findings import tables_of

    monkeypatch.setattr(ddp, "COMM_SHARE_WARN", 0.0)  # the words, on a run too small to clear the floors
    monkeypatch.setattr(ddp, "worth_time", lambda *args: True)
    t = tables_of(jobs["ddp"]["run"])
    [row] = [f for f in ddp.communication(t) if f["kind"] == "bucket_size"]
    assert row["advice"].endswith("or accumulate gradients over more micro-batches under no_sync() (the run already "
                                  f"accumulates {ACCUM} a step).")
    comms = ddp.later_collectives(t.comms)
    assert ddp._micro_batches(t.steps, comms) == ACCUM
    assert ddp._micro_batches(t.steps, pd.concat([comms] * ACCUM)) == 1  # each micro-batch all-reduced: no no_sync()


def test_the_stragglers_wait_is_paid_over_the_steps_that_run_collectives(jobs, monkeypatch):
    """The others' wait for a straggler rank, per step inside the collectives, was multiplied by every step past the
    first for its cost over the run, the evaluation steps (no all-reduce, no wait) included: 9 steps where 5 ran
    all-reduces (a DDP script with evaluation each epoch said 0.08 s where 0.05 s was paid)."""
    import dpprof.findings.collectives as collectives
    import dpprof.findings.ddp as ddp
    from dpprof.findings import tables_of

    t = tables_of(jobs["ddp"]["run"])
    assert t.later_step_count == EPOCHS * (STEPS + EVAL) - 1
    assert ddp.collective_steps(t) == 5  # training steps 1, 2, 5, 6, 7
    # the verdict on a run too small to clear the floors: every rank's wait a straggler's
    monkeypatch.setattr(collectives, "STRAGGLER_STEP_SHARE", 0.0)
    monkeypatch.setattr(collectives, "STRAGGLER_CHANCE", 1.0)
    monkeypatch.setattr(collectives, "STRAGGLER_WAIT_SHARE_CPU", -1e9)
    monkeypatch.setattr(collectives, "worth_time", lambda *args: True)
    monkeypatch.setattr(ddp, "straggler_verdict", lambda t: _reported(collectives.collective_verdict(t)))
    paid_over = []
    monkeypatch.setattr(collectives.CollectiveVerdict, "evidence", lambda self, steps: paid_over.append(steps) or "")
    assert len(ddp.straggler_rank(t)) == 1 and paid_over == [5]


def _reported(c):
    """A straggler verdict from the collectives' one, as straggler_verdict makes it."""
    from types import SimpleNamespace

    return SimpleNamespace(reported=True, slowest=c.straggler, collectives=c, severity="warning", wait_share=0.5)


@pytest.fixture(scope="module")
def eval_heavy(tmp_path_factory):
    """DDP with more evaluation batches than training steps (6 an epoch after 3), rank 1 80 ms late to each training
    step, recorded by `dpprof run` (a delay whose half outlasts what a loaded machine takes from rank 0's steps)."""
    reports = tmp_path_factory.mktemp("eval-heavy") / "reports"
    _torchrun(["-m", "dpprof", "run", SCRIPT], {"DPPROF_REPORTS": str(reports), "ACCUM": "1", "EVAL": "6",
                                                "SLOW": "1:80"})
    [run_id] = dpprof.list_runs(reports)["id"]
    return dpprof.load_run(run_id, reports)


def test_a_straggler_in_the_training_steps_is_weighed_against_them_not_the_evaluation_steps(eval_heavy):
    """The others wait ~80 ms inside each all-reduce for rank 1. The straggler finding, its value and the Overview's
    headline set that wait against the median of every step past the first, an evaluation step's fraction of a
    millisecond (thousands of percent); now against the median of the steps that ran the collectives, the wait's own."""
    from dpprof.findings import run_findings
    from dpprof.views.overview import overview

    run = eval_heavy
    steps = run.steps.groupby("step")["duration_ms"].max().iloc[1:]
    training = steps[steps.index.isin(run.comms["step"])]
    assert len(training) == EPOCHS * STEPS - 1 and len(steps) - len(training) == EPOCHS * 6
    assert steps.median() < 40 < training.median()  # the evaluation steps are the median step
    found = run_findings(run).table.set_index("kind").loc["straggler_rank"]
    assert found["device"] == "rank:1"
    wait = float(found["evidence"].split("the others wait ")[1].split(" ms")[0])
    assert wait > 40 and found["value"] == pytest.approx(wait / training.median(), rel=0.01) and found["value"] < 1
    assert "of the median step past the first that ran collectives" in found["evidence"]
    glance = overview(run).glance
    assert glance.wait_share == pytest.approx(found["value"])


def test_training_steps_between_evaluation_steps_are_no_stalls_a_stall_among_them_is(eval_heavy):
    """The stall rule set every step against the median of all, an evaluation step's: each training step (80 ms and
    more against 0.5 ms) was 'over 2x the median step', 5 of 17 said to stall 'from outside the model'. Each step is
    now set against the median of its kind (training: a backward ran; evaluation: none), and a training step that
    stalls among them still is one."""
    from dpprof.findings import run_findings, tables_of
    from dpprof.findings.steps import outlier_steps, stalls, step_kinds

    run = eval_heavy
    t = tables_of(run)
    per = t.every_step.groupby("step")["duration_ms"].max().sort_index().iloc[1:]
    kinds = step_kinds(t, per.index)
    assert kinds.value_counts().to_dict() == {"evaluation": EPOCHS * 6, "training": EPOCHS * STEPS - 1}
    training = per[kinds == "training"]
    assert set(training.index) <= set(stalls(per).slow_ms.index)  # the rule over every step alone: all of them
    # an evaluation step may stall against its own kind on a loaded machine; no training step does here
    found = stalls(per, kinds)
    assert found is None or not (kinds[found.slow_ms.index] == "training").any()
    said = run_findings(run).table.set_index("kind")
    assert "outlier_steps" not in said.index or said.loc["outlier_steps", "title"].endswith("of its kind")
    stalled = training.index[-1]
    per[stalled] = 10 * training.median()  # one training step ten times its kind's median
    found = stalls(per, kinds)
    assert found is not None and found.slow_ms.index[0] == stalled
    assert (kinds[found.slow_ms.index] == "training").sum() == 1
    assert found.median_ms == pytest.approx(per[kinds == "training"].median())
    t.steps = t.steps.copy()  # the run's own frame, which the module's other tests read: not changed under them
    t.steps.loc[t.steps["step"] == stalled, "duration_ms"] = 10 * training.median()
    [row] = outlier_steps(t)
    assert row["title"].endswith(f"of {len(per)} steps took over 2x the median step of its kind")
    assert "median training step past the first" in row["evidence"] and "(no backward)" in row["evidence"]


def test_show_gives_the_median_of_each_kind_beside_an_evaluation_heavy_runs_median(eval_heavy, capsys, tmp_path):
    """show's header gave the median of every step alone: an evaluation step's (under 1 ms) for a run whose training
    steps take over 40 ms. Each kind's median now follows it: a rank's step that ran a backward on it trains."""
    from dpprof.cli import main
    from dpprof.store import queries

    run = eval_heavy
    # each rank's step is training where that rank ran a backward in it, from the raw rows
    trained = set(map(tuple, run.phases.loc[run.phases["phase"] == "backward", ["rank", "step"]].to_numpy()))
    rows = run.steps.assign(kind=["training" if (r, s) in trained else "evaluation"
                                  for r, s in zip(run.steps["rank"], run.steps["step"])])
    expected = rows.groupby("kind")["duration_ms"].median()
    got = queries.kind_medians(run)
    assert got == pytest.approx(expected.to_dict()) and got["evaluation"] < 40 < got["training"]
    assert main(["--reports-dir", str(run.path.parent), "show", run.id]) == 0
    header = next(line for line in capsys.readouterr().out.splitlines() if ", median " in line)
    assert (f"median {queries.median_step_ms(run):.2f} ms (training steps {expected['training']:.2f} ms, "
            f"evaluation steps {expected['evaluation']:.2f} ms)") in header
    from recorded import record

    assert queries.kind_medians(record(tmp_path, "training only", steps=4)) is None  # every step ran a backward


@pytest.fixture(scope="module")
def eval_short(tmp_path_factory):
    """DDP, one micro-batch a step (8 samples), evaluation batches of 12 on rank 0 and 11 on rank 1 (its shard of a
    set that does not divide), recorded by `dpprof run`."""
    reports = tmp_path_factory.mktemp("eval-short") / "reports"
    _torchrun(["-m", "dpprof", "run", SCRIPT], {"WRAP": "ddp", "ACCUM": "1", "EVAL_SHORT": "1",
                                                "DPPROF_REPORTS": str(reports)})
    [run_id] = dpprof.list_runs(reports)["id"]
    return dpprof.load_run(run_id, reports)


def test_ranks_evaluating_different_batch_sizes_are_no_uneven_training_inputs(eval_short):
    """Rank 1's evaluation batches are one sample short, its training batches the others': the uneven_inputs finding
    said "ranks got different batch sizes in 4 steps ... those steps train on a skewed average" of evaluation steps
    under no_grad, which train nothing. It weighs the training steps alone."""
    run = eval_short
    sizes = run.steps.pivot(index="step", columns="rank", values="batch_size")
    uneven = sizes[sizes[0] != sizes[1]]
    assert len(uneven) == EPOCHS * EVAL and (uneven[1] == EVAL_BATCH - 1).all()  # the evaluation steps alone
    assert "uneven_inputs" not in set(run_findings(run).table["kind"])


def test_a_slow_evaluation_step_is_set_against_the_evaluation_steps_batch_not_the_training_steps(eval_short):
    """A slow evaluation step is judged against the median of its kind, and so is its batch now: its 12 samples were
    set against the median step's 8 (the training steps', the run's most), and the finding put its time down to "a
    bigger batch ... more samples to work on", not to a stall, though every evaluation step had those 12 samples."""
    from dpprof.findings import tables_of
    from dpprof.findings.steps import outlier_steps, step_kinds

    t = tables_of(eval_short)
    per = t.every_step.groupby("step")["duration_ms"].max().sort_index().iloc[1:]
    kinds = step_kinds(t, per.index)
    assert kinds.value_counts().to_dict() == {"training": EPOCHS * STEPS - 1, "evaluation": EPOCHS * EVAL}
    evaluation = per[kinds == "evaluation"]
    stalled = evaluation.index[-1]
    t.steps = t.steps.copy()  # the run's own frame, which the module's other tests read: not changed under them
    t.steps.loc[t.steps["step"] == stalled, "duration_ms"] = 10 * per.max()  # ten times any step of either kind
    [row] = outlier_steps(t)
    assert f"steps {stalled} (" in row["evidence"] and "bigger batch" not in row["evidence"], row["evidence"]
    assert "another process" in row["advice"]

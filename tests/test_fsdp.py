"""FSDP2 (fully_shard) on two gloo ranks (torchrun --standalone), recorded by dpprof: `dpprof run` of an unchanged
script (tests/scripts/train_fsdp.py) and `dpprof profile --fsdp`."""
from __future__ import annotations

import math
import os
import re
import sys
from collections import Counter
from pathlib import Path

import forked
import pandas as pd
import pytest
import torch
from torch import nn

import dpprof
from dpprof.cli import main
from dpprof.findings import run_findings
from dpprof.findings.fsdp import EXPOSED_SHARE_WARN, UNEVEN_SHARD_RATIO
from dpprof.records import FSDP_PHASES
from dpprof.store import queries
from dpprof.units import mib
from dpprof.views.fsdp import fsdp_collective_table
from test_invariants import assert_parts_partition_the_steps

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).parent / "scripts" / "train_fsdp.py"
ROOT = Path(__file__).parent.parent
WORLD = 2
STEPS = 5
ENV = {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={WORLD}"]
FLOAT_BYTES = 4


def _torchrun(args, env, timeout=300):
    out = forked.run(TORCHRUN + [str(a) for a in args], capture_output=True, text=True, timeout=timeout,
                     env={**os.environ, **ENV, "FSDP_STEPS": str(STEPS), **env})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


def _assert_same_weights(weights: dict[str, Path]) -> None:
    """The weights the script saved without dpprof ("plain") and under it ("recorded") are bit-identical."""
    plain, recorded = (torch.load(weights[k]) for k in ("plain", "recorded"))
    assert plain.keys() == recorded.keys() and all(torch.equal(plain[k], recorded[k]) for k in plain)


def _assert_one_raised_step(run, at: int, capsys) -> None:
    """Each rank's step ``at`` is its one step whose forward raised (every step one forward of batch 16): neither a
    training nor an evaluation step, its samples not counted, and `dpprof show` says so."""
    steps = run.steps.sort_values(["rank", "step"])
    assert steps["forward_calls"].tolist() == [1] * 2 * STEPS and steps["batch_size"].tolist() == [16] * 2 * STEPS
    assert steps["raised_calls"].tolist() == [int(s == at) for s in range(STEPS)] * WORLD
    assert queries.raised_steps(run) == 1
    rate = queries.throughput(run)
    assert rate is not None and (rate.samples, rate.evaluation_steps, rate.raised_steps) == (WORLD * 16 * 3, 0, 1)
    capsys.readouterr()
    assert main(["--reports-dir", str(run.paths[0].parent), "show", str(run.paths[0])]) == 0
    assert "\n  1 step's forward raised, the script going on" in capsys.readouterr().out


def _recorded(directory: Path, **env: str):
    """`dpprof run` of the script under torchrun into ``directory``; the run, opened."""
    _torchrun(["-m", "dpprof", "run", SCRIPT], {"DPPROF_REPORTS": str(directory), **env})
    runs = dpprof.list_runs(directory)
    assert len(runs) == 1, runs
    return dpprof.load_run(runs.loc[0, "id"], directory)


def _fsdp1_recorded_beside_plain(tmp_path: Path, **env: str):
    """The FSDP1 script under torchrun with ``env``, without dpprof and under `dpprof run`: the trained weights
    bit-identical, the recorded run opened."""
    weights = {"plain": tmp_path / "plain.pt", "recorded": tmp_path / "recorded.pt"}
    _torchrun([SCRIPT1], {**env, "FSDP_OUT": str(weights["plain"]), "DPPROF_REPORTS": str(tmp_path / "unused")})
    _torchrun(["-m", "dpprof", "run", SCRIPT1], {**env, "FSDP_OUT": str(weights["recorded"]),
                                                 "DPPROF_REPORTS": str(tmp_path / "runs")})
    _assert_same_weights(weights)
    listed = dpprof.list_runs(tmp_path / "runs")
    return dpprof.load_run(listed.loc[0, "id"], tmp_path / "runs")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The script recorded with FSDP2's default (reshard after forward) and with reshard_after_forward=False, and its
    trained weights with and without dpprof."""
    base = tmp_path_factory.mktemp("fsdp")
    weights = {"plain": base / "plain.pt", "recorded": base / "recorded.pt"}
    _torchrun([SCRIPT], {"FSDP_OUT": str(weights["plain"]), "DPPROF_REPORTS": str(base / "unused")})
    reshard = _recorded(base / "reshard", FSDP_OUT=str(weights["recorded"]))
    keep = _recorded(base / "keep", FSDP_RESHARD="0")
    return {"reshard": reshard, "keep": keep, "weights": weights}


def _group_shapes(width: int = 64) -> list[list[torch.Size]]:
    """The script's fully_shard groups' parameter shapes, from the same modules built here: each layer, then the
    root's own parameters (the last Linear)."""
    layers = [nn.Linear(width if i else 20, width) for i in range(3)]
    return [[p.shape for p in layer.parameters()] for layer in layers] + [[p.shape for p in
                                                                            nn.Linear(width, 7).parameters()]]


def _padded_bytes(shapes: list[torch.Size]) -> int:
    """A group's bytes as FSDP2 gathers them: each parameter's dim 0 padded to a multiple of the ranks."""
    return sum(math.ceil(s[0] / WORLD) * WORLD * math.prod(s[1:]) * FLOAT_BYTES for s in shapes)


def test_every_step_is_recorded_per_rank_with_fsdps_parts(runs):
    run = runs["reshard"]
    assert run.model.kind == "fsdp" and run.model.devices == ("rank:0", "rank:1")
    assert run.meta["status"] == "finished" and run.model.dist_backend == "gloo"
    assert run.steps.groupby("rank")["step"].apply(list).to_dict() == {r: list(range(STEPS)) for r in range(WORLD)}
    per = run.phases.groupby(["rank", "step", "phase"]).size().unstack(fill_value=0)
    for phase in ("forward", "backward", "optimizer", "all_gather_wait", "reduce_scatter_wait", "copy_in",
                  "copy_out"):
        assert (per[phase] >= 1).all(), phase
    assert (per.loc[per.index.get_level_values("step") > 0, "data"] == 1).all()
    assert set(run.phases["phase"]) <= set(FSDP_PHASES)
    # FSDP's own phases lie inside the root's forward or backward on their rank
    p = run.phases.assign(end=run.phases["start_ms"] + run.phases["duration_ms"])
    outer = p[p["phase"].isin(["forward", "backward"])]
    for (rank, step), inner in p[p["phase"].isin(["all_gather_wait", "reduce_scatter_wait"])].groupby(["rank", "step"]):
        spans = outer[(outer["rank"] == rank) & (outer["step"] == step)]
        for start, end in zip(inner["start_ms"], inner["end"]):
            assert ((spans["start_ms"] <= start + 1e-6) & (end <= spans["end"] + 1e-6)).any()


@pytest.mark.parametrize("name", ["reshard", "keep"])
def test_the_parts_partition_every_step(runs, name):
    totals = assert_parts_partition_the_steps(runs[name])
    assert {"all_gather_wait", "reduce_scatter_wait", "forward", "backward"} <= set(totals["phase"])


def test_weights_after_training_are_bit_identical_to_the_unprofiled_script(runs):
    plain, recorded = (torch.load(runs["weights"][k]) for k in ("plain", "recorded"))
    assert plain.keys() == recorded.keys() and len(plain) == 8
    for key in plain:
        assert torch.equal(plain[key], recorded[key]), key
    assert not torch.equal(plain["0.0.weight"], nn.Linear(20, 64).weight)  # trained: the weights moved


def test_a_batch_every_rank_skipped_after_its_forward_raised_is_a_step_of_neither_kind(tmp_path, capsys):
    """The FSDP2 script with a NaN in step 2's batch on every rank, which the model's forward raises on: the script
    catches it, recovers FSDP (reset_iter_state) and skips the batch. dpprof counted no call that raised in an FSDP
    root's forward, as DataParallel's, so the step held none (and the next batch's forward joined it: 4 steps, step 2
    of 2 calls and 32 samples a rank, all counted in samples/s). It is counted now, at the next root forward: 5 steps,
    step 2 raised on each rank, neither kind, its samples not counted, said by `dpprof show`; the weights are the
    unrecorded script's."""
    weights = {"plain": tmp_path / "plain.pt", "recorded": tmp_path / "recorded.pt"}
    _torchrun([SCRIPT], {"FSDP_NAN_AT": "2", "FSDP_OUT": str(weights["plain"]), "DPPROF_REPORTS": str(tmp_path / "no")})
    run = _recorded(tmp_path / "runs", FSDP_NAN_AT="2", FSDP_OUT=str(weights["recorded"]))
    _assert_same_weights(weights)
    _assert_one_raised_step(run, 2, capsys)


def test_a_last_forward_that_raised_is_counted_when_the_run_closes(tmp_path, capsys):
    """The FSDP2 script with a NaN in its last step's batch on every rank: the script catches the error, recovers FSDP
    (reset_iter_state) and ends, no root forward following. dpprof counted a root forward that raised at the next root
    forward alone, so this one was never counted: step 4 had raised_calls 0 and no forward part, and read as an
    evaluation step (throughput: 1 evaluation step, 0 raised). It is counted as its step closes (here at the run's
    close): step 4 raised on each rank, a forward part, neither kind, its samples not counted, said by `dpprof show`."""
    run = _recorded(tmp_path / "runs", FSDP_NAN_AT=str(STEPS - 1))
    assert run.meta["status"] == "finished"
    assert run.steps.sort_values(["rank", "step"])["step"].tolist() == list(range(STEPS)) * WORLD
    last = run.phases[run.phases["step"] == STEPS - 1].groupby("rank")["phase"].apply(set)
    assert all("forward" in parts and "backward" not in parts for parts in last), last
    _assert_one_raised_step(run, STEPS - 1, capsys)


class _Checked(nn.Sequential):
    def forward(self, x):
        if not torch.isfinite(x).all():
            raise RuntimeError("a batch with a NaN")
        return super().forward(x)


@pytest.mark.parametrize("nan_at", [1, 3])
def test_a_forward_that_raised_in_a_step_block_is_counted_in_its_step(tmp_path, nan_at):
    """One gloo rank (world size 1, in this process) training an FSDP2 model in run.step() blocks, 4 steps, step
    ``nan_at``'s batch with a NaN its forward raises on, caught in the block (reset_iter_state, the batch skipped).
    The block closed the step before any later root forward could count the raise, so it was lost whether a step
    followed (1) or not (3): raised_calls all 0. It is counted as the block closes the step."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from dpprof.instrument import instrument

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with instrument(name="blocks", reports_dir=tmp_path, sample_hz=None) as recording:
            torch.manual_seed(0)
            model = _Checked(nn.Linear(20, 8), nn.ReLU(), nn.Linear(8, 3))
            fully_shard(model[0])
            fully_shard(model)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for step in range(4):
                x = torch.randn(16, 20)
                if step == nan_at:
                    x[0, 0] = float("nan")
                with recording.step():
                    try:
                        loss = model(x).sum()
                    except RuntimeError:
                        model.reset_iter_state()
                        continue
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
    finally:
        dist.destroy_process_group()
    run = dpprof.load_run(recording.path)
    steps = run.steps.sort_values("step")
    assert steps["step"].tolist() == [0, 1, 2, 3] and steps["explicit"].all()
    assert steps["raised_calls"].tolist() == [int(i == nan_at) for i in range(4)]
    assert queries.raised_steps(run) == 1
    rate = queries.throughput(run)
    assert rate is not None and (rate.evaluation_steps, rate.raised_steps) == (0, 1)


@pytest.mark.parametrize("entry", ["instrument", "record"])
@pytest.mark.parametrize("wrap", ["fsdp2", "fsdp1"])
def test_a_recorded_fsdp_model_is_freed_when_the_script_drops_it(tmp_path, wrap, entry):
    """The last step's probe, which holds the root module, stayed in dpprof's FSDP recorder after a dpprof.record run
    (dpprof profile --fsdp's ranks), and the instrument session kept the last root forward's module and batch: a
    model the script dropped, its shards and its process group lived on to the interpreter's end, where gloo's objects
    freed then abort a rank now and then. A run lets its probes go as it closes, and the session each forward's call
    as it returns: the model is freed when the script drops it (one gloo rank, in this process)."""
    import gc
    import weakref

    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard

    from dpprof.instrument import instrument
    from dpprof.parallel import fsdp

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    installed = entry == "record" and not fsdp.installed() and fsdp.install()
    try:
        with instrument(store=False) if entry == "instrument" else dpprof.record(store=False) as run:
            model = nn.Sequential(nn.Linear(20, 8), nn.ReLU(), nn.Linear(8, 3))
            if wrap == "fsdp2":
                fully_shard(model[0])
                fully_shard(model)
            else:
                model = FullyShardedDataParallel(model, device_id=torch.device("cpu"))
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for _ in range(3):
                model(torch.randn(16, 20)).sum().backward()
                opt.step()
                opt.zero_grad()
        freed = weakref.ref(model)
        del model, opt
        gc.collect()
        assert freed() is None
    finally:
        if installed:
            fsdp.uninstall()
        dist.destroy_process_group()
    assert run.frames()["steps"]["step"].tolist() == [0, 1, 2]


def test_fsdp2s_warning_of_a_view_names_the_line_it_names_without_dpprof(tmp_path):
    """The FSDP2 script whose layers and root return a view of their output, which FSDP2 warns of at its caller's
    line (stacklevel=2, in its post-forward): under dpprof the warning named dpprof's wrapper of the function that
    warns (dpprof/parallel/fsdp.py, two lines: the root's and the other modules'), not torch's line. The recorded
    script's warnings are now the plain script's, line for line; its weights too."""
    warning = re.compile(r"^(.+):(\d+): (\w+Warning): (.*)$", re.MULTILINE)
    weights = {"plain": tmp_path / "plain.pt", "recorded": tmp_path / "recorded.pt"}
    plain = _torchrun([SCRIPT], {"FSDP_VIEW": "1", "FSDP_OUT": str(weights["plain"]),
                                 "DPPROF_REPORTS": str(tmp_path / "unused")})
    recorded = _torchrun(["-m", "dpprof", "run", SCRIPT], {"FSDP_VIEW": "1", "FSDP_OUT": str(weights["recorded"]),
                                                           "DPPROF_REPORTS": str(tmp_path / "runs")})
    said = [Counter(warning.findall(out.stderr)) for out in (plain, recorded)]
    assert said[0] and all("returned a view tensor" in w[3] for w in said[0])  # each module class's, once a rank
    assert said[1] == said[0]
    assert not [w for w in said[1] if w[0].startswith(str(ROOT / "dpprof"))]
    _assert_same_weights(weights)


def test_collectives_carry_the_bytes_the_shards_imply(runs):
    groups = sorted(_padded_bytes(g) for g in _group_shapes())
    for name, gathers_per_group in (("reshard", None), ("keep", 1)):
        comms = runs[name].comms
        for (rank, step), c in comms.groupby(["rank", "step"]):
            scatters = sorted(c.loc[c["collective"] == "reduce-scatter", "bucket_bytes"])
            assert scatters == groups, (name, rank, step)  # one reduce-scatter of each group's gradients
            gathers = Counter(c.loc[c["collective"] == "all-gather", "bucket_bytes"])
            if gathers_per_group == 1:  # kept from forward to backward: each group gathered once
                assert sorted(gathers.elements()) == groups
            else:  # resharded after forward: the layers gathered again in backward (the root keeps its own)
                assert set(gathers) == set(groups) and sum(gathers.values()) > len(groups)
        assert (comms["duration_ms"] >= 0).all() and set(comms["collective"]) == {"all-gather", "reduce-scatter"}


def test_memory_is_each_ranks_shard_and_the_gathered_peak(runs):
    total = sum(p.numel() for g in _group_shapes() for s in g for p in [torch.empty(s)]) * FLOAT_BYTES
    for name in ("reshard", "keep"):
        mem = runs[name].memory.groupby("device")[["param_bytes", "gathered_bytes"]].max()
        assert mem["param_bytes"].sum() == total  # the shards add up to the model
        assert (mem["param_bytes"] < total).all()
    keep = runs["keep"].memory["gathered_bytes"].max()
    reshard = runs["reshard"].memory["gathered_bytes"].max()
    assert keep == total  # every group held gathered at once until backward
    assert 0 < reshard < keep  # resharding after forward holds fewer at once


def test_the_reshard_after_forward_finding_fires_only_where_backward_gathers_again(runs):
    for name in ("reshard", "keep"):
        table = fsdp_collective_table(runs[name])
        gathers = table[table["collective"] == "all-gather"]
        found = run_findings(runs[name]).table
        fired = "reshard_after_forward" in set(found["kind"])
        assert fired == (gathers["in_backward_per_step"] > 0).any(), (name, table)
    assert "reshard_after_forward" in set(run_findings(runs["reshard"]).table["kind"])
    assert "reshard_after_forward" not in set(run_findings(runs["keep"]).table["kind"])


def test_exposed_collective_findings_follow_the_recorded_waits(runs):
    """On gloo every FSDP2 collective blocks the host: issued time is all exposed, and a finding is raised exactly
    where the wait is over EXPOSED_SHARE_WARN of the median step."""
    for name in ("reshard", "keep"):
        run = runs[name]
        table = fsdp_collective_table(run)
        assert ((table["exposed_ms"] - table["issued_ms"]).abs() <= 1e-6 + 1e-9 * table["issued_ms"]).all()
        assert (table["hidden_pct"] == 0.0).all(), table["hidden_pct"]  # none hidden: not 2.2e-14 of float rounding
        steps = run.steps[run.steps["step"] > 0].groupby("step")["duration_ms"].max()
        later = run.phases[run.phases["step"] > 0]
        kinds = set(run_findings(run).table["kind"])
        for phase, kind in (("all_gather_wait", "all_gather_exposed"),
                            ("reduce_scatter_wait", "reduce_scatter_exposed")):
            worst = later[later["phase"] == phase].groupby("device")["duration_ms"].sum().max() / len(steps)
            assert (kind in kinds) == (worst / steps.median() >= EXPOSED_SHARE_WARN and worst >= 0.25), (name, kind)
        # each title names the rank whose wait it gives (it said "the ranks wait", with one rank's share)
        found = run_findings(run).table
        for row in found[found["kind"].str.endswith("_exposed")].itertuples():
            what = row.kind.removesuffix("_exposed").replace("_", "-")
            mine = table[table["collective"] == what]
            assert row.device == mine.loc[mine["exposed_ms"].idxmax(), "device"]
            assert row.title == f"{what} exposed: {row.device} waits {100 * row.value:.0f}% of the step for it"


def test_uneven_shards_are_found_only_where_dim_0_does_not_divide(runs, tmp_path):
    assert "uneven_shards" not in set(run_findings(runs["reshard"]).table["kind"])
    run = _recorded(tmp_path / "uneven", FSDP_UNEVEN="1", FSDP_STEPS="4")
    held = run.memory.groupby("device")["param_bytes"].max()
    base = runs["reshard"].memory.groupby("device")["param_bytes"].max()
    row = 589_824 * FLOAT_BYTES  # the script's table: 3 rows, 2 on rank 0 and 1 on rank 1
    assert held["rank:0"] - held["rank:1"] == row + base["rank:0"] - base["rank:1"]
    assert held.max() / held.min() >= UNEVEN_SHARD_RATIO
    found = run_findings(run).table.set_index("kind")
    assert found.loc["uneven_shards", "device"] == "rank:0"
    assert mib(held["rank:0"] - held["rank:1"]) in found.loc["uneven_shards", "evidence"]


def test_a_collectives_bucket_is_its_index_among_the_steps_of_its_kind_over_micro_batches(tmp_path):
    """Gradient accumulation (3 micro-batches a step, set_requires_gradient_sync on the last alone): every micro-batch
    gathers each group in forward and backward, the last alone reduce-scatters, and ``bucket`` counts each kind's
    collectives over the whole step (each micro-batch's root forward used to start it again at 0)."""
    micro = 3
    run = _recorded(tmp_path, FSDP_ACCUM=str(micro))
    groups = sorted(_padded_bytes(g) for g in _group_shapes())
    assert (run.steps["forward_calls"] == micro).all()
    for (rank, step), c in run.comms.groupby(["rank", "step"]):
        gathers, scatters = (c[c["collective"] == k] for k in ("all-gather", "reduce-scatter"))
        assert sorted(scatters["bucket_bytes"]) == groups, (rank, step)
        assert len(gathers) == micro * 2 * len(groups), (rank, step)  # reshard_after_forward=True: the root too
        for kind in (gathers, scatters):
            assert sorted(kind["bucket"]) == list(range(len(kind))), (rank, step, sorted(kind["bucket"]))
            assert kind.sort_values("launch_ms")["bucket"].is_monotonic_increasing, (rank, step)


def test_param_bytes_are_the_shards_when_a_micro_batch_keeps_its_parameters_gathered(tmp_path):
    """Micro-batches before the last keep their parameters gathered after backward (set_reshard_after_backward(False)),
    where dpprof reads the step's memory: ``param_bytes`` is each rank's local shards all the same (it was the whole
    model on every rank, the unsharded parameters the modules held then)."""
    run = _recorded(tmp_path, FSDP_ACCUM="2", FSDP_KEEP_GATHERED="1")
    total = sum(math.prod(s) for g in _group_shapes() for s in g) * FLOAT_BYTES
    per_rank = run.memory.groupby("rank")["param_bytes"].agg(["min", "max"])
    assert (per_rank["min"] == per_rank["max"]).all(), per_rank
    assert per_rank["max"].sum() == total and (per_rank["max"] < total).all(), (per_rank, total)


def test_profile_fsdp_runs_a_builtin_on_two_ranks(tmp_path, capsys):
    assert main(["--reports-dir", str(tmp_path), "profile", "tutorial-linear", "--fsdp", "--nproc", "2",
                 "--steps", "4", "--quiet"]) == 0
    runs = dpprof.list_runs(tmp_path)
    run = dpprof.load_run(runs.loc[0, "id"], tmp_path)
    assert run.model.kind == "fsdp" and run.meta["workload_args"]["fsdp"] is True
    assert run.steps.groupby("rank").size().tolist() == [4, 4]
    assert set(run.comms["collective"]) == {"all-gather", "reduce-scatter"}
    assert main(["--reports-dir", str(tmp_path), "show", run.id]) == 0
    out = capsys.readouterr().out
    # the table's figures are the findings' (steps past the first), the step's parts every step's: said, not left to
    # read as the same wait measured twice
    assert "FSDP (gloo), 2 ranks" in out and "FSDP collectives per step past the first" in out
    # Linear(5, 2) is one group: one all-gather again in backward and one reduce-scatter a step, said in the singular
    found = run_findings(run).table
    said = " ".join(found["title"].tolist() + found["evidence"].tolist())
    assert "resharding after forward costs 1 more all-gather a step" in said, said
    assert "1 of its 2 all-gathers a step" in said, said
    assert not re.search(r"\b1 (more )?(all-gathers|reduce-scatters)\b", said), said


def test_profile_refuses_ddp_and_fsdp_together(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["profile", "tutorial-linear", "--fsdp", "--ddp"])
    assert exit_.value.code == 2
    assert "give --ddp or --fsdp, not both" in capsys.readouterr().err


def test_the_fsdp_table_is_empty_for_other_kinds(tmp_path):
    from recorded import record

    table = fsdp_collective_table(record(tmp_path, "dp", steps=3, batch_size=8))
    assert isinstance(table, pd.DataFrame) and table.empty


def test_the_overview_and_the_csvs_carry_the_fsdp_table(runs, tmp_path):
    from dpprof.views.export import export_run, export_tables
    from dpprof.views.overview import overview

    run = runs["reshard"]
    table = fsdp_collective_table(run)
    assert sorted(table["collective"].unique()) == ["all-gather", "reduce-scatter"] and len(table) == 2 * WORLD
    assert overview(run).fsdp.equals(table)
    assert "fsdp_collectives" in set(export_tables(run)["table"])
    written = {p.name for p in export_run(run, tmp_path / "csv")}
    assert "fsdp_collectives.csv" in written
    exported = pd.read_csv(tmp_path / "csv" / "fsdp_collectives.csv")
    assert exported["sent_bytes_per_step"].tolist() == table["sent_bytes_per_step"].tolist()


# FSDP1: FullyShardedDataParallel around each layer and the root (tests/scripts/train_fsdp1.py), the same phases,
# collectives and memory in FSDP1's units (one flat parameter per FSDP module)
SCRIPT1 = Path(__file__).parent / "scripts" / "train_fsdp1.py"


@pytest.fixture(scope="module")
def runs1(tmp_path_factory):
    """train_fsdp1.py recorded with FULL_SHARD (reshard after forward) and SHARD_GRAD_OP, and its trained weights
    with and without dpprof."""
    base = tmp_path_factory.mktemp("fsdp1")
    weights = {"plain": base / "plain.pt", "recorded": base / "recorded.pt"}
    _torchrun([SCRIPT1], {"FSDP_OUT": str(weights["plain"]), "DPPROF_REPORTS": str(base / "unused")})
    out: dict = {"weights": weights}
    for name, env in (("reshard", {"FSDP_OUT": str(weights["recorded"])}), ("keep", {"FSDP_RESHARD": "0"})):
        _torchrun(["-m", "dpprof", "run", SCRIPT1], {"DPPROF_REPORTS": str(base / name), **env})
        listed = dpprof.list_runs(base / name)
        assert len(listed) == 1, listed
        out[name] = dpprof.load_run(listed.loc[0, "id"], base / name)
    return out


def _flat_bytes(shapes: list[torch.Size], padded: bool) -> int:
    """An FSDP1 module's flat parameter in bytes: its parameters flattened into one, padded to a multiple of the
    ranks where FSDP1 pads it (the all-gather's output and the reduce-scatter's input)."""
    numel = sum(math.prod(s) for s in shapes)
    return (math.ceil(numel / WORLD) * WORLD if padded else numel) * FLOAT_BYTES


def test_fsdp1_steps_are_recorded_per_rank_in_fsdps_parts_with_its_collectives_inside(runs1):
    for name in ("reshard", "keep"):
        run = runs1[name]
        assert run.model.kind == "fsdp" and run.model.devices == ("rank:0", "rank:1"), name
        assert run.steps.groupby("rank")["step"].apply(list).to_dict() == {r: list(range(STEPS)) for r in range(WORLD)}
        per = run.phases.groupby(["rank", "step", "phase"]).size().unstack(fill_value=0)
        for phase in ("forward", "backward", "optimizer", "all_gather_wait", "reduce_scatter_wait"):
            assert (per[phase] >= 1).all(), (name, phase)
        assert set(run.phases["phase"]) <= set(FSDP_PHASES)
        assert_parts_partition_the_steps(run)
        # before the last step (after which the script gathers a full state dict), every wait is inside the root's
        # forward or backward on its rank
        p = run.phases.assign(end=run.phases["start_ms"] + run.phases["duration_ms"])
        outer = p[p["phase"].isin(["forward", "backward"])]
        waits = p[p["phase"].isin(["all_gather_wait", "reduce_scatter_wait"]) & (p["step"] < STEPS - 1)]
        for (rank, step), inner in waits.groupby(["rank", "step"]):
            spans = outer[(outer["rank"] == rank) & (outer["step"] == step)]
            for start, end in zip(inner["start_ms"], inner["end"]):
                assert ((spans["start_ms"] <= start + 1e-6) & (end <= spans["end"] + 1e-6)).any(), (name, rank, step)


def test_fsdp1_weights_after_training_are_bit_identical_to_the_unprofiled_script(runs1):
    plain, recorded = (torch.load(runs1["weights"][k]) for k in ("plain", "recorded"))
    assert plain.keys() == recorded.keys() and len(plain) == 8
    for key in plain:
        assert torch.equal(plain[key], recorded[key]), key


def test_fsdp1_all_gathers_of_a_full_state_dict_are_not_read_as_hidden_behind_compute(runs1):
    """On gloo every FSDP1 collective blocks the host: none is hidden. The full state dict the script gathers after
    its last backward (counted in that step, in neither pass, with no wait part of the step) made issued exceed
    exposed: 21-30% of the all-gathers 'hidden behind compute' in the table and the all-gather finding, beside its
    own 'on gloo ... none of it can overlap'. Issued is now the collectives in forward or backward."""
    for name in ("reshard", "keep"):
        table = fsdp_collective_table(runs1[name])
        assert (table["hidden_pct"] == 0.0).all(), (name, table)
        assert table["issued_ms"].to_numpy() == pytest.approx(table["exposed_ms"].to_numpy(), rel=1e-9), name
        gathers = table[table["collective"] == "all-gather"]
        assert (gathers["in_forward_per_step"] + gathers["in_backward_per_step"] < gathers["per_step"]).all(), name


def test_fsdp1_collectives_carry_each_flat_parameters_bytes_and_memory_is_the_shards(runs1):
    units = _group_shapes()  # the same modules: each layer's Linear, then the root's own Linear
    padded = sorted(_flat_bytes(u, padded=True) for u in units)
    total = sum(_flat_bytes(u, padded=False) for u in units)
    for name in ("reshard", "keep"):
        run = runs1[name]
        for (rank, step), c in run.comms[run.comms["step"] < STEPS - 1].groupby(["rank", "step"]):
            assert sorted(c.loc[c["collective"] == "reduce-scatter", "bucket_bytes"]) == padded, (name, rank, step)
            gathers = Counter(c.loc[c["collective"] == "all-gather", "bucket_bytes"])
            if name == "keep":  # SHARD_GRAD_OP: each module gathered once a step
                assert sorted(gathers.elements()) == padded
            else:  # FULL_SHARD: the layers gathered again in backward
                assert set(gathers) == set(padded) and sum(gathers.values()) > len(padded)
        # the last step also holds the full state dict's gathers, after backward: in neither forward nor backward
        table = fsdp_collective_table(run)
        gathers = table[table["collective"] == "all-gather"]
        assert (gathers["in_forward_per_step"] + gathers["in_backward_per_step"] < gathers["per_step"]).all(), name
        mem = run.memory.groupby("device")[["param_bytes", "gathered_bytes"]].max()
        assert mem["param_bytes"].sum() == total and (mem["param_bytes"] < total).all()  # shards, less padding
    assert runs1["keep"].memory["gathered_bytes"].max() == total
    assert 0 < runs1["reshard"].memory["gathered_bytes"].max() < total
    assert "reshard_after_forward" in set(run_findings(runs1["reshard"]).table["kind"])
    assert "reshard_after_forward" not in set(run_findings(runs1["keep"]).table["kind"])


def test_every_part_lies_inside_its_step_the_first_step_included(runs, runs1):
    """A step begins no later than its root's forward: FSDP2's root pre-forward (lazy init, the first all-gathers) and
    FSDP1's root forward start before the probe makes the step, and the first step has no previous step's end to begin
    at. Each phase row lies inside its own step's span, on every rank (a microsecond's margin for the ms floats)."""
    for name, run in (("fsdp2 reshard", runs["reshard"]), ("fsdp2 keep", runs["keep"]),
                      ("fsdp1 reshard", runs1["reshard"]), ("fsdp1 keep", runs1["keep"])):
        steps = run.steps.set_index(["rank", "step"])[["start_ms", "duration_ms"]].add_suffix("_of_step")
        rows = run.phases.join(steps, on=["rank", "step"])
        assert rows["start_ms_of_step"].notna().all(), name
        early = rows[rows["start_ms"] < rows["start_ms_of_step"] - 1e-3]
        late = rows[rows["start_ms"] + rows["duration_ms"] > rows["start_ms_of_step"] + rows["duration_ms_of_step"] + 1e-3]
        assert early.empty and late.empty, (name, early, late)


def test_each_ranks_compute_share_is_of_its_own_steps_and_never_over_the_step(runs1):
    """Ranks step together but each measures its own steps (rank 0 waits for rank 1 at the first collective, so its
    first step is longer): a rank's compute share is its compute per step over its own mean step, from the tables."""
    from dpprof.store import queries

    for name in ("reshard", "keep"):
        run = runs1[name]
        stats = queries.work_stats(run).set_index("device")
        work = run.phases[run.phases["phase"].isin(run.model.work.phases)]
        for rank in range(WORLD):
            mine = work[work["rank"] == rank].groupby("step")["duration_ms"].sum()
            steps = run.steps[run.steps["rank"] == rank]["duration_ms"]
            expected = 100 * mine.mean() / steps.mean()
            share = stats.loc[f"rank:{rank}", "work_share_of_step_pct"]
            assert abs(share - expected) <= 1e-9 * expected and 0 < share <= 100, (name, rank, share, expected)


def test_fsdp1_no_shard_records_its_gradient_all_reduce_as_ddp_does(tmp_path):
    """NO_SHARD all-reduces each flat parameter's gradient in its post-backward hook, as DDP does: each is an
    all-reduce row and a comm_wait inside backward, so the run (a ddp one) has its all-reduce section and findings;
    it had none, and `dpprof show` said no all-reduce was recorded. The trained weights stay bit-identical, and the run
    is titled as the FSDP it is."""
    run = _fsdp1_recorded_beside_plain(tmp_path, FSDP_RESHARD="none")
    assert run.model.kind == "ddp" and "comms" not in run.model.missing
    # titled as the script's FSDP, not as a DDP it never built ("DistributedDataParallel (gloo), 2 ranks" before)
    assert run.model.title == "FullyShardedDataParallel (NO_SHARD) (gloo), 2 ranks"
    units = sorted(_flat_bytes(u, padded=False) for u in _group_shapes())
    assert set(run.comms["collective"]) == {"all-reduce"}
    for (rank, step), c in run.comms.groupby(["rank", "step"]):
        assert sorted(c["bucket_bytes"]) == units, (rank, step)
    assert set(run.comms.groupby("rank")["step"].unique().map(list).map(tuple)) == {tuple(range(STEPS))}
    p = run.phases.assign(end=run.phases["start_ms"] + run.phases["duration_ms"])
    backward = p[p["phase"] == "backward"]
    for row in p[p["phase"] == "comm_wait"].itertuples():
        spans = backward[(backward["rank"] == row.rank) & (backward["step"] == row.step)]
        assert ((spans["start_ms"] <= row.start_ms + 1e-6) & (row.end <= spans["end"] + 1e-6)).any(), row
    assert_parts_partition_the_steps(run)


def test_fsdp1_layers_recomputed_in_backward_by_activation_checkpointing_are_no_forward_of_the_step(tmp_path):
    """The root's forward runs each FSDP layer under torch.utils.checkpoint, so backward calls the layers' FSDP forward
    again to recompute them. Each recomputation was read as a root forward of the step: 4 forward calls and batch 64 a
    step for 16 samples, no backward part at all, and the recomputations' all-gathers between "data" parts. A
    non-root FSDP module's forward is now no step's forward: one forward and one backward a step, the gathers inside
    them, the weights bit-identical."""
    run = _fsdp1_recorded_beside_plain(tmp_path, FSDP_CHECKPOINT="1")
    assert run.steps.groupby("rank")["step"].apply(list).to_dict() == {r: list(range(STEPS)) for r in range(WORLD)}
    assert run.steps["forward_calls"].tolist() == [1] * WORLD * STEPS
    assert run.steps["batch_size"].tolist() == [16] * WORLD * STEPS  # the script's batch a rank
    per = run.phases.groupby(["rank", "step", "phase"]).size().unstack(fill_value=0)
    assert (per["forward"] == 1).all() and (per["backward"] == 1).all()
    assert (per.get("data", 0) <= 1).all()
    p = run.phases.assign(end=run.phases["start_ms"] + run.phases["duration_ms"])
    outer = p[p["phase"].isin(["forward", "backward"])]
    waits = p[p["phase"].isin(["all_gather_wait", "reduce_scatter_wait"])]
    for row in waits.itertuples():
        spans = outer[(outer["rank"] == row.rank) & (outer["step"] == row.step)]
        assert ((spans["start_ms"] <= row.start_ms + 1e-6) & (row.end <= spans["end"] + 1e-6)).any(), row
    gathers = fsdp_collective_table(run).set_index(["device", "collective"])
    for rank in range(WORLD):  # FULL_SHARD: the layers gathered again in backward, for their recomputation
        assert gathers.loc[(f"rank:{rank}", "all-gather"), "in_backward_per_step"] >= 3
    assert_parts_partition_the_steps(run)


def test_an_optimizer_stepping_another_inside_its_step_is_one_optimizer_part_to_its_end(tmp_path):
    """FSDP2 on a gloo world of one, its optimizer an SGD inside a wrapping optimizer (as ZeroRedundancyOptimizer
    steps its local optimizer, then broadcasts): the optimizer part was the inner step's alone (0.3 ms of 21 ms); it is
    the outer step, start to end."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from dpprof.instrument import instrument
    from recorded import train_with_a_wrapping_optimizer

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with instrument(store=False) as run:
            took = train_with_a_wrapping_optimizer(fully_shard(nn.Linear(4, 2)), own_s=0.02)
    finally:
        dist.destroy_process_group()
    phases = run.frames()["phases"]
    parts = phases[phases["phase"] == "optimizer"].set_index("step")["duration_ms"]
    assert parts.index.tolist() == [0, 1, 2]
    assert ((parts >= 20) & (parts <= took)).all(), (parts, took)


@pytest.mark.parametrize("script", [SCRIPT, SCRIPT1], ids=["fsdp2", "fsdp1"])
def test_dpprof_run_steps_stops_an_fsdp_script_at_its_limit(tmp_path, script):
    """`dpprof run --steps 3` of an FSDP script of 5 steps: the limit was checked before DataParallel's and DDP's
    stand-ins' forwards alone, so an FSDP script's run held all 5 steps. The root's forward now tells the session
    first: the run holds 3 steps a rank, the script goes on unrecorded, and its weights are the plain script's."""
    weights = {"plain": tmp_path / "plain.pt", "recorded": tmp_path / "recorded.pt"}
    _torchrun([script], {"FSDP_OUT": str(weights["plain"]), "DPPROF_REPORTS": str(tmp_path / "unused")})
    _torchrun(["-m", "dpprof", "run", "--steps", "3", script], {"FSDP_OUT": str(weights["recorded"]),
                                                                 "DPPROF_REPORTS": str(tmp_path / "runs")})
    _assert_same_weights(weights)
    run = dpprof.load_run(dpprof.list_runs(tmp_path / "runs").loc[0, "id"], tmp_path / "runs")
    assert run.model.steps == 3 < STEPS
    steps = run.steps
    assert sorted(steps["rank"].unique()) == [0, 1]
    assert all(sorted(g["step"]) == [0, 1, 2] for _, g in steps.groupby("rank"))
    assert any("recording stopped after 3 steps (--steps)" in n for n in run.notes["message"])

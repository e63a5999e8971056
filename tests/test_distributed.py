"""DistributedDataParallel on two gloo ranks over loopback (torchrun --standalone), recorded by dpprof."""
from __future__ import annotations

import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
import contextlib
from contextlib import contextmanager
from pathlib import Path

import forked
import pytest
import torch

import dpprof
from dpprof.cli import main
from dpprof.findings import run_findings
from dpprof.findings.ddp import bucket_counts
from dpprof.findings.steps import REST_SHARE_WARN
from dpprof.store import queries
from dpprof.records import SCRIPT_BUCKET
from dpprof.store.reader import RUN_SUFFIX, RunFileError

pytestmark = pytest.mark.slow

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
            "-m", "dpprof.ddp_worker"]


def _torchrun(*args, env=None, timeout=180):
    out = forked.run(TORCHRUN + list(args), capture_output=True, text=True, timeout=timeout,
                     env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


def test_a_two_rank_run_records_every_step_and_one_allreduce_per_bucket_per_step(reports, profiled):
    # `dpprof profile --ddp` called in this process, recorded once a session (test_invariants reads the same run)
    profiled(reports, "cifar-lenet", "--ddp", "--nproc", "2", "--steps", "6", "--batch-size", "32")
    [run_id] = dpprof.list_runs()["id"]
    runs = dpprof.list_runs()
    assert runs.loc[0, "ranks"] == 2 and runs.loc[0, "status"] == "finished" and runs.loc[0, "devices"] == "rank:0,rank:1"
    run = dpprof.load_run(run_id)
    assert len(run.paths) == 2 and run.meta["ranks"] == [0, 1]
    assert run.steps.groupby("rank")["step"].apply(list).to_dict() == {0: list(range(6)), 1: list(range(6))}
    per = run.phases.groupby(["device", "phase"]).size().unstack()
    for phase in ("forward", "backward", "backward_compute", "comm_wait", "optimizer"):
        assert per[phase].tolist() == [6, 6], phase
    assert per["data"].tolist() == [5, 5]  # the gap before every step but the first
    comms = run.comms
    assert set(comms["device"]) == {"rank:0", "rank:1"}
    for (step, device), c in comms.groupby(["step", "device"]):
        assert sorted(c["bucket"]) == list(range(len(c))), (step, device)  # each bucket once
    # both ranks reduce the same buckets, the same bytes, every step
    by_rank = comms.groupby("device").apply(lambda c: sorted(zip(c["step"], c["bucket"], c["bucket_bytes"])))
    assert by_rank["rank:0"] == by_rank["rank:1"]
    params = 62006 * 4  # the CIFAR-10 Net's parameters, float32
    assert comms[comms["step"] == 5].groupby("device")["bucket_bytes"].sum().tolist() == [params, params]


def test_a_slowed_rank_is_found_as_the_straggler():
    _torchrun("tutorial-linear", "--steps", "12", "--delay-rank", "1:40")  # 11 later steps: one jittered is no chance
    run = dpprof.load_run(dpprof.list_runs().loc[0, "id"])
    findings = run_findings(run).table.set_index("kind")
    assert findings.loc["straggler_rank", "device"] == "rank:1"
    waits = run.phases[run.phases["phase"] == "comm_wait"].groupby("device")["duration_ms"].median()
    assert waits["rank:0"] > 30 > waits["rank:1"]  # rank 0 waits ~40 ms at every all-reduce
    # found from the collectives or from the work times, its value is the others' wait as a share of the step
    assert findings.loc["straggler_rank", "unit"] == "share" and 0 < findings.loc["straggler_rank", "value"] <= 1


def test_a_rank_killed_mid_run_leaves_the_other_ranks_data_whole(reports):
    proc = forked.Popen(TORCHRUN + ["tutorial-linear", "--steps", "100000", "--timeout-s", "20"],
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                        env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        started = None
        for line in proc.stdout:
            if line.startswith("rank 1 step "):
                started = started or time.monotonic()
                if time.monotonic() - started > 2.0:  # four commit intervals of recorded steps
                    os.kill(int(line.split()[-1]), signal.SIGKILL)
                    break
        proc.wait(timeout=120)
    finally:
        proc.kill()
    files = sorted(reports.glob("*.rank*.sqlite"))
    assert len(files) == 2
    run = dpprof.load_run(files[0])
    assert run.meta["status"] in ("incomplete", "failed")
    steps = run.steps.groupby("rank")["step"].agg(["count", "max"])
    # each rank holds its committed steps, in order, from step 0 (at most the last 0.5 s is lost)
    assert steps.loc[0, "count"] == steps.loc[0, "max"] + 1 >= 10
    assert steps.loc[1, "count"] == steps.loc[1, "max"] + 1 >= 10
    assert run_findings(run).table is not None  # a killed run still analyses


def test_merge_gathers_rank_files_written_to_separate_directories(tmp_path, reports):
    _torchrun("tutorial-linear", "--steps", "4", "--reports-dir", str(tmp_path / "machine{rank}"))
    sources = [tmp_path / "machine0", tmp_path / "machine1"]
    assert [len(list(s.iterdir())) for s in sources] == [1, 1]
    assert main(["merge", *map(str, sources)]) == 0
    run = dpprof.load_run(dpprof.list_runs().loc[0, "id"])
    assert run.meta["ranks"] == [0, 1] and run.meta["devices"] == ["rank:0", "rank:1"]
    assert len(run.steps) == 8
    assert main(["merge", *map(str, sources)]) == 0  # again: identical files are left alone
    (sources[1] / os.listdir(sources[1])[0]).write_bytes(b"not the same rank file")
    with pytest.raises(RunFileError):
        from dpprof.store.merge import merge_rank_files
        merge_rank_files(sources, reports)
    assert len(dpprof.load_run(run.id).steps) == 8  # the merged run is untouched


def test_a_rank_that_cannot_record_says_why_in_one_line(tmp_path, reports, capsys):
    # the reports "directory" is a file: every rank's recording fails to start
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("kept as it was")
    assert main(["--reports-dir", str(blocker), "profile", "tutorial-linear", "--ddp", "--nproc", "2",
                 "--steps", "2", "--quiet"]) == 1
    err = capsys.readouterr().err
    lines = err.splitlines()
    said = [line for line in lines if line.startswith("dpprof rank ")]
    assert said and all(line.endswith(f": cannot record in {blocker}: not a directory") for line in said), err
    assert "Traceback" not in err and "ChildFailedError" not in err, err
    assert lines[-1].startswith("dpprof: torchrun exited with 1")
    assert blocker.read_text() == "kept as it was" and dpprof.list_runs().empty


def _left_in_its_log(path: Path) -> None:
    """What a rank killed while recording leaves: a commit (here one more step, a copy of its last) in the
    write-ahead log beside its file, never folded in (the process ends without closing)."""
    code = ("import os, sqlite3, sys\n"
            "con = sqlite3.connect(sys.argv[1]); con.execute('PRAGMA journal_mode=WAL')\n"
            "con.execute('PRAGMA wal_autocheckpoint=0')\n"
            "with con:\n"
            "    con.execute('INSERT INTO steps SELECT step + 1, start_ms + duration_ms, duration_ms, batch_size, "
            "devices_used, forward_calls, explicit, raised_calls, loader_ms FROM steps ORDER BY step DESC LIMIT 1')\n"
            "os._exit(0)\n")
    subprocess.run([sys.executable, "-c", code, str(path)], check=True)
    assert Path(f"{path}-wal").stat().st_size > 0


def test_merge_refuses_rank_files_it_must_not_copy_and_folds_a_killed_ranks_log(tmp_path, reports, capsys):
    _torchrun("tutorial-linear", "--steps", "4", "--reports-dir", str(tmp_path / "machine{rank}"))
    [rank0] = (tmp_path / "machine0").iterdir()
    [rank1] = (tmp_path / "machine1").iterdir()
    run_id = rank0.name.split(".rank")[0]

    def refused(*sources: Path) -> str:
        assert main(["merge", *map(str, sources)]) == 1
        [line] = capsys.readouterr().err.strip().splitlines()
        assert not list(reports.glob("*.sqlite"))
        return line

    odd = tmp_path / "odd"
    odd.mkdir()
    renamed = odd / f"20260101-000000-aaaaaa.rank1{RUN_SUFFIX}"  # another run's name
    shutil.copyfile(rank1, renamed)
    assert refused(rank0, renamed).endswith(f"named as run 20260101-000000-aaaaaa rank 1, but it holds run {run_id} "
                                            "rank 1; nothing was copied")
    other = odd / rank1.name  # the same id, another job (a --run-id used twice)
    shutil.copyfile(rank1, other)
    with sqlite3.connect(other) as con:
        con.execute("UPDATE runs SET name = 'another job'")
    con.close()
    assert refused(rank0, other) == (f"dpprof: {rank0} and {other} are two runs of one id ({run_id}): their name "
                                     "differ; nothing was copied")
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    shutil.copyfile(rank1, damaged / rank1.name)
    data = bytearray((damaged / rank1.name).read_bytes())
    page = len(data) - 2 * 4096  # a table's page near the end, which opening the file never reads, scrambled
    data[page:page + 4096] = os.urandom(4096)
    (damaged / rank1.name).write_bytes(bytes(data))
    said = refused(rank0, damaged / rank1.name)  # opening it finds the damage, else SQLite's quick_check does
    assert said.startswith(f"dpprof: {damaged / rank1.name}: ") and ("corrupt" in said or "damaged inside" in said)
    # a rank killed while recording: its last commit is in its log; the merged copy holds it, the source unchanged
    _left_in_its_log(rank1)
    before = rank1.read_bytes()
    assert main(["merge", str(rank0.parent), str(rank1.parent)]) == 0
    merged = dpprof.load_run(run_id)
    assert merged.steps.groupby("rank")["step"].max().to_dict() == {0: 3, 1: 4}
    assert rank1.read_bytes() == before and not Path(f"{reports / rank1.name}-wal").exists()
    assert main(["merge", str(rank0.parent), str(rank1.parent)]) == 0  # again: the same, left alone
    assert main(["merge", str(rank1.parent), str(rank1), str(rank0.parent)]) == 0  # one rank named twice at once


@contextmanager
def _gloo_world_of_one(tmp_path: Path) -> Iterator[None]:
    """A gloo process group of this process alone, destroyed at the block's end."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_a_gan_of_two_ddp_models_keeps_each_part_and_all_reduce_in_the_step_it_runs_in(tmp_path):
    """Two DDP models, two optimizers (a GAN) on a gloo world of one: the generator's forward is in the
    discriminator's step, its backward and all-reduce run in the generator's step after. They are recorded there, every
    phase lies inside its step, and the steps do not overlap (the next step's data part starts at the end of the
    step before it, not at the end of the generator's backward inside it)."""
    from torch import nn

    from dpprof.instrument import instrument
    from recorded import assert_phases_inside_steps, train_gan

    with _gloo_world_of_one(tmp_path), instrument(store=False) as run:
        train_gan(nn.parallel.DistributedDataParallel(nn.Linear(4, 8)),
                  nn.parallel.DistributedDataParallel(nn.Linear(8, 1)))
    frames = run.frames()
    steps = frames["steps"].set_index("step")
    ends = steps["start_ms"] + steps["duration_ms"]
    assert (steps["start_ms"].iloc[1:].to_numpy() >= ends.iloc[:-1].to_numpy() - 1e-6).all(), steps
    assert_phases_inside_steps(steps, frames["phases"])
    generator_bytes = (4 * 8 + 8) * 4
    last = steps.index.max()  # a generator step: the discriminator's gradients and the generator's are all-reduced
    comms = frames["comms"]
    assert sorted(comms.loc[comms["step"] == last, "bucket_bytes"]) == [(8 + 1) * 4, generator_bytes]
    assert (comms["bucket_bytes"] == generator_bytes).sum() == 3
    # each model's reducer numbers its one bucket 0: the run's comms numbered both 0, one bucket to bucket_counts
    assert sorted(comms.loc[comms["step"] == last, "bucket"]) == [0, 1]


def test_an_optimizer_stepping_another_inside_its_step_is_one_optimizer_part_to_its_end(tmp_path):
    """An optimizer whose step runs another's (ZeroRedundancyOptimizer's local optimizer, then its broadcast of the
    updated shards; a Lookahead wrapper): torch's optimizer hooks fire for both, and the inner step's end closed the
    part, so a rank's optimizer part was the inner SGD's 0.3 ms of a 21 ms optimizer.step(), the rest of it in no part.
    It is now the outer step, start to end."""
    from torch import nn

    from dpprof.instrument import instrument
    from recorded import train_with_a_wrapping_optimizer

    with _gloo_world_of_one(tmp_path), instrument(store=False) as run:
        took = train_with_a_wrapping_optimizer(nn.parallel.DistributedDataParallel(nn.Linear(4, 2)), own_s=0.02)
    phases = run.frames()["phases"]
    parts = phases[phases["phase"] == "optimizer"].set_index("step")["duration_ms"]
    assert parts.index.tolist() == [0, 1, 2]
    assert ((parts >= 20) & (parts <= took)).all(), (parts, took)


def test_a_ddp_backward_ends_after_the_reducer_copied_the_all_reduced_gradients_into_grad(tmp_path):
    """DDP's reducer finishes backward in an autograd final callback it queues during the graph, after the one dpprof
    queued at backward's start: it waits for every bucket's all-reduce, then (gradient_as_bucket_view=False, torch's
    default) copies each bucket's reduced gradients into the parameters' .grad. Backward's end was taken in dpprof's
    callback, before that: the copy (about 8 ms a step for this model's 48 MiB of gradients) and a thread's late
    wake-up after the all-reduce (ms on a busy machine) were in no part of the step, which the unrecorded_time
    finding then put down to the script's own code. Backward now ends after the reducer's callback, where
    loss.backward() returns."""
    import time

    from torch import nn

    from dpprof.instrument import instrument

    torch.manual_seed(0)
    returned_ns = []
    with _gloo_world_of_one(tmp_path), instrument(store=False) as run:
        model = nn.parallel.DistributedDataParallel(nn.Sequential(*(nn.Linear(2048, 2048) for _ in range(3))))
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        x = torch.randn(2, 2048)
        for _ in range(4):
            model(x).sum().backward()
            returned_ns.append(time.perf_counter_ns())
            opt.step()
            opt.zero_grad(set_to_none=False)
        buffers = [p.grad.clone() for p in model.parameters()]
        t0 = time.perf_counter()
        for b, p in zip(buffers, model.parameters()):
            b.copy_(p.grad)
        copy_ms = (time.perf_counter() - t0) * 1e3
    phases = run.frames()["phases"]
    backward = phases[phases["phase"] == "backward"].set_index("step")
    ends = backward["start_ms"] + backward["duration_ms"]
    after = [run.ms(t) - end for t, end in zip(returned_ns, ends)]
    assert all(a >= -1e-3 for a in after), after  # never past backward's return
    assert max(after[1:]) < max(1.0, copy_ms / 2), (after, copy_ms)  # the copy is inside backward
    split = phases[phases["phase"].isin(["backward_compute", "comm_wait"])].groupby("step")["duration_ms"].sum()
    assert split.to_numpy() == pytest.approx(backward["duration_ms"].to_numpy(), abs=1e-6)


@pytest.mark.parametrize("hook", ["default", "script's"])
def test_a_recorded_ddp_model_is_freed_when_the_script_drops_it(tmp_path, hook):
    """dpprof's timed communication hook held its DDP model, and torch's reducer (C++, out of the collector's sight)
    holds the hook; and the latest step's probe, which holds the model inside DDP, stayed in a module of dpprof after
    its run. A recorded model, its gradients' buckets and its process group stayed alive after the script dropped
    them, until the interpreter's end, where gloo's objects freed then aborted a rank now and then ("terminate called
    without an active exception" after a clean run). The hook now reaches its model by a weak reference, and a run
    lets its probes go as it closes: the model is freed when the script drops it, whether dpprof registered torch's
    default all-reduce or the script its own hook."""
    import gc
    import weakref

    from torch import nn
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    from dpprof.instrument import instrument

    with _gloo_world_of_one(tmp_path):
        with instrument(store=False) as run:
            model = nn.parallel.DistributedDataParallel(nn.Linear(4, 2))
            if hook == "script's":
                model.register_comm_hook(None, allreduce_hook)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            for _ in range(3):
                model(torch.randn(8, 4)).sum().backward()
                optimizer.step()
                optimizer.zero_grad()
        freed = [weakref.ref(model), weakref.ref(model.module)]
        del model, optimizer
        gc.collect()
        assert [ref() for ref in freed] == [None, None]
    assert len(run.frames()["comms"]) == 3  # the hook was dpprof's, timing each step's bucket


def test_torchs_constructor_warnings_point_at_the_line_that_built_the_model(tmp_path):
    """torch's DDP warns at its caller's line (stacklevel=2: broadcast_buffers' deprecation); under dpprof that line
    was dpprof/parallel/distributed.py's call of torch's constructor, for dpprof's DDP and the stand-in dpprof run
    puts in torch's place alike, where torch names the script's line."""
    import warnings

    from torch import nn

    from dpprof.instrument import instrument

    with _gloo_world_of_one(tmp_path):
        for wrap in ("torch", "dpprof", "stand-in"):
            with warnings.catch_warnings(record=True) as caught, instrument(store=False) if wrap == "stand-in" else \
                    contextlib.nullcontext():
                warnings.simplefilter("always")
                cls = dpprof.DistributedDataParallel if wrap == "dpprof" else nn.parallel.DistributedDataParallel
                line = sys._getframe().f_lineno + 1
                cls(nn.Linear(4, 2), broadcast_buffers=True)
            [said] = [w for w in caught if "broadcast_buffers" in str(w.message)]
            assert (said.filename, said.lineno, said.category) == (__file__, line, FutureWarning), wrap


def test_torchs_constructor_warnings_keep_the_scripts_filters(tmp_path, monkeypatch):
    """dpprof's constructor caught torch's warnings in warnings.catch_warnings and gave them again: entering it reset
    every module's once-only registry, so under the "default" filter the deprecation of broadcast_buffers given at
    one line was shown once a model built there (torch: once), and a warning not pointing into dpprof was given
    again under a module named for its file, past the script's filter naming its module."""
    import warnings

    from torch import nn
    from torch.nn.parallel import distributed as torch_ddp

    from dpprof.instrument import instrument

    verify = torch_ddp._verify_param_shape_across_processes

    def verify_warning(*args, **kwargs):  # a warning of a module's own inside torch's constructor, at its line
        warnings.warn("the module's own warning", UserWarning, stacklevel=1)
        return verify(*args, **kwargs)

    with _gloo_world_of_one(tmp_path):
        nn.parallel.DistributedDataParallel(nn.Linear(4, 2))  # torch's first model changes its filters once
        monkeypatch.setattr(torch_ddp, "_verify_param_shape_across_processes", verify_warning)
        for wrap in ("torch", "dpprof", "stand-in"):
            with warnings.catch_warnings(record=True) as caught, instrument(store=False) if wrap == "stand-in" else \
                    contextlib.nullcontext():
                warnings.simplefilter("default")
                warnings.filterwarnings("ignore", "the module's own warning", module=__name__)
                cls = dpprof.DistributedDataParallel if wrap == "dpprof" else nn.parallel.DistributedDataParallel
                for _ in range(3):
                    cls(nn.Linear(4, 2), broadcast_buffers=True)
            said = [str(w.message)[:30] for w in caught]
            assert said == ["`broadcast_buffers` is depreca"], wrap


def test_a_distillation_of_ddp_models_is_one_step_an_iteration(tmp_path):
    """A DDP teacher under no_grad, then a DDP student with grad, its backward and optimizer step, on a gloo world of
    one: one step an iteration (the student's forward joins the step the teacher's opened), its batch counted once;
    the student's evaluation after training is a step a forward, and its next training forward starts a step."""
    from torch import nn

    from dpprof.instrument import instrument
    from recorded import train_distillation

    with _gloo_world_of_one(tmp_path), instrument(store=False) as run:
        train_distillation(nn.parallel.DistributedDataParallel(nn.Linear(4, 3)),
                           nn.parallel.DistributedDataParallel(nn.Linear(4, 3)))
    steps = run.frames()["steps"]
    assert steps["forward_calls"].tolist() == [2, 2, 2, 1, 1, 2]
    assert steps["batch_size"].tolist() == [6] * 6
    comms = run.frames()["comms"]
    assert sorted(comms["step"].unique()) == [0, 1, 2, 5]  # the student's all-reduce, in each training step


def _ddp_steps_pausing(tmp_path: Path, pause_s: float, steps: int = 6, pausing: set[int] | None = None) -> dpprof.StoredRun:
    """A DDP model (Linear 1024 x 1024, batch 256: steps of tens of ms, so the loss and the Python between the parts
    are a few % of them) on a gloo world of one, recorded into the reports directory: each step (or each of
    ``pausing``) pauses ``pause_s`` after backward, in the script's own code (as a logging all-reduce waiting for a
    late rank would), before the optimizer step."""
    import torch
    from torch import nn

    from dpprof.instrument import instrument

    torch.manual_seed(0)
    with _gloo_world_of_one(tmp_path), instrument(name="pausing") as run:
        model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024)))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        for step in range(steps):
            optimizer.zero_grad()
            model(torch.randn(256, 1024)).square().mean().backward()
            time.sleep(pause_s if pausing is None or step in pausing else 0.0)
            optimizer.step()
    return dpprof.load_run(run.id)


def _rest_by_hand(run: dpprof.StoredRun) -> tuple[float, float]:
    """rank:0's mean step past the first, and the mean of its time in none of its recorded phases, from the raw rows:
    each step's length less the union of its phases (clipped to the step)."""
    length, rest = _rest_per_step_by_hand(run)
    return sum(length) / len(length), sum(rest) / len(rest)


def _rest_is_mostly_over_by_hand(run: dpprof.StoredRun) -> bool:
    """The unrecorded_time rule on the raw rows: the mean rest over REST_SHARE_WARN of the mean step, and the rest of
    most steps over it of theirs (the test's own loop, not the step model's partition)."""
    from dpprof.findings.floors import worth_time

    length, rest = _rest_per_step_by_hand(run)
    over = sum(r > REST_SHARE_WARN * n for n, r in zip(length, rest))
    step_ms, rest_ms = sum(length) / len(length), sum(rest) / len(rest)
    return rest_ms > REST_SHARE_WARN * step_ms and 2 * over > len(length) and worth_time(rest_ms, step_ms)


def _rest_per_step_by_hand(run: dpprof.StoredRun) -> tuple[list[float], list[float]]:
    """rank:0's steps past the first: each one's length, and its time in none of its recorded phases."""
    steps, phases = run.steps.set_index("step"), run.phases
    rest, length = [], []
    for step, row in steps.iloc[1:].iterrows():
        lo, hi = row["start_ms"], row["start_ms"] + row["duration_ms"]
        spans = sorted((max(lo, s), min(hi, s + d)) for s, d in
                       phases.loc[phases["step"] == step, ["start_ms", "duration_ms"]].itertuples(index=False))
        covered, reach = 0.0, lo
        for a, b in spans:
            if b > max(a, reach):
                covered += b - max(a, reach)
                reach = b
        rest.append(hi - lo - covered)
        length.append(hi - lo)
    return length, rest


def test_a_rank_whose_step_is_mostly_its_scripts_own_code_is_told_what_dpprof_does_not_time(tmp_path, reports):
    """A DDP step that spends 200 ms after backward in the script's own code (nothing dpprof times) gets a finding on
    the rank: its share of the step outside the recorded parts, the same ms as the step less the union of its phases
    computed here from the raw rows; the same model without the pause gets none, and nor does one that pauses in one
    step of five (a stall: most of its steps' rest is under the threshold, though the mean's is over it)."""
    import re

    run = _ddp_steps_pausing(tmp_path, 0.2)
    found = run_findings(run).table
    rest = found[found["kind"] == "unrecorded_time"]
    assert len(rest) == 1, found[["kind", "title"]]
    step_ms, rest_ms = _rest_by_hand(run)
    assert rest_ms >= 200 and rest.iloc[0]["device"] == "rank:0"
    assert rest.iloc[0]["value"] == pytest.approx(rest_ms / step_ms, rel=1e-6)
    said = re.search(r"([0-9.]+) ms of rank:0's ([0-9.]+) ms mean step past the first \(5 steps\)", rest.iloc[0]["evidence"])
    assert said and float(said[1]) == pytest.approx(rest_ms, abs=0.006) and float(said[2]) == pytest.approx(step_ms, abs=0.006)
    assert f"{rest_ms / step_ms:.0%} of the step is outside" in rest.iloc[0]["title"]
    assert "over 25% of the step in 5 of them" in rest.iloc[0]["evidence"]
    # without the pause, and with it in one step of five: no finding where the steps' own rest is under the threshold
    # in most of them. A loaded machine (other work on the 2 cores) can stretch the Python between the parts of every
    # step past it: the rule is then checked on the steps this run recorded, computed here from the raw rows
    (tmp_path / "quiet").mkdir()
    quiet = _ddp_steps_pausing(tmp_path / "quiet", 0.0)
    assert ("unrecorded_time" in set(run_findings(quiet).table["kind"])) == _rest_is_mostly_over_by_hand(quiet)
    (tmp_path / "once").mkdir()
    once = _ddp_steps_pausing(tmp_path / "once", 0.4, pausing={3})
    assert ("unrecorded_time" in set(run_findings(once).table["kind"])) == _rest_is_mostly_over_by_hand(once)


def test_a_second_ddp_models_forward_in_the_step_reads_no_data_over_the_first_models(tmp_path):
    """An encoder and a decoder, each its own DDP, one loss and one optimizer: the decoder's forward recorded a data
    part from the step's start, over the encoder's forward (2 gloo ranks: 1.43 ms of data a step where 0.36 ms was
    loading, and a data finding of 21% of the step). A later forward's data starts after the parts recorded in its
    step before it."""
    import torch
    from torch import nn

    from dpprof.instrument import instrument

    with _gloo_world_of_one(tmp_path), instrument(store=False) as run:
        enc = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(32, 64), nn.ReLU()))
        dec = nn.parallel.DistributedDataParallel(nn.Linear(64, 8))
        opt = torch.optim.SGD([*enc.parameters(), *dec.parameters()], lr=0.1)
        for _ in range(4):
            x = torch.randn(16, 32)
            dec(enc(x)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    frames = run.frames()
    phases = frames["phases"]
    phases = phases.assign(end_ms=phases["start_ms"] + phases["duration_ms"])
    assert phases.groupby("phase").size()[["data", "forward"]].tolist() == [6, 8]  # no data before the first step
    # two models, a bucket each: two buckets a step (both were numbered 0: one bucket to the bucket finding and the
    # Overview's buckets per step), each model's numbers the same in every step
    comms = frames["comms"]
    assert bucket_counts(comms).tolist() == [2, 2, 2]
    assert comms.groupby("step")["bucket"].apply(sorted).tolist() == [[0, 1]] * 4
    for step, p in phases[phases["phase"].isin(["data", "forward"])].groupby("step"):
        p = p.sort_values("start_ms")
        assert (p["start_ms"].iloc[1:].to_numpy() >= p["end_ms"].iloc[:-1].to_numpy() - 1e-6).all(), p  # none overlap


def _train_hooked(register, recorded: bool) -> tuple[list, object, list[str]]:
    """A DDP Linear trained 3 steps in this process's gloo world after ``register(ddp)`` ran (it registers a comm hook,
    and may run a forward first), recorded or not: its weights, the run (None unrecorded) and the hooks that ran."""
    import contextlib

    import torch
    from torch import nn

    from dpprof.instrument import instrument

    ran: list[str] = []
    torch.manual_seed(0)
    with instrument(store=False) if recorded else contextlib.nullcontext() as run:
        ddp = nn.parallel.DistributedDataParallel(nn.Linear(6, 3))
        opt = torch.optim.SGD(ddp.parameters(), lr=0.5)
        register(ddp, ran)
        for _ in range(3):
            ddp(torch.randn(4, 6)).pow(2).sum().backward()
            opt.step()
            opt.zero_grad()
    return [p.detach().clone() for p in ddp.parameters()], run, ran


def _fp16_after_an_evaluation(ddp, ran) -> None:
    """A forward under no_grad (an evaluation before training), then torch's fp16 compression hook, counted."""
    import torch
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook

    def counted(state, bucket):
        ran.append("fp16")
        return fp16_compress_hook(state, bucket)

    with torch.no_grad():
        ddp(torch.randn(2, 6))
    ddp.register_comm_hook(None, counted)


def test_a_comm_hook_registered_after_a_recorded_forward_runs_in_place_of_dpprofs_timed_all_reduce(tmp_path):
    """dpprof registers its timed default all-reduce at a recorded forward; torch's reducer takes one hook, once. A
    script that evaluates first and then registers its hook raised 'register_comm_hook or register_builtin_comm_hook
    can only be called once' under dpprof: now the script's hook runs there, timed, and trains as without dpprof; a
    second registration is still torch's error."""
    import torch

    with _gloo_world_of_one(tmp_path):
        plain, _, plain_ran = _train_hooked(_fp16_after_an_evaluation, recorded=False)
        weights, run, ran = _train_hooked(_fp16_after_an_evaluation, recorded=True)
        assert ran == plain_ran == ["fp16"] * 3
        assert all(torch.equal(a, b) for a, b in zip(plain, weights))
        comms = run.frames()["comms"]
        # what the hook all-reduced: the bucket's 21 gradients in float16
        assert comms["step"].tolist() == [1, 2, 3] and set(comms["bucket_bytes"]) == {(6 * 3 + 3) * 2}

        def twice(ddp, ran):
            _fp16_after_an_evaluation(ddp, ran)
            ddp.register_comm_hook(None, lambda state, bucket: None)

        with pytest.raises(RuntimeError, match="can only be called once"):
            _train_hooked(twice, recorded=True)


@pytest.mark.parametrize("hook, sent_bytes", [
    (None, [2080 * 4] * 3),  # torch's default all-reduce: the bucket, float32
    ("fp16", [2080 * 2] * 3),  # its float16 copy
    # PowerSGD of rank 1 from its third iteration: the plain bucket before; then each matrix's P and Q (the weight's
    # 32 + 64, the bias, a 32x1 matrix, its 32 + 1) and nothing uncompressed, two all-reduces from its callbacks
    ("powersgd", [2080 * 4, 2080 * 4, (32 + 64 + 32 + 1) * 4]),
])
def test_sent_per_step_is_what_the_comm_hook_sent_not_the_buckets_size(tmp_path, reports, hook, sent_bytes,
                                                                        monkeypatch):
    """A compressing hook all-reduces fewer bytes than its bucket holds: the comms rows, `dpprof show`'s sent per step
    and the CSV said the bucket's 8,320 bytes under fp16_compress_hook (it sent 4,160) and under PowerSGD (516)."""
    import torch
    from torch import nn
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    from dpprof.instrument import instrument
    from dpprof.views.overview import comm_stats

    with _gloo_world_of_one(tmp_path):
        torch.manual_seed(0)
        with instrument(name=f"hook-{hook}", reports_dir=reports):
            ddp = nn.parallel.DistributedDataParallel(nn.Linear(64, 32))  # 2,080 parameters, one bucket
            if hook == "fp16":
                ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
            elif hook == "powersgd":
                state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                                    start_powerSGD_iter=2, min_compression_rate=0.5)
                ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
            opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
            for _ in range(3):
                ddp(torch.randn(8, 64)).pow(2).sum().backward()
                opt.step()
                opt.zero_grad()
    [run_id] = dpprof.list_runs(reports)["id"]
    run = dpprof.load_run(run_id, reports)
    assert run.comms.sort_values("step")["bucket_bytes"].tolist() == sent_bytes
    assert comm_stats(run)["sent_per_step_bytes"].tolist() == [sum(sent_bytes[1:]) / 2]  # the steps past the first
    assert main(["export", run_id, "--out", str(tmp_path / "csv")]) == 0
    csv = (tmp_path / "csv" / "comms.csv").read_text()
    assert f",{sent_bytes[-1]}," in csv
    # the run keeps the hook's name, and the communication finding's advice does not tell it to compress again
    from dpprof.findings.ddp import _compress_words

    named = {None: None, "fp16": "fp16_compress_hook", "powersgd": "powerSGD_hook"}[hook]
    assert run.model.comm_hook == named
    advice = _compress_words(run.model.comm_hook)
    assert ("already go through the compressing communication hook " + named in advice) if named else \
        advice.startswith(", or compress gradients")
    # the bucket finding's bucket_cap_mb came from the bytes sent: half the bucket under fp16, a 16th under PowerSGD
    from dpprof.findings import ddp as ddp_findings, tables_of

    monkeypatch.setattr(ddp_findings, "COMM_SHARE_WARN", 0.0)  # its figures are what this tests, not its thresholds
    monkeypatch.setattr(ddp_findings, "SMALL_BUCKET_BYTES", 0)
    monkeypatch.setattr(ddp_findings, "worth_time", lambda *a: True)
    [bucket] = [f for f in ddp_findings.communication(tables_of(run)) if f["kind"] == "bucket_size"]
    if named:
        assert "to below" not in bucket["advice"] and f"what {named} sent" in bucket["advice"]
    else:
        assert f"to below {8320 / 2**20 / 4:.2g} so it overlaps" in bucket["advice"]


def _builtin_fp16(ddp, ran) -> None:
    import torch.distributed as dist

    ddp._register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS)


def test_a_builtin_comm_hook_trains_as_without_dpprof_its_backward_whole_and_said(tmp_path):
    """torch's built-in (C++) hook, which dpprof cannot wrap: the script raised 'can only be called once' at its first
    recorded forward (dpprof registered its own hook there). Now it trains as without dpprof; its backward is one part
    (the wait for the unseen all-reduce is in it), no all-reduce rows, and the run's note says why."""
    import torch

    with _gloo_world_of_one(tmp_path):
        plain, _, _ = _train_hooked(_builtin_fp16, recorded=False)
        weights, run, _ = _train_hooked(_builtin_fp16, recorded=True)
    assert all(torch.equal(a, b) for a, b in zip(plain, weights))
    frames = run.frames()
    assert frames["phases"].groupby("phase").size().to_dict() == {"backward": 3, "data": 2, "forward": 3,
                                                                   "optimizer": 3}
    assert frames["comms"].empty
    assert any("built-in communication hook (BuiltinCommHookType.FP16_COMPRESS)" in m
               for m in frames["notes"]["message"])
    assert run.workload_args["comm_hook"] == "BuiltinCommHookType.FP16_COMPRESS"  # the advice's: no compressing again


def test_a_hook_torchs_constructor_registers_is_the_scripts_not_replaced_by_dpprofs(tmp_path):
    """DDP's constructor registers a comm hook itself for parameters with optimizers in backward (and for its
    mixed_precision): dpprof's constructor forgot it after torch's returned, and its first recorded forward raised
    'register_comm_hook or register_builtin_comm_hook can only be called once'. Now the recorded script ends as
    torch's does (on a machine with no accelerator, torch's own error in backward)."""
    import contextlib

    import torch
    from torch import nn
    from torch.distributed.optim import _apply_optimizer_in_backward

    from dpprof.instrument import instrument

    def train(recorded: bool) -> str:
        torch.manual_seed(0)
        net = nn.Linear(6, 3)
        _apply_optimizer_in_backward(torch.optim.SGD, net.parameters(), {"lr": 0.5})
        try:
            with instrument(store=False) if recorded else contextlib.nullcontext():
                ddp = nn.parallel.DistributedDataParallel(net)
                for _ in range(3):
                    ddp(torch.randn(4, 6)).pow(2).sum().backward()
        except RuntimeError as err:
            return str(err)
        return repr(net.weight.detach().flatten().tolist())

    with _gloo_world_of_one(tmp_path):
        assert train(recorded=True) == train(recorded=False)


def test_a_ddp_runs_samples_per_s_leaves_its_evaluation_steps_out_from_its_rows_and_its_aggregates():
    """A DDP script (dpprof run under torchrun, 2 ranks) that evaluates a batch of 64 under no_grad on every rank after
    every third training step of 32: read from its rows, samples/s counted the training steps' samples alone; read
    from its aggregates (a long run's way), every step's, the evaluations' too, as trained. The ranks' step blocks
    count the steps a backward ran in and their samples, and DDP's all-reduce has every rank backward in the same
    steps: both reads now give what the script trained, 8 training steps past the first on 2 ranks of 32."""
    out = forked.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
                      "dpprof", "run", str(Path(__file__).parent / "scripts" / "train_ddp.py"), "--steps", "9",
                      "--evaluate-every", "3"], capture_output=True, text=True, timeout=180,
                     env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    run_id = dpprof.list_runs().loc[0, "id"]
    rows, aggregates = dpprof.load_run(run_id, read="rows"), dpprof.load_run(run_id, read="aggregates")
    assert rows.ranks == 2 and not rows.model.aggregated and aggregates.model.aggregated
    kinds = "TTTE" * 3  # the script's own account of its steps
    steps = rows.steps.sort_values(["rank", "step"])
    assert steps["batch_size"].tolist() == [64 if k == "E" else 32 for k in kinds] * 2
    ends = (steps["start_ms"] + steps["duration_ms"]).groupby(steps["step"]).max()
    for run in (rows, aggregates):
        rate = queries.throughput(run)
        assert rate is not None and (rate.samples, rate.evaluation_steps) == (2 * 32 * 8, 3), run.model.aggregated
        assert rate.samples_per_s == pytest.approx(2 * 32 * 8 / (ends.iloc[-1] - ends.iloc[0]) * 1e3, rel=1e-9)


def test_a_batch_every_rank_skipped_after_its_forward_raised_is_a_step_of_neither_kind(tmp_path, capsys):
    """A DDP script (dpprof run under torchrun, 2 ranks, 6 steps of 32) whose model's forward raises on a NaN in step
    3's batch on every rank, which the script catches and goes on (zero_grad, next batch): DDP's forward did not count
    the call that raised, as DataParallel's does, so the step held no raised call (and the next batch's forward joined
    it: 5 steps, step 3 of 2 calls and 64 samples a rank, all counted in samples/s). The call is counted now: 6 steps,
    step 3 raised on each rank, neither kind, its samples not counted, said by `dpprof show`; the weights are the
    unrecorded script's."""
    script = [str(Path(__file__).parent / "scripts" / "train_ddp.py"), "--steps", "6", "--nan-at", "3"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    outs = [forked.run(torchrun + command + ["--save", str(tmp_path / f"{name}.pt")], capture_output=True, text=True,
                       timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"})
            for name, command in (("plain", script), ("recorded", ["-m", "dpprof", "run", *script]))]
    for out in outs:
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert outs[0].stdout == outs[1].stdout and "step 3 skipped" in outs[0].stdout
    plain, recorded = (torch.load(tmp_path / f"{name}.pt") for name in ("plain", "recorded"))
    assert plain.keys() == recorded.keys() and all(torch.equal(plain[k], recorded[k]) for k in plain)
    run = dpprof.load_run(dpprof.list_runs().loc[0, "id"])
    steps = run.steps.sort_values(["rank", "step"])
    assert steps["forward_calls"].tolist() == [1] * 12 and steps["batch_size"].tolist() == [32] * 12
    assert steps["raised_calls"].tolist() == [0, 0, 0, 1, 0, 0] * 2
    assert queries.raised_steps(run) == 1
    rate = queries.throughput(run)
    assert rate is not None and (rate.samples, rate.evaluation_steps, rate.raised_steps) == (2 * 32 * 4, 0, 1)
    capsys.readouterr()
    assert main(["show", dpprof.list_runs().loc[0, "id"]]) == 0
    assert "\n  1 step's forward raised, the script going on" in capsys.readouterr().out


def test_a_collective_the_script_bound_by_name_before_the_first_recorded_forward_is_timed(tmp_path):
    """A script recorded by dpprof.record that imports ``from torch.distributed import all_reduce`` at its top and
    all-reduces a metric by that name after each step: dpprof wrapped torch.distributed's collectives at the first
    recorded DDP forward, after the script had bound torch's own function, so those calls were not timed while
    ``dist.all_reduce``'s were. The names the script's modules hold are bound to the timed collectives then too; a
    function's local name, which dpprof cannot rebind, is untimed and the run's notes say so."""
    out = forked.run([sys.executable, str(Path(__file__).parent / "scripts" / "record_ddp_metric.py"), str(tmp_path)],
                     capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    run = dpprof.load_run(dpprof.list_runs().loc[0, "id"])
    own = run.comms[run.comms["bucket"] == SCRIPT_BUCKET]
    # each step's metrics are the next step's (held for its forward); the last step's are in no step
    assert own.groupby("bucket_bytes").size().to_dict() == {16: 3, 32: 3}
    notes = run.notes["message"].tolist()
    assert ("the script's reduce_here in train() (record_ddp_metric.py) is torch.distributed's all_reduce, bound before "
            "the first recorded forward to a local name dpprof cannot rebind: its calls are not timed (call "
            "torch.distributed.all_reduce there, or record with dpprof run, which times it from the start)") in notes

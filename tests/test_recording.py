"""What a recorded run holds: phases, steps, chunk sizes and bytes, profiler ranges."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

import dpprof
from dpprof.records import PHASES


def _linear_net(workers: int) -> dpprof.DataParallel:
    torch.manual_seed(0)
    return dpprof.DataParallel(nn.Linear(5, 2), device_ids=dpprof.cpu_devices(workers))


@pytest.mark.parametrize("batch, workers, chunks", [
    (30, 3, [10, 10, 10]),  # the tutorial on 3 GPUs
    (10, 3, [4, 4, 2]),
    (10, 8, [2, 2, 2, 2, 2]),  # only 5 of 8 devices get a chunk
    (5, 4, [2, 2, 1]),
])
def test_chunk_sizes_and_bytes_are_recorded_per_device(batch, workers, chunks):
    net = _linear_net(workers)
    with dpprof.record(name="chunks") as run:
        net(torch.randn(batch, 5)).sum().backward()
    frames = run.frames()
    mem = frames["memory"].set_index("device").sort_index()
    assert mem["chunk_size"].tolist() == chunks
    assert mem["input_bytes"].tolist() == [c * 5 * 4 for c in chunks]
    assert mem["output_bytes"].tolist() == [c * 2 * 4 for c in chunks]
    # Linear saves its input chunk for the weight gradient; the weight itself is not an activation
    assert mem["activation_bytes"].tolist() == [c * 5 * 4 for c in chunks]
    assert mem["param_bytes"].tolist() == [(5 * 2 + 2) * 4] * len(chunks)
    assert mem.loc["cpu:0", "gathered_bytes"] == batch * 2 * 4
    assert mem["gathered_bytes"].iloc[1:].eq(0).all()
    step = frames["steps"].iloc[0]
    assert (step["batch_size"], step["devices_used"], step["forward_calls"]) == (batch, len(chunks), 1)


def test_every_phase_is_recorded_once_per_step_and_nested_in_time():
    net = _linear_net(2)
    with dpprof.record(name="phases") as run:
        for _ in range(3):
            with run.step():
                net(torch.randn(8, 5)).sum().backward()
    phases = run.frames()["phases"]
    counts = phases.groupby(["step", "phase"]).size().unstack()
    assert set(counts.columns) == set(PHASES) - {"loss", "reduce"}  # MeasuredLoss and the balanced criterion
    assert (counts["apply"] == 2).all() and (counts.drop(columns="apply") == 1).all().all()
    for _, step in phases.groupby("step"):
        by = {p: r for p, r in step.groupby("phase")}
        pa = by["parallel_apply"].iloc[0]
        for _, apply in by["apply"].iterrows():  # each replica's apply lies inside parallel_apply
            assert pa.start_ms <= apply.start_ms
            assert apply.start_ms + apply.duration_ms <= pa.start_ms + pa.duration_ms + 1e-3
        order = [by[p].iloc[0].start_ms for p in ("scatter", "replicate", "parallel_apply", "gather", "backward")]
        assert order == sorted(order)
    steps = run.frames()["steps"]
    assert steps["explicit"].all() and steps["step"].tolist() == [0, 1, 2]
    assert phases["device_duration_ms"].isna().all()  # no CUDA events on CPU workers


def test_without_run_step_each_forward_starts_a_step():
    net = _linear_net(2)
    with dpprof.record(name="implicit") as run:
        for _ in range(4):
            net(torch.randn(6, 5)).sum().backward()
    frames = run.frames()
    assert frames["steps"]["step"].tolist() == [0, 1, 2, 3]
    assert not frames["steps"]["explicit"].any()
    assert frames["phases"].query("phase == 'backward'")["step"].tolist() == [0, 1, 2, 3]
    # an implicit step spans its forward and its backward
    for _, s in frames["steps"].iterrows():
        bw = frames["phases"].query("phase == 'backward' and step == @s.step").iloc[0]
        assert s.start_ms + s.duration_ms >= bw.start_ms + bw.duration_ms - 1e-3


class _SleepySGD(torch.optim.SGD):
    """SGD whose step also sleeps ``sleep_s``: an optimizer step of known length."""

    def __init__(self, params, sleep_s: float) -> None:
        super().__init__(params, lr=0.1)
        self.sleep_s = sleep_s

    def step(self, closure=None):
        time.sleep(self.sleep_s)
        return super().step(closure)


def test_an_implicit_step_holds_the_optimizer_steps_after_its_backward():
    """Without run.step(), a DataParallel step ended at its last phase, its backward: the optimizer steps after it were
    in no step (here two optimizers of 10 ms each after every backward, in steps of about 2 ms), where a DDP rank's
    implicit step holds them and `dpprof run`'s ends at them. It now ends after them. A step with no backward (an
    evaluation forward) is not stretched over an optimizer step after it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 2))
    net = dpprof.DataParallel(model, device_ids=dpprof.cpu_devices(2))
    first, second = _SleepySGD(model[0].parameters(), 0.01), _SleepySGD(model[2].parameters(), 0.01)
    with dpprof.record(name="implicit optimizers") as run:
        for _ in range(3):
            net(torch.randn(6, 5)).sum().backward()
            first.step()
            second.step()
        with torch.no_grad():
            net(torch.randn(6, 5))
        first.step()  # after a step with no backward: not that step's
    frames = run.frames()
    steps = frames["steps"].set_index("step")
    assert steps.index.tolist() == [0, 1, 2, 3]
    last_part_end = frames["phases"].eval("end = start_ms + duration_ms").groupby("step")["end"].max()
    after = steps["start_ms"] + steps["duration_ms"] - last_part_end  # what no phase covers after the last one
    assert (after[:3] >= 20).all(), after
    assert after[3] < 10, after


def test_an_implicit_step_holds_no_optimizer_step_of_a_model_the_run_does_not_record():
    """A plain module beside the DataParallel, its optimizer stepped after loading the next batch (30 ms) and before
    the DataParallel's forward: the step still open then ended at that optimizer step, over the loading (steps of 33 to
    34 ms where 8 ms were recorded). Only an optimizer of a recorded module's weights moves a step's end."""
    torch.manual_seed(0)
    net = dpprof.DataParallel(nn.Linear(8, 4), device_ids=dpprof.cpu_devices(2))
    plain = nn.Linear(8, 4)
    optimizer, plain_optimizer = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (net, plain))
    with dpprof.record(name="beside a plain model") as run:
        for _ in range(4):
            time.sleep(0.03)  # loading the batch
            plain(torch.randn(8, 8)).sum().backward()
            plain_optimizer.step()
            net(torch.randn(8, 8)).sum().backward()
            optimizer.step()
    steps = run.frames()["steps"].sort_values("step")
    gaps = steps["start_ms"].to_numpy()[1:] - (steps["start_ms"] + steps["duration_ms"]).to_numpy()[:-1]
    assert (gaps >= 30).all(), gaps  # each loading lies between two steps


def test_two_forward_calls_in_one_step_are_two_calls():
    net = _linear_net(2)
    with dpprof.record(name="two calls") as run:
        with run.step():
            (net(torch.randn(4, 5)).sum() + net(torch.randn(6, 5)).sum()).backward()
    frames = run.frames()
    assert frames["steps"].iloc[0][["batch_size", "forward_calls"]].tolist() == [10, 2]
    assert sorted(frames["memory"]["call"].unique().tolist()) == [0, 1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="torch's pass-through is what it does without a GPU")
def test_a_data_parallel_with_no_device_to_spread_over_counts_its_steps_batch():
    """With no GPU and no device_ids, DataParallel calls the module itself (torch's pass-through, what a plain
    nn.DataParallel script does on a laptop): its step's batch is still the samples it took, micro-batches added."""
    net = dpprof.DataParallel(nn.Linear(5, 2))
    assert net.device_ids == []
    with dpprof.record(name="pass-through", store=False) as run:
        with run.step():
            net(torch.randn(7, 5)).sum().backward()
        with run.step():
            for size in (4, 6):
                net(torch.randn(size, 5)).sum().backward()
    steps = run.frames()["steps"]
    assert steps[["batch_size", "forward_calls"]].values.tolist() == [[7, 1], [10, 2]]


def test_a_step_of_two_models_counts_the_samples_of_its_first_model():
    """A GAN's step: the generator on 12 noise samples, the discriminator on 12 real and 12 generated. The step's batch
    is its first model's samples (12), not every call's (36); that model called twice adds up, as micro-batches do."""
    devices = dpprof.cpu_devices(2)
    generator, discriminator = dpprof.DataParallel(nn.Linear(4, 8), devices), dpprof.DataParallel(nn.Linear(8, 1), devices)
    with dpprof.record(name="gan", store=False) as run:
        with run.step():
            fake = generator(torch.randn(12, 4))
            (discriminator(torch.randn(12, 8)).mean() - discriminator(fake).mean()).backward()
        with run.step():
            fake = torch.cat([generator(torch.randn(12, 4)), generator(torch.randn(4, 4))])
            discriminator(fake).mean().backward()
    steps = run.frames()["steps"]
    assert steps[["batch_size", "forward_calls"]].values.tolist() == [[12, 3], [16, 3]]


def test_explicit_and_implicit_steps_mix_in_one_run():
    """Forward calls before a run.step() block are a step of their own, closed when the block opens; a
    forward on another thread inside the block joins it; one block object can be entered again."""
    net = _linear_net(2)
    with dpprof.record(name="mixed") as run:
        net(torch.randn(4, 5)).sum().backward()  # step 0, implicit
        with run.step() as index:
            assert index == 1
            other = threading.Thread(target=lambda: net(torch.randn(6, 5)))
            other.start()
            other.join()
            net(torch.randn(2, 5)).sum().backward()
        block = run.step()
        for expected in (2, 3):
            with block as index:
                assert index == expected
                net(torch.randn(3, 5)).sum().backward()
        with pytest.raises(RuntimeError, match="cannot be nested"):
            with run.step(), run.step():
                pass
        net(torch.randn(5, 5)).sum().backward()  # implicit again, closed with the run
    steps = run.frames()["steps"]
    columns = ["step", "explicit", "forward_calls", "batch_size"]  # no batch: -1
    assert steps[columns].fillna(-1).astype(int).values.tolist() == [
        [0, 0, 1, 4], [1, 1, 2, 8], [2, 1, 1, 3], [3, 1, 1, 3], [4, 1, 0, -1], [5, 0, 1, 5]]


def test_explicit_and_implicit_steps_record_the_same_values():
    """The same training steps with run.step() and without it: every record alike, but for the step's
    `explicit` flag, its span and the times."""
    model = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 2))
    net = dpprof.DataParallel(model, device_ids=dpprof.cpu_devices(2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    timed = {"start_ms", "duration_ms", "device_duration_ms"}
    frames = {}
    for explicit in (True, False):
        torch.manual_seed(0)
        with dpprof.record(name=f"explicit={explicit}") as run:
            for _ in range(3):
                with run.step() if explicit else nullcontext():
                    optimizer.zero_grad()
                    net(torch.randn(7, 5)).sum().backward()
                    optimizer.step()
        frames[explicit] = run.frames()
    for table in ("steps", "phases", "memory"):
        # a value not read (NaN, None) compared as None: NaN equals nothing, itself included
        a, b = (frames[e][table].drop(columns=[c for c in frames[e][table] if c in timed | {"explicit"}])
                .astype(object).pipe(lambda df: df.where(df.notna(), None)) for e in (True, False))
        assert sorted(a.values.tolist(), key=repr) == sorted(b.values.tolist(), key=repr), table  # the replicas race
    assert frames[True]["steps"]["explicit"].all() and not frames[False]["steps"]["explicit"].any()


def test_no_grad_forward_records_no_backward_and_no_activations():
    net = _linear_net(2)
    with dpprof.record(name="eval") as run, torch.no_grad():
        net(torch.randn(8, 5))
    frames = run.frames()
    assert "backward" not in set(frames["phases"]["phase"])
    assert frames["memory"]["activation_bytes"].eq(0).all()


class _ReturnsItsWeight(nn.Module):
    """A module whose output is its own parameter: a leaf, made by no graph node."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight


@pytest.mark.skipif(torch.cuda.is_available(), reason="asserts behaviour without a GPU")
def test_a_leaf_output_times_each_backward_once_and_keeps_no_hook():
    """A module that returns its parameter (no GPU: torch runs it directly) gives a leaf output, which has no graph
    node to hook: the tensor hook each forward put on it stayed on the parameter, so the third step's backward was
    timed three times (6 backward records for 3 steps) and the hooks grew with the run. Each backward is now timed once,
    two forwards before one backward included, and no hook is left on the parameter."""
    module = _ReturnsItsWeight()
    net = dpprof.DataParallel(module)
    assert net.device_ids == []
    with dpprof.record(name="leaf") as run:
        for _ in range(3):
            with run.step():
                net(torch.randn(4, 3)).sum().backward()
        with run.step():  # two forwards of the same leaf, one backward
            net(torch.randn(4, 3))
            net(torch.randn(4, 3)).sum().backward()
    phases = run.frames()["phases"]
    assert phases.loc[phases["phase"] == "backward", "step"].tolist() == [0, 1, 2, 3]
    assert not module.weight._backward_hooks


@pytest.mark.skipif(torch.cuda.is_available(), reason="asserts behaviour without a GPU")
def test_one_device_and_no_device_paths_still_record_an_apply():
    torch.manual_seed(0)
    one = dpprof.DataParallel(nn.Linear(5, 2), device_ids=["cpu:0"])
    plain = dpprof.DataParallel(nn.Linear(5, 2))  # no GPU here: torch runs the module directly
    assert plain.device_ids == []
    with dpprof.record(name="single") as run:
        one(torch.randn(4, 5)).sum().backward()
        plain(torch.randn(3, 5)).sum().backward()
    phases = run.frames()["phases"]
    assert phases.query("step == 0")["phase"].tolist().count("apply") == 1
    assert set(phases.query("step == 1")["phase"]) == {"apply", "backward"}
    mem = run.frames()["memory"]
    assert mem["chunk_size"].iloc[0] == 4 and mem["device"].tolist() == ["cpu:0", "cpu:0"]


def test_a_failing_step_closes_the_run_as_failed():
    net = _linear_net(2)
    with pytest.raises(ValueError, match="boom"):
        with dpprof.record(name="crash") as run:
            net(torch.randn(4, 5)).sum().backward()
            raise ValueError("boom")
    assert run.status == "failed" and "boom" in run.error
    assert len(run.frames()["steps"]) == 1  # the step before the crash is kept
    assert dpprof.current_run() is None


# a run recorded through dpprof.recording itself, never touching dpprof's lazy names until it has closed
_RECORD_THROUGH_RECORDING = r"""
import sys
import torch
from torch import nn
from dpprof.parallel import DataParallel, cpu_devices
from dpprof.recording import CLOSE_HOOKS, record
net = DataParallel(nn.Linear(16, 50_000), device_ids=cpu_devices(2))
with record(name="hooked") as run:
    for _ in range(4):
        with run.step():
            net(torch.randn(63, 16)).sum().backward()  # 12 MiB of outputs gathered on cpu:0: memory skew
        loaded = "dpprof.report" in sys.modules
import dpprof
dpprof.record, dpprof.DataParallel  # the collect side through dpprof's lazy names: no second hook
print(loaded, len(CLOSE_HOOKS), run.path)
"""


def test_a_run_recorded_through_dpprof_recording_stores_its_findings_at_close_once(reports):
    out = subprocess.run([sys.executable, "-c", _RECORD_THROUGH_RECORDING], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    assert out.returncode == 0, out.stderr
    loaded, hooks, path = out.stdout.split()
    assert loaded == "False" and hooks == "1"  # no analysis loaded while recording; one close hook
    assert "memory_skew" in dpprof.load_run(path).findings["kind"].tolist()  # stored when it closed


def _all_threads_profile():
    # the profiler is thread-local: worker threads (torch's on CUDA, dpprof's on CPU) show with this
    return profile(activities=[ProfilerActivity.CPU],
                   experimental_config=torch._C._profiler._ExperimentalConfig(profile_all_threads=True))


def test_ranges_appear_in_a_torch_profiler_trace():
    net = _linear_net(2)
    with _all_threads_profile() as prof:
        net(torch.randn(8, 5)).sum().backward()
    names = {e.name for e in prof.events()}
    for phase in ("scatter", "replicate", "parallel_apply", "apply", "gather", "backward"):
        assert f"dpprof.{phase}" in names
    # inside a run too, where backward is also timed
    with dpprof.record(name="trace"), _all_threads_profile() as prof:
        net(torch.randn(8, 5)).sum().backward()
    assert "dpprof.backward" in {e.name for e in prof.events()}
    applies = [e for e in prof.events() if e.name == "dpprof.apply"]
    assert len(applies) == 2


def test_activation_bytes_follow_the_model_not_the_weights():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 16), nn.ReLU(), nn.Linear(16, 3))
    net = dpprof.DataParallel(model, device_ids=dpprof.cpu_devices(2))
    with dpprof.record(name="acts") as run:
        net(torch.randn(8, 5)).sum().backward()
    mem = run.frames()["memory"].set_index("device")
    # per replica of 4 samples: Linear1 saves its input (4x5), ReLU its output (4x16) which Linear2 reuses
    assert mem["activation_bytes"].tolist() == [(4 * 5 + 4 * 16) * 4] * 2


def test_buffers_saved_for_backward_are_weights_on_every_replica():
    # BatchNorm in eval mode saves its running statistics for backward: on replicas after the
    # first those are copies, and still weights, not activations
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8)).eval()
    net = dpprof.DataParallel(model, device_ids=dpprof.cpu_devices(2))
    with dpprof.record(name="bn") as run:
        net(torch.randn(8, 5)).sum().backward()
    mem = run.frames()["memory"].set_index("device").sort_index()
    assert mem["activation_bytes"].nunique() == 1  # both replicas account the same activations


def _hook_count(module, *args):
    """What a saved-tensor pack hook sees a call save, weights left out: a count independent of saved_bytes' walk
    over the graph."""
    from torch.autograd.graph import saved_tensors_hooks

    from dpprof.parallel.probe import _weight_storages

    weights, seen, total = _weight_storages(module), set(), [0]

    def pack(t):
        if t.untyped_storage().data_ptr() not in weights and (t.data_ptr(), t.numel()) not in seen:
            seen.add((t.data_ptr(), t.numel()))
            total[0] += t.numel() * t.element_size()
        return t

    with saved_tensors_hooks(pack, lambda t: t):
        module(*args)
    return total[0]


@pytest.mark.parametrize("kind", ["mlp", "inplace relu", "conv batchnorm", "lstm", "gru", "transformer", "embedding"])
def test_saved_bytes_read_from_the_graph_are_what_autograd_saves(kind):
    from dpprof.parallel.probe import _weight_storages, saved_bytes

    torch.manual_seed(0)
    module, args = {
        "mlp": (nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)), (torch.randn(5, 8),)),
        "inplace relu": (nn.Sequential(nn.Linear(8, 16), nn.ReLU(inplace=True), nn.Linear(16, 4)), (torch.randn(5, 8),)),
        "conv batchnorm": (nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                                         nn.Linear(72, 10)), (torch.randn(4, 3, 8, 8),)),
        "lstm": (nn.LSTM(6, 10, batch_first=True), (torch.randn(3, 5, 6),)),
        "gru": (nn.GRU(6, 10, num_layers=2, batch_first=True), (torch.randn(3, 5, 6),)),
        "transformer": (nn.TransformerEncoderLayer(16, 2, 32, batch_first=True), (torch.randn(2, 7, 16),)),
        "embedding": (nn.Sequential(nn.Embedding(50, 8), nn.Flatten(), nn.Linear(32, 3)), (torch.randint(0, 50, (4, 4)),)),
    }[kind]
    expected = _hook_count(module, *args)
    assert expected > 0
    assert saved_bytes(module(*args), args, _weight_storages(module)) == expected


def test_recording_keeps_autograds_checks_and_what_torch_func_needs():
    """Activations are counted from the graph after the call: autograd still refuses a saved tensor modified in
    place, torch.func works inside a replica, and a dropped output's graph is freed at once (no cycle)."""
    import gc
    import weakref

    class InPlace(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            y = self.lin(x).sigmoid()  # sigmoid saves its output ...
            y.mul_(2)  # ... which this changes
            return y

    class FuncGrad(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 1)

        def forward(self, x):
            return torch.func.vmap(torch.func.grad(lambda v: self.lin(v).squeeze()))(x)

    kept = []

    class KeepsRef(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            s = self.lin(x).sigmoid()
            kept.append(weakref.ref(s))
            return s.exp()

    inplace = dpprof.DataParallel(InPlace(), dpprof.cpu_devices(2))
    func = dpprof.DataParallel(FuncGrad(), dpprof.cpu_devices(2))
    keeps = dpprof.DataParallel(KeepsRef(), dpprof.cpu_devices(2))
    with dpprof.record(store=False) as run:
        with run.step():  # the first call of its shapes: the one whose activations are counted
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                inplace(torch.randn(6, 4)).sum().backward()
        with run.step():
            assert func(torch.randn(6, 3)).shape == (6, 3)
        gc.disable()
        try:
            with run.step():
                out = keeps(torch.randn(6, 4))
                del out
                assert len(kept) == 2 and all(r() is None for r in kept)  # freed by reference counts alone
        finally:
            gc.enable()
    assert len(run.frames()["steps"]) == 3


class _SavesMoreWhenPositive(nn.Module):
    """Saves one tensor for backward, or two when its input's mean is positive: data-dependent."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(4))

    def forward(self, x):
        y = x * self.w  # saves x
        return y * y if x.mean() > 0 else y  # saves y twice (one tensor) when positive


def _activation_bytes(run, device="cpu:1"):
    mem = run.frames()["memory"]
    return mem[mem["device"] == device].sort_values("step")["activation_bytes"].tolist()


def test_activation_bytes_of_alike_calls_are_counted_once_and_recounted():
    from dpprof.parallel.probe import ACTIVATIONS_RECOUNT_EVERY as every

    net = dpprof.DataParallel(nn.Sequential(nn.Linear(5, 16), nn.ReLU(), nn.Linear(16, 3)), dpprof.cpu_devices(2))
    with dpprof.record(store=False) as run:
        for _ in range(every + 5):
            net(torch.randn(8, 5)).sum().backward()
    # a model whose saved tensors follow the shapes: every step carries the count of the first
    assert _activation_bytes(run) == [(4 * 5 + 4 * 16) * 4] * (every + 5)

    net = dpprof.DataParallel(_SavesMoreWhenPositive(), dpprof.cpu_devices(2))
    with dpprof.record(store=False) as run:
        for i in range(2 * every + 4):
            sign = 1 if i == 0 else -1  # the recount at call `every` sees fewer bytes than the first count
            net(sign * torch.rand(8, 4) + sign).sum().backward()
    counted = _activation_bytes(run)
    negative = 4 * 4 * 4  # x only, 4 samples x 4 features of float32
    assert counted[0] == 2 * negative
    # from the recount that saw the difference on, every call is counted
    assert counted[every:] == [negative] * (every + 4)


def test_a_data_parallel_inside_a_replica_is_part_of_that_replicas_apply():
    """A DataParallel wrapped in another: the inner one runs inside the outer's replicas, on their workers, and opens
    no step of its own (steps, batches and calls are the outer call's)."""
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    outer = dpprof.DataParallel(dpprof.DataParallel(model, dpprof.cpu_devices(2)), dpprof.cpu_devices(2))
    x = torch.randn(10, 8)
    for explicit in (True, False):
        with dpprof.record(store=False) as run:
            for _ in range(3):
                with run.step() if explicit else nullcontext():
                    assert torch.allclose(outer(x), model(x), atol=1e-6)
        frames = run.frames()
        steps = frames["steps"]
        assert steps["batch_size"].tolist() == [10] * 3 and steps["forward_calls"].tolist() == [1] * 3, explicit
        applies = frames["phases"][frames["phases"]["phase"] == "apply"]
        assert applies.groupby("step").size().tolist() == [2] * 3  # the outer call's two replicas, each once


def test_a_record_in_a_second_thread_while_one_is_open_is_refused_and_the_first_keeps_its_steps(tmp_path):
    """Two threads each recording: the second is refused before it makes a file (its calls would have gone to the
    first's run, or the first's to its); the first run keeps exactly its own steps."""
    import threading

    net = dpprof.DataParallel(nn.Linear(4, 2), device_ids=dpprof.cpu_devices(2))
    opened, done, refused = threading.Event(), threading.Event(), []

    def second() -> None:
        opened.wait(30)
        try:
            with dpprof.record(name="second", reports_dir=str(tmp_path)):
                net(torch.randn(6, 4)).sum().backward()
        except RuntimeError as err:
            refused.append(str(err))
        done.set()

    other = threading.Thread(target=second)
    other.start()
    with dpprof.record(name="first", reports_dir=str(tmp_path)) as run:
        for _ in range(3):
            net(torch.randn(6, 4)).sum().backward()
        opened.set()
        assert done.wait(30)
    other.join(30)
    assert refused == [f"run {run.id} is being recorded in another thread: dpprof records one thread's training at "
                       "a time (records nest within a thread); record this one after it ends"]
    assert len(dpprof.load_run(run.path).steps) == 3 and [p.name for p in tmp_path.glob("*.sqlite")] == \
        [f"{run.id}.sqlite"]
    # after it ends, another thread records
    other = threading.Thread(target=lambda: refused.append(_record_one(tmp_path, net)))
    other.start()
    other.join(60)
    assert refused[-1] == 1


def _record_one(directory, net) -> int:
    with dpprof.record(name="later", reports_dir=str(directory)) as run:
        net(torch.randn(6, 4)).sum().backward()
    return len(dpprof.load_run(run.path).steps)


def test_a_step_of_a_run_that_has_ended_is_refused():
    net = dpprof.DataParallel(nn.Linear(4, 2), device_ids=dpprof.cpu_devices(2))
    with dpprof.record(store=False) as run:
        pass
    with pytest.raises(RuntimeError, match=rf"run {run.id} has ended \(finished\): run.step\(\) marks steps inside"):
        with run.step():
            net(torch.randn(6, 4)).sum().backward()
    assert run.frames()["steps"].empty


def test_a_lazy_modules_own_error_is_raised_while_recording_as_without():
    net = dpprof.DataParallel(nn.LazyLinear(3), device_ids=dpprof.cpu_devices(2))
    with pytest.raises(RuntimeError, match="Modules with uninitialized parameters can't be used with `DataParallel`"):
        net(torch.randn(6, 4))
    with pytest.raises(RuntimeError, match="Modules with uninitialized parameters can't be used with `DataParallel`"):
        with dpprof.record(store=False):
            net(torch.randn(6, 4))

"""dpprof on real GPUs: parity with torch.nn.DataParallel, and CUDA-event timings in a run.

Every test here is marked ``cuda`` and skips without a GPU (two for the parity tests).
"""
from __future__ import annotations

import copy

import pandas as pd
import pytest
import torch
import torch.nn as nn
from torch.testing import assert_close

import dpprof

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")


def linear() -> nn.Module:
    return nn.Linear(10, 5)


def conv_bn_net() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 8 * 8, 5),
    )


@two_gpus
@pytest.mark.parametrize(
    "make, shape",
    [(linear, (20, 10)), (linear, (5, 10)), (conv_bn_net, (8, 3, 8, 8))],
    ids=["linear", "linear-batch5", "conv-bn"],
)
def test_parity_with_torch_data_parallel_on_two_gpus(make, shape):
    torch.manual_seed(0)
    module = make().to(torch.double).cuda(0)
    reference = copy.deepcopy(module)
    ours = dpprof.DataParallel(module, device_ids=[0, 1])
    theirs = nn.DataParallel(reference, device_ids=[0, 1])
    x = torch.randn(*shape, dtype=torch.double, device="cuda:0")

    out, expected = ours(x), theirs(x)
    assert out.device == expected.device == torch.device("cuda", 0)
    assert_close(out, expected)
    upstream = torch.randn_like(expected)
    out.backward(upstream)
    expected.backward(upstream)
    for (name, p), q in zip(module.named_parameters(), reference.parameters()):
        assert_close(p.grad, q.grad, msg=name)
    for (name, b), c in zip(module.named_buffers(), reference.buffers()):
        assert_close(b, c, msg=name)


@two_gpus
def test_functional_parity_with_torch_on_two_gpus():
    torch.manual_seed(0)
    module = nn.Linear(10, 5).cuda(0)
    x = torch.randn(20, 10, device="cuda:0")
    for device_ids in ([0, 1], ["cuda:1", "cuda:0"]):
        module = module.cuda(torch.device(device_ids[0]))
        ours = dpprof.data_parallel(module, x, device_ids)
        theirs = nn.parallel.data_parallel(module, x, [torch.device(d).index if isinstance(d, str) else d
                                                        for d in device_ids])
        assert ours.device == theirs.device
        assert_close(ours, theirs)


@two_gpus
def test_scalar_outputs_gather_into_a_vector_on_gpus():
    class Loss(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l = nn.Linear(4, 1)

        def forward(self, x):
            return self.l(x).pow(2).mean()

    module = Loss().cuda(0)
    with pytest.warns(UserWarning, match="all input tensors were scalars"):
        out = dpprof.DataParallel(module, [0, 1])(torch.randn(6, 4, device="cuda:0"))
    assert out.shape == (2,)


@pytest.mark.parametrize("sync_timing", [False, True])
def test_recording_fills_device_durations_on_cuda(sync_timing):
    device_ids = [0, 1] if torch.cuda.device_count() >= 2 else [0]
    net = dpprof.DataParallel(nn.Linear(64, 64).cuda(0), device_ids=device_ids)
    x = torch.randn(32, 64, device="cuda:0")
    with dpprof.record(name="cuda-timing", sync_timing=sync_timing) as run:
        for _ in range(2):
            with run.step():
                net(x).sum().backward()
    phases = run.frames()["phases"]
    cuda_rows = phases[phases["device"].str.startswith("cuda")]
    assert not cuda_rows.empty
    assert cuda_rows["device_duration_ms"].notna().all()
    assert (cuda_rows["device_duration_ms"] >= 0).all()
    assert set(cuda_rows["phase"]) >= {"apply", "backward"}
    assert sorted(set(cuda_rows.loc[cuda_rows["phase"] == "apply", "device"])) == [f"cuda:{i}" for i in device_ids]


# One GPU is enough for everything below: DataParallel on one device, a recorded run's CUDA events,
# allocator and NVML readings, two DDP ranks sharing the GPU, and a trace with CUDA activity.

def test_one_gpu_data_parallel_matches_torch_and_records_cuda_phases():
    torch.manual_seed(0)
    module = conv_bn_net().cuda(0)
    reference = copy.deepcopy(module)
    ours, theirs = dpprof.DataParallel(module, device_ids=[0]), nn.DataParallel(reference, device_ids=[0])
    x = torch.randn(8, 3, 8, 8, device="cuda:0")
    with dpprof.record(name="one-gpu", store=False) as run:
        out = ours(x)
        out.sum().backward()
    expected = theirs(x)
    expected.sum().backward()
    assert_close(out, expected)
    for (name, p), q in zip(module.named_parameters(), reference.parameters()):
        assert_close(p.grad, q.grad, msg=name)
    phases = run.frames()["phases"]
    assert set(phases["device"]) == {"cuda:0"}
    assert {"scatter", "apply", "backward"} <= set(phases["phase"])
    assert phases["device_duration_ms"].notna().all() and (phases["device_duration_ms"] > 0).all()


def test_a_recorded_cuda_run_holds_the_allocator_and_real_nvml_readings(reports):
    from dpprof.workloads import build_workload, train

    torch.cuda.synchronize()
    run = train(build_workload("cifar-lenet", 128), [0], steps=30, name="cuda-run")
    stored = dpprof.load_run(run.id)
    assert stored.meta["status"] == "finished" and len(stored.steps) == 30
    props = torch.cuda.get_device_properties(0)
    device = stored.devices.set_index("device").loc["cuda:0"]
    assert device["name"] == props.name and device["total_memory_bytes"] == props.total_memory
    assert device["multiprocessor_count"] == props.multi_processor_count
    assert device["nvml_index"] is not None and not pd.isna(device["nvml_index"])  # joined by PCI bus id
    alloc = stored.allocator[stored.allocator["device"] == "cuda:0"]
    assert not alloc.empty
    # the allocator's own counters, as torch reports them, never above the process's peak
    assert (alloc["peak_allocated_bytes"] >= alloc["allocated_bytes"]).all()
    assert alloc["peak_allocated_bytes"].max() <= torch.cuda.max_memory_allocated(0)
    assert (alloc["reserved_bytes"] >= alloc["allocated_bytes"]).all()
    samples = stored.gpu_samples[stored.gpu_samples["device"] == "cuda:0"]
    assert len(samples) >= 1  # the sampler ran against the real driver
    assert (samples["memory_total_bytes"] > 0).all()
    used = samples["memory_used_bytes"]
    assert (used > 0).all() and (used <= samples["memory_total_bytes"]).all()
    # NVML sees at least what this process's allocator reserved at the last sample's time, give or take
    # other processes: a reading in bytes, not a fraction
    assert used.max() >= alloc["reserved_bytes"].min()
    phases = stored.phases[stored.phases["device"] == "cuda:0"]
    assert phases["device_duration_ms"].notna().all()
    # a CUDA event time is GPU time: the apply phase's cannot exceed the host time around it by more
    # than the launch queue the host had already run ahead by (bounded by the step)
    steps = stored.steps.set_index("step")["duration_ms"]
    apply = phases[phases["phase"] == "apply"].set_index("step")
    assert (apply["device_duration_ms"] <= steps.loc[apply.index] * 2 + 1).all()


def test_dpprof_check_reads_the_real_gpu(capsys):
    from dpprof.cli import main

    assert main(["check", "--device-ids", "0"]) in (0, 1)
    props = torch.cuda.get_device_properties(0)
    assert capsys.readouterr().out.splitlines()[0] == (
        f"checked cuda:0: {props.name}, {props.total_memory / 2**30:.1f} GiB, {props.multi_processor_count} SMs, "
        f"compute capability {props.major}.{props.minor}")


@pytest.mark.slow
def test_two_ddp_ranks_share_one_gpu_over_gloo():
    from dpprof.cli import main

    assert main(["profile", "cifar-lenet", "--ddp", "--nproc", "2", "--devices", "cuda", "--steps", "6",
                 "--batch-size", "32", "--quiet"]) == 0
    [run_id] = dpprof.list_runs()["id"]
    run = dpprof.load_run(run_id)
    assert run.meta["status"] == "finished" and run.meta["ranks"] == [0, 1]
    args = run.meta["workload_args"]
    assert args["device"] in ("cuda:0", "cuda:1")
    expected_backend = "gloo" if torch.cuda.device_count() < 2 else "nccl"
    assert args["backend"] == expected_backend
    assert run.steps.groupby("rank").size().tolist() == [6, 6]
    comms = run.comms
    assert set(comms["device"]) == {"rank:0", "rank:1"}
    params = 62006 * 4
    assert comms[comms["step"] == 5].groupby("device")["bucket_bytes"].sum().tolist() == [params, params]
    # each rank's own allocator (one process each): forward and backward of every step, the peak at least
    # the weights and their gradients, and at least what is allocated at that moment
    alloc = run.allocator
    assert sorted(alloc.groupby(["device", "phase"]).size().items()) == [
        (("rank:0", "backward"), 6), (("rank:0", "forward"), 6), (("rank:1", "backward"), 6), (("rank:1", "forward"), 6)]
    assert (alloc["peak_allocated_bytes"] >= alloc["allocated_bytes"]).all()
    assert (alloc[alloc["phase"] == "backward"]["allocated_bytes"] >= 2 * params).all()
    assert (alloc["reserved_bytes"] >= alloc["peak_allocated_bytes"]).all()
    from dpprof.report import summary_of

    assert summary_of(run).loc[["rank:0", "rank:1"], "peak_allocated_bytes"].gt(2 * params).all()
    # each part of a rank's step also has its GPU time, from CUDA events on the rank's stream, once they complete:
    # every part of every step, data from the second step on (the first has no previous step's end on the GPU)
    phases = run.phases
    assert set(phases["phase"]) >= {"data", "forward", "backward", "backward_compute", "comm_wait", "optimizer"}
    assert phases["device_duration_ms"].notna().all(), phases[phases["device_duration_ms"].isna()]
    assert (phases["device_duration_ms"] >= 0).all()
    assert sorted(phases.loc[phases["phase"] == "data"].groupby("device")["step"].min()) == [1, 1]
    # backward's compute and its wait for the last all-reduce share the event between them: on the GPU as on the
    # host, the two add up to backward (elapsed_time's resolution is about half a microsecond)
    gpu = phases.pivot_table(index=["device", "step"], columns="phase", values="device_duration_ms", aggfunc="sum")
    assert ((gpu["backward_compute"] + gpu["comm_wait"] - gpu["backward"]).abs() < 0.005).all()
    # the data finding splits the host's part into the GPU's wait for the batch and what ran while the GPU was busy
    from dpprof.findings import run_findings

    found = run_findings(run).table
    for evidence in found.loc[found["kind"] == "data_loading", "evidence"]:
        # cifar-lenet builds its batches in the loop (no DataLoader): the GPU waits for the next forward
        assert "waiting for the next forward" in evidence
        assert "while the GPU was still busy with the previous step" in evidence
    if torch.cuda.device_count() < 2:
        # both ranks hold memory on the one GPU: each rank's NVML samples see the other's as another process's
        samples = run.gpu_samples
        assert not samples.empty
        assert (samples.groupby("rank")["other_process_memory_bytes"].max() > 0).all()


def test_a_cuda_trace_imports_with_gpu_time_and_dpprof_phases(tmp_path):
    from torch.profiler import ProfilerActivity, profile, schedule

    from dpprof.trace.importer import import_traces

    net = dpprof.DataParallel(conv_bn_net().cuda(0), device_ids=[0])
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    x = torch.randn(64, 3, 8, 8, device="cuda:0")
    trace = tmp_path / "gpu.pt.trace.json"
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                 schedule=schedule(wait=0, warmup=1, active=4),
                 on_trace_ready=lambda p: p.export_chrome_trace(str(trace))) as prof:
        for _ in range(5):
            optimizer.zero_grad()
            net(x).sum().backward()
            optimizer.step()
            prof.step()
    imported = import_traces([trace])
    assert imported.steps == 4 and "cuda:0" in imported.devices
    run = dpprof.load_run(imported.id)
    gpu = run.gpu_time[run.gpu_time["device"] == "cuda:0"]
    assert len(gpu) == 4 and (gpu["compute_ms"] > 0).all()
    assert (gpu["compute_ms"] <= gpu["window_ms"] + 1e-6).all()
    assert {"scatter", "apply", "backward"} <= set(run.phases["phase"])


def test_dpprof_run_records_an_unchanged_cuda_script(tmp_path, reports):
    import subprocess
    import sys

    script = tmp_path / "train_gpu.py"
    script.write_text(
        "import torch\nfrom torch import nn\n"
        "model = nn.DataParallel(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4)).cuda())\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "for _ in range(5):\n"
        "    x = torch.randn(16, 32, device='cuda')\n"
        "    opt.zero_grad(); model(x).sum().backward(); opt.step()\n"
        "print('trained on', next(model.parameters()).device)\n")
    out = subprocess.run([sys.executable, "-m", "dpprof", "run", str(script)], capture_output=True, text=True,
                         timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "trained on cuda:0" in out.stdout
    [run_id] = dpprof.list_runs()["id"]
    run = dpprof.load_run(run_id)
    assert len(run.steps) == 5
    assert "cuda:0" in set(run.phases["device"])
    assert run.phases.loc[run.phases["device"] == "cuda:0", "device_duration_ms"].notna().all()


def test_the_balanced_criterion_on_one_gpu_gives_the_plain_loss():
    torch.manual_seed(0)
    module = nn.Linear(10, 3).cuda(0)
    x, y = torch.randn(12, 10, device="cuda:0"), torch.randint(0, 3, (12,), device="cuda:0")
    model = dpprof.DataParallelModel(module, device_ids=[0])
    criterion = dpprof.DataParallelCriterion(nn.CrossEntropyLoss(), device_ids=[0])
    with dpprof.record(name="balanced-gpu", store=False):
        loss = criterion(model(x), y)
    assert_close(loss, nn.functional.cross_entropy(module(x), y))


def _raw_kernels(trace) -> dict[str, tuple[int, float]]:
    """Kernel name -> (calls, total ms), read straight from a trace file's events (independent of dpprof)."""
    import gzip
    import json
    from pathlib import Path

    path = Path(trace)
    with (gzip.open(path, "rt") if path.name.endswith(".gz") else open(path)) as f:
        events = json.load(f)["traceEvents"]
    out: dict[str, tuple[int, float]] = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "Kernel"):
            calls, ms = out.get(e["name"], (0, 0.0))
            out[e["name"]] = (calls + 1, ms + e["dur"] / 1e3)
    return out


def test_a_fresh_cuda_trace_links_its_operators_to_their_kernels(tmp_path):
    """A trace this torch writes on this GPU (CUDA 12: launches in cuda_runtime/cuda_driver): every kernel's calls
    and time as the raw events say, each kernel linked to the op that launched it (the operators' device self time
    adds up to the kernels'), GPU utilization a share of the step, and the allocator's peak on cuda:0."""
    from torch.profiler import ProfilerActivity, profile, schedule

    from dpprof.trace.importer import import_traces

    net = conv_bn_net().cuda(0)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    x = torch.randn(256, 3, 8, 8, device="cuda:0")
    trace = tmp_path / "fresh.pt.trace.json"
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True, profile_memory=True,
                 schedule=schedule(wait=0, warmup=1, active=4),
                 on_trace_ready=lambda p: p.export_chrome_trace(str(trace))) as prof:
        for _ in range(5):
            optimizer.zero_grad()
            net(x).sum().backward()
            optimizer.step()
            prof.step()
    run = dpprof.load_run(import_traces([trace], tmp_path / "reports").paths[0])
    kernels = run.kernels(top=None)
    raw = _raw_kernels(trace)
    stored = {n: (int(c), t) for n, c, t in zip(kernels["name"], kernels["calls"], kernels["total_ms"])}
    assert raw and set(stored) == set(raw)
    for name, (calls, ms) in raw.items():  # calls exact; sums as exact as summing floats in another order allows
        assert stored[name][0] == calls and abs(stored[name][1] - ms) <= 1e-9 * max(ms, 1.0), name
    ops = run.operators(top=None, device="cuda:0")
    linked = ops["device_self_ms"].fillna(0).sum()
    assert abs(linked - sum(t for _, t in raw.values())) <= 1e-3 * sum(t for _, t in raw.values())
    assert (ops.loc[ops["name"].str.contains("conv"), "device_total_ms"] > 0).any()
    gpu = run.gpu_metrics()
    assert len(gpu) and ((gpu["utilization_pct"] > 0) & (gpu["utilization_pct"] <= 100)).all()
    peaks = run.memory_timeline()
    assert (peaks.loc[peaks["device"] == "cuda:0", "allocated_bytes"] > 0).any()


def test_a_deep_capture_on_cuda_stores_the_window_s_kernels_under_the_gpu(reports):
    """dpprof.record(capture="2:4") on cuda:0: the window's kernels are stored under cuda:0, as many and as long
    as its raw trace says, and the raw trace is kept beside the run."""
    from dpprof.store.files import CAPTURE_TRACE

    torch.manual_seed(0)
    net = dpprof.DataParallel(conv_bn_net().cuda(0), device_ids=[0])
    x = torch.randn(64, 3, 8, 8, device="cuda:0")
    with dpprof.record(name="captured on cuda", capture="2:4") as run:
        for _ in range(6):
            with run.step():
                net(x).sum().backward()
    [trace] = [p for p in reports.iterdir() if CAPTURE_TRACE.match(p.name)]
    stored = dpprof.load_run(run.id)
    kernels = stored.kernels(top=None)
    assert len(kernels) and set(kernels["device"]) == {"cuda:0"}
    raw = _raw_kernels(trace)
    assert int(kernels["calls"].sum()) == sum(c for c, _ in raw.values()) > 0


@pytest.mark.slow
def test_two_fsdp_ranks_share_one_gpu_over_gloo():
    """FSDP2 on cuda:0 from two ranks: every step on both ranks with FSDP's parts partitioning it, the all-gathers and
    reduce-scatters, the shards adding up to the model, and each rank's own allocator at forward and backward."""
    from dpprof.cli import main
    from dpprof.workloads import build_workload
    from test_invariants import assert_parts_partition_the_steps

    steps = 6
    assert main(["profile", "tutorial-linear", "--fsdp", "--nproc", "2", "--devices", "cuda", "--steps", str(steps),
                 "--quiet"]) == 0
    [run_id] = dpprof.list_runs()["id"]
    run = dpprof.load_run(run_id)
    assert run.meta["status"] == "finished" and run.model.kind == "fsdp"
    assert run.model.devices == ("rank:0", "rank:1")
    assert run.meta["workload_args"]["backend"] == ("gloo" if torch.cuda.device_count() < 2 else "nccl")
    assert run.meta["workload_args"]["device"].startswith("cuda:")
    assert run.steps.groupby("rank").size().tolist() == [steps, steps]
    assert_parts_partition_the_steps(run)
    assert set(run.comms["collective"]) == {"all-gather", "reduce-scatter"}
    total = sum(p.numel() for p in build_workload("tutorial-linear").model.parameters()) * 4
    assert run.memory.groupby("device")["param_bytes"].max().sum() == total
    alloc = run.allocator
    assert sorted(alloc.groupby(["device", "phase"]).size().items()) == [
        ((f"rank:{r}", p), steps) for r in (0, 1) for p in ("backward", "forward")]
    assert (alloc["peak_allocated_bytes"] >= alloc["allocated_bytes"]).all()
    assert (alloc["allocated_bytes"] > 0).all() and (alloc["reserved_bytes"] >= alloc["peak_allocated_bytes"]).all()
    # data, forward, backward and the optimizer also have their GPU time, from CUDA events on the rank's current
    # stream (data from the second step on); the collectives and copies, on FSDP's own streams, keep host times only
    phases = run.phases
    timed = phases["phase"].isin(["data", "forward", "backward", "optimizer"])
    assert phases.loc[timed, "device_duration_ms"].notna().all(), phases[timed & phases["device_duration_ms"].isna()]
    assert phases.loc[~timed, "device_duration_ms"].isna().all()
    assert (phases.loc[timed, "device_duration_ms"] >= 0).all()
    assert sorted(phases.loc[phases["phase"] == "data"].groupby("device")["step"].min()) == [1, 1]
    assert sorted(phases.loc[phases["phase"] == "optimizer"].groupby("device").size()) == [steps, steps]


def _raw_events(trace) -> list[dict]:
    import gzip
    import json

    with gzip.open(trace, "rt") as f:
        return json.load(f)["traceEvents"]


@pytest.mark.slow
def test_each_ddp_ranks_capture_on_cuda_stores_its_kernels_and_the_gpus_memory_curve(reports):
    """Two DDP ranks on cuda:0, steps 2 and 3 captured: each rank's stored kernels are its raw trace's, under cuda:0,
    and its memory curve on cuda:0 peaks where the trace's [memory] events for that GPU do (a rank profiles its
    training thread, so torch writes them)."""
    from dpprof.cli import main

    assert main(["profile", "cifar-lenet", "--ddp", "--nproc", "2", "--devices", "cuda", "--steps", "5",
                 "--batch-size", "32", "--capture", "2:4", "--quiet"]) == 0
    [run_id] = dpprof.list_runs()["id"]
    run = dpprof.load_run(run_id)
    kernels, timeline = run.kernels(top=None), run.memory_timeline()
    for r in (0, 1):
        [trace] = reports.glob(f"{run_id}.rank{r}.capture-2-4.pt.trace.json.gz")
        raw = _raw_events(trace)
        ours = kernels[kernels["rank"] == r]
        assert set(ours["device"]) == {"cuda:0"}
        assert int(ours["calls"].sum()) == sum(e.get("ph") == "X" and e.get("cat") in ("kernel", "Kernel")
                                              for e in raw) > 0
        gpu_memory = [e["args"] for e in raw if e.get("name") == "[memory]" and e["args"].get("Device Type") == 1]
        assert gpu_memory, "no [memory] events for the GPU in the rank's capture"
        curve = timeline[(timeline["rank"] == r) & (timeline["device"] == "cuda:0")]
        assert int(curve["allocated_bytes"].max()) == max(m["Total Allocated"] for m in gpu_memory)

"""The NVML monitor against the fake pynvml: realistic values, and every way NVML fails."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import dpprof
import fake_pynvml
from dpprof.device_ids import DeviceSet
from dpprof.devices import inventory, nvml_handles
from dpprof.nvml import THROTTLE_REASONS, GpuSampler, Nvml
from dpprof.records import SLOWDOWN_REASONS

BUS = ["00000000:1A:00.0", "00000000:3B:00.0"]


def _train_while_sampling(steps=6, sample_hz=50.0, sample_gpus=True):
    """A CPU-worker run. CPU workers use no GPU, so by default (sample_gpus=True) the (fake) GPUs are
    sampled from the start, as for a script dpprof does not wrap; None is record()'s own default."""
    net = dpprof.DataParallel(nn.Linear(5, 2), device_ids=dpprof.cpu_devices(2))
    with dpprof.record(name="sampled", sample_hz=sample_hz, sample_gpus=sample_gpus) as run:
        for _ in range(steps):
            with run.step():
                net(torch.randn(8, 5)).sum().backward()
            time.sleep(0.05)
    return dpprof.load_run(run.path)


def test_a_sample_carries_every_metric_in_dpprof_units(fake_gpus):
    fake = fake_gpus([fake_pynvml.gpu(BUS[0], throttle=0x4 | 0x1, others_bytes=3 * 2**30)])
    with Nvml() as nv:
        s = nv.sample(nv.handle_by_index(0), "cuda:0", 12.5)
    assert (s.device, s.t_ms, s.gpu_util_pct, s.memory_util_pct) == ("cuda:0", 12.5, 90.0, 45.0)
    assert (s.memory_used_bytes, s.memory_total_bytes) == (5 * 2**30, 40 * 2**30)
    assert (s.power_w, s.power_limit_w, s.temperature_c, s.sm_clock_mhz) == (250.0, 400.0, 60.0, 1410.0)
    assert (s.pcie_tx_bytes_per_s, s.pcie_rx_bytes_per_s) == (1_000_000 * 1024.0, 500_000 * 1024.0)
    assert s.throttle_reasons == "gpu_idle,sw_power_cap"
    assert s.other_process_memory_bytes == 3 * 2**30
    assert fake.initialised == 0  # shut down on exit


def test_the_sampler_stores_samples_of_every_gpu_in_the_run(fake_gpus):
    fake_gpus([fake_pynvml.gpu(BUS[0]), fake_pynvml.gpu(BUS[1], util=30)])
    run = _train_while_sampling()
    samples = run.gpu_samples
    counts = samples.groupby("device").size()
    assert list(counts.index) == ["cuda:0", "cuda:1"] and (counts >= 5).all()
    assert samples.groupby("device")["gpu_util_pct"].mean().tolist() == [90.0, 30.0]
    assert samples["t_ms"].is_monotonic_increasing or samples.groupby("device")["t_ms"].apply(
        lambda t: t.is_monotonic_increasing).all()


def test_no_nvml_library_is_one_note_and_the_run_goes_on(fake_gpus, caplog):
    fake = fake_gpus([fake_pynvml.gpu(BUS[0])])
    fake.LIBRARY_MISSING = True
    with caplog.at_level(logging.WARNING, logger="dpprof"):
        run = _train_while_sampling()
    assert run.meta["status"] == "finished" and len(run.steps) == 6
    assert run.gpu_samples.empty
    assert run.notes["message"].tolist() == ["GPU sampling is off: NVML could not start: NVML Shared Library Not Found"]
    assert [r.getMessage() for r in caplog.records] == [
        "dpprof: GPU sampling is off: NVML could not start: NVML Shared Library Not Found"]


def test_nvidia_ml_py_not_installed_is_a_note(monkeypatch, fake_gpus):
    import sys
    fake_gpus([fake_pynvml.gpu(BUS[0])])
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    run = _train_while_sampling(steps=2)
    assert "nvidia-ml-py is not installed" in run.notes["message"].iloc[0]


def test_a_metric_not_supported_is_null_with_one_reason(fake_gpus):
    fake = fake_gpus([fake_pynvml.gpu(BUS[0])])
    fake.NOT_SUPPORTED.add("nvmlDeviceGetPowerUsage")
    run = _train_while_sampling()
    samples = run.gpu_samples
    assert samples["power_w"].isna().all() and samples["gpu_util_pct"].notna().all()
    assert run.notes["message"].tolist() == ["cuda:0: power draw not supported by this GPU or driver"]


def test_a_gpu_lost_mid_run_turns_null_and_the_run_finishes(fake_gpus):
    fake = fake_gpus([fake_pynvml.gpu(BUS[0]), fake_pynvml.gpu(BUS[1])])
    fake.LOST_AFTER[1] = 30  # three samples' worth of calls, then GPU 1 falls off the bus
    run = _train_while_sampling()
    assert run.meta["status"] == "finished"
    lost = run.gpu_samples[run.gpu_samples["device"] == "cuda:1"]
    assert lost["gpu_util_pct"].notna().sum() >= 2 and lost["gpu_util_pct"].isna().sum() >= 2
    assert lost["gpu_util_pct"].notna().iloc[-1] == False  # noqa: E712 (nulls from the loss on)
    ok = run.gpu_samples[run.gpu_samples["device"] == "cuda:0"]
    assert ok["gpu_util_pct"].notna().all()
    assert run.notes["message"].tolist() == ["cuda:1: GPU is lost (NVML); its values are null from here on"]


def test_torch_and_nvml_indices_are_joined_by_pci_bus_id(fake_gpus):
    fake_gpus([fake_pynvml.gpu(BUS[0], name="GPU A"), fake_pynvml.gpu(BUS[1], name="GPU B")], torch_order=[1, 0])
    with Nvml() as nv:
        handles = nvml_handles(nv, [0, 1])
        records = inventory(DeviceSet("cuda", (0, 1), 0), nv)
    assert handles == {"cuda:0": 1, "cuda:1": 0}  # torch's cuda:0 is NVML's GPU 1
    assert [(r.device, r.name, r.nvml_index, r.pci_bus_id) for r in records] == [
        ("cuda:0", "GPU B", 1, BUS[1]), ("cuda:1", "GPU A", 0, BUS[0])]


def test_cpu_runs_store_a_cpu_inventory():
    run = _train_while_sampling(steps=3, sample_gpus=None)
    devices = run.devices
    assert devices["device"].tolist() == ["cpu:0", "cpu:1"] and (devices["kind"] == "cpu").all()
    assert (devices["threads"] > 0).all() and devices["cpu_model"].notna().all()
    why = ("the run uses CPU workers: the GPUs here are not sampled" if torch.cuda.is_available()
           else "no CUDA GPU visible: GPU sampling is off")
    assert run.notes["message"].tolist() == [why] and run.gpu_samples.empty


def test_a_cpu_worker_run_on_a_gpu_machine_samples_no_gpu(fake_gpus):
    fake = fake_gpus([fake_pynvml.gpu(BUS[0])])
    run = _train_while_sampling(steps=3, sample_gpus=None)
    assert run.gpu_samples.empty and fake.initialised == 0
    assert run.notes["message"].tolist() == ["the run uses CPU workers: the GPUs here are not sampled"]


@pytest.mark.parametrize("hz", [0, -1, 1000])
def test_sampling_rate_out_of_range_is_refused(fake_gpus, hz):
    fake_gpus([fake_pynvml.gpu(BUS[0])])
    with Nvml() as nv, pytest.raises(ValueError, match="sampling rate"):
        GpuSampler(nv, {}, lambda s: None, lambda: 0.0, hz=hz)


def test_the_slowdown_reasons_the_findings_read_are_names_nvml_reports():
    assert set(SLOWDOWN_REASONS) < set(THROTTLE_REASONS)
    assert dpprof.nvml.SLOWDOWN_REASONS is SLOWDOWN_REASONS  # one definition, also readable from dpprof.nvml


def test_pynvml_is_imported_only_when_nvml_is_used():
    code = "import sys; from dpprof.nvml import throttle_names; throttle_names(0x24); print('pynvml' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"

"""The pre-flight check: every rule, through fake device properties and the fake NVML."""
from __future__ import annotations

import json

import re

import pytest
import torch

import dpprof
import fake_pynvml
from dpprof.cli import main
from dpprof.devices import chunk_sizes, even_batch_sizes

GIB = 2**30
BUS = [f"00000000:{b:02X}:00.0" for b in (0x1A, 0x3B, 0x5C)]


def _kinds(findings):
    return [(f.kind, f.device) for f in findings]


def test_identical_gpus_and_an_even_batch_have_no_findings(fake_gpus, capsys):
    fake_gpus([fake_pynvml.gpu(BUS[0]), fake_pynvml.gpu(BUS[1])])
    assert dpprof.check_balance(batch_size=64) == []
    assert main(["check", "--batch-size", "64"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "checked cuda:0: NVIDIA A100-SXM4-40GB, 40.0 GiB, 108 SMs, compute capability 8.0",
        "checked cuda:1: NVIDIA A100-SXM4-40GB, 40.0 GiB, 108 SMs, compute capability 8.0",
        "no findings: these devices look balanced"]


def test_torchs_75_percent_memory_rule_names_both_devices_and_the_ids_to_use(fake_gpus):
    fake_gpus([fake_pynvml.gpu(BUS[0]), fake_pynvml.gpu(BUS[1]), fake_pynvml.gpu(BUS[2], total=16 * GIB)])
    [finding] = dpprof.check_balance()
    assert (finding.kind, finding.severity, finding.device) == ("memory_imbalance", "critical", "cuda:2")
    assert "cuda:2 has 40% of the total memory of cuda:0" == finding.title
    assert "device_ids=[0, 1]" in finding.advice
    assert finding.value == pytest.approx(0.4)


def test_torchs_75_percent_multiprocessor_rule(fake_gpus):
    fake_gpus([fake_pynvml.gpu(BUS[0]), fake_pynvml.gpu(BUS[1])], multiprocessors=[108, 46])
    assert _kinds(dpprof.check_balance()) == [("multiprocessor_imbalance", "cuda:1")]


def test_other_processes_holding_a_gpu_is_low_free_memory(fake_gpus):
    fake_gpus([fake_pynvml.gpu(BUS[0]), fake_pynvml.gpu(BUS[1], others_bytes=20 * GIB)])
    [finding] = dpprof.check_balance()
    assert (finding.kind, finding.device) == ("low_free_memory", "cuda:1")
    assert finding.evidence == "free: cuda:1 18.00 GiB, cuda:0 38.00 GiB; other processes hold 20.00 GiB on cuda:1"


def test_a_pcie_link_below_its_maximum(fake_gpus):
    fake_gpus([fake_pynvml.gpu(BUS[0]), fake_pynvml.gpu(BUS[1], link=(3, 4, 8, 16))])
    [finding] = dpprof.check_balance()
    assert (finding.kind, finding.device) == ("pcie_link_degraded", "cuda:1")
    assert "current gen 3 x8, maximum gen 4 x16" == finding.evidence


def test_clocks_throttled_now(fake_gpus):
    fake_gpus([fake_pynvml.gpu(BUS[0], throttle=0x20 | 0x1), fake_pynvml.gpu(BUS[1], throttle=0x1)])
    [finding] = dpprof.check_balance()  # idle alone is not a slowdown
    assert (finding.kind, finding.device) == ("throttled_now", "cuda:0")
    assert "sw_thermal" in finding.title


def test_nvml_missing_still_checks_what_torch_knows(fake_gpus):
    fake = fake_gpus([fake_pynvml.gpu(BUS[0]), fake_pynvml.gpu(BUS[1], total=8 * GIB)])
    fake.LIBRARY_MISSING = True
    assert _kinds(dpprof.check_balance()) == [("memory_imbalance", "cuda:1")]


# share: what the split leaves unused of the devices' time in a step, which waits for the biggest chunk
# (records.split_shares): 10 of 12 samples' slots filled; the 3 idle devices' 6 of 16; 30 of 32; the idle device's
# 2 of 8 (and 1 more beside cpu:2's single sample)
@pytest.mark.parametrize("batch, n, chunks, kind, suggest, share", [
    (10, 3, [4, 4, 2], "uneven_chunks", [9, 12], 1 - 10 / 3 / 4),
    (10, 8, [2, 2, 2, 2, 2], "idle_devices", [8, 16], 3 / 8),
    (30, 8, [4, 4, 4, 4, 4, 4, 4, 2], "uneven_chunks", [24, 32], 2 / 32),
    (5, 4, [2, 2, 1], "idle_devices", [4, 8], 2 / 8),
    (30, 3, [10, 10, 10], None, [30, 33], 0.0),
])
def test_batch_split_as_torch_chunk_makes_it(batch, n, chunks, kind, suggest, share):
    assert chunk_sizes(batch, n) == chunks
    assert even_batch_sizes(batch, n) == suggest
    findings = [f for f in dpprof.check_balance(dpprof.cpu_devices(n), batch) if f.kind != "oversubscribed_cpu"]
    if kind is None:
        assert findings == []
        return
    [finding] = findings
    assert finding.kind == kind
    assert str(chunks) in finding.evidence
    assert f"{suggest[0]} or {suggest[1]}" in finding.advice
    assert (finding.value, finding.unit) == (pytest.approx(share), "share")
    biggest = max(chunks)
    assert (f"every step waits for a device with the biggest chunk, {biggest} sample{'s' * (biggest > 1)}, in which "
            f"the {n} devices could take {n * biggest} and are given {batch}: ") in finding.evidence
    assert f"leave {share:.0%} of the devices' time unused" in finding.evidence
    assert f"no split of {batch} samples gives a smaller biggest chunk" in finding.evidence
    if kind == "idle_devices":
        assert finding.title.startswith(f"{n - len(chunks)} of {n} devices") and finding.device == f"cpu:{len(chunks)}"


@pytest.mark.parametrize("batch", [10.0, True, "10"])
def test_a_batch_size_that_is_no_whole_number_is_a_type_error_naming_it(batch):
    with pytest.raises(TypeError, match=rf"batch size must be a whole number \(an int\), got {re.escape(repr(batch))}"):
        dpprof.check_balance(dpprof.cpu_devices(2), batch)
    import numpy as np
    assert dpprof.check_balance(dpprof.cpu_devices(2), np.int64(10)) == dpprof.check_balance(dpprof.cpu_devices(2), 10)


def _no_gpu(monkeypatch):
    """Make this process see no GPU, as on a machine without one."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


def test_no_gpu_is_a_critical_finding(monkeypatch):
    _no_gpu(monkeypatch)
    [finding] = dpprof.check_balance()
    assert (finding.kind, finding.severity) == ("no_gpu", "critical")
    assert "was not checked" not in finding.advice
    # a batch size given with no devices to split it over is said unchecked, not dropped without a word
    [finding] = dpprof.check_balance(batch_size=10)
    assert finding.kind == "no_gpu"
    assert finding.advice.endswith("Batch size 10 was not checked: there are no devices to split it over.")


def test_more_cpu_workers_than_threads(monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    assert _kinds(dpprof.check_balance(dpprof.cpu_devices(4))) == [("oversubscribed_cpu", None)]


@pytest.mark.parametrize("argv, code", [
    (["check", "--device-ids", "cpu:0,cpu:1", "--batch-size", "8"], 0),
    (["check", "--device-ids", "cpu:0,cpu:1,cpu:2", "--batch-size", "10"], 1),
    (["check"], 1),  # no GPU (hidden below where there is one)
    (["check", "--device-ids", "cpu:0,cpu:0"], 2),
    (["check", "--device-ids", "cpu:0", "--batch-size", "0"], 2),
    (["check", "--batch-size", "many"], 2),
])
def test_check_exit_codes(argv, code, capsys, monkeypatch):
    _no_gpu(monkeypatch)
    try:
        assert main(argv) == code
    except SystemExit as exit_:
        assert exit_.code == code


def test_check_json_is_the_findings(capsys):
    assert main(["check", "--device-ids", "cpu:0,cpu:1,cpu:2", "--batch-size", "10", "--json"]) == 1
    findings = json.loads(capsys.readouterr().out)
    uneven = [f for f in findings if f["kind"] == "uneven_chunks"]
    assert uneven[0]["evidence"].startswith("batch 10 on 3 devices: torch.chunk gives [4, 4, 2]; ")
    assert set(uneven[0]) == {"kind", "severity", "device", "title", "evidence", "advice", "value", "unit"}

"""dpprof.device_ids: CPU workers and the validation of device_ids / output_device."""
from __future__ import annotations

import pytest
import torch

import dpprof
from dpprof.device_ids import (
    MAX_CPU_WORKERS,
    MAX_DEVICE_INDEX,
    DeviceSet,
    is_cpu_worker_list,
    resolve_devices,
)

needs_no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="asserts that CUDA devices are absent")


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_cpu_devices_names_n_indexed_cpu_workers(n):
    assert dpprof.cpu_devices(n) == [torch.device("cpu", i) for i in range(n)]


@pytest.mark.parametrize("n", [0, -1, True, 2.0, "2", None])
def test_cpu_devices_rejects_anything_but_a_positive_int(n):
    with pytest.raises(ValueError, match="positive number of workers"):
        dpprof.cpu_devices(n)


@pytest.mark.parametrize(
    "device_ids, output_device, expected",
    [
        (dpprof.cpu_devices(3), None, DeviceSet("cpu", (0, 1, 2), 0)),
        (["cpu:0", "cpu:1"], None, DeviceSet("cpu", (0, 1), 0)),
        (("cpu:2", "cpu:0"), None, DeviceSet("cpu", (2, 0), 2)),
        (["cpu:2", "cpu:0"], "cpu:0", DeviceSet("cpu", (2, 0), 0)),
        ([torch.device("cpu", 1), "cpu:3"], torch.device("cpu", 3), DeviceSet("cpu", (1, 3), 3)),
        (["cpu:0", "cpu:1"], -1, DeviceSet("cpu", (0, 1), -1)),  # torch's -1: gather onto the host
    ],
)
def test_resolve_devices_accepts_cpu_workers(device_ids, output_device, expected):
    resolved = resolve_devices(device_ids, output_device)
    assert resolved == expected
    assert resolved.labels == [f"cpu:{i}" for i in expected.indices]


BAD_DEVICE_IDS = [
    pytest.param([], None, ValueError, "empty", id="empty"),
    pytest.param(["cpu:0", "cpu:0"], None, ValueError, "twice", id="duplicate"),
    pytest.param([torch.device("cpu", 1), "cpu:1"], None, ValueError, "twice", id="duplicate-mixed-spelling"),
    pytest.param(["cpu:0", "cuda:0"], None, ValueError, "mixes CPU workers and CUDA", id="cpu-with-cuda"),
    pytest.param(["cpu:0", 1], None, ValueError, "mixes CPU workers and CUDA", id="cpu-with-int"),
    pytest.param(["cpu"], None, ValueError, "names no worker", id="cpu-without-index"),
    pytest.param(["meta:0"], None, ValueError, "not supported", id="meta"),
    pytest.param(["not a device"], None, ValueError, "not a device name", id="garbage-string"),
    pytest.param([True], None, TypeError, "not a device", id="bool"),
    pytest.param([1.5], None, TypeError, "not a device", id="float"),
    pytest.param("cpu:0", None, TypeError, "must be a list", id="bare-string"),
    pytest.param([-1], None, ValueError, "negative", id="negative-int"),
    pytest.param(["cpu:0", "cpu:1"], "cpu:2", ValueError, "not one of the CPU workers", id="output-elsewhere"),
    pytest.param(["cpu:0", "cpu:1"], "cuda:0", ValueError, "not of the same kind", id="output-cuda"),
    pytest.param(["cpu:0", "cpu:1"], "cpu", ValueError, "names no worker", id="output-cpu-without-index"),
    pytest.param(["cpu:0", "cpu:1"], -2, ValueError, "negative", id="output-negative"),
    pytest.param(["cpu:0", "cpu:1"], True, TypeError, "not a device", id="output-bool"),
]


@pytest.mark.parametrize("device_ids, output_device, error, match", BAD_DEVICE_IDS)
def test_resolve_devices_rejects_bad_input(device_ids, output_device, error, match):
    with pytest.raises(error, match=match):
        resolve_devices(device_ids, output_device)


@needs_no_gpu
@pytest.mark.parametrize("device_ids", [["cuda:0"], [0], [torch.device("cuda", 0)], ["cuda"]])
def test_resolve_devices_rejects_a_cuda_device_this_machine_lacks(device_ids):
    with pytest.raises(ValueError, match="does not exist: this machine has 0 CUDA device"):
        resolve_devices(device_ids)


@pytest.mark.parametrize(
    "devices, expected",
    [
        (None, False),
        ([], False),
        (dpprof.cpu_devices(2), True),
        (["cpu:0"], True),
        ([0, 1], False),
        (["cuda:0"], False),
        ([torch.device("cuda", 0)], False),
    ],
)
def test_is_cpu_worker_list(devices, expected):
    assert is_cpu_worker_list(devices) is expected


# torch keeps a device index in one signed byte: past 127 it wraps ("cpu:300" would be cpu:44, cpu_devices(256)
# would hold "cpu" with no index at 255). Each is refused naming the device and what exists.
@pytest.mark.parametrize("n", [MAX_CPU_WORKERS + 1, 256, 99999])
def test_cpu_devices_refuses_more_workers_than_torch_can_number(n):
    with pytest.raises(ValueError, match=rf"cpu_devices\({n}\): at most 128 CPU workers, cpu:0 to cpu:127"):
        dpprof.cpu_devices(n)


def test_cpu_devices_goes_up_to_the_last_index_torch_numbers():
    assert dpprof.cpu_devices(MAX_CPU_WORKERS)[-1] == torch.device("cpu", MAX_DEVICE_INDEX)


@pytest.mark.parametrize("device_ids, says", [
    (["cpu:0", "cpu:300"], r"device_ids\[1\]: cpu:300 is out of range: CPU workers are cpu:0 to cpu:127"),
    (["cpu:255"], r"device_ids\[0\]: cpu:255 is out of range"),
    (["cpu:128"], r"device_ids\[0\]: cpu:128 is out of range"),
    ([300], r"device_ids\[0\]: cuda:300 does not exist: this machine has \d+ CUDA device"),
    (["cuda:99999"], r"device_ids\[0\]: cuda:99999 does not exist: this machine has \d+ CUDA device"),
])
def test_resolve_devices_names_the_index_past_range_and_what_exists(device_ids, says):
    with pytest.raises(ValueError, match=says):
        resolve_devices(device_ids)


def test_resolve_devices_takes_the_last_cpu_index():
    assert resolve_devices(["cpu:0", f"cpu:{MAX_DEVICE_INDEX}"]).indices == (0, MAX_DEVICE_INDEX)

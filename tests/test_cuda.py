"""dpprof on real GPUs: parity with torch.nn.DataParallel, and CUDA-event timings in a run.

Every test here is marked ``cuda`` and skips without a GPU (two for the parity tests).
"""
from __future__ import annotations

import copy

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

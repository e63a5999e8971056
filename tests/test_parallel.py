"""dpprof.DataParallel, data_parallel, replicate and parallel_apply on CPU workers.

torch's own DataParallel tests (test/distributed/test_data_parallel.py) re-expressed for
CPU workers: everything is compared with the plain module run on the whole batch (or on
the chunk that torch's semantics say matters), never with dpprof itself.
"""
from __future__ import annotations

import copy
import gc
import importlib
import io
import re
import threading
import warnings
import weakref
from collections import OrderedDict, namedtuple
from contextlib import contextmanager, nullcontext
from itertools import chain

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.autograd import gradcheck
from torch.testing import assert_close

import dpprof

W = dpprof.cpu_devices
DOUBLE = torch.double
SCALAR_WARNING = (
    "Was asked to gather along dimension 0, but all input tensors were scalars; "
    "will instead unsqueeze and return a vector."
)
DEVICE_CHECK = (
    r"module must have its parameters and buffers on device cpu \(device_ids\[0\]\) "
    r"but found one of them on device: meta"
)
needs_no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="asserts behaviour without a GPU")


# helpers

class Logged(nn.Module):
    """Wraps a module and logs (thread, batch size) of every call; replicas share the log."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.calls: list[tuple[threading.Thread, int]] = []

    def forward(self, x):
        self.calls.append((threading.current_thread(), x.shape[0]))
        return self.inner(x)


def linear() -> nn.Module:
    return nn.Linear(10, 5).to(DOUBLE)


def conv_net() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(4, 6, 3), nn.Tanh(), nn.Flatten(), nn.Linear(6 * 2 * 2, 5),
    ).to(DOUBLE)


def seeded(make, seed: int = 0):
    torch.manual_seed(seed)
    return make()


def grads(module: nn.Module) -> dict[str, torch.Tensor | None]:
    return {name: p.grad for name, p in module.named_parameters()}


def assert_same_grads(module: nn.Module, plain: nn.Module, **tol) -> None:
    got, want = grads(module), grads(plain)
    assert list(got) == list(want)
    for name in want:
        assert want[name] is not None, name
        assert got[name] is not None, name
        assert_close(got[name], want[name], msg=name, **tol)


def snapshot(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def assert_unchanged(module: nn.Module, before: dict[str, torch.Tensor]) -> None:
    after = module.state_dict()
    assert list(after) == list(before)
    for k, v in before.items():
        assert torch.equal(after[k], v), k
    assert all(p.grad is None for p in module.parameters())


# parity with the plain module

PARITY = [
    pytest.param(linear, (20, 10), 1, [20], id="linear-1"),
    pytest.param(linear, (20, 10), 2, [10, 10], id="linear-2"),
    pytest.param(linear, (20, 10), 3, [7, 7, 6], id="linear-3"),
    pytest.param(linear, (20, 10), 4, [5, 5, 5, 5], id="linear-4"),
    pytest.param(linear, (5, 10), 4, [2, 2, 1], id="linear-batch5-on-4"),
    pytest.param(linear, (10, 10), 8, [2, 2, 2, 2, 2], id="linear-batch10-on-8"),
    pytest.param(conv_net, (8, 3, 8, 8), 1, [8], id="convnet-1"),
    pytest.param(conv_net, (8, 3, 8, 8), 2, [4, 4], id="convnet-2"),
    pytest.param(conv_net, (8, 3, 8, 8), 3, [3, 3, 2], id="convnet-3"),
    pytest.param(conv_net, (8, 3, 8, 8), 4, [2, 2, 2, 2], id="convnet-4"),
]


@pytest.mark.parametrize("make, shape, workers, chunk_sizes", PARITY)
def test_outputs_and_gradients_match_the_plain_module(make, shape, workers, chunk_sizes):
    module = Logged(seeded(make))
    plain = copy.deepcopy(module)
    x = torch.randn(*shape, dtype=DOUBLE, requires_grad=True)
    x_plain = x.detach().clone().requires_grad_()

    net = dpprof.DataParallel(module, device_ids=W(workers))
    out = net(x)
    expected = plain(x_plain)
    assert_close(out, expected)

    upstream = torch.randn_like(expected)
    out.backward(upstream)
    expected.backward(upstream)
    assert_same_grads(module, plain)
    assert_close(x.grad, x_plain.grad)

    # torch.chunk decides the replicas: one call per chunk, each in its own thread
    threads = [t for t, _ in module.calls]
    assert sorted(size for _, size in module.calls) == sorted(chunk_sizes)
    if workers == 1:
        assert threads == [threading.main_thread()]
    else:
        assert len(set(map(id, threads))) == len(chunk_sizes)
        assert threading.main_thread() not in threads


def test_float32_training_steps_track_the_plain_module():
    """Three SGD steps: parameters stay equal to the plain module's (grads sum into the module)."""
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 2))
    plain = copy.deepcopy(module)
    net = dpprof.DataParallel(module, W(3))
    opt, opt_plain = torch.optim.SGD(net.parameters(), lr=0.1), torch.optim.SGD(plain.parameters(), lr=0.1)
    for _ in range(3):
        x, y = torch.randn(12, 6), torch.randn(12, 2)
        for model, o in ((net, opt), (plain, opt_plain)):
            o.zero_grad()
            F.mse_loss(model(x), y).backward()
            o.step()
    for p, q in zip(module.parameters(), plain.parameters()):
        assert_close(p, q)


@pytest.mark.parametrize("device_ids", [["cpu:1", "cpu:0"], ("cpu:0", "cpu:1"), [torch.device("cpu", 2), "cpu:0"]])
def test_device_id_spellings_and_orders(device_ids):
    module = seeded(linear)
    x = torch.randn(20, 10, dtype=DOUBLE)
    assert_close(dpprof.DataParallel(module, device_ids)(x), module(x))


def test_complex_parameters():
    torch.manual_seed(0)
    module = nn.Linear(4, 3, dtype=torch.cfloat)
    plain = copy.deepcopy(module)
    x = torch.randn(6, 4, dtype=torch.cfloat)
    out = dpprof.DataParallel(module, W(3))(x)
    expected = plain(x)
    assert_close(out, expected)
    out.abs().sum().backward()
    expected.abs().sum().backward()
    assert_same_grads(module, plain)


def test_lstm_replicas_use_their_own_flat_weights():
    """torch's test_data_parallel_rnn idea: RNN replicas must not share the flat-weights cache."""
    torch.manual_seed(0)
    lstm = nn.LSTM(4, 6, num_layers=2, batch_first=True).to(DOUBLE)
    plain = copy.deepcopy(lstm)
    x = torch.randn(6, 5, 4, dtype=DOUBLE)
    out, (h, c) = dpprof.DataParallel(lstm, W(3))(x)
    exp_out, _ = plain(x)
    assert_close(out, exp_out)
    # h is (layers, batch, hidden), so gathering along dim 0 stacks the replicas' layers, as in torch
    assert_close(h, torch.cat([plain(chunk)[1][0] for chunk in x.chunk(3)]))
    out.sum().backward()
    exp_out.sum().backward()
    assert_same_grads(lstm, plain)


# call shapes: kwargs, empty containers, zero inputs, nesting, non-tensors

class KwargsNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(10, 5).to(DOUBLE)
        self.unused_seen: list[object] = []

    def forward(self, input):
        if isinstance(input, dict):
            self.unused_seen.append(input["unused"])
            input = input["data"]
        return self.l(input)


@pytest.mark.parametrize("unused", [None, [], {}, ()], ids=["plain", "empty-list", "empty-dict", "empty-tuple"])
@pytest.mark.parametrize("workers", [1, 2, 3])
def test_kwargs_only_calls(unused, workers):
    """torch's test_data_parallel_module_kwargs_only[_empty_list|_empty_dict|_empty_tuple]."""
    net = seeded(KwargsNet)
    x = torch.randn(20, 10, dtype=DOUBLE)
    expected = net.l(x)
    arg = x if unused is None else {"data": x, "unused": unused}
    out = dpprof.DataParallel(net, W(workers))(input=arg)
    assert_close(out, expected)
    if unused is not None:
        # an empty container is not split: every replica gets the very same object
        assert len(net.unused_seen) == workers
        assert all(u is unused for u in net.unused_seen)


class ZeroInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[threading.Thread] = []

    def forward(self):
        self.calls.append(threading.current_thread())
        t = torch.eye(2, 3)
        return t + (1 - t)


@pytest.mark.parametrize(
    "call",
    [
        lambda m: dpprof.DataParallel(m, W(1))(),
        lambda m: dpprof.DataParallel(m, W(2))(),
        lambda m: dpprof.DataParallel(m, W(4))(),
        lambda m: dpprof.data_parallel(m, None, W(1)),
        lambda m: dpprof.data_parallel(m, (), W(2)),
    ],
    ids=["dp-1", "dp-2", "dp-4", "functional-None-1", "functional-empty-2"],
)
def test_module_without_inputs_runs_once_on_the_first_device(call):
    """torch's test_data_parallel_module_zero_inputs."""
    model = ZeroInputs()
    out = call(model)
    assert torch.equal(out, torch.ones(2, 3))
    assert len(model.calls) == 1


def nested_output(t):
    return [t, (t.sin(), t.cos(), [t.add(1)]), t, OrderedDict(a=t, b=[t.sin()])]


class NestedOutput(nn.Module):
    def forward(self, input):
        return nested_output(input)


@pytest.mark.parametrize("workers", [2, 3])
def test_nested_outputs_keep_their_types(workers):
    """torch's test_data_parallel_nested_output."""
    i = torch.randn(6, 2)
    output = dpprof.data_parallel(NestedOutput(), i, W(workers))
    expected = nested_output(i)
    assert isinstance(output, list)
    assert isinstance(output[0], torch.Tensor)
    assert isinstance(output[1], tuple)
    assert isinstance(output[1][2], list)
    assert isinstance(output[2], torch.Tensor)
    assert type(output[3]) is OrderedDict and list(output[3]) == ["a", "b"]
    assert isinstance(output[3]["b"], list)
    assert_close(output, expected)


class NestedInput(nn.Module):
    def forward(self, *input):
        return input[1][0]


@pytest.mark.parametrize("workers", [2, 4])
def test_nested_inputs(workers):
    """torch's test_data_parallel_nested_input."""
    i = torch.randn(20, 3)
    inputs = (i.cos(), (i.sin(), i), i.sin())
    assert_close(dpprof.data_parallel(NestedInput(), inputs, W(workers)), i.sin())


Batch = namedtuple("Batch", "x y")
Out = namedtuple("Out", "total parts")


class NamedTupleNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, dtype=DOUBLE))
        self.seen_types: list[tuple[type, type, type]] = []

    def forward(self, batch, extra):
        self.seen_types.append((type(batch), type(extra), type(extra["zs"])))
        return Out(batch.x * self.w + batch.y, {"d": [batch.x - batch.y], "e": (extra["zs"][0] * 2,)})


def test_namedtuple_dict_list_inputs_and_outputs_keep_their_types():
    net = seeded(NamedTupleNet)
    plain = copy.deepcopy(net)
    batch = Batch(torch.randn(7, 3, dtype=DOUBLE), torch.randn(7, 3, dtype=DOUBLE))
    extra = OrderedDict(zs=[torch.randn(7, 2, dtype=DOUBLE)])
    out = dpprof.DataParallel(net, W(3))(batch, extra)
    expected = plain(batch, extra)
    assert type(out) is Out
    assert type(out.parts) is dict and type(out.parts["d"]) is list and type(out.parts["e"]) is tuple
    assert_close(out.total, expected.total)
    assert_close(out.parts["d"][0], expected.parts["d"][0])
    assert_close(out.parts["e"][0], expected.parts["e"][0])
    assert net.seen_types == [(Batch, OrderedDict, list)] * 3
    out.total.sum().backward()
    expected.total.sum().backward()
    assert_same_grads(net, plain)


class MultipleInput(nn.Module):
    def forward(self, var1, var2, float1, var3=None):
        if var3 is None:
            return float1 * (var1 * var2)
        return float1 * (var1 * var2 + var3)


def test_multiple_inputs_positional_and_keyword():
    """torch's test_data_parallel_multiple_input: gradients reach every input that requires them."""
    m = MultipleInput()
    var1 = torch.randn(5, 5, requires_grad=True)
    var2 = torch.randn(5, 5, requires_grad=True)
    var3 = torch.randn(5, 5)
    float1 = torch.randn(1).item()

    def expect(**kw):
        var1.grad = var2.grad = None
        expected = m(var1, var2, float1, **kw)
        expected.sum().backward()
        return expected.detach(), var1.grad.clone(), var2.grad.clone()

    def check(out, expected):
        var1.grad = var2.grad = None
        out.sum().backward()
        assert_close(out, expected[0])
        assert_close(var1.grad, expected[1])
        assert_close(var2.grad, expected[2])

    plain = expect()
    for ids in (["cpu:0", "cpu:1"], ["cpu:1", "cpu:0"], ["cpu:0"]):
        check(dpprof.data_parallel(m, (var1, var2, float1), ids), plain)
    with_var3 = expect(var3=var3)
    for ids in (W(2), ["cpu:0"], ["cpu:1", "cpu:0"]):
        check(dpprof.DataParallel(MultipleInput(), ids)(var1, var2, float1, var3=var3), with_var3)
    check(dpprof.data_parallel(m, (var1, var2, float1), W(2), module_kwargs={"var3": var3}), with_var3)


_SHARED = object()


class NonTensorArgs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple] = []

    def forward(self, x, scale, name, flag, obj, nothing, *, mode="train"):
        self.seen.append((scale, name, flag, obj, nothing, mode))
        return x * scale


@pytest.mark.parametrize("workers", [2, 3, 4])
def test_non_tensor_arguments_reach_every_replica(workers):
    net = NonTensorArgs()
    x = torch.randn(8, 2)
    out = dpprof.DataParallel(net, W(workers))(x, 2.5, "name", True, _SHARED, None, mode="eval")
    assert_close(out, x * 2.5)
    assert len(net.seen) == workers
    for scale, name, flag, obj, nothing, mode in net.seen:
        assert (scale, name, flag, nothing, mode) == (2.5, "name", True, None, "eval")
        assert obj is _SHARED  # shared by reference, as torch documents


class LastDimNet(nn.Module):
    """Works on any size of the last dim: the scatter dim can be -1."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 1, dtype=DOUBLE))
        self.b = nn.Parameter(torch.randn(3, 1, dtype=DOUBLE))

    def forward(self, x):
        return torch.tanh(x) * self.w + self.b


@pytest.mark.parametrize("dim", [1, -1])
@pytest.mark.parametrize("workers", [2, 3])
def test_scatter_and_gather_along_the_last_dim(dim, workers):
    net = seeded(LastDimNet)
    plain = copy.deepcopy(net)
    x = torch.randn(3, 8, dtype=DOUBLE, requires_grad=True)
    out = dpprof.DataParallel(net, W(workers), dim=dim)(x)
    expected = plain(x)
    assert_close(out, expected)
    out.sum().backward()
    expected.sum().backward()
    assert_same_grads(net, plain)


@pytest.mark.parametrize("workers", [2, 3])
def test_sequence_first_lstm_split_along_dim_1(workers):
    torch.manual_seed(0)
    lstm = nn.LSTM(4, 5).to(DOUBLE)  # input (seq, batch, feature): the batch is dim 1
    plain = copy.deepcopy(lstm)
    x = torch.randn(7, 6, 4, dtype=DOUBLE)
    out, (h, c) = dpprof.DataParallel(lstm, W(workers), dim=1)(x)
    exp_out, (exp_h, exp_c) = plain(x)
    assert_close(out, exp_out)
    assert_close(h, exp_h)
    assert_close(c, exp_c)
    (out.sum() + c.sum()).backward()
    (exp_out.sum() + exp_c.sum()).backward()
    assert_same_grads(lstm, plain)
    assert_close(dpprof.data_parallel(lstm, x, W(workers), dim=1)[0], exp_out)


# scalar outputs

class ScalarLoss(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(4, 1).to(DOUBLE)

    def forward(self, x):
        return (self.l(x) ** 2).mean()


@pytest.mark.parametrize("workers", [2, 3])
def test_scalar_outputs_are_gathered_into_a_vector_with_torchs_warning(workers):
    net = seeded(ScalarLoss)
    plain = copy.deepcopy(net)
    x = torch.randn(6, 4, dtype=DOUBLE)
    with pytest.warns(UserWarning, match=re.escape(SCALAR_WARNING)) as caught:
        out = dpprof.DataParallel(net, W(workers))(x)
    assert SCALAR_WARNING in [str(w.message) for w in caught]
    per_chunk = [plain(c) for c in x.chunk(workers)]
    assert out.shape == (workers,)
    assert_close(out, torch.stack(per_chunk))
    out.sum().backward()
    sum(per_chunk).backward()
    assert_same_grads(net, plain)


def test_scalar_output_on_one_worker_stays_a_scalar():
    net = seeded(ScalarLoss)
    x = torch.randn(6, 4, dtype=DOUBLE)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = dpprof.DataParallel(net, W(1))(x)
    assert out.dim() == 0
    assert_close(out, net(x))


# buffers and in-place updates on replica 0

@pytest.mark.parametrize("bn, shape", [(nn.BatchNorm1d, (12, 3)), (nn.BatchNorm2d, (12, 3, 4, 4))])
@pytest.mark.parametrize("workers", [2, 3, 4])
def test_batchnorm_running_stats_come_from_chunk_zero(bn, shape, workers):
    torch.manual_seed(0)
    module = bn(3, momentum=0.5)
    on_chunk0, on_whole = copy.deepcopy(module), copy.deepcopy(module)
    x = torch.randn(*shape) * 3 + torch.arange(shape[0]).view(-1, *[1] * (len(shape) - 1))

    out = dpprof.DataParallel(module, W(workers))(x)
    chunks = x.chunk(workers)
    on_chunk0(chunks[0])
    on_whole(x)

    assert_close(module.running_mean, on_chunk0.running_mean)
    assert_close(module.running_var, on_chunk0.running_var)
    assert module.num_batches_tracked.item() == 1
    assert not torch.allclose(module.running_mean, on_whole.running_mean)
    # each replica normalises its chunk with that chunk's statistics
    expected = torch.cat([copy.deepcopy(bn(3, momentum=0.5))(c) for c in chunks])
    assert_close(out, expected)


def test_batchnorm_in_eval_mode_matches_the_whole_batch_and_keeps_its_stats():
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    module(torch.randn(32, 4))  # give it running statistics
    module.eval()
    before = snapshot(module)
    x = torch.randn(9, 4)
    assert_close(dpprof.DataParallel(module, W(3))(x), module(x))
    for k, v in before.items():
        assert torch.equal(module.state_dict()[k], v), k


def test_spectral_norm_updates_u_through_replica_zero():
    torch.manual_seed(0)
    module = nn.utils.spectral_norm(nn.Linear(4, 3).to(DOUBLE))
    u0 = module.weight_u.clone()
    on_chunk0, on_whole = copy.deepcopy(module), copy.deepcopy(module)
    x = torch.randn(6, 4, dtype=DOUBLE)

    out = dpprof.DataParallel(module, W(3))(x)
    on_chunk0(x.chunk(3)[0])
    expected = on_whole(x)

    assert not torch.allclose(module.weight_u, u0)
    assert_close(module.weight_u, on_chunk0.weight_u)
    assert_close(module.weight_v, on_chunk0.weight_v)
    assert_close(out, expected)
    out.sum().backward()
    expected.sum().backward()
    assert_same_grads(module, on_whole)


class BufferRequiringGrad(nn.Module):
    def __init__(self, t: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("t_rg", t)
        self.register_buffer("t_not_rg", t.detach().clone())

    def forward(self, x):
        return x * self.t_rg + self.t_not_rg


def test_buffers_requiring_grad_pass_gradcheck():
    """torch's test_data_parallel_buffers_requiring_grad."""
    m = BufferRequiringGrad(torch.randn(100, dtype=DOUBLE, requires_grad=True))
    assert m.t_rg.requires_grad
    dpm = dpprof.DataParallel(m, W(2))
    inp = torch.randn(2, 100, dtype=DOUBLE)
    assert gradcheck(lambda t: dpm(inp), (m.t_rg,))


class ParamContainer(nn.Module):
    def __init__(self, data: nn.Module, keys: tuple) -> None:
        super().__init__()
        self.data = data
        self.keys = keys
        self.seen: list[tuple] = []

    def forward(self, x):
        a, b = (self.data[k] for k in self.keys)
        self.seen.append((a.requires_grad, b.requires_grad, a.grad_fn is not None, b.grad_fn is not None,
                          a.detach().clone(), b.detach().clone()))
        return x * a + b


@pytest.mark.parametrize(
    "make, keys",
    [
        (lambda p1, p2: nn.ParameterList([p1, p2]), (0, 1)),
        (lambda p1, p2: nn.ParameterDict({"0": p1, "1": p2}), ("0", "1")),
        (lambda p1, p2: nn.ParameterDict({"scale": p1, "shift": p2}), ("scale", "shift")),
    ],
    ids=["ParameterList", "ParameterDict-digits", "ParameterDict-names"],
)
def test_parameter_list_and_dict_replicas_work_and_get_gradients(make, keys):
    """torch's test_parameter_list_dict_replica, plus gradients."""
    torch.manual_seed(0)
    p1, p2 = nn.Parameter(torch.rand(10, dtype=DOUBLE)), nn.Parameter(torch.rand(10, dtype=DOUBLE))
    module = ParamContainer(make(p1, p2), keys)
    plain = copy.deepcopy(module)
    x = torch.randn(8, 10, dtype=DOUBLE)
    out = dpprof.DataParallel(module, W(2))(x)
    expected = plain(x)
    assert_close(out, expected)
    assert len(module.seen) == 2
    for a_rg, b_rg, a_fn, b_fn, a, b in module.seen:
        assert a_rg and b_rg and a_fn and b_fn  # replicas hold differentiable copies, not the leaves
        assert torch.equal(a, p1.detach()) and torch.equal(b, p2.detach())
    out.sum().backward()
    expected.sum().backward()
    assert_same_grads(module, plain)
    assert p1.grad is not None and p2.grad is not None


def test_lazy_module_refuses_with_torchs_error():
    """torch's test_data_parallel_lazy_linear."""
    with pytest.raises(RuntimeError, match="Modules with uninitialized parameters"):
        dpprof.DataParallel(nn.LazyLinear(10), W(2))(torch.rand(64, 10))
    with pytest.raises(RuntimeError, match="Modules with uninitialized parameters"):
        dpprof.replicate(nn.LazyLinear(10), W(2), detach=True)


def test_zero_grad_inside_a_replica_warns_and_changes_nothing():
    """torch's test_zero_grad: a replica's zero_grad has no effect on the module."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(10, 10)

        def forward(self, x):
            self.zero_grad()
            return self.linear(x)

    module = Net()
    for p in module.parameters():
        p.grad = torch.ones_like(p)
    with pytest.warns(UserWarning, match="has no effect"):
        dpprof.DataParallel(module, W(2))(torch.rand(4, 10))
    assert all(torch.equal(p.grad, torch.ones_like(p)) for p in module.parameters())


# hooks

@pytest.mark.parametrize("workers", [1, 2, 3, 4])
def test_forward_hooks_and_pre_hooks_run_once_per_replica(workers):
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    plain = copy.deepcopy(module)
    pre, post, sub = [], [], []
    module.register_forward_pre_hook(lambda mod, args: pre.append(args[0].shape[0]))
    module.register_forward_hook(lambda mod, args, out: post.append(out.shape[0]))
    module[0].register_forward_hook(lambda mod, args, out: (sub.append(mod), out * 2)[1])
    x = torch.randn(10, 4)

    out = dpprof.DataParallel(module, W(workers))(x)

    sizes = sorted(c.shape[0] for c in x.chunk(workers))
    assert sorted(pre) == sizes
    assert sorted(post) == sizes
    assert len(sub) == workers
    if workers == 1:
        assert sub == [module[0]]
    else:  # each call saw its own replica
        assert len(set(map(id, sub))) == workers and module[0] not in sub
    # the output-rewriting hook took effect in every replica
    assert_close(out, plain[2](plain[1](plain[0](x) * 2)))


@pytest.mark.parametrize("workers", [2, 3])
def test_full_backward_hooks_run_once_per_replica(workers):
    module = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    seen = []
    module[0].register_full_backward_hook(lambda mod, gin, gout: seen.append(gout[0].shape[0]))
    x = torch.randn(9, 4, requires_grad=True)
    dpprof.DataParallel(module, W(workers))(x).sum().backward()
    assert sorted(seen) == sorted(c.shape[0] for c in x.chunk(workers))


# autograd: double backward, sparse gradients, layouts

def test_gradient_penalty_double_backward_gives_torchs_values():
    """torch's test_data_parallel_function_deletion (#16532), on CPU workers."""
    net = nn.Linear(4, 1)
    dpn = dpprof.DataParallel(net, W(2))
    x = torch.ones(2, 4, requires_grad=True)
    out = dpn(x)
    loss = torch.autograd.grad(out, x, grad_outputs=x.new_ones(out.size()), create_graph=True,
                               retain_graph=True)[0].mean()
    loss.backward()
    weight_grad, bias_grad = (p.grad for p in net.parameters())
    assert_close(weight_grad, torch.tensor([[0.25, 0.25, 0.25, 0.25]]))
    assert_close(bias_grad, torch.tensor([0.0]))


@pytest.mark.parametrize(
    "make",
    [lambda: nn.Linear(4, 1), lambda: nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))],
    ids=["linear", "mlp"],
)
@pytest.mark.parametrize("workers", [2, 3])
def test_double_backward_matches_the_plain_module(make, workers):
    module = seeded(make).to(DOUBLE)
    plain = copy.deepcopy(module)
    x = torch.randn(6, 4, dtype=DOUBLE, requires_grad=True)
    x_plain = x.detach().clone().requires_grad_()

    def penalty(net, inp):
        out = net(inp)
        (g,) = torch.autograd.grad(out, inp, torch.ones_like(out), create_graph=True)
        return (g ** 2).sum() + out.sum()

    penalty(dpprof.DataParallel(module, W(workers)), x).backward()
    penalty(plain, x_plain).backward()
    assert_same_grads(module, plain)
    assert_close(x.grad, x_plain.grad)


@pytest.mark.parametrize("device_ids", [["cpu:0", "cpu:1"], ["cpu:1", "cpu:0"], W(3)], ids=str)
def test_sparse_embedding_gradients(device_ids):
    """torch's test_data_parallel_sparse."""
    torch.manual_seed(0)
    emb = nn.Embedding(10, 5, sparse=True)
    i = torch.randint(10, (20, 5))
    expected_out = emb(i)
    expected_out.sum().backward()
    expected = emb.weight.grad.clone()
    emb.zero_grad()
    out = dpprof.data_parallel(emb, i, device_ids)
    out.sum().backward()
    assert_close(out, expected_out)
    assert emb.weight.grad.is_sparse
    assert_close(emb.weight.grad.to_dense(), expected.to_dense())


class ConvStack(nn.Module):
    def __init__(self, layouts) -> None:
        super().__init__()
        self.conv0 = nn.Conv2d(8, 16, (2, 2)).to(memory_format=layouts[0])
        self.conv1 = nn.Conv2d(16, 32, (2, 2)).to(memory_format=layouts[1])
        self.conv2 = nn.Conv2d(32, 16, (2, 2)).to(memory_format=layouts[2])
        self.conv3 = nn.Conv2d(16, 8, (2, 2)).to(memory_format=layouts[3])

    def forward(self, x):
        return self.conv3(self.conv2(self.conv1(self.conv0(x))))


@pytest.mark.parametrize(
    "layouts",
    [
        [torch.contiguous_format] * 4,
        [torch.channels_last] * 2 + [torch.contiguous_format] * 2,
        [torch.channels_last] * 4,
    ],
    ids=["contiguous", "mixed", "channels_last"],
)
def test_gradients_keep_the_parameters_memory_format(layouts):
    """torch's test_strided_grad_layout (float32): two iterations, the second on zeroed grads."""
    torch.manual_seed(0)
    m = ConvStack(layouts)
    m_dp = dpprof.DataParallel(copy.deepcopy(m), W(2))
    opt, opt_dp = torch.optim.SGD(m.parameters(), lr=0.1), torch.optim.SGD(m_dp.parameters(), lr=0.1)
    x, target = torch.randn(16, 8, 8, 8), torch.randn(16, 8, 4, 4)
    for _ in range(2):
        F.mse_loss(m(x), target).backward()
        F.mse_loss(m_dp(x), target).backward()
        for i, (child, dp_child) in enumerate(zip(m.children(), m_dp.module.children())):
            assert child.weight.grad.is_contiguous(memory_format=layouts[i])
            assert dp_child.weight.grad.is_contiguous(memory_format=layouts[i])
            for p, p_dp in zip(child.parameters(), dp_child.parameters()):
                assert_close(p_dp.grad, p.grad, rtol=1e-5, atol=1e-5)
        opt.step()
        opt_dp.step()
        opt.zero_grad()
        opt_dp.zero_grad()


# exceptions

class FailsOnNaN(nn.Module):
    def forward(self, x):
        if torch.isnan(x).any():
            raise ValueError("saw a NaN row")
        return x * 2


@pytest.mark.parametrize(
    "device_ids, bad_row, replica, device",
    [
        (W(3), 5, 2, "cpu:2"),
        (W(3), 0, 0, "cpu:0"),
        (["cpu:1", "cpu:0"], 0, 0, "cpu:1"),
        (["cpu:1", "cpu:0"], 5, 1, "cpu:0"),
    ],
)
def test_a_replica_exception_is_reraised_naming_the_replica(device_ids, bad_row, replica, device):
    x = torch.randn(6, 2)
    x[bad_row] = float("nan")
    expected = f"Caught ValueError in replica {replica} on device {device}."
    with pytest.raises(ValueError, match=re.escape(expected)) as info:
        dpprof.DataParallel(FailsOnNaN(), device_ids)(x)
    assert "saw a NaN row" in str(info.value)
    with pytest.raises(ValueError, match=re.escape(expected)):
        dpprof.data_parallel(FailsOnNaN(), x, device_ids)


@pytest.mark.parametrize("devices", [W(2), None], ids=["cpu-workers", "from-inputs"])
def test_parallel_apply_passes_a_key_error_on(devices):
    """torch's test_parallel_apply_passes_exception (one module used twice); without devices, the
    None inputs run on CPU workers too."""

    class TestModule(nn.Module):
        def forward(self, *args):
            return {}["wonderful"]

    l1 = TestModule()
    pattern = r"Caught KeyError in replica \d on device cpu:\d.\nOriginal Traceback[\s\S]+wonderful"
    with pytest.raises(KeyError, match=pattern):
        dpprof.parallel_apply(modules=(l1, l1), inputs=(None, None), devices=devices)


def test_parallel_apply_without_devices_runs_cpu_inputs_on_cpu_workers():
    # torch takes the device from the inputs; none on a GPU (None inputs too) means CPU workers
    seen = []

    def fn(*args):
        seen.append(threading.current_thread().name)
        return args

    outputs = dpprof.parallel_apply([fn, fn], [None, (torch.ones(2),)])
    assert outputs[0] == (None,) and torch.equal(outputs[1][0], torch.ones(2))
    assert sorted(name.rsplit("_", 1)[0] for name in seen) == ["dpprof-cpu:0", "dpprof-cpu:1"]


def test_gather_onto_minus_one_warns_as_torch_and_gathers_on_the_cpu():
    outputs = [torch.ones(2, 3), torch.zeros(1, 3)]
    with pytest.warns(FutureWarning, match="Using -1 to represent CPU tensor is deprecated"):
        out = dpprof.gather(outputs, -1)
    assert out.device == torch.device("cpu") and torch.equal(out, torch.cat(outputs))


# grad mode and autocast in worker threads

class ModeRecorder(nn.Linear):
    def __init__(self) -> None:
        super().__init__(4, 4)
        self.modes: list[tuple[bool, bool, torch.dtype | None]] = []

    def forward(self, x):
        autocast = torch.is_autocast_enabled("cpu")
        self.modes.append((torch.is_grad_enabled(), autocast, torch.get_autocast_dtype("cpu") if autocast else None))
        return super().forward(x)


def _autocast_bf16():
    return torch.autocast("cpu", dtype=torch.bfloat16)


@contextmanager
def _no_grad_autocast():
    with torch.no_grad(), _autocast_bf16():
        yield


@pytest.mark.parametrize(
    "context, grad, autocast, dtype",
    [
        (nullcontext, True, False, torch.float32),
        (torch.no_grad, False, False, torch.float32),
        (lambda: torch.set_grad_enabled(False), False, False, torch.float32),
        (_autocast_bf16, True, True, torch.bfloat16),
        (_no_grad_autocast, False, True, torch.bfloat16),
    ],
    ids=["default", "no_grad", "set_grad_enabled-False", "autocast-bf16", "no_grad+autocast"],
)
@pytest.mark.parametrize("workers", [2, 3])
def test_grad_mode_and_autocast_reach_worker_threads(context, grad, autocast, dtype, workers):
    torch.manual_seed(0)
    module = ModeRecorder()
    plain = copy.deepcopy(module)
    x = torch.randn(6, 4)
    with context():
        out = dpprof.DataParallel(module, W(workers))(x)
        expected = plain(x)
    assert module.modes == [(grad, autocast, torch.bfloat16 if autocast else None)] * workers
    assert out.dtype == dtype
    assert out.requires_grad is grad
    assert_close(out, expected)
    assert torch.is_grad_enabled() and not torch.is_autocast_enabled("cpu")  # nothing leaked out


def test_autocast_a_replica_leaves_on_its_worker_does_not_reach_the_next_call():
    # a worker's thread outlives the call: autocast a module switched on there and did not switch off
    # must not apply to the next call made with autocast off (the worker enters autocast(enabled=False))
    class LeavesAutocastOn(nn.Linear):
        def forward(self, x):
            torch.set_autocast_enabled("cpu", True)
            torch.set_autocast_dtype("cpu", torch.bfloat16)
            return super().forward(x)

    net = dpprof.DataParallel(nn.Linear(4, 4), W(2))
    dpprof.DataParallel(LeavesAutocastOn(4, 4), W(2))(torch.randn(4, 4))
    try:
        assert net(torch.randn(4, 4)).dtype is torch.float32
    finally:  # switch the workers' autocast off again for the tests after this one
        def off():
            torch.set_autocast_enabled("cpu", False)
        dpprof.parallel_apply([off, off], [(), ()], None, W(2))


def test_a_base_exception_in_a_replica_reaches_the_caller_and_the_workers_go_on():
    class Exits(nn.Module):
        def forward(self, x):
            raise KeyboardInterrupt  # not an Exception: torch's wrapper does not catch it either

    with pytest.raises(KeyboardInterrupt):
        dpprof.DataParallel(Exits(), W(2))(torch.randn(4, 4))
    net = nn.Linear(4, 4)
    x = torch.randn(4, 4)
    assert_close(dpprof.DataParallel(net, W(2))(x), net(x))


def test_autocast_decorated_forward():
    """torch's test_autocast: a forward decorated with autocast produces low-precision outputs."""

    class Model(nn.Linear):
        def __init__(self) -> None:
            super().__init__(8, 8)

        @torch.autocast(device_type="cpu", dtype=torch.bfloat16)
        def forward(self, input):
            return super().forward(input)

    model = dpprof.DataParallel(Model(), W(2))
    assert model(torch.randn(8, 8)).dtype is torch.bfloat16


# no_grad

def test_no_grad_is_honoured_in_every_replica():
    """torch's test_data_parallel_no_grad."""

    class Layer(nn.Module):
        def forward(self, x):
            assert not torch.is_grad_enabled()
            return x

    layer = Layer()
    i = torch.randn(20, 10)
    with torch.no_grad():
        assert torch.equal(dpprof.data_parallel(layer, i, W(2)), i)
    with pytest.raises(AssertionError, match="Caught AssertionError in replica"):
        dpprof.data_parallel(layer, i, W(2))


class ParamStateRecorder(nn.Linear):
    def __init__(self) -> None:
        super().__init__(3, 3)
        self.param_states: list[tuple[bool, bool]] = []

    def forward(self, x):
        self.param_states.append((self.weight.requires_grad, self.weight.grad_fn is None))
        return super().forward(x)


@pytest.mark.parametrize("workers", [2, 3])
def test_no_grad_outputs_have_no_graph_and_replicas_are_detached(workers):
    module = ParamStateRecorder()
    x = torch.randn(6, 3, requires_grad=True)
    with torch.no_grad():
        out = dpprof.DataParallel(module, W(workers))(x)
    assert not out.requires_grad and out.grad_fn is None
    assert module.param_states == [(False, True)] * workers
    assert_close(out, module(x).detach())

    module.param_states.clear()
    out = dpprof.DataParallel(module, W(workers))(x)
    assert out.requires_grad and out.grad_fn is not None
    assert module.param_states == [(True, False)] * workers


# the device check

class MetaBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(3, 3)
        self.register_buffer("scale", torch.ones(3, device="meta"))

    def forward(self, x):
        return self.l(x)


@pytest.mark.parametrize(
    "make",
    [lambda: nn.Linear(3, 3, device="meta"), MetaBuffer,
     lambda: nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3, device="meta"))],
    ids=["meta-parameter", "meta-buffer", "meta-submodule"],
)
@pytest.mark.parametrize("workers", [1, 2])
def test_module_elsewhere_raises_torchs_device_error(make, workers):
    """torch's test_data_parallel_model_device, with 'meta' standing in for another device."""
    x = torch.randn(4, 3)
    with pytest.raises(RuntimeError, match=DEVICE_CHECK):
        dpprof.DataParallel(make(), W(workers))(x)
    with pytest.raises(RuntimeError, match=DEVICE_CHECK):
        dpprof.data_parallel(make(), x, W(workers))


def test_replicate_refuses_a_module_off_the_cpu():
    with pytest.raises(RuntimeError, match="meta"):
        dpprof.replicate(nn.Linear(3, 3, device="meta"), W(2))


# resources: reference cycles, threads

def test_a_step_leaves_no_reference_cycles():
    """torch's test_data_parallel_model_no_refcycles, strengthened: nothing for gc to collect."""
    replicas = []

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(1, 1)

        def forward(self, x):
            replicas.append(weakref.ref(self))
            return self.linear(x)

    model = dpprof.DataParallel(Model(), W(2))
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        out = model(torch.randn(4, 1))
        out.sum().backward()
        del out
        dead = [r() is None for r in replicas]  # freed by reference counting alone
        found = gc.collect()
        garbage = list(gc.garbage)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert len(replicas) == 2 and all(dead)
    assert found == 0 and garbage == []


def _assert_no_new_threads(before: set[threading.Thread]) -> None:
    # active_count() equals the count of threads alive before the step: compared this way,
    # a thread from another test that ends meanwhile cannot make the check flaky.
    assert set(threading.enumerate()) - before == set()
    assert threading.active_count() == sum(t.is_alive() for t in before)


@pytest.mark.parametrize("workers", [2, 4, 8])
def test_workers_are_long_lived_threads(workers):
    # like a GPU's stream, each worker is one thread that outlives the call: steps after the
    # first, and a step whose replica fails, start no thread
    net = dpprof.DataParallel(nn.Linear(4, 4), W(workers))
    net(torch.randn(16, 4)).sum().backward()
    before = set(threading.enumerate())
    names = {t.name.rsplit("_", 1)[0] for t in before}
    assert {f"dpprof-cpu:{i}" for i in range(workers)} <= names
    net(torch.randn(16, 4)).sum().backward()
    _assert_no_new_threads(before)
    x = torch.randn(16, 4)
    x[-1] = float("nan")
    with pytest.raises(ValueError):
        dpprof.DataParallel(FailsOnNaN(), W(workers))(x)
    _assert_no_new_threads(before)


def _forward_on_workers_in_child(conn) -> None:
    # one intra-op thread, as torch's DataLoader sets in each worker it forks: OpenMP's and MKL's pools are not
    # fork-safe, and a child that used the parent's crashed once in torch's linear (SIGSEGV, the full suite under
    # xdist, 2026-11-27); what is tested here is dpprof's workers, which the child must start afresh either way
    torch.set_num_threads(1)
    net = nn.Linear(4, 4)
    x = torch.randn(8, 4)
    out = dpprof.DataParallel(net, W(2))(x)
    conn.send(torch.allclose(out, net(x)))


def test_a_forked_child_starts_workers_of_its_own():
    # the parent's worker threads do not exist in a forked child (a DataLoader worker, a
    # multiprocessing pool): a forward there must start new ones, not wait on the parent's queues
    import multiprocessing

    dpprof.DataParallel(nn.Linear(4, 4), W(2))(torch.randn(8, 4))  # the parent's workers are running
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_forward_on_workers_in_child, args=(child,))
    proc.start()
    proc.join(60)
    if proc.is_alive():
        proc.kill()
        pytest.fail("the forked child's forward on CPU workers never returned")
    assert proc.exitcode == 0 and parent.recv() is True


def test_a_forked_child_never_waits_for_the_parents_openmp_helpers(monkeypatch):
    # the forking thread's OpenMP helpers are listed in the child's runtime but do not exist there: releasing them
    # (a call after long calls, which a loaded machine makes of any hand-off) waited for them forever, 4 forks in 40
    # under load; here every call counts as following long ones, and the parent's helpers are alive at the fork
    import multiprocessing

    from dpprof.parallel import workers

    monkeypatch.setattr(workers, "PAUSE_AFTER_S", 0.0)
    dpprof.DataParallel(nn.Linear(4, 4), W(2))(torch.randn(8, 4))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        torch.randn(512, 512) @ torch.randn(512, 512)  # the caller's helper threads start, and stay
        ctx = multiprocessing.get_context("fork")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_forward_on_workers_in_child, args=(child,))
        proc.start()
    finally:
        torch.set_num_threads(threads)
    proc.join(60)
    if proc.is_alive():
        proc.kill()
        pytest.fail("the forked child's forward on CPU workers never returned")
    assert proc.exitcode == 0 and parent.recv() is True


_THREAD_SHARE_SCRIPT = """
import torch, dpprof
from torch import nn

torch.set_num_threads(4)
asked = []

class Counts(nn.Linear):
    ask = False

    def forward(self, x):
        if Counts.ask:
            asked.append(torch.get_num_threads())  # on the replica's worker
        return super().forward(x)

net = dpprof.DataParallel(Counts(4, 4), dpprof.cpu_devices(2))
net(torch.randn(8, 4))  # the workers' first call: every op too small to run in parallel
Counts.ask = True
net(torch.randn(8, 4)).sum().backward()
print(sorted(asked), torch.get_num_threads())
"""


def test_each_worker_keeps_its_share_of_the_intra_op_threads():
    # two workers of a caller with 4 intra-op threads run with 2 each, also when their first call ran
    # no op in parallel (torch would then set a worker's count to the caller's on its first parallel
    # op), and the caller keeps its 4; a fresh process, so that no earlier test has started the workers
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _THREAD_SHARE_SCRIPT], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[0] == "[2, 2] 4"


_RELEASE_SCRIPT = """
import os, sys, time
import torch
import dpprof.parallel.workers as W

if W._omp_pause is None or not os.path.isdir("/proc/self/task"):
    print("no omp_pause_resource_all or no /proc")
    sys.exit(0)
torch.set_num_threads(2)
W.PAUSE_AFTER_S = 0.05  # calls of 0.1 s count as long; hand-offs of nothing stay short on a loaded machine
x = torch.randn(1 << 20)


def threads(expect=None):
    # the caller's helper leaves the process just after omp_pause_resource_all returns
    for _ in range(100):
        n = len(os.listdir("/proc/self/task"))
        if expect is None or n == expect:
            break
        time.sleep(0.02)
    return n


def short():
    return None


def long():
    time.sleep(0.1)


for _ in range(3):
    W.run_on_workers([0, 1], [short, short])  # the workers started, and three short calls
x.add_(1.0)  # 1M elements: torch adds with both intra-op threads, the caller's OpenMP helper among them
with_helper = threads()
W.run_on_workers([0, 1], [short, short])
after_short = threads()
for _ in range(3):
    W.run_on_workers([0, 1], [long, long])
x.add_(1.0)
kept = threads()
W.run_on_workers([0, 1], [short, short])  # follows three long calls: the helper is released first
released = threads(with_helper - 1)
x.add_(1.0)  # and started again by the caller's next parallel op
print(with_helper, after_short, kept, released, threads(with_helper))
"""


def test_the_caller_releases_its_openmp_helpers_before_a_call_that_follows_long_ones():
    # the caller's OpenMP helper spins for milliseconds after each of the caller's parallel ops, on
    # the cores the workers need: a call after long calls releases it, one after short calls does not
    # (starting it again would cost more than its spin); a fresh process, so that no other thread
    # shares the count
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _RELEASE_SCRIPT], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    if done.stdout.startswith("no "):
        pytest.skip(done.stdout.strip())
    with_helper, after_short, kept, released, again = map(int, done.stdout.split())
    assert after_short == kept == again == with_helper
    assert released == with_helper - 1


@contextmanager
def _intra_op_threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("features", [4, 256])  # 256 x 256: a copy torch makes with several threads
@pytest.mark.parametrize("grad", [True, False])
def test_a_data_parallel_inside_a_replica_runs_on_threads_of_its_own(features, grad):
    # the workers are busy with the outer call: the inner one (its forward, and without grad its
    # replicas' large copies too) must not wait for them. Run on a thread of its own, so that a
    # deadlock fails the test rather than hanging the suite.
    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Linear(features, features)
            # a replica's parameters are plain attributes, which the inner replicate does not copy;
            # its buffers it copies
            self.inner.register_buffer("table", torch.randn(features, features))

        def forward(self, x):
            return dpprof.data_parallel(self.inner, x, W(2))

    torch.manual_seed(0)
    outer = Outer()
    x = torch.randn(8, features)
    result = {}

    def call() -> None:
        # 4 threads: each worker's share is 2, so the inner call, on a worker, would copy in parallel
        with _intra_op_threads(4), torch.set_grad_enabled(grad):
            result["out"] = dpprof.DataParallel(outer, W(2))(x)

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(120)
    assert not thread.is_alive(), "the inner DataParallel waited on the busy workers"
    with torch.no_grad():
        torch.testing.assert_close(result["out"], outer.inner(x))


def _replica_tensors(replica: nn.Module) -> dict[str, torch.Tensor]:
    """A replica's parameters (plain attributes, kept in _former_parameters) and buffers, by qualified name."""
    out = {}
    for prefix, m in replica.named_modules():
        for key, t in chain(m._former_parameters.items(), m._buffers.items()):
            if t is not None:
                out[f"{prefix}.{key}" if prefix else key] = t
    return out


@pytest.mark.parametrize("features, on_workers", [(8, False), (256, True)])
def test_no_grad_replicas_make_large_copies_on_their_own_workers(features, on_workers, monkeypatch):
    # a parallel copy on the calling thread leaves its OpenMP helpers spinning on the cores the
    # workers need next: without grad, a replica's copies large enough for torch to make with
    # several threads (256 x 256 = 65,536 elements) are made on that replica's worker; small
    # ones stay on the calling thread, where a hand-off would cost more than the copy
    replicate_module = importlib.import_module("dpprof.parallel.replicate")
    real = replicate_module.run_on_workers
    made_on: list[str] = []

    def noting(indices, tasks, kind=None):
        def where(task):
            def run():
                made_on.append(threading.current_thread().name)
                return task()
            return run
        return real(indices, [where(t) for t in tasks], kind)

    monkeypatch.setattr(replicate_module, "run_on_workers", noting)
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(features, features), nn.BatchNorm1d(features))
    x = torch.randn(6, features)
    with _intra_op_threads(2), torch.no_grad():
        replicas = dpprof.replicate(module, W(2), detach=True)
    assert sorted(made_on) == (["dpprof-cpu:0", "dpprof-cpu:1"] if on_workers else [])
    # replica 0 shares the module's tensors, replica 1 holds equal copies of its own; none takes part in autograd
    for name, t in chain(module.named_parameters(), module.named_buffers()):
        first, second = (_replica_tensors(r)[name] for r in replicas)
        assert first.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
        assert second.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()
        assert torch.equal(second, t)
        assert not second.requires_grad and second.grad_fn is None
    module.eval()
    with _intra_op_threads(2), torch.no_grad():
        torch.testing.assert_close(dpprof.DataParallel(module, W(2))(x), module(x))
    assert len(made_on) == (4 if on_workers else 0)  # the forward's replicate went the same way


# the functional form

@pytest.mark.parametrize(
    "device_ids, output_device",
    [
        (W(2), None),
        (("cpu:0", "cpu:1"), None),
        (["cpu:1", "cpu:0"], None),
        (W(2), torch.device("cpu", 0)),
        (W(3), "cpu:2"),
        (["cpu:0"], None),
    ],
)
def test_data_parallel_function_matches_the_plain_module(device_ids, output_device):
    """torch's test_data_parallel / test_data_parallel_small_back / test_data_parallel_device_args."""
    module = seeded(linear)
    plain = copy.deepcopy(module)
    x = torch.randn(20, 10, dtype=DOUBLE, requires_grad=True)
    out = dpprof.data_parallel(module, x, device_ids, output_device=output_device)
    expected = plain(x)
    assert_close(out, expected)
    out.sum().backward()
    expected.sum().backward()
    assert_same_grads(module, plain)


def test_data_parallel_function_scatters_module_kwargs():
    module = seeded(KwargsNet)
    x = torch.randn(9, 10, dtype=DOUBLE)
    out = dpprof.data_parallel(module, None, W(3), module_kwargs={"input": {"data": x, "unused": ()}})
    assert_close(out, module.l(x))
    assert len(module.unused_seen) == 3


@needs_no_gpu
def test_data_parallel_function_without_device_ids_and_gpu_raises():
    with pytest.raises(RuntimeError):
        dpprof.data_parallel(nn.Linear(3, 3), torch.randn(2, 3))


# replicate and parallel_apply

@pytest.mark.parametrize("devices", [tuple(W(2)), W(2), W(3)], ids=["tuple", "list", "three"])
def test_replicate_gives_equal_differentiable_replicas(devices):
    """torch's test_replicate, plus where the replicas' gradients go."""
    torch.manual_seed(0)
    module = nn.Linear(10, 5).to(DOUBLE)
    x = torch.randn(2, 10, dtype=DOUBLE)
    expected = module(x)
    replicas = dpprof.replicate(module, devices)
    assert len(replicas) == len(devices)
    for replica in replicas:
        assert replica is not module
        assert list(replica.parameters()) == []  # as in torch: replicas hold non-leaf copies
        assert set(replica._former_parameters) == {"weight", "bias"}
        assert replica.weight.requires_grad and not replica.weight.is_leaf
        assert torch.equal(replica.weight, module.weight)
        assert_close(replica(x), expected)
    module.zero_grad()
    sum(r(x).sum() for r in replicas).backward()
    ref = copy.deepcopy(module)
    ref.zero_grad()
    (len(devices) * ref(x).sum()).backward()
    assert_same_grads(module, ref)


def test_replicate_detached_gives_leaves_without_grad():
    module = nn.Linear(4, 2)
    for replica in dpprof.replicate(module, W(2), detach=True):
        assert not replica.weight.requires_grad and replica.weight.grad_fn is None
        assert torch.equal(replica.weight, module.weight)


@pytest.mark.parametrize("devices", [tuple(W(2)), W(3)], ids=["tuple", "three"])
def test_replicate_shares_buffers_with_replica_zero_only(devices):
    """torch's test_replicate_buffers: replica 0 shares storage, the others hold copies."""
    net = nn.Module()
    net.bn = nn.BatchNorm2d(10)
    net.bn.running_mean.normal_()
    replicas = dpprof.replicate(net, devices)
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        original = getattr(net.bn, name)
        ptr = original.untyped_storage().data_ptr()
        for j, replica in enumerate(replicas):
            buf = getattr(replica.bn, name)
            assert torch.equal(buf, original)
            assert (buf.untyped_storage().data_ptr() == ptr) is (j == 0), (name, j)


@pytest.mark.parametrize("detach", [False, True])
@pytest.mark.parametrize("devices", [W(2), W(3)], ids=["two", "three"])
def test_replicas_after_the_first_hold_copies_of_the_parameters(devices, detach):
    """As torch's Broadcast gives each GPU its own copy: replica 0 shares the module's storage, the
    others hold copies, so an in-place change to the module after replicate shows in replica 0 only."""
    torch.manual_seed(0)
    module = nn.Linear(6, 3).to(DOUBLE)
    replicas = dpprof.replicate(module, devices, detach=detach)
    ptr = module.weight.untyped_storage().data_ptr()
    for j, replica in enumerate(replicas):
        assert (replica.weight.untyped_storage().data_ptr() == ptr) is (j == 0), j
        assert torch.equal(replica.weight, module.weight)
    with torch.no_grad():
        module.weight.add_(1.0)
    assert [torch.equal(r.weight, module.weight) for r in replicas] == [True] + [False] * (len(devices) - 1)


@pytest.mark.parametrize("devices", [W(2), W(3)], ids=["two", "three"])
def test_gradients_through_copied_replicas_are_the_plain_modules(devices):
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).to(DOUBLE)
    ref = copy.deepcopy(module)
    x = torch.randn(3 * len(devices), 6, dtype=DOUBLE)
    replicas = dpprof.replicate(module, devices)
    sum(r(c).pow(2).sum() for r, c in zip(replicas, x.chunk(len(devices)))).backward()
    ref(x).pow(2).sum().backward()
    assert_same_grads(module, ref)


@pytest.mark.parametrize("detach", [False, True])
def test_replicas_can_be_saved(detach):
    """torch's test_save_replica_module (gh-37182)."""
    module = nn.Linear(8, 8)
    replicas = dpprof.replicate(module, W(2), detach=detach)
    buffer = io.BytesIO()
    torch.save(replicas, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    x = torch.randn(3, 8)
    for replica in loaded:
        assert_close(replica(x), module(x))


@pytest.mark.parametrize("devices", [W(2), None], ids=["cpu-workers", "from-inputs"])
def test_parallel_apply(devices):
    """torch's test_parallel_apply: inputs as tuples of arguments or as single arguments."""
    torch.manual_seed(0)
    l1, l2 = nn.Linear(10, 5), nn.Linear(10, 5)
    i1, i2 = torch.randn(2, 10), torch.randn(2, 10)
    expected = (l1(i1), l2(i2))
    for inputs in [((i1,), (i2,)), (i1, i2)]:
        outputs = dpprof.parallel_apply((l1, l2), inputs, None, devices)
        assert len(outputs) == 2
        for out, want in zip(outputs, expected):
            assert_close(out, want)


def test_parallel_apply_autocast():
    """torch's test_parallel_apply_autocast, with bfloat16 CPU autocast."""
    torch.manual_seed(0)
    l1, l2 = nn.Linear(10, 5), nn.Linear(10, 5)
    i1, i2 = torch.randn(2, 10), torch.randn(2, 10)
    with _autocast_bf16():
        expected = (l1(i1), l2(i2))
    for inputs in [((i1,), (i2,)), (i1, i2)]:
        with _autocast_bf16():
            outputs = dpprof.parallel_apply((l1, l2), inputs, None, W(2))
        for out, want in zip(outputs, expected):
            assert out.dtype is torch.bfloat16
            assert_close(out, want)


def test_parallel_apply_runs_each_module_in_its_own_thread_with_its_kwargs():
    seen = []

    def fn(x, *, k):
        seen.append((threading.current_thread(), k))
        return x + k

    xs = [torch.zeros(1), torch.ones(1), torch.full((1,), 2.0)]
    outputs = dpprof.parallel_apply([fn] * 3, [(x,) for x in xs], [{"k": 10}, {"k": 20}, {"k": 30}], W(3))
    assert [o.item() for o in outputs] == [10.0, 21.0, 32.0]
    threads = [t for t, _ in seen]
    assert len(set(map(id, threads))) == 3 and threading.main_thread() not in threads


@pytest.mark.parametrize(
    "inputs, kwargs_tup, devices",
    [
        ([(torch.ones(1),)], None, None),
        ([(torch.ones(1),)] * 2, [{}], None),
        ([(torch.ones(1),)] * 2, None, W(3)),
    ],
    ids=["inputs", "kwargs", "devices"],
)
def test_parallel_apply_checks_lengths(inputs, kwargs_tup, devices):
    with pytest.raises(AssertionError, match="is not equal to the number of"):
        dpprof.parallel_apply([nn.Identity(), nn.Identity()], inputs, kwargs_tup, devices)


# bad input: clear errors, nothing changed

class Tracked(nn.Module):
    """Linear + BatchNorm (buffers that a forward would move) with a call counter."""

    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(3, 3)
        self.bn = nn.BatchNorm1d(3)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.bn(self.l(x))


BAD_CONSTRUCTION = [
    pytest.param([], None, ValueError, "empty", id="empty"),
    pytest.param(["cpu:0", "cpu:0"], None, ValueError, "twice", id="duplicate"),
    pytest.param(["cpu:0", "cuda:0"], None, ValueError, "mixes CPU workers and CUDA", id="cpu-with-cuda"),
    pytest.param(["cpu:0", "cpu:1"], "cpu:5", ValueError, "not one of the CPU workers", id="output-elsewhere"),
    pytest.param(["cpu:0", "cpu:1"], "cuda:0", ValueError, "not of the same kind", id="output-cuda"),
    pytest.param(["cpu"], None, ValueError, "names no worker", id="cpu-without-index"),
    pytest.param("cpu:0", None, TypeError, "must be a list", id="bare-string"),
]
BAD_CONSTRUCTION_NO_GPU = [
    pytest.param(["cuda:0"], None, ValueError, "does not exist", id="missing-cuda-string"),
    pytest.param([0], None, ValueError, "does not exist", id="missing-cuda-int"),
    pytest.param([0, 1], 0, ValueError, "does not exist", id="missing-cuda-pair"),
]


def _assert_rejected(device_ids, output_device, error, match):
    torch.manual_seed(0)
    module = Tracked()
    before = snapshot(module)
    with pytest.raises(error, match=match):
        dpprof.DataParallel(module, device_ids, output_device=output_device)
    with pytest.raises(error, match=match):
        dpprof.data_parallel(module, torch.randn(4, 3), device_ids, output_device=output_device)
    assert module.calls == 0
    assert_unchanged(module, before)


@pytest.mark.parametrize("device_ids, output_device, error, match", BAD_CONSTRUCTION)
def test_bad_device_ids_raise_clearly_and_change_nothing(device_ids, output_device, error, match):
    _assert_rejected(device_ids, output_device, error, match)


@needs_no_gpu
@pytest.mark.parametrize("device_ids, output_device, error, match", BAD_CONSTRUCTION_NO_GPU)
def test_a_missing_cuda_device_raises_value_error(device_ids, output_device, error, match):
    _assert_rejected(device_ids, output_device, error, match)


@pytest.mark.parametrize(
    "dim, shape",
    [(2, (4, 3)), (-3, (4, 3)), (5, (4, 3))],
)
@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("recording", [False, True], ids=["plain", "recorded"])
def test_scatter_dim_out_of_range_names_the_shape_and_changes_nothing(dim, shape, workers, recording):
    # recorded too: the step's batch is noted before the scatter, and must not raise an error of its own first
    torch.manual_seed(0)
    module = Tracked()
    before = snapshot(module)
    x = torch.randn(*shape)
    with dpprof.record(name="dim out of range") if recording else nullcontext():
        with pytest.raises(IndexError, match=re.escape(str(shape))):
            dpprof.DataParallel(module, W(workers), dim=dim)(x)
        with pytest.raises(IndexError, match=re.escape(str(shape))):
            dpprof.data_parallel(module, x, W(workers), dim=dim)
    assert module.calls == 0
    assert_unchanged(module, before)



@pytest.mark.parametrize("workers", [1, 2, 3])
@pytest.mark.parametrize("recording", [False, True], ids=["plain", "recorded"])
def test_a_replica_modifying_its_input_in_place_leaves_the_callers_batch_alone(workers, recording):
    # torch's Scatter hands each device a copy of its chunk: an in-place first layer neither changes the batch the
    # caller passed nor meets autograd's "Output 0 of Split is a view and is being modified inplace"
    net = dpprof.DataParallel(nn.ReLU(inplace=True), W(workers))
    x = torch.randn(5, 3, dtype=DOUBLE)
    before = x.clone()
    leaf = torch.randn(5, 3, dtype=DOUBLE, requires_grad=True)
    with dpprof.record(name="in place") if recording else nullcontext():
        out = net(x)
        out_grad = net(leaf * 2)
        out_grad.sum().backward()
    assert torch.equal(x, before)
    assert torch.equal(out, before.relu())
    assert torch.equal(out_grad, (leaf * 2).relu())
    assert torch.equal(leaf.grad, (leaf > 0).to(DOUBLE) * 2)


# the wrapper itself

def test_it_is_a_torch_data_parallel_around_the_module():
    module = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    net = dpprof.DataParallel(module, W(2))
    assert isinstance(net, nn.DataParallel)
    assert net.module is module
    # device_ids are indices, as torch keeps them; output_device a device tensor.to takes (an int would mean CUDA)
    assert net.device_ids == [0, 1] and net.output_device == torch.device("cpu", 0) and net.dim == 0
    keys = list(net.state_dict())
    assert keys and all(k.startswith("module.") for k in keys)
    assert keys == list(nn.DataParallel(copy.deepcopy(module)).state_dict())
    assert [p for p in net.parameters()] == list(module.parameters())
    # a plain checkpoint loads back through the wrapper's "module." prefix
    other = copy.deepcopy(module)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1)
    net.load_state_dict({f"module.{k}": v for k, v in other.state_dict().items()})
    assert_close(module[0].weight, other[0].weight)


@pytest.mark.parametrize("output_device, expected", [(None, torch.device("cpu", 0)), ("cpu:1", torch.device("cpu", 1)),
                                                     (-1, torch.device("cpu"))])
def test_cpu_workers_output_device_is_where_tensor_to_puts_the_output(output_device, expected):
    """On CPU workers net.output_device is a torch.device: x.to(net.output_device) stays on the CPU (an int would be
    a CUDA device). -1 is torch's "gather onto the host (CPU)": accepted, outputs and gradients as the plain
    module's, with no deprecation warning of torch's comm.gather (which -1 as a gather target gives)."""
    module = seeded(linear)
    plain = copy.deepcopy(module)
    x = torch.randn(20, 10, dtype=DOUBLE)
    net = dpprof.DataParallel(module, W(2), output_device=output_device)
    assert net.output_device == expected and net.src_device_obj == torch.device("cpu")
    assert x.to(net.output_device).device == x.to(net.src_device_obj).device == torch.device("cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = net(x)
        functional = dpprof.data_parallel(copy.deepcopy(plain), x, W(3), output_device=output_device)
    expected_out = plain(x)
    assert_close(out, expected_out)
    assert_close(functional, expected_out)
    out.sum().backward()
    expected_out.sum().backward()
    assert_same_grads(module, plain)


def test_a_balanced_criterion_reduces_onto_the_host_with_output_device_minus_one():
    torch.manual_seed(0)
    module = seeded(linear)
    x, y = torch.randn(12, 10, dtype=DOUBLE), torch.randn(12, 5, dtype=DOUBLE)
    model = dpprof.DataParallelModel(module, W(3), output_device=-1)
    criterion = dpprof.DataParallelCriterion(nn.MSELoss(), W(3), output_device=-1)
    assert model.output_device == criterion.output_device == torch.device("cpu")
    assert_close(criterion(model(x), y), nn.MSELoss()(module(x), y))


@needs_no_gpu
def test_without_device_ids_and_gpu_the_module_runs_directly():
    """As in torch: no device to spread over, so forward is the module's own call."""
    torch.manual_seed(0)
    module = Logged(seeded(linear))
    plain = copy.deepcopy(module)
    net = dpprof.DataParallel(module)
    assert net.device_ids == [] == nn.DataParallel(copy.deepcopy(module)).device_ids
    x = torch.randn(7, 10, dtype=DOUBLE)
    out = net(x)
    expected = plain(x)
    assert_close(out, expected)
    assert module.calls == [(threading.main_thread(), 7)]
    out.sum().backward()
    expected.sum().backward()
    assert_same_grads(module, plain)


# recording changes nothing

@pytest.mark.parametrize("workers", [1, 3])
def test_recording_does_not_change_outputs_or_gradients(workers):
    module = seeded(conv_net)
    plain = copy.deepcopy(module)
    net = dpprof.DataParallel(module, W(workers))
    x = torch.randn(6, 3, 8, 8, dtype=DOUBLE)
    with dpprof.record(name="parity") as run:
        out = net(x)
        out.sum().backward()
    expected = plain(x)
    expected.sum().backward()
    assert_close(out, expected)
    assert_same_grads(module, plain)
    phases = run.frames()["phases"]
    applied = phases[phases["phase"] == "apply"]
    assert sorted(applied["device"]) == [f"cpu:{i}" for i in range(workers)]
    assert phases["device_duration_ms"].isna().all()  # CPU workers have no device clock


def test_dropout_on_several_cpu_workers_is_said_once_where_the_call_is(tmp_path):
    """The CPU workers share the CPU's one random generator (each GPU has its own): a model with dropout trained on 2 of
    them is warned about once, at the caller's line, and the recorded run keeps the note; in eval mode, on one worker,
    or with p=0 nothing is said."""
    def calls(model, workers, train=True, steps=2):
        net = dpprof.DataParallel(model, device_ids=dpprof.cpu_devices(workers)).train(train)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(steps):
                net(torch.randn(8, 4))
        return [w for w in caught if "share the CPU's one generator" in str(w.message)]

    def dropping(p=0.1):
        return nn.Sequential(nn.Linear(4, 4), nn.Dropout(p))

    said = calls(dropping(), 2)
    assert len(said) == 1 and said[0].filename == __file__
    assert str(said[0].message).startswith("the model's Dropout(p=0.1) draws random numbers in its replicas on 2 CPU")
    assert calls(dropping(), 2, train=False) == [] and calls(dropping(), 1) == [] and calls(dropping(0.0), 2) == []
    with dpprof.record(name="dropout", reports_dir=tmp_path) as run:
        assert len(calls(dropping(), 2)) == 1
    notes = dpprof.load_run(run.id, tmp_path).notes["message"].tolist()
    assert sum("share the CPU's one generator" in n for n in notes) == 1

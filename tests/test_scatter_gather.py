"""dpprof.scatter, scatter_kwargs and gather on CPU workers, checked against torch's meaning.

Re-expresses torch's test_scatter_cpu / test_gather_cpu / test_gather_different_len_dicts
(test/distributed/test_data_parallel.py) for CPU workers. Where no tensor is involved,
torch's own functions run on a CPU-only machine too, so the result is compared with theirs.
"""
from __future__ import annotations

import re
import warnings
from collections import OrderedDict, namedtuple

import pytest
import torch
import torch.nn.parallel.scatter_gather as tnp
from torch.autograd import gradcheck, gradgradcheck
from torch.testing import assert_close

import dpprof
from dpprof.parallel.scatter_gather import check_scatter_dim

W = dpprof.cpu_devices
SCALAR_WARNING = (
    "Was asked to gather along dimension 0, but all input tensors were scalars; "
    "will instead unsqueeze and return a vector."
)
Pair = namedtuple("Pair", "a b")


# scatter

def test_scatter_splits_a_tensor_and_routes_gradients_back():
    """torch's _test_scatter: chunks equal the slices, and backward fills only the slice's rows."""
    x = torch.randn(4, 4).requires_grad_()
    result = dpprof.scatter(x, W(2))
    assert len(result) == 2
    assert_close(result[0], x[:2])
    assert_close(result[1], x[2:])
    assert all(r.device.type == "cpu" for r in result)
    grad = result[0].detach().clone().fill_(2)
    result[0].backward(grad)
    assert_close(x.grad[:2], grad)
    assert_close(x.grad[2:], torch.zeros_like(grad))


def test_scatter_is_twice_differentiable():
    x = torch.randn(4, 4, dtype=torch.double, requires_grad=True)
    assert gradcheck(lambda y: dpprof.scatter(y, W(2)), (x,))
    assert gradgradcheck(lambda y: dpprof.scatter(y, W(2)), (x,))


@pytest.mark.parametrize(
    "rows, workers, sizes",
    [
        (4, 2, [2, 2]),
        (20, 3, [7, 7, 6]),
        (5, 4, [2, 2, 1]),  # torch.chunk: fewer chunks than workers
        (10, 8, [2, 2, 2, 2, 2]),
        (3, 4, [1, 1, 1]),
        (1, 3, [1]),
    ],
)
def test_scatter_chunk_sizes_follow_torch_chunk(rows, workers, sizes):
    x = torch.arange(rows * 2.0).view(rows, 2)
    chunks = dpprof.scatter(x, W(workers))
    assert [c.shape[0] for c in chunks] == sizes
    assert_close(torch.cat(chunks), x)


@pytest.mark.parametrize("dim", [1, -1, 2, -2])
def test_scatter_along_other_dims_gives_contiguous_torch_chunks(dim):
    x = torch.randn(2, 5, 7)
    chunks = dpprof.scatter(x, W(3), dim=dim)
    expected = x.chunk(3, dim)
    assert len(chunks) == len(expected)
    for got, want in zip(chunks, expected):
        assert got.is_contiguous()
        assert torch.equal(got, want)


def test_scatter_keeps_container_types():
    x = torch.arange(12.0).view(6, 2)
    inputs = (x, [x, 7], {"k": x, "s": "label"}, Pair(x, None), OrderedDict(o=x))
    out = dpprof.scatter(inputs, W(3))
    assert isinstance(out, list) and len(out) == 3
    for i, per_device in enumerate(out):
        chunk = x.chunk(3)[i]
        assert isinstance(per_device, tuple) and len(per_device) == 5
        t, lst, dct, pair, odict = per_device
        assert torch.equal(t, chunk)
        assert isinstance(lst, list) and torch.equal(lst[0], chunk) and lst[1] == 7
        assert type(dct) is dict and torch.equal(dct["k"], chunk) and dct["s"] == "label"
        assert type(pair) is Pair and torch.equal(pair.a, chunk) and pair.b is None
        assert type(odict) is OrderedDict and torch.equal(odict["o"], chunk)


_SENTINEL = object()


@pytest.mark.parametrize(
    "obj",
    [
        (1, "a", None),
        [1, [2, 3], {"k": (4,)}],
        {"a": 1, "b": [None, "x"]},
        Pair(1, [2]),
        OrderedDict(z=1, a=2),
        (),
        [],
        {},
        None,
        3.5,
        "text",
        _SENTINEL,
    ],
    ids=lambda o: type(o).__name__,
)
def test_scatter_of_non_tensors_equals_torchs(obj):
    """With no tensor inside, torch's scatter runs on CPU too: the results must be identical."""
    ours = dpprof.scatter(obj, W(3))
    theirs = tnp.scatter(obj, [0, 1, 2])
    assert ours == theirs
    assert [type(o) for o in ours] == [type(o) for o in theirs]


def test_scatter_shares_non_container_objects_by_reference():
    ours = dpprof.scatter((_SENTINEL, []), W(3))
    assert all(per[0] is _SENTINEL for per in ours)
    assert all(type(per[1]) is list and per[1] == [] for per in ours)


@pytest.mark.parametrize(
    "inputs, kwargs",
    [
        ((1,), None),
        ((1,), {}),
        ((), {"a": 1}),
        (None, {"a": 1}),
        ((), None),
        ((1, "x"), {"a": 2, "b": [3]}),
        ((Pair(1, 2),), {"d": {"e": None}}),
    ],
)
def test_scatter_kwargs_of_non_tensors_equals_torchs(inputs, kwargs):
    """Padding of the shorter side with () or {} exactly as torch's scatter_kwargs does."""
    ours = dpprof.scatter_kwargs(inputs, kwargs, W(3))
    theirs = tnp.scatter_kwargs(inputs, kwargs, [0, 1, 2])
    assert ours == theirs
    assert isinstance(ours, tuple) and isinstance(ours[0], tuple) and isinstance(ours[1], tuple)


def test_scatter_kwargs_pads_kwargs_with_empty_dicts():
    x = torch.randn(5, 3)
    inputs, kwargs = dpprof.scatter_kwargs((x,), None, W(4))
    assert len(inputs) == 3 and kwargs == ({}, {}, {})
    assert [i[0].shape[0] for i in inputs] == [2, 2, 1]


def test_scatter_kwargs_pads_inputs_with_empty_tuples():
    x = torch.randn(5, 3)
    inputs, kwargs = dpprof.scatter_kwargs((), {"x": x}, W(4))
    assert inputs == ((), (), ())
    assert [k["x"].shape[0] for k in kwargs] == [2, 2, 1]


def test_scatter_kwargs_pads_positional_side_when_kwargs_have_more_chunks():
    """torch's rule: fewer positional chunks than keyword chunks → positional side gets ()."""
    inputs, kwargs = dpprof.scatter_kwargs((torch.randn(2, 3),), {"y": torch.randn(4, 3)}, W(4))
    assert len(inputs) == 4 and len(kwargs) == 4
    assert [len(i) for i in inputs] == [1, 1, 0, 0]
    assert [k["y"].shape[0] for k in kwargs] == [1, 1, 1, 1]


@pytest.mark.parametrize(
    "obj, dim, shape",
    [
        (torch.randn(4, 3), 2, "(4, 3)"),
        (torch.randn(4, 3), -3, "(4, 3)"),
        ((torch.randn(4), [torch.randn(4, 5, 6)]), 3, "(4,)"),
        ({"a": torch.randn(2, 2, 2)}, 5, "(2, 2, 2)"),
    ],
)
def test_scatter_dim_out_of_range_names_the_shape(obj, dim, shape):
    with pytest.raises(IndexError, match=re.escape(shape)):
        dpprof.scatter(obj, W(2), dim=dim)
    with pytest.raises(IndexError, match=re.escape(shape)):
        check_scatter_dim(obj, dim)


def test_a_0_dim_input_raises_what_torch_chunk_raises():
    """torch's scatter of a scalar reaches torch.chunk: RuntimeError "chunk expects at least a 1-dimensional tensor"."""
    with pytest.raises(RuntimeError, match="chunk expects at least a 1-dimensional tensor") as theirs:
        torch.tensor(1.0).chunk(2)
    with pytest.raises(type(theirs.value), match="chunk expects at least a 1-dimensional tensor: an input to scatter"):
        dpprof.scatter(torch.tensor(1.0), W(2))
    net = dpprof.DataParallel(torch.nn.Linear(1, 1), device_ids=W(2))
    with pytest.raises(RuntimeError, match="chunk expects at least a 1-dimensional tensor"):
        net(torch.tensor(1.0))


# gather

def test_gather_concatenates_and_splits_gradients_back():
    """torch's _test_gather on CPU workers."""
    inputs = (
        torch.randn(2, 4, requires_grad=True, dtype=torch.double),
        torch.randn(2, 4, requires_grad=True, dtype=torch.double),
    )
    result = dpprof.gather(inputs, torch.device("cpu", 0))
    assert result.size() == torch.Size([4, 4])
    assert_close(result[:2], inputs[0])
    assert_close(result[2:], inputs[1])
    grad = torch.randn(4, 4, dtype=torch.double)
    result.backward(grad)
    assert_close(inputs[0].grad, grad[:2])
    assert_close(inputs[1].grad, grad[2:])
    gathered = lambda x, y: dpprof.gather((x, y), torch.device("cpu", 0))  # noqa: E731
    assert gradcheck(gathered, inputs)
    assert gradgradcheck(gathered, inputs)


@pytest.mark.parametrize("workers", [2, 3])
def test_gather_of_scalars_returns_a_vector_and_warns(workers):
    inputs = tuple(torch.randn((), requires_grad=True, dtype=torch.double) for _ in range(workers))
    with pytest.warns(UserWarning, match=re.escape(SCALAR_WARNING)) as caught:
        result = dpprof.gather(inputs, torch.device("cpu", 0))
    assert [(str(w.message), w.filename) for w in caught if "scalars" in str(w.message)] == [(SCALAR_WARNING, __file__)]
    assert result.size() == torch.Size([workers])
    for i in range(workers):
        assert_close(result[i], inputs[i])
    grad = torch.randn(workers, dtype=torch.double)
    result.backward(grad)
    for i in range(workers):
        assert_close(inputs[i].grad, grad[i])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert gradcheck(lambda *xs: dpprof.gather(xs, torch.device("cpu", 0)), inputs)


def test_the_scalar_warning_names_the_callers_line_however_deep_the_scalars_lie():
    """It named a line of dpprof/parallel/scatter_gather.py (a fixed stacklevel), another one for a dict's scalars."""
    for outputs in ([torch.tensor(1.0), torch.tensor(2.0)], [{"loss": torch.tensor(1.0)}, {"loss": torch.tensor(2.0)}],
                    [(torch.ones(2), (torch.tensor(1.0),)), (torch.ones(2), (torch.tensor(2.0),))]):
        with pytest.warns(UserWarning, match=re.escape(SCALAR_WARNING)) as caught:
            dpprof.gather(outputs, torch.device("cpu", 0))
        assert [w.filename for w in caught] == [__file__]


def test_gather_of_scalars_along_dim_1_does_not_unsqueeze():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no scalar warning may fire
        with pytest.raises(RuntimeError):
            dpprof.gather((torch.tensor(1.0), torch.tensor(2.0)), torch.device("cpu", 0), dim=1)


def test_gather_dicts_of_different_length_raise():
    inputs = (
        {"a": torch.randn(1, 2)},
        {"b": torch.randn(1, 2), "a": torch.randn(1, 2)},
    )
    with pytest.raises(ValueError, match="same number of keys"):
        dpprof.gather(inputs, torch.device("cpu", 0))


def test_gather_keeps_nested_types():
    def out(t):
        return [t, (t.sin(), [t + 1]), OrderedDict(a=t, b=[t.cos()]), Pair(t, None), {"n": None}]

    a, b = torch.randn(2, 3), torch.randn(1, 3)
    result = dpprof.gather([out(a), out(b)], torch.device("cpu", 0))
    whole = torch.cat([a, b])
    expected = out(whole)
    assert isinstance(result, list)
    assert isinstance(result[1], tuple) and isinstance(result[1][1], list)
    assert type(result[2]) is OrderedDict and list(result[2]) == ["a", "b"]
    assert type(result[3]) is Pair and result[3].b is None
    assert result[4] == {"n": None}
    assert_close(result[0], expected[0])
    assert_close(result[1][0], expected[1][0])
    assert_close(result[1][1][0], expected[1][1][0])
    assert_close(result[2]["b"][0], expected[2]["b"][0])
    assert_close(result[3].a, expected[3].a)


@pytest.mark.parametrize("dim", [1, -1])
def test_gather_along_other_dims(dim):
    parts = [torch.randn(3, 2), torch.randn(3, 4), torch.randn(3, 1)]
    result = dpprof.gather(parts, torch.device("cpu", 1), dim=dim)
    assert torch.equal(result, torch.cat(parts, dim=1))


def test_gather_undoes_scatter():
    x = torch.randn(7, 3, 2)
    for dim in (0, 1, 2, -1):
        assert torch.equal(dpprof.gather(dpprof.scatter(x, W(3), dim), torch.device("cpu", 0), dim), x)


def test_gather_without_tensors_equals_torchs():
    outputs = [(None, [None], {"k": None}), (None, [None], {"k": None})]
    assert dpprof.gather(outputs, torch.device("cpu", 0)) == tnp.gather(outputs, 0)

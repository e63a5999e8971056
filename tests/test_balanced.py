"""DataParallelModel and DataParallelCriterion on CPU workers: the plain criterion's loss and gradients,
and the output device no longer holding every output."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import dpprof
from dpprof.cli import main
from dpprof.workloads import build_workload, train


class TwoHeads(nn.Module):
    """Returns a tuple: class logits and a regression output."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(6, 8)
        self.cls = nn.Linear(8, 4)
        self.reg = nn.Linear(8, 2)

    def forward(self, x):
        h = torch.relu(self.body(x))
        return self.cls(h), self.reg(h)


class TwoTargetLoss(nn.Module):
    """A criterion over tuple outputs and two targets."""

    reduction = "mean"

    def forward(self, outputs, labels, values):
        logits, reg = outputs
        return nn.functional.cross_entropy(logits, labels) + nn.functional.mse_loss(reg, values)


def _pair(model_fn, criterion_fn, workers):
    torch.manual_seed(0)
    model, ref = model_fn(), model_fn()
    ref.load_state_dict(model.state_dict())
    devices = dpprof.cpu_devices(workers)
    return (dpprof.DataParallelModel(model, devices), dpprof.DataParallelCriterion(criterion_fn(), devices),
            model, ref, criterion_fn())


def _assert_same_loss_and_grads(loss, expected, model, ref):
    """The balanced loss equals the plain one, and so do the gradients both leave in their modules."""
    assert torch.allclose(loss, expected, atol=1e-6)
    loss.backward()
    expected.backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-6), name


@pytest.mark.parametrize("batch, workers, chunks", [(5, 4, [2, 2, 1]), (10, 3, [4, 4, 2]), (12, 3, [4, 4, 4]),
                                                    (7, 1, [7])])
@pytest.mark.parametrize("criterion_fn", [nn.CrossEntropyLoss, lambda: nn.CrossEntropyLoss(reduction="sum")])
def test_tensor_outputs_equal_the_plain_criterion_on_the_whole_batch(batch, workers, chunks, criterion_fn):
    net, crit, model, ref, plain = _pair(lambda: nn.Linear(6, 4), criterion_fn, workers)
    x, y = torch.randn(batch, 6), torch.randint(0, 4, (batch,))
    outputs = net(x)
    assert isinstance(outputs, list) and [o.shape[0] for o in outputs] == chunks
    loss = crit(outputs, y)
    expected = plain(ref(x), y)
    _assert_same_loss_and_grads(loss, expected, model, ref)


def test_class_weights_and_ignored_targets_still_give_the_whole_batch_mean():
    weight = torch.tensor([1.0, 3.0, 0.5, 2.0])
    net, crit, model, ref, plain = _pair(lambda: nn.Linear(6, 4),
                                         lambda: nn.CrossEntropyLoss(weight=weight, ignore_index=1), 3)
    x = torch.randn(10, 6)
    y = torch.tensor([0, 2, 3, 1, 1, 0, 2, 1, 3, 1])  # chunk 2 (of 2) ignores one of its targets
    loss = crit(net(x), y)
    expected = plain(ref(x), y)
    _assert_same_loss_and_grads(loss, expected, model, ref)


def test_a_chunk_whose_targets_are_all_ignored_drops_out():
    net, crit, model, ref, plain = _pair(lambda: nn.Linear(6, 4), lambda: nn.CrossEntropyLoss(ignore_index=1), 2)
    x, y = torch.randn(6, 6), torch.tensor([0, 2, 3, 1, 1, 1])
    assert torch.allclose(crit(net(x), y), plain(ref(x), y), atol=1e-6)


def test_tuple_outputs_and_several_targets():
    net, crit, model, ref, plain = _pair(TwoHeads, TwoTargetLoss, 3)
    x, labels, values = torch.randn(11, 6), torch.randint(0, 4, (11,)), torch.randn(11, 2)
    outputs = net(x)
    assert all(isinstance(o, tuple) for o in outputs)
    loss = crit(outputs, labels, values)
    expected = plain(ref(x), labels, values)
    _assert_same_loss_and_grads(loss, expected, model, ref)


def test_reduction_none_concatenates_per_sample_losses():
    net, crit, model, ref, plain = _pair(lambda: nn.Linear(6, 4), lambda: nn.CrossEntropyLoss(reduction="none"), 3)
    x, y = torch.randn(10, 6), torch.randint(0, 4, (10,))
    assert torch.allclose(crit(net(x), y), plain(ref(x), y), atol=1e-6)


def test_targets_split_differently_from_the_outputs_is_a_clear_error():
    net, crit, *_ = _pair(lambda: nn.Linear(6, 4), nn.CrossEntropyLoss, 3)
    outputs = net(torch.randn(10, 6))
    with pytest.raises(ValueError, match=r"split 4\+4\+2 = 10 along dim 0, but a target of shape \(9,\) holds 9"):
        crit(outputs, torch.randint(0, 4, (9,)))


def test_more_outputs_than_devices_is_a_clear_error():
    net = dpprof.DataParallelModel(nn.Linear(6, 4), dpprof.cpu_devices(3))
    crit = dpprof.DataParallelCriterion(nn.CrossEntropyLoss(), dpprof.cpu_devices(2))
    with pytest.raises(ValueError, match="3 outputs but only 2 devices"):
        crit(net(torch.randn(9, 6)), torch.randint(0, 4, (9,)))


def test_the_criterion_records_its_phases_in_the_models_step():
    net, crit, *_ = _pair(lambda: nn.Linear(6, 4), nn.CrossEntropyLoss, 3)
    with dpprof.record(name="balanced phases") as run:
        for _ in range(3):
            crit(net(torch.randn(10, 6)), torch.randint(0, 4, (10,))).backward()
    stored = dpprof.load_run(run.path)
    assert stored.steps["step"].tolist() == [0, 1, 2] and stored.steps["forward_calls"].tolist() == [2, 2, 2]
    assert stored.steps["batch_size"].tolist() == [10, 10, 10]  # the targets are not a second batch
    step0 = stored.phases.query("step == 0")
    assert step0.groupby("call")["phase"].apply(sorted).to_dict() == {
        0: ["apply", "apply", "apply", "backward", "parallel_apply", "replicate", "scatter"],
        1: ["apply", "apply", "apply", "parallel_apply", "reduce", "replicate", "scatter"]}
    mem = stored.memory.query("step == 0 and call == 1").set_index("device").sort_index()
    assert mem["input_bytes"].tolist() == [4 * 8, 4 * 8, 2 * 8]  # each device's int64 targets only


def test_on_one_device_the_criterion_is_the_loss_phase_and_the_advisor_reads_the_run(tmp_path):
    """One device: the criterion runs whole where the outputs are, recorded as the loss (as MeasuredLoss's), not as a
    second DataParallel apply; show's apply is the model's alone and the advisor predicts the recorded set-up."""
    from dpprof.advise.measured import measure
    run = train(build_workload("tutorial-linear", 8), dpprof.cpu_devices(1), steps=6, balanced=True,
                reports_dir=str(tmp_path))
    stored = dpprof.load_run(run.path)
    per_step = stored.phases.groupby("step")["phase"].apply(sorted)
    assert all(p.count("apply") == 1 and p.count("loss") == 1 for p in per_step), per_step
    m = measure(stored)  # it refused: "runs DataParallel 2 times a step"
    loss = stored.phases[stored.phases["phase"] == "loss"]["duration_ms"]
    assert 0 < loss.min() <= m.parts_ms["loss"] <= loss.max()  # the typical steps' mean loss
    assert m.loss_apply_ms == {"cpu:0": m.parts_ms["loss"]}  # the criterion's share on its one device: all of it


def _held(run, device):
    mem = dpprof.load_run(run.path).memory
    cols = ["input_bytes", "output_bytes", "activation_bytes", "gathered_bytes", "param_bytes", "buffer_bytes"]
    return mem[mem["device"] == device].groupby("step")[cols].sum()


def test_the_output_device_no_longer_holds_every_output():
    plain = train(build_workload("seg-fcn", 8), dpprof.cpu_devices(2), steps=2)
    balanced = train(build_workload("seg-fcn", 8), dpprof.cpu_devices(2), steps=2, balanced=True)
    logits = 8 * 21 * 96 * 96 * 4  # the whole batch's per-pixel logits, float32
    plain0, plain1 = _held(plain, "cpu:0"), _held(plain, "cpu:1")
    assert plain0["gathered_bytes"].tolist() == [logits, logits] and plain1["gathered_bytes"].eq(0).all()
    bal0, bal1 = _held(balanced, "cpu:0"), _held(balanced, "cpu:1")
    assert bal0["gathered_bytes"].eq(0).all()
    # plain: cpu:0 holds the gathered logits and the whole-batch loss; balanced: each holds its half
    assert plain0.sum(axis=1).iloc[-1] > plain1.sum(axis=1).iloc[-1] + logits
    assert bal0.sum(axis=1).tolist() == bal1.sum(axis=1).tolist()
    assert bal0.sum(axis=1).iloc[-1] < plain0.sum(axis=1).iloc[-1] - logits / 2


def test_profile_balanced_from_the_command_line():
    assert main(["profile", "tutorial-linear", "--steps", "4", "--devices", "cpu:3", "--balanced", "--quiet"]) == 0
    run = dpprof.load_run(dpprof.list_runs().loc[0, "id"])
    assert run.meta["name"] == "tutorial-linear (balanced)" and run.meta["workload_args"]["balanced"] is True
    assert "reduce" in set(run.phases["phase"]) and "gather" not in set(run.phases["phase"])

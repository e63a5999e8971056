"""DataParallelModel and DataParallelCriterion: the loss on every device, nothing gathered.

DataParallel gathers every replica's outputs onto one device and computes the loss there, so
that device holds the whole batch's outputs and the loss's saved tensors. These two classes
(PyTorch-Encoding's design) keep each device's outputs where they are and compute each
device's share of the loss there; only one scalar per device travels. Unlike the original:
plain-tensor outputs work, a mean-reduced loss equals the plain criterion on the whole batch
even with unequal chunks, and the one-device path passes the target as the target.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from dpprof.device_ids import DeviceLike, resolve_devices
from dpprof.parallel.data_parallel import HOST_LABEL, DataParallel, device_index
from dpprof.parallel.probe import ForwardProbe, MeasuredReplica, end_after_error, iter_tensors
from dpprof.parallel.scatter_gather import gather, scatter_sized
from dpprof.recording import current_run

__all__ = ["DataParallelModel", "DataParallelCriterion", "MeasuredLoss"]


class DataParallelModel(DataParallel):
    """dpprof.DataParallel that returns the per-device outputs un-gathered: a list, one per device used.

    Example:
        >>> net = dpprof.DataParallelModel(model, device_ids=[0, 1, 2])
        >>> criterion = dpprof.DataParallelCriterion(nn.CrossEntropyLoss(), device_ids=[0, 1, 2])
        >>> loss = criterion(net(x), y)
    """

    def forward(self, *inputs: Any, **kwargs: Any) -> list[Any]:
        output = super().forward(*inputs, **kwargs)
        return output if len(self.device_ids) > 1 else [output]

    def gather(self, outputs: Any, output_device: int | torch.device) -> list[Any]:
        return list(outputs)  # nothing is gathered: that is the point


def _split_size(output: Any, dim: int) -> int:
    first = next(iter_tensors(output), None)
    if first is None or first.dim() == 0:
        raise ValueError("DataParallelCriterion needs each device's output to hold a tensor with a batch "
                         f"dimension {dim}, got {type(output).__name__}")
    return first.size(dim)


def _mean_weight(criterion: nn.Module, targets: tuple[Any, ...], chunk: int) -> float:
    """What one device's mean loss averages over: samples, or for class-index losses the targets'
    class weights with ignore_index left out (so the weighted result equals the whole-batch mean)."""
    if isinstance(criterion, (nn.CrossEntropyLoss, nn.NLLLoss)) and targets:
        t = targets[0]
        if isinstance(t, torch.Tensor) and not t.is_floating_point():
            keep = t != criterion.ignore_index
            if criterion.weight is not None:
                return float(criterion.weight.to(t.device)[t[keep]].sum())
            return float(keep.sum())
    return float(chunk)


class DataParallelCriterion(DataParallel):
    """Compute ``criterion(outputs, *targets)`` on every device and reduce the losses onto output_device.

    ``outputs`` is DataParallelModel's list (a plain tensor or a tuple per device). The targets are
    split exactly as the inputs were (each device's output size along ``dim``). The per-device losses
    are combined as the criterion's ``reduction`` says: "mean" weights each device by what it averaged
    over (its chunk size, or its class weights for CrossEntropyLoss and NLLLoss), "sum" adds, "none"
    concatenates. Criteria without a ``reduction`` attribute are taken as "mean" unless ``reduction``
    is given.
    """

    _watch_backward = False  # the model's backward covers it: it starts where this loss's gradient ends
    _shared_args = 1  # the outputs were counted as the model's
    _starts_step = False  # it is the same step as the model's forward

    def __init__(self, criterion: nn.Module, device_ids: Sequence[DeviceLike] | None = None,
                 output_device: DeviceLike | None = None, dim: int = 0, reduction: str | None = None) -> None:
        super().__init__(criterion, device_ids, output_device, dim)
        if reduction not in (None, "mean", "sum", "none"):
            raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
        self.reduction = reduction

    def forward(self, outputs: Any, *targets: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        return super().forward(outputs, *targets, **kwargs)

    def _forward(self, inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        outputs, targets = inputs[0], inputs[1:]
        per_device = list(outputs) if isinstance(outputs, list) else [outputs]
        probe = self.__dict__["_probe"]
        if len(per_device) == 1:
            label = self._label(self.device_ids[0]) if self.device_ids else HOST_LABEL
            # one device: the criterion runs whole where the outputs are, measured as the loss (as MeasuredLoss's)
            return MeasuredReplica(self.module, probe, label, shared_args=1, phase="loss")(per_device[0], *targets,
                                                                                           **kwargs)
        if len(per_device) > len(self.device_ids):
            raise ValueError(f"{len(per_device)} outputs but only {len(self.device_ids)} devices in device_ids: "
                             "use the same device_ids as the DataParallelModel")
        device_ids = self.device_ids[: len(per_device)]
        sizes = [_split_size(o, self.dim) for o in per_device]
        with self._phase("scatter", device_ids[0]):
            devices = self._targets(device_ids)
            split_targets = scatter_sized(targets, devices, sizes, self.dim) if targets else [()] * len(sizes)
            split_kwargs = scatter_sized(kwargs, devices, sizes, self.dim) if kwargs else [{}] * len(sizes)
        replicas = self.replicate(self.module, device_ids)
        args = [(o, *t) for o, t in zip(per_device, split_targets)]
        losses = self.parallel_apply(replicas, args, split_kwargs)
        weights = [_mean_weight(self.module, tuple(t), n) for t, n in zip(split_targets, sizes)]
        return self._reduce(losses, weights)

    def _reduce(self, losses: list[Any], weights: list[float]) -> Any:
        index = device_index(self.output_device)
        with self._phase("reduce", index):
            target = self._output_target(index)
            reduction = self.reduction or getattr(self.module, "reduction", "mean")
            if reduction == "none":
                return gather(losses, target, dim=self.dim)
            vector = gather([loss.reshape(1) for loss in losses], target, dim=0)
            if reduction == "sum":
                return vector.sum()
            w = torch.tensor(weights, dtype=vector.dtype, device=vector.device)
            # a device whose targets were all ignored has a NaN mean and weight 0: leave it out
            return torch.where(w > 0, vector, torch.zeros_like(vector)).mul(w).sum() / w.sum()


class MeasuredLoss(nn.Module):
    """A plain criterion on gathered outputs, measured as the "loss" phase on the output device.

    The counterpart of DataParallelCriterion for plain DataParallel, so the two can be compared:
    the loss's saved tensors and targets count against the output device, where they live.
    """

    def __init__(self, criterion: nn.Module, output_device: DeviceLike) -> None:
        super().__init__()
        self.criterion = criterion
        self._devices = resolve_devices([output_device])

    def forward(self, output: Any, *targets: Any, **kwargs: Any) -> Any:
        run = current_run()
        if run is None:
            return self.criterion(output, *targets, **kwargs)
        label = self._devices.labels[0]
        probe = ForwardProbe(run, self._devices, label, dim=0, starts_step=False)
        try:
            loss = MeasuredReplica(self.criterion, probe, label, shared_args=1, phase="loss")(output, *targets,
                                                                                               **kwargs)
        except BaseException:
            end_after_error(probe, self.criterion, used=1)
            raise
        probe.end(self.criterion, used=1)
        return loss

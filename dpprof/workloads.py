"""Built-in workloads: the DataParallel tutorial's models on synthetic data of the real shapes."""
from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dpprof.device_ids import DeviceLike, resolve_devices
from dpprof.parallel import DataParallel, DataParallelCriterion, DataParallelModel
from dpprof.parallel.balanced import MeasuredLoss
from dpprof.plaintext import error_line
from dpprof.recording import Run, record
from dpprof.workload_names import WORKLOAD_SAMPLES

__all__ = ["Workload", "WORKLOADS", "build_workload", "user_workload", "token_count", "random_inputs", "train", "TutorialLinear", "CifarNet",
           "SortedGRU", "TinyFCN"]

Batch = tuple[tuple[Any, ...], torch.Tensor]  # (positional inputs of the model, target)


class TutorialLinear(nn.Module):
    """The DataParallel tutorial's model: one Linear(5, 2)."""

    def __init__(self, input_size: int = 5, output_size: int = 2) -> None:
        super().__init__()
        self.fc = nn.Linear(input_size, output_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


class CifarNet(nn.Module):
    """The 60-minute blitz's CIFAR-10 Net: conv 3→6 5x5, pool, conv 6→16 5x5, fc 400→120→84→10."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


class SortedGRU(nn.Module):
    """A GRU classifier over padded variable-length sequences; each replica trims to its own longest.

    Batches come sorted by length, as length-bucketing loaders make them, so torch.chunk hands
    the last device the longest sequences: a straggler by nature, on GPUs and CPU workers alike.
    """

    def __init__(self, features: int = 32, hidden: int = 64, classes: int = 10) -> None:
        super().__init__()
        self.gru = nn.GRU(features, hidden, batch_first=True)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        x = x[:, : int(lengths.max())]  # this chunk's longest sequence, not the batch's
        packed = nn.utils.rnn.pack_padded_sequence(x, lengths.cpu(), batch_first=True, enforce_sorted=False)
        _, h = self.gru(packed)
        return self.head(h[-1])


class TinyFCN(nn.Module):
    """A small fully-convolutional segmentation net: per-pixel logits at the input's resolution.

    Semantic segmentation is where gathered outputs hurt most (PyTorch-Encoding's reason for the
    balanced criterion): the logits are classes x height x width per sample.
    """

    def __init__(self, classes: int = 21) -> None:
        super().__init__()
        self.encode = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        )
        self.classify = nn.Conv2d(32, classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.classify(self.encode(x))
        return F.interpolate(logits, size=x.shape[-2:], mode="bilinear", align_corners=False)


@dataclass
class Workload:
    """A model, its loss, and an endless stream of (inputs, target) batches; the model takes *inputs."""

    name: str
    model: nn.Module
    criterion: nn.Module
    batches: Callable[[], Iterator[Batch]]
    batch_size: int
    args: dict[str, Any] = field(default_factory=dict)


def _tutorial_linear(batch_size: int | None, seed: int) -> Workload:
    batch_size = batch_size or 30
    samples = WORKLOAD_SAMPLES["tutorial-linear"]
    gen = torch.Generator().manual_seed(seed)
    data = torch.randn(samples, 5, generator=gen)  # the tutorial's RandomDataset(5, 100)
    target = torch.randn(samples, 2, generator=gen)

    def batches() -> Iterator[Batch]:
        while True:  # epochs of 100 samples: 30, 30, 30, 10 at the tutorial's batch size
            order = torch.randperm(samples, generator=gen)
            for start in range(0, samples, batch_size):
                idx = order[start:start + batch_size]
                yield (data[idx],), target[idx]

    return Workload("tutorial-linear", TutorialLinear(), nn.MSELoss(), batches, batch_size,
                    {"batch_size": batch_size, "samples": samples})


def _cifar_lenet(batch_size: int | None, seed: int) -> Workload:
    batch_size = batch_size or 256
    gen = torch.Generator().manual_seed(seed)

    def batches() -> Iterator[Batch]:
        while True:  # synthetic CIFAR-10: 3x32x32 images in [-1, 1], labels 0..9
            yield ((torch.rand(batch_size, 3, 32, 32, generator=gen) * 2 - 1,),
                   torch.randint(0, 10, (batch_size,), generator=gen))

    return Workload("cifar-lenet", CifarNet(), nn.CrossEntropyLoss(), batches, batch_size,
                    {"batch_size": batch_size, "data": "synthetic"})


def _sorted_gru(batch_size: int | None, seed: int) -> Workload:
    batch_size = batch_size or 64
    gen = torch.Generator().manual_seed(seed)
    max_len, features = 128, 32

    def batches() -> Iterator[Batch]:
        while True:  # lengths 8..128, sorted ascending within the batch
            lengths = torch.randint(8, max_len + 1, (batch_size,), generator=gen).sort().values
            x = torch.randn(batch_size, max_len, features, generator=gen)
            yield (x, lengths), torch.randint(0, 10, (batch_size,), generator=gen)

    return Workload("sorted-gru", SortedGRU(features), nn.CrossEntropyLoss(), batches, batch_size,
                    {"batch_size": batch_size, "lengths": f"8..{max_len}, sorted"})


def _seg_fcn(batch_size: int | None, seed: int) -> Workload:
    batch_size = batch_size or 16
    gen = torch.Generator().manual_seed(seed)
    classes, size = 21, 96  # PASCAL VOC's 21 classes on small synthetic images

    def batches() -> Iterator[Batch]:
        while True:
            yield ((torch.rand(batch_size, 3, size, size, generator=gen) * 2 - 1,),
                   torch.randint(0, classes, (batch_size, size, size), generator=gen))

    return Workload("seg-fcn", TinyFCN(classes), nn.CrossEntropyLoss(), batches, batch_size,
                    {"batch_size": batch_size, "image": f"3x{size}x{size}", "classes": classes})


# Their names are also in dpprof.workload_names (for the CLI, without torch); a test checks the two agree.
WORKLOADS: dict[str, Callable[[int | None, int], Workload]] = {
    "tutorial-linear": _tutorial_linear,
    "cifar-lenet": _cifar_lenet,
    "sorted-gru": _sorted_gru,
    "seg-fcn": _seg_fcn,
}


class _SquaredOutput(nn.Module):
    """Loss for a user's model on random inputs: the mean square of every output tensor."""

    def forward(self, output: Any, target: Any = None) -> torch.Tensor:
        from dpprof.parallel.probe import iter_tensors
        # started from a zero tensor, not sum()'s int 0: a tensor even for an output with no floating tensor
        return sum((t.float().pow(2).mean() for t in iter_tensors(output) if t.is_floating_point()),
                   torch.zeros(()))


def user_workload(spec: str, input_shape: Sequence[int], batch_size: int | None = None,
                  seed: int = 0) -> Workload:
    """A user's model from ``package.module:factory``, trained on random inputs of (batch, *input_shape)."""
    import importlib

    module_name, _, factory_name = spec.partition(":")
    if not module_name or not factory_name:
        raise ValueError(f"--model takes package.module:factory, got {spec!r}")
    try:
        factory = getattr(importlib.import_module(module_name), factory_name)
    except Exception as err:  # noqa: BLE001 - ImportError, AttributeError, the module's own SyntaxError or raise
        if module_name.endswith(".py") or "/" in module_name:  # a file's path: the module is named as python -m names it
            path = Path(module_name)
            where = "the file's directory" if str(path.parent) == "." else path.parent
            raise ValueError(f"--model takes a module's name as python -m does, not a file's path ({spec!r}): run "
                             f"from {where} with --model {path.name.removesuffix('.py')}:{factory_name}") from None
        raise ValueError(f"cannot load model factory {spec!r}: {error_line(err)}") from None
    if not input_shape or any(d < 1 for d in input_shape):
        raise ValueError(f"--input-shape needs positive sizes, got {list(input_shape)}")
    torch.manual_seed(seed)
    try:
        model = factory()
    except Exception as err:  # noqa: BLE001 - a factory that needs arguments, or fails: its message, in one line
        raise ValueError(f"{spec}() failed: {error_line(err)}") from None
    if not isinstance(model, nn.Module):
        raise ValueError(f"{spec} returned {type(model).__name__}, not a torch.nn.Module")
    batch_size = batch_size or 32
    gen = torch.Generator().manual_seed(seed)
    shape = (batch_size, *input_shape)
    tokens = token_count(model)

    def batches() -> Iterator[Batch]:
        while True:
            yield (random_inputs(shape, tokens, gen),), torch.zeros(batch_size)

    inputs = {"inputs": f"token ids 0..{tokens - 1}"} if tokens is not None else {}
    return Workload(spec, model, _SquaredOutput(), batches, batch_size,
                    {"batch_size": batch_size, "input_shape": list(input_shape), **inputs,
                     "loss": "mean square of outputs"})


def token_count(model: nn.Module) -> int | None:
    """How many token ids a user's model takes where its first module with parameters is an nn.Embedding (or
    EmbeddingBag), as a language model's is: its num_embeddings; None for a model of float inputs."""
    for module in model.modules():
        if isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
            return int(module.num_embeddings)
        if any(True for _ in module.parameters(recurse=False)):
            return None
    return None


def random_inputs(shape: Sequence[int], tokens: int | None, generator: torch.Generator | None = None) -> torch.Tensor:
    """A batch of a user's model's inputs: token ids uniform in 0..tokens-1 (int64) for a model that starts with an
    embedding (token_count), else standard normal floats."""
    if tokens is not None:
        return torch.randint(0, tokens, tuple(shape), generator=generator)
    return torch.randn(tuple(shape), generator=generator)


def build_workload(name: str, batch_size: int | None = None, seed: int = 0) -> Workload:
    """A built-in workload by name (see WORKLOADS)."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose one of {', '.join(WORKLOADS)}")
    if batch_size is not None and batch_size < 1:
        raise ValueError(f"batch size must be positive, got {batch_size}")
    torch.manual_seed(seed)
    return WORKLOADS[name](batch_size, seed)


def train(workload: Workload, device_ids: Sequence[DeviceLike], steps: int, name: str | None = None,
          reports_dir: str | None = None, progress: Callable[[Iterator[int]], Iterator[int]] | None = None,
          balanced: bool = False, detail: str = "bounded", run_id: str | None = None,
          capture: str | None = None) -> Run:
    """Train ``workload`` for ``steps`` steps under dpprof.DataParallel and record it; returns the run.

    With ``balanced``, the model runs as DataParallelModel and the loss as DataParallelCriterion on
    the same devices: every device computes its own share of the loss, nothing is gathered.
    On GPUs the model is moved to device_ids[0] (as torch.nn.DataParallel requires) and each
    batch stays on the host until DataParallel scatters it; plain DataParallel's targets go to the
    output device, where the gathered outputs are. ``run_id``: the run's id, chosen by the caller (dpprof.record).
    ``capture``: "A:B", steps A to B-1 profiled with torch.profiler (dpprof.record's capture).
    """
    devices = resolve_devices(device_ids)
    on_gpus = devices.type == "cuda"
    if on_gpus:
        workload.model.to(torch.device("cuda", devices.indices[0]))
        workload.criterion.to(torch.device("cuda", devices.indices[0]))
    net: DataParallel
    if balanced:
        net = DataParallelModel(workload.model, device_ids=device_ids)
        criterion: nn.Module = DataParallelCriterion(workload.criterion, device_ids=device_ids)
    else:
        net = DataParallel(workload.model, device_ids=device_ids)
        criterion = MeasuredLoss(workload.criterion, output_device=device_ids[0])
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    batches = workload.batches()
    step_ids: Iterator[int] = iter(range(steps))
    if progress is not None:
        step_ids = progress(step_ids)
    default_name = f"{workload.name} (balanced)" if balanced else workload.name
    args = {**workload.args, "devices": [str(d) for d in device_ids], "steps": steps, "balanced": balanced}
    if os.environ.get("OMP_NUM_THREADS"):
        args["omp_num_threads"] = os.environ["OMP_NUM_THREADS"]
    with record(name=name or default_name, reports_dir=reports_dir, workload=workload.name,
                workload_args=args, detail=detail, run_id=run_id, capture=capture) as run:
        for _ in step_ids:
            inputs, target = next(batches)
            if on_gpus and not balanced:
                target = target.to(torch.device("cuda", devices.output_index), non_blocking=True)
            with run.step():
                optimizer.zero_grad(set_to_none=True)
                loss = criterion(net(*inputs), target)
                loss.backward()
                optimizer.step()
    return run

"""Plain record types: what one step of a data-parallel run produced. Units are in the field names."""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PHASES", "StepRecord", "PhaseRecord", "DeviceMemoryRecord", "AllocatorRecord", "Record", "TABLE_OF"]

# Phase names, in the order a step runs them; record_function ranges are "dpprof.<phase>".
PHASES = ("scatter", "replicate", "parallel_apply", "apply", "gather", "backward")


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One training step: an explicit ``run.step()`` block, or one forward and its backward."""

    step: int
    start_ms: float  # since the run started
    duration_ms: float
    batch_size: int | None  # size of the scattered inputs along dim, summed over forward calls
    devices_used: int  # replicas that ran (torch.chunk may use fewer than device_ids)
    forward_calls: int
    explicit: bool  # True when marked with run.step()


@dataclass(frozen=True, slots=True)
class PhaseRecord:
    """One phase of one forward call on one device, timed on the host (and on the GPU for CUDA)."""

    step: int
    call: int  # forward call within the step, from 0
    phase: str  # one of PHASES
    device: str  # "cuda:1", "cpu:0"
    start_ms: float  # since the run started
    duration_ms: float  # host wall time
    device_duration_ms: float | None = None  # CUDA event time; None on CPU workers


@dataclass(frozen=True, slots=True)
class DeviceMemoryRecord:
    """What one device held for one forward call: its chunk, outputs, saved activations, weights."""

    step: int
    call: int
    device: str
    chunk_size: int | None  # samples along dim in this device's input chunk
    input_bytes: int
    output_bytes: int
    activation_bytes: int  # tensors autograd saved for backward in this replica
    gathered_bytes: int  # gathered outputs held on this device (the output device only)
    param_bytes: int
    buffer_bytes: int


@dataclass(frozen=True, slots=True)
class AllocatorRecord:
    """The CUDA caching allocator's view of one device at the end of one phase."""

    step: int
    call: int
    device: str
    phase: str
    allocated_bytes: int
    peak_allocated_bytes: int  # peak since the step started
    reserved_bytes: int


Record = StepRecord | PhaseRecord | DeviceMemoryRecord | AllocatorRecord

# Record type -> the run table that holds it.
TABLE_OF: dict[type, str] = {
    StepRecord: "steps",
    PhaseRecord: "phases",
    DeviceMemoryRecord: "memory",
    AllocatorRecord: "allocator",
}

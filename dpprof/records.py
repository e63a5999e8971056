"""Plain record types: what one step of a data-parallel run produced. Units are in the field names."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["HOST_OUTPUT", "PHASE_ORDER", "PHASES", "DDP_PHASES", "FSDP_PHASES", "FSDP_ONLY_PHASES", "DP_TAX_PHASES", "MEMORY_BYTES", "SEVERITIES", "FINDING_UNITS", "finding_unit_error", "SLOWDOWN_REASONS", "device_key", "idle_severity", "uneven_severity", "split_shares", "even_batch_sizes", "StepRecord", "PhaseRecord", "DeviceMemoryRecord", "AllocatorRecord", "GpuSampleRecord",
           "DeviceRecord", "NoteRecord", "FindingRecord", "CommRecord", "GpuTimeRecord", "Record",
           "TABLE_OF", "CHECK_OF_ENV", "Row", "PHASE_ROW", "COMM_ROW", "STEP_ROW", "MEMORY_ROW",
           "RECORD_OF_TABLE", "record_of_row", "ALL_REDUCE", "ALL_REDUCE_RANGE", "SCRIPT_BUCKET"]

# ``dpprof advise RUN --check`` sets this in the environment of the runs it records (one per scenario): a run
# recorded under it stores the id of the run it checks as ``check_of`` in its workload_args, so that listings
# group it under that run and no page opens on it by default.
CHECK_OF_ENV = "DPPROF_CHECK_OF"

# What an all-reduce is called wherever it is named: a DistributedDataParallel gradient bucket's collective in a
# recorded run's comms rows, an imported trace's all-reduce (dpprof.trace.collect.COLLECTIVES), the findings and pages.
ALL_REDUCE = "all-reduce"
# The record_function range around each bucket's all-reduce (dpprof.parallel.distributed).
ALL_REDUCE_RANGE = "dpprof.allreduce"
# A comms row's bucket for a collective the script called itself (dpprof.parallel.script_comms): no bucket of DDP's
# or FSDP's. The figures of DDP's buckets and FSDP's collectives leave such rows out (framework_comms); the straggler
# verdict matches them with the rest.
SCRIPT_BUCKET = -1

# Phase names, in the order a step runs them; record_function ranges are "dpprof.<phase>".
PHASES = ("scatter", "replicate", "parallel_apply", "apply", "gather", "loss", "reduce", "backward")
# DistributedDataParallel's phases, per rank ("rank:N" as the device): the gap before the step
# (data loading), forward, backward (first gradient to the last all-reduce done), inside it
# backward_compute (until the last bucket was launched) and comm_wait (from then until the last
# all-reduce completed), the optimizer step, and script_comm (the host's time inside the script's own collectives:
# a metric all-reduced after the optimizer step; dpprof.parallel.script_comms).
DDP_PHASES = ("data", "forward", "backward", "backward_compute", "comm_wait", "optimizer", "script_comm")
# FSDP's phases, per rank (dpprof.parallel.fsdp): data, the root's forward and backward (each holding the FSDP work
# below that ran inside it), the exposed part of its all-gathers and reduce-scatters (the host blocked in the
# collective or its wait), FSDP's copies around them (copy_in: shards into the all-gather buffer, gradients into the
# reduce-scatter buffer; copy_out: the gathered buffer into the unsharded parameters, the reduced shard into .grad),
# and the optimizer step.
FSDP_PHASES = ("data", "forward", "backward", "all_gather_wait", "reduce_scatter_wait", "copy_in", "copy_out",
               "optimizer", "script_comm")
FSDP_ONLY_PHASES = ("all_gather_wait", "reduce_scatter_wait", "copy_in", "copy_out")  # a run with one is FSDP's
# Every phase in the order it runs in a step, the one order every table, legend and the advisor's parts list them in
# (a parent before its parts: backward before backward_compute and comm_wait).
PHASE_ORDER = ("data", "scatter", "replicate", "apply", "parallel_apply", "gather", "loss", "reduce", "forward",
               "backward", "backward_compute", "comm_wait", "copy_in", "all_gather_wait", "copy_out",
               "reduce_scatter_wait", "optimizer", "script_comm")
# "loss" is a whole-batch loss measured on the output device (MeasuredLoss, after a plain gather);
# "reduce" is DataParallelCriterion's: the per-device losses combined on the output device.
DP_TAX_PHASES = ("scatter", "replicate", "gather")  # work only DataParallel does (DDP has none of it)
# Finding severities, worst first: the order findings are listed and graded in.
SEVERITIES = ("critical", "warning", "info")
# What a finding's value is (FindingRecord.unit), the one definition of that column: every finding's value is in one
# of these, and says which (docs/findings.md lists them).
FINDING_UNITS = {
    "share": "a fraction from 0 to 1 of what the finding weighs it against (the step, the steps, the samples, the "
             "memory), as its title says",
    "ratio": "one figure over another (the device's over the others', the least over the most): 1.5 is half as "
             "much again",
    "ms": "milliseconds a step",
    "bytes": "bytes",
    "count": "how many (devices, buckets, GPUs, reasons)",
}


def finding_unit_error(value: float | None, unit: str | None) -> str | None:
    """Why a finding's value and unit are not a pair, in one sentence (a value needs a unit of FINDING_UNITS, and a
    unit a value); None where they are: every finding, from a run's rules or dpprof check's, is made through this."""
    if (unit is None) != (value is None) or (unit is not None and unit not in FINDING_UNITS):
        return (f"a finding's value needs a unit, one of {', '.join(FINDING_UNITS)}, and a unit a value: got "
                f"{value!r} in {unit!r}")
    return None


def idle_severity(idle: int, devices: int) -> str:
    """The severity of ``idle`` of ``devices`` getting no chunk: critical where at least half idle (the pre-flight
    check's idle_devices finding and a run's alike)."""
    return "critical" if idle >= devices / 2 else "warning"


# The device label of DataParallel's output_device -1 (torch's "gather onto the host"): the host's memory, no worker
# or GPU of device_ids
HOST_OUTPUT = "cpu"


def uneven_severity(chunks: Sequence[int], devices: int) -> str:
    """The severity of a batch split into uneven ``chunks`` over ``devices``: a warning where the chunks differ by
    more than one sample or the batch is under 8 samples a device (the difference is then a large part of a
    chunk), else info (the pre-flight check's uneven_chunks finding and a run's alike)."""
    return "warning" if max(chunks) - min(chunks) > 1 or sum(chunks) < 8 * devices else "info"


def split_shares(chunks: Sequence[float], devices: int) -> tuple[float, float]:
    """What a batch split leaves unused of the step, which waits for a device with the biggest chunk: in that time
    every device could take the biggest chunk, ``devices`` x biggest samples in all, and is given the batch. The
    shares of those samples' slots left empty: (uneven, idle). ``uneven``: the slots the devices given a chunk leave
    empty beside the biggest ((given devices x biggest - batch) / (devices x biggest)); ``idle``: the slots of the
    devices given none ((devices - given devices) / devices). The two sum to 1 - batch / (devices x biggest).
    torch.chunk's biggest chunk, ceil(batch / devices), is the smallest any split of whole samples makes: the same
    batch gains nothing from another split, a batch the devices divide evenly fills every slot. The uneven_chunks
    and idle_devices findings of the pre-flight check and of a run read them.

    Example:
        >>> split_shares([4, 4, 2], 3)  # batch 10 on 3 devices: (0.1667, 0.0)
        >>> split_shares([1, 1, 1], 4)  # batch 3 on 4 devices: (0.0, 0.25)
        >>> split_shares([2, 2, 1], 4)  # batch 5 on 4 devices: (0.125, 0.25)
    """
    given = [c for c in chunks if c > 0]
    if not given or devices < 1:
        return 0.0, 0.0
    slots = devices * max(given)
    return (len(given) * max(given) - sum(given)) / slots, (devices - len(given)) / devices


def even_batch_sizes(batch_size: int, n_devices: int) -> list[int]:
    """The nearest batch sizes at or around ``batch_size`` that give every device an equal chunk."""
    below = (batch_size // n_devices) * n_devices
    above = below + n_devices
    return [b for b in (below, above) if b > 0]


def device_key(label: object) -> tuple[str, int, str]:
    """Sort key for device labels: by kind, then index, so cpu:2 comes before cpu:10 and rank:9 before rank:10."""
    kind, _, index = str(label).partition(":")
    return (kind, int(index), "") if index.isdigit() else (kind, -1, str(label))


# The records made on every step, on the training thread (steps, phases, memory, allocator, collectives), are not
# frozen: a frozen dataclass sets each field through object.__setattr__, which made a PhaseRecord take 0.58 us to
# build against 0.12 us, and an FSDP rank builds about 60 records a step. Nothing changes a record once made, and
# nothing hashes one. (Most now reach the sink as rows: see Row at the end.)
@dataclass(slots=True)  # built on every step: not frozen (see above)
class StepRecord:
    """One training step: an explicit ``run.step()`` block, or one forward and its backward."""

    step: int
    start_ms: float  # since the run started
    duration_ms: float
    batch_size: int | None  # size of the scattered inputs along dim, summed over forward calls
    devices_used: int  # replicas that ran (torch.chunk may use fewer than device_ids)
    forward_calls: int
    explicit: bool  # True when marked with run.step()
    # forward calls that raised, the script catching the error and going on (an out-of-memory batch skipped); None
    # where nobody knows (an imported trace's step; a file written before the column reads NULL)
    raised_calls: int | None = None
    # DataLoader time (its iterators' batches, dpprof.loaders.time_in) on the step's thread from the previous step's
    # end to this step's start, in no step: a DataParallel run's (0.0 where none ran there); None where the DataLoader
    # time is the step's own data part (a DDP or FSDP rank's), where no DataLoader made a batch, in an imported trace
    # and in a file written before the column
    loader_ms: float | None = None


@dataclass(slots=True)  # built on every step: not frozen (see above StepRecord)
class PhaseRecord:
    """One phase of one forward call on one device, timed on the host (and on the GPU for CUDA)."""

    step: int
    call: int  # forward call within the step, from 0
    phase: str  # one of PHASES
    device: str  # "cuda:1", "cpu:0"
    start_ms: float  # since the run started
    duration_ms: float  # host wall time
    device_duration_ms: float | None = None  # CUDA event time; None on CPU workers


@dataclass(slots=True)  # built on every step: not frozen (see above StepRecord)
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


# What a device holds in one forward call, as the memory table records it: every byte field, in field order.
MEMORY_BYTES = tuple(name for name in DeviceMemoryRecord.__dataclass_fields__ if name.endswith("_bytes"))


@dataclass(slots=True)  # built on every step: not frozen (see above StepRecord)
class AllocatorRecord:
    """The CUDA caching allocator's view of one device at the end of a phase: of each replica's apply (on its
    device) and of backward (on every device); of a DDP rank's forward and backward (its GPU, as "rank:N")."""

    step: int
    call: int
    device: str
    phase: str
    allocated_bytes: int
    peak_allocated_bytes: int  # peak since the step started
    reserved_bytes: int | None  # None: an imported trace's memory events in the step said none


# Clock-throttle reasons that mean "slower than it could be" (idle and application-clock settings do not), by
# the names GpuSampleRecord.throttle_reasons holds (dpprof.nvml.THROTTLE_REASONS maps NVML's bits to them).
# Here, below both, because the findings read them and the NVML monitor writes them.
SLOWDOWN_REASONS = ("sw_power_cap", "hw_slowdown", "sw_thermal", "hw_thermal", "hw_power_brake")


@dataclass(frozen=True, slots=True)
class GpuSampleRecord:
    """One NVML reading of one GPU; None where NVML had no value (unsupported, lost, no library)."""

    t_ms: float  # since the run started
    device: str  # torch's label, "cuda:N"
    gpu_util_pct: float | None = None
    memory_util_pct: float | None = None
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    power_w: float | None = None
    power_limit_w: float | None = None
    temperature_c: float | None = None
    sm_clock_mhz: float | None = None
    pcie_tx_bytes_per_s: float | None = None
    pcie_rx_bytes_per_s: float | None = None
    throttle_reasons: str | None = None  # comma-separated names of active clock-throttle reasons
    other_process_memory_bytes: int | None = None  # held on this GPU by processes other than this one


@dataclass(frozen=True, slots=True)
class DeviceRecord:
    """One device of the run's inventory."""

    device: str
    kind: str  # "cuda" or "cpu"
    name: str | None = None
    total_memory_bytes: int | None = None
    multiprocessor_count: int | None = None
    capability: str | None = None
    pci_bus_id: str | None = None
    nvml_index: int | None = None  # NVML's index for the same GPU (may differ from torch's)
    cpu_model: str | None = None
    cores: int | None = None
    threads: int | None = None


@dataclass(frozen=True, slots=True)
class NoteRecord:
    """A reason some data is missing (no NVML, a metric not supported, a GPU lost), stored once."""

    t_ms: float
    source: str
    message: str


@dataclass(frozen=True, slots=True)
class FindingRecord:
    """A diagnosis: what is wrong, the numbers that show it, and what to do."""

    kind: str
    severity: str  # "info" | "warning" | "critical"
    device: str | None
    title: str
    evidence: str
    advice: str
    value: float | None = None  # the finding's headline number, in ``unit``
    unit: str | None = None  # what ``value`` is: a key of FINDING_UNITS (None where there is no value)


@dataclass(slots=True)  # built on every step: not frozen (see above StepRecord)
class CommRecord:
    """One collective in one step on one rank: a DistributedDataParallel gradient bucket's all-reduce (recorded),
    or an imported trace's collective kernel on the GPU (its host op where the trace has no collective kernels)."""

    step: int
    device: str  # "rank:N"
    bucket: int  # the bucket's index in DDP's reducer, after the buckets of the DDP models recorded before it (a
    # GAN's two models: the second's follow the first's); FSDP's and an imported trace's: its index among the step's;
    # SCRIPT_BUCKET for a collective the script called itself (a recorded DDP or FSDP run's)
    bucket_bytes: int | None  # what it sent: a DDP bucket's hook's collectives' tensors (half the bucket under an fp16
    # compress hook), the bucket's size where none was seen; None: an imported collective whose kernel and op give no size
    launch_ms: float  # since the run started: when the bucket was ready and its all-reduce launched
    duration_ms: float  # launch to completion (the future's callback)
    collective: str | None = None  # what it is: a DDP bucket's ALL_REDUCE; FSDP's all-gather, reduce-scatter; an
    # imported trace's all-reduce, reduce-scatter, all-gather, all-to-all, broadcast, send/recv
    # (dpprof.trace.collect.collective_name). None only in a file written before dpprof stored a DDP bucket's: the
    # reader names it (dpprof.store.reader.named_collectives)


@dataclass(frozen=True, slots=True)
class GpuTimeRecord:
    """How one GPU (or one rank's GPU) spent one step, from a torch.profiler trace's GPU activity.

    The step's window is partitioned (``dpprof.stepmodel.partition`` with GPU_PARTS): every instant goes to the
    first of overlap (a compute and a collective kernel both running), computation, communication, memcpy,
    memset, else idle. Stored so that the Distributed view's derivation gives the parts: computation is
    compute_ms - overlap_ms, communication communication_ms - overlap_ms, overlapping overlap_ms; with memcpy_ms,
    memset_ms and idle_ms they sum to window_ms.
    """

    step: int
    device: str
    window_ms: float  # the step's length
    compute_ms: float  # union of the kernels other than collectives, in the window
    communication_ms: float  # union of the collective kernels (NCCL, RCCL, Gloo), in the window
    overlap_ms: float  # collective kernels while compute kernels ran
    memcpy_ms: float  # copies while no kernel ran
    memset_ms: float  # memsets while no kernel or copy ran
    idle_ms: float  # nothing running on the GPU


Record = (StepRecord | PhaseRecord | DeviceMemoryRecord | AllocatorRecord | GpuSampleRecord | DeviceRecord
          | NoteRecord | FindingRecord | CommRecord | GpuTimeRecord)

# Record type -> the run table that holds it.
TABLE_OF: dict[type, str] = {
    StepRecord: "steps",
    PhaseRecord: "phases",
    DeviceMemoryRecord: "memory",
    AllocatorRecord: "allocator",
    GpuSampleRecord: "gpu_samples",
    DeviceRecord: "devices",
    NoteRecord: "notes",
    FindingRecord: "findings",
    CommRecord: "comms",
    GpuTimeRecord: "gpu_time",
}


# The records the training thread makes on every step (its steps, phases, memory and collectives: an FSDP rank's ~60,
# a DataParallel step's ~12) reach the sink as rows: plain tuples, (table, *the record's fields in order), e.g.
# (PHASE_ROW, step, call, phase, device, start_ms, duration_ms, None). A tuple of numbers and strings leaves the
# garbage collector's lists at the first collection it lives through; a record instance stays on them until the
# writer has committed it (up to half a second later), and is moved into the oldest generation, whose growth sets
# off full collections of the whole process (150-200 ms each with torch loaded): on the MLP on 2 CPU workers, 37 us
# a step over long runs (bench/gc_cost.py); on an FSDP rank, one every ~1,500 steps. A sink stores a row as it is
# (SqliteSink) or makes it into its record (MemorySink, ``record_of_row``).
Row = tuple[Any, ...]
PHASE_ROW = TABLE_OF[PhaseRecord]
COMM_ROW = TABLE_OF[CommRecord]
STEP_ROW = TABLE_OF[StepRecord]
MEMORY_ROW = TABLE_OF[DeviceMemoryRecord]
RECORD_OF_TABLE: dict[str, type] = {table: cls for cls, table in TABLE_OF.items()}  # a row's record type, by its table


def record_of_row(row: Row) -> Record:
    """The record a row stands for."""
    record: Record = RECORD_OF_TABLE[row[0]](*row[1:])
    return record

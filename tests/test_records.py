"""Record types: the field order the hot path builds records in positionally, and the shared names."""
from __future__ import annotations

import ast
from dataclasses import fields
from pathlib import Path

import pytest

from dpprof.records import (ALL_REDUCE, ALL_REDUCE_RANGE, MEMORY_BYTES, AllocatorRecord, CommRecord, DeviceMemoryRecord, PhaseRecord, StepRecord,
                            device_key)

# Records built positionally on the hot path, or written there as rows (dpprof.records.Row: the table, then the
# fields in this order) (dpprof/recording.py, dpprof/parallel/probe.py, dpprof/parallel/distributed.py,
# dpprof/parallel/fsdp.py): a field moved in records.py would store wrong data silently, so the order those call
# sites assume is pinned here. Change both together.
POSITIONAL = [
    (StepRecord, ["step", "start_ms", "duration_ms", "batch_size", "devices_used", "forward_calls", "explicit",
                  "raised_calls", "loader_ms"]),
    (PhaseRecord, ["step", "call", "phase", "device", "start_ms", "duration_ms", "device_duration_ms"]),
    (DeviceMemoryRecord, ["step", "call", "device", "chunk_size", "input_bytes", "output_bytes", "activation_bytes",
                          "gathered_bytes", "param_bytes", "buffer_bytes"]),
    (AllocatorRecord, ["step", "call", "device", "phase", "allocated_bytes", "peak_allocated_bytes",
                       "reserved_bytes"]),
    (CommRecord, ["step", "device", "bucket", "bucket_bytes", "launch_ms", "duration_ms", "collective"]),
]


@pytest.mark.parametrize("record_type, order", POSITIONAL, ids=[t.__name__ for t, _ in POSITIONAL])
def test_positional_records_keep_their_field_order(record_type, order):
    assert [f.name for f in fields(record_type)] == order


def test_memory_bytes_are_the_memory_records_byte_fields():
    assert MEMORY_BYTES == ("input_bytes", "output_bytes", "activation_bytes", "gathered_bytes", "param_bytes",
                            "buffer_bytes")


def test_the_all_reduce_is_named_in_records_alone():
    """The word for an all-reduce (a recorded DDP bucket's, an imported trace's, the findings' and the pages') and the
    range around a bucket's all-reduce are written out once, in dpprof/records.py; every other module takes them
    from there."""
    root = Path(__file__).resolve().parents[1] / "dpprof"
    spelled = {ALL_REDUCE, ALL_REDUCE_RANGE}
    found = sorted(f"{f.relative_to(root)}:{node.lineno} {node.value!r}" for f in root.rglob("*.py")
                   if f.name != "records.py" for node in ast.walk(ast.parse(f.read_text()))
                   if isinstance(node, ast.Constant) and node.value in spelled)
    assert found == []


def test_devices_sort_by_kind_then_index():
    labels = ["cpu:10", "cpu:2", "rank:10", "cuda:1", "rank:9", "cpu:0"]
    assert sorted(labels, key=device_key) == ["cpu:0", "cpu:2", "cpu:10", "cuda:1", "rank:9", "rank:10"]


@pytest.mark.parametrize("value, unit", [(0.3, None), (None, "share"), (1.5, "x"), (2.0, "percent")])
def test_both_finding_makers_refuse_a_value_and_unit_that_are_no_pair(value, unit):
    """A run's rules (findings.base.finding) and dpprof check's (devices._finding) make findings through one check
    (records.finding_unit_error): a value needs a unit of FINDING_UNITS, and a unit a value."""
    from dpprof.devices import _finding
    from dpprof.findings.base import finding
    from dpprof.records import finding_unit_error

    why = finding_unit_error(value, unit)
    assert why is not None and repr(unit) in why
    for make in (finding, _finding):
        with pytest.raises(ValueError) as err:
            make("k", "info", None, "title", "evidence", "advice", value, unit)
        assert str(err.value) == why
    assert finding("k", "info", None, "t", "e", "a", None, None)["unit"] is None  # no figure: neither
    assert _finding("k", "info", None, "t", "e", "a", 0.25, "share").unit == "share"

"""dpprof.workload_names: the built-in workloads' names without torch, the same as dpprof.workloads builds."""
from __future__ import annotations

from dpprof.workload_names import WORKLOAD_NAMES
from dpprof.workloads import WORKLOADS


def test_the_names_are_the_built_in_workloads_in_order():
    assert WORKLOAD_NAMES == tuple(WORKLOADS)

"""The built-in workloads' names, without torch: `dpprof profile`'s choices (dpprof.workloads builds them)."""
from __future__ import annotations

__all__ = ["WORKLOAD_NAMES"]

WORKLOAD_NAMES = ("tutorial-linear", "cifar-lenet", "sorted-gru", "seg-fcn")  # in dpprof.workloads.WORKLOADS' order

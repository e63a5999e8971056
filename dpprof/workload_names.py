"""The built-in workloads' names, without torch: `dpprof profile`'s choices (dpprof.workloads builds them)."""
from __future__ import annotations

__all__ = ["WORKLOAD_NAMES", "WORKLOAD_SAMPLES"]

WORKLOAD_NAMES = ("tutorial-linear", "cifar-lenet", "sorted-gru", "seg-fcn")  # in dpprof.workloads.WORKLOADS' order
# A built-in whose data set is finite, as a DataLoader's: none of its batches holds more than its samples (asked for
# more, it yields them all, as DataLoader(dataset, batch_size=more) does). The others stream batches of any size.
WORKLOAD_SAMPLES = {"tutorial-linear": 100}  # the tutorial's RandomDataset(5, 100)

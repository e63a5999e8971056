"""Device-generic scatter, replicate, parallel_apply, gather, and DataParallel itself."""
from dpprof.compiled import skip_in_torch_compile
from dpprof.device_ids import cpu_devices, resolve_devices
from dpprof.parallel.balanced import DataParallelCriterion, DataParallelModel
from dpprof.parallel.data_parallel import DataParallel, data_parallel
from dpprof.parallel.distributed import DistributedDataParallel
from dpprof.parallel.parallel_apply import parallel_apply
from dpprof.parallel.replicate import replicate
from dpprof.parallel.scatter_gather import gather, scatter, scatter_kwargs

__all__ = ["DataParallel", "data_parallel", "DataParallelModel", "DataParallelCriterion",
           "DistributedDataParallel", "cpu_devices", "resolve_devices", "parallel_apply",
           "replicate", "gather", "scatter", "scatter_kwargs"]

skip_in_torch_compile()  # torch.compile of a dpprof model runs dpprof's code as it is (dpprof.compiled)

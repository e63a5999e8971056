"""One rank of ``dpprof profile --ddp`` (or ``--fsdp``): run under torchrun, trains a built-in workload (or a user's
model, ``--model``) with dpprof.DistributedDataParallel (or FSDP2's ``fully_shard`` on each top-level child module
with parameters and on the root, recorded by dpprof.parallel.fsdp) and records it.

On the CPU the ranks talk over gloo. With ``--device cuda`` each rank takes GPU
``local_rank % GPUs``: NCCL when every rank has a GPU of its own, gloo when ranks share GPUs
(NCCL refuses two ranks on one GPU), unless ``--backend`` says otherwise."""
from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import dpprof
from dpprof.plaintext import error_line
from dpprof.store.faults import RecordingError
from dpprof.store.retention import DETAIL_MODES
from dpprof.workloads import WORKLOADS, build_workload, user_workload

# How a rank says in one line why it stopped (its recording could not start); the
# `dpprof profile --ddp` process shows these lines instead of torchrun's report.
FAILED_PREFIX = "dpprof rank "
STEP_PREFIX = "rank 0 step "  # rank 0's line at each step: the progress bar's tick


def _say_failed(why: str) -> None:
    """This rank's one line on why it stopped, written whole in one write: the ranks share torchrun's pipe."""
    sys.stderr.write(f"{FAILED_PREFIX}{os.environ.get('RANK', '?')}: {why}\n")
    sys.stderr.flush()


def main() -> None:
    try:
        _main()
    except RecordingError as err:
        _say_failed(str(err))
        sys.exit(1)
    except Exception as err:  # noqa: BLE001 - the workload failed while training: why, in one line
        _say_failed(f"the workload failed while training: {error_line(err)}")
        sys.exit(1)


def _main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workload", nargs="?", default=None, choices=list(WORKLOADS))
    parser.add_argument("--model", default=None, metavar="PKG.MODULE:FACTORY",
                        help="your own model instead of a built-in workload (as dpprof profile --model)")
    parser.add_argument("--input-shape", default=None, metavar="D1,D2,...", help="with --model: one sample's shape")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch-size", type=int, default=None, help="per-rank batch size")
    parser.add_argument("--name", default=None)
    parser.add_argument("--reports-dir", default=None, help="may contain {rank}: one directory per rank")
    parser.add_argument("--run-id", default=None, help="the run's id, chosen by whoever started the ranks (rank 0's "
                        "is every rank's)")
    parser.add_argument("--delay-rank", default=None, metavar="RANK:MS",
                        help="add MS milliseconds to every forward on RANK: what a straggler looks like")
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0, help="DDP's bucket_cap_mb")
    parser.add_argument("--timeout-s", type=float, default=60.0, help="collective timeout")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where each rank trains")
    parser.add_argument("--detail", choices=list(DETAIL_MODES), default="bounded", help="as dpprof.record's detail")
    parser.add_argument("--capture", default=None, metavar="A:B", help="as dpprof.record's capture: steps A to B-1 "
                        "profiled with torch.profiler, on each rank")
    parser.add_argument("--fsdp", action="store_true", help="FSDP2 (fully_shard) instead of DDP")
    parser.add_argument("--backend", choices=["gloo", "nccl"], default=None,
                        help="default: gloo on the CPU or when ranks share GPUs, else NCCL")
    args = parser.parse_args()
    if (args.workload is None) == (args.model is None):
        parser.error("give a built-in workload or --model")
    if args.model and not args.input_shape:
        parser.error("--model needs --input-shape")

    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA GPU is visible here")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    gpu = local_rank % torch.cuda.device_count() if cuda else None
    shared = cuda and torch.cuda.device_count() < int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    backend = args.backend or ("nccl" if cuda and not shared else "gloo")
    if cuda:
        torch.cuda.set_device(gpu)
    dist.init_process_group(backend, timeout=timedelta(seconds=args.timeout_s))
    try:
        _train(args, cuda, gpu, backend)
    finally:
        # the model, its optimizer and the run are _train's, freed as it returned: the process group is destroyed
        # with nothing left holding it, and gloo's objects are not freed at the interpreter's end, where they abort
        # a rank now and then
        dist.destroy_process_group()


def _train(args: argparse.Namespace, cuda: bool, gpu: int | None, backend: str) -> None:
    """This rank's training, recorded."""
    rank = dist.get_rank()
    if args.model:  # each rank its own batches
        shape = [int(d) for d in args.input_shape.replace("x", ",").split(",")]
        workload = user_workload(args.model, shape, args.batch_size, seed=rank)
    else:
        workload = build_workload(args.workload, args.batch_size, seed=rank)
    torch.manual_seed(0)  # the same initial weights on every rank (DDP broadcasts rank 0's anyway)
    model = workload.model
    if cuda:
        model = model.cuda(gpu)
    if args.fsdp:
        ddp = _fully_shard(model, cuda)
    else:
        ddp = dpprof.DistributedDataParallel(model, device_ids=[gpu] if cuda else None,
                                             bucket_cap_mb=args.bucket_cap_mb)
    kind = "fsdp" if args.fsdp else "ddp"
    delay_rank, delay_ms = (int(x) for x in args.delay_rank.split(":")) if args.delay_rank else (-1, 0)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    batches = workload.batches()
    reports = args.reports_dir.format(rank=rank) if args.reports_dir else None
    name = args.name or f"{workload.name} ({kind} x{dist.get_world_size()})"
    run_args = {**workload.args, kind: True, "threads": torch.get_num_threads(), "world_size": dist.get_world_size(), "steps": args.steps,
                **({} if args.fsdp else {"bucket_cap_mb": args.bucket_cap_mb}), "backend": backend,
                "device": f"cuda:{gpu}" if cuda else "cpu"}
    with dpprof.record(name=name, reports_dir=reports, workload=workload.name, workload_args=run_args,
                       detail=args.detail, run_id=args.run_id, capture=args.capture) as run:
        for step in range(args.steps):
            inputs, target = next(batches)
            if cuda:
                inputs = tuple(t.cuda(gpu) for t in inputs)
                target = target.cuda(gpu)
            if rank == delay_rank:
                time.sleep(delay_ms / 1e3)
            optimizer.zero_grad(set_to_none=True)
            loss = workload.criterion(ddp(*inputs), target)
            loss.backward()
            optimizer.step()
            print(f"rank {rank} step {step} pid {os.getpid()}", flush=True)
    if rank == 0:
        print(f"recorded run {run.id} ({args.steps} steps on {dist.get_world_size()} ranks)", flush=True)


def _fully_shard(model: torch.nn.Module, cuda: bool) -> torch.nn.Module:
    """FSDP2 as its documentation applies it: each top-level child module that holds parameters, then the root;
    dpprof.parallel.fsdp's hooks installed so the steps are recorded.

    The mesh is on the ranks' own device type: fully_shard's default mesh is on the accelerator wherever one is
    visible, which CPU ranks over gloo on a GPU machine cannot use."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from dpprof.parallel import fsdp

    fsdp.install()
    mesh = init_device_mesh("cuda" if cuda else "cpu", (dist.get_world_size(),))
    for child in model.children():
        if any(True for _ in child.parameters()):
            fully_shard(child, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


if __name__ == "__main__":
    main()

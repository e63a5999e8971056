"""One rank of ``dpprof profile --ddp``: run under torchrun, trains a built-in workload with
dpprof.DistributedDataParallel and records it (gloo on CPU, NCCL on GPUs)."""
from __future__ import annotations

import argparse
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import dpprof
from dpprof.workloads import WORKLOADS, build_workload


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workload", choices=list(WORKLOADS))
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch-size", type=int, default=None, help="per-rank batch size")
    parser.add_argument("--name", default=None)
    parser.add_argument("--reports-dir", default=None, help="may contain {rank}: one directory per rank")
    parser.add_argument("--delay-rank", default=None, metavar="RANK:MS",
                        help="add MS milliseconds to every forward on RANK: what a straggler looks like")
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0, help="DDP's bucket_cap_mb")
    parser.add_argument("--timeout-s", type=float, default=60.0, help="collective timeout")
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=args.timeout_s))
    rank = dist.get_rank()
    try:
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        workload = build_workload(args.workload, args.batch_size, seed=rank)  # each rank its own batches
        torch.manual_seed(0)  # the same initial weights on every rank (DDP broadcasts rank 0's anyway)
        model = workload.model
        if cuda:
            torch.cuda.set_device(local_rank)
            model = model.cuda(local_rank)
        ddp = dpprof.DistributedDataParallel(model, device_ids=[local_rank] if cuda else None,
                                             bucket_cap_mb=args.bucket_cap_mb)
        delay_rank, delay_ms = (int(x) for x in args.delay_rank.split(":")) if args.delay_rank else (-1, 0)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
        batches = workload.batches()
        reports = args.reports_dir.format(rank=rank) if args.reports_dir else None
        name = args.name or f"{workload.name} (ddp x{dist.get_world_size()})"
        run_args = {**workload.args, "ddp": True, "world_size": dist.get_world_size(), "steps": args.steps,
                    "bucket_cap_mb": args.bucket_cap_mb}
        with dpprof.record(name=name, reports_dir=reports, workload=workload.name, workload_args=run_args) as run:
            for step in range(args.steps):
                inputs, target = next(batches)
                if cuda:
                    inputs = tuple(t.cuda(local_rank) for t in inputs)
                    target = target.cuda(local_rank)
                if rank == delay_rank:
                    time.sleep(delay_ms / 1e3)
                optimizer.zero_grad(set_to_none=True)
                loss = workload.criterion(ddp(*inputs), target)
                loss.backward()
                optimizer.step()
                print(f"rank {rank} step {step} pid {os.getpid()}", flush=True)
        if rank == 0:
            print(f"recorded run {run.id} ({args.steps} steps on {dist.get_world_size()} ranks)", flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""A data-parallel script for torchrun (gloo) whose ranks spend a fixed time loading each batch, one rank longer (or,
with ``--delay-at optimizer``, that long between its backward and its optimizer step): a straggler of known size.
DistributedDataParallel (``--rank-steps``: one rank trains fewer steps, under Join), or FSDP2 (``--fsdp``: fully_shard on each Linear and the root).
``--trace DIR``: profile each rank with torch.profiler (a schedule, so steps are ProfilerStep#N) and export
DIR/<stem>-rank<N>.pt.trace.json, as a user would without dpprof."""
import argparse
import gc
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed import all_reduce  # bound at import, as scripts write it, before any forward
from torch import nn
from torch.profiler import ProfilerActivity, profile, schedule

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--load-ms", type=float, default=60.0, help="every rank's time to load a batch")
parser.add_argument("--delay", default=None, metavar="RANK:MS", help="RANK loads each batch MS longer")
parser.add_argument("--also-delay", default=None, metavar="RANK:MS", help="a second late rank: RANK loads each batch "
                    "MS longer too")
parser.add_argument("--delay-at", choices=["load", "optimizer", "after"], default="load", help="where RANK's delay "
                    "is: in loading its batch, after its backward, before its optimizer step (outside its work), or "
                    "after its optimizer step, before every rank all-reduces a metric to log (the script's own "
                    "collective)")
parser.add_argument("--fsdp", action="store_true")
parser.add_argument("--trace", default=None, metavar="DIR")
parser.add_argument("--stem", default="straggler")
parser.add_argument("--window", default=None, metavar="RANK:STEPS", help="RANK's profiler is active for STEPS steps "
                    "of the --steps the others profile (its trace holds fewer steps)")
parser.add_argument("--rank-steps", default=None, metavar="RANK:STEPS", help="RANK trains STEPS steps, the others "
                    "--steps: uneven inputs under DDP's Join (the ranks done early shadow the others' all-reduces)")
parser.add_argument("--subgroup", default=None, metavar="RANKS", help="comma-separated ranks that all-reduce a "
                    "metric among themselves (dist.new_group) before each forward")
parser.add_argument("--moves-to", default=None, metavar="RANK:STEP", help="from the script's step STEP on, the "
                    "delay is RANK's instead (the straggler moves)")
parser.add_argument("--no-backend", action="store_true", help="init_process_group() naming no backend (torch's "
                    "default for each device type)")
args = parser.parse_args()

dist.init_process_group(None if args.no_backend else "gloo")
rank = dist.get_rank()
torch.set_num_threads(1)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
if args.fsdp:
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    del layer  # a global left holding an FSDP module keeps the process group to the interpreter's end
    fully_shard(model)
else:
    model = nn.parallel.DistributedDataParallel(model)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
batches = torch.Generator().manual_seed(rank)
delay_rank, delay_ms = (int(x) for x in args.delay.split(":")) if args.delay else (-1, 0)
window_rank, window = (int(x) for x in args.window.split(":")) if args.window else (-1, 0)
late_s = (delay_ms if rank == delay_rank else 0) / 1e3
also_rank, also_ms = (int(x) for x in args.also_delay.split(":")) if args.also_delay else (-1, 0)
also_s = (also_ms if rank == also_rank else 0) / 1e3
subgroup = [int(r) for r in args.subgroup.split(",")] if args.subgroup else []
metric_group = dist.new_group(subgroup) if subgroup else None  # every rank takes part in creating it
load_s, before_optimizer_s = (args.load_ms / 1e3 + late_s, 0.0) if args.delay_at == "load" else (args.load_ms / 1e3, late_s)
if args.delay_at == "after":
    before_optimizer_s = 0.0


moved_rank, moved_at = (int(x) for x in args.moves_to.split(":")) if args.moves_to else (-1, -1)
calls = 0


def step() -> None:
    global calls
    moved = 0 <= moved_at <= calls
    calls += 1
    late = (delay_ms / 1e3 if rank == (moved_rank if moved else delay_rank) else 0.0) if moved_at >= 0 else None
    time.sleep((load_s if late is None else args.load_ms / 1e3 + late) + also_s)  # loading the batch: a slow disk, a busy input pipeline
    if rank in subgroup:
        dist.all_reduce(torch.ones(4), group=metric_group)  # a metric of the subgroup's ranks alone
    x, y = torch.randn(32, 32, generator=batches), torch.randint(0, 4, (32,), generator=batches)
    optimizer.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    time.sleep(before_optimizer_s)  # the host's own work between backward and the optimizer (clipping, logging)
    optimizer.step()
    if args.delay_at == "after":
        time.sleep(late_s)  # the host's own work after the step (a checkpoint, a log line)
        all_reduce(torch.ones(4))  # a metric every rank logs: the script's own collective, by the name it bound


if args.trace:
    out = Path(args.trace) / f"{args.stem}-rank{rank}.pt.trace.json"
    with profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=0, warmup=1, active=window if rank == window_rank else args.steps,
                                       repeat=1),
                 on_trace_ready=lambda p: p.export_chrome_trace(str(out))) as prof:
        for _ in range(args.steps + 1):
            step()
            prof.step()
elif args.rank_steps:
    from torch.distributed.algorithms.join import Join

    short_rank, short_steps = (int(x) for x in args.rank_steps.split(":"))
    with Join([model]):
        for _ in range(short_steps if rank == short_rank else args.steps):
            step()
else:
    for _ in range(args.steps):
        step()
# The gloo objects these globals hold (DDP's reducer, FSDP's state) abort the process now and then when the
# interpreter frees them at its exit ("terminate called without an active exception"; pytorch/pytorch#179291):
# as in train_ddp.py. Freed here, while the interpreter is whole.
model = optimizer = None  # step() reads them: rebound, not deleted
gc.collect()
dist.destroy_process_group()

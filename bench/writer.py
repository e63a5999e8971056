"""The run file writer's CPU per recorded step: what the background writer thread spends on each step a run records.

Records one run in memory (the MLP 64-128-128-10, batch 64, on 2 CPU workers, ``run.step()`` around each step: about
10 records a step), then writes those records (the per-step ones as the rows a run file's writer gets) into fresh
run files in commit-sized batches (a quarter second of steps at 500 steps a second), as the writer thread does: with
the per-block aggregates that long runs are read from, and without them (the rows alone). The two arms alternate,
``--rounds`` times; each prints the least CPU time per step over its rounds (CPU time, not wall: the machine's other
work moves it least).

    python bench/writer.py [--steps 3000] [--rounds 5]
"""
from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import fields

import torch
from torch import nn

import dpprof
from dpprof.records import TABLE_OF, CommRecord, DeviceMemoryRecord, PhaseRecord, StepRecord
from dpprof.store.writer import SqliteSink

COMMIT_STEPS = 125  # a quarter second of steps at 500 steps a second
# the records that reach a run file's writer as rows (dpprof.records.Row: their table, then their fields in order)
ROW_RECORDS = (PhaseRecord, CommRecord, StepRecord, DeviceMemoryRecord)


def recorded(steps: int) -> list:
    torch.manual_seed(0)
    net = dpprof.DataParallel(nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
                                            nn.Linear(128, 10)), device_ids=dpprof.cpu_devices(2))
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    x, y = torch.randn(64, 64), torch.randint(0, 10, (64,))
    with dpprof.record(name="writer bench", store=False) as run:
        for _ in range(steps):
            with run.step():
                opt.zero_grad()
                nn.functional.cross_entropy(net(x), y).backward()
                opt.step()
    records = [r for table in run.sink.tables.values() for r in table]
    records.sort(key=lambda r: getattr(r, "step", 0) or 0)  # in step order, as the training thread puts them
    # a run kept in memory makes its rows into records; a run file's writer gets the per-step ones as rows
    return [(TABLE_OF[type(r)], *(getattr(r, f.name) for f in fields(r))) if type(r) in ROW_RECORDS else r
            for r in records]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    records = recorded(args.steps)
    per_commit = max(1, round(len(records) / args.steps * COMMIT_STEPS))
    print(f"{len(records):,} records of {args.steps:,} steps ({len(records) / args.steps:.1f} a step), "
          f"{per_commit} a commit")
    best: dict[bool, float] = {}
    for _ in range(args.rounds):
        for aggregate in (True, False):
            with tempfile.TemporaryDirectory() as directory:
                sink = SqliteSink(f"{directory}/run.sqlite", {"id": "bench", "name": "bench", "status": "running"},
                                  flush_interval_s=3600)
                t0 = time.process_time()
                for i in range(0, len(records), per_commit):
                    sink._write(records[i:i + per_commit], {}, aggregate=aggregate)
                cpu = time.process_time() - t0
                sink._con.close()
            best[aggregate] = min(best.get(aggregate, float("inf")), cpu)
    with_aggregates, rows = (1e6 * best[a] / args.steps for a in (True, False))
    print(f"writer CPU per step, least of {args.rounds} rounds: {with_aggregates:.1f} us with the aggregates, "
          f"{rows:.1f} us the rows alone (the aggregates {with_aggregates - rows:.1f} us)")


if __name__ == "__main__":
    main()

"""The run store under load: writer throughput and memory across a million phase records.

    python bench/store.py [--records 1000000]

1. Throughput: records pushed as fast as one thread can, then close(); records per second
   from the first put to the last commit.
2. Memory: a million phase records pushed in bursts of 1,000 every 20 ms (about 50,000 a
   second, twenty times what an 8-device run at 100 steps/s produces); the process's RSS is
   sampled every 100,000 records. It must stay bounded: the writer keeps up, and the buffer has a hard cap.
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from dpprof.records import PhaseRecord
from dpprof.recording import Run
from dpprof.store.reader import load_run
from dpprof.store.writer import MAX_BUFFERED_RECORDS, SqliteSink


def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _phase(i: int) -> PhaseRecord:
    return PhaseRecord(step=i // 8, call=0, phase="apply", device=f"cuda:{i % 8}", start_ms=i * 0.01,
                       duration_ms=1.0 + (i % 7) * 0.1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=1_000_000)
    args = parser.parse_args()
    n = args.records
    meta = Run(name="bench-store", store=False).metadata()
    with tempfile.TemporaryDirectory() as tmp:
        records = [_phase(i) for i in range(200_000)]
        sink = SqliteSink(f"{tmp}/throughput.sqlite", meta, max_buffered=len(records) + 1)
        t0 = time.perf_counter()
        for r in records:
            sink.put(r)
        t_put = time.perf_counter() - t0
        sink.close()
        elapsed = time.perf_counter() - t0
        stored = len(load_run(f"{tmp}/throughput.sqlite").phases)
        print(f"throughput: {len(records):,} phase records put in {t_put * 1e3:.0f} ms "
              f"({t_put / len(records) * 1e9:.0f} ns per put), committed in {elapsed:.2f} s: "
              f"{len(records) / elapsed:,.0f} records/s ({stored:,} read back)")
        del records

        sink = SqliteSink(f"{tmp}/memory.sqlite", meta)
        rss0 = _rss_mb()
        samples = []
        t0 = time.perf_counter()
        for i in range(n):
            sink.put(_phase(i))
            if i % 1000 == 999:
                time.sleep(0.02)  # ~50,000 records/s: 20 times an 8-device run at 100 steps/s
            if i % 100_000 == 99_999:
                samples.append(_rss_mb() - rss0)
        sink.close()
        elapsed = time.perf_counter() - t0
        print(f"memory: {n:,} phase records in {elapsed:.1f} s ({n / elapsed:,.0f}/s), dropped {sink.dropped}; "
              f"RSS growth every 100k records (MB): {', '.join(f'{s:.1f}' for s in samples)}")
        print(f"  max growth {max(samples):.1f} MB; buffer cap {MAX_BUFFERED_RECORDS:,} records")


if __name__ == "__main__":
    main()

"""The dashboard on long runs: file size and seconds to build each page for 8 devices x 50,000 and 1,000,000 steps.

    python bench/dashboard.py [--devices 8] [--steps 50000,1000000] [--backend cpu|cuda] [--runs 2] [--apptest]
                              [--detail bounded|all] [--keep DIR] [--trace-run RUN_FILE]

1. Synthesise each run: records shaped like the ones `dpprof profile` emits (a step of two forward calls:
   the model's scatter, replicate, parallel_apply, one apply per device and gather, then the loss on the
   output device; backward; a memory record per device and one for the loss; with
   --backend cuda also allocator records (after each apply on its device, after backward on every
   device) and NVML samples at 10 Hz), with realistic times (a straggler on the last device, noise, a slow
   step now and then), emitted into a dpprof Run as a recording does: its writer keeps the detail the
   retention keeps and builds the per-block aggregates; closing it stores its findings (the close hooks).
   The records are emitted as fast as the writer takes them (it is flushed every few thousand steps, so
   nothing is dropped).
2. Print the file's size, then time each page's data (dpprof.views, no cache: a first open) and figures
   (dpprof.charts), best of 3; Compare sets all the synthesised runs of that length side by side.
3. With --apptest, also time streamlit's AppTest running each page of app.py, once, with empty caches.

4. With --trace-run (the run file of an imported trace, e.g. of the 1 GiB trace ``bench/trace_import.py --keep DIR``
   makes, imported with ``dpprof import``), time the Operators, Kernels and Memory pages on it the same way
   (their views and figures, best of 3; with --apptest also under AppTest), after the synthesised runs (none
   with ``--steps ''``).

Exits 1 when a page takes PAGE_BUDGET_S or more, or a file is over FILE_BUDGET_BYTES.
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from pathlib import Path

from dpprof.records import (AllocatorRecord, DeviceMemoryRecord, DeviceRecord, GpuSampleRecord, NoteRecord,
                            PhaseRecord, StepRecord)
from dpprof.recording import CLOSE_HOOKS, Run

PAGE_BUDGET_S = 1.0  # each page of a day-long run opens in under a second
FILE_BUDGET_BYTES = 200e6  # 8 devices x 1,000,000 steps in at most 200 MB
FLUSH_EVERY_STEPS = 2_000  # the synthesis waits for the writer's commit this often: nothing is dropped


def synthesise(path: str, devices: int, steps: int, backend: str = "cpu", seed: int = 0,
               detail: str = "bounded") -> None:
    """Record a finished run of ``steps`` steps on ``devices`` devices through dpprof's recording path; its file
    ends up at ``path``."""
    rng = random.Random(seed)
    labels = [f"{backend}:{i}" for i in range(devices)]
    directory = os.path.dirname(path) or "."
    run = Run(name=f"bench {devices}x{steps} {backend}", reports_dir=directory, workload="cifar-lenet",
              workload_args={"batch_size": 32 * devices, "data": "synthetic", "devices": labels, "steps": steps},
              sample_hz=None, detail=detail)
    run.devices = list(labels)
    run.sink.update_run(backend=backend, devices=labels)
    sink = run.sink
    cuda = backend == "cuda"
    for label in labels:
        sink.put(DeviceRecord(device=label, kind=backend, name="CPU worker thread" if not cuda else "NVIDIA A100",
                              total_memory_bytes=40 * 2**30 if cuda else None, cores=2, threads=2,
                              cpu_model=None if cuda else "bench CPU"))
    if not cuda:
        sink.put(NoteRecord(t_ms=0.05, source="nvml", message="no CUDA GPU visible: GPU sampling is off"))
    batch, chunk = 32 * devices, 32
    t = 5.0
    alloc = {label: 600 * 2**20 for label in labels}
    next_sample = 0.0
    for step in range(steps):
        t0 = t
        slow = 3.0 if rng.random() < 0.002 else 1.0  # a hiccup now and then
        scatter = rng.gauss(0.15, 0.02) * slow
        replicate = rng.gauss(0.25 * devices, 0.05)
        applies = [max(1.0, rng.gauss(8.0, 0.6) * (1.25 if i == devices - 1 else 1.0) * slow)
                   for i in range(devices)]
        pa = max(applies) + 0.3
        gather = rng.gauss(0.12, 0.01)
        backward = max(5.0, rng.gauss(22.0, 1.5)) * slow
        loss, optimizer = 0.4, rng.gauss(2.5, 0.2)
        phases = [("scatter", labels[0], t0 + 0.05, scatter)]
        c = t0 + 0.05 + scatter
        phases.append(("replicate", labels[0], c, replicate))
        c += replicate
        pa_start = c
        for i, a in enumerate(applies):
            phases.append(("apply", labels[i], pa_start + 0.05 * (i + 1), a))
        phases.append(("parallel_apply", labels[0], pa_start, pa))
        c += pa
        phases.append(("gather", labels[0], c, gather))
        c += gather
        phases.append(("loss", labels[0], c, loss))  # the whole-batch loss on the output device: call 1
        c += loss + 0.05
        phases.append(("backward", labels[0], c, backward))
        end = c + backward + optimizer
        for name, label, start, ms in phases:
            sink.put(PhaseRecord(step=step, call=1 if name == "loss" else 0, phase=name, device=label,
                                 start_ms=start, duration_ms=ms, device_duration_ms=ms * 0.97 if cuda else None))
            if cuda and name in ("apply", "backward"):  # where the recorder reads the allocator
                for d in labels if name == "backward" else [label]:
                    alloc[d] = 600 * 2**20 + rng.randrange(0, 64 * 2**20) + (200 * 2**20 if d == labels[0] else 0)
                    sink.put(AllocatorRecord(step=step, call=0, device=d, phase=name, allocated_bytes=alloc[d],
                                             peak_allocated_bytes=alloc[d] + 50 * 2**20,
                                             reserved_bytes=1024 * 2**20))
        for label in labels:
            sink.put(DeviceMemoryRecord(
                step=step, call=0, device=label, chunk_size=chunk, input_bytes=chunk * 3 * 32 * 32 * 4,
                output_bytes=chunk * 10 * 4, activation_bytes=1_831_424,
                gathered_bytes=batch * 10 * 4 if label == labels[0] else 0, param_bytes=248_024, buffer_bytes=0))
        sink.put(DeviceMemoryRecord(step=step, call=1, device=labels[0], chunk_size=None, input_bytes=batch * 8,
                                    output_bytes=4, activation_bytes=batch * 48 + 4, gathered_bytes=0, param_bytes=0,
                                    buffer_bytes=0))  # the loss's targets and saved tensors
        sink.put(StepRecord(step=step, start_ms=t0, duration_ms=end - t0, batch_size=batch, devices_used=devices,
                            forward_calls=2, explicit=True))
        while cuda and next_sample <= end:
            for i, label in enumerate(labels):
                sink.put(GpuSampleRecord(
                    t_ms=next_sample, device=label, gpu_util_pct=min(100.0, rng.gauss(85 if i else 70, 5)),
                    memory_util_pct=rng.gauss(40, 3), memory_used_bytes=alloc[label] + 300 * 2**20,
                    memory_total_bytes=40 * 2**30, power_w=rng.gauss(250, 10), power_limit_w=400.0,
                    temperature_c=rng.gauss(62, 1), sm_clock_mhz=1410.0, throttle_reasons="gpu_idle"))
            next_sample += 100.0
        t = end + 0.2
        if step % FLUSH_EVERY_STEPS == FLUSH_EVERY_STEPS - 1:
            sink.flush(timeout_s=600)
    run.close(status="finished")
    if sink.dropped:
        raise RuntimeError(f"the writer dropped {sink.dropped} records: the synthesis outran it")
    for hook in CLOSE_HOOKS:  # what dpprof.record does after a run closes: its findings stored
        hook(run)
    os.replace(run.path, path)


def _best_of(fn, repeat: int = 3) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def page_builders(paths: list[str]) -> dict[str, object]:
    """Each page's data and figures, as the pages build them (dpprof.views, then dpprof.charts)."""
    from dpprof import charts
    from dpprof.views import compare as compare_view
    from dpprof.views import export as export_view
    from dpprof.views import load as load_view
    from dpprof.views import overview as overview_view
    from dpprof.views import timeline as timeline_view
    from dpprof.store.reader import list_runs, load_run

    path = paths[0]

    def runs():
        return list_runs(Path(path).parent)

    def overview():
        data = overview_view.overview(load_run(path))
        g = data.glance
        return [charts.device_glance(g.devices, g.work_phase, g.memory_source, *g.marked()),
                charts.step_times(data.steps), charts.phase_breakdown(data.breakdown), charts.phase_shares(data.totals)]

    def load():
        data = load_view.load(load_run(path))
        figs = [charts.work_distribution(data.work_samples), charts.memory_per_device(data.memory),
                charts.chunk_sizes(data.chunks)]
        return figs + ([charts.gpu_samples(data.gpu)] if not data.gpu.empty else [])

    def timeline():
        run = load_run(path)
        return [charts.timeline(*timeline_view.timeline(run, *timeline_view.default_timeline_range(run)))]

    def timeline_100():
        run = load_run(path)
        last = timeline_view.step_bounds(run)[1]
        return [charts.timeline(*timeline_view.timeline(run, last - 99, last))]

    def compare():
        data = compare_view.compare([load_run(p) for p in paths])
        return [charts.compare_step_times(data.steps), charts.compare_phase_shares(data.shares),
                charts.compare_memory(data.memory)]

    def export():
        return export_view.export_tables(load_run(path))

    return {"Runs": runs, "Overview": overview, "Per-GPU load": load, "Timeline (5 steps)": timeline,
            "Timeline (100 steps)": timeline_100, f"Compare ({len(paths)} runs)": compare, "Export": export}


def detail_page_builders(path: str) -> dict[str, object]:
    """The Operators, Kernels and Memory pages' data and figures for a run with operator data, as the pages build
    them (the first rank and device, grouped by name; the side by side of its first two devices where it has two)."""
    from dpprof import charts
    from dpprof.store.reader import load_run
    from dpprof.views import kernels, memory, operators, opdiff

    def operators_page():
        run = load_run(path)
        picks = operators.picks(run)
        top, value = operators.top_operators(run, picks[0])
        out = [charts.top_operators(top, value), operators.operator_table(run, picks[0]),
               operators.module_tree(run, picks[0])]
        if len(picks) > 1:
            diff = opdiff.operator_diff(run, picks[0], run, picks[1])
            out += [charts.operator_diff(diff, picks[0].label(), picks[1].label()),
                    opdiff.diff_sentence(diff, picks[0].label(), picks[1].label())]
        return out

    def kernels_page():
        run = load_run(path)
        pick = operators.picks(run)[0]
        return [kernels.gpu_summary(run), charts.gpu_metrics_per_step(kernels.gpu_per_step(run, pick)),
                kernels.kernel_table(run, pick)]

    def memory_page():
        run = load_run(path)
        if memory.missing_text(run):
            return [memory.missing_text(run)]
        pick = operators.picks(run)[0]
        peaks = memory.peaks(run, pick)
        return [charts.memory_over_time(memory.memory_curve(run, pick), peaks), memory.events(run, pick),
                memory.per_operator(run, pick)]

    def timeline_page():
        from dpprof.views import timeline as timeline_view

        run = load_run(path)
        return [charts.timeline(*timeline_view.timeline(run, *timeline_view.default_timeline_range(run)))]

    return {"Operators": operators_page, "Kernels": kernels_page, "Memory": memory_page,
            "Timeline (5 steps, streams)": timeline_page}


def page_seconds(run_id: str, page: str, compare_ids: list[str] | None = None, timeout_s: float = 300) -> float:
    """Seconds for AppTest to run one page of app.py on run ``run_id`` (and ``compare_ids`` on Compare), cold: the
    app run once on its first page, the caches emptied, then the page's own run timed. The reports directory is
    $DPPROF_REPORTS's. Raises RuntimeError where the page raised."""
    import streamlit as st
    from streamlit.testing.v1 import AppTest

    at = AppTest.from_file(str(Path(__file__).resolve().parents[1] / "app.py"), default_timeout=timeout_s)
    at.session_state["chosen_run"] = run_id
    if compare_ids:
        at.session_state["compare_ids"] = compare_ids
    at.run()
    at.switch_page(f"app_pages/{page}.py")
    st.cache_data.clear()
    t0 = time.perf_counter()
    at.run()
    seconds = time.perf_counter() - t0
    if at.exception:
        raise RuntimeError(f"{page}: {at.exception[0].message}")
    return seconds


def apptest_pages(paths: list[str], pages: tuple[str, ...] = ("runs", "overview", "load", "timeline", "compare",
                                                                "export")) -> dict[str, float]:
    """Seconds for AppTest to run each page of app.py on the first run, cold (empty caches)."""
    from dpprof.store.reader import load_run

    os.environ["DPPROF_REPORTS"] = str(Path(paths[0]).parent)
    ids = [load_run(p).id for p in paths]
    return {page: page_seconds(ids[0], page, ids, timeout_s=120) for page in pages}


def _lengths(text: str) -> list[int]:
    return [int(x.replace("_", "")) for x in text.split(",") if x.strip()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--steps", type=_lengths, default=[50_000, 1_000_000],
                        help="run lengths, comma-separated (default: 50000,1000000)")
    parser.add_argument("--backend", choices=["cpu", "cuda"], default="cpu",
                        help="cuda adds allocator records (each apply, and backward on every device) and NVML samples")
    parser.add_argument("--runs", type=int, default=2, help="runs of each length to synthesise (Compare shows them)")
    parser.add_argument("--detail", choices=["bounded", "all"], default="bounded", help="as dpprof.record's detail")
    parser.add_argument("--apptest", action="store_true", help="also time app.py's pages under AppTest")
    parser.add_argument("--keep", default=None, help="write the runs into this directory and keep them")
    parser.add_argument("--trace-run", default=None, help="an imported trace's run file: time the Operators, "
                        "Kernels and Memory pages on it")
    args = parser.parse_args()
    worst, largest = 0.0, 0
    with tempfile.TemporaryDirectory() as tmp:
        for steps in args.steps:
            directory = Path(args.keep or tmp) / f"{args.devices}x{steps}-{args.backend}-{args.detail}"
            directory.mkdir(parents=True, exist_ok=True)
            paths = []
            for i in range(args.runs):
                path = directory / f"bench-{args.devices}x{steps}-{args.backend}-{i}.sqlite"
                if not path.exists():
                    t0 = time.perf_counter()
                    synthesise(str(path), args.devices, steps, args.backend, seed=i, detail=args.detail)
                    print(f"recorded {path.name} in {time.perf_counter() - t0:.0f} s")
                paths.append(str(path))
            size = Path(paths[0]).stat().st_size
            largest = max(largest, size)
            print(f"{args.devices} devices x {steps:,} steps, {args.backend} records, detail {args.detail}: "
                  f"file {size / 1e6:.1f} MB ({size / steps / args.devices:.0f} bytes per device-step); "
                  f"page data + figures, best of 3 (budget {PAGE_BUDGET_S:.0f} s):")
            for page, build in page_builders(paths).items():
                seconds, _ = _best_of(build)
                worst = max(worst, seconds)
                print(f"  {page:<28} {seconds:6.2f} s")
            if args.apptest:
                print("  AppTest, each page's run of app.py with empty caches:")
                for page, seconds in apptest_pages(paths).items():
                    worst = max(worst, seconds)
                    print(f"  {page:<28} {seconds:6.2f} s")
    if args.trace_run:
        size = Path(args.trace_run).stat().st_size
        print(f"{Path(args.trace_run).name}: file {size / 1e6:.1f} MB; page data + figures, best of 3 "
              f"(budget {PAGE_BUDGET_S:.0f} s):")
        for page, build in detail_page_builders(args.trace_run).items():
            seconds, _ = _best_of(build)
            worst = max(worst, seconds)
            print(f"  {page:<28} {seconds:6.2f} s")
        if args.apptest:
            print("  AppTest, each page's run of app.py with empty caches:")
            for page, seconds in apptest_pages([args.trace_run], ("operators", "kernels", "memory", "timeline")).items():
                worst = max(worst, seconds)
                print(f"  {page:<28} {seconds:6.2f} s")
    ok = worst < PAGE_BUDGET_S and largest <= FILE_BUDGET_BYTES
    print(f"slowest page: {worst:.2f} s ({'within' if worst < PAGE_BUDGET_S else 'OVER'} the {PAGE_BUDGET_S:.0f} s "
          f"budget); largest file: {largest / 1e6:.1f} MB ({'within' if largest <= FILE_BUDGET_BYTES else 'OVER'} "
          f"{FILE_BUDGET_BYTES / 1e6:.0f} MB)")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()

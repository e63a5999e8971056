"""How far dpprof advise's predictions are from runs of the scenarios themselves, on this machine.

For each built-in workload and a user's model (``--model bench.advise_model:mlp``), recorded as DataParallel on
2 CPU workers: calibrate once, measure the model alone for every split of its batch (dpprof.advise.compute, as
``dpprof advise`` does), predict every scenario from the recorded run (DDP on 2 ranks, DataParallel on 1 to
4 workers, balanced, half and twice the batch), run each scenario's own command (the ``dpprof profile ...`` line
dpprof advise prints, started from the scenario's ``dpprof.launch.Profile`` in this process so that a run costs its
steps rather than a Python start-up; DDP starts torchrun and its ranks as ever), and print predicted against measured in one table with

- the median relative error of the step time over every scenario (aim: at most 10%; never above 15%),
- how many measured medians fall inside their predicted interval (aim: at least 2 of 3),
- the error of each device's peak held memory at twice the batch (aim: within 5%),
- beside each error, the same run's prediction from its recorded figures alone (without the measure of the model),
  so that what the measure buys is read in one run.

Every process runs with OMP_NUM_THREADS=1 by default (``--threads``): on the shared 2-core machine an OpenMP team
of 2 threads runs many times slower whenever another job holds a core, which no model of the run predicts.
Before each base run the calibration's cores are measured again (dpprof.advise.calibrate.refresh_load), as
``dpprof advise --calibrate`` run beside a recording would.
Each round (``--rounds``, default 3) records every workload's base run again and predicts from it; the order of
the scenarios rotates each round and reverses every other. Each scenario's prediction and measurement are the
medians over rounds.

    .venv/bin/python bench/advise.py                 # [--rounds N] [--steps N] [--only cifar-lenet,...] [--keep DIR]
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKLOADS = ["tutorial-linear", "cifar-lenet", "sorted-gru", "seg-fcn", "model"]
MODEL = {"model": "bench.advise_model:mlp", "input_shape": (256,), "batch_size": 64}  # dpprof.launch.Profile's


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30, help="steps of every run (the first is left out)")
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of every process (default 1)")
    parser.add_argument("--only", default=None, help="comma-separated workloads (model: the user's model)")
    parser.add_argument("--keep", default=None, help="record into this directory and keep it")
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # before torch is imported, here and in every child
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    os.chdir(ROOT)  # --model bench.advise_model:mlp imports from here
    sys.path.insert(0, str(ROOT))
    import pandas as pd

    from dpprof.advise.calibrate import calibrate, refresh_load
    from dpprof.advise.check import measured
    from dpprof.advise.compute import measure_compute
    from dpprof.launch import Profile
    from dpprof.advise.measured import measure
    from dpprof.advise.predict import advise, compute_layouts
    from dpprof.store.reader import load_run

    workloads = args.only.split(",") if args.only else WORKLOADS
    out = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="dpprof-advise-bench-"))
    t_start = time.perf_counter()
    cal = calibrate(2)
    print("\n".join(cal.lines()), flush=True)

    def run(profile: Profile, name: str) -> str:
        """A scenario's profile (the one its command starts), in this process (torch imported once: a run costs its
        steps, not a start-up); DDP's still starts torchrun and its ranks. Its environment (OMP_NUM_THREADS, set
        above for every process) is left out: with one, Profile.run would start a child."""
        run_id = replace(profile, env={}, reports_dir=str(out), name=name).run()
        gc.collect()  # no run pays for collecting another's garbage
        return run_id

    rows = []  # one per workload, scenario and round
    memory_rows = []
    cores = []  # the effective cores measured before each base run
    waits = []  # and DDP's wait
    for r in range(args.rounds):
        for w in workloads:
            what = MODEL if w == "model" else {"workload": w}
            cal = refresh_load(cal)  # the cores and DDP's wait now, as dpprof advise --calibrate right after a run
            cores.append(cal.effective_cores)
            waits.append(cal.ddp_sync_ms)
            base_id = run(Profile(**what, devices="cpu:2", steps=args.steps), f"base {w} round {r}")
            m = measure(load_run(base_id, out))
            probe = measure_compute(m, compute_layouts(m))  # as dpprof advise does, before it predicts
            advice = advise(m, cal, steps=args.steps, compute=probe)
            # the same run predicted from its recorded figures alone (no measure of the model): the step it would say
            recorded_only = {s.label: s.step_ms for s in advise(m, cal, steps=args.steps).scenarios}
            order = list(advice.scenarios)
            shift = (r * 3) % len(order)
            order = order[shift:] + order[:shift]
            if r % 2:
                order.reverse()
            for s in order:
                run_id = run(s.profile, f"{w}: {s.label} round {r}")
                step, held = measured(run_id, out)
                rows.append({"workload": w, "scenario": s.label.replace(" (recorded)", " (recorded, again)"),
                             "kind": s.scenario, "devices": s.devices, "batch": s.batch_size, "round": r,
                             "predicted_ms": s.step_ms, "low_ms": s.step_ms_low, "high_ms": s.step_ms_high,
                             "recorded_only_ms": recorded_only[s.label],
                             "measured_ms": step, "base_ms": advice.measured_step_ms})
                if s.batch_size == 2 * advice.measured.batch_size:
                    for device, b in held.items():
                        memory_rows.append({"workload": w, "device": device, "round": r,
                                            "predicted_bytes": s.peak_bytes.get(device), "measured_bytes": b})
            print(f"  {w} round {r} done ({time.perf_counter() - t_start:.0f} s)", flush=True)
    df = pd.DataFrame(rows)
    per = df.groupby(["workload", "scenario"], sort=False).agg(
        predicted_ms=("predicted_ms", "median"), low_ms=("low_ms", "median"), high_ms=("high_ms", "median"),
        recorded_only_ms=("recorded_only_ms", "median"),
        measured_ms=("measured_ms", "median"), base_ms=("base_ms", "median")).reset_index()
    per["error"] = (per["predicted_ms"] - per["measured_ms"]) / per["measured_ms"]
    per["recorded_only_error"] = (per["recorded_only_ms"] - per["measured_ms"]) / per["measured_ms"]
    per["inside"] = (per["low_ms"] <= per["measured_ms"]) & (per["measured_ms"] <= per["high_ms"])
    pd.set_option("display.width", 250)
    print()
    print(f"predicted against measured, OMP_NUM_THREADS={args.threads}, {args.steps} steps a run, "
          f"{args.rounds} round(s), {time.perf_counter() - t_start:.0f} s:")
    shown = per.assign(**{"interval (ms)": [f"{lo:.2f}-{hi:.2f}" for lo, hi in zip(per["low_ms"], per["high_ms"])],
                          "error": per["error"].map("{:+.1%}".format),
                          "without the measure": per["recorded_only_error"].map("{:+.1%}".format),
                          "inside": per["inside"].map({True: "yes", False: "no"})})
    print(shown[["workload", "scenario", "base_ms", "predicted_ms", "interval (ms)", "measured_ms", "error",
                 "inside", "without the measure"]].to_string(index=False, float_format="{:.2f}".format))
    mem = pd.DataFrame(memory_rows)
    print()
    if len(mem):
        mem = mem.groupby(["workload", "device"], sort=False)[["predicted_bytes", "measured_bytes"]].median().reset_index()
        mem["error"] = (mem["predicted_bytes"] - mem["measured_bytes"]) / mem["measured_bytes"]
        print("peak held memory at twice the batch, per device:")
        print(mem.assign(error=mem["error"].map("{:+.3%}".format)).to_string(index=False))
    print()
    errors = per["error"].abs()
    print(f"median |error| of the step time: {errors.median():.1%} over {len(per)} scenarios "
          f"(aim at most 10%, never above 15%); by workload: "
          + ", ".join(f"{w} {g.median():.1%}" for w, g in per.assign(e=errors).groupby("workload", sort=False)["e"]))
    one = per[per["scenario"].str.contains("on 1 CPU worker")]
    print(f"the same predicted from the recorded figures alone (no measure of the model alone): median |error| "
          f"{per['recorded_only_error'].abs().median():.1%}, above 15% {int((per['recorded_only_error'].abs() > 0.15).sum())}"
          f" of {len(per)} (with the measure: {int((errors > 0.15).sum())})")
    print("one worker, with the measure / without: " + ", ".join(
        f"{w} {e:+.1%} / {r:+.1%}" for w, e, r in zip(one["workload"], one["error"], one["recorded_only_error"])))
    print(f"measured inside the predicted interval: {int(per['inside'].sum())} of {len(per)} (aim at least 2 of 3)")
    if len(mem):
        print(f"peak memory at twice the batch: largest |error| {mem['error'].abs().max():.3%} (aim within 5%)")
    again = per[per["scenario"].str.contains("recorded, again")]
    print("the recorded set-up run again against its own base (the machine's drift between two runs): "
          + ", ".join(f"{w} {e:+.1%}" for w, e in zip(again["workload"], again["measured_ms"] / again["base_ms"] - 1)))
    print("cores this job got, measured before each base run: " + ", ".join(f"{c:.2f}" for c in cores))
    print("a real DDP run's wait at its all-reduce, ms, before each base run: " + ", ".join(f"{w:.2f}" for w in waits))
    print(f"runs in {out}" if args.keep else "")


if __name__ == "__main__":
    main()

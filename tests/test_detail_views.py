"""The Operators, Kernels and Memory pages' views, the side-by-side difference (dpprof.views.opdiff) and the
findings from operator data (dpprof.findings.detail), on the real GPU traces of ../shared/traces and on CPU
traces recorded here with the condition each finding is about (tests/detail_traces.py)."""
from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest
import torch
from streamlit.testing.v1 import AppTest

import dpprof
from dpprof import charts
from dpprof.findings import run_findings
from dpprof.findings.detail import DATA_SHARE_WARN, GPU_UTIL_LOW_PCT, MEMORY_FULL_SHARE, TC_UNUSED_SHARE
from dpprof.plaintext import shown_text
from dpprof.store import detail_rows
from dpprof.trace import import_traces
from dpprof.trace.detail import detail_of_trace
from dpprof.trace.export import write_trace
from dpprof.views import kernels, memory, operators, opdiff
from dpprof.views.opdiff import Pick
from detail_traces import SlowSet, slow_loader_trace, straggler_ddp_traces, with_gpu_memory
from dpprof.workloads import build_workload, train
from recorded import record

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT.parent / "shared" / "traces"
RESNET = TRACES / "resnet50-1gpu-tb-sample.pt.trace.json.gz"
DDP2 = TRACES / "ddp-2ranks-rank0-nccl.json.gz"
DDP128 = [TRACES / "ddp-128ranks-rank0-sampled.json.gz", TRACES / "ddp-128ranks-rank1-sampled.json.gz"]
APP = ROOT / "app.py"
SMALL_GPU_BYTES = int(2.8 * 2**30)  # the ResNet-50 trace's GPU peaks at 2.6 GiB: 93% of this
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

pytestmark = [pytest.mark.skipif(not RESNET.exists(), reason="../shared/traces is not beside the project"),
              pytest.mark.slow]  # its fixture records DDP under torchrun and captures


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The shared traces imported, two CPU traces recorded here (a DataLoader that dominates the step; a gloo DDP
    job whose rank 1 does extra matrix products), the ResNet-50 trace on a GPU given 2.8 GiB (its peak is 2.6 GiB),
    a run recorded with a deep capture, and one without operator data."""
    d = tmp_path_factory.mktemp("detail")
    reports = d / "reports"

    def load(files, name):
        return dpprof.load_run(import_traces(files, reports, name=name, jobs=1).id, reports)

    small_gpu = with_gpu_memory(RESNET, d / "resnet-small-gpu.pt.trace.json.gz", SMALL_GPU_BYTES)
    return SimpleNamespace(
        reports=reports,
        resnet=load([RESNET], "resnet"), ddp2=load([DDP2], "ddp2"), ddp128=load(DDP128, "ddp128"),
        loader=load([slow_loader_trace(d / "loader")], "loader"),
        straggler=load(straggler_ddp_traces(d / "straggler"), "straggler"),
        small_gpu=load([small_gpu], "smallgpu"),
        recorded=record(reports, "recorded", workers=2, steps=4),
        captured=dpprof.load_run(train(build_workload("cifar-lenet", 32), dpprof.cpu_devices(2), 5, name="captured",
                                       reports_dir=str(reports), capture="2:4").path))


def _kinds(run) -> dict[str, pd.Series]:
    table = run_findings(run).table
    return {r["kind"]: r for _, r in table.iterrows()}


# -- side by side ---------------------------------------------------------------------------------

def _expected(a: pd.DataFrame, b: pd.DataFrame, clock: str) -> pd.Series:
    """B's self time less A's per operator name, from two readers' rows (0 where a side lacks the operator)."""
    col = f"{clock}_self_ms"
    left = a.groupby("name")[col].sum().astype(float)
    right = b.groupby("name")[col].sum().astype(float)
    names = left.index.union(right.index)
    return right.reindex(names, fill_value=0.0) - left.reindex(names, fill_value=0.0)


@pytest.mark.parametrize("case", ["two ranks", "two runs", "cpu ranks"])
def test_the_diff_is_the_difference_of_the_two_readers_rows(runs, case):
    if case == "two ranks":
        run_a = run_b = runs.ddp128
        pick_a, pick_b, clock = Pick(rank=0), Pick(rank=1), "device"
    elif case == "two runs":
        run_a, run_b, pick_a, pick_b, clock = runs.resnet, runs.ddp2, Pick(), Pick(), "device"
    else:
        run_a = run_b = runs.straggler
        pick_a, pick_b, clock = Pick(device="rank:0"), Pick(device="rank:1"), "host"
    diff = opdiff.operator_diff(run_a, pick_a, run_b, pick_b)
    assert diff.attrs["clock"] == clock
    a = detail_rows.operators(run_a, rank=pick_a.rank, device=pick_a.device)
    b = detail_rows.operators(run_b, rank=pick_b.rank, device=pick_b.device)
    steps_a, steps_b = detail_rows.detail_step_count(run_a), detail_rows.detail_step_count(run_b)
    if steps_a != steps_b:  # two runs' traces of different lengths: A's totals over as many steps as B's
        assert diff.attrs["steps"] == steps_b and diff.attrs["scaled_a"] == {0: steps_a}, diff.attrs
        a = a.assign(**{c: a[c] * steps_b / steps_a for c in ("calls", f"{clock}_self_ms")})
    expected = _expected(a, b, clock)
    got = diff.set_index("name")["delta_ms"]
    assert set(got.index) == set(expected.index) and len(got) == len(expected)
    pd.testing.assert_series_equal(got.sort_index(), expected.sort_index(), check_names=False, rtol=1e-9, atol=1e-9)
    calls_b = b.groupby("name")["calls"].sum()
    assert (diff.set_index("name")["calls_b"].reindex(calls_b.index) == calls_b).all()
    assert diff["delta_ms"].abs().is_monotonic_decreasing  # largest difference first
    assert abs(diff["delta_ms"].sum() - (b[f"{clock}_self_ms"].sum() - a[f"{clock}_self_ms"].sum())) < 1e-6


def test_the_sentence_names_the_whole_difference_and_the_operators_behind_it(runs):
    diff = opdiff.operator_diff(runs.ddp128, Pick(rank=0), runs.ddp128, Pick(rank=1))
    text = opdiff.diff_sentence(diff, "rank 0", "rank 1")
    total = diff["delta_ms"].sum()
    top = diff[diff["delta_ms"] * total > 0].iloc[0]
    assert text.startswith(f"rank 1 is {abs(total):.1f} ms {'slower' if total > 0 else 'faster'} than rank 0")
    assert f"`{top['name']}` {top['delta_ms']:+.1f} ms" in text


def test_kernel_diff_is_the_difference_of_the_kernel_readers(runs):
    diff = opdiff.kernel_diff(runs.ddp128, Pick(rank=0), runs.ddp128, Pick(rank=1))
    a = detail_rows.kernels(runs.ddp128, rank=0).groupby("name")["total_ms"].sum()
    b = detail_rows.kernels(runs.ddp128, rank=1).groupby("name")["total_ms"].sum()
    names = a.index.union(b.index)
    expected = b.reindex(names, fill_value=0) - a.reindex(names, fill_value=0)
    got = diff.set_index("name")["delta_ms"]
    pd.testing.assert_series_equal(got.sort_index(), expected.sort_index(), check_names=False, rtol=1e-9)


# -- findings -----------------------------------------------------------------------------------

def test_data_loading_fires_where_loading_takes_the_step_and_not_elsewhere(runs):
    for run in (runs.resnet, runs.loader):  # the plugin's own sample has num_workers=0; the CPU loader sleeps
        found = _kinds(run)["data_loading"]
        phases, steps = run.phases, run.steps
        later = steps[steps["step"] != steps["step"].min()]
        data = phases[(phases["phase"] == "data") & phases["step"].isin(later["step"])]["duration_ms"].sum()
        share = data / later["duration_ms"].sum()
        assert share > DATA_SHARE_WARN
        assert found["value"] == pytest.approx(share, rel=1e-9)
    assert "data_loading" not in _kinds(runs.ddp2)  # 2 ms of loading in a 667 ms trace


@pytest.mark.parametrize("num_workers", [0, 2])
def test_data_loading_advice_follows_whether_the_traced_loader_has_workers(tmp_path, num_workers):
    """torch.profiler names the iterator that ran (_MultiProcessingDataLoaderIter with workers): a job loading in 2
    workers that still waits is told they do not keep up, not to load in workers (num_workers=4 or more)."""
    trace = slow_loader_trace(tmp_path, num_workers=num_workers)
    found = _kinds(dpprof.load_run(import_traces([trace], tmp_path / "r", jobs=1).id, tmp_path / "r"))["data_loading"]
    if num_workers:
        assert "num_workers=4 or more" not in found["advice"]
        assert "already loads in worker processes: they do not keep up" in found["advice"]
        assert found["evidence"].endswith("already loads in worker processes (the trace's "
                                          "_MultiProcessingDataLoaderIter)")
    else:
        assert "load in DataLoader worker processes (num_workers=4 or more" in found["advice"]
        assert found["evidence"].endswith("the DataLoader loads in the training process (num_workers=0)")


def test_data_loading_advice_names_a_recorded_ddp_loaders_own_settings(tmp_path):
    """A DDP rank recorded while its DataLoader loads in 2 workers (pin_memory off, prefetch_factor 2): the advice
    names what is left (more than 2 workers, persistent_workers, prefetch_factor), from the settings the recorder noted
    as the loader was iterated. Not pin_memory, nor work moved to the GPU, for this gloo rank on a CPU: a loader pins
    memory only for an accelerator (torch warns that it finds none); the advice named them for CPU ranks too."""
    import torch.distributed as dist
    from torch import nn
    from torch.utils.data import DataLoader

    from dpprof.instrument import instrument

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with instrument(name="loader", reports_dir=tmp_path, sample_hz=None) as run:
            net = nn.parallel.DistributedDataParallel(nn.Linear(64, 10))
            opt = torch.optim.SGD(net.parameters(), lr=0.01)
            for i, x in enumerate(DataLoader(SlowSet(), batch_size=8, num_workers=2)):
                net(x).sum().backward()
                opt.step()
                if i == 5:
                    break
    finally:
        dist.destroy_process_group()
    stored = dpprof.load_run(run.path)
    assert stored.data_loaders() == {0: [{"workers": True, "num_workers": 2, "persistent_workers": False,
                                          "pin_memory": False, "prefetch_factor": 2}]}
    found = _kinds(stored)["data_loading"]
    assert found["evidence"].endswith("the DataLoader already loads in num_workers=2")
    assert "num_workers=4 or more" not in found["advice"]
    for left in ("more workers than 2", "persistent_workers=True (its workers start again each epoch)",
                 "a larger prefetch_factor (it is 2)"):
        assert left in found["advice"]
    assert "pin_memory" not in found["advice"] and "GPU" not in found["advice"], found["advice"]
    # exported as a trace (dpprof export --trace) and imported again: the same loaders, the same advice (it read
    # 'load in DataLoader worker processes (num_workers=4 or more' again: the export did not carry them)
    write_trace(stored, tmp_path / "exported.json.gz")
    again = dpprof.load_run(import_traces([tmp_path / "exported.json.gz"], tmp_path / "r", jobs=1).id, tmp_path / "r")
    assert again.data_loaders() == stored.data_loaders()
    assert _kinds(again)["data_loading"]["advice"] == found["advice"]


def test_low_gpu_utilization_is_the_kernels_pages_figure(runs):
    util = detail_rows.gpu_summary(runs.ddp2)["utilization_pct"].iloc[0]
    assert util < GPU_UTIL_LOW_PCT
    found = _kinds(runs.ddp2)
    assert found["gpu_utilization"]["value"] == pytest.approx(util / 100)  # a share (FindingRecord.unit)
    assert found["gpu_utilization"]["unit"] == "share"
    assert "gpu_idle" not in found  # said once, by the utilization finding
    resnet = detail_rows.gpu_summary(runs.resnet)["utilization_pct"].iloc[0]
    assert resnet >= GPU_UTIL_LOW_PCT and "gpu_utilization" not in _kinds(runs.resnet)  # 55%: the real figure decides


def test_a_gpu_whose_process_iterates_no_dataloader_is_not_told_of_dataloader_workers(runs):
    """gpu_utilization and gpu_idle told a GPU waiting on its host to add DataLoader workers, whatever the run said of
    its loaders. The real 2-rank trace's rank 0 (its GPU busy 1% of the step), read as a rank recorded with the watch
    on and no DataLoader iterated (``data_loaders`` [], as dpprof's export of such a rank carries it), is pointed at
    the script's own work between steps instead; read as the trace says it (nothing of its loaders), the words stay."""
    import dataclasses

    from dpprof.findings import tables_of
    from dpprof.findings.detail import NO_LOADER_WORDS, gpu_utilization
    from dpprof.findings.gpu import gpu_idle

    said = tables_of(runs.ddp2)
    assert said.data_loaders == {}  # the trace has no DataLoader ranges: it says nothing
    none = dataclasses.replace(said, data_loaders={0: []})
    for rule in (gpu_utilization, gpu_idle):
        [before], [after] = rule(said), rule(none)
        assert "DataLoader workers" in before["advice"] and NO_LOADER_WORDS not in before["advice"]
        assert NO_LOADER_WORDS in after["advice"] and "DataLoader workers" not in after["advice"]
        assert {k: v for k, v in after.items() if k != "advice"} == {k: v for k, v in before.items() if k != "advice"}


def test_tensor_cores_unused_on_fp32_resnet_and_not_where_they_are_used(runs):
    found = _kinds(runs.resnet)["tensor_cores_unused"]
    k = detail_rows.kernels(runs.resnet, by="operator")
    ops = detail_rows.operators(runs.resnet)
    eligible = set(ops.loc[ops["tc_eligible"].fillna(False).astype(bool), "name"])
    plain = k[k["operator"].isin(eligible) & ~k["tensor_cores"].fillna(False).astype(bool)]["total_ms"].sum()
    assert found["value"] == pytest.approx(plain / k["total_ms"].sum()) and found["value"] > TC_UNUSED_SHARE
    assert "aten::cudnn_convolution" in found["evidence"]
    assert "tensor_cores_unused" not in _kinds(runs.ddp2)  # the A100 trace runs its convolutions on tensor cores
    assert "tensor_cores_unused" not in _kinds(runs.loader)  # no kernels at all


def test_memory_full_fires_on_a_gpu_too_small_for_the_peak(runs):
    peaks = detail_rows.memory_peaks(runs.small_gpu).set_index("device")
    found = _kinds(runs.small_gpu)["memory_full"]
    assert found["device"] == "cuda:0"
    assert found["value"] == pytest.approx(peaks.loc["cuda:0", "peak_allocated_bytes"] / SMALL_GPU_BYTES)
    assert found["value"] > MEMORY_FULL_SHARE
    assert f"step {int(peaks.loc['cuda:0', 'peak_step'])}" in found["evidence"]
    assert "memory_full" not in _kinds(runs.resnet)  # the same 2.6 GiB on the trace's own 32 GiB V100


def test_a_straggler_finding_names_the_operators_behind_it(runs):
    found = _kinds(runs.straggler)["straggler_rank"]
    assert found["device"] == "rank:1"
    assert "Operators behind it" in found["evidence"] and "'aten::mm'" in found["evidence"]


def test_the_operators_behind_a_finding_of_a_captured_run_are_over_the_captures_steps(runs):
    """The captured run's tables span its capture (steps 2 and 3 of 5): a straggler's operators are said over 2."""
    from dpprof.findings import tables_of
    from dpprof.findings.detail import explain
    t = tables_of(runs.captured)
    assert t.detail is not None and t.detail.operator_steps == detail_rows.detail_step_count(runs.captured) == 2
    [row] = explain([{"kind": "straggler", "device": "cpu:1", "evidence": "cpu:1 is slower"}], t)
    assert " over 2 steps" in row["evidence"], row["evidence"]
    # the lead as the difference's sign says: a cpu:1 whose operators are faster is not late for them
    faster = " ms faster than the others' mean" in row["evidence"]
    assert ("Operators behind it" in row["evidence"]) == (not faster), row["evidence"]
    assert ("Not its operators, which are faster than the others'" in row["evidence"]) == faster, row["evidence"]


def test_show_prints_the_findings_the_page_reads(runs, capsys):
    from dpprof.cli import main
    assert main(["--reports-dir", str(runs.reports), "show", runs.ddp2.id]) == 0
    out = capsys.readouterr().out
    found = _kinds(runs.ddp2)["gpu_utilization"]
    assert found["title"] in out


# -- views and pages ----------------------------------------------------------------------------

def test_views_give_what_the_pages_draw(runs):
    run = runs.resnet
    pick = operators.picks(run)[0]
    top, value = operators.top_operators(run, pick)
    assert value == "device_self_ms" and top[value].is_monotonic_decreasing and len(top) == operators.TOP_OPERATORS
    charts.top_operators(top, value)
    assert len(kernels.gpu_per_step(run, pick)) == run.model.steps
    curve, peaks = memory.memory_curve(run, pick), memory.peaks(run, pick)
    fig = charts.memory_over_time(curve, peaks)
    marker = [t for t in fig.data if t.name.endswith("peak")][0]
    assert f"step {int(peaks['peak_step'].iloc[0])}" in marker.text[0]
    loader_tree = operators.module_tree(runs.loader, operators.picks(runs.loader)[0])
    assert "Sequential_0/Linear_0" in set(loader_tree["path"])
    for view in (operators.missing_text, kernels.missing_text, memory.missing_text):
        assert view(run) is None
        assert "--capture" in view(runs.recorded)
    assert "CPU" in kernels.missing_text(runs.loader)
    assert "profile_memory" in memory.missing_text(runs.ddp2)


def _page(at: AppTest, page: str) -> AppTest:
    at.switch_page(f"app_pages/{page}.py").run()
    assert not at.exception, [e.message for e in at.exception]
    return at


@pytest.mark.parametrize("page", ["operators", "kernels", "memory"])
def test_pages_render_for_a_run_with_data_and_say_why_for_one_without(runs, monkeypatch, page):
    monkeypatch.setenv("DPPROF_REPORTS", str(runs.reports))
    at = AppTest.from_file(str(APP), default_timeout=120)
    at.run()
    at.session_state["chosen_run"] = runs.resnet.id
    _page(at, page)
    assert at.get("plotly_chart"), page
    texts = "\n".join(shown_text(e.value) for e in at.markdown)
    if page == "memory":
        assert "in step" in texts
    if page == "kernels":
        assert "GPU busy time" in texts  # the plugin's definitions on the page
    at.session_state["chosen_run"] = runs.recorded.id
    _page(at, page)
    assert not at.get("plotly_chart")
    info = "\n".join(shown_text(e.value) for e in at.info)
    assert "--capture" in info


def test_the_operators_page_sets_two_ranks_side_by_side(runs, monkeypatch):
    monkeypatch.setenv("DPPROF_REPORTS", str(runs.reports))
    at = AppTest.from_file(str(APP), default_timeout=120)
    at.run()
    at.session_state["chosen_run"] = runs.straggler.id
    _page(at, "operators")
    assert operators.picks(runs.straggler) == [Pick(0, "rank:0"), Pick(1, "rank:1")]
    assert operators.picks(runs.resnet) == [Pick(None, "cuda:0")]  # one rank: its devices alone
    at.selectbox(key="ops_pick").select(Pick(1, "rank:1")).run()
    assert not at.exception, [e.message for e in at.exception]
    at.selectbox(key="ops_a").select(Pick(0, "rank:0")).run()
    assert not at.exception, [e.message for e in at.exception]
    texts = "\n".join(shown_text(e.value) for e in at.markdown).replace("`", "")
    diff = opdiff.operator_diff(runs.straggler, Pick(0, "rank:0"), runs.straggler, Pick(1, "rank:1"))
    assert f"rank 1 is {diff['delta_ms'].sum():.1f} ms slower than rank 0" in texts
    assert diff.iloc[0]["name"] in texts
    assert len(at.get("plotly_chart")) == 2  # the top operators and the difference


# -- the Timeline's GPU stream lanes ------------------------------------------------------------

def test_stream_lanes_hold_every_kernel_of_the_steps_on_its_stream(runs):
    """Each stream's spans add up to the kernels the file itself puts in the steps on that stream (counted here
    with gzip + json): same count, same time; and the Timeline draws a lane per stream below the host's."""
    import gzip
    import json
    import re

    with gzip.open(RESNET, "rt") as f:
        doc = json.load(f)
    steps = [(e["ts"], e["ts"] + e["dur"]) for e in doc["traceEvents"]
             if e.get("ph") == "X" and re.fullmatch(r"ProfilerStep#\d+", str(e.get("name", "")))]
    busy: dict[str, float] = {}
    count: dict[str, int] = {}
    for e in doc["traceEvents"]:
        if e.get("ph") == "X" and e.get("cat") in ("Kernel", "kernel") and any(a <= e["ts"] < b for a, b in steps):
            stream = str(e["tid"]).removeprefix("stream ")
            busy[stream] = busy.get(stream, 0.0) + e["dur"] / 1e3
            count[stream] = count.get(stream, 0) + 1
    spans = detail_rows.stream_spans(runs.resnet, 0, 10**6)
    per = spans.groupby("stream").agg(busy_ms=("busy_ms", "sum"), kernels=("kernels", "sum"))
    assert per["kernels"].to_dict() == count
    assert per["busy_ms"].to_dict() == pytest.approx(busy, rel=1e-9)
    assert (spans["busy_ms"] <= spans["duration_ms"] + 1e-9).all()
    from dpprof.views import timeline
    phases, steps_df = timeline.timeline(runs.resnet, *timeline.default_timeline_range(runs.resnet))
    lanes = phases[phases["phase"] == timeline.STREAM_PHASE]
    assert set(lanes["device"]) == {f"cuda:0 stream {s}" for s in count}
    fig = charts.timeline(phases, steps_df)
    assert list(fig.layout.yaxis.categoryarray)[0] == "cuda:0 stream 7"  # the bottom lane
    assert detail_rows.stream_spans(runs.loader, 0, 10**6).empty  # a CPU trace: no lanes


def test_ops_vs_prints_the_pages_sentence_and_the_difference(runs, capsys):
    from dpprof.cli import main
    import json

    base = ["--reports-dir", str(runs.reports), "ops"]
    assert main([*base, runs.straggler.id, "--device", "rank:1", "--vs", "rank:0", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    diff = opdiff.operator_diff(runs.straggler, Pick(None, "rank:0"), runs.straggler, Pick(None, "rank:1"))
    assert doc["sentence"] == opdiff.diff_sentence(diff, "rank 0", "rank 1", quote="", steps=runs.straggler.model.steps)
    assert [r["name"] for r in doc["operators"]] == diff["name"].head(20).tolist()
    assert [r["delta_ms"] for r in doc["operators"]] == pytest.approx(diff["delta_ms"].head(20).tolist())
    assert main([*base, runs.ddp2.id, "--vs", runs.recorded.id]) == 1  # a run without operators: one line
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--capture" in err[0]


def test_pages_on_a_captured_run_show_each_worker_and_say_what_the_capture_lacks(runs, monkeypatch):
    """A deep capture on CPU workers: each worker's operators under its device, set side by side on the Operators
    page; no kernels and no memory events, each said in a sentence."""
    picks = operators.picks(runs.captured)
    assert {p.device for p in picks} >= {"cpu:0", "cpu:1"}
    monkeypatch.setenv("DPPROF_REPORTS", str(runs.reports))
    at = AppTest.from_file(str(APP), default_timeout=120)
    at.run()
    at.session_state["chosen_run"] = runs.captured.id
    _page(at, "operators")
    at.selectbox(key="ops_pick").select(Pick(None, "cpu:1")).run()
    at.selectbox(key="ops_a").select(Pick(None, "cpu:0")).run()
    assert not at.exception, [e.message for e in at.exception]
    diff = opdiff.operator_diff(runs.captured, Pick(None, "cpu:0"), runs.captured, Pick(None, "cpu:1"))
    texts = "\n".join(shown_text(e.value) for e in at.markdown).replace("`", "")
    assert f"cpu:1 is {abs(diff['delta_ms'].sum()):.1f} ms" in texts
    for page, words in (("kernels", "No GPU kernels"), ("memory", "no [memory] events")):
        _page(at, page)
        assert not at.get("plotly_chart")
        assert words in "\n".join(shown_text(e.value) for e in at.info)


def test_the_pages_read_the_capture_picked_and_the_latest_by_default(runs, tmp_path, monkeypatch):
    """A run keeping two captures' tables (the captured run's raw trace as steps 2-3, the ResNet-50 trace as steps
    10-11): the Operators page offers both, shows the latest at first and the other once picked; a run with one
    capture offers no picker."""
    reports = tmp_path / "reports"
    two = record(reports, "two captures", workers=2, steps=3)
    [raw] = [p for p in runs.reports.iterdir() if p.name.startswith(f"{runs.captured.id}.capture-")]
    detail_rows.write_detail(two.path, detail_of_trace(raw), detail_rows.Capture(2, 4, (raw.name,)))
    detail_rows.write_detail(two.path, detail_of_trace(RESNET), detail_rows.Capture(10, 12))
    one = record(reports, "one capture", workers=2, steps=3)
    detail_rows.write_detail(one.path, detail_of_trace(raw), detail_rows.Capture(2, 4, (raw.name,)))
    monkeypatch.setenv("DPPROF_REPORTS", str(reports))
    at = AppTest.from_file(str(APP), default_timeout=120)
    at.run()
    at.session_state["chosen_run"] = two.id
    _page(at, "operators")
    box = at.selectbox(key=f"capture_{two.id}")
    assert box.options == ["steps 10 to 11 (latest)", "steps 2 to 3"]

    def shown_calls() -> int:
        return int(at.dataframe[0].value["calls"].sum())

    stored = dpprof.load_run(two.path)
    assert shown_calls() == detail_rows.operators(stored)["calls"].sum() == runs.resnet.operators()["calls"].sum()
    box.select(2).run()
    assert not at.exception, [e.message for e in at.exception]
    stored.capture = 2
    assert shown_calls() == detail_rows.operators(stored)["calls"].sum() != runs.resnet.operators()["calls"].sum()
    at.session_state["chosen_run"] = one.id  # one capture: nothing to pick
    _page(at, "operators")
    assert shown_calls() == detail_rows.operators(dpprof.load_run(one.path))["calls"].sum()
    assert not [b for b in at.selectbox if b.key and b.key.startswith("capture_")]

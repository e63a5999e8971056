"""dpprof.charts: figures drawn from what the store's queries return for runs the CPU backend records."""
from __future__ import annotations

from pathlib import Path

import plotly.graph_objects as go
import pytest

import dpprof
from dpprof import charts
from dpprof.trace import import_traces
from dpprof.units import bytes_unit
from dpprof.views import compare, kernels, load, overview
from dpprof.views.opdiff import Pick
from dpprof.devices import chunk_sizes
from dpprof.store import queries
from recorded import BUS, record, record_with_gpu_samples


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    directory = tmp_path_factory.mktemp("reports")
    return {"plain": record(directory, "plain", workers=2, steps=6, batch_size=32),
            "three": record(directory, "three", workers=3, steps=4, batch_size=30)}


def _names(fig: go.Figure) -> list[str]:
    return [t.name for t in fig.data]


def test_step_times_is_one_line_or_a_median_with_its_band(runs):
    run = runs["plain"]
    fig = charts.step_times(queries.step_times(run))
    assert _names(fig) == ["step time"] and list(fig.data[0].y) == run.steps["duration_ms"].tolist()
    fig = charts.step_times(queries.step_times(run, max_points=2))
    assert _names(fig) == [None, "min-max", "median"] and "every 3 steps: median" in fig.layout.title.text
    durations = run.steps.sort_values("step")["duration_ms"]
    assert list(fig.data[2].y) == [durations.iloc[i:i + 3].median() for i in range(0, len(durations), 3)]
    assert list(fig.data[0].y) == [durations.iloc[i:i + 3].max() for i in range(0, len(durations), 3)]


def test_phase_breakdown_stacks_each_phase_and_the_rest(runs):
    fig = charts.phase_breakdown(queries.phase_breakdown(runs["plain"]))
    assert _names(fig) == ["scatter", "replicate", "apply (all devices)", "gather", "loss (output device)", "backward",
                           "rest of step"]
    assert all(isinstance(t, go.Bar) for t in fig.data) and fig.layout.barmode == "stack"


def test_phase_shares_label_each_bar_with_its_share(runs):
    totals = queries.phase_totals(runs["plain"])
    fig = charts.phase_shares(totals)
    assert list(fig.data[0].y)[::-1] == [charts._label(p) for p in totals["phase"]]
    assert fig.data[0].text[-1].startswith(f"{totals['share_pct'].iloc[0]:.1f}%")


@pytest.mark.parametrize("kind, trace", [("box", go.Box), ("violin", go.Violin)])
def test_work_distribution_is_one_shape_per_device(runs, kind, trace):
    fig = charts.work_distribution(queries.work_samples(runs["three"]), kind)
    assert _names(fig) == ["cpu:0", "cpu:1", "cpu:2"] and all(isinstance(t, trace) for t in fig.data)
    assert all(len(t.y) == 4 for t in fig.data)


def test_memory_marks_the_output_device_and_leaves_out_what_is_not_there(runs):
    fig = charts.memory_per_device(queries.memory_peaks(runs["plain"]))
    assert list(fig.data[0].x) == ["cpu:0 (output)", "cpu:1"]
    assert [a.text for a in fig.layout.annotations] == ["output device"]
    assert fig.layout.annotations[0].x == "cpu:0 (output)"
    assert "gathered outputs" in _names(fig) and "buffers" not in _names(fig)  # no buffers in CifarNet
    assert not any("allocator" in (n or "") for n in _names(fig))  # CPU workers: no allocator markers


def test_chunk_sizes_and_the_check_chunks_chart(runs):
    fig = charts.chunk_sizes(queries.chunk_counts(runs["three"]))
    assert list(fig.data[0].x) == ["cpu:0", "cpu:1", "cpu:2"] and list(fig.data[0].y) == [10, 10, 10]
    fig = charts.check_chunks(chunk_sizes(5, 4), ["cpu:0", "cpu:1", "cpu:2", "cpu:3"])
    assert list(fig.data[0].y) == [2, 2, 1, 0] and list(fig.data[0].text) == ["2", "2", "1", "idle"]


def test_gpu_samples_draw_a_line_per_gpu_and_say_what_nvml_did_not_give(reports, fake_gpus):
    import fake_pynvml

    fake = fake_gpus([fake_pynvml.gpu(BUS[0]), fake_pynvml.gpu(BUS[1], util=30)])
    fake.NOT_SUPPORTED.add("nvmlDeviceGetPowerUsage")
    run = record_with_gpu_samples(reports)
    fig = charts.gpu_samples(queries.gpu_series(run))
    assert sorted({t.name for t in fig.data}) == ["cuda:0", "cuda:1"]
    assert len(fig.data) == 2 * 3  # utilisation, memory, temperature; power was not supported
    assert "not recorded by NVML for these GPUs" in [a.text for a in fig.layout.annotations]


def test_timeline_has_a_lane_per_device_and_the_steps(runs):
    phases, steps = queries.timeline(runs["three"], 1, 2)
    fig = charts.timeline(phases, steps)
    assert list(fig.layout.yaxis.categoryarray) == ["cpu:2", "cpu:1", "cpu:0", "parallel_apply", "step"]
    apply = next(t for t in fig.data if t.name == "apply")
    assert len(apply.x) == 6 and list(apply.base) == phases.loc[phases["phase"] == "apply", "start_ms"].tolist()


def test_step_axes_tick_whole_steps_only(runs):
    """A step is a whole number: every chart over steps ticks 0, 1, 2 (never 4.5), one step alone (a step 550 of
    a trace) too, and a long run's axis prints its ticks as whole numbers."""
    run = runs["plain"]
    steps = queries.step_times(run)
    one = steps[steps["step"] == steps["step"].max()].assign(step=550)
    figs = [charts.step_times(steps), charts.step_times(one), charts.phase_breakdown(queries.phase_breakdown(run)),
            charts.compare_step_times(compare.compare([runs["plain"], runs["three"]]).steps)]
    for fig in figs:
        axis = fig.layout.xaxis
        assert axis.title.text == "step" and axis.tickformat == "d" and axis.dtick == 1 and axis.tick0 == 0
    long = steps.loc[steps.index.repeat(10)].reset_index(drop=True).assign(step=lambda d: d.index)
    axis = charts.step_times(long).layout.xaxis
    assert axis.tickformat == "d" and axis.dtick is None  # plotly's own spacing over 60 steps: 1, 2 or 5 apart


def test_compare_charts_have_one_series_per_run(runs):
    data = compare.compare([runs["plain"], runs["three"]])
    labels = data.summary["run"].tolist()
    assert _names(charts.compare_step_times(data.steps)) == labels
    shares = charts.compare_phase_shares(data.shares)
    assert {tuple(t.y) for t in shares.data} == {tuple(labels)}
    memory = charts.compare_memory(data.memory)
    assert _names(memory) == labels and list(memory.data[1].x) == ["cpu:0", "cpu:1", "cpu:2"]


def test_downsample_keeps_at_most_max_points_and_the_last_row(runs):
    df = queries.step_times(runs["plain"])
    small = charts.downsample(df, 4)
    assert len(small) <= 4 + 1 and small.index[-1] == df.index[-1] and small.index[0] == 0
    assert charts.downsample(df, 100) is df


def test_the_violin_is_clipped_to_the_data(runs):
    samples = queries.work_samples(runs["plain"])
    fig = charts.work_distribution(samples, "violin")
    assert [t.spanmode for t in fig.data] == ["hard", "hard"]  # no tail drawn below the fastest step


def test_the_per_device_glance_marks_the_worst_device_and_idle_ones(runs, reports):
    glance = overview.glance(runs["three"])
    fig = charts.device_glance(glance.devices, glance.work_phase, glance.memory_source, glance.slowest,
                               glance.heaviest)
    work, memory = fig.data
    devices = glance.devices.set_index("device")
    assert list(work.x) == devices["work_ms"].tolist()
    red = [y for y, c in zip(work.y, work.marker.color) if c == "#CC6677"]
    assert red == [glance.slowest] or red == [f"{glance.slowest} (output)"]
    idle = overview.glance(record(reports, "idle", workers=2, steps=3, batch_size=1, workload="tutorial-linear"))
    fig = charts.device_glance(idle.devices, idle.work_phase, idle.memory_source, idle.slowest, idle.heaviest)
    assert [t for t in fig.data[0].text][-1] == "idle" and fig.data[0].x[-1] == 0


def test_byte_axes_read_in_a_unit_that_fits(runs):
    assert bytes_unit(120.0) == ("KiB", 2**-10)  # not "120μ" MiB
    assert bytes_unit(47_503_964.0) == ("MiB", 2**-20)
    assert bytes_unit(3 * 2**30) == ("GiB", 2**-30)
    memory = queries.memory_peaks(runs["plain"])
    fig = charts.memory_per_device(memory)
    unit, scale = bytes_unit(memory["peak_held_bytes"].max())
    assert fig.layout.yaxis.title.text == unit and fig.layout.yaxis.tickformat == ",.3~f"


def test_two_devices_sit_apart_on_the_chunk_chart_without_a_row_for_calls_without_a_chunk(runs):
    chunks = queries.chunk_counts(runs["plain"])
    assert chunks["chunk_size"].isna().any()  # the whole-batch loss on the output device has no chunk
    fig = charts.chunk_sizes(chunks)
    assert list(fig.layout.xaxis.range) == [-0.75, 1.75] and list(fig.data[0].x) == ["cpu:0", "cpu:1"]
    assert load.load(runs["plain"]).chunks["chunk_size"].notna().all()


def test_the_timeline_can_draw_every_step_the_same_width(runs):
    phases, steps = queries.timeline(runs["three"], 0, 3)
    fig = charts.timeline(phases, steps, equal_steps=True)
    step_lane = fig.data[0]
    assert list(step_lane.x) == [1.0] * 4 and list(step_lane.base) == [0, 1, 2, 3]
    for trace in fig.data[1:]:  # each phase inside its own step's unit, at its share of that step
        step_of = [int(c[0]) for c in trace.customdata]
        assert all(s <= b + 1e-9 and b + w <= s + 1 + 1e-6 for s, b, w in zip(step_of, trace.base, trace.x))
    assert list(fig.layout.xaxis.ticktext) == ["0", "1", "2", "3"]
    real = charts.timeline(phases, steps)
    assert list(real.data[0].x) == steps["duration_ms"].tolist()  # the default: milliseconds


# plotly reads <a href>, <b>, <br> and entities in titles, legend entries, ticks and hover text: a run named with
# them is drawn as its characters (dpprof.plaintext.plotly_text), in every chart that shows run names.
HTML_NAME = "<a href='http://198.51.100.7/x'>x</a> <b>y</b> <img src=http://198.51.100.7/i.png> &amp;"


def _strings(value: object, key: str = "") -> list[tuple[str, str]]:
    """Every string in a figure's JSON with its key, hover templates (dpprof's own markup) left out."""
    if isinstance(value, dict):
        return [s for k, v in value.items() if k != "hovertemplate" for s in _strings(v, k)]
    if isinstance(value, (list, tuple)):
        return [s for v in value for s in _strings(v, key)]
    if hasattr(value, "tolist"):
        return _strings(value.tolist(), key)
    return [(key, value)] if isinstance(value, str) else []


def test_a_run_named_with_html_is_text_in_every_compare_chart(tmp_path):
    import html

    runs = [record(tmp_path, HTML_NAME, workers=2, steps=4, batch_size=16, workload="tutorial-linear"),
            record(tmp_path, "plain", workers=3, steps=4, batch_size=16, workload="tutorial-linear")]
    data = compare.combine([compare.compare_part(r) for r in runs])
    for fig in (charts.compare_step_times(data.steps), charts.compare_phase_shares(data.shares),
                charts.compare_memory(data.memory)):
        strings = _strings(fig.to_plotly_json())
        assert not [s for _, s in strings if "<" in s or ">" in s], strings
        shown = {html.unescape(s) for _, s in strings}
        assert any(HTML_NAME in s for s in shown)  # the name is there, as its characters


DDP128 = [Path(__file__).resolve().parents[2] / "shared" / "traces" / f"ddp-128ranks-rank{r}-sampled.json.gz"
          for r in (0, 1)]


@pytest.mark.skipif(not DDP128[0].exists(), reason="../shared/traces is not beside the project")
def test_a_ranks_own_device_is_named_once_in_the_gpu_figures(tmp_path):
    """An imported rank file's device is its rank ("rank:1"): its lines say "rank 1", not "rank 1 rank:1"."""
    run = dpprof.load_run(import_traces(DDP128, tmp_path, name="ddp128", jobs=1).id, tmp_path)
    fig = charts.gpu_metrics_per_step(kernels.gpu_per_step(run, Pick()))
    assert _names(fig) == [f"rank {r} {word}" for r in (0, 1)
                           for word in ("GPU utilization", "Est. SM efficiency", "Est. achieved occupancy")]

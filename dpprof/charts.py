"""Charts: DataFrames in (as dpprof.store.queries and dpprof.views return them), plotly figures out.

No I/O and no Streamlit here. Every function takes the frame a query returns and draws it; a
frame longer than MAX_POINTS rows per series is thinned first (a browser draws 2,000 points
per line quickly, 50,000 slowly). Callers decide what to say when there is no data: these
functions are given data.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from dpprof.plaintext import capitalized, plotly_text
from dpprof.records import MEMORY_BYTES, device_key
from dpprof.stepmodel import PHASE_WORDS
from dpprof.records import PHASE_ORDER
from dpprof.store.queries import MAX_POINTS
from dpprof.units import bytes_unit
from dpprof.views.opdiff import Pick
from dpprof.views.timeline import STREAM_PHASE

__all__ = ["MAX_POINTS", "PHASE_COLORS", "downsample", "device_glance", "step_times", "phase_breakdown", "phase_shares",
           "work_distribution", "memory_per_device", "chunk_sizes", "gpu_samples", "timeline",
           "compare_step_times", "compare_phase_shares", "compare_memory", "check_chunks", "gpu_time",
           "advice_parts", "top_operators", "gpu_metrics_per_step", "memory_over_time", "operator_diff"]

# One colour per phase, the same on every chart and no two phases alike, since DataParallel and DDP runs are
# compared on one chart (plotly's colour-blind-safe "Safe" palette, then Tol's muted and light ones).
PHASE_COLORS = {
    "scatter": "#88CCEE", "replicate": "#CC6677", "parallel_apply": "#DDCC77", "apply": "#117733",
    "gather": "#332288", "loss": "#44AA99", "reduce": "#999933", "backward": "#AA4499", "rest": "#BBBBBB",
    "step": "#DDDDDD", "data": "#661100", "forward": "#6699CC", "backward_compute": "#882255",
    "comm_wait": "#EE8866", "optimizer": "#E69F00", "kernels": "#225555", "script_comm": "#994455",
}
PHASE_LABELS = {**PHASE_WORDS, "kernels": "GPU kernels", "rest": "rest of step", "loss": "loss (output device)", "reduce": "reduce (losses)"}
_OTHER_COLORS = ["#888888", "#FFAABB", "#77AADD", "#AAAA00"]  # phases dpprof does not name


def _color(phase: str) -> str:
    return PHASE_COLORS.get(phase) or _OTHER_COLORS[sum(map(ord, phase)) % len(_OTHER_COLORS)]
TIMELINE_LABELLED_STEPS = 20  # more step labels than this in one lane get cramped and turn on their side
_LAYOUT = dict(template="plotly_white", margin=dict(l=10, r=10, t=50, b=10), legend_title_text="")


def _fig(title: str, **layout: object) -> go.Figure:
    fig = go.Figure()
    fig.update_layout(title=title, **{**_LAYOUT, **layout})
    return fig


def _plain_values(values: Any) -> Any:
    """A trace's values with each string as plotly text (dpprof.plaintext.plotly_text), numbers as they are."""
    if isinstance(values, str):
        return plotly_text(values)
    if isinstance(values, (tuple, list)) and any(isinstance(v, (str, tuple, list, np.ndarray)) for v in values):
        return [_plain_values(v) for v in values]
    if isinstance(values, np.ndarray) and values.dtype == object:
        return np.vectorize(lambda v: plotly_text(v) if isinstance(v, str) else v, otypes=[object])(values)
    return values


# Where a figure shows strings: run, device, phase and event names come from users and files, and plotly reads
# <a href>, <b> and <br> in any of these as markup. Hover templates are dpprof's own (their %{...} values are the
# data's, escaped here) and stay markup.
_TRACE_TEXT = ("x", "y", "text", "hovertext", "name", "customdata", "legendgroup")
_AXIS_TEXT = ("categoryarray", "ticktext")


def _plain(draw: Callable[..., go.Figure]) -> Callable[..., go.Figure]:
    """Every string a chart function puts in its figure (titles, names, categories, labels, hover values) shown
    as plain text, never as plotly's HTML."""

    @functools.wraps(draw)
    def drawn(*args: Any, **kwargs: Any) -> go.Figure:
        fig = draw(*args, **kwargs)
        for trace in fig.data:
            for attr in _TRACE_TEXT:
                value = getattr(trace, attr, None)
                if value is not None:
                    trace[attr] = _plain_values(value)
        layout = fig.layout
        if layout.title.text:
            layout.title.text = plotly_text(layout.title.text)
        for note in layout.annotations:
            note.text = plotly_text(note.text)
            for pos in ("x", "y"):
                if isinstance(note[pos], str):
                    note[pos] = plotly_text(note[pos])
        for key in [k for k in layout.to_plotly_json() if k.startswith(("xaxis", "yaxis"))]:
            axis = layout[key]
            if axis.title.text:
                axis.title.text = plotly_text(axis.title.text)
            for attr in _AXIS_TEXT:
                if axis[attr] is not None:
                    axis[attr] = _plain_values(axis[attr])
        return fig

    return drawn


STEP_TICKS_EVERY_STEP = 20  # up to this many steps on an axis, a tick at every step; past it plotly's, whole


def _step_axis(fig: go.Figure, steps: pd.Series) -> None:
    """A step axis with whole-step ticks only (no 4.5 or 550.5): a tick at every step over a short span (one step
    alone too), plotly's own spacing, as whole numbers, over a long one."""
    span = float(steps.max() - steps.min()) if len(steps) else 0.0
    if span <= STEP_TICKS_EVERY_STEP:
        fig.update_xaxes(tickformat="d", tick0=0, dtick=1)
    else:  # plotly spaces ticks 1, 2 or 5 x 10^k apart: at least 1 over more than 20 steps
        fig.update_xaxes(tickformat="d")


def downsample(df: pd.DataFrame, max_points: int = MAX_POINTS) -> pd.DataFrame:
    """Every k-th row, so that at most max_points remain (the last row always kept)."""
    if len(df) <= max_points:
        return df
    stride = math.ceil(len(df) / max_points)
    keep = list(range(0, len(df), stride))
    if keep[-1] != len(df) - 1:
        keep.append(len(df) - 1)
    return df.iloc[keep]


def _label(phase: str) -> str:
    return PHASE_LABELS.get(phase, phase)


_WORST, _DEVICE, _IDLE = "#CC6677", "#4477AA", "#BBBBBB"


@_plain
def device_glance(devices: pd.DataFrame, work_phase: str = "apply", memory_source: str | None = "peak held",
                  slowest: str | None = None, heaviest: str | None = None) -> go.Figure:
    """Each device's work per step and its peak memory, side by side, the worst device of each in red and idle
    devices at zero, labelled idle. Without memory (``memory_source`` None) the work panel stands alone.

    Args:
        devices: dpprof.views.overview.Glance.devices (device, work_ms, peak_bytes, output_device, idle).
        slowest, heaviest: the devices to mark (dpprof.views.overview.Glance.marked).
    """
    panels = [("work_ms", slowest, "{:.2f} ms", 1.0, f"{work_phase} per step (ms, median)")]
    if memory_source is not None:
        unit, scale = bytes_unit(float(devices["peak_bytes"].max() or 0) if len(devices) else 0.0)
        panels.append(("peak_bytes", heaviest, "{:,.1f} " + unit, scale, f"memory ({unit}, {memory_source})"))
    fig = make_subplots(rows=1, cols=len(panels), horizontal_spacing=0.12, subplot_titles=[p[-1] for p in panels])
    fig.update_layout(**{**_LAYOUT, "margin": dict(l=10, r=10, t=40, b=10)}, height=110 + 34 * max(2, len(devices)),
                      showlegend=False)
    ticks = [f"{d} (output)" if o else str(d) for d, o in zip(devices["device"], devices["output_device"])]
    for col, (value_col, worst, fmt, mult, _) in enumerate(panels, 1):
        values = devices[value_col].astype(float) * mult
        text = ["idle" if i else ("" if pd.isna(v) else fmt.format(v)) for v, i in zip(values, devices["idle"])]
        colors = [_IDLE if i else _WORST if d == worst else _DEVICE for d, i in zip(devices["device"], devices["idle"])]
        fig.add_trace(go.Bar(x=values.fillna(0).tolist(), y=ticks, orientation="h", marker_color=colors, text=text,
                             textposition=["outside" if i else "auto" for i in devices["idle"]],  # a zero-width bar
                             cliponaxis=False, hovertemplate="%{y}: %{text}<extra></extra>"), row=1, col=col)
        fig.update_xaxes(rangemode="tozero", tickformat=",.3~f", row=1, col=col)
    fig.update_yaxes(categoryorder="array", categoryarray=ticks[::-1])
    return fig


@_plain
def step_times(steps: pd.DataFrame, outliers: pd.DataFrame | None = None) -> go.Figure:
    """Step time over the steps; bucketed points show a band: each bucket's min to max shaded, its median as the
    line (its mean on hover), and the outlier steps the run kept marked.

    Args:
        steps: dpprof.store.queries.step_times (step, steps, duration_ms, min_duration_ms, median_duration_ms,
            max_duration_ms).
        outliers: dpprof.store.queries.outlier_steps (step, duration_ms, median_ms), if any.
    """
    df = downsample(steps)
    bucketed = "steps" in df and (df["steps"] > 1).any()
    title = (f"Step time (every {int(df['steps'].max()):,} steps: median, min-max shaded)" if bucketed else "Step time")
    fig = _fig(title, xaxis_title="step", yaxis_title="ms", hovermode="x unified")
    if bucketed:
        fig.add_trace(go.Scatter(x=df["step"], y=df["max_duration_ms"], mode="lines", line=dict(width=0),
                                 showlegend=False, hoverinfo="skip"))
        fig.add_trace(go.Scatter(x=df["step"], y=df["min_duration_ms"], mode="lines", line=dict(width=0),
                                 fill="tonexty", fillcolor="rgba(68,119,170,0.2)", name="min-max", hoverinfo="skip"))
        middle = df["median_duration_ms"] if "median_duration_ms" in df else df["duration_ms"]
        fig.add_trace(go.Scatter(x=df["step"], y=middle, mode="lines", name="median", line=dict(color="#4477AA"),
                                 customdata=df["duration_ms"], hovertemplate="median %{y:.3f} ms, mean %{customdata:.3f} ms"))
    else:
        fig.add_trace(go.Scatter(x=df["step"], y=df["duration_ms"], mode="lines" if len(df) > 60 else "lines+markers",
                                 name="step time", line=dict(color="#4477AA")))
    if outliers is not None and len(outliers):
        fig.add_trace(go.Scatter(x=outliers["step"], y=outliers["duration_ms"], mode="markers", name="outlier step",
                                 marker=dict(color="#CC3311", size=7, symbol="x"),
                                 customdata=outliers["median_ms"],
                                 hovertemplate="step %{x}: %{y:.2f} ms (median then %{customdata:.2f} ms)"))
    _step_axis(fig, df["step"])
    return fig


@_plain
def phase_breakdown(breakdown: pd.DataFrame) -> go.Figure:
    """Each step stacked by phase: scatter, replicate, apply (all devices), gather, backward, rest of step.

    Args:
        breakdown: dpprof.store.queries.phase_breakdown.
    """
    df = downsample(breakdown)
    phases = [c[:-3] for c in df.columns if c.endswith("_ms") and c != "step_ms"]
    bars = len(df) <= 300
    fig = _fig("Phase breakdown per step (ms)", xaxis_title="step", yaxis_title="ms", hovermode="x unified",
               barmode="stack", bargap=0.05)
    for phase in phases:
        kwargs = dict(x=df["step"], y=df[f"{phase}_ms"], name=_label(phase), marker_color=_color(phase))
        if bars:
            fig.add_trace(go.Bar(**kwargs))
        else:
            fig.add_trace(go.Scatter(**kwargs, mode="lines", stackgroup="phases",
                                     line=dict(width=0.5, color=_color(phase))))
    _step_axis(fig, df["step"])
    return fig


@_plain
def phase_shares(totals: pd.DataFrame) -> go.Figure:
    """Each phase's share of the run's step time, one horizontal bar each.

    Args:
        totals: dpprof.store.queries.phase_totals (phase, total_ms, per_step_ms, share_pct).
    """
    df = totals.iloc[::-1]
    fig = _fig("Share of the step", xaxis_title="% of step time", showlegend=False, height=320)
    fig.add_trace(go.Bar(x=df["share_pct"], y=[_label(p) for p in df["phase"]], orientation="h",
                         marker_color=[_color(p) for p in df["phase"]],
                         text=[f"{s:.1f}% · {ms:.2f} ms/step" for s, ms in zip(df["share_pct"], df["per_step_ms"])],
                         textposition="auto"))
    return fig


@_plain
def work_distribution(samples: pd.DataFrame, kind: str = "box", phase: str = "apply",
                       idle: list[str] | tuple[str, ...] = (), unit_word: str = "device") -> go.Figure:
    """Each device's work per step (DataParallel's apply, a rank's forward + backward compute), as box plots (or
    violins, clipped to the data): a straggler stands out.

    Args:
        samples: dpprof.store.queries.work_samples (step, device, duration_ms).
        kind: "box" or "violin".
        phase: the phase the samples are of ("forward" for DistributedDataParallel ranks).
        idle: devices of the run that did no work: drawn at zero, labelled idle.
        unit_word: what a lane is called ("device", "rank": RunModel.unit).
    """
    fig = _fig(f"{capitalized(phase)} time per {unit_word} (ms per step)", yaxis_title="ms", showlegend=False,
               yaxis_rangemode="tozero")
    trace = go.Violin if kind == "violin" else go.Box
    extra = dict(box_visible=True, meanline_visible=True, points=False, spanmode="hard") if kind == "violin" else dict(
        boxmean=True, boxpoints="outliers")
    for device, df in samples.groupby("device", sort=False):
        fig.add_trace(trace(y=df["duration_ms"], name=str(device), marker_color=PHASE_COLORS["apply"], **extra))
    for device in idle:
        fig.add_trace(go.Scatter(x=[f"{device} (idle)"], y=[0], mode="markers+text", text=["idle: no chunk"],
                                 textposition="top center", marker=dict(color=_IDLE, size=10), name=str(device)))
    return fig


_MEMORY_LABELS = {"input_bytes": "inputs", "output_bytes": "outputs", "activation_bytes": "activations",
                  "gathered_bytes": "gathered outputs", "param_bytes": "parameters", "buffer_bytes": "buffers"}
_MEMORY_KINDS = {c: _MEMORY_LABELS[c] for c in MEMORY_BYTES}  # in the memory record's order
_MEMORY_COLORS = ["#88CCEE", "#44AA99", "#117733", "#CC6677", "#999933", "#DDCC77"]


def _device_ticks(memory: pd.DataFrame) -> list[str]:
    return [f"{d} (output)" if out else str(d) for d, out in zip(memory["device"], memory["output_device"])]


@_plain
def memory_per_device(memory: pd.DataFrame, idle: list[str] | tuple[str, ...] = (), unit_word: str = "device",
                      gathered: str = "gathered outputs") -> go.Figure:
    """What each device held in its peak step, by kind, stacked; the CUDA allocator's peak allocated
    and reserved bytes as markers where recorded; the output device marked; idle devices at zero.

    Args:
        memory: dpprof.store.queries.memory_peaks.
        idle: devices of the run that did no work: drawn at zero, labelled idle.
        unit_word: what a lane is called ("device", "rank": RunModel.unit).
        gathered: what gathered_bytes are in the run's kind (an FSDP rank's are its all-gathered parameters).
    """
    ticks = _device_ticks(memory)
    peaks = [memory[c].max() for c in ("peak_held_bytes", "peak_allocated_bytes", "peak_reserved_bytes") if c in memory]
    unit, scale = bytes_unit(float(pd.Series(peaks, dtype=float).max()) if peaks and len(memory) else 0.0)
    fig = _fig(f"Memory per {unit_word} ({unit}, in each {unit_word}'s peak step)", yaxis_title=unit, barmode="stack",
               yaxis_tickformat=",.3~f")
    for (col, label), color in zip(_MEMORY_KINDS.items(), _MEMORY_COLORS):
        if col == "gathered_bytes":
            label = gathered
        if col in memory and memory[col].fillna(0).any():
            fig.add_trace(go.Bar(x=ticks, y=memory[col] * scale, name=label, marker_color=color))
    for col, label, symbol in (("peak_allocated_bytes", "peak allocated (allocator)", "diamond"),
                               ("peak_reserved_bytes", "reserved (allocator)", "line-ew-open")):
        if col in memory and memory[col].notna().any():
            fig.add_trace(go.Scatter(x=ticks, y=memory[col] * scale, name=label, mode="markers",
                                     marker=dict(symbol=symbol, size=14, color="#222222", line=dict(width=2))))
    if idle:
        fig.add_trace(go.Bar(x=[f"{d} (idle)" for d in idle], y=[0] * len(idle), name="idle", marker_color=_IDLE,
                             text=["idle: no chunk"] * len(idle), textposition="outside", cliponaxis=False))
    for tick, out in zip(ticks, memory["output_device"]):
        if out:
            fig.add_annotation(x=tick, y=1.0, yref="paper", text="output device", showarrow=False,
                               yanchor="bottom", font=dict(color="#CC6677"))
    return fig


@_plain
def chunk_sizes(chunks: pd.DataFrame, idle: list[str] | tuple[str, ...] = ()) -> go.Figure:
    """The chunk each device got: one dot per (device, chunk size), its size the share of forward calls;
    idle devices at zero, labelled idle.

    Args:
        chunks: dpprof.store.queries.chunk_counts (device, chunk_size, calls).
        idle: devices of the run that never got a chunk.
    """
    df = chunks.dropna(subset=["chunk_size"])
    total = df.groupby("device")["calls"].transform("sum")
    share = df["calls"] / total
    fig = _fig("Chunk size per device (samples; dot size: share of forward calls)", yaxis_title="samples",
               showlegend=False, yaxis_rangemode="tozero")
    fig.add_trace(go.Scatter(x=df["device"].tolist(), y=df["chunk_size"].astype(float).tolist(), mode="markers+text",
                             marker=dict(size=(10 + 30 * share.astype(float)).tolist(), color="#4477AA"),
                             text=[f"{int(c)} ({n:,} calls)" for c, n in zip(df["chunk_size"], df["calls"])],
                             textposition="top center", cliponaxis=False))
    if idle:
        fig.add_trace(go.Scatter(x=list(idle), y=[0] * len(idle), mode="markers+text", text=["idle: no chunk"] * len(idle),
                                 textposition="top center", marker=dict(size=10, color=_IDLE), cliponaxis=False))
    lanes = list(dict.fromkeys([*df["device"], *idle]))
    # categories with half a lane of room each side: two devices sit apart, not at the plot's edges
    fig.update_xaxes(type="category", categoryorder="array", categoryarray=lanes, range=[-0.75, len(lanes) - 0.25])
    fig.update_yaxes(range=[0, float(df["chunk_size"].max() if len(df) else 1) * 1.3])
    return fig


_GPU_PANELS = [("gpu_util_pct", "GPU utilisation (%)", 1.0), ("memory_used_bytes", "memory used (GiB)", 2**-30),
               ("power_w", "power (W)", 1.0), ("temperature_c", "temperature (°C)", 1.0)]


@_plain
def gpu_samples(series: pd.DataFrame) -> go.Figure:
    """Utilisation, memory used, power and temperature over time, one line per GPU; a metric NVML never
    gave says so in its panel.

    Args:
        series: dpprof.store.queries.gpu_series.
    """
    fig = make_subplots(rows=2, cols=2, subplot_titles=[p[1] for p in _GPU_PANELS], shared_xaxes=True)
    fig.update_layout(title="GPU samples (NVML) over time", **_LAYOUT, height=560, hovermode="x unified")
    palette = ["#4477AA", "#EE6677", "#228833", "#CCBB44", "#66CCEE", "#AA3377", "#BBBBBB", "#000000"]
    legend_panel = next((col for col, _, _ in _GPU_PANELS if series[col].notna().any()), None)
    for i, (col, _, scale) in enumerate(_GPU_PANELS):
        row, c = divmod(i, 2)
        if series[col].isna().all():
            fig.add_annotation(text="not recorded by NVML for these GPUs", showarrow=False,
                               xref=f"x{i + 1 if i else ''} domain", yref=f"y{i + 1 if i else ''} domain",
                               x=0.5, y=0.5)
            continue
        for j, (device, df) in enumerate(series.groupby("device", sort=False)):
            df = downsample(df)
            fig.add_trace(go.Scatter(x=df["t_ms"] / 1e3, y=df[col] * scale, mode="lines", name=str(device),
                                     legendgroup=str(device), showlegend=col == legend_panel,
                                     line=dict(color=palette[j % len(palette)])), row=row + 1, col=c + 1)
    fig.update_xaxes(title_text="s since the run started", row=2)
    return fig


def _per_step_scale(phases: pd.DataFrame, steps: pd.DataFrame) -> tuple[pd.Series, pd.Series]:
    """Each phase's start and length in steps: step i spans [i, i + 1) of the range, whatever its duration."""
    index = {s: i for i, s in enumerate(steps["step"])}
    start = phases["step"].map(steps.set_index("step")["start_ms"])
    length = phases["step"].map(steps.set_index("step")["duration_ms"]).replace(0, float("nan"))
    base = phases["step"].map(index) + (phases["start_ms"] - start) / length
    return base, phases["duration_ms"] / length


def _stream_key(lane: str) -> tuple:
    """"cuda:0 stream 7" sorts by device, then stream number."""
    device, _, stream = lane.partition(" stream ")
    return (*device_key(device), int(stream) if stream.isdigit() else -1, stream)


@_plain
def timeline(phases: pd.DataFrame, steps: pd.DataFrame, equal_steps: bool = False) -> go.Figure:
    """A Gantt chart of the phases on each device over a range of steps.

    Lanes: "step" (each step), "parallel_apply" (all replicas together), then one lane per device with
    its scatter, replicate, apply, gather and backward.

    Args:
        phases, steps: dpprof.store.queries.timeline.
        equal_steps: draw every step the same width (each phase at its share of its step), so that a few
            slow steps do not squash the others; hover still gives milliseconds.
    """
    stream_lanes = phases["phase"] == STREAM_PHASE  # a GPU stream's kernels: below the host lanes, by device, stream
    devices = sorted(dict.fromkeys(phases.loc[~stream_lanes, "device"]), key=device_key)  # not by who started first
    devices += sorted(dict.fromkeys(phases.loc[stream_lanes, "device"]), key=_stream_key)
    lanes = ["step", *(["parallel_apply"] if (phases["phase"] == "parallel_apply").any() else []), *devices]
    equal_steps = equal_steps and not steps.empty
    fig = _fig("Timeline (every step the same width)" if equal_steps else "Timeline (ms since the run started)",
               xaxis_title="step (each the same width)" if equal_steps else "ms", barmode="overlay",
               height=140 + 40 * len(lanes), bargap=0.25)
    if not steps.empty:
        x, base = ([1.0] * len(steps), list(range(len(steps)))) if equal_steps else (steps["duration_ms"],
                                                                                     steps["start_ms"])
        fig.add_trace(go.Bar(y=["step"] * len(steps), x=x, base=base, orientation="h",
                             name="step", marker=dict(color=PHASE_COLORS["step"], line=dict(color="#888", width=1)),
                             text=[f"step {s}" for s in steps["step"]], customdata=steps[["duration_ms"]],
                             # labels only where they fit flat; past TIMELINE_LABELLED_STEPS steps, on hover
                             texttemplate="%{text}" if len(steps) <= TIMELINE_LABELLED_STEPS else "",
                             textposition="inside", insidetextanchor="middle", textangle=0,
                             hovertemplate="%{text}<br>%{customdata[0]:.2f} ms<extra></extra>"))
    rank = {p: i for i, p in enumerate(PHASE_ORDER)}
    for phase in sorted(dict.fromkeys(phases["phase"]), key=lambda p: rank.get(p, len(rank))):
        df = phases[phases["phase"] == phase]
        y = ["parallel_apply"] * len(df) if phase == "parallel_apply" else df["device"]
        base, x = _per_step_scale(df, steps) if equal_steps else (df["start_ms"], df["duration_ms"])
        fig.add_trace(go.Bar(y=y, x=x, base=base, orientation="h", name=_label(phase),
                             marker_color=_color(phase), customdata=df[["step", "device", "duration_ms", "start_ms"]],
                             hovertemplate=f"{plotly_text(_label(phase))}<br>step %{{customdata[0]}} on %{{customdata[1]}}"
                                           "<br>%{customdata[2]:.3f} ms from %{customdata[3]:.2f} ms<extra></extra>"))
    fig.update_yaxes(categoryorder="array", categoryarray=lanes[::-1])
    if equal_steps:
        every = max(1, math.ceil(len(steps) / TIMELINE_LABELLED_STEPS))
        ticks = list(range(0, len(steps), every))
        fig.update_xaxes(tickvals=[i + 0.5 for i in ticks], ticktext=[str(steps["step"].iloc[i]) for i in ticks],
                         range=[0, len(steps)])
    return fig


@_plain
def compare_step_times(steps: pd.DataFrame) -> go.Figure:
    """Step time over the steps of each run, one line per run.

    Args:
        steps: dpprof.views.compare(...).steps (run, step, duration_ms).
    """
    fig = _fig("Step time by run (ms)", xaxis_title="step", yaxis_title="ms", hovermode="x unified")
    for run, df in steps.groupby("run", sort=False):
        df = downsample(df)
        fig.add_trace(go.Scatter(x=df["step"], y=df["duration_ms"], mode="lines", name=str(run)))
    _step_axis(fig, steps["step"])
    return fig


@_plain
def compare_phase_shares(shares: pd.DataFrame) -> go.Figure:
    """Each run's step split into phases, as 100% stacked horizontal bars.

    Args:
        shares: dpprof.views.compare(...).shares (run, phase, share_pct, per_step_ms).
    """
    fig = _fig("Phase shares of the step by run (%)", xaxis_title="% of step time", barmode="stack",
               height=260 + 50 * shares["run"].nunique(),
               legend=dict(orientation="h", yanchor="top", y=-0.25, x=0, title_text=""))
    for phase, df in shares.groupby("phase", sort=False):
        fig.add_trace(go.Bar(y=df["run"], x=df["share_pct"], name=_label(str(phase)), orientation="h",
                             marker_color=_color(str(phase)), customdata=df["per_step_ms"],
                             hovertemplate="%{y}: %{x:.1f}% (%{customdata:.2f} ms/step)<extra>" + plotly_text(_label(str(phase)))
                                           + "</extra>"))
    fig.update_yaxes(autorange="reversed")
    return fig


@_plain
def compare_memory(memory: pd.DataFrame) -> go.Figure:
    """Each device's memory figure (the Overview's), grouped by device, one bar per run; output devices marked.

    Args:
        memory: dpprof.views.compare(...).memory (run, device, output_device, peak_bytes, memory: the figure in
            words).
    """
    col = "peak_bytes"
    sources = list(memory["memory"].unique()) if len(memory) else []
    what = sources[0] if len(sources) == 1 else "each run's own figure (see the table)"
    unit, scale = bytes_unit(float(memory[col].max()) if len(memory) and memory[col].notna().any() else 0.0)
    fig = _fig("Memory per device by run", yaxis_title=f"{unit}, {what}", barmode="group", yaxis_tickformat=",.3~f")
    for run, df in memory.groupby("run", sort=False):
        fig.add_trace(go.Bar(x=df["device"], y=df[col] * scale, name=str(run),
                             text=["output" if o else "" for o in df["output_device"]], textposition="outside"))
    return fig


@_plain
def check_chunks(sizes: list[int], devices: list[str]) -> go.Figure:
    """How torch.chunk would split a batch over devices (the pre-flight check's batch size)."""
    padded = list(sizes) + [0] * (len(devices) - len(sizes))
    fig = _fig("Chunk per device at this batch size (samples)", yaxis_title="samples", showlegend=False, height=300)
    fig.add_trace(go.Bar(x=devices, y=padded, text=[str(s) if s else "idle" for s in padded], textposition="auto",
                         marker_color=["#4477AA" if s else "#CC6677" for s in padded]))
    return fig


_GPU_TIME_COLORS = {"computation_ms": "#4477AA", "overlapping_ms": "#228833", "communication_ms": "#CC6677",
                    "memcpy_ms": "#DDCC77", "memset_ms": "#88CCEE", "idle_ms": "#BBBBBB"}


@_plain
def gpu_time(per_device: pd.DataFrame) -> go.Figure:
    """Each GPU's mean step, stacked by what it ran (an imported trace's Distributed view).

    Args:
        per_device: dpprof.views.gpu_time (device, computation_ms, overlapping_ms, communication_ms,
            memcpy_ms, memset_ms, idle_ms).
    """
    fig = _fig("GPU time per step by device (ms): computation, overlap, communication, copies, idle",
               yaxis_title="ms per step", barmode="stack")
    for col, color in _GPU_TIME_COLORS.items():
        if col in per_device and per_device[col].fillna(0).any():
            fig.add_trace(go.Bar(x=per_device["device"].tolist(), y=per_device[col].astype(float).tolist(),
                                 name=col[:-3], marker_color=color))
    return fig


@_plain
def collective_waits(heatmap: pd.DataFrame) -> go.Figure:
    """The wait inside the collectives, rank by step (a multi-rank run's Overview): a late rank is the row of no wait.

    Args:
        heatmap: dpprof.views.overview.CollectiveWaitView.heatmap (ms; rows rank:N, columns steps).
    """
    fig = _fig("Wait inside the collectives (ms): rank by step", xaxis_title="step", yaxis_title="rank")
    fig.add_trace(go.Heatmap(z=heatmap.to_numpy(dtype=float), x=[int(s) for s in heatmap.columns],
                             y=[str(r) for r in heatmap.index], colorscale="Reds", colorbar=dict(title="ms"),
                             hovertemplate="%{y}, step %{x}: waited %{z:.2f} ms<extra></extra>"))
    fig.update_yaxes(autorange="reversed", type="category")
    return fig


@_plain
def advice_parts(parts: pd.DataFrame, scenarios: pd.DataFrame) -> go.Figure:
    """Each scenario's predicted step, stacked by part, with its interval as an error bar on the total.

    Args:
        parts: dpprof.views.advise.parts_table (label, one ``<part>_ms`` column per part).
        scenarios: dpprof.views.advise.scenario_table (label, step_ms, step_ms_low, step_ms_high, recorded).
    """
    fig = _fig("Predicted step by scenario (ms), stacked by part; the bar's line is its interval",
               xaxis_title="ms per step", barmode="stack", height=max(320, 48 * len(parts) + 120))
    labels = [f"{label} *" if rec else label for label, rec in zip(scenarios["label"], scenarios["recorded"])]
    for col in [c for c in parts.columns if c.endswith("_ms")]:
        phase = col[:-3]
        fig.add_trace(go.Bar(y=labels, x=parts[col].astype(float).tolist(), name=_label(phase), orientation="h",
                             marker_color=_color(phase)))
    fig.add_trace(go.Scatter(
        y=labels, x=scenarios["step_ms"].astype(float).tolist(), mode="markers", name="step (interval)",
        marker=dict(color="black", size=6), error_x=dict(
            type="data", symmetric=False, array=(scenarios["step_ms_high"] - scenarios["step_ms"]).tolist(),
            arrayminus=(scenarios["step_ms"] - scenarios["step_ms_low"]).tolist())))
    fig.update_yaxes(autorange="reversed")
    return fig


NAME_CHARS = 60  # an operator or kernel name on a bar's axis is cut here (its full name is in the hover and table)


def _short(name: str) -> str:
    return name if len(name) <= NAME_CHARS else name[: NAME_CHARS - 1] + "…"


@_plain
def top_operators(top: pd.DataFrame, value: str = "device_self_ms") -> go.Figure:
    """The top operators by self time, one horizontal bar each, with the other clock's time beside it.

    Args:
        top: dpprof.views.operators.top_operators (name, host_self_ms, device_self_ms), largest first.
        value: the column the rows were chosen by ("device_self_ms", or "host_self_ms" without kernels).
    """
    words = {"device_self_ms": "device self time", "host_self_ms": "host self time"}
    fig = _fig(f"Top {len(top)} operators by {words[value]} (ms, all steps)", xaxis_title="ms", barmode="group",
               height=max(320, 26 * len(top) + 120))
    names = [_short(str(n)) for n in top["name"]]
    for col, color in (("device_self_ms", "#117733"), ("host_self_ms", "#6699CC")):
        if top[col].notna().any():
            fig.add_trace(go.Bar(y=names, x=top[col].astype(float).tolist(), name=words[col], orientation="h",
                                 marker_color=color, hovertext=[str(n) for n in top["name"]]))
    fig.update_yaxes(autorange="reversed")
    return fig


_GPU_METRICS = (("utilization_pct", "GPU utilization"), ("sm_efficiency_pct", "Est. SM efficiency"),
                ("achieved_occupancy_pct", "Est. achieved occupancy"))


@_plain
def gpu_metrics_per_step(per_step: pd.DataFrame) -> go.Figure:
    """GPU utilization, estimated SM efficiency and achieved occupancy per step (%), a line per metric and GPU.

    Args:
        per_step: dpprof.views.kernels.gpu_per_step (rank, device, step, and the three ``*_pct`` columns).
    """
    fig = _fig("GPU utilization, est. SM efficiency and est. achieved occupancy per step (%)",
               xaxis_title="step", yaxis_title="%", hovermode="x unified")
    many = per_step["rank"].nunique() > 1
    dashes = ("solid", "dash", "dot")
    for (rank, device), df in per_step.groupby(["rank", "device"], sort=False):
        who = Pick(int(rank), str(device)).label() if many else str(device)  # "rank 1 cuda:0", or "rank 1"
        for (col, word), dash in zip(_GPU_METRICS, dashes):
            fig.add_trace(go.Scatter(x=df["step"].astype(int).tolist(), y=df[col].astype(float).tolist(),
                                     mode="lines+markers", name=f"{who} {word}", line=dict(dash=dash)))
    fig.update_yaxes(range=[0, 105])
    _step_axis(fig, per_step["step"])
    return fig


@_plain
def memory_over_time(curve: pd.DataFrame, peaks: pd.DataFrame) -> go.Figure:
    """Allocated (solid) and reserved (dashed) memory over time, a line per device, each device's peak marked with
    its step.

    Args:
        curve: dpprof.views.memory.memory_curve (series, t_ms, allocated_bytes, reserved_bytes), already bucketed.
        peaks: dpprof.views.memory.peaks (rank, device, peak_allocated_bytes, peak_t_ms, peak_step).
    """
    top = float(pd.concat([curve["allocated_bytes"], curve["reserved_bytes"]]).max())
    unit, scale = bytes_unit(top if top == top else 0.0)
    fig = _fig(f"Memory over time per device ({unit}): allocated, and reserved by the caching allocator",
               xaxis_title="s since the run started", yaxis_title=unit, hovermode="x unified")
    palette = ["#4477AA", "#EE6677", "#228833", "#CCBB44", "#66CCEE", "#AA3377", "#BBBBBB", "#000000"]
    for j, (series, df) in enumerate(curve.groupby("series", sort=False)):
        df = downsample(df)
        color = palette[j % len(palette)]
        fig.add_trace(go.Scatter(x=(df["t_ms"] / 1e3).tolist(), y=(df["allocated_bytes"] * scale).tolist(),
                                 mode="lines", name=f"{series} allocated", line=dict(color=color)))
        if df["reserved_bytes"].notna().any():
            fig.add_trace(go.Scatter(x=(df["t_ms"] / 1e3).tolist(), y=(df["reserved_bytes"] * scale).tolist(),
                                     mode="lines", name=f"{series} reserved", line=dict(color=color, dash="dash")))
    many = peaks["rank"].nunique() > 1
    for row in peaks.itertuples(index=False):
        step = f"step {int(row.peak_step)}" if pd.notna(row.peak_step) else "no step"
        who = Pick(int(row.rank), str(row.device)).label() if many else str(row.device)
        fig.add_trace(go.Scatter(x=[row.peak_t_ms / 1e3], y=[row.peak_allocated_bytes * scale], mode="markers+text",
                                 marker=dict(symbol="x", size=11, color="black"), name=f"{who} peak",
                                 text=[f"peak {row.peak_allocated_bytes * scale:,.1f} {unit} ({step})"],
                                 textposition="top center"))
    return fig


@_plain
def operator_diff(diff: pd.DataFrame, label_a: str, label_b: str, top: int = 15) -> go.Figure:
    """B's difference from A per operator (ms of self time), the largest ``top``: right of zero, B is slower.

    Args:
        diff: dpprof.views.opdiff.operator_diff (name, delta_ms), largest difference first.
    """
    rows = diff.head(top)
    clock = diff.attrs.get("clock", "host")
    fig = _fig(f"{label_b} less {label_a}: {clock} self time per operator (ms)", xaxis_title="ms",
               height=max(320, 26 * len(rows) + 120))
    fig.add_trace(go.Bar(y=[_short(str(n)) for n in rows["name"]], x=rows["delta_ms"].astype(float).tolist(),
                         orientation="h", hovertext=[str(n) for n in rows["name"]], showlegend=False,
                         marker_color=["#CC6677" if d > 0 else "#117733" for d in rows["delta_ms"]]))
    fig.update_yaxes(autorange="reversed")
    return fig

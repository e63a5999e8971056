"""Each kind of run speaks in its own terms (issue 30, "a CPU-only trace in other kinds' words"): a process's
work is forward + backward compute, never apply; a run of one device, rank or process says once that it has
nothing to balance (a rank of a bigger job names its world size); a section of another kind is absent, not
empty; a missing measurement is said once in words, never an empty table or chart; an imported trace's workload
is its job; a DDP run's backend is its torch.distributed backend, not "rank".

Driven through `dpprof show`, `dpprof export` (device_summary.csv), `dpprof runs`, the views and the pages, on
runs the code really makes: a DDP recording on 2 gloo ranks, traces of a 2-rank gloo DDP job recorded here
(rank 0 alone, and both ranks), one-step and inference-only CPU traces, and the real GPU traces in
../shared/traces."""
from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest
from streamlit.testing.v1 import AppTest

import dpprof
from cpu_traces import gloo_ddp_traces, inference_trace, single_process_trace
from dpprof.cli import main
from dpprof.plaintext import shown_text
from dpprof.trace import import_traces
from dpprof.trace.importer import LEGACY_WORKLOAD, job_name
from dpprof.views import compare, load

pytestmark = pytest.mark.slow  # its fixture profiles gloo ranks and records DDP under torchrun

ROOT = Path(__file__).resolve().parents[1]
APP = ROOT / "app.py"
TRACES = ROOT.parent / "shared" / "traces"
RESNET = "resnet50-1gpu-tb-sample.pt.trace.json.gz"
NCCL_RANK0 = "ddp-2ranks-rank0-nccl.json.gz"
# runs of the fixture that are imported traces, and the kind each must read as
TRACE_RUNS = {"gloo_rank0": "trace_cpu", "gloo_both": "trace_cpu", "cpu_one_step": "trace_cpu",
              "cpu_inference": "trace_cpu", "resnet": "trace_gpu", "nccl_rank0": "trace_gpu"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, profiled):
    """One reports directory: a DDP recording on 2 gloo ranks and the imported traces of TRACE_RUNS."""
    if not TRACES.is_dir():
        pytest.skip("../shared/traces is not beside the project")
    directory = tmp_path_factory.mktemp("kind-words")
    made = tmp_path_factory.mktemp("cpu-traces")
    ddp = gloo_ddp_traces(made, stem="tinyddp", steps=3)
    ids = {
        "gloo_rank0": import_traces([ddp[0]], directory).id,
        "gloo_both": import_traces(ddp, directory, again=True).id,
        "cpu_one_step": import_traces([single_process_trace(made, "onestep", steps=1)], directory).id,
        "cpu_inference": import_traces([inference_trace(made, "tinyinfer", steps=3)], directory).id,
        "resnet": import_traces([TRACES / RESNET], directory).id,
        "nccl_rank0": import_traces([TRACES / NCCL_RANK0], directory).id,
    }
    profiled(directory, "tutorial-linear", "--ddp", "--nproc", "2", "--steps", "4")  # recorded once a session
    listing = dpprof.list_runs(directory)
    ids["ddp_gloo"] = listing[listing["source"].isna() & (listing["ranks"] == 2)]["id"].iloc[0]
    return SimpleNamespace(dir=directory, ids=ids)


def _run(runs, name):
    return dpprof.load_run(runs.ids[name], runs.dir)


def _show(runs, name, capsys) -> str:
    assert main(["--reports-dir", str(runs.dir), "show", runs.ids[name]]) == 0
    return capsys.readouterr().out


def _page(runs, monkeypatch, name: str, page: str) -> AppTest:
    monkeypatch.setenv("DPPROF_REPORTS", str(runs.dir))
    at = AppTest.from_file(str(APP), default_timeout=120)
    at.query_params["run"] = runs.ids[name]
    at.run()
    at.switch_page(f"app_pages/{page}.py").run()
    assert not at.exception, [e.message for e in at.exception]
    return at


def _text(at: AppTest) -> str:
    parts = [shown_text(e.value) for kind in ("markdown", "caption", "info", "warning", "subheader", "title")
             for e in at.get(kind) if isinstance(getattr(e, "value", None), str)]
    return "\n".join(parts)


def _chart_titles(at: AppTest) -> list[str]:
    import json

    titles = []
    for c in at.get("plotly_chart"):
        title = json.loads(c.proto.spec)["layout"].get("title")
        titles.append((title or {}).get("text", "") if isinstance(title, dict) else str(title or ""))
    return titles


@pytest.mark.parametrize("name", list(TRACE_RUNS))
def test_each_trace_reads_as_its_kind_with_a_process_s_work(runs, name):
    model = _run(runs, name).model
    assert model.kind == TRACE_RUNS[name]
    assert model.work.label == "forward + backward compute" and model.work.column == "compute"


@pytest.mark.parametrize("name", list(TRACE_RUNS))
def test_show_of_a_trace_has_no_apply_words_and_no_empty_table(runs, name, capsys):
    out = _show(runs, name, capsys)
    assert not re.search(r"\bapply\b", out), out
    model = _run(runs, name).model
    assert "(none)" not in out
    assert ("nothing to balance" in out) == (len(model.devices) == 1)
    if "work" in model.has:
        assert f"per {model.unit} (forward + backward compute):" in out
    else:  # the inference trace: why there is no compute per device, said once where the table would be
        assert out.count(model.missing["work"]) == 1 and "compute mean" not in out


def test_a_trace_with_no_forward_or_backward_says_so_once_in_words(runs, capsys):
    model = _run(runs, "cpu_inference").model
    assert "work" not in model.has
    assert "no forward range" in model.missing["work"] and "no backward op" in model.missing["work"]
    assert "No apply phases" not in _show(runs, "cpu_inference", capsys)


@pytest.mark.parametrize("name", ["gloo_rank0", "gloo_both", "nccl_rank0"])
def test_show_prints_a_traces_collectives_where_the_overview_has_them(runs, name, capsys):
    from dpprof.views.overview import overview

    run = _run(runs, name)
    assert len(overview(run).comms)  # the Overview's collectives section
    out = _show(runs, name, capsys)
    assert "collectives per step past the first (from the trace):" in out
    assert "gradient all-reduce per step past the first:" in _show(runs, "ddp_gloo", capsys)


@pytest.mark.parametrize("name", list(TRACE_RUNS))
def test_the_device_summary_csv_has_rows_and_only_columns_the_run_has(runs, name, tmp_path):
    assert main(["--reports-dir", str(runs.dir), "export", runs.ids[name], "--out", str(tmp_path)]) == 0
    summary = pd.read_csv(tmp_path / "device_summary.csv")
    model = _run(runs, name).model
    assert len(summary) == len(model.devices) and summary["device"].tolist() == list(model.devices)
    assert not [c for c in summary.columns if c.startswith("apply_")]
    empty = [c for c in summary.columns if summary[c].isna().all()]
    assert not empty, f"columns with no value: {empty}"
    for other_kinds in ("output_device", "chunk_size_mean", "peak_held_bytes"):  # DataParallel's accounting
        assert other_kinds not in summary.columns
    assert (summary["steps"] == model.steps).all() or "work" in model.has


def test_the_device_summary_of_a_dataparallel_run_keeps_its_output_device(tmp_path):
    from recorded import record

    run = record(tmp_path / "dp", "dp", workers=2, steps=3, batch_size=16)
    summary = dpprof.report.summary_of(run)
    assert summary["output_device"].tolist() == [True, False]
    assert {"apply_mean_ms", "chunk_size_mean", "peak_held_bytes"} <= set(summary.columns)


def test_a_one_gpu_trace_says_its_allocator_peak_in_words_not_a_one_marker_chart(runs, monkeypatch):
    run = _run(runs, "resnet")
    data = load.load(run)
    peak = run.allocator["peak_allocated_bytes"].max()
    assert not data.memory_chart and f"{peak / 2**30:,.2f} GiB allocated" in data.memory_text
    assert "output_device" not in data.memory_table.columns
    at = _page(runs, monkeypatch, "resnet", "load")
    text = _text(at)
    assert "output device" not in text.lower()
    assert not [t for t in _chart_titles(at) if t.startswith("Memory per")]
    assert "output device" not in [c for df in at.dataframe for c in df.value.columns]
    assert text.count("One GPU: nothing to balance.") == 1


@pytest.mark.parametrize("name", ["gloo_rank0", "cpu_one_step", "cpu_inference"])
def test_a_cpu_only_trace_s_load_page_has_no_gpu_sections_and_says_so_once(runs, monkeypatch, name):
    at = _page(runs, monkeypatch, name, "load")
    text = _text(at)
    headers = [s.value for s in at.subheader]
    assert "GPUs over time" not in headers and not [h for h in headers if h.startswith("GPU time")]
    said = _run(runs, name).model.missing["gpu_samples"]
    assert text.count(said) == 1 and "GPU activity" not in text and "GPUs to sample" not in text, text
    assert "No apply phases" not in text and not re.search(r"\bapply\b", text)


def test_a_one_gpu_traces_overview_caption_speaks_of_no_gradient_bucket(runs, monkeypatch):
    text = _text(_page(runs, monkeypatch, "resnet", "overview"))
    assert "gradient bucket" not in text and "all-reduce" not in text
    assert "backward compute is the span of the step's autograd ops" in text
    assert "last gradient bucket" in _text(_page(runs, monkeypatch, "ddp_gloo", "overview"))


@pytest.mark.parametrize("name, scope", [("gloo_rank0", "rank 0 of 2"), ("nccl_rank0", "rank 0 of 2")])
def test_one_rank_of_a_bigger_job_names_its_world_size_once(runs, monkeypatch, capsys, name, scope):
    model = _run(runs, name).model
    assert model.world_size == 2 and model.ranks == (0,) and model.scope == scope and scope in model.title
    text = _text(_page(runs, monkeypatch, name, "overview"))
    assert "One rank: nothing to balance" not in text
    assert text.count("the other ranks were not imported") == 1 and scope in text
    assert scope in _show(runs, name, capsys)


def test_both_ranks_of_a_job_have_something_to_balance(runs, monkeypatch):
    model = _run(runs, "gloo_both").model
    assert model.ranks == (0, 1) and not model.partial_job and model.nothing_to_balance is None
    assert "nothing to balance" not in _text(_page(runs, monkeypatch, "gloo_both", "overview"))


@pytest.mark.parametrize("name", list(TRACE_RUNS))
def test_a_trace_header_does_not_repeat_itself(runs, monkeypatch, name):
    caption = shown_text(_page(runs, monkeypatch, name, "load").caption[0].value)
    assert "torch.profiler trace · torch.profiler trace" not in caption
    assert caption.count("torch.profiler trace") == 1, caption


def test_a_gloo_ddp_run_names_its_backend_in_runs_listings_and_compare(runs, capsys):
    listing = dpprof.list_runs(runs.dir).set_index("id")
    assert listing.at[runs.ids["ddp_gloo"], "backend"] == "gloo"
    assert "rank" not in set(listing["backend"])
    assert main(["--reports-dir", str(runs.dir), "runs"]) == 0
    line = next(l for l in capsys.readouterr().out.splitlines() if l.startswith(runs.ids["ddp_gloo"]))
    assert " gloo " in line and " rank " not in line
    part = compare.compare_part(_run(runs, "ddp_gloo"))
    assert part.row["backend"] == "gloo"
    assert "(gloo)" in _run(runs, "ddp_gloo").model.title


def test_an_imported_trace_s_workload_is_its_job(runs):
    listing = dpprof.list_runs(runs.dir).set_index("id")
    workload = {name: listing.at[runs.ids[name], "workload"] for name in TRACE_RUNS}
    assert workload["gloo_rank0"] == workload["gloo_both"] == "tinyddp"  # one job, whichever ranks were imported
    assert workload["resnet"] == "resnet50-1gpu-tb-sample" and workload["nccl_rank0"] == "ddp-2ranks-nccl"
    assert LEGACY_WORKLOAD not in workload.values()
    assert len({workload[n] for n in ("gloo_rank0", "cpu_one_step", "cpu_inference", "resnet", "nccl_rank0")}) == 5


def test_compare_opens_on_two_runs_of_one_trace_job_never_two_unrelated_traces(runs):
    listing = dpprof.list_runs(runs.dir)
    readable = listing[listing["reason"].isna()]
    pair, need = compare.default_compare(readable, runs.ids["resnet"])
    assert pair == []  # no other run of its job
    assert "record or import another run of it (the New run page records the built-in workloads only)" in need
    pair, _ = compare.default_compare(readable, runs.ids["gloo_rank0"])
    assert sorted(pair) == sorted([runs.ids["gloo_rank0"], runs.ids["gloo_both"]])


def test_a_trace_imported_before_is_still_known_by_its_files(runs):
    with pytest.raises(dpprof.trace.AlreadyImported):
        import_traces([TRACES / RESNET], runs.dir)


@pytest.mark.parametrize("names, job", [
    (["ddp-2ranks-rank0-nccl.json.gz"], "ddp-2ranks-nccl"),
    (["resnet-rank0.pt.trace.json.gz", "resnet-rank1.pt.trace.json.gz"], "resnet"),
    (["job_rank_3.json", "job_rank_12.json"], "job"),
    (["resnet50-1gpu-tb-sample.pt.trace.json.gz"], "resnet50-1gpu-tb-sample"),
    # torch.profiler.tensorboard_trace_handler: <host>_<pid>.<epoch ms>.pt.trace.json, a pid and time per rank
    (["vm_1234.1700000000000.pt.trace.json", "vm_99.1700000000123.pt.trace.json"], "vm"),
    # ... with a worker_name of the script's: <worker_name>.<epoch ns>.pt.trace.json, no pid
    (["trainer_rank0.1795790935661911523.pt.trace.json.gz", "trainer_rank1.1795790935647464699.pt.trace.json.gz"],
     "trainer"),
    (["rank0.1795790935661911523.pt.trace.json.gz", "rank1.1795790935647464699.pt.trace.json.gz"], LEGACY_WORKLOAD),
    (["w.1795790867980670731.pt.trace.json.gz"], "w"),
    (["rank0.json"], LEGACY_WORKLOAD),  # nothing in the name but its rank
    (["a.json", "b.json"], LEGACY_WORKLOAD),  # nothing in common
    (["ranking-model.json"], "ranking-model"),  # "rank" inside a word is not a rank
])
def test_job_name(names, job):
    assert job_name(names) == job

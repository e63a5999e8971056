"""The dpprof command end to end on CPU workers: profile, runs, show, export, exit codes."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import forked
import pandas as pd
import pytest
import torch

import dpprof
import dpprof.report
from recorded import record
from dpprof.cli import main


def _profile(*extra):
    return main(["profile", "tutorial-linear", "--steps", "6", "--devices", "cpu:3", "--quiet", *extra])


@pytest.mark.parametrize("command", [[], ["profile"], ["runs"], ["show"], ["export"]])
def test_help_on_every_command(command, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([*command, "--help"])
    assert exit_.value.code == 0
    assert "usage: dpprof" in capsys.readouterr().out


# Each usage line names what an option takes as docs/cli.md writes it (RUN, N, DIR), not argparse's upper-cased dest
# (BATCH_SIZE, REPORTS_DIR, CHECK_DIR) or a lower-case "run"
USAGE_METAVARS = [([], ["[--reports-dir DIR]"]),
                  (["profile"], ["[--steps N]", "[--batch-size N]", "[--nproc N]"]),
                  (["check"], ["[--batch-size N]"]),
                  (["capture"], ["[--steps N]", " RUN"]),
                  (["show"], [" RUN"]),
                  (["export"], ["[--out DIR]", " RUN"]),
                  (["ops"], ["[--rank N]", "[--device D]", " RUN"]),
                  (["kernels"], ["[--rank N]", "[--device D]", " RUN"]),
                  (["memory"], ["[--rank N]", "[--device D]", " RUN"]),
                  (["advise"], ["[--check-dir DIR]", "[RUN]"]),
                  (["merge"], ["[--out DIR]", "DIR_OR_FILE [DIR_OR_FILE ...]"])]


@pytest.mark.parametrize("command, shown", USAGE_METAVARS, ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_every_usage_line_names_what_each_option_takes(command, shown, capsys):
    with pytest.raises(SystemExit):
        main([*command, "--help"])
    usage = " ".join(capsys.readouterr().out.split("\n\n")[0].split())
    for text in shown:
        assert text in usage, usage


def test_profile_records_a_run_that_runs_and_show_describe(capsys):
    assert _profile("--name", "cli run") == 0
    runs = dpprof.list_runs()
    assert runs[["name", "status", "workload", "steps", "devices"]].values.tolist() == [
        ["cli run", "finished", "tutorial-linear", 6, "cpu:0,cpu:1,cpu:2"]]
    run_id = runs.loc[0, "id"]
    capsys.readouterr()
    assert main(["runs"]) == 0
    assert run_id in capsys.readouterr().out
    assert main(["show", run_id]) == 0
    out = capsys.readouterr().out
    assert "6 steps" in out and "apply mean (ms)" in out and "peak held (KiB)" in out  # a model of a few KiB
    for device in ("cpu:0", "cpu:1", "cpu:2"):
        assert device in out
    # each of the recorder's notes said once: one that "not in this run" quotes is not repeated as a note
    for message in dict.fromkeys(dpprof.load_run(run_id).notes["message"]):
        assert out.count(message.rstrip(".")) == 1, (message, out)
    stored = dpprof.load_run(run_id)
    # the tutorial's batches of 30 over 100 samples: 30, 30, 30, 10, 30, 30
    assert stored.steps["batch_size"].tolist() == [30, 30, 30, 10, 30, 30]
    assert stored.meta["workload_args"]["batch_size"] == 30


@pytest.mark.parametrize("flags, mode", [((), "bounded"), (("--detail", "all"), "all")])
def test_profile_records_with_the_detail_asked_for(flags, mode):
    assert _profile(*flags) == 0
    run = dpprof.load_run(dpprof.list_runs().loc[0, "id"])
    assert run.meta["detail"]["mode"] == mode and run.model.retention.mode == mode
    assert run.query("SELECT SUM(steps) AS n FROM step_blocks")["n"].iloc[0] == 6  # the aggregates either way


def test_profile_refuses_an_unknown_detail(capsys):
    with pytest.raises(SystemExit) as exit_:
        _profile("--detail", "some")
    assert exit_.value.code == 2 and "--detail: invalid choice: 'some'" in capsys.readouterr().err


@pytest.mark.parametrize("terminal", [False, True])
def test_profile_draws_its_progress_bar_on_a_terminal_only(terminal, monkeypatch, capsys):
    # under nohup or a job scheduler stderr is a log: a bar there is ten lines a second for as long as the run lasts
    monkeypatch.setattr(sys.stderr, "isatty", lambda: terminal)
    assert main(["profile", "tutorial-linear", "--steps", "3", "--devices", "cpu:2"]) == 0
    err = capsys.readouterr().err
    assert ("tutorial-linear on cpu:2" in err) == terminal, err


def test_profile_names_the_run_by_its_absolute_path(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DPPROF_REPORTS", "reports")  # relative: ./reports
    assert _profile() == 0
    run_id = dpprof.list_runs().loc[0, "id"]
    assert f"recorded run {run_id} (6 steps) in {tmp_path}/reports/{run_id}.sqlite\n" in capsys.readouterr().out


def test_export_writes_every_table_with_the_runs_values(tmp_path):
    assert _profile() == 0
    run = dpprof.load_run(dpprof.list_runs().loc[0, "id"])
    out = tmp_path / "csv"
    assert main(["export", run.id, "--out", str(out)]) == 0
    phases = pd.read_csv(out / "phases.csv")
    assert list(phases.columns) == ["step", "call", "phase", "device", "start_ms", "duration_ms",
                                    "device_duration_ms", "rank"]  # rank: 0 for a one-file run
    assert (phases["rank"] == 0).all()
    pd.testing.assert_series_equal(phases["duration_ms"], run.phases["duration_ms"])
    memory = pd.read_csv(out / "memory.csv")
    pd.testing.assert_series_equal(memory["chunk_size"], run.memory["chunk_size"], check_dtype=False)
    summary = pd.read_csv(out / "device_summary.csv").set_index("device")
    assert list(summary.index) == ["cpu:0", "cpu:1", "cpu:2"]
    apply = run.phases.query("phase == 'apply'").groupby("device")["duration_ms"]
    assert summary["apply_mean_ms"].round(9).tolist() == apply.mean().round(9).tolist()
    later = run.phases.query(f"phase == 'apply' and step > {run.steps['step'].min()}").groupby("device")["duration_ms"]
    assert summary["apply_p95_ms"].round(9).tolist() == later.quantile(0.95).round(9).tolist()  # past the first
    assert summary["chunk_size_mean"].tolist() == pytest.approx(run.memory.groupby("device")["chunk_size"].mean().tolist(), rel=1e-14)
    meta = pd.read_csv(out / "run.csv")
    assert meta.loc[0, "id"] == run.id


@pytest.mark.parametrize("out, file, says", [
    ("report.csv", "report.csv", "cannot write {out}: it is an existing file, not a directory"),
    ("report.csv/csv", "report.csv", "cannot write {out}: {file} is an existing file, not a directory"),
], ids=["the-file", "inside-a-file"])
def test_export_into_an_existing_file_says_so_in_one_line_and_writes_nothing(out, file, says, tmp_path, capsys):
    assert _profile() == 0
    run_id = dpprof.list_runs().loc[0, "id"]
    (tmp_path / file).write_text("the user's own file")
    before = sorted(tmp_path.rglob("*"))
    capsys.readouterr()
    assert main(["export", run_id, "--out", str(tmp_path / out)]) == 1
    err = capsys.readouterr().err
    assert err.splitlines() == [f"dpprof: {says.format(out=tmp_path / out, file=tmp_path / file)}; nothing was "
                                "written"], err
    assert sorted(tmp_path.rglob("*")) == before and (tmp_path / file).read_text() == "the user's own file"


def test_exit_codes_for_bad_input(capsys, monkeypatch):
    with pytest.raises(SystemExit) as exit_:
        main(["profile", "--devices", "gpu7", "--quiet"])
    assert exit_.value.code == 2
    assert "--devices 'gpu7'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["profile", "no-such-workload"])
    assert exit_.value.code == 2
    for ddp in ([], ["--ddp"]):  # as on a machine with no GPU; --ddp refuses before starting torchrun
        with monkeypatch.context() as no_gpu, pytest.raises(SystemExit) as exit_:
            no_gpu.setattr(torch.cuda, "is_available", lambda: False)
            main(["profile", *ddp, "--devices", "cuda", "--quiet"])
        assert exit_.value.code == 2
        assert "no CUDA GPU is visible here" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["profile", "--model", "nowhere.models:make", "--input-shape", "5", "--quiet"])
    assert exit_.value.code == 2
    assert "cannot load model factory" in capsys.readouterr().err
    assert main(["show", "no-such-run"]) == 1
    assert "no run 'no-such-run'" in capsys.readouterr().err
    # a path to a file that is not there: said of the path, not "no run '...' in the reports directory"
    assert main(["show", "elsewhere/gone.sqlite"]) == 1
    assert capsys.readouterr().err == "dpprof: no run file 'elsewhere/gone.sqlite': no such file\n"
    assert dpprof.list_runs().empty  # nothing half-made was left behind


_FAILING = """
import torch
from torch import nn


def needs_args(width):
    return nn.Linear(width, 2)


def raises():
    raise RuntimeError("no weights file here")


def frozen():
    return nn.Identity()


def integer_out():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 2)

        def forward(self, x):
            return self.lin(x).argmax(dim=1)
    return M()


def batchnorm():
    return nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))


class _Pair(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, x, mask):
        return self.lin(x) * mask


class _Dict(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, batch):
        return self.lin(batch["image"])


def two_inputs():
    return _Pair()


def dict_input():
    return _Dict()
"""


@pytest.mark.parametrize("factory, says", [("needs_args", "needs_args() failed: TypeError"),
                                           ("raises", "raises() failed: RuntimeError: no weights file here"),
                                           ("frozen", "has no parameter that takes a gradient"),
                                           ("integer_out", "(a batch of 2, one tensor of shape (2, 4) as its "
                                            "forward's only argument, one training step): RuntimeError"),
                                           # what it was given beside torch's words, which name neither
                                           ("two_inputs", "one tensor of shape (2, 4) as its forward's only argument, "
                                            "one training step): TypeError: _Pair.forward() missing 1 required"),
                                           ("dict_input", "one tensor of shape (2, 4) as its forward's only argument, "
                                            "one training step): "),
                                           ("missing", "cannot load model factory 'failing:missing': AttributeError")])
def test_a_model_that_cannot_train_is_refused_in_one_line_before_any_run(factory, says, tmp_path, monkeypatch, capsys):
    (tmp_path / "failing.py").write_text(_FAILING)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(SystemExit) as exit_:
        main(["profile", "--model", f"failing:{factory}", "--input-shape", "4", "--steps", "2", "--quiet"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    message = [line for line in err.splitlines() if line.startswith("dpprof profile: error:")]
    assert len(message) == 1 and says in message[0], err
    assert "Traceback" not in err and dpprof.list_runs().empty


@pytest.mark.parametrize("spec, says", [("failing.py:batchnorm", "run from the file's directory with --model failing:batchnorm"),
                                        ("{dir}/failing.py:batchnorm", "run from {dir} with --model failing:batchnorm")])
def test_a_model_given_as_a_files_path_says_the_module_name_to_give(spec, says, tmp_path, monkeypatch, capsys):
    """As a newcomer writes it: the file, not the module python -m imports (No module named 'failing.py' before)."""
    (tmp_path / "failing.py").write_text(_FAILING)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        main(["profile", "--model", spec.format(dir=tmp_path), "--input-shape", "4", "--steps", "2", "--quiet"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "--model takes a module's name as python -m does, not a file's path" in err
    assert says.format(dir=tmp_path) in err and "Traceback" not in err and dpprof.list_runs().empty


def test_a_workload_that_fails_while_training_says_so_in_one_line_and_keeps_its_run(tmp_path, monkeypatch, capsys):
    """BatchNorm in training mode on a replica of one sample: torch's error, from inside the run."""
    (tmp_path / "failing.py").write_text(_FAILING)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["profile", "--model", "failing:batchnorm", "--input-shape", "4", "--batch-size", "2", "--devices",
                 "cpu:2", "--steps", "2", "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert lines[0].startswith("dpprof: the workload failed while training: ValueError: Caught ValueError in replica")
    assert "Expected more than 1 value per channel" in lines[0] and lines[1].startswith("  dpprof show ")
    [status] = dpprof.list_runs()["status"]
    assert status == "failed"


@pytest.mark.parametrize("argv, says", [
    (["profile", "--devices", "cpu:99999"],
     "--devices 'cpu:99999': 99,999 CPU workers asked, at most 128 exist (cpu:0 to cpu:127"),
    (["profile", "--devices", "cpu:129"], "--devices 'cpu:129': 129 CPU workers asked, at most 128 exist"),
    (["check", "--device-ids", "cpu:0,cpu:300", "--batch-size", "8"],
     "device_ids[1]: cpu:300 is out of range: CPU workers are cpu:0 to cpu:127"),
    (["advise", "RUN", "--memory-gib", "nan"], "argument --memory-gib: 'nan' is not a memory size"),
    (["advise", "RUN", "--memory-gib", "1e308"], "argument --memory-gib: '1e308' is not a memory size"),
    (["advise", "RUN", "--memory-gib", "inf"], "argument --memory-gib: 'inf' is not a memory size"),
    (["advise", "RUN", "--memory-gib", "-2"], "argument --memory-gib: '-2' is not a memory size"),
    (["advise", "RUN", "--memory-gib", "0"], "argument --memory-gib: '0' is not a memory size"),
    (["advise", "RUN", "--memory-gib", "lots"], "argument --memory-gib: 'lots' is not a number of GiB"),
])
def test_out_of_range_numbers_are_one_usage_line_naming_the_value(argv, says, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--quiet"] if argv[0] == "profile" else argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith(f"dpprof {argv[0]}: error: ")
    assert dpprof.list_runs().empty  # nothing was recorded


def test_profile_a_users_model_from_a_factory(tmp_path, monkeypatch):
    (tmp_path / "mymodels.py").write_text(
        "import torch\n"
        "def make():\n"
        "    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 4))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["profile", "--model", "mymodels:make", "--input-shape", "3,4", "--batch-size", "10",
                 "--steps", "3", "--devices", "cpu:2", "--quiet"]) == 0
    run = dpprof.load_run(dpprof.list_runs().loc[0, "id"])
    assert run.meta["workload"] == "mymodels:make"
    assert run.memory.groupby("device")["input_bytes"].first().tolist() == [5 * 12 * 4] * 2


def test_profile_a_users_language_model_on_token_ids(tmp_path, monkeypatch):
    """A model whose first module is an nn.Embedding (a language model) trains on random token ids below its
    vocabulary, not on floats it cannot take ("Expected tensor for argument #1 'indices' to have one of the following
    scalar types: Long, Int" before): every token of the recorded inputs is an int64 under 100."""
    (tmp_path / "lms.py").write_text(
        "import torch\n"
        "def make():\n"
        "    return torch.nn.Sequential(torch.nn.Embedding(100, 8), torch.nn.Flatten(), torch.nn.Linear(16 * 8, 100))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["profile", "--model", "lms:make", "--input-shape", "16", "--batch-size", "6", "--steps", "3",
                 "--devices", "cpu:2", "--quiet"]) == 0
    run = dpprof.load_run(dpprof.list_runs().loc[0, "id"])
    assert run.meta["workload_args"]["inputs"] == "token ids 0..99"
    assert run.memory.groupby("device")["input_bytes"].first().tolist() == [3 * 16 * 8] * 2  # int64 ids
    from dpprof.workloads import user_workload

    (ids,), _ = next(user_workload("lms:make", [16], 6).batches())
    assert ids.dtype == torch.int64 and ids.shape == (6, 16) and 0 <= int(ids.min()) and int(ids.max()) < 100


def test_python_dash_m_and_the_console_script_agree(reports):
    out = forked.run([sys.executable, "-m", "dpprof", "runs"], capture_output=True, text=True, check=True)
    assert "no runs yet" in out.stdout


ROOT = Path(__file__).resolve().parents[1]
_MODEL = ("import torch\n"
          "def make():\n"
          "    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 4))\n")


def _console_script(tmp_path, cwd, *args):
    """Run dpprof the way its console script does: sys.path[0] is the script's folder, not the current one."""
    script = tmp_path / "bin" / "dpprof_entry.py"
    script.parent.mkdir(exist_ok=True)
    script.write_text("import sys\nfrom dpprof.cli import main\nsys.exit(main())\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return forked.run([sys.executable, str(script), *args], cwd=cwd, capture_output=True, text=True, env=env,
                      timeout=300)


@pytest.mark.slow
def test_model_from_the_current_directory_as_the_console_script_runs_it(tmp_path, reports):
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "cwdmodels.py").write_text(_MODEL)
    out = _console_script(tmp_path, folder, "--reports-dir", str(reports), "profile", "--model", "cwdmodels:make",
                          "--input-shape", "3,4", "--batch-size", "4", "--steps", "2", "--devices", "cpu:2",
                          "--quiet")
    assert out.returncode == 0, out.stderr
    assert dpprof.list_runs(reports).loc[0, "workload"] == "cwdmodels:make"


def test_a_model_that_fails_on_the_input_shape_is_refused_in_one_line_before_any_run(tmp_path, monkeypatch, capsys):
    (tmp_path / "shapemodels.py").write_text(_MODEL)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(SystemExit) as exit_:
        main(["profile", "--model", "shapemodels:make", "--input-shape", "3,5", "--steps", "2", "--quiet"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    message = [line for line in err.splitlines() if line.startswith("dpprof profile: error:")]
    assert len(message) == 1 and "--input-shape 3,5" in message[0] and "RuntimeError" in message[0], err
    assert "Traceback" not in err
    assert dpprof.list_runs().empty  # no failed run left in the listing


@pytest.mark.parametrize("argv, says", [
    (["profile", "--model", "m:make", "--input-shape", "3,x,32"], "'3,x,32' is not a shape"),
    (["profile", "--model", "m:make", "--input-shape", "3,,32"], "'3,,32' is not a shape"),
    (["profile", "seg-fcn", "--model", "m:make", "--input-shape", "3,32,32"], "seg-fcn) or --model, not both"),
    (["profile", "--steps", "0"], "--steps must be positive"),
    (["profile", "--capture", "-3:2"], "--capture -3:2: steps A:B need 0 <= A < B"),  # not "expected one argument"
    (["capture", "some-run", "--steps", "2000"], "--steps 2000: at most 1,000 steps in one capture"),  # not exit 1
    (["profile", "seg-fcn", "--input-shape", "3,4"], "the built-in workload (seg-fcn) makes its own"),  # not dropped
    (["check", "--device-ids", "cpu:3"], "--device-ids cpu:0,cpu:1,cpu:2 for 3 workers"),
    # a flag --no-record would drop without a word (the script never runs)
    (["run", "--no-record", "--capture", "1:2", "train.py"], "--no-record records nothing, so --capture would do "
                                                             "nothing: leave it out, or record without --no-record"),
    (["run", "--no-record", "--name", "x", "--detail", "all", "train.py"], "so --name and --detail all would do nothing"),
    # an option the command does not take: its own usage, not the top-level one
    (["show", "some-run", "--json"], "unrecognized arguments: --json"),
    (["runs", "--reports-dir", "elsewhere"], "--reports-dir goes before the command: dpprof --reports-dir DIR runs"),
    (["export", "some-run", "--reports-dir=elsewhere"], "--reports-dir goes before the command"),
])
def test_usage_errors_exit_2_with_the_subcommands_usage(argv, says, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: dpprof {argv[0]} "), err
    assert says in err


def test_check_and_profile_take_the_same_list_of_cpu_workers(capsys):
    from dpprof.cli import parse_devices
    assert [str(d) for d in parse_devices("cpu:0,cpu:1")] == ["cpu:0", "cpu:1"]
    assert len(parse_devices("cpu:3")) == 3
    assert main(["check", "--device-ids", "cpu:0,cpu:1", "--batch-size", "4"]) == 0
    assert "no findings" in capsys.readouterr().out


def test_a_reader_that_closes_the_pipe_early_gets_no_traceback(tmp_path, reports):
    read, write = os.pipe()
    os.close(read)  # `dpprof runs | head` after head has gone
    try:
        out = forked.run([sys.executable, "-m", "dpprof", "runs"], stdout=write, stderr=subprocess.PIPE,
                         text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    finally:
        os.close(write)
    assert "Traceback" not in out.stderr and "BrokenPipeError" not in out.stderr, out.stderr
    assert out.returncode == 0


def test_check_piped_into_a_reader_that_stops_early_still_exits_1_on_findings():
    # `set -o pipefail; dpprof check ... | head -n 1` in a job script: the findings are still a refusal to start
    read, write = os.pipe()
    os.close(read)
    try:
        out = forked.run([sys.executable, "-m", "dpprof", "check", "--device-ids", "cpu:0,cpu:1,cpu:2", "--batch-size",
                          "4"], stdout=write, stderr=subprocess.PIPE, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    finally:
        os.close(write)
    assert "Traceback" not in out.stderr, out.stderr
    assert out.returncode == 1


def _significant_digits(token: str) -> int:
    mantissa = token.lstrip("-").split("e")[0].replace(".", "").lstrip("0")
    return len(mantissa)


def test_exported_csvs_hold_machine_values_without_float_noise_or_python_text(tmp_path):
    assert _profile("--batch-size", "7") == 0  # 7 over 3 workers: chunks 3, 3, 1
    run = dpprof.load_run(dpprof.list_runs().loc[0, "id"])
    out = tmp_path / "csv"
    main(["export", run.id, "--out", str(out)])
    for path in out.glob("*.csv"):
        numbers = re.findall(r"(?<![\w:.])-?\d+\.\d+(?:e-?\d+)?(?![\w:])", path.read_text())
        noisy = [n for n in numbers if _significant_digits(n) > 15]
        assert not noisy, (path.name, noisy[:3])
    meta = pd.read_csv(out / "run.csv")
    cells = [str(v) for v in meta.iloc[0].tolist()]
    assert not [c for c in cells if c.startswith(("[", "{"))], cells
    assert meta.loc[0, "devices"] == "cpu:0,cpu:1,cpu:2" and meta.loc[0, "workload_args.batch_size"] == 7
    summary = pd.read_csv(out / "device_summary.csv")
    assert summary["peak_held_bytes"].dtype.kind == "i"  # bytes as whole numbers, not 47503964.0
    assert (summary["peak_held_bytes"] == dpprof.report.summary_of(run)["peak_held_bytes"].values).all()


def test_runs_shows_control_characters_in_names_escaped_never_obeyed(tmp_path, capsys):
    """A run named with an escape sequence, a bell and a right-to-left override: `runs` prints them as escapes."""
    net = dpprof.DataParallel(torch.nn.Linear(3, 1), dpprof.cpu_devices(2))
    with dpprof.record(name="\x1b[31mred\x1b[0m\x07 \u202eevil"):
        net(torch.randn(4, 3)).sum().backward()
    assert main(["runs"]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out and "\u202e" not in out
    assert "\\x1b[31mred\\x1b[0m\\x07 \\u202eevil" in out


def test_runs_counts_steps_in_whole_numbers_beside_a_file_that_is_no_run(tmp_path, capsys):
    """A file that is no run has no step count: the others' stay whole numbers (3, not 3.0)."""
    run = record(tmp_path, "three", workers=2, steps=3)
    (tmp_path / "bad.sqlite").write_text("junk")
    assert main(["--reports-dir", str(tmp_path), "runs"]) == 0
    out = capsys.readouterr().out
    [line] = [ln for ln in out.splitlines() if ln.startswith(run.id)]
    assert " 3 " in line and " 3.0 " not in line, out
    assert "unreadable: " in out and str(tmp_path / "bad.sqlite") in out
    assert str(dpprof.list_runs(tmp_path)["steps"].dtype) == "Int64"



def test_a_run_file_given_as_the_reports_directory_is_said_never_no_runs_yet(tmp_path, capsys):
    """`--reports-dir reports/RUN.sqlite` (a file, not the directory): `runs` and `show` say so in one line and exit 1,
    not "no runs yet" with exit 0 or "no run in" the file; the run's file is left as it was."""
    run = record(tmp_path, "kept", workers=2, steps=3)
    before = Path(run.path).read_bytes()
    said = f"the reports directory {run.path} is an existing file, not a directory"
    assert main(["--reports-dir", str(run.path), "runs"]) == 1
    out = capsys.readouterr()
    assert out.out == "" and out.err == f"dpprof: {said}\n"
    assert main(["--reports-dir", str(run.path), "show", run.id]) == 1
    assert capsys.readouterr().err == f"dpprof: no run {run.id!r}: {said}\n"
    assert main(["--reports-dir", str(run.path), "show", str(run.path)]) == 0  # the file named as the run still reads
    assert Path(run.path).read_bytes() == before
    assert main(["--reports-dir", str(tmp_path / "none yet"), "runs"]) == 0  # no directory yet: no runs yet
    assert f"no runs yet ({tmp_path / 'none yet'} does not exist)" in capsys.readouterr().out  # a typo is seen

def test_a_reports_directory_that_is_a_symlink_loop_is_said_so_in_one_line(tmp_path, capsys):
    """`--reports-dir LOOP` (a symlink to itself): runs, show, profile and merge --out each say it is a symlink loop, exit
    1; they said "a symlink to LOOP, which is not there", "not a directory" and "file exists"."""
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    said = f"a symlink loop (it points to {loop}), not a directory"
    assert main(["--reports-dir", str(loop), "runs"]) == 1
    assert capsys.readouterr().err == f"dpprof: the reports directory {loop} is {said}\n"
    assert main(["--reports-dir", str(loop), "show", "x"]) == 1
    assert capsys.readouterr().err == f"dpprof: no run 'x': the reports directory {loop} is {said}\n"
    assert main(["--reports-dir", str(loop), "profile", "tutorial-linear", "--steps", "2", "--devices", "cpu:2",
                 "--quiet"]) == 1
    assert capsys.readouterr().err == f"dpprof: cannot record in {loop}: {said}\n"
    from dpprof.recording import Run
    rank = Run(name="rank", reports_dir=tmp_path / "machine", rank=0, world_size=1, sample_hz=None)
    with rank.step():
        pass
    rank.close()
    assert main(["merge", str(tmp_path / "machine"), "--out", str(loop)]) == 1
    assert capsys.readouterr().err == f"dpprof: --out {loop}: {said}; nothing was copied\n"
    assert os.readlink(loop) == str(loop)


def test_a_file_named_with_a_line_break_is_said_in_one_line(tmp_path, capsys):
    """A reports directory and a trace whose names hold a line break: each error is one line, the break written as
    Python writes it (it split the error over two lines)."""
    odd = tmp_path / "a\nb"
    odd.write_text('{"traceEvents": [')
    assert main(["--reports-dir", str(odd), "runs"]) == 1
    escaped = str(odd).replace("\n", "\\n")
    assert capsys.readouterr().err == f"dpprof: the reports directory {escaped} is an existing file, not a directory\n"
    assert main(["--reports-dir", str(tmp_path / "reports"), "import", str(odd)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("dpprof: a\\nb: not JSON"), err
    assert odd.read_text() == '{"traceEvents": ['


def test_check_takes_one_worker_named_cpu0_and_asks_every_worker_named_for_cpu_n(capsys):
    assert main(["check", "--device-ids", "cpu:0", "--batch-size", "10"]) == 0
    assert capsys.readouterr().out.startswith("checked 1 CPU worker, cpu:0, on ")
    with pytest.raises(SystemExit) as exit_:
        main(["check", "--device-ids", "cpu:2", "--batch-size", "10"])
    assert exit_.value.code == 2
    assert ("--device-ids cpu:2 is ambiguous: name every worker, e.g. --device-ids cpu:0,cpu:1 for 2 workers (as "
            "`dpprof profile --devices cpu:2` means)") in capsys.readouterr().err


@pytest.mark.parametrize("size", ["99999999999999999999999", str(2**63 - 1)])
def test_check_refuses_a_batch_past_any_device_in_one_line(size, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["check", "--device-ids", "cpu:0,cpu:1", "--batch-size", size])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "is past any batch a device holds" in err and "Traceback" not in err and "frame" not in err


@pytest.mark.slow
def test_a_ddp_rank_whose_workload_fails_says_why_in_one_line_each(tmp_path, monkeypatch, capsys):
    """Ranks that fail while training (BatchNorm on one sample) each say why in one line, not torchrun's report."""
    (tmp_path / "failing.py").write_text(_FAILING)
    monkeypatch.chdir(tmp_path)  # the ranks import the model from the current directory, as python -m does
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert main(["profile", "--model", "failing:batchnorm", "--input-shape", "4", "--ddp", "--nproc", "2",
                 "--batch-size", "1", "--steps", "2", "--quiet"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == "dpprof: torchrun exited with 1; the ranks' records so far are kept", err
    assert sorted(err[:-1]) == [f"dpprof rank {r}: the workload failed while training: ValueError: Expected more than "
                                "1 value per channel when training, got input size torch.Size([1, 3])" for r in (0, 1)]


def test_run_of_a_script_that_does_not_compile_says_what_python_says_and_records_nothing(tmp_path, reports):
    """A SyntaxError in the script: python's own lines (no traceback of dpprof's frames), exit 1, and no run of 0
    steps left in the reports directory, since nothing ran."""
    script = tmp_path / "broken.py"
    script.write_text("import torch\nmodel = torch.nn.DataParallel(torch.nn.Linear(2, 2)\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    plain = forked.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    out = forked.run([sys.executable, "-m", "dpprof", "run", str(script)], capture_output=True, text=True,
                     timeout=120, env=env)
    assert out.returncode == plain.returncode == 1
    assert "SyntaxError: '(' was never closed" in plain.stderr
    assert out.stderr == plain.stderr and "Traceback" not in out.stderr
    assert not reports.exists() or not list(reports.glob("*.sqlite"))


def test_run_of_a_directory_without_main_is_a_usage_error_and_records_nothing(tmp_path, reports, capsys):
    """python runs a directory's __main__.py; a directory without one is refused in one line before anything is
    recorded (it was a runpy traceback and a failed run of 0 steps)."""
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "train.py").write_text("print('train')\n")
    with pytest.raises(SystemExit) as exited:
        main(["run", str(tmp_path / "scripts")])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "a directory with no __main__.py" in err and "Traceback" not in err
    assert not reports.exists() or not list(reports.glob("*.sqlite"))

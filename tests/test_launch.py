"""dpprof.launch and dpprof.processes: one description of a profile, its words, and its starts (in this process,
as a child, under torchrun), each recording under the run id chosen before the start."""
from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import dpprof
from dpprof.cli import build_parser, main
from dpprof.launch import DEFAULT_NPROC, LaunchError, Profile, ProfileError
from dpprof.processes import progress_line, run_row
from dpprof.workload_names import WORKLOAD_NAMES, WORKLOAD_SAMPLES

# -- words: argv and the shell command ------------------------------------------------------------

_text = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), min_size=1, max_size=20)
_positive = st.integers(1, 10**6)


@st.composite
def profiles(draw) -> Profile:
    model = draw(st.booleans())
    ddp = draw(st.booleans())
    workload = None if model else draw(st.none() | st.sampled_from(WORKLOAD_NAMES))
    most = WORKLOAD_SAMPLES.get(workload or "", 10**6)  # a batch over a finite data set's is refused (a test below)
    return Profile(
        workload=workload,
        model=draw(st.from_regex(r"[a-z_][a-z0-9_.]{0,10}:[a-z_]\w{0,8}", fullmatch=True)) if model else None,
        input_shape=tuple(draw(st.lists(_positive, min_size=1, max_size=4))) if model else None,
        devices=draw(st.none() | st.sampled_from(["cpu:2", "cpu:0,cpu:1", "cuda", "0,1", "cpu:7", "-1"])),
        batch_size=draw(st.none() | st.integers(1, most)), steps=draw(_positive),
        balanced=False if ddp else draw(st.booleans()), ddp=ddp, nproc=draw(_positive) if ddp else DEFAULT_NPROC,
        bucket_cap_mb=draw(st.none() | st.floats(1e-6, 1e6)) if ddp else None,
        detail=draw(st.sampled_from(["bounded", "all"])), name=draw(st.none() | _text),
        run_id=draw(st.none() | st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_-]{0,30}", fullmatch=True)),
        reports_dir=draw(st.none() | _text),
        env=draw(st.dictionaries(st.from_regex(r"[A-Z_][A-Z0-9_]{0,8}", fullmatch=True), _text, max_size=2)))


def _parsed(argv: list[str]) -> Profile:
    """What ``dpprof`` makes of argv: the CLI's own parser, then Profile.from_args."""
    args = build_parser().parse_args(argv)
    assert args.command == "profile" and args.func.__name__ == "_cmd_profile"
    return Profile.from_args(args)


@settings(max_examples=100, deadline=None)
@given(profiles())
def test_a_profile_goes_through_argv_and_the_clis_parser_unchanged(profile):
    from dataclasses import replace

    assert _parsed(profile.argv()) == replace(profile, env={})
    assert _parsed(profile.argv(quiet=True)) == replace(profile, env={})  # --quiet is no part of the profile


@settings(max_examples=100, deadline=None)
@given(profiles())
def test_the_shell_command_is_the_environment_then_argv_as_a_shell_reads_it(profile):
    words = shlex.split(profile.command())
    env = {}
    while "=" in words[0] and words[0] != "dpprof":
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    assert env == dict(profile.env) and words[0] == "dpprof" and words[1:] == profile.argv()


def test_the_commands_users_read_keep_their_order():
    assert Profile(workload="cifar-lenet", ddp=True, nproc=2, batch_size=16, steps=6).command() == \
        "dpprof profile cifar-lenet --ddp --nproc 2 --batch-size 16 --steps 6"
    assert Profile(workload="seg-fcn", devices="cpu:2", batch_size=16, balanced=True, steps=20, name="a b",
                   env={"OMP_NUM_THREADS": "1"}).command() == \
        "OMP_NUM_THREADS=1 dpprof profile seg-fcn --devices cpu:2 --batch-size 16 --balanced --steps 20 --name 'a b'"


@pytest.mark.parametrize("fields, message", [
    ({"steps": 0}, "--steps must be positive, got 0"),
    ({"workload": "cifar-lenet", "model": "m:f", "input_shape": (3,)},
     "give a built-in workload (cifar-lenet) or --model, not both"),
    ({"workload": "resnet"}, ("unknown workload 'resnet'; choose one of tutorial-linear, cifar-lenet, sorted-gru, "
                              "seg-fcn")),
    ({"ddp": True, "balanced": True}, "--ddp computes each rank's loss on its own outputs already: no --balanced"),
    ({"ddp": True, "nproc": 0}, "--nproc must be positive, got 0"),
    ({"model": "m:f"}, "--model needs --input-shape (the shape of one sample, e.g. 3,224,224)"),
    ({"input_shape": (3, 4)}, ("--input-shape is the shape of --model's inputs; the built-in workload (cifar-lenet) "
                               "makes its own: give --model, or leave it out")),
    ({"batch_size": 0}, "batch size must be positive, got 0"),
    ({"workload": "tutorial-linear", "batch_size": 101},  # its loader would yield the 100 as one batch
     "tutorial-linear's data set holds 100 samples: --batch-size takes 1 to 100, got 101"),
    ({"workload": "tutorial-linear", "ddp": True, "batch_size": 1000},
     "tutorial-linear's data set holds 100 samples: --batch-size takes 1 to 100 (each rank's), got 1,000"),
    ({"bucket_cap_mb": 1.0}, "--bucket-cap-mb is DDP's gradient bucket size: give it with --ddp"),
    ({"ddp": True, "bucket_cap_mb": 0.0}, "--bucket-cap-mb must be a positive number of MB, got 0"),
    ({"ddp": True, "bucket_cap_mb": float("nan")}, "--bucket-cap-mb must be a positive number of MB, got nan"),
    ({"detail": "some"}, "--detail 'some': choose one of bounded, all"),
    ({"run_id": "../x"}, ("--run-id '../x': a run id is 1 to 64 letters, digits, '-' and '_', starting with a "
                          "letter or digit")),
    ({"env": {"A B": "1"}}, "environment variable name 'A B' is not a name like OMP_NUM_THREADS"),
])
def test_a_profile_that_cannot_start_is_one_line_in_the_clis_words(fields, message):
    with pytest.raises(ProfileError) as err:
        Profile(**fields)
    assert str(err.value) == message


def test_the_cli_refuses_a_bad_run_id_with_that_line_and_records_nothing(tmp_path, capsys):
    with pytest.raises(SystemExit) as done:
        main(["--reports-dir", str(tmp_path), "profile", "tutorial-linear", "--steps", "2", "--run-id", "a.b"])
    assert done.value.code == 2
    assert "dpprof profile: error: --run-id 'a.b': a run id is" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("nproc", ["2", "4"])
def test_nproc_without_ddp_or_fsdp_is_refused_not_ignored(tmp_path, capsys, nproc):
    with pytest.raises(SystemExit) as done:  # the default's own value too: the user asked for ranks
        main(["--reports-dir", str(tmp_path), "profile", "tutorial-linear", "--steps", "2", "--nproc", nproc])
    assert done.value.code == 2
    assert f"dpprof profile: error: --nproc {nproc} starts ranks with --ddp or --fsdp only" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ProfileError, match="--nproc 4 starts ranks"):
        Profile(workload="tutorial-linear", nproc=4)
    assert Profile(workload="tutorial-linear", fsdp=True, nproc=4).argv()[-4:-2] == ["--nproc", "4"]
    assert "--nproc" not in Profile(workload="tutorial-linear").argv()
    assert Profile(workload="tutorial-linear").nproc == DEFAULT_NPROC


def test_the_run_id_is_chosen_once_before_the_start():
    profile = Profile(workload="tutorial-linear")
    assert profile.run_id is None
    chosen = profile.with_run_id()
    assert chosen.run_id and chosen.with_run_id() is chosen  # never chosen again
    assert Profile(workload="tutorial-linear", run_id=chosen.run_id).with_run_id().run_id == chosen.run_id


# -- starts ----------------------------------------------------------------------------------------

def test_run_in_process_records_under_the_id_it_was_given(tmp_path):
    profile = Profile(workload="tutorial-linear", devices="cpu:2", steps=3, reports_dir=str(tmp_path),
                      run_id="given-in-process")
    assert profile.run() == "given-in-process"
    run = dpprof.load_run("given-in-process", tmp_path)
    assert len(run.steps) == 3 and run.meta["devices"] == ["cpu:0", "cpu:1"]


@pytest.mark.slow
def test_a_child_process_reports_the_run_id_it_was_given(tmp_path):
    started = Profile(workload="tutorial-linear", devices="cpu:2", steps=3, name="child",
                      reports_dir=str(tmp_path)).start(log=tmp_path / "child.log")
    assert started.run_id and started.cmd[-3:] == ["--run-id", started.run_id, "--quiet"]
    assert started.wait(300) == 0, started.log_tail()
    started.raise_for_status()
    assert started.status() == ("exited", 0)
    row = run_row(dpprof.list_runs(tmp_path), started.run_id)
    assert row is not None and row["name"] == "child" and row["status"] == "finished"
    run = dpprof.load_run(started.run_id, tmp_path)
    assert run.meta["pid"] == started.pid and len(run.steps) == 3


@pytest.mark.slow
def test_stop_ends_the_child_with_sigterm_and_keeps_the_steps_it_recorded(tmp_path):
    started = Profile(workload="tutorial-linear", devices="cpu:2", steps=1_000_000,
                      reports_dir=str(tmp_path)).start(log=tmp_path / "long.log")
    try:
        deadline = time.monotonic() + 120
        while (row := run_row(dpprof.list_runs(tmp_path), started.run_id)) is None or not row["steps"] >= 3:
            assert started.running, started.log_tail()
            assert time.monotonic() < deadline, "3 steps on disk"
            time.sleep(0.3)
        line = progress_line(row["steps"], started.profile.steps, row["duration_s"])
        assert line is not None and line.startswith(f"step {int(row['steps']):,} of 1,000,000")
    finally:
        started.stop()
    started.wait(60)
    assert started.stopped and started.status()[0] == "exited"
    run = dpprof.load_run(started.run_id, tmp_path)
    assert len(run.steps) >= 3
    assert run_row(dpprof.list_runs(tmp_path), started.run_id)["status"] == "interrupted"


@pytest.mark.slow
def test_a_child_that_fails_is_one_error_with_its_last_lines_and_leaves_no_run(tmp_path):
    profile = Profile(workload="tutorial-linear", devices="cpu:0", steps=2, reports_dir=str(tmp_path))
    with pytest.raises(LaunchError) as err:
        profile.run_child(timeout_s=300)
    assert err.value.returncode == 2 and "cpu:N needs a positive number of workers" in str(err.value)
    assert str(err.value).startswith("dpprof --reports-dir")
    assert dpprof.list_runs(tmp_path).empty


def test_a_run_id_already_taken_leaves_the_run_that_has_it_whole(tmp_path):
    profile = Profile(workload="tutorial-linear", devices="cpu:2", steps=2, reports_dir=str(tmp_path),
                      run_id="taken")
    profile.run()
    before = (tmp_path / "taken.sqlite").read_bytes()
    again = Profile(workload="tutorial-linear", devices="cpu:2", steps=5, reports_dir=str(tmp_path), run_id="taken")
    with pytest.raises(ProfileError, match=f"^--run-id taken: {tmp_path} holds a run of that id already "
                                           r"\(taken.sqlite\); give another id, or none for a new one$"):
        again.run()
    with pytest.raises(LaunchError, match="holds a run of that id already"):  # a child says so too, exit 2
        again.run_child(timeout_s=300)
    assert (tmp_path / "taken.sqlite").read_bytes() == before
    assert len(dpprof.load_run("taken", tmp_path).steps) == 2


@pytest.mark.slow
def test_ddp_under_torchrun_records_under_the_id_it_was_given(tmp_path):
    ticks = []
    profile = Profile(workload="tutorial-linear", ddp=True, nproc=2, steps=3, reports_dir=str(tmp_path),
                      run_id="given-ddp")
    assert profile.run_ddp(on_step=lambda: ticks.append(1)) == "given-ddp"
    assert len(ticks) == 3  # rank 0's steps, one tick each
    runs = dpprof.list_runs(tmp_path)
    assert runs["id"].tolist() == ["given-ddp"]
    run = dpprof.load_run("given-ddp", tmp_path)
    assert sorted(run.steps["rank"].unique().tolist()) == [0, 1]


def test_ddp_with_small_buckets_records_the_buckets_it_was_given(tmp_path):
    """--bucket-cap-mb reaches DDP (the bucket finding advises changing bucket_cap_mb; dpprof profile --ddp had no way
    to): cifar-lenet's 242 KiB of gradients, capped at 50 KB a bucket, are all-reduced in several buckets a step past the
    first (with the default 25 MB, in one), none holding them all (DDP's buckets end at a parameter: fc1's 188 KiB
    weight fills one of its own), and the run says the cap it trained with."""
    profile = Profile(workload="cifar-lenet", ddp=True, nproc=2, steps=3, batch_size=4, bucket_cap_mb=0.05,
                      reports_dir=str(tmp_path), run_id="small-buckets")
    assert "--bucket-cap-mb 0.05" in profile.command()
    profile.run_ddp()
    run = dpprof.load_run("small-buckets", tmp_path)
    assert run.meta["workload_args"]["bucket_cap_mb"] == 0.05
    later = run.comms[run.comms["step"] > 0]
    per_step = later.groupby(["rank", "step"])["bucket"].nunique()
    total = later.groupby(["rank", "step"])["bucket_bytes"].sum()
    assert (per_step >= 2).all() and (later["bucket_bytes"] < total.min()).all(), later


def test_describing_a_profile_loads_no_torch():
    code = ("import sys; from dpprof.launch import Profile; import dpprof.processes, dpprof.advise.commands; "
            "Profile(workload='cifar-lenet', ddp=True).command(); print('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"


def test_the_library_never_calls_its_own_cli():
    """Only the command itself (cli.py, __main__.py) imports dpprof.cli: the library starts profiles with
    dpprof.launch."""
    import ast
    from pathlib import Path

    package = Path(dpprof.__file__).parent
    importers = []
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [f"{node.module}.{a.name}" for a in node.names] if isinstance(node, ast.ImportFrom)
                     and node.module else [])
            if any(n == "dpprof.cli" or n.startswith("dpprof.cli.") for n in names):
                importers.append(str(path.relative_to(package)))
    assert importers == ["__main__.py"]


def test_the_dashboard_server_serves_the_app_and_is_gone_after_its_block(tmp_path):
    """processes.dashboard_server (the docs' screenshots, bench/read_side.py and the browser test start the dashboard
    through it): the health check answers before it yields, the page is served, and the process ends with the block;
    a server that cannot start is one DashboardError carrying its own output."""
    import urllib.request

    from dpprof.processes import DashboardError, dashboard_server

    app = Path(__file__).resolve().parents[1] / "app.py"
    with dashboard_server(app, tmp_path / "reports", tmp_path / "streamlit.log") as served:
        assert urllib.request.urlopen(f"{served.url}/_stcore/health", timeout=10).read() == b"ok"
        assert urllib.request.urlopen(served.url, timeout=10).status == 200
        os.kill(served.pid, 0)  # alive inside the block
    with pytest.raises(ProcessLookupError):
        os.kill(served.pid, 0)  # reaped after it
    with pytest.raises(DashboardError) as err:
        with dashboard_server(tmp_path / "no-such-app.py", tmp_path / "reports", tmp_path / "bad.log"):
            pass
    assert "ended with status" in str(err.value) and "no-such-app.py" in str(err.value)

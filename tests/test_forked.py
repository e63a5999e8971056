"""tests/forked.py: a child forked from the server shows its command what a fresh interpreter shows it."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

import forked

pytestmark = pytest.mark.slow  # each test starts fresh interpreters that import torch, to compare with

_PROBE = """
import atexit, os, sys, threading, time
import torch
print(sys.argv, sys.path[0], os.getcwd(), os.environ.get("PROBE"), torch.get_num_threads(), __name__)
print("mine" in sys.path, sys.stdin.read() if os.environ.get("PROBE") == "stdin" else "")
atexit.register(lambda: print("at exit", end=""))  # printed at shutdown, unflushed: the interpreter flushes it
threading.Thread(target=lambda: (time.sleep(0.2), print("thread joined"))).start()
sys.exit(int(os.environ.get("CODE", "0")))
"""

_RAISES = "import sys\nprint(__file__, sys.argv, sys.path[0])\nraise ValueError('bad ' + sys.argv[1])\n"


def _both(args, **kw):
    """(forked, fresh) CompletedProcess of the same command."""
    return forked.run(args, capture_output=True, text=True, timeout=120, **kw), \
        subprocess.run(args, capture_output=True, text=True, timeout=120, **kw)


@pytest.mark.parametrize("env", [{}, {"OMP_NUM_THREADS": "1", "PROBE": "x", "CODE": "3"},
                                 {"PROBE": "stdin", "PYTHONPATH": "mine"}], ids=["plain", "omp1-exit3", "stdin-path"])
def test_a_command_given_code_sees_what_a_fresh_interpreter_would(tmp_path, env):
    ours, fresh = _both([sys.executable, "-c", _PROBE, "a", "--b"], cwd=tmp_path, env={**os.environ, **env},
                        input="from stdin")
    assert (ours.returncode, ours.stdout, ours.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)
    assert "at exit" in ours.stdout and "thread joined" in ours.stdout


def test_a_script_and_a_module_see_their_file_argv_and_path_and_raise_as_python_shows_it(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "raises.py").write_text(_RAISES)
    (tmp_path / "mod.py").write_text(_RAISES)
    for args in (["sub/raises.py", "x"], ["-m", "mod", "y"]):
        ours, fresh = _both([sys.executable, *args], cwd=tmp_path)
        assert (ours.returncode, ours.stdout) == (fresh.returncode, fresh.stdout) and ours.returncode == 1
        assert ours.stderr == fresh.stderr, (ours.stderr, fresh.stderr)


def test_an_interrupted_command_runs_its_exit_handlers_then_ends_by_sigint_as_python_does(tmp_path):
    code = "import atexit\natexit.register(print, 'handled')\nraise KeyboardInterrupt"
    ours, fresh = _both([sys.executable, "-c", code], cwd=tmp_path)
    assert (ours.returncode, ours.stdout, ours.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)
    assert ours.returncode == -signal.SIGINT and ours.stdout == "handled\n"


def test_a_child_is_killed_timed_out_and_put_in_a_session_of_its_own_as_subprocess_does(tmp_path):
    code = "import os, time\nprint(os.getsid(0) == os.getpid(), flush=True)\ntime.sleep(60)"
    child = forked.Popen([sys.executable, "-c", code], stdout=forked.PIPE, text=True, start_new_session=True)
    assert child.stdout.readline().strip() == "True" and child.poll() is None
    os.killpg(child.pid, signal.SIGKILL)
    assert child.wait(30) == -signal.SIGKILL
    child.stdout.close()
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        forked.run([sys.executable, "-c", "import time; time.sleep(60)"], timeout=0.5)
    assert time.monotonic() - started < 30


def test_only_this_interpreter_is_forked():
    assert forked.run(["echo", "not python"], capture_output=True, text=True).stdout == "not python\n"
    with pytest.raises(AssertionError, match="not a python command"):
        forked.Popen(["echo"])

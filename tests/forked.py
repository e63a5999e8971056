"""Python child processes for the tests without paying torch's import in each: ``run`` and ``Popen`` take the
arguments of ``subprocess.run`` and ``subprocess.Popen`` and, for a command ``[sys.executable, ...]``, fork the
child from a server process that imported torch and dpprof once (the way multiprocessing's forkserver preloads).

A fresh interpreter on this 2-core machine spends about 3 s of CPU importing torch: the suite starts over a
hundred of them, and most test what their command does, not how the interpreter starts. The forked child is set
up as ``python`` would set up a fresh one: the given environment, working directory, file descriptors 0-2,
``sys.argv``, ``sys.path`` (the script's directory, '' for -c, the working directory for -m, then $PYTHONPATH) and a
fresh ``__main__``; it exits through the interpreter's own shutdown (atexit, flushing, threads joined).

What it cannot be is an interpreter that has not imported torch and dpprof: a test about what a process imports
(the read side's "no torch"), about modules patched when a script imports them, or about a checkout other than
this one uses ``subprocess`` itself. So does any command that is not this interpreter (torchrun's ranks,
Chromium, mount).
"""
from __future__ import annotations

import atexit
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

PIPE = subprocess.PIPE
DEVNULL = subprocess.DEVNULL
STDOUT = subprocess.STDOUT

# The server: imports what every child would (torch, dpprof and its command line), then forks one child per request.
# Each request is one connection: a JSON line (argv, env, cwd) with the child's fds 0, 1, 2 passed alongside;
# the server answers the child's pid, then its exit code once it has reaped it.
_SERVER = r"""
import json, os, select, signal, socket, sys, types

import torch, dpprof, dpprof.cli, dpprof.launch  # what the children would import: once, here

BASE_PATH = [p for p in sys.path[1:] if p not in os.environ.get("PYTHONPATH", "").split(os.pathsep)]


def child(request, fds):
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    if request["new_session"]:
        os.setsid()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    if os.environ.get("PYTHONUNBUFFERED") or request["unbuffered"]:
        sys.stdout.reconfigure(write_through=True)
        sys.stderr.reconfigure(write_through=True)
    extra = [os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    kind, target, rest = request["kind"], request["target"], request["rest"]
    first = "" if kind == "-c" else os.getcwd() if kind == "-m" else os.path.dirname(os.path.realpath(target))
    sys.path[:] = [first, *extra, *BASE_PATH]
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = __builtins__
    sys.modules["__main__"] = main
    import runpy
    try:
        if kind == "-c":
            sys.argv = ["-c", *rest]
            exec(compile(target, "<string>", "exec"), main.__dict__)
        elif kind == "-m":
            sys.argv = [target, *rest]
            runpy._run_module_as_main(target, alter_argv=True)
        else:
            sys.argv = [target, *rest]
            path = os.path.abspath(target)  # __file__ absolute, as python 3.9+ has it; sys.argv[0] as given
            with open(path, "rb") as f:
                code = compile(f.read(), path, "exec")
            main.__dict__.update(__file__=path, __cached__=None)
            exec(code, main.__dict__)
    except SystemExit:
        raise
    except BaseException as err:  # as python shows it: the traceback from the command's own first frame
        tb = err.__traceback__.tb_next  # past this function's frame
        sys.excepthook(type(err), err.with_traceback(tb), tb)
        if isinstance(err, KeyboardInterrupt):  # python ends by SIGINT then, after its exit handlers
            import atexit
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        raise SystemExit(1) from None


def serve(path):
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    print("ready", flush=True)
    waiting = {}  # pid -> the connection that asked for it
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes select
    while True:
        try:
            ready, _, _ = select.select([listener, sys.stdin], [], [], 0.2)
        except InterruptedError:
            ready = []
        if sys.stdin in ready and not sys.stdin.buffer.read1(1):
            return  # the tests' process is gone
        if listener in ready:
            conn, _ = listener.accept()
            data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
            while not data.endswith(b"\n"):
                data += conn.recv(1 << 20)
            request = json.loads(data)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                listener.close()
                conn.close()
                for c in waiting.values():
                    c.close()
                return child(request, fds)
            for fd in fds:
                os.close(fd)
            conn.sendall(f"{pid}\n".encode())
            waiting[pid] = conn
        while waiting:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = waiting.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
                except OSError:
                    pass  # the test that asked has gone
                conn.close()


serve(sys.argv[1])
"""


# What an interpreter or torch reads from the environment as it starts (libgomp its OMP_NUM_THREADS as torch loads
# it): a child whose environment differs in these from a server's is forked from another server, started with them.
_READ_AT_START = ("OMP_", "MKL_", "KMP_", "GOMP_", "TORCH_", "PYTORCH_", "CUDA_", "LD_", "PYTHON")
_HANDLED = ("PYTHONPATH", "PYTHONUNBUFFERED")


def _start_key(env: dict[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((k, v) for k, v in env.items() if k.startswith(_READ_AT_START) and k not in _HANDLED))


class _Server:
    """A server per test process and environment read at start, started on first use, ended with the test
    process (its stdin is our end of a pipe)."""

    _lock = threading.Lock()
    _servers: dict[tuple[tuple[str, str], ...], _Server] = {}

    def __init__(self, start_env: dict[str, str]) -> None:
        self.dir = tempfile.mkdtemp(prefix="dpprof-forked-")
        atexit.register(shutil.rmtree, self.dir, True)  # its socket, left behind by every test process once
        self.path = os.path.join(self.dir, "server.sock")
        env = {k: v for k, v in os.environ.items()
               if not k.startswith("PYTEST_") and not (k.startswith(_READ_AT_START) and k not in _HANDLED)}
        env.update(start_env)
        self.process = subprocess.Popen([sys.executable, "-c", _SERVER, self.path], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, env=env, cwd=Path(__file__).parent)
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if line.strip() != b"ready":
            raise RuntimeError(f"the fork server did not start (it said {line!r})")

    @classmethod
    def get(cls, env: dict[str, str]) -> _Server:
        """The server whose children start as a fresh interpreter with ``env`` would."""
        key = _start_key(env)
        with cls._lock:
            server = cls._servers.get(key)
            if server is None or server.process.poll() is not None:
                server = cls._servers[key] = cls(dict(key))
            return server


def _python_command(args: Sequence[str]) -> dict[str, Any] | None:
    """The request for ``python ARGS`` if ``args`` is this interpreter run as ``-c CODE``, ``-m MODULE`` or a
    script, with no other option but -u; None otherwise."""
    args = [os.fspath(a) for a in args]
    if not args or args[0] != sys.executable:
        return None
    rest = args[1:]
    unbuffered = False
    while rest and rest[0] == "-u":
        unbuffered, rest = True, rest[1:]
    if not rest:
        return None
    if rest[0] in ("-c", "-m"):
        if len(rest) < 2:
            return None
        return {"kind": rest[0], "target": rest[1], "rest": rest[2:], "unbuffered": unbuffered}
    if rest[0].startswith("-"):
        return None
    return {"kind": "script", "target": rest[0], "rest": rest[1:], "unbuffered": unbuffered}


class Popen:
    """``subprocess.Popen`` of ``[sys.executable, ...]``, forked: pid, stdin/stdout/stderr, poll, wait, communicate,
    send_signal, terminate, kill, returncode; a context manager. Other commands are refused (use subprocess)."""

    def __init__(self, args: Sequence[Any], stdin: Any = None, stdout: Any = None, stderr: Any = None,
                 cwd: str | os.PathLike | None = None, env: dict[str, str] | None = None, text: bool = False,
                 universal_newlines: bool | None = None, encoding: str | None = None, errors: str | None = None,
                 bufsize: int = -1, start_new_session: bool = False) -> None:
        request = _python_command(args)
        assert request is not None, f"not a python command forked.Popen can start: {args!r}"
        self.args = list(args)
        self.returncode: int | None = None
        text = bool(text or universal_newlines or encoding or errors)
        ours: list[int] = []  # our ends of pipes, and files we opened, closed once handed over

        def end(spec: Any, fd: int, reading: bool) -> tuple[int, Any]:
            """(the child's fd, our file object or None)"""
            if spec is None:
                return fd, None
            if spec == PIPE:
                r, w = os.pipe()
                mine, child = (w, r) if reading else (r, w)
                ours.append(child)
                mode = ("w" if reading else "r") + ("" if text else "b")
                return child, open(mine, mode, buffering=bufsize if not text else -1, encoding=encoding,
                                   errors=errors) if text else open(mine, mode, buffering=bufsize)
            if spec == DEVNULL:
                null = os.open(os.devnull, os.O_RDWR)
                ours.append(null)
                return null, None
            return (spec if isinstance(spec, int) else spec.fileno()), None

        fd0, self.stdin = end(stdin, 0, True)
        fd1, self.stdout = end(stdout, 1, False)
        if stderr == STDOUT:
            fd2, self.stderr = fd1, None
        else:
            fd2, self.stderr = end(stderr, 2, False)
        request.update(env=dict(os.environ if env is None else env), cwd=os.path.abspath(cwd or os.getcwd()),
                       new_session=start_new_session)
        self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._conn.connect(_Server.get(request["env"]).path)
            socket.send_fds(self._conn, [json.dumps(request).encode() + b"\n"], [fd0, fd1, fd2])
            reply = b""
            while b"\n" not in reply:
                data = self._conn.recv(64)
                if not data:
                    raise RuntimeError("the fork server closed the connection before starting the child")
                reply += data
            first, _, self._buf = reply.partition(b"\n")
            self.pid = int(first)
        finally:
            for fd in ours:
                os.close(fd)

    def _exit_code(self, timeout: float | None) -> int | None:
        """The exit code the server sends once it has reaped the child; None if not within ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._buf.endswith(b"\n"):
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self._conn], [], [], left)[0]:
                return None
            data = self._conn.recv(64)
            if not data:
                raise RuntimeError(f"the fork server ended before reporting child {self.pid}'s exit")
            self._buf += data
        return int(self._buf)

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._exit_code(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self._exit_code(timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, input: Any = None, timeout: float | None = None) -> tuple[Any, Any]:
        """Read stdout and stderr to their ends (a thread each) while writing ``input``, then wait."""
        deadline = None if timeout is None else time.monotonic() + timeout
        out: dict[str, Any] = {}

        def drain(name: str, f: Any) -> None:
            out[name] = f.read()
            f.close()

        threads = [threading.Thread(target=drain, args=(n, f), daemon=True)
                   for n, f in (("stdout", self.stdout), ("stderr", self.stderr)) if f is not None]
        for t in threads:
            t.start()
        if self.stdin is not None:
            try:
                if input:
                    self.stdin.write(input)
                self.stdin.close()
            except BrokenPipeError:
                pass
        for t in threads:
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return out.get("stdout"), out.get("stderr")

    def __enter__(self) -> Popen:
        return self

    def __exit__(self, *exc: object) -> None:
        for f in (self.stdout, self.stderr, self.stdin):
            if f is not None and not f.closed:
                f.close()
        self.wait()


def run(args: Sequence[Any], *, capture_output: bool = False, timeout: float | None = None, check: bool = False,
        input: Any = None, stdout: Any = None, stderr: Any = None, **kw: Any) -> subprocess.CompletedProcess:
    """``subprocess.run``, forked from the server for ``[sys.executable, ...]``, by subprocess otherwise."""
    if _python_command(args) is None:
        return subprocess.run(args, capture_output=capture_output, timeout=timeout, check=check, input=input,
                              stdout=stdout, stderr=stderr, **kw)
    if capture_output:
        stdout = stderr = PIPE
    stdin = PIPE if input is not None else kw.pop("stdin", None)
    with Popen(args, stdin=stdin, stdout=stdout, stderr=stderr, **kw) as child:
        try:
            out, err = child.communicate(input, timeout)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
            raise
    done = subprocess.CompletedProcess(child.args, child.returncode, out, err)
    if check:
        done.check_returncode()
    return done


def run_ranks(nproc: int, args: Sequence[Any], env: dict[str, str] | None = None, timeout: float = 240
              ) -> list[subprocess.CompletedProcess]:
    """``[sys.executable, *args]`` on ``nproc`` ranks of one job on this host, forked, each with the environment
    torchrun gives its ranks (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, ROLE_RANK, MASTER_ADDR,
    MASTER_PORT): for tests about what ranks do, not about torchrun, which costs a launcher and a fresh interpreter
    per rank. Returns each rank's CompletedProcess (text) once all have ended; once one fails, the others (which
    would wait in a collective for it) are killed.

    Raises:
        subprocess.TimeoutExpired: not all ended within ``timeout`` seconds (all are killed).
    """
    from cpu_traces import _free_port

    base = {**(os.environ if env is None else env), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
            "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0"}
    with tempfile.TemporaryDirectory(prefix="dpprof-ranks-") as tmp:
        outs = [(open(os.path.join(tmp, f"{r}.out"), "w+"), open(os.path.join(tmp, f"{r}.err"), "w+"))
                for r in range(nproc)]
        ranks = [Popen([sys.executable, *map(os.fspath, args)], stdout=out, stderr=err,
                       env={**base, "RANK": str(r), "LOCAL_RANK": str(r), "ROLE_RANK": str(r)})
                 for r, (out, err) in enumerate(outs)]
        deadline = time.monotonic() + timeout
        try:
            while any(p.poll() is None for p in ranks):
                if any(p.returncode not in (None, 0) for p in ranks):
                    break  # the others would wait for it in their next collective
                if time.monotonic() > deadline:
                    raise subprocess.TimeoutExpired([sys.executable, *map(str, args)], timeout)
                time.sleep(0.05)
        finally:
            for p in ranks:
                p.kill()
                p.wait()
        done = []
        for p, (out, err) in zip(ranks, outs):
            out.seek(0)
            err.seek(0)
            done.append(subprocess.CompletedProcess(p.args, p.returncode, out.read(), err.read()))
            out.close()
            err.close()
        return done

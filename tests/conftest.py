"""Shared fixtures: every test records into its own reports directory, never the checkout's."""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

# Where the controller of a pytest-xdist session put the calibration the workers share (calibration_home)
CALIBRATION_ENV = "DPPROF_TEST_CALIBRATION_HOME"


def _calibrate_into(home: Path) -> None:
    """dpprof advise --calibrate's calibration of this machine for 2 CPU workers, cached under ``home``."""
    from dpprof.advise.calibrate import calibrate

    saved = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(home)
    try:
        calibrate(2)
    finally:
        if saved is None:
            del os.environ["XDG_CACHE_HOME"]
        else:
            os.environ["XDG_CACHE_HOME"] = saved


def _may_calibrate(config) -> bool:
    """Whether the tests asked for may use calibration_home: a directory, or a file that names it."""
    for arg in config.args:
        path = Path(config.invocation_params.dir, arg.split("::")[0])
        if path.is_dir() or (path.is_file() and "calibration_home" in path.read_text(encoding="utf-8")):
            return True
    return False


def pytest_configure(config):
    """In tests run by pytest-xdist's workers, the calibration the advisor's tests share is measured here, in the
    controller, before any worker starts: measured beside another worker's tests it reads a loaded machine (a
    thread speedup near 1, a backward that does not grow with the batch), and the predictions drawn from it fail."""
    if hasattr(config, "workerinput") or not getattr(config.option, "numprocesses", None) \
            or os.environ.get(CALIBRATION_ENV) or not _may_calibrate(config):
        return
    home = Path(tempfile.mkdtemp(prefix="dpprof-test-calibration-"))
    _calibrate_into(home)
    os.environ[CALIBRATION_ENV] = str(home)  # the workers, started after this, inherit it
    config.add_cleanup(lambda: (shutil.rmtree(home, ignore_errors=True), os.environ.pop(CALIBRATION_ENV, None)))


@pytest.fixture(autouse=True)
def reports(tmp_path, monkeypatch):
    """A fresh reports directory, also set as $DPPROF_REPORTS for code under test, and a staging directory
    of its own (for a reports directory on a network filesystem), never another test's or the user's."""
    path = tmp_path / "reports"
    monkeypatch.setenv("DPPROF_REPORTS", str(path))
    monkeypatch.setenv("DPPROF_STAGING_DIR", str(tmp_path / "staging"))
    monkeypatch.delenv("DPPROF_NETWORK_FS", raising=False)
    # dpprof advise caches its calibration under $XDG_CACHE_HOME: never the user's from a test
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))
    return path


@pytest.fixture
def mount(tmp_path):
    """mount("260k") or mount("64k", read_only=True): a fresh tmpfs, unmounted after the test; None
    where mounting is not permitted (the test then fakes the filesystem error)."""
    mounted = []

    def make(size: str, read_only: bool = False) -> Path | None:
        point = tmp_path / f"mnt{len(mounted)}"
        point.mkdir()
        options = f"size={size}" + (",ro" if read_only else "")
        try:
            done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(point)],
                                  capture_output=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return None
        if done.returncode != 0:
            return None
        mounted.append(point)
        return point

    yield make
    for point in mounted:
        subprocess.run(["umount", "-l", str(point)], capture_output=True, timeout=30)


@pytest.fixture(scope="session")
def calibration_home(tmp_path_factory):
    """An $XDG_CACHE_HOME holding a real calibration of this machine (dpprof advise --calibrate's) for 2 CPU
    workers at this process's intra-op threads, measured once per session (by the controller, under pytest-xdist):
    point XDG_CACHE_HOME here."""
    if os.environ.get(CALIBRATION_ENV):
        return Path(os.environ[CALIBRATION_ENV])
    home = tmp_path_factory.mktemp("xdg-cache")
    _calibrate_into(home)
    return home


@pytest.fixture
def fake_gpus(monkeypatch):
    """Install the fake pynvml and fake CUDA device properties: ``fake_gpus([fake_pynvml.gpu(...), ...])``.

    torch's device i is NVML's GPU ``torch_order[i]`` (CUDA_VISIBLE_DEVICES can reorder them).
    Returns the fake module, whose state the test may change further.
    """
    import sys
    from types import SimpleNamespace

    import torch

    import fake_pynvml

    def install(gpus, multiprocessors=None, torch_order=None):
        fake_pynvml.reset(gpus)
        monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml)
        order = torch_order or list(range(len(gpus)))
        props = []
        for i in order:
            g = gpus[i]
            domain, bus, device = g["bus_id"].split(":")[0], g["bus_id"].split(":")[1], g["bus_id"].split(":")[2]
            props.append(SimpleNamespace(
                name=g["name"], total_memory=g["total"],
                multi_processor_count=(multiprocessors or [108] * len(gpus))[i], major=8, minor=0,
                pci_domain_id=int(domain, 16), pci_bus_id=int(bus, 16), pci_device_id=int(device.split(".")[0], 16)))
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: len(props))
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props[i])
        return fake_pynvml

    return install


@pytest.fixture(scope="session")
def profiled(tmp_path_factory):
    """``profiled(directory, "tutorial-linear", "--ddp", "--nproc", "2", "--steps", "4")``: that ``dpprof profile``
    run, recorded once per session (by one of pytest-xdist's workers, in the directory above theirs), copied into
    ``directory`` (recorded.ProfiledOnce)."""
    from recorded import ProfiledOnce

    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # pytest-N/, above popen-gwK/
    return ProfiledOnce(shared / "profiled-once")

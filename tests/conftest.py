"""Shared test set-up: hermetic demo files, no network, a shared latent cache for trainer tests."""
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from modules.util.bytecode import keep_bytecode  # noqa: E402 - standard library only

# The test processes keep their bytecode as the scripts do, before any test module imports torch: where the
# packages have none and Python may write none (PYTHONDONTWRITEBYTECODE=1, as on CI), every pytest worker,
# every process a test starts directly (spawn, `python -c`, the scripts without keep_bytecode) and every
# test module's assertion rewrite compiled from source again (torch + diffusers + transformers: 32 s of CPU
# a process, 11 s from the cache, at load 17 on 2 cores). Children inherit it (modules/util/bytecode.py).
keep_bytecode()
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    """Each test's pytest-timeout limit (the ini default or its own mark) scaled to the machine's load as the
    test starts: the limit is there to end a hang, and a busy laptop must pass the suite too. Runs before
    pytest-timeout's own wrapper (tryfirst), which reads the mark put first here."""
    from tests.patience import patience
    marker = item.get_closest_marker("timeout")
    seconds = (marker.kwargs.get("timeout", marker.args[0] if marker.args else None) if marker
               else item.config.getini("timeout"))
    if seconds:
        item.add_marker(pytest.mark.timeout(patience(float(seconds))), append=False)
    yield


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """The known-slowest tests first, spread over the xdist workers (tests/slowest_first.py says why)."""
    from tests.slowest_first import known_seconds, slowest_first, worker_count
    items[:] = slowest_first(items, known_seconds(), worker_count(config))


@pytest.fixture(scope="session")
def tandem_home(tmp_path_factory) -> Path:
    """Demo model and dataset built once per test session, outside the repository."""
    home = tmp_path_factory.mktemp("tandem_home")
    os.environ["TANDEM_HOME"] = str(home)
    return home


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch thread for the module's tests: tiny models run far faster that way on 2 busy cores."""
    import torch  # here, not at the top: pytest-xdist's controller loads this file and runs no test
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def _die_with_parent() -> None:
    """The X server ends with the test process that started it, also when that process crashes (a crashed
    xdist worker never runs the fixture's teardown; its servers were left running)."""
    import ctypes
    pr_set_pdeathsig = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


_INTERPRETERS: list = []
"""Every Tk interpreter a test process creates, kept to the process's end as the app keeps its one. A
closed window left in a reference cycle was otherwise freed by whichever thread the cyclic collector
happened to run on next (a GUI test's TensorBoard starter, a memory estimate), and an interpreter freed on
another thread than its own aborts the whole process ("Tcl_AsyncDelete: async handler deleted by the wrong
thread"; CI: an xdist worker "crashed while running" a later GUI test). The app itself has one window and
one interpreter for the life of its process, so it never frees one."""


def _keep_every_interpreter() -> None:
    import tkinter
    create = tkinter.Tk.__init__
    if getattr(create, "keeps_interpreters", False):
        return

    def create_and_keep(self, *args, **kwargs):
        create(self, *args, **kwargs)
        _INTERPRETERS.append(self.tk)
    create_and_keep.keeps_interpreters = True
    tkinter.Tk.__init__ = create_and_keep


@pytest.fixture(scope="session")
def display():
    """One X server for the whole test process, never one per stretch of this module's tests: a worker
    that runs other modules' tests between them (pytest-xdist's worksteal) would otherwise stop the server
    while a closed window's Tk interpreter still held a connection to it, and Xlib ended the whole process
    at that connection's next use (xdist: "node down: Not properly terminated"; reproduced in one process
    by running a test of another module between two of these)."""
    if shutil.which("Xvfb") is None:
        pytest.fail("Xvfb is not installed; run-tests.sh installs it (apt-get install xvfb)")
    _keep_every_interpreter()
    # Xvfb picks a free display itself and writes its number to the pipe (test processes run side by side).
    read_end, write_end = os.pipe()
    server = subprocess.Popen(["Xvfb", "-displayfd", str(write_end), "-screen", "0", "1280x900x24", "-nolisten", "tcp"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, pass_fds=(write_end,),
                              preexec_fn=_die_with_parent)
    os.close(write_end)
    with os.fdopen(read_end) as pipe:
        reply = pipe.readline().strip()
    assert server.poll() is None and reply.isdigit(), "Xvfb exited at start"
    number = int(reply)
    old = os.environ.get("DISPLAY")
    os.environ["DISPLAY"] = f":{number}"
    yield f":{number}"
    server.terminate()
    server.wait(5)
    if old is None:
        os.environ.pop("DISPLAY", None)
    else:
        os.environ["DISPLAY"] = old

"""A one-process CPU run: PyTorch's threads chosen as the launcher chooses its CPU workers' (fewer on a busy
machine), and a stop that ends the run in seconds in every phase, its last sampling and its save included
(a run on a busy machine must not go quiet after its last step, and must end on SIGTERM)."""
from __future__ import annotations

import contextlib
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from modules.util import cpu_threads
from tests.trainer_helpers import tandem_log
from tests.patience import patience
from tests.trainer_helpers import REPO

HANG_S = 300
"""A hang detector, not a speed check: a stop that works ends the run in seconds, even on a busy machine."""


# -- the threads ----------------------------------------------------------------------------------------

def test_an_idle_machine_gives_one_thread_per_usable_core_a_busy_one_fewer(monkeypatch):
    monkeypatch.setattr(cpu_threads, "affinity_cores", lambda: 8)
    monkeypatch.setattr(cpu_threads, "quota_cores", lambda: None)
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    assert cpu_threads.threads_per_worker(1) == 8 and cpu_threads.threads_per_worker(2) == 4
    assert cpu_threads.one_process_cpu_threads(load=0.9)[0] == 8  # this process's own import counts as 1
    threads, why = cpu_threads.one_process_cpu_threads(load=5.0)  # 4 of 8 cores busy elsewhere
    assert threads == 4 and "load 5.0" in why and "OMP_NUM_THREADS" in why, why
    assert cpu_threads.one_process_cpu_threads(load=46.0)[0] == 1  # the busy machine


def test_a_container_quota_lowers_the_usable_cores(monkeypatch, tmp_path):
    quota = tmp_path / "cpu.max"
    monkeypatch.setattr(cpu_threads, "CGROUP_V2_QUOTA", quota)
    monkeypatch.setattr(cpu_threads, "affinity_cores", lambda: 64)
    quota.write_text("150000 100000\n")  # docker run --cpus 1.5
    assert cpu_threads.usable_cores() == 2
    quota.write_text("max 100000\n")
    assert cpu_threads.usable_cores() == 64


def test_a_one_process_cpu_run_sets_and_says_its_threads_and_leaves_an_explicit_choice(monkeypatch):
    import torch

    from modules.single_run import use_cpu_threads
    previous = torch.get_num_threads()
    try:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        monkeypatch.setattr(cpu_threads, "one_process_cpu_threads", lambda load=None: (1, "a reason"))
        torch.set_num_threads(2)
        with tandem_log() as lines:
            use_cpu_threads("cpu")
        assert torch.get_num_threads() == 1 and lines == ["CPU threads: 1 (a reason)."], lines

        monkeypatch.setenv("OMP_NUM_THREADS", "2")  # the user's choice (PyTorch read it at start): left alone
        torch.set_num_threads(2)
        with tandem_log() as lines:
            use_cpu_threads("cpu")
        assert torch.get_num_threads() == 2 and lines == ["CPU threads: 2 (OMP_NUM_THREADS=2)."], lines
    finally:
        torch.set_num_threads(previous)


# -- a stop signal inside the phases that used to ignore it ---------------------------------------------

@contextlib.contextmanager
def _own_signal_handlers():
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)


def _signal_self_and_wait(signum=signal.SIGTERM) -> None:
    os.kill(os.getpid(), signum)
    for _ in range(1000):  # the handler runs at one of the next lines of Python
        time.sleep(0.001)


def test_a_stop_signal_abandons_work_inside_abandoning_on_stop_at_once(tmp_path):
    from modules.trainer.commands import CommandInbox, StopRequested
    inbox = CommandInbox(tmp_path / "commands")
    with _own_signal_handlers():
        inbox.install_signal_handlers()
        reached_the_end = False
        with pytest.raises(StopRequested):
            with inbox.abandoning_on_stop():
                _signal_self_and_wait()
                reached_the_end = True
        assert not reached_the_end and inbox.pending == {"stop"}
        with pytest.raises(StopRequested):  # a stop that came before: the work does not start
            with inbox.abandoning_on_stop():
                pytest.fail("the work started after a stop")


def test_a_stop_written_to_the_commands_file_abandons_the_next_sampling(tmp_path):
    from modules.trainer.commands import CommandInbox, StopRequested
    inbox = CommandInbox(tmp_path / "commands")
    (tmp_path / "commands").write_text("stop\n")
    with pytest.raises(StopRequested):
        with inbox.abandoning_on_stop():
            pytest.fail("the work started after a stop")


def test_a_stop_during_the_save_is_answered_at_once_and_a_second_one_quits_even_after_the_loop_took_the_first(
        tmp_path, capfd):
    from modules.trainer.commands import CommandInbox
    inbox = CommandInbox(tmp_path / "commands")
    with _own_signal_handlers():
        inbox.install_signal_handlers()
        with inbox.noting_stop("the save is finished first"):
            _signal_self_and_wait()
        assert "SIGTERM: the save is finished first" in capfd.readouterr().err
        assert inbox.take() == {"stop"}  # the loop takes it; the next one still means "quit now"
        with pytest.raises(KeyboardInterrupt):
            _signal_self_and_wait(signal.SIGINT)


# -- the whole run ---------------------------------------------------------------------------------------

def _read_lines(stream, into: queue.Queue) -> None:
    for line in stream:
        into.put(line)
    into.put(None)


def _wait_for(lines: queue.Queue, seen: list[str], text: str, limit_s: float) -> bool:
    """Collect output lines into `seen` until one holds `text` (True) or the output ends or `limit_s` passes."""
    deadline = time.monotonic() + patience(limit_s)
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=1)
        except queue.Empty:
            continue
        if line is None:
            return False
        seen.append(line)
        if text in line:
            return True
    return False


@pytest.mark.slow
def test_sigterm_during_the_final_sampling_ends_a_one_process_cpu_run_in_seconds_with_the_model_saved(
        tmp_path, tandem_home):
    workspace = tmp_path / "ws"
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # the run chooses its threads
    env["PYTHONUNBUFFERED"] = "1"
    overrides = ["training.max_steps=3", f"general.workspace_dir={workspace}", "general.tensorboard=false",
                 "save.backup_every_n_epochs=0",
                 # long enough samples that the stop surely comes while they render (1000: the scheduler's most)
                 "sampling.inference_steps=1000"]
    args = [a for o in overrides for a in ("--config-value", o)]
    proc = subprocess.Popen([sys.executable, str(REPO / "scripts" / "train.py"), "--config-path", "#demo",
                             "--device", "cpu", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, cwd=REPO, start_new_session=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_read_lines, args=(proc.stdout, lines), daemon=True).start()
    seen: list[str] = []
    try:
        sampling = _wait_for(lines, seen, "Rendering the finished model's", HANG_S)
        assert sampling, f"the run never reached its final sampling; it printed:\n{''.join(seen)[-4000:]}"
        time.sleep(1)  # inside the rendering
        proc.send_signal(signal.SIGTERM)
        stopped = time.monotonic()
        try:
            code = proc.wait(timeout=HANG_S)
        except subprocess.TimeoutExpired:
            code = None
        took = time.monotonic() - stopped
        _wait_for(lines, seen, "\0", 10)  # the rest of the output
        output = "".join(seen)
        assert code == 0, f"exit {code} {took:.0f} s after SIGTERM during the final sampling; it printed:\n" \
                          f"{output[-4000:]}"
        assert "Stop requested: the samples of step 3 were abandoned." in output, output[-4000:]
        assert "Model saved:" in output and (workspace / "output" / "demo").is_dir(), output[-4000:]
        threads = [line for line in seen if line.startswith("CPU threads: ")]
        assert len(threads) == 1, f"no one line about the CPU threads; it printed:\n{output[:3000]}"
        count = int(threads[0].split()[2])
        assert 1 <= count <= cpu_threads.usable_cores(), threads[0]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()

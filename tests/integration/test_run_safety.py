"""Nothing lost: a failed save on N processes, two runs on one workspace, a user's files, a run gone NaN."""
from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from modules.distributed.launch import LaunchError, launch
from modules.trainer import backup as backups
from modules.trainer.finite import NonFiniteTrainingError
from modules.trainer.callbacks import RecordingCallbacks
from modules.trainer.generic_trainer import GenericTrainer
from modules.util.workspace_lock import WorkspaceBusy, WorkspaceLock, workspace_in_use
from tests.trainer_helpers import demo_config, hold_lock, launcher_flag, overrides_for, run_script
from tests.patience import patience


@pytest.fixture(scope="module")
def cache_dir(tandem_home, tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("latent_cache")


def test_a_workspace_in_use_is_refused_naming_the_holder_and_a_killed_holder_frees_it(tmp_path):
    ws = tmp_path / "ws"
    holder = hold_lock(ws)
    try:
        assert str(holder.pid) in workspace_in_use(ws)
        with pytest.raises(WorkspaceBusy, match=rf"in use by another run \(process {holder.pid} on .*-c"):
            WorkspaceLock(ws).acquire()
    finally:
        holder.send_signal(signal.SIGKILL)  # a crash: no clean-up runs
        holder.wait()
    assert workspace_in_use(ws) is None
    with WorkspaceLock(ws):
        assert workspace_in_use(ws) is not None  # held again, by this process now
    assert workspace_in_use(ws) is None


@pytest.mark.slow
def test_second_run_on_a_busy_workspace_stops_at_once(tmp_path, cache_dir):
    ws = tmp_path / "ws"
    holder = hold_lock(ws)
    try:
        started = time.monotonic()
        single = run_script("train.py", "--config-path", "#demo", *overrides_for(ws, cache_dir), "--device", "cpu")
        assert single.returncode == 2 and "in use by another run" in single.stdout + single.stderr
        assert "Traceback" not in single.stdout + single.stderr
        assert not (ws / "backups").exists() and not (ws / "output").exists()
        with pytest.raises(LaunchError, match="in use by another run"):
            launch(demo_config(ws, cache_dir, "multi_gpu.enabled=true", "multi_gpu.num_gpus=2",
                               "multi_gpu.launcher=spawn"))
        assert time.monotonic() - started < patience(60)
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.slow
def test_a_users_config_json_in_the_workspace_is_left_alone(tmp_path, cache_dir):
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "config.json").write_text('{"mine": true}')
    cfg = demo_config(ws, cache_dir, "training.max_steps=1")
    trainer = GenericTrainer(cfg, RecordingCallbacks())
    trainer.run()
    assert (ws / "config.json").read_text() == '{"mine": true}'
    assert json.loads((ws / "config" / f"{trainer.run_id}.json").read_text())["training"]["max_steps"] == 1


@pytest.mark.slow  # trains
def test_a_run_whose_loss_turns_nan_stops_saves_nothing_and_calls_no_absurd_backup_good(tmp_path, cache_dir):
    """A huge learning rate (finite, so validation passes) sends the weights to inf within a few steps:
    the run must fail naming the step, write no final model, and keep its earlier good backup.
    learning_rate=1e30: after step 1 the weights reach 1e29 - finite, so backed up, but absurd: the loss
    computed from them is not finite. The refusal must not name that backup as the good one.
    (One run for both: they trained the same config twice.)"""
    cb = RecordingCallbacks()
    cfg = demo_config(tmp_path / "ws", cache_dir, "training.max_steps=12", "save.backup_every_n_steps=1",
                      "training.learning_rate=1e30", "optimizer.name=sgd", "training.max_grad_norm=0",
                      "training.precision=fp32", method="full")
    trainer = GenericTrainer(cfg, cb)
    with pytest.raises(NonFiniteTrainingError, match=r"(loss of step \d+ is (nan|inf)|weights hold NaN).*"
                                                     r"Nothing was saved as the final model") as error:
        trainer.run()
    assert not trainer.completed and not cb.of_type("done"), "a run gone NaN reported itself done"
    assert not (tmp_path / "ws" / "output").exists(), "a run gone NaN saved a final model"
    for found in backups.list_backups(tmp_path / "ws" / "backups"):
        weights, _, _ = backups.read_backup(found.path)
        assert all(torch.isfinite(w).all() for w in weights.values()), f"{found.path} holds non-finite weights"
    # the backup of absurd (finite) weights is not called good
    text = str(error.value)
    written = [b.step for b in backups.list_backups(tmp_path / "ws" / "backups")]
    assert written and "good backup" not in text and "sound weights is" not in text, (written, text)
    steps = ", ".join(map(str, written))
    assert f"the backup(s) at step(s) {steps} hold the weights that led to it - do not continue them" in text, text


@pytest.mark.slow
def test_nan_on_two_processes_stops_every_rank(tmp_path, cache_dir):
    result = run_script("train_multi_gpu.py", "--config-path", "#demo", "--num-gpus", "2", "--device", "cpu", "--spawn",
                        *overrides_for(tmp_path / "ws", cache_dir, "training.max_steps=12", "optimizer.name=sgd",
                                       "training.learning_rate=1e30", "training.max_grad_norm=0",
                                       "training.precision=fp32", "save.backup_every_n_steps=1", method="full"),
                        timeout=patience(300))
    out = result.stdout + result.stderr
    assert result.returncode != 0 and "NonFiniteTrainingError" in out and '"completed": true' not in out, \
        f"exit code {result.returncode}; the run's output ends:\n{out[-4000:]}"
    assert not (tmp_path / "ws" / "output").exists(), out[-3000:]
    # One statement about the backups, whichever rank says it (rank 1 once said none was written).
    said = {line.split("NonFiniteTrainingError: ", 1)[1] for line in out.splitlines()
            if "failed: NonFiniteTrainingError: " in line}
    assert len(said) == 1 and "good backup" not in next(iter(said)), said


@pytest.mark.slow
def test_failed_final_save_on_two_processes_backs_up_and_ends(tmp_path, cache_dir):
    """The reported hang: rank 0 took its 'back up instead' path while rank 1 waited at a barrier until the
    process-group timeout, and no backup was written. Every rank must take the backup path together. The ranks
    agree on it among themselves (the trainer's collectives), whichever launcher started them: one launch,
    under spawn; torchrun's end of a failed job is tests/integration/test_launch_safety.py's killed-rank test."""
    ws = tmp_path / "ws"
    # A link to a drive that is not mounted: the start cannot tell it from one that will be, the final save fails.
    blocker = tmp_path / "unmounted-drive"
    blocker.symlink_to(tmp_path / "nowhere")
    started = time.monotonic()
    result = run_script("train_multi_gpu.py", "--config-path", "#demo", "--num-gpus", "2", "--device", "cpu",
                        *launcher_flag("spawn"),
                        *overrides_for(ws, cache_dir, "training.max_steps=3", f"save.output_dir={blocker / 'out'}",
                                       "multi_gpu.timeout_minutes=60"), timeout=400)
    elapsed = time.monotonic() - started
    out = result.stdout + result.stderr
    assert result.returncode != 0, out
    # Seconds, not the hour of the process-group timeout (on a busy machine a few times the seconds).
    assert elapsed < min(patience(200), 3000), f"took {elapsed:.0f} s: waited for the process-group timeout\n{out[-3000:]}"
    assert "Saving the model failed; writing a backup" in out
    newest = backups.latest_backup(ws / "backups")
    assert newest is not None and newest.step == 3, out
    _, state, _ = backups.read_backup(newest.path)
    assert state["global_step"] == 3 and len(state["rng"]) == 2


@pytest.mark.slow
def test_a_failed_one_process_run_prints_one_line_and_keeps_the_traceback_in_a_file(tmp_path, cache_dir):
    """scripts/train.py ended in a bare traceback; it says one line, as the launchers do, naming the file."""
    ws = tmp_path / "ws"
    result = run_script("train.py", "--config-path", "#demo", "--device", "cpu",
                        *overrides_for(ws, cache_dir, "training.max_steps=12", "optimizer.name=sgd",
                                       "training.learning_rate=1e30", "training.max_grad_norm=0",
                                       "training.precision=fp32", method="full"), timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode == 1 and "Traceback" not in output, output[-3000:]
    (line,) = [line for line in output.splitlines() if line.startswith("error: ")]
    details = ws / ".tandem" / "failures" / "rank-0.log"
    assert line.startswith("error: NonFiniteTrainingError: Training stopped: ") and line.endswith(f"(details: {details})")
    assert "Traceback" in details.read_text()


HOLD_WORKER_LOCK = """
import sys, time
sys.path.insert(0, {repo!r})
from modules.util.workspace_lock import WorkerLock
WorkerLock({ws!r}, 1).acquire()
print("holding", flush=True)
time.sleep(600)
"""


def test_the_workspace_is_not_free_while_a_worker_of_an_earlier_run_lives(tmp_path, monkeypatch):
    """kill -9 of a launcher freed its lock while its workers lived on for 1.6-33 s, and a new run took the
    workspace while they still wrote. A worker holds a lock of its own: a new run waits for it, then refuses."""
    import subprocess
    import sys
    from modules.util import workspace_lock
    from modules.util.workspace_lock import WorkspaceBusy, WorkspaceLock, workspace_in_use
    from tests.trainer_helpers import REPO
    ws = tmp_path / "ws"
    worker = subprocess.Popen([sys.executable, "-c", HOLD_WORKER_LOCK.format(repo=str(REPO), ws=str(ws))],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert worker.stdout.readline().strip() == "holding"
        monkeypatch.setattr(workspace_lock, "WORKERS_GRACE_S", 0.5)
        with pytest.raises(WorkspaceBusy, match=rf"worker processes of an earlier run are still running \(process "
                                                rf"{worker.pid} on .*rank-1 of a training run\)"):
            WorkspaceLock(ws).acquire()
        assert "worker processes of an earlier run" in workspace_in_use(ws)
        # The refused start did not keep the workspace: once the worker ends, a run takes it.
        threading.Timer(1.0, worker.kill).start()
        monkeypatch.setattr(workspace_lock, "WORKERS_GRACE_S", 60)
        started = time.monotonic()
        WorkspaceLock(ws).acquire().release()
        assert worker.poll() is not None and time.monotonic() - started >= 0.5
        assert workspace_in_use(ws) is None
    finally:
        worker.kill()

"""Nothing lost: a failed save on N processes, two runs on one workspace, a user's files, a run gone NaN."""
from __future__ import annotations

import json
import signal
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
        assert time.monotonic() - started < 60
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


@pytest.mark.slow
def test_a_run_whose_loss_turns_nan_stops_and_saves_nothing(tmp_path, cache_dir):
    """A huge learning rate (finite, so validation passes) sends the weights to inf within a few steps:
    the run must fail naming the step, write no final model, and keep its earlier good backup."""
    cb = RecordingCallbacks()
    cfg = demo_config(tmp_path / "ws", cache_dir, "training.max_steps=12", "save.backup_every_n_steps=1",
                      "training.learning_rate=1e30", "optimizer.name=sgd", "training.max_grad_norm=0",
                      "training.precision=fp32", method="full")
    trainer = GenericTrainer(cfg, cb)
    with pytest.raises(NonFiniteTrainingError, match=r"(loss of step \d+ is (nan|inf)|weights hold NaN).*"
                                                     r"Nothing was saved as the final model"):
        trainer.run()
    assert not trainer.completed and not cb.of_type("done")
    assert not (tmp_path / "ws" / "output").exists()
    for found in backups.list_backups(tmp_path / "ws" / "backups"):
        weights, _, _ = backups.read_backup(found.path)
        assert all(torch.isfinite(w).all() for w in weights.values()), f"{found.path} holds non-finite weights"


@pytest.mark.slow
def test_nan_on_two_processes_stops_every_rank(tmp_path, cache_dir):
    result = run_script("train_multi_gpu.py", "--config-path", "#demo", "--num-gpus", "2", "--device", "cpu", "--spawn",
                        *overrides_for(tmp_path / "ws", cache_dir, "training.max_steps=12", "optimizer.name=sgd",
                                       "training.learning_rate=1e30", "training.max_grad_norm=0",
                                       "training.precision=fp32", method="full"), timeout=300)
    out = result.stdout + result.stderr
    assert result.returncode != 0 and "NonFiniteTrainingError" in out and '"completed": true' not in out
    assert not (tmp_path / "ws" / "output").exists()


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["spawn", "torchrun"])
def test_failed_final_save_on_two_processes_backs_up_and_ends(tmp_path, cache_dir, launcher):
    """The reported hang: rank 0 took its 'back up instead' path while rank 1 waited at a barrier until the
    process-group timeout, and no backup was written. Every rank must take the backup path together."""
    ws = tmp_path / "ws"
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    started = time.monotonic()
    result = run_script("train_multi_gpu.py", "--config-path", "#demo", "--num-gpus", "2", "--device", "cpu",
                        *launcher_flag(launcher),
                        *overrides_for(ws, cache_dir, "training.max_steps=3", f"save.output_dir={blocker / 'out'}",
                                       "multi_gpu.timeout_minutes=4"), timeout=400)
    elapsed = time.monotonic() - started
    out = result.stdout + result.stderr
    assert result.returncode != 0, out
    assert elapsed < 200, f"took {elapsed:.0f} s: waited for the process-group timeout"
    assert "Saving the model failed; writing a backup" in out
    newest = backups.latest_backup(ws / "backups")
    assert newest is not None and newest.step == 3, out
    _, state, _ = backups.read_backup(newest.path)
    assert state["global_step"] == 3 and len(state["rng"]) == 2

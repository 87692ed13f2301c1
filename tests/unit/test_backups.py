"""Backups: grouped by run, rotated within a run, resumed by time, loaded without running code."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch

from modules.trainer import backup as backups
from modules.trainer.callbacks import RecordingCallbacks
from modules.trainer.commands import CommandInbox
from modules.trainer.generic_trainer import GenericTrainer
from tests.trainer_helpers import demo_config, run_script


@pytest.fixture(scope="module")
def cache_dir(tandem_home, tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("latent_cache")


def fake_backup(backups_dir: Path, run_id: str, step: int, written: float, keep: int = 3) -> Path:
    path = backups.write_backup(backups_dir, run_id, step, {"w": torch.full((2,), float(step))},
                                {"global_step": step}, {}, keep=keep)
    manifest = json.loads((path / backups.MANIFEST).read_text())
    (path / backups.MANIFEST).write_text(json.dumps({**manifest, "time": written}))
    return path


def test_rotation_keeps_the_newest_of_each_run_and_never_touches_other_runs(tmp_path):
    bdir = tmp_path / "backups"
    for step in (200, 242, 400):
        fake_backup(bdir, "run-old", step, written=1000.0 + step)
    for step in (10, 20, 30, 43):
        fake_backup(bdir, "run-new", step, written=5000.0 + step, keep=2)
    steps = {(b.run_id, b.step) for b in backups.list_backups(bdir)}
    assert steps == {("run-old", 200), ("run-old", 242), ("run-old", 400), ("run-new", 30), ("run-new", 43)}
    # The newest by time, not by step number or name: the new run's step 43 beats the old run's step 400.
    newest = backups.latest_backup(bdir)
    assert (newest.run_id, newest.step) == ("run-new", 43)
    assert "run run-new, step 43" in newest.describe()
    assert backups.latest_backup(bdir, "run-old").step == 400


def test_a_kill_while_rotation_deletes_a_backup_leaves_no_backup_with_missing_files(tmp_path, monkeypatch):
    """A process killed while rotation deletes an old backup (seen in a fault trial: torchrun's agent killed)
    must not leave that folder under its own name with some files gone - its manifest still there, it would be
    listed, offered and fail to load. The kill is simulated inside the delete, after the state file went."""
    import shutil

    bdir = tmp_path / "backups"
    for step in (10, 20):
        fake_backup(bdir, "run", step, written=100.0 + step, keep=2)
    real_rmtree = shutil.rmtree

    def killed_mid_delete(path, *args, **kwargs):
        (Path(path) / backups.STATE).unlink()
        raise KeyboardInterrupt("killed while deleting (simulated)")

    monkeypatch.setattr(shutil, "rmtree", killed_mid_delete)
    with pytest.raises(KeyboardInterrupt):
        fake_backup(bdir, "run", 30, written=130.0, keep=2)
    monkeypatch.setattr(shutil, "rmtree", real_rmtree)
    listed = backups.list_backups(bdir)
    assert [b.step for b in listed] == [20, 30]
    for info in listed:
        weights, state, _ = backups.read_backup(info.path)
        assert state["global_step"] == info.step
    backups.remove_interrupted(bdir)  # the next start: the hidden leftover of the delete goes
    assert sorted(p.name for p in (bdir / "run").iterdir()) == ["step-00000020", "step-00000030"]

    from modules.util import atomic

    def refused(folder):
        raise PermissionError(f"{folder}: held open (simulated)")

    monkeypatch.setattr(atomic, "_set_aside", refused)  # a folder that cannot be renamed stays whole; the backup is written
    fake_backup(bdir, "run", 40, written=140.0, keep=2)
    assert sorted(b.step for b in backups.list_backups(bdir)) == [20, 30, 40]


def test_backups_written_before_run_ids_are_still_found_and_resumed(tmp_path):
    bdir = tmp_path / "backups"
    legacy = backups.write_backup(tmp_path / "x", "r", 7, {"w": torch.ones(1)}, {"global_step": 7}, {}, keep=3)
    manifest = json.loads((legacy / backups.MANIFEST).read_text())
    del manifest["run_id"]  # what Tandem wrote before run ids, directly under backups/
    (legacy / backups.MANIFEST).write_text(json.dumps(manifest))
    bdir.mkdir()
    legacy.rename(bdir / "step-00000007")
    found = backups.find_backup(bdir, "latest")
    assert found.step == 7 and found.run_id == backups.LEGACY_RUN and found.path == bdir / "step-00000007"


def test_find_backup_by_run_id_path_and_clear_errors(tmp_path):
    bdir = tmp_path / "backups"
    fake_backup(bdir, "run-a", 5, written=10.0)
    fake_backup(bdir, "run-a", 6, written=11.0)
    b = fake_backup(bdir, "run-b", 3, written=12.0)
    assert backups.find_backup(bdir, "run-a").step == 6
    assert backups.find_backup(bdir, str(bdir / "run-a")).step == 6
    assert backups.find_backup(bdir, str(b)).path == b
    with pytest.raises(FileNotFoundError, match="run-a, run-b"):
        backups.find_backup(bdir, "run-c")
    with pytest.raises(FileNotFoundError, match="holds no complete backup"):
        backups.find_backup(tmp_path / "empty", "latest")


def test_a_backup_whose_state_runs_code_is_refused(tmp_path):
    marker = tmp_path / "pwned"

    class RunsCode:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    path = fake_backup(tmp_path / "backups", "run-a", 1, written=1.0)
    torch.save({"global_step": 1, "payload": RunsCode()}, path / backups.STATE)
    with pytest.raises(backups.UnsafeBackupError, match="could run code.*not loaded.*system"):
        backups.read_backup(path)
    assert not marker.exists()


@pytest.mark.slow
def test_state_of_a_real_backup_loads_with_weights_only(tmp_path, cache_dir):
    """What the trainer writes (optimizer, schedule, scaler, sampler, every RNG, EMA) is tensors and plain values."""
    cfg = demo_config(tmp_path / "ws", cache_dir, "training.max_steps=2", "save.backup_every_n_steps=2",
                      "training.ema=true")
    GenericTrainer(cfg, RecordingCallbacks()).run()
    newest = backups.latest_backup(tmp_path / "ws" / "backups")
    torch.load(newest.path / backups.STATE, weights_only=True)  # raises if anything needs pickled code
    _, state, manifest = backups.read_backup(newest.path)
    assert state["global_step"] == 2 and manifest["run_id"] == newest.run_id


@pytest.mark.slow
def test_a_new_run_in_a_reused_workspace_keeps_its_own_backups(tmp_path, cache_dir):
    """The reported bug: a fresh run's newest backup was deleted by rotation against an older run's steps,
    and 'continue' then resumed the old run. Now each run rotates its own and resume takes the newest."""
    ws = tmp_path / "ws"
    old = GenericTrainer(demo_config(ws, cache_dir, "training.max_steps=6", "save.backup_every_n_steps=2",
                                     "save.rolling_backup_count=2"), RecordingCallbacks())
    old.run()
    time.sleep(1.1)  # run ids are start times to the second

    inbox = CommandInbox()

    class StopAt(RecordingCallbacks):
        def on_event(self, type_, **fields):
            super().on_event(type_, **fields)
            if type_ == "progress" and fields["step"] == 1:
                inbox.request("stop")

    new = GenericTrainer(demo_config(ws, cache_dir, "training.max_steps=6", "save.backup_every_n_steps=5",
                                     "save.rolling_backup_count=2"), StopAt(), inbox)
    new.run()
    assert new.run_id != old.run_id and not new.completed
    assert backups.finished_at(ws / "backups", old.run_id)[0] == 6  # the finished run says so
    assert backups.finished_at(ws / "backups", new.run_id) is None
    found = {(b.run_id, b.step) for b in backups.list_backups(ws / "backups")}
    assert found == {(old.run_id, 4), (old.run_id, 6), (new.run_id, new.global_step)}

    cb = RecordingCallbacks()
    resumed = GenericTrainer(demo_config(ws, cache_dir, "training.max_steps=6", "save.backup_every_n_steps=5",
                                         "save.rolling_backup_count=2"), cb, resume="latest")
    resumed.run()
    assert resumed.run_id == new.run_id and resumed.completed
    assert cb.of_type("loss")[0]["step"] == new.global_step + 1  # continued the new run, not the old one


@pytest.mark.slow
def test_resume_flag_of_the_script(tmp_path, cache_dir):
    ws = tmp_path / "ws"
    common = ["--config-path", "#demo", "--config-value", f"general.workspace_dir={ws}", "--config-value",
              f"general.cache_dir={cache_dir}", "--config-value", "general.tensorboard=false",
              "--config-value", "sampling.every_n_epochs=0", "--config-value", "data.num_workers=0",
              "--config-value", "save.backup_every_n_epochs=0", "--device", "cpu"]
    nothing = run_script("train.py", *common, "--resume")
    assert nothing.returncode == 2 and "holds no complete backup" in nothing.stderr
    assert "Traceback" not in nothing.stderr + nothing.stdout
    old_field = run_script("train.py", *common, "--config-value", "general.continue_from_backup=true")
    assert old_field.returncode == 2 and "no longer a config field" in old_field.stderr
    assert "--resume" in old_field.stderr

    # The run to continue is trained here, in this process (the script's plain start is tested everywhere; a
    # process of its own cost ~5 s of imports): the same config as the script's `common` makes.
    from modules.config import load_config
    first = GenericTrainer(load_config("#demo", [f"general.workspace_dir={ws}", f"general.cache_dir={cache_dir}",
                                                 "general.tensorboard=false", "sampling.every_n_epochs=0",
                                                 "data.num_workers=0", "save.backup_every_n_epochs=0",
                                                 "general.device=cpu", "training.max_steps=2",
                                                 "save.backup_every_n_steps=2"]), RecordingCallbacks())
    first.run()
    assert first.completed and backups.latest_backup(ws / "backups").step == 2, "the run to continue did not back up"
    second = run_script("train.py", *common, "--config-value", "training.max_steps=3", "--resume")
    assert second.returncode == 0, second.stdout + second.stderr
    assert "Continuing run run-" in second.stdout and "step 2" in second.stdout
    steps = [json.loads(line[len("@tandem "):])["step"] for line in second.stdout.splitlines()
             if line.startswith('@tandem {"type": "loss"')]
    assert steps == [3]


def test_compare_backups_measures_each_run_against_the_first(tmp_path):
    """scripts/gpu/compare_backups.py (the GPU end-to-end check): newest backup of each run vs the first's."""
    from modules.benchmark.equivalence import compare_backups
    fake_backup(tmp_path / "one" / "backups", "run-a", 4, written=1.0)
    fake_backup(tmp_path / "two" / "backups", "run-b", 2, written=1.0)
    fake_backup(tmp_path / "two" / "backups", "run-b", 4, written=2.0)
    result = compare_backups(tmp_path, "one", "two")
    assert result["steps"] == {"one": 4, "two": 4} and result["relative_l2"] == {"two": 0.0}
    fake_backup(tmp_path / "two" / "backups", "run-b", 8, written=3.0)  # weights 8 against 4: 100% apart
    assert compare_backups(tmp_path, "one", "two")["relative_l2"] == {"two": pytest.approx(1.0)}
    with pytest.raises(FileNotFoundError, match="three"):
        compare_backups(tmp_path, "one", "three")


def test_a_sharded_backup_holds_the_trained_parameters_only():
    """What a sharded (FSDP) backup writes through DCP: trained weights and their optimizer state - no
    frozen weight (a LoRA's base comes from the base model) and no buffer (SD3's position embedding, which
    the model rebuilds), as in the other backups."""
    from modules.trainer.sharded_backup import checkpoint_state
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 1))
    model[0].register_buffer("pos_embed", torch.ones(3))
    model[1].weight.requires_grad_(False)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    tensors, entries = checkpoint_state(model, optimizer, None)
    assert sorted(tensors["model"]) == ["0.bias", "0.weight", "1.bias"]
    assert sorted(tensors["optimizer"]) == [f"state.{name}.momentum_buffer" for name in ("0.bias", "0.weight", "1.bias")]
    assert entries["param_groups.0.weight.momentum"] == 0.9

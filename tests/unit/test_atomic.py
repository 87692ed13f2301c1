"""Atomic writes keep the permissions the user's umask gives any new file or folder."""
from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from modules.util.atomic import atomic_directory, build_folder_once, save_safetensors_atomically
from tests.trainer_helpers import demo_config


@pytest.fixture
def umask():
    """Set the process umask for one test (restored afterwards)."""
    previous = os.umask(0o022)
    os.umask(previous)

    def set_umask(value: int) -> None:
        os.umask(value)
    yield set_umask
    os.umask(previous)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.parametrize("mask", [0o022, 0o077, 0o002])
def test_atomic_folders_and_files_follow_the_umask(tmp_path, umask, mask):
    umask(mask)
    with atomic_directory(tmp_path / "backup") as folder:
        (folder / "inner").mkdir()
        save_safetensors_atomically({}, folder / "weights.safetensors")
    assert mode(tmp_path / "backup") == 0o777 & ~mask
    assert mode(tmp_path / "backup" / "inner") == 0o777 & ~mask
    assert mode(tmp_path / "backup" / "weights.safetensors") == 0o666 & ~mask

    built = build_folder_once(tmp_path / "generated", lambda p: (p / "x").write_text("x"),
                              lambda p: (p / "x").is_file())
    assert mode(built) == 0o777 & ~mask


@pytest.mark.slow
@pytest.mark.parametrize("mask", [0o022, 0o077])
def test_a_run_writes_its_model_and_backups_with_the_umask(tmp_path, tandem_home, umask, mask):
    """The full-model folder and the backup folder of a real run (they were 0700 under any umask)."""
    from modules.trainer.generic_trainer import GenericTrainer

    cfg = demo_config(tmp_path / "ws", tmp_path / "cache", "training.max_steps=1", "save.backup_every_n_steps=1",
                      method="full")
    umask(mask)
    GenericTrainer(cfg).run()
    (backup,) = (tmp_path / "ws" / "backups").rglob("step-*")  # backups/<run id>/step-N
    (model,) = [p for p in (tmp_path / "ws" / "output").iterdir() if p.is_dir()]
    for folder in (backup, backup.parent, model, model / "unet"):
        assert mode(folder) == 0o777 & ~mask, folder
    for file in (*backup.iterdir(), model / "model_index.json"):
        assert mode(file) == 0o666 & ~mask, file

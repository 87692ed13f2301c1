"""OutputWriter gets what it uses: the run's live state (`TrainingRun`) and its fixed parts (`RunParts`)."""
from __future__ import annotations

import contextlib

import torch

from modules.config import RunPaths, TrainConfig
from modules.trainer.backup import read_backup
from modules.trainer.outputs import OutputWriter, RunParts
from modules.trainer.run_numbers import derive_run_numbers


class FakeRun:
    """A run at step 3 with one trained weight: all OutputWriter may read of a trainer."""
    global_step, epoch = 3, 1

    def training_state(self) -> dict:
        return {"global_step": self.global_step, "note": "state"}

    def trainable_state(self) -> dict:
        return {"w": torch.full((2,), 0.5)}

    def encoders_on_device(self):
        return contextlib.nullcontext()


def test_a_backup_needs_no_trainer(tmp_path):
    cfg = TrainConfig()
    cfg.general.workspace_dir = str(tmp_path / "ws")
    events = []
    parts = RunParts(cfg=cfg, paths=RunPaths(cfg), bundle=None, device=torch.device("cpu"), ema=None,
                     numbers=derive_run_numbers(cfg, 1, 4), dataset=None,
                     emit=lambda type_, **fields: events.append((type_, fields)),
                     log_image=lambda tag, image, step: None)
    writer = OutputWriter(FakeRun(), parts, "run-1")
    writer.backup()
    writer.finish_backups()
    writer.close()
    assert [(t, f["step"]) for t, f in events] == [("backup", 3)]
    weights, state, manifest = read_backup(writer.last_backup)
    assert torch.equal(weights["w"], torch.full((2,), 0.5)) and state["note"] == "state"
    assert (manifest["global_step"], manifest["epoch"], manifest["run_id"]) == (3, 1, "run-1")
    assert writer.final_path.parent == RunPaths(cfg).output_dir

"""Training-state backups: everything needed to continue exactly where a run stopped.

A backup is a folder `backups/step-<N>` holding the trained weights (`weights.safetensors`), the rest
of the state (`state.pt`: optimizer, schedule, sampler position, step, RNG of every rank, EMA, loss
scaler) and `backup.json`. It is written into a temporary folder and renamed into place in one step,
so a crash mid-write leaves the previous backup as the newest complete one.
"""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from modules.util.atomic import atomic_directory

WEIGHTS = "weights.safetensors"
STATE = "state.pt"
MANIFEST = "backup.json"


def backup_name(step: int) -> str:
    return f"step-{step:08d}"


def write_backup(backups_dir: Path, step: int, weights: dict[str, torch.Tensor], state: dict,
                 manifest: dict, keep: int) -> Path:
    """Write one backup atomically, then delete all but the newest `keep` complete backups."""
    target = Path(backups_dir) / backup_name(step)
    if target.exists():  # a backup of this very step exists already (e.g. "backup now" twice)
        return target
    with atomic_directory(target) as tmp:
        save_file({k: v.detach().contiguous().cpu() for k, v in weights.items()}, str(tmp / WEIGHTS))
        torch.save(state, tmp / STATE)
        (tmp / MANIFEST).write_text(json.dumps({**manifest, "step": step, "time": time.time()}, indent=2))
    for old in list_backups(backups_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return target


def list_backups(backups_dir: Path) -> list[Path]:
    """Complete backups, oldest first. Leftover temporary folders of an interrupted write are ignored."""
    backups_dir = Path(backups_dir)
    if not backups_dir.is_dir():
        return []
    found = [p for p in backups_dir.iterdir()
             if p.is_dir() and p.name.startswith("step-") and (p / MANIFEST).is_file()]
    return sorted(found, key=lambda p: p.name)


def latest_backup(backups_dir: Path) -> Path | None:
    backups = list_backups(backups_dir)
    return backups[-1] if backups else None


def read_backup(path: Path) -> tuple[dict[str, torch.Tensor], dict, dict]:
    """(weights, state, manifest) of a backup folder."""
    path = Path(path)
    weights = load_file(str(path / WEIGHTS))
    # The state holds optimizer tensors, RNG byte tensors and plain Python values only.
    state = torch.load(path / STATE, map_location="cpu", weights_only=False)
    manifest = json.loads((path / MANIFEST).read_text())
    return weights, state, manifest


def remove_interrupted(backups_dir: Path) -> None:
    """Delete temporary folders left by a backup that was interrupted mid-write."""
    backups_dir = Path(backups_dir)
    if backups_dir.is_dir():
        for p in backups_dir.iterdir():
            if p.name.startswith(".step-") and p.name.endswith(".tmp"):
                shutil.rmtree(p, ignore_errors=True)

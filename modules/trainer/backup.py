"""Training-state backups: everything needed to continue exactly where a run stopped.

Backups are grouped by run: `backups/<run id>/step-<N>`. A run keeps its id when it is resumed, so a
new run in a reused workspace never mixes its backups with an earlier run's, rotation deletes only
older backups of the same run, and "resume the newest" means the newest by the time it was written.
Folders of the layout before run ids (`backups/step-<N>`) are still found and resumed.

A backup folder holds the trained weights (`weights.safetensors`), the rest of the state (`state.pt`:
optimizer, schedule, sampler position, step, RNG of every rank, EMA, loss scaler) and `backup.json`.
A sharded (FSDP) run writes `shards/` instead of the weights, with the optimizer state and EMA in it
too, every rank its own part (`sharded_backup.py`); `state.pt` then holds only the plain values.
`state.pt` holds tensors and plain values only and is read with `weights_only=True`, so a doctored
backup cannot run code when it is resumed. The folder is written under a temporary name and renamed
into place in one step, so a crash mid-write leaves the previous backup as the newest complete one.
"""
from __future__ import annotations

import json
import pickle
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from modules.util.atomic import atomic_directory, delete_directory, write_text_atomically
from modules.util.exit import orphaned

WEIGHTS = "weights.safetensors"
STATE = "state.pt"
MANIFEST = "backup.json"
FINISHED = "finished.json"
"""In a run's folder: the run finished (its model saved) at that step and time."""
LEGACY_RUN = "(before run ids)"
"""The run id reported for backups written directly under `backups/` by Tandem before run ids."""


class UnsafeBackupError(RuntimeError):
    """A backup's state file holds something other than tensors and plain values."""


def backup_name(step: int) -> str:
    return f"step-{step:08d}"


def new_run_id(backups_dir: Path) -> str:
    """A run id that sorts by start time and is not used in `backups_dir` yet."""
    base = "run-" + time.strftime("%Y%m%d-%H%M%S")
    candidate, n = base, 1
    while (Path(backups_dir) / candidate).exists():
        n += 1
        candidate = f"{base}-{n}"
    return candidate


@dataclass(frozen=True)
class BackupInfo:
    path: Path
    run_id: str
    step: int
    written: float
    """Seconds since the epoch when the backup was completed (from its manifest)."""

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.written))
        return f"run {self.run_id}, step {self.step} (written {when})"


def write_backup(backups_dir: Path, run_id: str, step: int, weights: dict[str, torch.Tensor], state: dict,
                 manifest: dict, keep: int) -> Path:
    """Write one backup of run `run_id` atomically, then delete all but this run's newest `keep`."""
    run_dir = Path(backups_dir) / run_id
    target = run_dir / backup_name(step)
    if target.exists():  # a backup of this very step of this run exists already (e.g. "backup now" twice)
        return target
    with atomic_directory(target) as tmp:
        save_file({k: v.detach().contiguous().cpu() for k, v in weights.items()}, str(tmp / WEIGHTS))
        write_state_and_manifest(tmp, run_id, step, state, manifest)
        refuse_if_orphaned(target)
    rotate(run_dir, keep)
    return target


class OrphanedWorkerError(RuntimeError):
    """A worker whose launcher has ended, about to publish a backup: it is being killed, and a backup written
    after the launcher died would appear in a workspace a new run may already hold."""


def refuse_if_orphaned(target: Path) -> None:
    if orphaned():
        raise OrphanedWorkerError(f"Not publishing {target}: this worker's launcher has ended.")


def write_state_and_manifest(folder: Path, run_id: str, step: int, state: dict, manifest: dict) -> None:
    """The non-weight part of a backup folder: `state.pt` and, last, `backup.json` (what marks it complete)."""
    torch.save(state, folder / STATE)
    (folder / MANIFEST).write_text(json.dumps({**manifest, "run_id": run_id, "step": step, "time": time.time()},
                                              indent=2))


def rotate(run_dir: Path, keep: int) -> None:
    """Delete all but the newest `keep` complete backups of one run (each set aside first: `delete_directory`).
    One that cannot be renamed (a file of it held open, on Windows) stays whole for the next rotation: a rotation
    never fails the backup that triggered it."""
    for old in _complete_in(run_dir)[:-keep]:
        try:
            delete_directory(old)
        except OSError:
            pass


def _complete_in(folder: Path) -> list[Path]:
    """Complete backup folders directly inside `folder`, lowest step first."""
    if not folder.is_dir():
        return []
    found = [p for p in folder.iterdir() if p.is_dir() and p.name.startswith("step-") and (p / MANIFEST).is_file()]
    return sorted(found, key=lambda p: p.name)


def _info(path: Path, run_id: str) -> BackupInfo | None:
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        return BackupInfo(path, manifest.get("run_id", run_id), int(manifest["step"]), float(manifest["time"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None  # not a backup Tandem can read: never picked, never deleted


def list_backups(backups_dir: Path, run_id: str | None = None) -> list[BackupInfo]:
    """Complete backups of every run (or of `run_id` only), oldest first by the time they were written.

    Leftover temporary folders of an interrupted write are ignored."""
    backups_dir = Path(backups_dir)
    found = [_info(p, LEGACY_RUN) for p in _complete_in(backups_dir)]
    if backups_dir.is_dir():
        for run_dir in sorted(backups_dir.iterdir()):
            if run_dir.is_dir() and not run_dir.name.startswith(("step-", ".")):
                found += [_info(p, run_dir.name) for p in _complete_in(run_dir)]
    infos = [i for i in found if i is not None and (run_id is None or i.run_id == run_id)]
    return sorted(infos, key=lambda i: (i.written, i.step))


def latest_backup(backups_dir: Path, run_id: str | None = None) -> BackupInfo | None:
    found = list_backups(backups_dir, run_id)
    return found[-1] if found else None


def find_backup(backups_dir: Path, which: str) -> BackupInfo:
    """The backup `--resume` names: `latest` (the newest of any run), a run id (its newest), or a path to
    a backup folder (or to a run folder: its newest). Raises FileNotFoundError saying what exists."""
    if which == "latest":
        found = latest_backup(backups_dir)
        if found is None:
            raise FileNotFoundError(f"--resume latest: {backups_dir} holds no complete backup. "
                                    "Start without --resume to train from the beginning.")
        return found
    path = Path(which).expanduser()
    if not path.exists() and (Path(backups_dir) / which).exists():
        path = Path(backups_dir) / which
    if (path / MANIFEST).is_file():
        info = _info(path, path.parent.name if path.parent != Path(backups_dir) else LEGACY_RUN)
        if info is not None:
            return info
    elif path.is_dir():
        newest = [_info(p, path.name) for p in _complete_in(path)]
        newest = [i for i in newest if i is not None]
        if newest:
            return max(newest, key=lambda i: (i.written, i.step))
    runs = sorted({i.run_id for i in list_backups(backups_dir)})
    have = f"runs with backups in {backups_dir}: {', '.join(runs)}" if runs else f"{backups_dir} holds no backup"
    raise FileNotFoundError(f"--resume {which}: not a backup folder, a run folder with backups or a run id "
                            f"({have}). Use --resume latest, or the path of a backups/<run>/step-<N> folder.")


def mark_finished(backups_dir: Path, run_id: str, step: int, output: str | Path) -> None:
    """Record that run `run_id` finished at `step`, its model saved to `output`: its backups then hold nothing
    left to train (continuing one trained 0 images and wrote another copy of the model). Only runs with
    backups get the note."""
    run_dir = Path(backups_dir) / run_id
    if run_dir.is_dir():
        write_text_atomically(run_dir / FINISHED, json.dumps({"step": step, "output": str(output),
                                                             "time": time.time()}, indent=2))


def finished_at(backups_dir: Path, run_id: str) -> tuple[int, float] | None:
    """(step, time) at which run `run_id` last finished, or None if it never did (or the note is unreadable)."""
    try:
        note = json.loads((Path(backups_dir) / run_id / FINISHED).read_text())
        return int(note["step"]), float(note["time"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _safe_globals() -> list:
    """What old backups need beyond tensors and plain values: numpy's RNG state arrays (numpy's own array
    reconstruction, which runs no user code)."""
    import numpy as np
    multiarray = np._core.multiarray if hasattr(np, "_core") else np.core.multiarray
    return [np.ndarray, np.dtype, type(np.dtype(np.uint32)), multiarray._reconstruct]


def read_backup(path: Path) -> tuple[dict[str, torch.Tensor], dict, dict]:
    """(weights, state, manifest) of a backup folder. Raises UnsafeBackupError for a state file that would
    need to run code to load."""
    path = Path(path)
    weights = load_file(str(path / WEIGHTS))
    state, manifest = read_state_and_manifest(path)
    return weights, state, manifest


def read_state_and_manifest(path: Path, mmap: bool = False) -> tuple[dict, dict]:
    """(state, manifest) of a backup folder, the state read without running any code (UnsafeBackupError);
    `mmap`: its tensors mapped from the file, not read (a check costs little for a large optimizer state)."""
    path = Path(path)
    try:
        with torch.serialization.safe_globals(_safe_globals()):
            try:
                state = torch.load(path / STATE, map_location="cpu", weights_only=True, mmap=mmap)
            except RuntimeError as e:
                if not mmap or "mmap" not in str(e):
                    raise
                state = torch.load(path / STATE, map_location="cpu", weights_only=True)  # not a zip file
    except pickle.UnpicklingError as e:
        found = next((line.strip() for line in str(e).splitlines() if "GLOBAL" in line), "")
        raise UnsafeBackupError(
            f"{path / STATE} holds something other than tensors and plain values, which could run code when "
            f"loaded, so it was not loaded{f' ({found})' if found else ''}. Resume only backups Tandem wrote.") from None
    manifest = json.loads((path / MANIFEST).read_text())
    return state, manifest


def check_backup(path: Path) -> None:
    """Refuse a backup that cannot be resumed, before any worker starts: a state file that would run code
    (UnsafeBackupError), or one that cannot be read (ValueError naming the file). Nothing large is read."""
    from safetensors import safe_open

    path = Path(path)
    try:
        read_state_and_manifest(path, mmap=True)
        if (path / WEIGHTS).exists():
            with safe_open(str(path / WEIGHTS), "pt"):
                pass
    except UnsafeBackupError:
        raise
    except Exception as e:  # noqa: BLE001 - damaged or foreign files get one explanation
        raise ValueError(f"--resume {path}: the backup cannot be read ({type(e).__name__}: "
                         f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}); resume another backup, "
                         "or start a new run without --resume.") from None


def check_optimizer(state: dict, optimizer_name: str) -> None:
    """Refuse a backup whose optimizer state belongs to another optimizer than `optimizer_name`, before any of
    it is loaded (backups from before the name was recorded are not checked)."""
    saved = state.get("optimizer_name")
    if saved is not None and saved != optimizer_name:
        raise ValueError(f"optimizer.name: the backup was trained with {saved!r} and this run uses "
                         f"{optimizer_name!r}, whose state it cannot continue; set optimizer.name to "
                         f"{saved!r} to continue the backup, or start a new run without resuming.")


def remove_interrupted(backups_dir: Path) -> None:
    """Delete the hidden folders an interrupted write (`.step-N.XXXX.tmp`) or delete (`.old`) left, in any
    run's folder."""
    backups_dir = Path(backups_dir)
    if not backups_dir.is_dir():
        return
    folders = [backups_dir] + [p for p in backups_dir.iterdir() if p.is_dir() and not p.name.startswith(".")]
    for folder in folders:
        for p in folder.iterdir():
            if p.name.startswith(".step-") and p.name.endswith((".tmp", ".old")):
                shutil.rmtree(p, ignore_errors=True)


def describe_other_runs(backups_dir: Path, run_id: str) -> str | None:
    """One line about backups of earlier runs in this workspace (they are kept, never rotated away)."""
    others = [i for i in list_backups(backups_dir) if i.run_id != run_id]
    if not others:
        return None
    newest = others[-1]
    runs = len({i.run_id for i in others})
    return (f"{backups_dir} also holds {len(others)} backup(s) of {runs} earlier run(s), newest: {newest.describe()}; "
            f"they are kept (this run writes to {Path(backups_dir) / run_id}). Continue one with --resume.")


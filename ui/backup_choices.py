"""The backups a user may continue, newest first, as the Run tab lists them: run, step and date.

A backup written before its run finished holds nothing left to train: continuing it trained 0 images (or
the last steps again) and wrote another copy of the model. Such backups stay in the list, marked, for a
user who raised the epochs to train on; the Continue button does not pick them by itself.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class BackupChoice:
    info: object
    """The backup (`modules.trainer.backup.BackupInfo`): path, run_id, step, written."""
    finished_step: int | None = None
    """The step at which the backup's run finished after the backup was written; None: it did not."""

    @property
    def finished(self) -> bool:
        return self.finished_step is not None

    @property
    def path(self) -> Path:
        return self.info.path

    @property
    def step(self) -> int:
        return self.info.step

    def label(self) -> str:
        """`run-20261201-101500 · step 40 · 2026-12-01 10:20` (`· run finished at step 100`)."""
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(self.info.written))
        done = f" · run finished at step {self.finished_step}" if self.finished else ""
        return f"{self.info.run_id} · step {self.info.step} · {when}{done}"


def backup_choices(backups_dir: Path) -> list[BackupChoice]:
    """Every complete backup in `backups_dir`, newest first."""
    from modules.trainer.backup import finished_at, list_backups  # torch: imported when first needed
    choices, finished = [], {}
    for info in reversed(list_backups(backups_dir)):
        if info.run_id not in finished:
            finished[info.run_id] = finished_at(backups_dir, info.run_id)
        end = finished[info.run_id]
        # A run resumed after it finished and stopped again has newer backups than its finish: those count.
        choices.append(BackupChoice(info, end[0] if end is not None and end[1] >= info.written else None))
    return choices


def default_choice(choices: list[BackupChoice]) -> BackupChoice | None:
    """What Continue resumes unless the user picks another: the newest backup of a run that has not finished."""
    return next((c for c in choices if not c.finished), None)


def backup_the_run_wrote(choices: list[BackupChoice], written: list[tuple[str, int]]) -> BackupChoice | None:
    """What Continue offers once a run ended: the newest backup it wrote (`written`: its backups' run id and
    step, in order) while that one is listed and its run has not finished - a Stop's, rather than a backup
    picked before the run, whose continuing would throw the run's later steps away. None: it wrote none."""
    for run_id, step in reversed(written):
        wrote = next((c for c in choices if c.info.run_id == run_id and c.step == step), None)
        if wrote is not None:
            return None if wrote.finished else wrote
    return None

"""The Run tab's list of backups to continue: run, step and date of each, newest first.

Continue resumes the one picked here. Unless the user picks another, that is the newest backup of a run
that has not finished (ui/backup_choices.py); a finished run's backups are listed, marked, for a user
who raised the epochs to train on.
"""
from __future__ import annotations

from typing import Callable

import customtkinter as ctk

from ..backup_choices import BackupChoice, default_choice
from .buttons import OptionMenu
from .tooltip import Tooltip

NONE = "No backup in this workspace"


class BackupPicker(ctk.CTkFrame):
    def __init__(self, master, on_pick: Callable[[], None]):
        super().__init__(master, fg_color="transparent")
        self.on_pick = on_pick
        self.choices: list[BackupChoice] = []
        self.picked: BackupChoice | None = None
        self._chosen_by_user = False
        label = ctk.CTkLabel(self, text="Continue from")
        label.grid(row=0, column=0, padx=(0, 6))
        self.menu = OptionMenu(self, values=[NONE], width=470, dynamic_resizing=False, command=self._picked)
        self.menu.grid(row=0, column=1)
        for widget in (label, self.menu):
            Tooltip(widget, "The backups in this workspace, newest first: run, step and when each was written. "
                            "Continue resumes the one picked here; without a pick, the newest of a run that has "
                            "not finished. A finished run's backups are marked: continuing one trains only if "
                            "Epochs or Max steps were raised since.")

    def set_choices(self, choices: list[BackupChoice], enabled: bool, offer: BackupChoice | None = None) -> None:
        """The workspace's backups now; a pick the user made stays while that backup is still there. `offer`
        (the backup a run just wrote) replaces that pick, and stays likewise: continuing the pick made before
        the run would throw its later steps away."""
        self.choices = choices
        if offer is not None:
            self.picked, self._chosen_by_user = offer, True
        still = next((c for c in choices if self.picked and c.path == self.picked.path), None)
        if not (self._chosen_by_user and still):
            self.picked, self._chosen_by_user = default_choice(choices), False
        else:
            self.picked = still
        labels = [c.label() for c in choices]
        self.menu.configure(values=labels or [NONE], state="normal" if labels and enabled else "disabled")
        self.menu.set(self.picked.label() if self.picked else (NONE if not labels else "Pick a backup to continue"))

    def forget_pick(self) -> None:
        """A run ended: a pick made before it is not kept (continuing it would throw the run's steps away)."""
        self.picked, self._chosen_by_user = None, False

    def pick(self, choice: BackupChoice) -> None:
        """Pick `choice` as a user would in the menu."""
        self._picked(choice.label())

    def _picked(self, label: str) -> None:
        self.picked = next((c for c in self.choices if c.label() == label), None)
        self._chosen_by_user = self.picked is not None
        self.on_pick()

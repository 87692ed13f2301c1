"""Commands sent to a running training from outside: stop, sample, backup, save.

They arrive as lines appended to the commands file (the GUI writes them; a user can too:
`echo stop >> workspace/run/.tandem/commands`) or, for stop, as SIGINT/SIGTERM. Each rank collects
what it saw; the trainer then merges the flags over all ranks so every rank acts on the same step.
"""
from __future__ import annotations

import os
import signal
from pathlib import Path

from modules.util.no_follow import make_private_folder, open_no_follow
from modules.util.run_protocol import COMMANDS, command_problem


class CommandInbox:
    """Pending command flags of this process."""

    def __init__(self, commands_file: Path | None = None, start: int | None = None) -> None:
        """`start`: the byte offset from which commands are this run's (a launcher passes its own, taken
        before it started the workers, so a stop it writes during their start-up counts); None: the
        file's current end - commands written before this run started belong to an earlier run."""
        self.commands_file = Path(commands_file) if commands_file else None
        self._offset = 0
        self.pending: set[str] = set()
        if self.commands_file is not None:
            make_private_folder(self.commands_file.parent)
            if start is not None:
                self._offset = start
            else:
                self._offset = self.commands_file.stat().st_size if self.commands_file.exists() else 0

    def request(self, command: str) -> None:
        problem = command_problem(command)
        if problem:
            raise ValueError(problem)
        self.pending.add(command)

    def poll(self) -> None:
        """Read lines appended to the commands file since the last poll (a stat call when nothing is new)."""
        if self.commands_file is None or not self.commands_file.exists():
            return
        size = self.commands_file.stat().st_size
        if size <= self._offset:
            return
        with os.fdopen(open_no_follow(self.commands_file, os.O_RDONLY), "rb") as f:  # a link is refused, named
            f.seek(self._offset)
            data = f.read(size - self._offset)
        # Only consume complete lines; a half-written line is read next time.
        end = data.rfind(b"\n") + 1
        self._offset += end
        for raw in data[:end].decode("utf-8", "replace").splitlines():
            word = raw.strip().lower()
            if word in COMMANDS:
                self.pending.add(word)

    def take(self) -> set[str]:
        taken, self.pending = self.pending, set()
        return taken

    def install_signal_handlers(self) -> None:
        """Ctrl-C / SIGTERM ask for a clean stop (with a backup) instead of killing mid-step."""
        def handler(signum, frame):
            if "stop" in self.pending:  # a second Ctrl-C means: really quit now
                raise KeyboardInterrupt
            self.pending.add("stop")
        signal.signal(signal.SIGINT, handler)
        signal.signal(signal.SIGTERM, handler)

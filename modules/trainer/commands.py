"""Commands sent to a running training from outside: stop, sample, backup, save.

They arrive as lines appended to the commands file (the GUI writes them; a user can too:
`echo stop >> workspace/run/.tandem/commands`) or, for stop, as SIGINT/SIGTERM. Each rank collects
what it saw; the trainer then merges the flags over all ranks so every rank acts on the same step.
"""
from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

from modules.util.no_follow import make_private_folder, open_no_follow
from modules.util.run_protocol import COMMANDS, command_problem


class StopRequested(BaseException):
    """A stop signal abandoned work that a stop need not wait for (`CommandInbox.abandoning_on_stop`). A
    BaseException, as KeyboardInterrupt is, so that no `except Exception` on its way swallows it."""

    def __init__(self) -> None:
        super().__init__("a stop was requested")


class CommandInbox:
    """Pending command flags of this process."""

    def __init__(self, commands_file: Path | None = None, start: int | None = None) -> None:
        """`start`: the byte offset from which commands are this run's (a launcher passes its own, taken
        before it started the workers, so a stop it writes during their start-up counts); None: the
        file's current end - commands written before this run started belong to an earlier run."""
        self.commands_file = Path(commands_file) if commands_file else None
        self._offset = 0
        self.pending: set[str] = set()
        self.stop_signals = 0
        """Stop signals this process received (the second one quits at once, `install_signal_handlers`)."""
        self._abandon_on_stop = False
        self._stop_note: str | None = None
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
        """Ctrl-C / SIGTERM ask for a clean stop (with a backup) instead of killing mid-step; inside
        `abandoning_on_stop` they end the work at once, inside `noting_stop` they say what is finished first.
        The second signal quits now (KeyboardInterrupt), also after the loop took the first one."""
        def handler(signum, frame):
            self.stop_signals += 1
            if self.stop_signals > 1 or "stop" in self.pending:  # a second Ctrl-C means: really quit now
                raise KeyboardInterrupt
            self.pending.add("stop")
            if self._abandon_on_stop:
                self._abandon_on_stop = False  # once: what the work undoes on its way out runs to its end
                raise StopRequested()
            if self._stop_note:
                # os.write, not print: the handler may have interrupted a write to the same stream
                os.write(2, f"{signal.Signals(signum).name}: {self._stop_note}\n".encode())
        signal.signal(signal.SIGINT, handler)
        signal.signal(signal.SIGTERM, handler)

    @contextlib.contextmanager
    def abandoning_on_stop(self):
        """Inside, a stop signal abandons the work at once: the handler raises `StopRequested` wherever the
        work is (at its next line of Python; a PyTorch kernel running then finishes first), and a stop that
        came before raises it on entry. For work that costs only time to lose - a sampling in one process,
        which on a busy machine ran 19.5 minutes after the last step while the stop it was sent waited."""
        self.poll()  # a stop written to the commands file since the last step counts too
        if "stop" in self.pending or self.stop_signals:
            raise StopRequested()
        self._abandon_on_stop = True
        try:
            yield
        finally:
            self._abandon_on_stop = False

    @contextlib.contextmanager
    def noting_stop(self, note: str):
        """Inside, a first stop signal is answered at once with `note` on stderr: what the run finishes before
        it acts on the stop (the trained model's save), and that a second signal abandons it."""
        self._stop_note = note
        try:
            yield
        finally:
            self._stop_note = None

"""Opening things outside the GUI: a folder in the file manager, TensorBoard in the browser.

Either may be missing or fail (a server without a desktop, a minimal Linux install, no handler for
folders): the result says what happened in words the window shows, together with the path or address,
so the user can open it by hand. Nothing here raises for that. Success is claimed only when the opener
said so: its exit status is read, and TensorBoard must answer on its port. These calls wait for that
(seconds), so the window runs them off its own thread.
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import webbrowser
from dataclasses import dataclass
from pathlib import Path

from modules.util.ports import find_free_port

FILE_MANAGER_COMMANDS = ("xdg-open", "gio")
OPENER_WAIT_S = 15.0
"""How long an opener may take to say whether it worked. One still running then is taken as working:
some stay until the window they opened closes."""
TENSORBOARD_READY_S = 90.0
"""How long TensorBoard may take to answer on its port (its start imports a lot: seconds on a busy machine)."""


@dataclass(frozen=True)
class Opened:
    ok: bool
    message: str
    """What the window shows: the path or address, and what went wrong if something did."""


def _opener_command(target: str) -> list[str] | None:
    """The desktop's command that opens `target` (a folder or an address) on Linux; None when there is none."""
    for tool in FILE_MANAGER_COMMANDS:
        found = shutil.which(tool)
        if found:
            return [found, target] if tool == "xdg-open" else [found, "open", target]
    return None


def run_opener(command: list[str]) -> str | None:
    """Run an opener (xdg-open, gio open, open) and wait for its verdict: None when it worked, else why not."""
    with tempfile.TemporaryFile(mode="w+", encoding="utf-8", errors="replace") as errors:
        try:
            process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=errors)
        except OSError as e:
            return f"{Path(command[0]).name} could not run ({e.strerror or e})"
        try:
            code = process.wait(timeout=OPENER_WAIT_S)
        except subprocess.TimeoutExpired:
            return None
        if code == 0:
            return None
        errors.seek(0)
        said = [line.strip() for line in errors.read().splitlines() if line.strip()]
        return f"{Path(command[0]).name} failed: " + (said[-1] if said else f"exit code {code}")


def open_folder(path: str | Path) -> Opened:
    path = Path(path).resolve()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return Opened(False, f"Could not create the folder {path}: {e.strerror or e}")
    try:
        if sys.platform == "win32":
            os.startfile(path)  # type: ignore[attr-defined]  # raises OSError when nothing opens it
            problem = None
        elif sys.platform == "darwin":
            problem = run_opener(["open", str(path)])
        else:
            command = _opener_command(str(path))
            if command is None:
                return Opened(False, f"No file manager found (xdg-open is not installed). The folder is {path}")
            problem = run_opener(command)
    except OSError as e:
        problem = f"no file manager could open it ({e.strerror or e})"
    if problem:
        return Opened(False, f"Could not open a file manager ({problem}). The folder is {path}")
    return Opened(True, f"Opened {path}")


def open_url(url: str) -> str | None:
    """Show `url` in the web browser: None when a browser took it, else why not. On Linux through the
    desktop's opener, whose exit status says whether it worked (Python's webbrowser module does not check)."""
    if sys.platform.startswith("linux"):
        command = _opener_command(url)
        if command is not None:
            return run_opener(command)
    try:
        return None if webbrowser.open(url) else "no web browser was found"
    except Exception as e:  # noqa: BLE001 - webbrowser raises whatever its back-end raises
        return f"no web browser could be opened ({e})"


def tensorboard_command(logdir: str | Path, port: int, python: str = sys.executable) -> list[str]:
    return [python, "-m", "tensorboard.main", "--logdir", str(logdir), "--port", str(port),
            "--host", "127.0.0.1"]


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


class TensorBoard:
    """One TensorBoard server per GUI session, restarted when the log folder changes.

    `open_browser(url)` returns None when the page was shown, else why not."""

    def __init__(self, python: str = sys.executable, open_browser=open_url, ready_s: float = TENSORBOARD_READY_S):
        self.python = python
        self.open_browser = open_browser
        self.ready_s = ready_s
        self._process: subprocess.Popen | None = None
        self._errors = None
        self._logdir: Path | None = None
        self.url: str | None = None
        self.answers = _answers
        """Whether something answers on a port (tests replace it)."""

    def open(self, logdir: str | Path, browser: bool = True) -> Opened:
        logdir = Path(logdir).resolve()
        if self._process is None or self._process.poll() is not None or logdir != self._logdir:
            problem = self._start(logdir)
            if problem:
                return Opened(False, f"TensorBoard could not start ({problem}); its logs are in {logdir}")
        if not browser:
            return Opened(True, f"TensorBoard: {self.url}")
        problem = self.open_browser(self.url)
        if problem:
            return Opened(False, f"TensorBoard runs at {self.url}, but the browser did not open it ({problem}): "
                                 "open that address yourself")
        return Opened(True, f"TensorBoard: {self.url} (opened in the browser)")

    def _start(self, logdir: Path) -> str | None:
        """Start the server and wait until it answers; why not, if it does not."""
        self.close()
        self.url = None
        try:
            logdir.mkdir(parents=True, exist_ok=True)
            port = find_free_port()
            # Its messages go to a file, not a pipe: a pipe nobody reads fills up and stops the server.
            self._errors = tempfile.TemporaryFile(mode="w+", encoding="utf-8", errors="replace")
            self._process = subprocess.Popen(tensorboard_command(logdir, port, self.python), stdin=subprocess.DEVNULL,
                                             stdout=self._errors, stderr=subprocess.STDOUT)
        except OSError as e:
            return e.strerror or str(e)
        deadline = time.monotonic() + self.ready_s
        while not self.answers(port):
            code = self._process.poll()
            if code is not None:
                self._errors.seek(0)
                said = [line.strip() for line in self._errors.read().splitlines() if line.strip()]
                self.close()
                return said[-1] if said else f"it exited with code {code}"
            if time.monotonic() > deadline:
                self.close()
                return f"it did not answer on port {port} within {self.ready_s:g} s"
            time.sleep(0.2)
        self._logdir, self.url = logdir, f"http://127.0.0.1:{port}/"
        return None

    def close(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
        self._process = None
        if self._errors is not None:
            self._errors.close()
            self._errors = None

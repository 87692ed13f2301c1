"""Opening things outside the GUI: a folder in the file manager, TensorBoard in the browser.

Either may be missing (a server without a desktop, a minimal Linux install): the result says what
happened in words the window shows, together with the path or address, so the user can open it
by hand. Nothing here raises for that.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import webbrowser
from dataclasses import dataclass
from pathlib import Path

from modules.util.ports import find_free_port

FILE_MANAGER_COMMANDS = ("xdg-open", "gio")


@dataclass(frozen=True)
class Opened:
    ok: bool
    message: str
    """What the window shows: the path or address, and what went wrong if something did."""


def open_folder(path: str | Path) -> Opened:
    path = Path(path).resolve()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return Opened(False, f"Could not create the folder {path}: {e.strerror or e}")
    try:
        if sys.platform == "win32":
            os.startfile(path)  # type: ignore[attr-defined]
        elif sys.platform == "darwin":
            subprocess.Popen(["open", str(path)])
        else:
            tool = next((t for t in FILE_MANAGER_COMMANDS if shutil.which(t)), None)
            if tool is None:
                return Opened(False, f"No file manager found (xdg-open is not installed). The folder is {path}")
            command = [tool, str(path)] if tool == "xdg-open" else [tool, "open", str(path)]
            subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    except OSError as e:
        return Opened(False, f"Could not open a file manager ({e.strerror or e}). The folder is {path}")
    return Opened(True, f"Opened {path}")


def tensorboard_command(logdir: str | Path, port: int, python: str = sys.executable) -> list[str]:
    return [python, "-m", "tensorboard.main", "--logdir", str(logdir), "--port", str(port),
            "--host", "127.0.0.1"]


class TensorBoard:
    """One TensorBoard server per GUI session, restarted when the log folder changes."""

    def __init__(self, python: str = sys.executable, open_browser=webbrowser.open):
        self.python = python
        self.open_browser = open_browser
        self._process: subprocess.Popen | None = None
        self._logdir: Path | None = None
        self.url: str | None = None

    def open(self, logdir: str | Path, browser: bool = True) -> Opened:
        logdir = Path(logdir).resolve()
        if self._process is None or self._process.poll() is not None or logdir != self._logdir:
            self.close()
            try:
                logdir.mkdir(parents=True, exist_ok=True)
                port = find_free_port()
                self._process = subprocess.Popen(tensorboard_command(logdir, port, self.python),
                                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            except OSError as e:
                self.url = None
                return Opened(False, f"TensorBoard could not start ({e.strerror or e}); its logs are in {logdir}")
            self._logdir, self.url = logdir, f"http://127.0.0.1:{port}/"
        if not browser:
            return Opened(True, f"TensorBoard: {self.url}")
        try:
            shown = self.open_browser(self.url)
        except Exception as e:  # noqa: BLE001 - webbrowser raises whatever its back-end raises
            shown, why = False, f" ({e})"
        else:
            why = ""
        if not shown:
            return Opened(False, f"TensorBoard runs at {self.url} - no web browser could be opened{why}; "
                                 "open that address yourself")
        return Opened(True, f"TensorBoard: {self.url} (opened in the browser)")

    def close(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
        self._process = None

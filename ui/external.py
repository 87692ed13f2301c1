"""Opening things outside the GUI: a folder in the file manager, TensorBoard in the browser."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import webbrowser
from pathlib import Path


def open_folder(path: str | Path) -> None:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if sys.platform == "win32":
        os.startfile(path)  # type: ignore[attr-defined]
    elif sys.platform == "darwin":
        subprocess.Popen(["open", str(path)])
    else:
        subprocess.Popen(["xdg-open", str(path)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tensorboard_command(logdir: str | Path, port: int, python: str = sys.executable) -> list[str]:
    return [python, "-m", "tensorboard.main", "--logdir", str(logdir), "--port", str(port),
            "--host", "127.0.0.1"]


class TensorBoard:
    """One TensorBoard server per GUI session, restarted when the log folder changes."""

    def __init__(self, python: str = sys.executable):
        self.python = python
        self._process: subprocess.Popen | None = None
        self._logdir: Path | None = None
        self.url: str | None = None

    def open(self, logdir: str | Path, browser: bool = True) -> str:
        logdir = Path(logdir).resolve()
        if self._process is None or self._process.poll() is not None or logdir != self._logdir:
            self.close()
            logdir.mkdir(parents=True, exist_ok=True)
            port = free_port()
            self._process = subprocess.Popen(tensorboard_command(logdir, port, self.python),
                                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            self._logdir, self.url = logdir, f"http://127.0.0.1:{port}/"
        if browser:
            webbrowser.open(self.url)
        return self.url

    def close(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
        self._process = None

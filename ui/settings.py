"""What the GUI remembers between sessions: the config open at exit and recently used files.

Stored in `$TANDEM_HOME/recent.json`, else `~/.config/tandem/recent.json`. A damaged or missing
file means a fresh start, never a failed one.
"""
from __future__ import annotations

import json
from pathlib import Path

from modules.util.atomic import write_text_atomically
from modules.util.settings_dir import settings_dir

RECENT_LIMIT = 10


class RecentConfigs:
    def __init__(self, folder: Path | None = None):
        self.file = (folder or settings_dir()) / "recent.json"
        self.last: str | None = None
        self.recent: list[str] = []
        try:
            data = json.loads(self.file.read_text(encoding="utf-8"))
            self.last = data.get("last") if isinstance(data.get("last"), str) else None
            self.recent = [p for p in data.get("recent", []) if isinstance(p, str)]
        except (OSError, ValueError, AttributeError):
            pass

    def remember(self, path: str | Path) -> None:
        """Put `path` first in the recent list and make it the config restored at next start."""
        text = str(Path(path).expanduser().resolve())
        self.recent = [text] + [p for p in self.recent if p != text][:RECENT_LIMIT - 1]
        self.last = text
        self._write()

    def set_last(self, path_or_preset: str | None) -> None:
        self.last = path_or_preset
        self._write()

    def existing(self) -> list[str]:
        """Recent files that still exist, most recent first."""
        return [p for p in self.recent if Path(p).is_file()]

    def _write(self) -> None:
        write_text_atomically(self.file, json.dumps({"last": self.last, "recent": self.recent}, indent=2))

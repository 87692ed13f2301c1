"""What the GUI remembers between sessions: the config open at exit, recently used files, whether the
getting-started hint was hidden, and remote machines.

Stored in `$TANDEM_HOME/recent.json`, else `~/.config/tandem/recent.json`. A damaged or missing
file means a fresh start, never a failed one.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from modules.remote.host import RemoteHost
from modules.remote.known_hosts import KnownHosts, user_file
from modules.util.atomic import write_text_atomically
from modules.util.settings_dir import settings_dir

RECENT_LIMIT = 10


class RecentConfigs:
    def __init__(self, folder: Path | None = None):
        self.file = (folder or settings_dir()) / "recent.json"
        self.last: str | None = None
        self.recent: list[str] = []
        self.hint_hidden = False
        """The General tab's getting-started hint was hidden by the user."""
        try:
            data = json.loads(self.file.read_text(encoding="utf-8"))
            self.last = data.get("last") if isinstance(data.get("last"), str) else None
            self.recent = [p for p in data.get("recent", []) if isinstance(p, str)]
            self.hint_hidden = data.get("hint_hidden") is True
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

    def hide_hint(self) -> None:
        self.hint_hidden = True
        self._write()

    def existing(self) -> list[str]:
        """Recent files that still exist, most recent first."""
        return [p for p in self.recent if Path(p).is_file()]

    def _write(self) -> None:
        write_text_atomically(self.file, json.dumps({"last": self.last, "recent": self.recent,
                                                         "hint_hidden": self.hint_hidden}, indent=2))


class SavedRemotes:
    """The remote machines the Run tab offers under "Run on", and the one chosen last ("" = this machine).

    Stored in `remotes.json` beside recent.json, readable by the user alone; the host keys accepted for them in
    `known_hosts` there (ssh also trusts the user's own ~/.ssh/known_hosts). No password is ever stored (keys
    only); a machine's Environment field is, as typed.
    """

    def __init__(self, folder: Path | None = None):
        self.folder = folder or settings_dir()
        self.file = self.folder / "remotes.json"
        self.hosts: list[RemoteHost] = []
        self.chosen = ""
        try:
            data = json.loads(self.file.read_text(encoding="utf-8"))
            for entry in data.get("hosts", []):
                try:
                    self.hosts.append(RemoteHost.from_dict(entry))
                except (TypeError, ValueError):
                    continue
            self.chosen = data.get("chosen") if isinstance(data.get("chosen"), str) else ""
        except (OSError, ValueError, AttributeError):
            pass

    def known_hosts(self) -> KnownHosts:
        return KnownHosts((self.folder / "known_hosts", user_file()), self.folder / "known_hosts")

    def find(self, key: str) -> RemoteHost | None:
        return next((h for h in self.hosts if h.key == key), None)

    def save(self, host: RemoteHost, replacing: str | None = None) -> None:
        """Add `host` (or put it in place of the entry `replacing` names) and make it the chosen one."""
        keys = {host.key, replacing}
        at = next((i for i, h in enumerate(self.hosts) if h.key in keys), len(self.hosts))
        self.hosts = [h for h in self.hosts if h.key not in keys]
        self.hosts.insert(min(at, len(self.hosts)), host)
        self.chosen = host.key
        self._write()

    def remove(self, key: str) -> None:
        self.hosts = [h for h in self.hosts if h.key != key]
        if self.chosen == key:
            self.chosen = ""
        self._write()

    def choose(self, key: str) -> None:
        self.chosen = key
        self._write()

    def _write(self) -> None:
        write_text_atomically(self.file, json.dumps({"chosen": self.chosen, "hosts": [h.to_dict() for h in self.hosts]},
                                                    indent=2))
        os.chmod(self.file, 0o600)  # a machine's Environment may hold a token (HF_TOKEN=...): the user's alone

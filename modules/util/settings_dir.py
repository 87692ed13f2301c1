"""Where Tandem keeps what belongs to the user rather than to a run: the GUI's settings, saved remote
machines and their accepted host keys.

`$TANDEM_HOME` when set (tests, a portable install), else `~/.config/tandem`.
"""
from __future__ import annotations

import os
from pathlib import Path


def settings_dir() -> Path:
    home = os.environ.get("TANDEM_HOME")
    return Path(home).expanduser() if home else Path.home() / ".config" / "tandem"

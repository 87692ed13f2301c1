"""What importing another trainer's config yields (`ImportResult`: the mapped settings, what was not
mapped, what changed meaning) and the readers of config values the mappings share (`number`, `whole`,
`resolution`, `is_off`). Below `config_import.py` and the mappings (`kohya.py`,
`onetrainer.py`), which all use it.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from modules.config.errors import ConfigError
from modules.config.field_labels import labelled_paths
from modules.config.presets import config_from_overlay
from modules.config.train_config import TrainConfig


@dataclass
class ImportResult:
    source: Path
    tool: str
    """Whose config it was: `kohya sd-scripts`, `kohya_ss GUI` or `OneTrainer`."""
    overlay: dict = field(default_factory=dict)
    """The mapped settings as a sparse Tandem config (section -> field -> value)."""
    unmapped: list[str] = field(default_factory=list)
    """`key = value` of each setting that was set but has no Tandem counterpart (with the reason, if any)."""
    off_unmapped: int = 0
    """How many settings without a counterpart were at an off value (false, 0, empty): not listed."""
    notes: list[str] = field(default_factory=list)
    """Mapped settings whose meaning changed on the way (say so, so the user can check them)."""
    unread: dict[str, Path] = field(default_factory=dict)
    """Files the config names that were not read, by the option that reads them (`concepts`, `samples`): an
    import reads only the files the user names (the report says how)."""

    def set(self, path: str, value: Any) -> None:
        """Set Tandem field `path` (`training.learning_rate`) in the overlay."""
        section, name = path.split(".", 1)
        self.overlay.setdefault(section, {})[name] = value

    def get(self, path: str, default: Any = None) -> Any:
        section, name = path.split(".", 1)
        return self.overlay.get(section, {}).get(name, default)

    def refuse(self, key: str, value: Any, error: Exception) -> None:
        """Raise the `ConfigError` for a value of a kind the trainer never writes there (`error`: what it caused)."""
        raise ConfigError([f"{key} = {_shown(value)}: not a value of the kind this setting takes ({error}); write "
                           "it as the trainer does (a number, true/false or text)."], str(self.source))

    def skip(self, key: str, value: Any, reason: str = "") -> None:
        """Record a setting that is not mapped (counted only when it is off)."""
        if is_off(value):
            self.off_unmapped += 1
            return
        self.unmapped.append(f"{key} = {_shown(value)}" + (f" ({labelled_paths(reason)})" if reason else ""))

    def config(self) -> TrainConfig:
        """The Tandem config: the defaults with the mapped settings (types checked, values not validated)."""
        return config_from_overlay(self.overlay, str(self.source))

    def unread_question(self) -> str:
        """The GUI's question before it reads the files the config names (`unread`)."""
        listed = "\n".join(f"  - {what}: {path}" for what, path in self.unread.items())
        return (f"{self.source.name} keeps some settings in files of its own, which an import reads only when you "
                f"say so:\n{listed}\n\nRead them too? Choose No if you do not know where the file came from.")

    def report(self) -> str:
        """The one message about what was not taken over; Tandem's fields named by their labels in the window,
        with the path that `--config-value` and config files take (`field_labels.labelled_paths`)."""
        lines = [f"Imported {self.source.name} ({self.tool}): "
                 f"{sum(len(v) for v in self.overlay.values())} settings mapped."]
        if self.notes:
            lines += ["", "Check these (their meaning differs a little in Tandem):"]
            lines += [f"  - {labelled_paths(note)}" for note in self.notes]
        if self.unmapped:
            lines += ["", f"Not imported ({len(self.unmapped)}; Tandem has no such setting or value):"]
            lines += [f"  - {item}" for item in self.unmapped]
        else:
            lines += ["", "Every setting that was set is mapped."]
        if self.off_unmapped:
            lines.append(f"  ({self.off_unmapped} more without a Tandem counterpart were off or empty.)")
        if self.unread:
            lines += ["", "Files the config names, not read (an import reads only the files you name; a config from "
                          "elsewhere could name any file):"]
            lines += [f"  - its {what}: {path} - to read it: scripts/import_config.py ... --{what} {path}"
                      for what, path in self.unread.items()]
        return "\n".join(lines)


def _shown(value: Any) -> str:
    """`value` as the report shows it: JSON, text quoted, at most 80 characters."""
    shown = json.dumps(value) if not isinstance(value, str) else repr(value)
    return shown if len(shown) <= 80 else shown[:77] + "..."


def is_off(value: Any) -> bool:
    return value is None or value is False or value == 0 or value in ("", "0", [], {}) or (
        isinstance(value, str) and value.strip().lower() in ("", "none", "false", "0", "0.0"))


def number(value: Any) -> float | None:
    """A number from a config value (the kohya GUI writes many as strings: "1", "0.0001"); None if empty or
    no finite number (`"inf"`, `"nan"`: `files.check_values` refused such numbers already)."""
    if value is None or value == "" or isinstance(value, bool):
        return None
    try:
        found = float(value)
    except (TypeError, ValueError, OverflowError):
        return None
    return found if math.isfinite(found) else None


def whole(value: Any) -> int | None:
    found = number(value)
    return None if found is None else int(round(found))


def resolution(value: Any) -> tuple[int, bool] | None:
    """(side of a square of the same area, rounded to 8; whether it was a rectangle) from "512", 512, "768,512"."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return (int(value) // 8 * 8, False) if math.isfinite(value) else None
    parts = [p for p in str(value).replace("x", ",").split(",") if p.strip()]
    try:
        sides = [int(float(p)) for p in parts]
    except (ValueError, OverflowError):  # not a number, or "inf"
        return None
    if len(sides) == 1:
        return sides[0] // 8 * 8, False
    if len(sides) == 2:
        return int(round((sides[0] * sides[1]) ** 0.5)) // 8 * 8, sides[0] != sides[1]
    return None

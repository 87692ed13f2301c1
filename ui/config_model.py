"""The config being edited: one `TrainConfig`, its file, unsaved-change tracking and problems.

Views call `set(path, text)` when a widget changes and `get_text(path)` to fill one; they
subscribe to hear about changes made elsewhere (loading a file, the multi-GPU frame writing
several fields). No Tk in here, so the behaviour is tested without a display.
"""
from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any, Callable

from modules.config import TrainConfig, config_to_dict, save_config
from modules.config.loading import read_config
from modules.config.validation import validate

from .binding import FieldError, format_value, get_value, set_value

# A validation message names its field first: "training.batch_size: 0 is not allowed; ..."
_MESSAGE_PATH = re.compile(r"^([A-Za-z_][\w]*(?:\[\d+\])?(?:\.[A-Za-z_][\w]*(?:\[\d+\])?)*):\s")

Listener = Callable[[str | None], None]
"""Called with the changed field path, or None when the whole config was replaced."""


def problem_field(message: str) -> str | None:
    """The field path a validation message starts with, or None for a message about no field."""
    match = _MESSAGE_PATH.match(message)
    return match.group(1) if match else None


def problems_by_field(messages: list[str]) -> dict[str, list[str]]:
    """Validation messages grouped by the field they name; messages naming no field go under ''.

    A message about a section or a list (`data.concepts: none ... enabled`) is kept under that
    path; views that show a list show it at the list.
    """
    grouped: dict[str, list[str]] = {}
    for message in messages:
        grouped.setdefault(problem_field(message) or "", []).append(message)
    return grouped


def points_nowhere(value: str) -> bool:
    """A path that is not on this machine (a built-in model or dataset is; an empty field names nothing)."""
    return bool(value.strip()) and not value.startswith("builtin:") and not Path(value).expanduser().exists()


def without_placeholders(cfg: TrainConfig) -> list[str]:
    """Empty the model and concept paths of a preset that point nowhere (its examples of where your files
    might be); returns the fields emptied. Built-in models and data, and paths that exist, are kept."""
    emptied = []
    missing = points_nowhere

    if missing(cfg.model.base_model):
        cfg.model.base_model = ""
        emptied.append("model.base_model")
    for i, concept in enumerate(cfg.data.concepts):
        if missing(concept.path):
            concept.path = ""
            emptied.append(f"data.concepts[{i}].path")
    return emptied


class ConfigModel:
    def __init__(self, cfg: TrainConfig | None = None):
        self.cfg = cfg if cfg is not None else TrainConfig()
        self.path: Path | None = None
        """The file the config was loaded from or last saved to; None for a preset or a new one."""
        self.source_name = "new config"
        """What the title bar shows: the file name or the preset's name."""
        self._saved = config_to_dict(self.cfg)
        self._listeners: list[Listener] = []
        self.placeholders: list[str] = []
        """The fields a loaded preset left empty for the user to pick (`without_placeholders`)."""
        self.missing_base_model = ""
        """The base model an imported config names that is not on this machine (kept in the field, so that the
        user sees what it named; the Model tab asks for one); empty when there is none."""

    # --- change notification -------------------------------------------------------------
    def subscribe(self, listener: Listener) -> None:
        self._listeners.append(listener)

    def _notify(self, path: str | None) -> None:
        for listener in list(self._listeners):
            listener(path)

    # --- fields ----------------------------------------------------------------------------
    def get(self, path: str) -> Any:
        return get_value(self.cfg, path)

    def get_text(self, path: str) -> str:
        return format_value(self.get(path))

    def set(self, path: str, value: Any, notify: bool = True) -> None:
        """Store `value` (text or typed) in the field; `FieldError` leaves the config as it was.

        Listeners hear about it only when the stored value changed, so a view that writes back
        what it just read does not start a loop of updates.
        """
        before = self.get(path)
        after = set_value(self.cfg, path, value)
        if notify and after != before:
            self._notify(path)

    def update(self, values: dict[str, Any]) -> None:
        """Set several fields as one change (all converted first, so a bad one changes nothing)."""
        trial = copy.deepcopy(self.cfg)
        for path, value in values.items():
            set_value(trial, path, value)
        self.cfg = trial
        self._notify(None)

    def replace_list(self, mutate: Callable[[TrainConfig], None]) -> None:
        """Apply a structural edit (add/remove a concept or prompt) and tell every view."""
        mutate(self.cfg)
        self._notify(None)

    # --- files -----------------------------------------------------------------------------
    @property
    def dirty(self) -> bool:
        return config_to_dict(self.cfg) != self._saved

    def load_file(self, path: str | Path) -> None:
        """Read a config file or preset name (raises `ConfigError` listing every problem). A preset's
        placeholder paths (`models/sd15.safetensors` where no such file is) are left empty, for the window's
        pickers: `self.placeholders` names the fields."""
        cfg = read_config(path)
        is_file = Path(path).is_file()
        self.placeholders = [] if is_file else without_placeholders(cfg)
        self.replace(cfg, Path(path) if is_file else None, Path(str(path)).stem)

    def replace(self, cfg: TrainConfig, path: Path | None, source_name: str, missing_base_model: str = "") -> None:
        self.cfg = cfg
        self.path = path
        self.source_name = source_name
        self.missing_base_model = missing_base_model
        self._saved = config_to_dict(cfg)
        self._notify(None)

    def adopt(self, cfg: TrainConfig, source_name: str) -> None:
        """Take `cfg` from elsewhere (an imported config): no file yet (Save as writes one), and - like a preset
        just opened - no changes of the user's, so no unsaved-changes marker until the user edits it. A base
        model it names that is not here is noted (`missing_base_model`) for the Model tab's picker."""
        base = cfg.model.base_model
        self.replace(cfg, None, source_name, base.strip() if points_nowhere(base) else "")

    def save(self, path: str | Path | None = None) -> Path:
        target = Path(path) if path is not None else self.path
        if target is None:
            raise ValueError("this config has no file yet; use Save as")
        save_config(self.cfg, target, follow_link=True)  # the user's own file: a link to it is theirs
        self.path = target
        self.source_name = target.stem
        self._saved = config_to_dict(self.cfg)
        self._notify(None)
        return target

    # --- problems --------------------------------------------------------------------------
    def problems(self, check_paths: bool = False) -> list[str]:
        """Every validation problem. While editing, paths on disk are not checked (the user may
        still be typing one); Start checks them."""
        return validate(self.cfg, check_paths=check_paths)


__all__ = ["ConfigModel", "FieldError", "problem_field", "problems_by_field"]

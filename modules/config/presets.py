"""Presets: sparse JSON overlays in `training_presets/` merged onto the defaults.

A preset holds only the keys that differ from `TrainConfig()`. Loading one deep-merges it onto the
default config's JSON (objects merge key by key, lists and values are replaced), so a preset keeps
working when a new field with a default is added. Presets whose name starts with `#` are the
built-in ones that work without any download; they can be named with or without the `#`.
"""
from __future__ import annotations

import difflib
from pathlib import Path

from .migrations import migrate
from .serialization import ConfigError, config_from_dict, config_to_dict, read_json
from .train_config import TrainConfig

PRESETS_DIR = Path(__file__).resolve().parents[2] / "training_presets"
BUILTIN_MARK = "#"


def list_presets(presets_dir: Path = PRESETS_DIR) -> list[str]:
    """Preset names (file names without `.json`), sorted; built-in `#` presets come first."""
    return sorted(p.stem for p in Path(presets_dir).glob("*.json"))


def find_preset(name: str, presets_dir: Path = PRESETS_DIR) -> Path | None:
    """The file of preset `name` (`#demo`, `demo`, `sd15_lora.json`), or None when there is none."""
    stem = name[:-5] if name.endswith(".json") else name
    for candidate in (stem, BUILTIN_MARK + stem):
        path = Path(presets_dir) / f"{candidate}.json"
        if candidate and "/" not in candidate and "\\" not in candidate and path.is_file():
            return path
    return None


def preset_path(name: str, presets_dir: Path = PRESETS_DIR) -> Path:
    """The file of preset `name`; `ConfigError` naming the known presets when there is none."""
    path = find_preset(name, presets_dir)
    if path is None:
        names = list_presets(presets_dir)
        close = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
        hint = f" Did you mean '{close[0]}'?" if close else ""
        raise ConfigError([f"no preset named {name!r}.{hint} Presets: {', '.join(names) or 'none'}."],
                          str(presets_dir))
    return path


def deep_merge(base: dict, overlay: dict) -> dict:
    """`overlay` on top of `base` as a new dict: nested objects merge, everything else is replaced."""
    merged = dict(base)
    for key, value in overlay.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def config_from_overlay(overlay: dict, source: str | None = None) -> TrainConfig:
    """A `TrainConfig` from a sparse overlay of any known version merged onto the defaults."""
    if not isinstance(overlay, dict):
        raise ConfigError([f"the top level must be a JSON object, got {type(overlay).__name__}."], source)
    # Migrate the overlay on its own first: the defaults are always of the current version.
    overlay = migrate(dict(overlay), source)
    return config_from_dict(deep_merge(config_to_dict(TrainConfig()), overlay), source)


def load_preset(name: str, presets_dir: Path = PRESETS_DIR) -> TrainConfig:
    """The preset `name` merged onto the defaults, strictly typed but not validated.

    Validate with `check(cfg, check_paths=False)`: presets name model files the user may not have yet.
    """
    path = preset_path(name, presets_dir)
    return config_from_overlay(read_json(path), str(path))

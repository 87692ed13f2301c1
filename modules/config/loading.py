"""Reading a config by file path or preset name, with overrides and validation.

Wherever a config path is expected (CLI `--config`, the GUI's open dialog, launchers), a preset
name works too: an existing file always wins; otherwise the text is looked up in `training_presets/`
(`#demo`, `demo`, `sd15_lora`).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable

from .overrides import apply_overrides
from .presets import config_from_overlay, find_preset, list_presets
from .serialization import ConfigError, read_json
from .train_config import TrainConfig
from .validation import check


def resolve_config_source(path_or_preset: str | os.PathLike) -> Path:
    """The JSON file that `path_or_preset` names: the file itself, else the preset's file."""
    path = Path(path_or_preset).expanduser()
    if path.is_file():
        return path
    preset = find_preset(str(path_or_preset))
    if preset is not None:
        return preset
    if path.is_dir():
        raise ConfigError([f"{path} is a folder, not a config file: give the path of a config JSON file in it, "
                           "or a preset name: " + ", ".join(list_presets()) + "."],
                          str(path))
    raise ConfigError([f"config file not found: {path} (and no preset of that name). "
                       f"Check the path or pick a preset: {', '.join(list_presets())}."], str(path))


def read_config(path_or_preset: str | os.PathLike) -> TrainConfig:
    """The config in a file or preset, strictly typed (unknown keys, wrong types) but not validated.

    The GUI opens configs with this so that a missing dataset folder is shown, not fatal.
    Every file is read as an overlay on the defaults: fields it leaves out take their defaults.
    """
    source = resolve_config_source(path_or_preset)
    return config_from_overlay(read_json(source), str(source))


def load_config(path_or_preset: str | os.PathLike, overrides: Iterable[str] = (),
                check_paths: bool = True) -> TrainConfig:
    """Read a config file or preset, apply `KEY=VALUE` overrides, and validate the result.

    Raises `ConfigError` with every problem at once.
    """
    overrides = list(overrides)
    source = describe_source(path_or_preset, bool(overrides))
    cfg = apply_overrides(read_config(path_or_preset), overrides)
    return check(cfg, source=source, check_paths=check_paths)


def describe_source(path_or_preset: str | os.PathLike, overridden: bool) -> str:
    """How a refusal names the config: its file, or the preset by name (its file is Tandem's, not the
    user's to fix), and whether command-line overrides changed it - their values are checked with it."""
    path = Path(path_or_preset).expanduser()
    what = str(resolve_config_source(path_or_preset))
    if not path.is_file():
        what = f"preset {str(path_or_preset)!r}"
    return f"{what} with the command line's overrides" if overridden else what

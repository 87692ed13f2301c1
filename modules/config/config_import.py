"""Importing another trainer's config: kohya sd-scripts (`.toml`), the kohya_ss GUI (`.json`) and
OneTrainer (`.json`).

`import_config(path)` reads the file, recognises whose it is, and maps every setting Tandem has onto a
sparse Tandem config (`ImportResult.overlay`, merged onto the defaults like a preset). Whatever has no
Tandem counterpart is listed in one message (`ImportResult.report`), so nothing is dropped silently;
settings left at an off value (false, 0, empty) are only counted. Approximations (a warm-up given as a
share of the steps, a scheduler Tandem has in another form) are said in `notes`.

The mappings themselves are in `import_kohya.py` and `import_onetrainer.py`, what they fill and the
value readers they share in `import_result.py`. Torch-free: the GUI and `scripts/import_config.py` use it
without loading any model code.
"""
from __future__ import annotations

import json
import tomllib
from pathlib import Path

from . import import_kohya, import_onetrainer
from .import_result import ImportResult
from .serialization import ConfigError


def import_config(path: str | Path) -> ImportResult:
    """The Tandem config of a kohya (`.toml` / `.json`) or OneTrainer (`.json`) config file."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise ConfigError([f"{path}: no such file; choose a kohya .toml/.json or OneTrainer .json config."], str(path))
    text = path.read_text(encoding="utf-8-sig")
    try:
        data = tomllib.loads(text) if path.suffix.lower() == ".toml" else json.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as error:
        raise ConfigError([f"not valid {path.suffix.lstrip('.').upper() or 'JSON'}: {error}."], str(path)) from None
    if not isinstance(data, dict):
        raise ConfigError(["the top level must be an object (a table of settings)."], str(path))
    if path.suffix.lower() == ".toml":
        return import_kohya.from_sd_scripts(path, data)
    if import_onetrainer.looks_like(data):
        return import_onetrainer.from_onetrainer(path, data)
    if import_kohya.looks_like_gui(data):
        return import_kohya.from_gui(path, data)
    if "general" in data and "training" in data:
        raise ConfigError(["this is a Tandem config already; open it with Load (or --config-path)."], str(path))
    raise ConfigError(["not a config Tandem can import: neither OneTrainer's (training_method, model_type, "
                       "base_model_name) nor kohya's (pretrained_model_name_or_path, train_data_dir); kohya "
                       "sd-scripts configs are .toml files."], str(path))

"""Importing another trainer's config: kohya sd-scripts (`.toml`), the kohya_ss GUI (`.json`) and
OneTrainer (`.json`).

`import_config(path)` reads the file, recognises whose it is, and maps every setting Tandem has onto a
sparse Tandem config (`ImportResult.overlay`, merged onto the defaults like a preset). Whatever has no
Tandem counterpart is listed in one message (`ImportResult.report`), so nothing is dropped silently;
settings left at an off value (false, 0, empty) are only counted. Approximations (a warm-up given as a
share of the steps, a scheduler Tandem has in another form) are said in `notes`.

The mappings themselves are in `kohya.py` and `onetrainer.py`, what they fill and the
value readers they share in `result.py`, the reading of files in `files.py`. Torch-free: the
GUI and `scripts/import_config.py` use it without loading any model code.

An import reads the config and the files the user names with it - `concepts` (OneTrainer's concepts file),
`samples` (OneTrainer's sample definitions, sd-scripts' prompt file) - and no other: a file the config
names itself (`concept_file_name = "/etc/..."`) is listed in `ImportResult.unread` and in the report,
with the option that would read it. Anything wrong with a file is one `ConfigError` sentence
(`import_error_line` makes the one line the script and the GUI show), never a traceback.
"""
from __future__ import annotations

from pathlib import Path

from modules.config.serialization import ConfigError

from . import kohya, onetrainer
from .files import read_file
from .result import ImportResult

UNEXPECTED = (TypeError, ValueError, AttributeError, KeyError, IndexError, OverflowError, RecursionError, OSError)
"""What a mapping raises on a value of a kind no trainer writes (a list where a table goes), or a folder it
names that cannot be listed: one line too (the values it knows to check are refused naming their key)."""


def import_config(path: str | Path, concepts: str | Path | None = None,
                  samples: str | Path | None = None) -> ImportResult:
    """The Tandem config of a kohya (`.toml` / `.json`) or OneTrainer (`.json`) config file; `concepts` and
    `samples`: the files the user names for the concepts and sample prompts the config keeps in files of
    their own (read only when named)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise ConfigError([f"{path}: no such file; choose a kohya .toml/.json or OneTrainer .json config."], str(path))
    data = read_file(path, "the config")
    if not isinstance(data, dict):
        raise ConfigError(["the top level must be an object (a table of settings)."], str(path))
    named = {key: Path(value).expanduser() for key, value in (("concepts", concepts), ("samples", samples)) if value}
    try:
        return _mapped(path, data, named)
    except ConfigError:
        raise
    except UNEXPECTED as error:
        raise ConfigError([f"a setting holds a value of a kind the {_tool(path, data)} config never has "
                           f"({type(error).__name__}: {error}); export the config again from the trainer."],
                          str(path)) from None


def import_error_line(error: ConfigError) -> str:
    """An import's refusal as the one line the script prints and the GUI shows: the file, then each problem."""
    where = f"{error.source}: " if error.source else ""
    return where + " ".join(error.problems)


def _tool(path: Path, data: dict) -> str:
    if path.suffix.lower() == ".toml":
        return "kohya sd-scripts"
    return "OneTrainer" if onetrainer.looks_like(data) else "kohya_ss GUI"


def _mapped(path: Path, data: dict, named: dict[str, Path]) -> ImportResult:
    if path.suffix.lower() == ".toml":
        return kohya.from_sd_scripts(path, data, named)
    if onetrainer.looks_like(data):
        return onetrainer.from_onetrainer(path, data, named)
    if kohya.looks_like_gui(data):
        return kohya.from_gui(path, data, named)
    if "general" in data and "training" in data:
        raise ConfigError(["this is a Tandem config already; open it with Load (or --config-path)."], str(path))
    raise ConfigError(["not a config Tandem can import: neither OneTrainer's (training_method, model_type, "
                       "base_model_name) nor kohya's (pretrained_model_name_or_path, train_data_dir); kohya "
                       "sd-scripts configs are .toml files."], str(path))

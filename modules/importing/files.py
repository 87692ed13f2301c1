"""Reading the files an import is given: another trainer's config, and the concepts or prompts file the user
names beside it (`--concepts`, `--samples`). Every problem is one `ConfigError` sentence naming the file,
the key where there is one, and the fix - never a traceback: these files come from elsewhere (a download,
a colleague) and may be anything - not UTF-8, nested thousands of levels deep, `inf` where a count goes.

An import reads no other file: a path inside a config (OneTrainer's `concept_file_name`) is only named in
the report, with the option that reads it (`config_import.py`).
"""
from __future__ import annotations

import json
import math
import re
import tomllib
from pathlib import Path
from typing import Any

from modules.config.errors import ConfigError

MAX_BYTES = 16 * 1024 * 1024
"""A config or concepts file is a few kilobytes; a bigger one is not one (and is not read into memory)."""
MAX_DEPTH = 24
"""Objects within objects: configs nest 3 or 4 levels; deeper is no config (and would exhaust the recursion
of the parsers and of everything that walks the values)."""
LARGEST = 2 ** 53
"""The largest whole number a JSON number holds exactly: no count, size or seed of a config is above it."""
_NUMBER_TEXT = re.compile(r"\s*[+-]?((\d+\.?\d*|\.\d+)([eE][+-]?\d+)?|inf|infinity|nan)\s*", re.IGNORECASE)
"""A number written as text (the kohya_ss GUI writes "1", "0.0001", "1e400", "inf")."""


def read_file(path: Path, what: str) -> Any:
    """The parsed contents of `path` (TOML for `.toml`, else JSON), checked by `check_values`.
    `what`: what the file is, for the messages ("the config", "the --concepts file")."""
    text = _read_text(path, what)
    kind = "TOML" if path.suffix.lower() == ".toml" else "JSON"
    try:
        data = tomllib.loads(text) if kind == "TOML" else json.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as error:
        raise ConfigError([f"{what} is not valid {kind}: {error}."], str(path)) from None
    except RecursionError:
        raise ConfigError([f"{what} nests objects or lists too deeply to be a config (more than {MAX_DEPTH} "
                           "levels); import the file the trainer saved."], str(path)) from None
    except ValueError:  # a whole number of thousands of digits ("Exceeds the limit ...")
        raise ConfigError([f"{what} holds a number of thousands of digits, which no setting takes; write the value "
                           "you mean."], str(path)) from None
    check_values(data, path, what)
    return data


def read_lines(path: Path, what: str) -> list[str]:
    """The lines of a text file the user named (sd-scripts' prompt file)."""
    return _read_text(path, what).splitlines()


def _read_text(path: Path, what: str) -> str:
    if not path.is_file():
        raise ConfigError([f"{what} {path} is not a file; name an existing file."], str(path))
    try:
        if path.stat().st_size > MAX_BYTES:
            raise ConfigError([f"{what} is {path.stat().st_size / 2**20:.0f} MiB, too large for a config (at most "
                               f"{MAX_BYTES // 2**20} MiB); name the config file itself."], str(path))
        data = path.read_bytes()
    except OSError as error:
        raise ConfigError([f"{what} cannot be read ({error.strerror}); check its permissions."], str(path)) from None
    if not data.strip():
        raise ConfigError([f"{what} is empty; export the config again from the trainer."], str(path))
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        raise ConfigError([f"{what} is not UTF-8 text (byte 0x{data[error.start]:02x} at position {error.start}); "
                           "save it as UTF-8, or name the trainer's own config file."], str(path)) from None


def check_values(data: Any, path: Path, what: str) -> None:
    """Refuse what no config holds, naming the key: nesting deeper than `MAX_DEPTH`, a number that is not
    finite (`inf`, `nan`, `1e400`) or above `LARGEST` - each would end in an error deep in the mapping.
    Iterative, so that no depth can exhaust the recursion here."""
    pending: list[tuple[str, Any, int]] = [("", data, 0)]
    while pending:
        key, value, depth = pending.pop()
        if isinstance(value, (dict, list)):
            if depth >= MAX_DEPTH:
                raise ConfigError([f"{what} nests objects or lists more than {MAX_DEPTH} levels deep (at {key}); "
                                   "no config does: import the file the trainer saved."], str(path))
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for name, item in items:
                inner = f"{key}[{name}]" if isinstance(value, list) else f"{key}.{name}" if key else str(name)
                pending.append((inner, item, depth + 1))
            continue
        problem = number_problem(value)
        if problem:
            shown = value if isinstance(value, str) else _shown(value)
            raise ConfigError([f"{key} = {shown}: {problem}; write the value you mean (such as 16 or 0.0001)."],
                              str(path))


def number_problem(value: Any) -> str | None:
    """Why `value` (a number, or a number written as text) cannot be a config's number; None if it can."""
    if isinstance(value, bool):
        return None
    if isinstance(value, str):
        if len(value) > 400 or not _NUMBER_TEXT.fullmatch(value):
            return None  # text, not a number (a 400-digit number is refused by `number` when read)
        value = float(value)
    if isinstance(value, float) and not math.isfinite(value):
        return "not a finite number"
    if isinstance(value, (int, float)) and abs(value) > LARGEST:
        return f"too large for any setting (above {LARGEST})"
    return None


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:20]}...({len(text)} digits)"

"""A config field's name as the window shows it - its label - for messages made outside the window too.

The label is declared with the field (`rule(..., label=...)` in train_config.py) or made from its name
(`lora_format` -> `LoRA format`). The window's rows use it (`ui/binding.field_label`), and so do messages that
a person reads whichever way they started training: a check before training says "Batch size per GPU",
which the window shows, and the command line adds the path (`training.batch_size`) that `--config-value`
and config files take.
"""
from __future__ import annotations

import dataclasses
import re
import typing

from .field_paths import walk_types
from .field_rules import rules_of
from .train_config import TrainConfig

SPELLING = {"lora": "LoRA", "ema": "EMA", "unet": "UNet", "vae": "VAE", "eps": "epsilon", "lr": "LR", "gpu": "GPU",
            "gpus": "GPUs", "ddp": "DDP", "fsdp": "FSDP", "snr": "SNR", "tf32": "TF32", "cpu": "CPU", "mb": "MB",
            "t5": "T5", "json": "JSON", "id": "ID"}
"""How the words of a field's name are written in a label made from it (`lora_format` -> `LoRA format`)."""

_LIST_ITEM = re.compile(r"\[\]")
_FIELD_IN_TEMPLATE = re.compile(r"\{([a-z_][a-z0-9_]*(?:\[\d*\])?(?:\.[a-z_][a-z0-9_]*(?:\[\d*\])?)+)\}")


def field_label(path: str) -> str:
    """The label the field declares, else one made from its name: `training.seed` -> `Seed`. A list item's
    field may be written `data.concepts[].repeats` (any row: the label is the column's). Raises the
    `field_paths` errors for a path that is no field."""
    steps = list(walk_types(_LIST_ITEM.sub("[0]", path)))
    section = steps[-2][1] if len(steps) > 1 else TrainConfig
    declared = rules_of(section).get(steps[-1][0])
    if declared is not None and declared.label:
        return declared.label
    words = [SPELLING.get(word, word) for word in str(steps[-1][0]).split("_")]
    text = " ".join(words)
    return text[0].upper() + text[1:]


def in_config_words(template: str, with_paths: bool) -> str:
    """`template` with each `{field.path}` in it written as the field's label - followed by its path in
    parentheses where `with_paths` (the command line: the path is what `--config-value` takes)."""
    def named(match: re.Match) -> str:
        path = match.group(1)
        label = field_label(path)
        return f"{label} ({path})" if with_paths else label

    return _FIELD_IN_TEMPLATE.sub(named, template)


_FIELD_PATH = re.compile(r"(?<![\w./])[a-z_][a-z0-9_]*(?:\[\d+\])?(?:\.[a-z_][a-z0-9_]*(?:\[\d+\])?)+(?![\w/(])")
"""A field path inside a sentence (`training.lr_warmup_steps`), not part of a file name or a longer path."""


def labelled_paths(text: str) -> str:
    """`text` with each config field it names by path (`training.lr_warmup_steps`) as `Warm-up steps
    (training.lr_warmup_steps)`: messages that both the window and the command line show (an import's
    report). Words that only look like paths (a file name, another trainer's key) are left as they are."""
    def named(match: re.Match) -> str:
        path = match.group(0)
        try:
            annotation = list(walk_types(path))[-1][1]
        except (ValueError, KeyError):  # no field of Tandem's
            return path
        if dataclasses.is_dataclass(annotation) or typing.get_origin(annotation) is list:
            return path  # a section or a list: no row of the window
        return f"{field_label(path)} ({path})"

    return _FIELD_PATH.sub(named, text)

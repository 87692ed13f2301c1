"""The model families, one module each, and how a model on disk is matched to its family.

`family(name)` gives the family object (`base.ModelFamily`); `detect_folder` and `detect_checkpoint`
ask every family whether it recognises a diffusers folder or a single file's tensor names, so adding
a family never touches the detection of the others.

This registry imports no family module at load time (nor `base.py`, whose interface names the
`ModelBundle`): the bundle asks it for its family, so it must not import what imports the bundle.
"""
from __future__ import annotations

import functools
import importlib
import json
from pathlib import Path

from modules.families.registry import DETECTION_ORDER, FAMILIES, MODEL_TYPES, known_pipelines


@functools.cache
def family(name: str):
    """The family object (a `base.ModelFamily`) of model type `name` (one of `MODEL_TYPES`), from the module
    and class its `FamilyInfo.implementation` names (SD 1.x and 2.x share one)."""
    if name not in FAMILIES:
        raise ValueError(f"model type {name!r} is not one of {', '.join(MODEL_TYPES)}")
    module, cls = FAMILIES[name].implementation.split(":")
    return getattr(importlib.import_module(f"{__name__}.{module}"), cls)(name)


def detect_folder(folder: Path) -> tuple[str, str]:
    """(model type, reason) of a diffusers folder, from its model_index.json and component configs."""
    index = json.loads((Path(folder) / "model_index.json").read_text())
    for name in DETECTION_ORDER:
        reason = family(name).recognise_folder(Path(folder), index)
        if reason:
            return name, reason
    raise ValueError(
        f"{folder}: its model_index.json names pipeline {index.get('_class_name')!r}, which Tandem does not "
        f"train; supported: {known_pipelines()}")


def detect_checkpoint(keys, source="checkpoint") -> str:
    """The model type of a single file from its tensor names (never from sizes, so tiny test models work):
    SD3 and Flux by their `key_markers`, the SD families by `detect.detect_model_type`, whose errors
    explain refiners, diffusers-layout files and UNet-only files."""
    keys = set(keys)
    for name in DETECTION_ORDER:
        if FAMILIES[name].flow_matching and family(name).recognise_checkpoint(keys):
            return name
    from modules.model.detect import detect_model_type

    return detect_model_type(keys, source)  # SD 1.x/2.x/SDXL, or a clear error naming what was found


__all__ = ["FAMILIES", "MODEL_TYPES", "detect_checkpoint", "detect_folder", "family"]

"""The family registry (`modules/families/registry.py`) is the one list of families: what names a family
anywhere else - presets, shipped configs, text-encoder kinds, the config docs, docs/Models.md's tables - is
checked against it here, so a registered family cannot be left out and nothing can drift. Torch-free, quick."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from modules.config import field_docs, list_presets, read_config
from modules.families.registry import FAMILIES, MODEL_TYPES, guess_family
from modules.families.text_encoders import TEXT_ENCODER_KINDS, kept_weight, kind_of_class
from modules.config.train_config import ModelConfig

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "modules" / "model" / "configs"
MODELS_DOC = REPO / "docs" / "Models.md"


@pytest.mark.parametrize("name", MODEL_TYPES)
def test_a_family_names_known_text_encoder_kinds_and_its_shipped_configs_are_of_them(name):
    info = FAMILIES[name]
    assert info.text_encoders, f"{name}: FamilyInfo.text_encoders names no kind"
    unknown = [kind for kind in info.text_encoders if kind not in TEXT_ENCODER_KINDS]
    assert not unknown, f"{name}: unknown text encoder kinds {unknown}; add them to TEXT_ENCODER_KINDS"
    classes = {cls for kind in info.text_encoders for cls in TEXT_ENCODER_KINDS[kind].classes}
    for path in sorted((CONFIGS / name).glob("text_encoder*.json")):
        architecture = json.loads(path.read_text())["architectures"][0]
        assert architecture in classes, f"{path.name}: {architecture} is none of {name}'s text encoder kinds"
    if info.text_apart:
        (kind,) = (TEXT_ENCODER_KINDS[k] for k in info.text_encoders)
        assert kind.language_model and kind.tiny, f"{name} loads a language model apart: its kind needs a tiny builder"


def test_every_text_encoder_kind_is_a_transformers_class():
    import transformers

    names = set(dir(transformers))  # the lazy module lists its classes without importing them
    missing = [cls for kind in TEXT_ENCODER_KINDS.values() for cls in kind.classes if cls not in names]
    assert not missing, f"transformers {transformers.__version__} has no {missing}"
    assert kind_of_class("random Qwen2_5_VLForConditionalGeneration").name == "qwen2.5-vl"
    assert not kept_weight("Qwen2_5_VLForConditionalGeneration", "model.visual.blocks.0.attn.qkv.weight")
    assert kept_weight("Qwen3Model", "layers.0.mlp.up_proj.weight") and not kept_weight("Qwen3Model", "lm_head.weight")


@pytest.mark.parametrize("name", MODEL_TYPES)
def test_a_familys_presets_and_demo_are_where_the_registry_says(name):
    info = FAMILIES[name]
    presets = set(list_presets())
    if info.flow_matching:  # every family since SD's has a built-in tiny model and its preset
        assert info.demo == f"builtin:demo-{name}", f"{name}: its built-in model should be builtin:demo-{name}"
    if info.demo:
        assert info.demo_preset in presets, f"{name}: no preset {info.demo_preset} for {info.demo}"
        assert read_config(info.demo_preset).model.base_model == info.demo
    for kind in ("lora", "finetune") if info.presets else ():
        preset = f"{info.presets}_{kind}"
        assert preset in presets, f"{name}: FamilyInfo.presets names {preset}, which training_presets/ lacks"
        model = read_config(preset).model
        assert guess_family(model.base_model, model.model_type) in (name, None), f"{preset} trains another family"


def test_every_preset_belongs_to_a_registered_family():
    """A model preset starts with its family's stem; a demo preset trains a family's built-in model (its own data
    too: `#demo_flux2_edit` trains `builtin:demo-flux2` on pairs)."""
    stems = {info.presets for info in FAMILIES.values() if info.presets}
    demos = {info.demo for info in FAMILIES.values() if info.demo}
    orphans = [p for p in list_presets() if not (p.startswith("#") and read_config(p).model.base_model in demos)
               and not any(p.startswith(stem) for stem in stems)]
    assert not orphans, f"presets of no registered family: {orphans}"


def test_the_config_docs_name_every_family_and_built_in_model():
    """`model.model_type`'s and `model.base_model`'s docstrings (tooltips, docs/Configuration.md) list them by
    hand: a family registered without them fails here."""
    docs = field_docs(ModelConfig)
    missing_types = [name for name in MODEL_TYPES if f"`{name}`" not in docs["model_type"]]
    assert not missing_types, f"model.model_type's docstring lacks {missing_types}"
    missing_demos = [info.demo for info in FAMILIES.values() if info.demo and f"`{info.demo}`" not in docs["base_model"]]
    assert not missing_demos, f"model.base_model's docstring lacks {missing_demos}"
    rows = {line.split(" | ")[0].strip("| `"): line
            for line in (REPO / "docs" / "Configuration.md").read_text(encoding="utf-8").splitlines()
            if line.startswith(("| `model_type` |", "| `base_model` |"))}
    assert [name for name in MODEL_TYPES if f"`{name}`" not in rows["model_type"]] == [], "docs/Configuration.md"
    assert [info.demo for info in FAMILIES.values() if info.demo and f"`{info.demo}`" not in rows["base_model"]] == [], \
        "docs/Configuration.md's model.base_model row lacks a built-in model"


def _table(heading: str) -> list[list[str]]:
    """The rows (cells) of the first table after `heading` in docs/Models.md."""
    text = MODELS_DOC.read_text(encoding="utf-8")
    after = text[text.index(heading):]
    lines = after[after.index("\n|"):].strip().splitlines()
    rows = []
    for line in lines[2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split(" | ")])
    return rows


def test_the_models_doc_tables_follow_the_registry():
    """docs/Models.md's family table: one row per family, in the registry's order, naming its denoiser class (a
    transformer's), its text encoders and its image-side step; its `model.base_model` table names every
    built-in model."""
    rows = _table("## Model families")
    assert [row[0].strip("`") for row in rows] == list(MODEL_TYPES)
    for row in rows:
        info = FAMILIES[row[0].strip("`")]
        if info.denoiser == "transformer":
            assert f"`{info.denoiser_class}`" in row[2], f"{info.name}: the denoiser cell lacks {info.denoiser_class}"
        titles = [TEXT_ENCODER_KINDS[kind].title for kind in info.text_encoders]
        assert all(title in row[3] for title in titles), f"{info.name}: the text encoders cell lacks one of {titles}"
        assert f"multiples of {info.pixel_multiple} px" in row[6], info.name
    builtins = " ".join(row[0] for row in _table("## Model bundle"))
    missing = [info.demo for info in FAMILIES.values() if info.demo and f"`{info.demo}`" not in builtins]
    assert not missing, f"docs/Models.md's model.base_model table lacks {missing}"
    assert re.search(r"\| `builtin:demo` \|", MODELS_DOC.read_text(encoding="utf-8"))

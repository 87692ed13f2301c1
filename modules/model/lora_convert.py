"""Rewriting a LoRA file in the current layouts (`scripts/convert_lora.py`): an SDXL LoRA from an older Tandem
then loads in A1111/Forge as sd-scripts' files do, and any file becomes the layout a named program applies
exactly (`lora_clients.layout_for`: ComfyUI's kohya/LyCORIS names with an `.alpha` per module, diffusers'
peft layout with alpha in the header). Above both the reader (`lora_reading.py`) and the writer (`lora.py`),
which need not know each other for it.
"""
from __future__ import annotations

from pathlib import Path

from modules.config.train_config import ModelConfig, TrainingConfig

from .loading import load_model
from .lora import add_lora, lora_alpha_and_rank, save_lora
from modules.families.lora_clients import layout_for, save_note
from .lora_metadata import file_metadata
from .lora_reading import adapter_settings, apply_lora, read_lora


def convert_lora_file(source: str | Path, target: str | Path, base_model: str, fmt: str | None = None,
                      dtype: str = "fp16", client: str | None = None) -> Path:
    """Rewrite the LoRA `source` (any layout above) for `base_model` as `target`, in today's `fmt` layout or
    in the one `client` (`comfyui`, `diffusers`) applies exactly; the metadata of the source is kept where the
    new file does not set it. A ValueError when the client reads no such file, before anything is written."""
    return convert_and_describe(source, target, base_model, fmt, dtype, client)[0]


def convert_and_describe(source: str | Path, target: str | Path, base_model: str, fmt: str | None = None,
                         dtype: str = "fp16", client: str | None = None) -> tuple[Path, str]:
    """`convert_lora_file`, and the line that says which program applies the new file (`lora_clients.save_note`)."""
    if (fmt is None) == (client is None):
        raise ValueError("name either the layout (--format kohya|peft) or the program (--for comfyui|diffusers)")
    bundle = load_model(ModelConfig(base_model=base_model))
    weights = read_lora(source, bundle)
    settings = adapter_settings(weights)
    if client is not None:
        fmt = layout_for(client, bundle.model_type, weights.lora_type)
    add_lora(bundle, TrainingConfig(precision="fp32", **settings))
    apply_lora(bundle, weights)
    # What describes the new file (layout, implementation, base model by name) is written anew; an old
    # file's `tandem_base_model` may even hold a full local path.
    fresh = set(file_metadata(bundle, fmt, settings["lora_rank"], settings["lora_alpha"], "", weights.lora_type)) | {
        "format", "lora_adapter_metadata"}
    kept = {k: v for k, v in weights.metadata.items() if k not in fresh}
    path = save_lora(bundle, target, fmt, dtype, kept)
    alpha, rank = lora_alpha_and_rank(bundle)
    return path, save_note(path, bundle.model_type, weights.lora_type, fmt, alpha, rank, base_model)

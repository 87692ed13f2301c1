"""Rewriting a LoRA file in the current layouts: an SDXL LoRA from an older Tandem then loads in A1111/Forge
as sd-scripts' files do (`scripts/convert_lora.py`). Above both the reader (`lora_reading.py`) and the writer
(`lora.py`), which need not know each other for it.
"""
from __future__ import annotations

from pathlib import Path

from modules.config.train_config import ModelConfig, TrainingConfig

from .loading import load_model
from .lora import add_lora, save_lora
from .lora_metadata import file_metadata
from .lora_reading import adapter_settings, apply_lora, read_lora


def convert_lora_file(source: str | Path, target: str | Path, base_model: str, fmt: str,
                      dtype: str = "fp16") -> Path:
    """Rewrite the LoRA `source` (any layout above) for `base_model` as `target` in today's `fmt` layout;
    the metadata of the source is kept where the new file does not set it."""
    bundle = load_model(ModelConfig(base_model=base_model))
    weights = read_lora(source, bundle)
    settings = adapter_settings(weights)
    add_lora(bundle, TrainingConfig(precision="fp32", **settings))
    apply_lora(bundle, weights)
    # What describes the new file (layout, implementation, base model by name) is written anew; an old
    # file's `tandem_base_model` may even hold a full local path.
    fresh = set(file_metadata(bundle, fmt, settings["lora_rank"], settings["lora_alpha"], "", weights.lora_type)) | {
        "format", "lora_adapter_metadata"}
    kept = {k: v for k, v in weights.metadata.items() if k not in fresh}
    return save_lora(bundle, target, fmt, dtype, kept)

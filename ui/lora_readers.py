"""The line under the Save tab's LoRA format: which programs apply the LoRA files this config writes, and what
to do for one that does not (`modules/model/lora_clients.py` decides; the trainer logs the same per file).

Tk-free, so it is tested without a display. The family comes from the config without loading anything
(`families.registry.guess_family`); while it is unknown the line says so.
"""
from __future__ import annotations

from modules.config import TrainConfig
from modules.families.registry import guess_family
from modules.families.lora_clients import CLIENTS, EXACT, layout_for, readings


def lora_readers_text(cfg: TrainConfig) -> str:
    """Empty for a full fine-tune; else one sentence per file the config writes."""
    t = cfg.training
    if t.method != "lora":
        return ""
    family = guess_family(cfg.model.base_model, cfg.model.model_type)
    if family is None:
        return "Which programs read the LoRA file depends on the model family (the Models page has the table)."
    formats = ("kohya", "peft") if cfg.save.lora_format == "both" else (cfg.save.lora_format,)
    sentences, exact_somewhere = [], set()
    for fmt in formats:
        found = readings(family, t.lora_type, fmt, t.lora_alpha, t.lora_rank)
        exact_somewhere |= {r.client for r in found if r.verdict == EXACT}
        sentences.append(f"The {fmt} file: " + "; ".join(r.describe() for r in found) + ".")
    for client in CLIENTS:
        if client in exact_somewhere:
            continue
        try:
            wanted = layout_for(client, family, t.lora_type)
        except ValueError:
            sentences.append(f"{CLIENTS[client]} reads no file of this LoRA type.")
        else:
            sentences.append(f"For {CLIENTS[client]} choose {wanted} or both (scripts/convert_lora.py --for {client} "
                             "converts a saved file).")
    return " ".join(sentences)

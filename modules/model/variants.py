"""Which weight file of a diffusers model folder to load: the plain one, or a variant such as fp16.

Hub downloads often hold only `diffusion_pytorch_model.fp16.safetensors` / `model.fp16.safetensors`
(the "fp16 variant"), which `from_pretrained` reads only when told `variant="fp16"`; without it the
error names the model's top folder and a file name that was never there. Each component folder is
looked at here first: plain weights win (as in diffusers); otherwise its variant is used; a folder
with no weights at all gets an error naming that folder.
"""
from __future__ import annotations

import logging
import re
from pathlib import Path

log = logging.getLogger("tandem")

WEIGHT_STEMS = {"unet": "diffusion_pytorch_model", "transformer": "diffusion_pytorch_model",
                "transformer_2": "diffusion_pytorch_model",
                "vae": "diffusion_pytorch_model", "text_encoder": "model", "text_encoder_2": "model",
                "text_encoder_3": "model"}
_FORMATS = ("safetensors", "bin")
PREFERRED = ("fp16", "bf16", "fp32")


def weight_files(folder: Path, stem: str) -> tuple[bool, set[str]]:
    """(whether plain weights are there, the variants there) for one component folder. Single files
    and sharded ones (their index) count: `stem.safetensors`, `stem.fp16.safetensors`,
    `stem.safetensors.index.json`, `stem.safetensors.index.fp16.json`, and the same with `.bin`."""
    plain, variants = False, set()
    escaped = re.escape(stem)
    for file in folder.iterdir() if folder.is_dir() else ():
        name = file.name
        if any(name in (f"{stem}.{fmt}", f"{stem}.{fmt}.index.json") for fmt in _FORMATS):
            plain = True
        elif m := re.fullmatch(rf"{escaped}\.([\w-]+)\.(?:safetensors|bin)", name):
            variants.add(m[1])
        elif m := re.fullmatch(rf"{escaped}\.(?:safetensors|bin)\.index\.([\w-]+)\.json", name):
            variants.add(m[1])
    return plain, variants


def component_variant(where: Path, component: str, storage_dtype: str = "fp16") -> str | None:
    """None to load the plain weights of the component folder `where` (a `unet`, `vae`, `text_encoder` or
    `text_encoder_2`), or the variant to load; raises when it holds neither.

    With several variants and no plain file, the one matching `storage_dtype` (the config's dtype for
    that part) is taken, else fp16, bf16, fp32, then the first by name.
    """
    stem = WEIGHT_STEMS[component]
    plain, variants = weight_files(where, stem)
    if plain:
        return None
    if not variants:
        present = ", ".join(sorted(p.name for p in where.iterdir())[:8]) if where.is_dir() else "(no such folder)"
        raise FileNotFoundError(
            f"{where} holds no {component} weights: expected {stem}.safetensors (or .bin), or a variant such "
            f"as {stem}.fp16.safetensors; it holds {present or 'nothing'}. The download is probably "
            f"incomplete: download the {component} folder of the model again.")
    order = [storage_dtype, *PREFERRED]
    chosen = next((v for v in order if v in variants), sorted(variants)[0])
    if len(variants) > 1:
        log.info("%s: no plain weights; of the variants %s, %s is used.", where, ", ".join(sorted(variants)), chosen)
    return chosen

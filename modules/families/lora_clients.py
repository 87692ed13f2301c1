"""Which program applies which LoRA file exactly: diffusers 0.42.1 and ComfyUI, by family, adapter type and layout.

What is said here was found by loading Tandem's files into diffusers' pipelines and comparing the weights
(`tests/integration/test_lora_clients.py`), and by applying them with ComfyUI's loader as its source has it
(`tests/comfy_lora_rules.py`). In short:

- ComfyUI applies the `kohya` layout exactly for every family and adapter type (LoRA's `lora_down` /
  `lora_up` / `alpha`, the LyCORIS tensors of DoRA, LoHa and LoKr, under names it maps for the family), but
  Lumina 2's LyCORIS adapters of q, k and v (fused there in one weight of unequal parts, with no name for each). It
  takes alpha from `<module>.alpha` tensors only, so from a `peft` file, whose alpha is in the header, it
  applies alpha / rank = 1: the wrong strength whenever alpha differs from the rank. A DoRA `peft` file loses
  its magnitudes there; an SD UNet's attention layers and a Wan or Lumina 2 transformer it does not map at all. It
  has no Flux.3 model.
- diffusers applies the `peft` layout of LoRA and DoRA exactly for every family, and LoKr for Flux.2 and
  Z-Image; it reads no LoHa file, and no LyCORIS-named (`kohya`) DoRA, LoHa or LoKr file. Its kohya readers
  take plain LoRA of every family but SD3, Lumina 2 and Flux.3 (their kohya files load as nothing) - of Qwen-Image
  2.1 all but the SwiGLU gate and up projections' adapters; its Flux.1 reader (Chroma's too) assumes Flux.1's full
  width in the single blocks.

`save_note` is the line the trainer logs for each LoRA file it writes; `layout_for` is what
`scripts/convert_lora.py --for CLIENT` writes.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

CLIENTS = {"comfyui": "ComfyUI", "diffusers": "diffusers"}
EXACT, WRONG, NOTHING = "exact", "wrong", "nothing"
UNETS = ("sd1", "sd2", "sdxl")
LOKR_IN_DIFFUSERS = ("flux2", "zimage")
"""The families whose diffusers LoRA loader takes peft's LoKr tensors (diffusers 0.42.1)."""
NO_DIFFUSERS_NAMES_IN_COMFYUI = {"wan": "Wan", "lumina2": "Lumina 2"}
"""The families for which ComfyUI maps no diffusers module names (its Lumina 2 model takes Z-Image's, which differ)."""
FUSED_UNEQUAL_QKV = ("lumina2",)
"""The families whose original layout fuses q, k and v of unequal widths (Lumina 2's grouped heads) in one weight:
ComfyUI has no name for a LyCORIS adapter of q, k or v alone there, and no kohya reader of diffusers takes their
plain LoRA either."""
FUSED_MISREAD_IN_DIFFUSERS = {"qwen_image21": ("img_mlp.gate_layer", "img_mlp.proj", "img_mlp_gate_up")}
"""The families whose kohya files fuse two diffusers modules in one name (as the original layout fuses their weights)
that diffusers' kohya reader splits at its underscores into a module that does not exist: (the modules, the name).
Qwen-Image 2.1's SwiGLU gate and up projections: its reader applies the file's other adapters."""
NOT_IN_COMFYUI = {"flux3": "Flux.3"}
"""The families ComfyUI has no model of (tests/comfy_lora_rules.py holds no rules for them): it applies no file."""
KOHYA_UNREAD_IN_DIFFUSERS = {"flux3": "its Flux.3 reader takes only `diffusion_model.` keys with peft's tensors"}
"""The families whose diffusers LoRA loader reads no kohya (`lora_unet_`) names at all: why."""
TYPE_TITLES = {"lora": "LoRA", "dora": "DoRA", "loha": "LoHa", "lokr": "LoKr"}


@dataclass(frozen=True)
class Reading:
    """What one program makes of one file."""

    client: str
    verdict: str
    """`exact`, `wrong` (applied, but not as trained) or `nothing` (nothing applied; `why` says whether it errs)."""
    why: str = ""

    def describe(self) -> str:
        title = CLIENTS[self.client]
        if self.verdict == EXACT:
            return f"{title} applies it exactly"
        return f"{title} {self.why}"


def comfyui_reading(model_type: str, lora_type: str, fmt: str, alpha: float, rank: int) -> Reading:
    if model_type in NOT_IN_COMFYUI:
        return Reading("comfyui", NOTHING, f"applies nothing of it (it has no {NOT_IN_COMFYUI[model_type]} model)")
    if fmt == "kohya":
        if lora_type != "lora" and model_type in FUSED_UNEQUAL_QKV:
            return Reading("comfyui", WRONG, "applies all but its adapters of q, k and v (one fused weight there, "
                                             "which has no name for a LyCORIS adapter of each)")
        return Reading("comfyui", EXACT)
    if model_type in NO_DIFFUSERS_NAMES_IN_COMFYUI:
        return Reading("comfyui", NOTHING, "applies nothing of it (it maps no diffusers names for "
                                           f"{NO_DIFFUSERS_NAMES_IN_COMFYUI[model_type]})")
    scale = f"alpha / rank = 1 instead of {alpha / rank:g}" if rank else "alpha / rank = 1"
    if model_type in UNETS:
        return Reading("comfyui", WRONG, "skips its UNet attention layers (it knows them by the old `processor` "
                                         f"names only) and applies the rest at {scale}")
    if lora_type == "dora":
        return Reading("comfyui", WRONG, f"drops its DoRA magnitudes and applies the rest at {scale}")
    if rank and abs(alpha - rank) <= 1e-6 * rank:
        return Reading("comfyui", EXACT)
    return Reading("comfyui", WRONG, f"applies it at {scale} (it reads alpha from `.alpha` tensors only, and this "
                                     "file has alpha in its header)")


def diffusers_reading(model_type: str, lora_type: str, fmt: str) -> Reading:
    if fmt == "peft":
        if lora_type in ("lora", "dora") or (lora_type == "lokr" and model_type in LOKR_IN_DIFFUSERS):
            return Reading("diffusers", EXACT)
        return Reading("diffusers", NOTHING, f"refuses it (its loader reads no {TYPE_TITLES[lora_type]} file "
                                             f"of this family)")
    if lora_type in ("loha", "lokr"):
        return Reading("diffusers", NOTHING, f"applies nothing of it (it reads no LyCORIS {TYPE_TITLES[lora_type]} "
                                             "names: an error or a silent no-op)")
    if lora_type == "dora":
        if model_type in UNETS:
            return Reading("diffusers", WRONG, "drops its `dora_scale` tensors (a plain LoRA is left)")
        return Reading("diffusers", NOTHING, "applies nothing of it (it reads no LyCORIS DoRA names)")
    if model_type == "sd3":
        return Reading("diffusers", NOTHING, "applies nothing of it, silently (it has no reader of sd-scripts' "
                                             "SD3 names)")
    if model_type in KOHYA_UNREAD_IN_DIFFUSERS:
        return Reading("diffusers", NOTHING, f"applies nothing of it ({KOHYA_UNREAD_IN_DIFFUSERS[model_type]})")
    if model_type in FUSED_UNEQUAL_QKV:
        return Reading("diffusers", NOTHING, "applies nothing of it, silently (its Lumina 2 reader takes only "
                                             "`diffusion_model.` keys at the released model's widths)")
    if model_type in FUSED_MISREAD_IN_DIFFUSERS:
        first, second, fused = FUSED_MISREAD_IN_DIFFUSERS[model_type]
        return Reading("diffusers", WRONG, f"applies all but its adapters of `{first}` and `{second}` (it misreads "
                                           f"their fused name `{fused}`); a file without them it applies exactly")
    return Reading("diffusers", EXACT)


def readings(model_type: str, lora_type: str, fmt: str, alpha: float, rank: int) -> list[Reading]:
    """What ComfyUI and diffusers make of a `fmt` file (`kohya` or `peft`) of a `lora_type` adapter of
    `model_type`, trained with `alpha` and `rank`."""
    return [comfyui_reading(model_type, lora_type, fmt, alpha, rank), diffusers_reading(model_type, lora_type, fmt)]


def layout_for(client: str, model_type: str, lora_type: str) -> str:
    """The layout (`kohya` or `peft`) that `client` applies exactly for this family and adapter type; a
    ValueError when it reads none."""
    if client not in CLIENTS:
        raise ValueError(f"--for {client!r}: choose one of {', '.join(CLIENTS)}")
    for fmt in ("kohya", "peft") if client == "comfyui" else ("peft", "kohya"):
        # alpha != rank: a layout that is exact only when alpha happens to equal the rank does not count.
        if readings(model_type, lora_type, fmt, 2.0, 1)[list(CLIENTS).index(client)].verdict == EXACT:
            return fmt
    if client == "comfyui":
        why = comfyui_reading(model_type, lora_type, "kohya", 2.0, 1).why
        raise ValueError(f"ComfyUI applies no {TYPE_TITLES[lora_type]} file of a {model_type} model exactly in any "
                         f"layout: it {why}; train training.lora_type lora for ComfyUI"
                         + (", or load the peft file in diffusers" if diffusers_reading(
                             model_type, lora_type, "peft").verdict == EXACT else ""))
    readers = "LoRA, DoRA and LoKr (Flux.2, Z-Image)" if model_type in LOKR_IN_DIFFUSERS else "LoRA and DoRA"
    raise ValueError(f"{CLIENTS[client]} reads no {TYPE_TITLES[lora_type]} file of a {model_type} model in any layout "
                     f"(diffusers 0.42 loads {readers} files); use the file in ComfyUI, or train training.lora_type "
                     "lora or dora for diffusers")


def convert_command(source: str | Path, client: str, base_model: str) -> str:
    source = Path(source)
    target = source.with_name(f"{source.name.removesuffix('.safetensors').removesuffix('.peft')}.{client}.safetensors")
    return (f"python scripts/convert_lora.py {_quoted(str(source))} {_quoted(str(target))} "
            f"--base-model {_quoted(base_model)} --for {client}")


def _quoted(text: str) -> str:
    import shlex
    return shlex.quote(text)


def save_note(path: str | Path, model_type: str, lora_type: str, fmt: str, alpha: float, rank: int,
              base_model: str, others: dict[str, Path] | None = None) -> str:
    """One line on a saved LoRA file: which program applies it exactly, which does not and what to use there
    instead - the run's other file (`others`: layout -> path) or a conversion."""
    others = others or {}
    parts = []
    for reading in readings(model_type, lora_type, fmt, alpha, rank):
        text = reading.describe()
        if reading.verdict != EXACT:
            try:
                wanted = layout_for(reading.client, model_type, lora_type)
            except ValueError:
                text += f"; {CLIENTS[reading.client]} reads no {TYPE_TITLES[lora_type]} file of this family"
            else:
                if wanted in others:
                    text += f"; for {CLIENTS[reading.client]} use {Path(others[wanted]).name}"
                else:
                    text += f"; for {CLIENTS[reading.client]}: {convert_command(path, reading.client, base_model)}"
        parts.append(text)
    return f"{Path(path).name} ({fmt} layout, {TYPE_TITLES[lora_type]}): " + "; ".join(parts)

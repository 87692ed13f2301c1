"""ComfyUI's LoRA loader restated for the tests: which key patches which weight, and how much.

Read from ComfyUI's source - `comfy/lora.py` (`load_lora`, `model_lora_keys_clip`, `model_lora_keys_unet`),
`comfy/weight_adapter/lora.py`, `loha.py`, `lokr.py`, `base.py` (`weight_decompose`) and the name maps of
`comfy/utils.py` (`unet_to_diffusers`, `mmdit_to_diffusers`, `flux_to_diffusers`, `z_image_to_diffusers`) -
as of Comfy-Org/ComfyUI 17358c8 (2026; its per-stem `.alpha` / `.dora_scale` reading and the LoRA formula are
the same in the 2024 copy comfyanonymous/ComfyUI 41444b5, while the Z-Image and Flux.2 maps came after v0.3.64);
written here from that reading, not copied.

ComfyUI holds a model's weights under `diffusion_model.` + the names of its original release (SD's LDM
UNet, Stability's/Black Forest Labs' fused q/k/v, Z-Image's fused `qkv`, Wan's `self_attn.q`, Qwen-Image's
diffusers names) and CLIP text encoders under `clip_l.` / `clip_g.` / `clip_h.` + `transformer.` + the
checkpoint names. It maps LoRA key stems to those weights:

- every model: `lora_unet_<name with _>` and `diffusion_model.<name>` for each weight `<name>.weight`;
- UNet models (SD 1.x/2.x, SDXL), through diffusers' module names `d`: `lora_unet_<d with _>`,
  `lycoris_<d with _>`, and `<e>` / `unet.<e>` where `e` is `d` with attention's `.to_x` spelled
  `.processor.to_x` and `to_out.0` as `to_out` (the old attention-processor names: today's peft names
  `unet.<d>` of attention layers are not among them);
- SD3 (`mmdit_to_diffusers`): `transformer.<d>`, `base_model.model.<d>`, `lora_transformer_<d with _>`,
  `lycoris_<d with _>`;
- Flux-type models - Flux.1, Flux.2, Chroma (`flux_to_diffusers`): `transformer.<d>`, `lycoris_<d with _>`,
  `lora_transformer_<d with _>`, `<d>`;
- Qwen-Image: `<name>`, `transformer.<name>`, `lycoris_<name with _>`; Qwen-Image 2.1 (a `QwenImage` model too)
  likewise, where its fused `img_mlp.gate_up` is addressed by halves: `...img_mlp.gate_layer` its first rows,
  `...img_mlp.proj` the rest;
- Z-Image (`Lumina2`, `z_image_to_diffusers`): `diffusion_model.<d>`, `transformer.<d>`, `lycoris_<d with _>`,
  `<d>`; `attention.to_q/to_k/to_v` patch row slices of `attention.qkv`;
- Wan: the generic rules only (no diffusers names);
- CLIP layers (`self_attn.q/k/v/out_proj`, `mlp.fc1/fc2`): `lora_te_` / `lora_te1_` + the path with `_` and
  `text_encoder.<path>` for CLIP-L and CLIP-H; for CLIP-G beside a CLIP-L `lora_te2_` and `text_encoder_2.`,
  alone `lora_te_` and `text_encoder.`; any text-encoder weight as `text_encoders.<its name>`.

Per stem ComfyUI reads `<stem>.alpha` (the only place it takes alpha from: without it alpha / rank is 1,
whatever a file's header says) and `<stem>.dora_scale`, then the first adapter whose tensors are there:
LoRA (`.lora_up.weight` + `.lora_down.weight`, or diffusers' `.lora_B.weight` + `.lora_A.weight`, `_lora.up`,
`.lora.up`, `.lora_linear_layer.up`; change up @ down x alpha / rank), LoHa (`hada_w1_a/b`, `hada_w2_a/b`;
(w1_a w1_b) * (w2_a w2_b) x alpha / rank), LoKr (`lokr_w1` or `lokr_w1_a/b`, `lokr_w2` or `lokr_w2_a/b`;
kron(w1, w2) x alpha / rank of the split factor, x 1 when no factor is split). With a `dora_scale` of one value
per output row the weight becomes (W + change) x dora_scale / row norms of W; with one per input column,
(W + change) x dora_scale / column norms of (W + change). Keys no stem takes are logged "lora key not loaded"
and do nothing.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

PREFIX = "diffusion_model."
CLIP_LAYERS = ("mlp.fc1", "mlp.fc2", "self_attn.k_proj", "self_attn.q_proj", "self_attn.v_proj", "self_attn.out_proj")
"""The CLIP layers ComfyUI's text-encoder LoRA names cover (`LORA_CLIP_MAP`)."""
CLIPS = {"sd1": ("clip_l",), "sd2": ("clip_h",), "sdxl": ("clip_l", "clip_g"), "sd3": ("clip_l", "clip_g"),
         "flux": ("clip_l",)}
"""ComfyUI's name of each of a family's CLIP text encoders, in diffusers' order (`text_encoder`, `text_encoder_2`)."""
FLUX_TYPE = ("flux", "flux2", "chroma")
UNET_FAMILIES = ("sd1", "sd2", "sdxl")


def _stem(name: str) -> str:
    return name[:-len(".weight")]


def key_map(family: str, comfy_state: dict[str, torch.Tensor], diffusers_to_original: dict[str, object]) -> dict:
    """Stem -> target weight name, or (name, (dim, offset, size)) for a slice, for the denoiser. `comfy_state`:
    the model's weights as ComfyUI names them (with `diffusion_model.`); `diffusers_to_original`: diffusers
    weight name -> the original name, or (name, (dim, offset, size)) (a row slice of a fused weight)."""
    found = {}
    for key in comfy_state:
        if key.startswith(PREFIX) and key.endswith(".weight"):
            found[f"lora_unet_{_stem(key)[len(PREFIX):].replace('.', '_')}"] = key
            found[_stem(key)] = key
    for name, target in diffusers_to_original.items():
        if not name.endswith(".weight"):
            continue
        d = _stem(name)
        under = d.replace(".", "_")
        target = (PREFIX + target[0], target[1]) if isinstance(target, tuple) else PREFIX + target
        if family in UNET_FAMILIES:
            old = d.replace(".to_", ".processor.to_")
            old = old[:-2] if old.endswith(".to_out.0") else old
            forms = [f"lora_unet_{under}", f"lycoris_{under}", old, f"unet.{old}"]
        elif family == "sd3":
            forms = [f"transformer.{d}", f"base_model.model.{d}", f"lora_transformer_{under}", f"lycoris_{under}"]
        elif family in FLUX_TYPE:
            forms = [f"transformer.{d}", f"lycoris_{under}", f"lora_transformer_{under}", d]
        elif family in ("qwen", "qwen_image21"):
            forms = [d, f"transformer.{d}", f"lycoris_{under}"]
        elif family == "zimage":
            forms = [f"{PREFIX}{d}", f"transformer.{d}", f"lycoris_{under}", d]
        else:
            forms = []
        for form in forms:
            found[form] = target
    return found


def clip_key_map(comfy_state: dict[str, torch.Tensor]) -> dict[str, str]:
    """Stem -> CLIP weight name, for the text encoders in `comfy_state` (`clip_l.transformer.text_model...`)."""
    found = {f"text_encoders.{_stem(k)}": k for k in comfy_state if k.startswith("clip_") and k.endswith(".weight")}
    clip_l = any(k.startswith("clip_l.") for k in comfy_state)
    for block in range(32):
        for layer in CLIP_LAYERS:
            kohya = f"text_model_encoder_layers_{block}_{layer.replace('.', '_')}"
            diffusers = f"text_model.encoder.layers.{block}.{layer}"
            for clip in ("clip_h", "clip_l", "clip_g"):
                key = f"{clip}.transformer.{diffusers}.weight"
                if key not in comfy_state:
                    continue
                if clip == "clip_g" and clip_l:
                    forms = [f"lora_te2_{kohya}", f"text_encoder_2.{diffusers}"]
                elif clip == "clip_g":
                    forms = [f"lora_te_{kohya}", f"text_encoder.{diffusers}", f"lora_prior_te_{kohya}"]
                else:
                    forms = [f"lora_te_{kohya}", f"lora_te1_{kohya}", f"text_encoder.{diffusers}"]
                for form in forms:
                    found[form] = key
    return found


_LORA_PAIRS = ((".lora_up.weight", ".lora_down.weight"), ("_lora.up.weight", "_lora.down.weight"),
               (".lora_B.weight", ".lora_A.weight"), (".lora.up.weight", ".lora.down.weight"),
               (".lora_linear_layer.up.weight", ".lora_linear_layer.down.weight"))
_LOHA = ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b")
_LOKR = ("lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b")


def _change(stem: str, lora: dict, shape) -> tuple[torch.Tensor, float, set[str]] | None:
    """(the unscaled change, its scale, the keys used) of the first adapter ComfyUI finds under `stem`."""
    alpha = float(lora[f"{stem}.alpha"]) if f"{stem}.alpha" in lora else None
    t = lambda name: lora[f"{stem}{name}"].double()  # noqa: E731
    for up, down in _LORA_PAIRS:
        if f"{stem}{up}" in lora:
            change = (t(up).flatten(1) @ t(down).flatten(1)).reshape(shape)
            rank = lora[f"{stem}{down}"].shape[0]
            return change, alpha / rank if alpha is not None else 1.0, {f"{stem}{up}", f"{stem}{down}"}
    if f"{stem}.hada_w1_a" in lora:
        change = ((t(".hada_w1_a") @ t(".hada_w1_b")) * (t(".hada_w2_a") @ t(".hada_w2_b"))).reshape(shape)
        rank = lora[f"{stem}.hada_w1_b"].shape[0]
        return change, alpha / rank if alpha is not None else 1.0, {f"{stem}.{n}" for n in _LOHA}
    present = {n for n in _LOKR if f"{stem}.{n}" in lora}
    if present & {"lokr_w1", "lokr_w2", "lokr_w1_a", "lokr_w2_a"}:
        split = None
        if "lokr_w1" in present:
            w1 = t(".lokr_w1")
        else:
            split, w1 = lora[f"{stem}.lokr_w1_b"].shape[0], t(".lokr_w1_a") @ t(".lokr_w1_b")
        if "lokr_w2" in present:
            w2 = t(".lokr_w2")
        else:
            split, w2 = lora[f"{stem}.lokr_w2_b"].shape[0], t(".lokr_w2_a") @ t(".lokr_w2_b")
        if w2.dim() == 4:
            w1 = w1[:, :, None, None]
        scale = alpha / split if alpha is not None and split is not None else 1.0
        return torch.kron(w1, w2).reshape(shape), scale, {f"{stem}.{n}" for n in present}
    return None


def _patch(weight: torch.Tensor, change: torch.Tensor, scale: float, dora_scale) -> torch.Tensor:
    calc = weight.double() + scale * change
    if dora_scale is None:
        return calc
    dora_scale = dora_scale.double()
    if dora_scale.shape[0] == weight.shape[0]:  # one value per output row: norms of the base weight
        norm = weight.double().reshape(weight.shape[0], -1).norm(dim=1).reshape(-1, *[1] * (weight.dim() - 1))
        norm = norm + torch.finfo(weight.dtype).eps
    else:  # LyCORIS's input-axis DoRA: norms of the changed weight's columns
        norm = calc.transpose(0, 1).reshape(calc.shape[1], -1).norm(dim=1).reshape(
            calc.shape[1], *[1] * (calc.dim() - 1)).transpose(0, 1)
    return calc * (dora_scale / norm)


def apply(lora: dict[str, torch.Tensor], mapping: dict, state: dict[str, torch.Tensor]) -> tuple[dict, list[str]]:
    """(the patched weights, the LoRA keys no stem took) - what ComfyUI's loader does at strength 1."""
    patched = {k: v.clone() for k, v in state.items()}
    used = set()
    for stem, target in mapping.items():
        name, where = target if isinstance(target, tuple) else (target, None)
        weight = patched[name] if where is None else patched[name].narrow(*where)
        found = _change(stem, lora, weight.shape)
        if found is None:
            continue
        change, scale, keys = found
        dora_scale = lora.get(f"{stem}.dora_scale")
        weight.copy_(_patch(weight, change, scale, dora_scale).to(weight.dtype))
        used |= keys | {f"{stem}.alpha", f"{stem}.dora_scale"}
    return patched, sorted(set(lora) - used)


# ------------------------------------------------------------------ a Tandem model as ComfyUI holds it


@dataclass
class ComfyModel:
    """A bundle's adaptable weights as ComfyUI holds them, and where each of Tandem's weights sits there."""

    state: dict[str, torch.Tensor]
    """ComfyUI's names (`diffusion_model.<original>`, `clip_l.transformer.<...>`) -> base weight."""
    places: dict[tuple[str, str], object]
    """(component, Tandem's weight name) -> ComfyUI weight name, or (name, (dim, offset, size)) for a row slice."""
    key_map: dict[str, object]
    """LoRA stem -> target, by ComfyUI's rules above."""

    def place(self, weights: dict[tuple[str, str], torch.Tensor]) -> dict[str, torch.Tensor]:
        """ComfyUI's weights with `weights` ((component, Tandem's name) -> tensor) put in their places."""
        out = {k: v.clone() for k, v in self.state.items()}
        for key, value in weights.items():
            target = self.places[key]
            name, where = target if isinstance(target, tuple) else (target, None)
            (out[name] if where is None else out[name].narrow(*where)).copy_(value.to(out[name].dtype))
        return out

    def apply(self, lora: dict[str, torch.Tensor]) -> tuple[dict, list[str]]:
        return apply(lora, self.key_map, self.state)


def _base_weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k.replace(".base_layer", ""): v.detach().double() for k, v in module.state_dict().items()
            if not any(m in k for m in (".lora_", ".hada_", ".lokr_"))}


def _denoiser_places(bundle, base: dict[str, torch.Tensor]) -> dict[str, object]:
    """Tandem's denoiser weight name -> its ComfyUI name without `diffusion_model.` (or a row slice)."""
    if bundle.model_type in UNET_FAMILIES:
        from modules.model.ldm_layout import unet_module_to_ldm

        return {name: unet_module_to_ldm(_stem(name), bundle.unet.config) + ".weight"
                for name in base if name.endswith(".weight")}
    if bundle.model_type == "wan":  # Tandem's Wan single files keep diffusers' names; ComfyUI's are the release's
        from modules.model.families.wan import original_module_name

        places = {}
        for name in base:
            try:
                places[name] = original_module_name(_stem(name)) + ".weight"
            except ValueError:
                places[name] = name  # outside the blocks' linear layers: no LoRA here targets these
        return places
    from modules.model.families import original_layout as layout

    places = {}
    for entry in bundle.family.layout(bundle.denoiser.config, base):
        if entry.swap_halves:  # ComfyUI maps these through a function (shift and scale swapped): not a slice
            continue
        for original_suffix, suffix in entry.params:
            row = 0
            for part in entry.parts:
                name = layout.Entry.part_name(part, suffix)
                if name not in base:
                    continue
                size = base[name].shape[0]
                target = entry.original_name(original_suffix)
                places[name] = (target, (0, row, size)) if len(entry.parts) > 1 else target
                row += size
    return places


def comfy_model(bundle) -> ComfyModel:
    """The bundle's weights (adapters left out) as ComfyUI would hold its model, with ComfyUI's key map. Only
    text encoders that carry adapters are included (their names are CLIP's)."""
    from modules.model.bundle import checkpoint_text_encoder_key

    base = _base_weights(bundle.denoiser)
    to_comfy = _denoiser_places(bundle, base)
    state, places = {}, {}
    for name, target in to_comfy.items():
        original, where = target if isinstance(target, tuple) else (target, None)
        if where is None:
            state[PREFIX + original] = base[name]
        else:
            state.setdefault(PREFIX + original, []).append(base[name])
        places[(bundle.denoiser_name, name)] = (PREFIX + original, where) if where else PREFIX + original
    state = {k: torch.cat(v) if isinstance(v, list) else v for k, v in state.items()}
    mapping = key_map(bundle.model_type, state, to_comfy)
    for index, clip in enumerate(CLIPS.get(bundle.model_type, ())):
        component = "text_encoder" if index == 0 else f"text_encoder_{index + 1}"
        encoder = bundle.modules().get(component)
        if encoder is None or not getattr(encoder, "peft_config", None):
            continue
        for name, value in _base_weights(encoder).items():
            if name.endswith(".weight"):
                key = f"{clip}.transformer.{checkpoint_text_encoder_key(name)}"
                state[key] = value
                places[(component, name)] = key
    mapping.update(clip_key_map(state))
    return ComfyModel(state, places, mapping)


def trained_weights(bundle) -> dict[tuple[str, str], torch.Tensor]:
    """(component, weight name) -> the weight every adapted layer computes with, as peft computes it (DoRA's
    magnitude included)."""
    from modules.model.lora_variants import adapted_layers, delta_weight

    out = {}
    for component, module in bundle.modules().items():
        for path, layer in adapted_layers(module).items():
            base = layer.get_base_layer().weight.detach().double()
            with torch.no_grad():
                weight = base + delta_weight(layer).detach().double().reshape(base.shape)
                if hasattr(layer, "lora_magnitude_vector") and "default" in layer.lora_magnitude_vector:
                    magnitude = layer.lora_magnitude_vector["default"].weight.detach().double().reshape(-1)
                    norms = weight.reshape(weight.shape[0], -1).norm(dim=1)
                    weight = weight * (magnitude / norms).reshape(-1, *[1] * (weight.dim() - 1))
            out[(component, f"{path}.weight")] = weight
    return out

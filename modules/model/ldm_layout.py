"""Diffusers -> original (LDM / "single file") key layout, for saving checkpoints other tools load.

The reverse of diffusers' own single-file conversion: UNet and VAE keys are renamed block by block;
OpenAI CLIP keys only get a prefix; OpenCLIP text encoders (SD 2.x, SDXL's second) get their q/k/v
projections fused back into `in_proj`. Written for any block count, so tiny test models map too.
"""
from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from modules.model.detect import UNET_PREFIX, VAE_PREFIX

_UNET_TOP_LEVEL = {
    "time_embedding.linear_1": "time_embed.0",
    "time_embedding.linear_2": "time_embed.2",
    "add_embedding.linear_1": "label_emb.0.0",
    "add_embedding.linear_2": "label_emb.0.2",
    "conv_in": "input_blocks.0.0",
    "conv_norm_out": "out.0",
    "conv_out": "out.2",
}
_RESNET_PARTS = {
    "norm1": "in_layers.0", "conv1": "in_layers.2", "norm2": "out_layers.0", "conv2": "out_layers.3",
    "time_emb_proj": "emb_layers.1", "conv_shortcut": "skip_connection",
}
_MID_BLOCK = {"resnets.0": "0", "attentions.0": "1", "resnets.1": "2"}


def _unet_key_to_ldm(key: str, per_block: int, up_blocks_with_attention: set[int]) -> str:
    """One diffusers UNet key -> its LDM name. LDM numbers the UNet's layers consecutively: every
    down block holds `per_block` layers + a downsampler, every up block `per_block + 1` layers, and an
    up block's upsampler takes slot 2 when slot 1 holds its attention."""
    module, _, param = key.rpartition(".")
    if module in _UNET_TOP_LEVEL:
        return f"{_UNET_TOP_LEVEL[module]}.{param}"

    def resnet(rest: str) -> str:
        layer, _, tail = rest.partition(".")
        return f"{_RESNET_PARTS.get(layer, layer)}.{tail}"

    if m := re.fullmatch(r"down_blocks\.(\d+)\.(resnets|attentions)\.(\d+)\.(.+)", key):
        index = 1 + int(m[1]) * (per_block + 1) + int(m[3])
        return f"input_blocks.{index}.0.{resnet(m[4])}" if m[2] == "resnets" else f"input_blocks.{index}.1.{m[4]}"
    if m := re.fullmatch(r"down_blocks\.(\d+)\.downsamplers\.0\.conv\.(.+)", key):
        return f"input_blocks.{1 + int(m[1]) * (per_block + 1) + per_block}.0.op.{m[2]}"
    if m := re.fullmatch(r"mid_block\.((?:resnets|attentions)\.\d+)\.(.+)", key):
        if m[1] in _MID_BLOCK:
            part = resnet(m[2]) if m[1].startswith("resnets") else m[2]
            return f"middle_block.{_MID_BLOCK[m[1]]}.{part}"
    if m := re.fullmatch(r"up_blocks\.(\d+)\.(resnets|attentions)\.(\d+)\.(.+)", key):
        index = int(m[1]) * (per_block + 1) + int(m[3])
        return f"output_blocks.{index}.0.{resnet(m[4])}" if m[2] == "resnets" else f"output_blocks.{index}.1.{m[4]}"
    if m := re.fullmatch(r"up_blocks\.(\d+)\.upsamplers\.0\.conv\.(.+)", key):
        slot = 2 if int(m[1]) in up_blocks_with_attention else 1
        return f"output_blocks.{int(m[1]) * (per_block + 1) + per_block}.{slot}.conv.{m[2]}"
    raise ValueError(f"UNet key {key!r} has no original-layout equivalent (is a LoRA/adapter still attached?).")


def _unet_layout(config: Mapping) -> tuple[int, set[int]]:
    per_block = config["layers_per_block"]
    if not isinstance(per_block, int):
        raise ValueError(f"UNet layers_per_block {per_block!r}: only one value for all blocks has an original layout.")
    return per_block, {i for i, name in enumerate(config["up_block_types"]) if "CrossAttn" in name}


def unet_to_ldm(state: Mapping[str, torch.Tensor], config: Mapping) -> dict:
    """Diffusers UNet state dict -> `model.diffusion_model.*` keys."""
    per_block, with_attention = _unet_layout(config)
    return {UNET_PREFIX + _unet_key_to_ldm(k, per_block, with_attention): v for k, v in state.items()}


def unet_module_to_ldm(module_path: str, config: Mapping) -> str:
    """A diffusers UNet module path -> its original-layout path (no `model.diffusion_model.` prefix):
    `down_blocks.1.attentions.0.proj_in` -> `input_blocks.4.1.proj_in` for SDXL. The same map as the
    weights' (a module is named by its weight's key without `.weight`)."""
    per_block, with_attention = _unet_layout(config)
    return _unet_key_to_ldm(module_path + ".weight", per_block, with_attention).removesuffix(".weight")


_VAE_TOP_LEVEL = {"encoder.conv_norm_out": "encoder.norm_out", "decoder.conv_norm_out": "decoder.norm_out"}
_VAE_ATTENTION_PARTS = {"group_norm": "norm", "to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "proj_out"}


def _vae_key_to_ldm(key: str, up_block_count: int) -> str:
    module, _, param = key.rpartition(".")
    if module in _VAE_TOP_LEVEL:
        return f"{_VAE_TOP_LEVEL[module]}.{param}"
    shortcut = lambda rest: rest.replace("conv_shortcut", "nin_shortcut")  # noqa: E731
    if m := re.fullmatch(r"encoder\.down_blocks\.(\d+)\.resnets\.(\d+)\.(.+)", key):
        return f"encoder.down.{m[1]}.block.{m[2]}.{shortcut(m[3])}"
    if m := re.fullmatch(r"encoder\.down_blocks\.(\d+)\.downsamplers\.0\.conv\.(.+)", key):
        return f"encoder.down.{m[1]}.downsample.conv.{m[2]}"
    # LDM counts decoder up blocks from the lowest resolution upwards, diffusers from the top down.
    if m := re.fullmatch(r"decoder\.up_blocks\.(\d+)\.resnets\.(\d+)\.(.+)", key):
        return f"decoder.up.{up_block_count - 1 - int(m[1])}.block.{m[2]}.{shortcut(m[3])}"
    if m := re.fullmatch(r"decoder\.up_blocks\.(\d+)\.upsamplers\.0\.conv\.(.+)", key):
        return f"decoder.up.{up_block_count - 1 - int(m[1])}.upsample.conv.{m[2]}"
    if m := re.fullmatch(r"(encoder|decoder)\.mid_block\.resnets\.(\d+)\.(.+)", key):
        return f"{m[1]}.mid.block_{int(m[2]) + 1}.{shortcut(m[3])}"
    if m := re.fullmatch(r"(encoder|decoder)\.mid_block\.attentions\.0\.(.+)\.(weight|bias)", key):
        if m[2] in _VAE_ATTENTION_PARTS:
            return f"{m[1]}.mid.attn_1.{_VAE_ATTENTION_PARTS[m[2]]}.{m[3]}"
    if module in ("encoder.conv_in", "encoder.conv_out", "decoder.conv_in", "decoder.conv_out",
                  "quant_conv", "post_quant_conv"):
        return key
    raise ValueError(f"VAE key {key!r} has no original-layout equivalent.")


def vae_to_ldm(state: Mapping[str, torch.Tensor], config: Mapping, prefix: str = VAE_PREFIX) -> dict:
    """Diffusers VAE state dict -> `first_stage_model.*` keys (`prefix=""` for a VAE-only file). The
    mid-block attention's linear layers are 1x1 convolutions in the original layout."""
    out = {}
    for key, value in state.items():
        ldm_key = _vae_key_to_ldm(key, len(config["up_block_types"]))
        if ".mid.attn_1." in ldm_key and ldm_key.endswith("weight") and value.ndim == 2:
            value = value[:, :, None, None]
        out[prefix + ldm_key] = value
    return out


def clip_to_ldm(state: Mapping[str, torch.Tensor], prefix: str) -> dict:
    """OpenAI CLIP text model (`text_model.*` keys) -> `<prefix>text_model.*`: the layouts only differ by prefix."""
    return {prefix + k: v for k, v in state.items() if not k.endswith("position_ids")}


_LAYER_KEY = re.compile(r"text_model\.encoder\.layers\.(\d+)\.(.+)\.(weight|bias)")
_OPEN_CLIP_LAYER_PARTS = {
    "self_attn.out_proj": "attn.out_proj", "layer_norm1": "ln_1", "layer_norm2": "ln_2",
    "mlp.fc1": "mlp.c_fc", "mlp.fc2": "mlp.c_proj",
}


def open_clip_to_ldm(state: Mapping[str, torch.Tensor], prefix: str) -> dict:
    """Transformers CLIP text model (`text_model.*`) -> OpenCLIP layout under `prefix`: q/k/v fused into
    one `in_proj` per block (q, k, v stacked in that order), `text_projection` stored transposed."""
    out = {}
    fused: dict[str, dict[str, torch.Tensor]] = {}
    fixed = {
        "text_model.embeddings.token_embedding.weight": "token_embedding.weight",
        "text_model.embeddings.position_embedding.weight": "positional_embedding",
        "text_model.final_layer_norm.weight": "ln_final.weight",
        "text_model.final_layer_norm.bias": "ln_final.bias",
    }
    for key, value in state.items():
        if key.endswith("position_ids"):
            continue
        if key in fixed:
            out[prefix + fixed[key]] = value
        elif key == "text_projection.weight":
            out[prefix + "text_projection"] = value.T
        elif m := re.fullmatch(r"text_model\.encoder\.layers\.(\d+)\.self_attn\.([qkv])_proj\.(weight|bias)", key):
            fused.setdefault(f"transformer.resblocks.{m[1]}.attn.in_proj_{m[3]}", {})[m[2]] = value
        elif (m := _LAYER_KEY.fullmatch(key)) and m[2] in _OPEN_CLIP_LAYER_PARTS:
            out[f"{prefix}transformer.resblocks.{m[1]}.{_OPEN_CLIP_LAYER_PARTS[m[2]]}.{m[3]}"] = value
        else:
            raise ValueError(
                f"text encoder key {key!r} has no OpenCLIP equivalent (is a LoRA/adapter still attached?)."
            )
    for name, parts in fused.items():
        if set(parts) != {"q", "k", "v"}:
            raise ValueError(f"text encoder block {name}: q/k/v projections incomplete ({sorted(parts)}).")
        out[prefix + name] = torch.cat([parts["q"], parts["k"], parts["v"]], dim=0)
    return out

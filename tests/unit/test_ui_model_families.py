"""The GUI shows a model family's own settings only when they apply: the rule, without a display (the rows
themselves are tested under Xvfb in tests/gui/test_ui_widgets.py)."""
from __future__ import annotations

import json

import torch
from safetensors.torch import save_file

from modules.config import TrainConfig, load_preset
from modules.families.registry import guess_family
from ui.field_visibility import hidden_fields

FLOW_ONLY = {"model.t5_max_length", "model.components_folder", "training.timestep_logit_mean",
             "training.timestep_logit_std"}
LANGUAGE_MODEL_ONLY = {"model.text_max_length"}
"""Flux.2's (the families whose text encoder is a language model it shows the length of)."""
SD_ONLY = {"model.prediction_type", "training.min_snr_gamma", "training.clip_skip"}
TEXT_APART_ONLY = {"model.text_encoder_placement"}
"""Qwen-Image's and Z-Image's: where their text encoder runs while it fills the text cache."""
VIDEO_ONLY = {"data.video_frames", "data.video_fps", "sampling.video_frames", "model.wan_expert"}
"""Wan's: the frames of a clip's window and their rate, the frames of a video sample, and which Wan 2.2 A14B
expert trains."""


def config(base_model: str, model_type: str = "auto") -> TrainConfig:
    cfg = TrainConfig()
    cfg.model.base_model, cfg.model.model_type = base_model, model_type
    return cfg


def test_hidden_fields_follow_the_family():
    OTHERS = LANGUAGE_MODEL_ONLY | TEXT_APART_ONLY | VIDEO_ONLY
    assert hidden_fields(config("builtin:demo")) == FLOW_ONLY | OTHERS | {"training.flux_guidance"}
    assert hidden_fields(config("builtin:demo-sd3")) == SD_ONLY | OTHERS | {"training.flux_guidance"}
    assert hidden_fields(config("builtin:demo-flux")) == SD_ONLY | OTHERS
    assert hidden_fields(config("models/anything", "flux")) == SD_ONLY | OTHERS  # the explicit type decides
    assert hidden_fields(config("models/not-there")) == set()  # unknown family: everything shows
    assert hidden_fields(load_preset("flux_lora")) == SD_ONLY | OTHERS
    assert hidden_fields(load_preset("sd35_finetune")) == SD_ONLY | OTHERS | {"training.flux_guidance"}
    # Flux.2 has no T5 (its language model's length is model.text_max_length) but a guidance input on dev;
    # Chroma has T5 and no guidance input.
    for source in (config("builtin:demo-flux2"), load_preset("flux2_lora"), load_preset("flux2_finetune")):
        assert hidden_fields(source) == SD_ONLY | TEXT_APART_ONLY | VIDEO_ONLY | {"model.t5_max_length"}
    for source in (config("builtin:demo-chroma"), load_preset("chroma_lora"), load_preset("chroma_finetune")):
        assert hidden_fields(source) == SD_ONLY | OTHERS | {"training.flux_guidance"}
    # Qwen-Image and Z-Image: no T5, no Flux guidance; the components folder and timestep settings stay.
    for name in ("builtin:demo-qwen", "builtin:demo-zimage"):
        assert hidden_fields(config(name)) == SD_ONLY | LANGUAGE_MODEL_ONLY | VIDEO_ONLY | {
            "training.flux_guidance", "model.t5_max_length"}
    assert hidden_fields(load_preset("qwen_lora")) == hidden_fields(load_preset("zimage_finetune")) \
        == SD_ONLY | LANGUAGE_MODEL_ONLY | VIDEO_ONLY | {"training.flux_guidance", "model.t5_max_length"}
    # Wan: T5's length (UMT5), the flow settings and the clip window show; no Flux guidance.
    for source in (config("builtin:demo-wan"), load_preset("wan_lora"), load_preset("#demo_wan"),
                   load_preset("wan22_lora")):
        assert hidden_fields(source) == SD_ONLY | LANGUAGE_MODEL_ONLY | TEXT_APART_ONLY | {"training.flux_guidance"}


def test_the_family_is_guessed_from_folders_and_file_headers(tmp_path):
    folder = tmp_path / "flux-folder"
    folder.mkdir()
    (folder / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline"}))
    assert guess_family(str(folder)) == "flux"
    (folder / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionXLPipeline"}))
    assert guess_family(str(folder)) == "sdxl"
    (folder / "model_index.json").write_text(json.dumps({"_class_name": "Flux2KleinPipeline"}))
    assert guess_family(str(folder)) == "flux2"
    (folder / "model_index.json").write_text(json.dumps({"_class_name": "ChromaPipeline"}))
    assert guess_family(str(folder)) == "chroma"
    # Flux.2's and Chroma's files carry Flux.1's double blocks too: the newer family is asked first.
    for keys, family in ((["double_blocks.0.img_attn.qkv.weight"], "flux"),
                         (["double_blocks.0.img_attn.qkv.weight", "double_stream_modulation_img.lin.weight"], "flux2"),
                         (["model.diffusion_model.double_blocks.0.img_attn.qkv.weight",
                           "model.diffusion_model.distilled_guidance_layer.in_proj.weight"], "chroma"),
                         (["model.diffusion_model.joint_blocks.0.x_block.attn.qkv.weight"], "sd3"),
                         (["conditioner.embedders.1.model.ln_final.weight"], "sdxl"),
                         (["cond_stage_model.transformer.text_model.final_layer_norm.weight"], "sd1"),
                         (["txt_norm.weight", "transformer_blocks.0.attn.to_q.weight"], "qwen"),
                         (["model.diffusion_model.cap_pad_token", "layers.0.attention.qkv.weight"], "zimage")):
        path = tmp_path / f"{family}.safetensors"
        save_file({key: torch.zeros(1) for key in keys}, str(path))
        assert guess_family(str(path)) == family
    (tmp_path / "junk.safetensors").write_bytes(b"not a header at all")
    assert guess_family(str(tmp_path / "junk.safetensors")) is None


def test_a_weights_files_header_is_read_once_per_version_of_the_file(tmp_path, monkeypatch):
    """The GUI asks for the family on every edit; a large model's header is read again only once the file
    changes."""
    from modules.families import registry

    reads = []
    real = registry._safetensors_keys
    monkeypatch.setattr(registry, "_safetensors_keys", lambda path: reads.append(path) or real(path))
    path = tmp_path / "model.safetensors"
    save_file({"txt_norm.weight": torch.zeros(1), "transformer_blocks.0.attn.to_q.weight": torch.zeros(1)}, str(path))
    assert [guess_family(str(path)) for _ in range(3)] == ["qwen"] * 3 and len(reads) == 1
    save_file({"model.diffusion_model.joint_blocks.0.x_block.attn.qkv.weight": torch.zeros(1)}, str(path))
    assert guess_family(str(path)) == "sd3" and len(reads) == 2

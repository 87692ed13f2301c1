"""Single-file checkpoints: tiny SD1/SD2/SDXL-shaped models written in the original layout and read
back exactly; the reverse key maps checked against the real-size layouts on the meta device; type and
prediction detection; tokenizer ids."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import types

import pytest
import torch
from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
from diffusers.loaders.single_file_utils import (
    convert_ldm_clip_checkpoint,
    convert_ldm_unet_checkpoint,
    convert_ldm_vae_checkpoint,
    convert_open_clip_checkpoint,
)
from safetensors.torch import save_file
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

from modules.model.detect import SD2_V_PROBE_KEY, detect_model_type, resolve_prediction_type
from modules.model.single_file import (
    clip_to_ldm,
    load_single_file_components,
    load_vae_file,
    open_clip_to_ldm,
    read_checkpoint,
    save_single_file,
    shipped_config,
    unet_to_ldm,
    vae_to_ldm,
)
from modules.model.tokenizer import clip_tokenizer

VOCAB = 49408


# ------------------------------------------------------------------ tiny models with the real structure


def tiny_clip_config(hidden=32, layers=2, act="quick_gelu", projection=16):
    return dict(vocab_size=VOCAB, max_position_embeddings=77, hidden_size=hidden, intermediate_size=2 * hidden,
                num_attention_heads=4, num_hidden_layers=layers, hidden_act=act, projection_dim=projection,
                layer_norm_eps=1e-5, bos_token_id=0, eos_token_id=2, pad_token_id=1)


def tiny_vae_config():
    return dict(block_out_channels=[16, 32], down_block_types=["DownEncoderBlock2D"] * 2,
                up_block_types=["UpDecoderBlock2D"] * 2, layers_per_block=1, norm_num_groups=8,
                latent_channels=4, sample_size=32, scaling_factor=0.18215)


def tiny_configs(model_type):
    unet = dict(block_out_channels=[32, 64], layers_per_block=2, norm_num_groups=8, sample_size=16)
    text = {"text_encoder": tiny_clip_config()}
    if model_type == "sd1":
        unet.update(down_block_types=["CrossAttnDownBlock2D", "DownBlock2D"],
                    up_block_types=["UpBlock2D", "CrossAttnUpBlock2D"], attention_head_dim=8, cross_attention_dim=32)
    elif model_type == "sd2":
        text = {"text_encoder": tiny_clip_config(act="gelu")}
        unet.update(down_block_types=["CrossAttnDownBlock2D", "DownBlock2D"],
                    up_block_types=["UpBlock2D", "CrossAttnUpBlock2D"], attention_head_dim=[2, 4],
                    cross_attention_dim=32, use_linear_projection=True)
    else:  # SDXL: no attention at the top level, deeper transformers below, two encoders, size/crop embedding
        text = {"text_encoder": tiny_clip_config(),
                "text_encoder_2": tiny_clip_config(hidden=48, act="gelu", projection=24)}
        unet.update(down_block_types=["DownBlock2D", "CrossAttnDownBlock2D"],
                    up_block_types=["CrossAttnUpBlock2D", "UpBlock2D"], attention_head_dim=[2, 4],
                    transformer_layers_per_block=[1, 2], cross_attention_dim=32 + 48, use_linear_projection=True,
                    addition_embed_type="text_time", addition_time_embed_dim=8,
                    projection_class_embeddings_input_dim=24 + 6 * 8)
    return {"unet": unet, "vae": tiny_vae_config(), **text}


def randomize(module, seed):
    """Random values everywhere (norm weights included), so a swapped or transposed tensor cannot pass."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator))
    return module.eval()


def tiny_bundle(model_type, seed=0, prediction_type="epsilon"):
    configs = tiny_configs(model_type)
    encoders = [randomize(CLIPTextModel(CLIPTextConfig(**configs["text_encoder"])), seed + 2)]
    if model_type == "sdxl":
        encoders.append(randomize(CLIPTextModelWithProjection(CLIPTextConfig(**configs["text_encoder_2"])), seed + 3))
    return types.SimpleNamespace(
        model_type=model_type,
        unet=randomize(UNet2DConditionModel(**configs["unet"]), seed),
        vae=randomize(AutoencoderKL(**configs["vae"]), seed + 1),
        text_encoders=encoders,
        tokenizers=[],
        noise_scheduler=None,
        prediction_type=prediction_type,
    ), configs


def assert_same_state(actual, expected):
    a, e = actual.state_dict(), expected.state_dict()
    assert a.keys() == e.keys()
    for key in e:
        assert a[key].dtype == e[key].dtype, key
        assert torch.equal(a[key], e[key]), key


def loaded_text_encoders(components):
    return [m for m in (components["text_encoder"], components["text_encoder_2"]) if m is not None]


# ------------------------------------------------------------------ round trips


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["sd1", "sd2", "sdxl"])
def test_save_then_load_gives_identical_models(tmp_path, model_type):
    bundle, _ = tiny_bundle(model_type, prediction_type="v_prediction")
    path = save_single_file(bundle, tmp_path / "model.safetensors", torch.float32)

    keys = read_checkpoint(path)[0].keys()
    assert detect_model_type(keys) == model_type
    assert not [p for p in tmp_path.iterdir() if p.name != "model.safetensors"], "temporary file left behind"
    (tmp_path / "plain").touch()
    assert path.stat().st_mode == (tmp_path / "plain").stat().st_mode  # not safetensors' own 0600
    (tmp_path / "plain").unlink()

    loaded = load_single_file_components(path)
    assert loaded["model_type"] == model_type
    assert loaded["prediction_type"] == "v_prediction"  # recorded in the file's metadata
    assert isinstance(loaded["scheduler"], DDPMScheduler)
    assert loaded["scheduler"].config.prediction_type == "v_prediction"
    assert_same_state(loaded["unet"], bundle.unet)
    assert_same_state(loaded["vae"], bundle.vae)
    encoders = loaded_text_encoders(loaded)
    assert [type(m) for m in encoders] == [type(m) for m in bundle.text_encoders]
    ids = clip_tokenizer()(["a photo of a cat"], padding="max_length", max_length=77, return_tensors="pt").input_ids
    for original, restored in zip(bundle.text_encoders, encoders):
        assert_same_state(restored, original)
        # Also runs the rebuilt non-persistent buffers (position_ids), which no checkpoint carries.
        with torch.no_grad():
            assert torch.equal(restored(ids).last_hidden_state, original(ids).last_hidden_state)
    if model_type == "sdxl":
        assert loaded["tokenizer"].pad_token_id == 49407 and loaded["tokenizer_2"].pad_token_id == 0
    else:
        assert loaded["text_encoder_2"] is None and loaded["tokenizer_2"] is None
        assert loaded["tokenizer"].pad_token_id == (0 if model_type == "sd2" else 49407)


def test_save_casts_to_the_requested_dtype_and_uses_the_unet_override(tmp_path):
    bundle, _ = tiny_bundle("sd1")
    override = {k: v + 1 for k, v in bundle.unet.state_dict().items()}
    path = save_single_file(bundle, tmp_path / "half.safetensors", "fp16", unet_state_override=override)
    loaded = load_single_file_components(path)
    for key, value in loaded["unet"].state_dict().items():
        assert value.dtype == torch.float16 and torch.equal(value, override[key].half()), key
    assert_same_state(loaded["vae"], bundle.vae.half())

    with pytest.raises(ValueError, match="unet_state_override does not match"):
        save_single_file(bundle, tmp_path / "bad.safetensors", "fp16", unet_state_override={"conv_in.weight": 0})
    with pytest.raises(ValueError, match=r"\.safetensors only"):
        save_single_file(bundle, tmp_path / "model.ckpt", "fp16")


@pytest.mark.slow
def test_ckpt_without_metadata_needs_config_overrides(tmp_path):
    bundle, configs = tiny_bundle("sd2", seed=5)
    state, _ = read_checkpoint(save_single_file(bundle, tmp_path / "model.safetensors", torch.float32))
    ckpt = tmp_path / "foreign.ckpt"
    torch.save({"state_dict": state, "global_step": 10}, ckpt)

    # Tiny shapes against the shipped real-size configs: a clear error that names the way out.
    with pytest.raises(ValueError, match=r"foreign\.ckpt: the UNet weights do not fit.*config_overrides"):
        load_single_file_components(ckpt)

    loaded = load_single_file_components(ckpt, model_type="sd2", config_overrides=configs)
    assert_same_state(loaded["unet"], bundle.unet)
    assert_same_state(loaded["text_encoder"], bundle.text_encoders[0])
    assert loaded["prediction_type"] == "v_prediction"  # SD 2.x default when the file says nothing

    (tmp_path / "foreign.yaml").write_text('model:\n  params:\n    parameterization: "eps"\n')
    assert load_single_file_components(ckpt, config_overrides=configs)["prediction_type"] == "epsilon"
    (tmp_path / "foreign.yaml").write_text('model:\n  params:\n    parameterization: "v"\n')
    assert load_single_file_components(ckpt, config_overrides=configs)["prediction_type"] == "v_prediction"
    assert load_single_file_components(ckpt, prediction_type="epsilon", config_overrides=configs)[
        "prediction_type"] == "epsilon"


def test_explicit_model_type_must_match_the_checkpoint(tmp_path):
    bundle, _ = tiny_bundle("sd1")
    path = save_single_file(bundle, tmp_path / "sd1.safetensors", torch.float32)
    with pytest.raises(ValueError, match=r"sd1\.safetensors: model\.model_type is 'sdxl' but the checkpoint is 'sd1'"):
        load_single_file_components(path, model_type="sdxl")
    with pytest.raises(ValueError, match="model_type 'sd3'"):
        load_single_file_components(path, model_type="sd3")


@pytest.mark.slow
def test_vae_files_and_checkpoints_without_vae(tmp_path):
    bundle, configs = tiny_bundle("sdxl")
    full = save_single_file(bundle, tmp_path / "full.safetensors", torch.float32)
    assert_same_state(load_vae_file(full), bundle.vae)  # first_stage_model.* of a full checkpoint

    other_vae = randomize(AutoencoderKL(**configs["vae"]), 42)
    vae_only = tmp_path / "vae.safetensors"
    save_file({k: v.contiguous() for k, v in vae_to_ldm(other_vae.state_dict(), other_vae.config, prefix="").items()},
              str(vae_only))
    config = {k: v for k, v in configs["vae"].items() if k != "scaling_factor"}
    restored = load_vae_file(vae_only, model_type="sdxl", config=config)
    assert_same_state(restored, other_vae)
    assert restored.config.scaling_factor == 0.13025  # the SDXL VAE's, from the shipped config

    state, _ = read_checkpoint(full)
    no_vae = tmp_path / "no_vae.safetensors"
    state = {k: v for k, v in state.items() if not k.startswith("first_stage_model.")}
    # Leftovers found in released checkpoints: a stored position_ids buffer and EMA bookkeeping.
    state["conditioner.embedders.0.transformer.text_model.embeddings.position_ids"] = torch.arange(77.0)[None]
    state["model_ema.decay"] = torch.tensor(0.9999)
    save_file(state, str(no_vae))
    with pytest.raises(ValueError, match=r"no_vae\.safetensors: the checkpoint has no VAE.*model\.vae_path"):
        load_single_file_components(no_vae, config_overrides=configs)
    without_vae = load_single_file_components(no_vae, config_overrides=configs, load_vae=False)
    assert without_vae["vae"] is None
    assert_same_state(without_vae["text_encoder"], bundle.text_encoders[0])


def test_missing_and_unreadable_files_name_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nothing\.safetensors: checkpoint file not found"):
        load_single_file_components(tmp_path / "nothing.safetensors")
    (tmp_path / "model.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match=r"model\.bin: unsupported checkpoint extension"):
        load_single_file_components(tmp_path / "model.bin")
    (tmp_path / "broken.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match=r"broken\.safetensors: not a readable"):
        load_vae_file(tmp_path / "broken.safetensors")
    torch.save({"state_dict": {"x": torch.zeros(1)}, "callback": types.SimpleNamespace()}, tmp_path / "pickled.ckpt")
    with pytest.raises(ValueError, match=r"pickled\.ckpt: could not be read as a weights-only"):
        load_single_file_components(tmp_path / "pickled.ckpt")


# ------------------------------------------------------------------ detection


def test_detect_model_type_from_key_names():
    unet = ["model.diffusion_model.input_blocks.0.0.weight"]
    assert detect_model_type(unet + ["cond_stage_model.transformer.text_model.final_layer_norm.weight"]) == "sd1"
    assert detect_model_type(unet + ["cond_stage_model.model.ln_final.weight"]) == "sd2"
    assert detect_model_type(unet + ["conditioner.embedders.0.transformer.text_model.final_layer_norm.weight",
                                     "conditioner.embedders.1.model.ln_final.weight"]) == "sdxl"
    with pytest.raises(ValueError, match=r"odd\.safetensors: cannot detect.*no Stable Diffusion.*First keys: a\.b"):
        detect_model_type(["a.b", "c.d"], source="odd.safetensors")
    with pytest.raises(ValueError, match="SDXL refiner"):
        detect_model_type(unet + ["conditioner.embedders.0.model.ln_final.weight"])
    with pytest.raises(ValueError, match="diffusers layout"):
        detect_model_type(["down_blocks.0.resnets.0.conv1.weight"])


def test_prediction_type_rules_in_order(tmp_path):
    path = tmp_path / "model.safetensors"
    wide, narrow = {SD2_V_PROBE_KEY: torch.linspace(-1, 1, 64)}, {SD2_V_PROBE_KEY: torch.full((64,), 0.02)}
    assert resolve_prediction_type("epsilon", "sd2", path, wide, recorded="v_prediction") == "epsilon"
    assert resolve_prediction_type("auto", "sd2", path, wide, recorded="epsilon") == "epsilon"
    assert resolve_prediction_type("auto", "sdxl", path, {"v_pred": torch.zeros(0)}) == "v_prediction"
    assert resolve_prediction_type("auto", "sd2", path, wide) == "v_prediction"  # ComfyUI's weight heuristic
    assert resolve_prediction_type("auto", "sd2", path, narrow) == "epsilon"
    assert resolve_prediction_type("auto", "sd2", path, {}) == "v_prediction"  # SD 2.x default (768-v)
    assert resolve_prediction_type("auto", "sd1", path, wide) == "epsilon"
    with pytest.raises(ValueError, match="prediction_type 'v'"):
        resolve_prediction_type("v", "sd1", path)


# ------------------------------------------------------------------ real-size layouts (meta device: no memory)


REAL_LAYOUT = {  # key counts and a few well-known tensors of the released checkpoints
    "sd1": {"unet": 686, "text": 196, "known": {
        "model.diffusion_model.output_blocks.2.1.conv.weight": (1280, 1280, 3, 3),
        "model.diffusion_model.output_blocks.5.2.conv.weight": (1280, 1280, 3, 3),
        "model.diffusion_model.input_blocks.1.1.proj_in.weight": (320, 320, 1, 1),
        "cond_stage_model.transformer.text_model.embeddings.token_embedding.weight": (49408, 768)}},
    "sd2": {"unet": 686, "text": 23 * 12 + 4, "known": {
        "model.diffusion_model.input_blocks.1.1.proj_in.weight": (320, 320),
        "model.diffusion_model.input_blocks.4.1.transformer_blocks.0.attn2.to_k.weight": (640, 1024),
        "cond_stage_model.model.transformer.resblocks.22.attn.in_proj_weight": (3072, 1024),
        "cond_stage_model.model.positional_embedding": (77, 1024)}},
    "sdxl": {"unet": 1680, "text": 196 + 32 * 12 + 5, "known": {
        "model.diffusion_model.label_emb.0.0.weight": (1280, 2816),
        "model.diffusion_model.output_blocks.2.2.conv.weight": (1280, 1280, 3, 3),
        "model.diffusion_model.output_blocks.5.2.conv.weight": (640, 640, 3, 3),
        "conditioner.embedders.1.model.text_projection": (1280, 1280),
        "conditioner.embedders.1.model.transformer.resblocks.31.attn.in_proj_bias": (3840,)}},
}


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["sd1", "sd2", "sdxl"])
def test_reverse_maps_reproduce_the_real_original_layout(model_type):
    expected = REAL_LAYOUT[model_type]
    with torch.device("meta"):
        unet = UNet2DConditionModel.from_config(shipped_config(model_type, "unet"))
        vae = AutoencoderKL.from_config(shipped_config(model_type, "vae"))
        encoders = [CLIPTextModel(CLIPTextConfig(**shipped_config(model_type, "text_encoder")))]
        if model_type == "sdxl":
            encoders.append(CLIPTextModelWithProjection(CLIPTextConfig(**shipped_config("sdxl", "text_encoder_2"))))
    bundle = types.SimpleNamespace(unet=unet, vae=vae, text_encoders=encoders)

    ldm_unet = unet_to_ldm(unet.state_dict(), unet.config)
    ldm_vae = vae_to_ldm(vae.state_dict(), vae.config)
    text_states = [_text_state(m) for m in bundle.text_encoders]
    if model_type == "sd1":
        ldm_text = clip_to_ldm(text_states[0], "cond_stage_model.transformer.")
    elif model_type == "sd2":
        ldm_text = open_clip_to_ldm(text_states[0], "cond_stage_model.model.")
    else:
        ldm_text = {**clip_to_ldm(text_states[0], "conditioner.embedders.0.transformer."),
                    **open_clip_to_ldm(text_states[1], "conditioner.embedders.1.model.")}
    assert (len(ldm_unet), len(ldm_vae), len(ldm_text)) == (expected["unet"], 248, expected["text"])
    checkpoint = {**ldm_unet, **ldm_vae, **ldm_text}
    for key, shape in expected["known"].items():
        assert tuple(checkpoint[key].shape) == shape, key
    assert tuple(checkpoint["first_stage_model.encoder.mid.attn_1.q.weight"].shape) == (512, 512, 1, 1)

    # diffusers' own converters must take the file back to exactly the model's keys and shapes.
    def same_layout(converted, state):
        assert {k: tuple(v.shape) for k, v in converted.items()} == {k: tuple(v.shape) for k, v in state.items()}

    same_layout(convert_ldm_unet_checkpoint(checkpoint, unet.config), unet.state_dict())
    same_layout(convert_ldm_vae_checkpoint(checkpoint, vae.config), vae.state_dict())
    if model_type == "sd2":
        same_layout(convert_open_clip_checkpoint(encoders[0], checkpoint, "cond_stage_model.model."), text_states[0])
    else:
        prefix = "cond_stage_model.transformer." if model_type == "sd1" else "conditioner.embedders.0.transformer."
        same_layout(convert_ldm_clip_checkpoint({k: v for k, v in checkpoint.items() if k.startswith(prefix)}),
                    text_states[0])
    if model_type == "sdxl":
        same_layout(convert_open_clip_checkpoint(encoders[1], checkpoint, "conditioner.embedders.1.model."),
                    text_states[1])


def _text_state(model):
    state = model.state_dict()
    if hasattr(model, "text_model"):
        return state
    return {"text_model." + k: v for k, v in state.items()}


def test_shipped_configs_have_the_released_parameter_counts():
    counts = {"sd1": 859_520_964, "sd2": 865_910_724, "sdxl": 2_567_463_684}
    for model_type, count in counts.items():
        with torch.device("meta"):
            unet = UNet2DConditionModel.from_config(shipped_config(model_type, "unet"))
        assert sum(p.numel() for p in unet.parameters()) == count, model_type
    with torch.device("meta"):
        big_g = CLIPTextModelWithProjection(CLIPTextConfig(**shipped_config("sdxl", "text_encoder_2")))
    assert sum(p.numel() for p in big_g.parameters()) == 694_659_840


# ------------------------------------------------------------------ tokenizer


def test_tokenizer_matches_the_clip_vit_l_14_ids():
    tokenizer = clip_tokenizer()
    assert len(tokenizer) == 49408
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (49406, 49407, 49407)
    assert tokenizer("a photo of a cat").input_ids == [49406, 320, 1125, 539, 320, 2368, 49407]
    assert tokenizer("Hello, World!").input_ids == [49406, 3306, 267, 1002, 256, 49407]
    long = tokenizer(["cat " * 100], padding="max_length", max_length=77, truncation=True).input_ids[0]
    assert len(long) == 77 and long[0] == 49406 and long[-1] == 49407

    open_clip = clip_tokenizer(pad_token="!")
    padded = open_clip("a cat", padding="max_length", max_length=8).input_ids
    assert padded == [49406, 320, 2368, 49407, 0, 0, 0, 0]
    with pytest.raises(ValueError, match="not in the CLIP vocabulary"):
        clip_tokenizer(pad_token="<pad>")


def test_config_overrides_is_a_config_field(tmp_path, tandem_home):
    """model.config_overrides (JSON text) reaches the loader from a config file or --config-value; bad
    values are named by the field."""
    import json

    from modules.config import apply_overrides, validate
    from modules.config.train_config import ModelConfig, TrainConfig
    from modules.model import load_model

    bundle, configs = tiny_bundle("sd1", seed=6)
    state, _ = read_checkpoint(save_single_file(bundle, tmp_path / "model.safetensors", torch.float32))
    ckpt = tmp_path / "foreign.ckpt"
    torch.save({"state_dict": state}, ckpt)
    with pytest.raises(ValueError, match=r'model\.config_overrides giving them as JSON, e\.g\. \{"unet"'):
        load_model(ModelConfig(base_model=str(ckpt)))

    cfg = apply_overrides(TrainConfig(), [f"model.base_model={ckpt}",
                                          f"model.config_overrides={json.dumps(configs)}"])
    assert not [p for p in validate(cfg) if p.startswith("model.")]
    loaded = load_model(cfg.model)
    assert_same_state(loaded.unet, bundle.unet)
    assert_same_state(loaded.text_encoders[0], bundle.text_encoders[0])

    def problems(text, base="builtin:demo"):
        cfg = TrainConfig(model=ModelConfig(base_model=base, config_overrides=text))
        return [p for p in validate(cfg, check_paths=False) if p.startswith("model.config_overrides")]

    assert "not valid JSON" in problems('{"unet": ')[0]
    assert "unknown part(s) unte" in problems('{"unte": {}}', str(ckpt))[0]
    assert "must hold an object" in problems('{"unet": 3}', str(ckpt))[0]
    assert "single-file checkpoints only" in problems('{"unet": {"sample_size": 8}}')[0]
    assert problems('{"unet": {"sample_size": 8}}', str(ckpt)) == []


def test_a_pickled_ckpt_is_refused_in_one_sentence_of_its_own_without_warnings(tmp_path, recwarn):
    """PyTorch's refusal is paragraphs about its changed default; the user needs what was refused and what to do."""
    import os
    from modules.model.pickled import load_pickled_state
    torch.save({"state_dict": {"x": torch.zeros(1)}, "callback": types.SimpleNamespace()}, tmp_path / "pickled.ckpt")
    torch.save({"callback": types.SimpleNamespace()}, tmp_path / "legacy.ckpt", _use_new_zipfile_serialization=False)
    for name in ("pickled.ckpt", "legacy.ckpt"):
        with pytest.raises(ValueError) as error:
            load_pickled_state(tmp_path / name)
        text = str(error.value)
        assert "GLOBAL types.SimpleNamespace" in text and "could run code" in text, text
        assert "PyTorch 2.6" not in text and "\n" not in text and text.endswith("diffusers folder."), text
    (tmp_path / "random.ckpt").write_bytes(os.urandom(4096))
    with pytest.raises(ValueError) as error:
        load_pickled_state(tmp_path / "random.ckpt")
    assert "Weights only load failed" not in str(error.value) and "Is the file complete?" in str(error.value)
    assert not [w for w in recwarn.list if "torch" in str(w.filename)], [str(w.message) for w in recwarn.list]

"""Qwen-Image, Qwen-Image 2.1 and Z-Image on their built-in tiny models: what their diffusers pipelines compute, LoRA files
as diffusers and ComfyUI apply them, full saves (folder and single file), and models from the random builder.

Training through the real trainer: N processes x B == 1 x N*B and resume in tests/integration/test_family_training.py (every
family's), the text encoder loaded apart in tests/integration/test_qwen_zimage_training.py."""
from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file

from modules.config.train_config import ModelConfig, SamplePromptConfig, TrainingConfig
from modules.model import add_lora, load_model, save_lora
from modules.model import text_apart
from modules.model.families import original_layout as layout
from modules.model.saving import save_full_diffusers, save_full_single_file
from modules.util.batch_slice import BatchSlice
from tests import comfy_lora_rules

FAMILIES = ("qwen", "zimage", "qwen_image21")
CAPTIONS = ["a red circle on a blue background", "a white triangle"]
RANK, ALPHA = 4, 8.0
TARGETS = {"qwen": ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
                    "img_mlp.net.0.proj", "txt_mlp.net.2", "img_mod.1"],
           "zimage": ["to_q", "to_k", "to_v", "to_out.0", "feed_forward.w1", "feed_forward.w2", "feed_forward.w3"],
           "qwen_image21": ["to_q", "to_k", "to_v", "to_out.0", "img_mlp.gate_layer", "img_mlp.proj", "img_mlp.out",
                            "modulation.1"]}
"""Every kind of module LoRA may target: fused in the original layout (Z-Image's q/k/v, Qwen-Image 2.1's SwiGLU
gate and up projections) or not."""
KOHYA_IN_DIFFUSERS = {"qwen_image21": ["to_q", "to_k", "to_v", "to_out.0", "img_mlp.out"]}
"""What diffusers' kohya reader takes of a family whose fused modules it cannot name (it reads Qwen-Image 2.1's
`img_mlp_gate_up` as `img_mlp.gate.up`)."""

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def demo(name: str, **model):
    bundle = load_model(ModelConfig(base_model=f"builtin:demo-{name}", **model))
    for module in bundle.modules().values():
        module.eval()
    return bundle


def pipeline_of(name: str, folder=None):
    from modules.model.families import family

    pipeline = family(name).stock_pipeline(folder or family(name).build_demo())
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


def prediction(bundle, transformer, text=None):
    """The transformer's velocity for fixed latents, timesteps and captions, through the family's objective."""
    objective = bundle.family.objective(bundle, TrainingConfig())
    latents = torch.randn(2, bundle.family.cached_shapes()[0], 8, 8, generator=torch.Generator().manual_seed(3))
    draw = objective.draw(tuple(latents.shape), 5, 0, 0, BatchSlice(0, 2, 2), torch.device("cpu"))
    with torch.no_grad():
        text = bundle.encode_text(CAPTIONS) if text is None else text
        return objective.predict(transformer, objective.noisy(latents, draw), draw.timesteps, text)


def trained_lora(name: str, targets: list[str] | None = None):
    bundle = demo(name)
    params = add_lora(bundle, TrainingConfig(lora_rank=RANK, lora_alpha=ALPHA,
                                             lora_target_modules=targets or TARGETS[name]))
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in params:
            param.add_(torch.randn(param.shape, generator=generator) * 0.1)
    bundle.denoiser.eval()
    return bundle


# ------------------------------------------------------------------ what the pipelines compute

@pytest.mark.parametrize("name", FAMILIES)
def test_text_is_encoded_as_the_pipeline_encodes_it(tandem_home, name):
    bundle = demo(name)
    pipeline = pipeline_of(name)
    text = bundle.encode_text(CAPTIONS)
    rows = text_apart.masked_rows(text[text_apart.HIDDEN], text[text_apart.MASK])
    with torch.no_grad():
        if name == "qwen":
            embeds, mask = pipeline.encode_prompt(CAPTIONS, device="cpu", max_sequence_length=512)
            expected = text_apart.masked_rows(embeds, mask)
        elif name == "qwen_image21":
            embeds, mask, _ = pipeline.encode_prompt(CAPTIONS, device="cpu")
            expected = text_apart.masked_rows(embeds, mask)
            # The tokens it drops are those of the system turn as the real chat template writes it, not only as
            # the processor that stands in for Qwen3VLProcessor does.
            from modules.model.families.qwen_image21 import SYSTEM_TURN
            system = [{"role": "system", "content": [{"type": "text", "text": pipeline.sys_prompt}]}]
            assert pipeline.processor.tokenizer.apply_chat_template(system, tokenize=False) == SYSTEM_TURN
            assert pipeline._drop_idx == len(pipeline.processor.tokenizer(SYSTEM_TURN).input_ids)
        else:
            expected, _ = pipeline.encode_prompt(list(CAPTIONS), device="cpu", do_classifier_free_guidance=False)
    assert [r.shape for r in rows] == [e.shape for e in expected]
    for row, want in zip(rows, expected):
        torch.testing.assert_close(row, want, rtol=0, atol=1e-5)
    assert bundle.text_encoders == [], "the text encoder is not loaded with the model"


@pytest.mark.parametrize("name", FAMILIES)
def test_a_sampling_step_is_the_pipelines(tandem_home, name):
    """The pipeline's second Euler step equals x + (sigma' - sigma) x velocity with the family's objective: the
    time input, the sign of the output and (Qwen-Image) the packing are the pipeline's."""
    from modules.model.families.flux import unpack_latents

    bundle = demo(name)
    pipeline = pipeline_of(name)
    text = bundle.encode_text(CAPTIONS[:1])
    steps = []

    def keep(pipe, step, timestep, tensors):
        steps.append(tensors["latents"].clone())
        return tensors

    arguments = ({"prompt_embeds": text[text_apart.HIDDEN], "prompt_embeds_mask": text[text_apart.MASK].bool(),
                  "true_cfg_scale": 1.0} if name in ("qwen", "qwen_image21") else
                 {"prompt_embeds": text_apart.masked_rows(text[text_apart.HIDDEN], text[text_apart.MASK]),
                  "guidance_scale": 0.0})
    pipeline(height=64, width=64, num_inference_steps=3, generator=torch.Generator().manual_seed(0),
             output_type="latent", callback_on_step_end=keep, **arguments)
    as_latents = {"qwen": lambda x: unpack_latents(x, 8, 8), "zimage": lambda x: x,
                  "qwen_image21": lambda x: x.transpose(1, 2).reshape(1, -1, 4, 4)}[name]  # 64 px: 4x4 unpatched
    sigmas = pipeline.scheduler.sigmas
    objective = bundle.family.objective(bundle, TrainingConfig())
    with torch.no_grad():
        velocity = objective.predict(bundle.denoiser, as_latents(steps[0]).float(), sigmas[1:2].float(), text)
    torch.testing.assert_close(as_latents(steps[0]) + (sigmas[2] - sigmas[1]) * velocity, as_latents(steps[1]),
                               rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", FAMILIES)
def test_training_times_are_shifted_as_the_scheduler_shifts_them(tandem_home, name):
    """Qwen-Image: by image size (exp(mu), mu from the scheduler's base and max shift; 2.1 counts one token per
    latent pixel, Qwen-Image one per 2x2); Z-Image-Turbo: a fixed 3."""
    import math

    bundle = demo(name)
    config = dict(bundle.noise_scheduler.config)
    objective = bundle.family.objective(bundle, TrainingConfig(timestep_logit_mean=0.0, timestep_logit_std=1e-6))
    for size in (8, 64):  # 16 and 1024 image tokens (Qwen-Image 2.1: 64 and 4096)
        draw = objective.draw((1, 16, size, size), 0, 0, 0, BatchSlice(0, 1, 1), torch.device("cpu"))
        if name in ("qwen", "qwen_image21"):
            tokens = size * size // (4 if name == "qwen" else 1)
            mu = config["base_shift"] + (config["max_shift"] - config["base_shift"]) * (tokens - 256) / (
                config["max_image_seq_len"] - config["base_image_seq_len"])
            shift = math.exp(mu)
        else:
            shift = 3.0
        assert draw.timesteps.item() == pytest.approx(shift / (1 + shift), abs=1e-4)  # t = 0.5, shifted


# ------------------------------------------------------------------ LoRA files

@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("fmt", ["peft", "kohya"])
def test_lora_files_load_in_diffusers_with_the_same_output(tandem_home, tmp_path, name, fmt):
    bundle = trained_lora(name, KOHYA_IN_DIFFUSERS.get(name) if fmt == "kohya" else None)
    path = save_lora(bundle, tmp_path / "lora.safetensors", fmt, "fp32")
    expected = prediction(bundle, bundle.denoiser)
    pipeline = pipeline_of(name)
    base = prediction(bundle, pipeline.transformer)
    pipeline.load_lora_weights(str(path))
    torch.testing.assert_close(prediction(bundle, pipeline.transformer), expected, rtol=0, atol=1e-5)
    assert not torch.allclose(base, expected, atol=1e-4), "the LoRA changed nothing: the comparison is vacuous"


def _comfy_view(bundle):
    """(ComfyUI's weights of the model: `diffusion_model.` + the original names; diffusers name -> original
    name or row slice), from the family's layout table."""
    transformer = bundle.denoiser
    base = {k.replace(".base_layer", ""): v for k, v in transformer.state_dict().items() if ".lora_" not in k}
    entries = bundle.family.layout(transformer.config, base)
    comfy = {comfy_lora_rules.PREFIX + k: v for k, v in layout.to_original(base, entries).items()}
    table = {}
    for entry in entries:
        for original_suffix, suffix in entry.params:
            row = 0
            for part in entry.parts:
                name = layout.Entry.part_name(part, suffix)
                size = base[name].shape[0]
                target = entry.original_name(original_suffix)
                table[name] = (target, (0, row, size)) if len(entry.parts) > 1 else target
                row += size
    return base, entries, comfy, table


@pytest.mark.parametrize("name", FAMILIES)
def test_comfyui_applies_the_kohya_file_to_the_original_weights(tandem_home, tmp_path, name):
    """ComfyUI's key rules (tests/comfy_lora_rules.py) take every key of the kohya file, and patching its weights
    gives exactly the LoRA-merged model in the original layout; the peft file's keys are all taken too."""
    bundle = trained_lora(name)
    base, entries, comfy, table = _comfy_view(bundle)
    mapping = comfy_lora_rules.key_map(name, comfy, table)
    merged = dict(base)
    for module_name, module in bundle.denoiser.named_modules():
        if hasattr(module, "lora_A") and "default" in module.lora_A:
            delta = module.lora_B["default"].weight @ module.lora_A["default"].weight
            merged[f"{module_name}.weight"] = merged[f"{module_name}.weight"] + ALPHA / RANK * delta
    expected = {comfy_lora_rules.PREFIX + k: v for k, v in layout.to_original(merged, entries).items()}

    kohya = load_file(str(save_lora(bundle, tmp_path / "kohya.safetensors", "kohya", "fp32")))
    patched, left = comfy_lora_rules.apply(kohya, mapping, comfy)
    assert left == []
    for key in expected:
        torch.testing.assert_close(patched[key], expected[key], rtol=0, atol=2e-6, msg=key)
    prefix = "lora_unet_layers_0_attention_qkv" if name == "zimage" else "lora_unet_transformer_blocks_0_attn_to_q"
    assert f"{prefix}.lora_down.weight" in kohya

    peft = load_file(str(save_lora(bundle, tmp_path / "peft.safetensors", "peft", "fp32")))
    assert comfy_lora_rules.apply(peft, mapping, comfy)[1] == [], "ComfyUI leaves keys of the peft file unloaded"


def test_lora_metadata_names_the_family(tandem_home, tmp_path):
    from safetensors import safe_open

    for name, architecture, version in (("qwen", "qwen-image/lora", "qwen_image"), ("zimage", "z-image/lora", "z_image"),
                                        ("qwen_image21", "qwen-image-2.1/lora", "qwen_image21")):
        bundle = trained_lora(name)
        with safe_open(str(save_lora(bundle, tmp_path / f"{name}.safetensors", "kohya", "fp16")), "pt") as f:
            metadata = f.metadata()
        assert (metadata["modelspec.architecture"], metadata["ss_base_model_version"]) == (architecture, version)
        assert metadata["tandem_model_type"] == name


# ------------------------------------------------------------------ full saves

@pytest.mark.parametrize("name", FAMILIES)
def test_full_saves_load_back_in_tandem_and_diffusers(tandem_home, tmp_path, name):
    """A diffusers folder (the text encoder copied from the source, never loaded) and a single file in the
    original layout (read back with model.components_folder) hold the transformer's weights exactly."""
    bundle = demo(name)
    with torch.no_grad():
        for param in bundle.denoiser.parameters():
            param.add_(0.01)
    folder = save_full_diffusers(bundle, tmp_path / "folder", "fp32")
    single = save_full_single_file(bundle, tmp_path / "single.safetensors", "fp32")
    expected = bundle.denoiser.state_dict()
    for loaded in (load_model(ModelConfig(base_model=str(folder))),
                   load_model(ModelConfig(base_model=str(single), components_folder=str(folder)))):
        assert loaded.model_type == name
        state = loaded.denoiser.state_dict()
        assert state.keys() == expected.keys() and all(torch.equal(state[k], expected[k]) for k in expected)
        torch.testing.assert_close(loaded.encode_text(CAPTIONS)[text_apart.HIDDEN],
                                   bundle.encode_text(CAPTIONS)[text_apart.HIDDEN], rtol=0, atol=0)
    pipeline = pipeline_of(name, folder)
    assert all(torch.equal(pipeline.transformer.state_dict()[k], expected[k]) for k in expected)
    assert (folder / "text_encoder" / "model.safetensors").is_file()
    assert (folder / bundle.family.tokenizer_folder / "tokenizer_config.json").is_file()
    source = bundle.extra["text_side"].folder / "text_encoder"
    assert not os.path.samefile(folder / "text_encoder" / "config.json", source / "config.json"), \
        "a config of the copied text encoder is the source's own file: cleaning it would change the base model"
    if name == "zimage":
        from diffusers.loaders.single_file_utils import convert_z_image_transformer_checkpoint_to_diffusers

        original = load_file(str(single))
        assert "layers.0.attention.qkv.weight" in original and "x_embedder.weight" in original
        converted = convert_z_image_transformer_checkpoint_to_diffusers(dict(original))
        assert converted.keys() == expected.keys() and all(torch.equal(converted[k], expected[k]) for k in expected)
    elif name == "qwen_image21":  # diffusers' names, the SwiGLU gate and up projections fused (ComfyUI's release)
        from diffusers.loaders.single_file_utils import convert_qwen_image21_transformer_checkpoint_to_diffusers

        original = load_file(str(single))
        assert "transformer_blocks.0.img_mlp.gate_up.weight" in original
        converted = convert_qwen_image21_transformer_checkpoint_to_diffusers(dict(original))
        assert converted.keys() == expected.keys() and all(torch.equal(converted[k], expected[k]) for k in expected)
    else:
        assert load_file(str(single)).keys() == expected.keys()  # Qwen-Image's releases use diffusers' names


@pytest.mark.parametrize("name", FAMILIES)
def test_random_model_folders_load(tandem_home, tmp_path, name):
    """scripts/make_random_model.py's builder, at a tiny size (real size needs the GPU machine)."""
    from modules.model.families import family

    tiny = {"qwen": {"transformer": {"num_layers": 1, "attention_head_dim": 16, "num_attention_heads": 2,
                                     "joint_attention_dim": 32, "axes_dims_rope": [4, 6, 6]},
                     "vae": {"base_dim": 8, "num_res_blocks": 1},
                     "text_encoder": {"text_config": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                                                      "num_attention_heads": 2, "num_key_value_heads": 1,
                                                      "vocab_size": 1000, "rope_parameters": {
                                                          "rope_type": "default", "rope_theta": 1e6,
                                                          "mrope_section": [2, 3, 3]}},
                                      "vision_config": {"depth": 1, "hidden_size": 16, "intermediate_size": 32,
                                                        "num_heads": 2, "out_hidden_size": 32,
                                                        "fullatt_block_indexes": [0]}}},
            "zimage": {"transformer": {"dim": 64, "n_layers": 1, "n_refiner_layers": 1, "n_heads": 4, "n_kv_heads": 4,
                                       "cap_feat_dim": 32, "axes_dims": [4, 6, 6], "axes_lens": [1024, 64, 64]},
                       "vae": {"block_out_channels": [8, 8, 8, 8], "norm_num_groups": 4},
                       "text_encoder": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                                        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
                                        "vocab_size": 1000, "bos_token_id": 0, "eos_token_id": 0,
                                        "pad_token_id": 0}},
            "qwen_image21": {"transformer": {"num_layers": 1, "attention_head_dim": 16, "num_attention_heads": 2,
                                             "context_in_dim": 32, "axes_dims_rope": [4, 6, 6]},
                             "vae": {"base_dim": 8, "decoder_base_dim": 8, "num_res_blocks": 1},
                             "text_encoder": {"text_config": {"hidden_size": 32, "intermediate_size": 64,
                                                              "num_hidden_layers": 1, "num_attention_heads": 2,
                                                              "num_key_value_heads": 1, "head_dim": 16,
                                                              "vocab_size": 1000, "rope_parameters": {
                                                                  "rope_type": "default", "rope_theta": 5e6,
                                                                  "mrope_section": [2, 3, 3], "mrope_interleaved": True}},
                                              "vision_config": {"depth": 1, "hidden_size": 16, "intermediate_size": 32,
                                                                "num_heads": 2, "out_hidden_size": 32,
                                                                "deepstack_visual_indexes": [0]}}}}[name]
    folder = family(name).write_random_model(tmp_path / "random", torch.float32, configs=tiny)
    bundle = load_model(ModelConfig(base_model=str(folder)))
    assert bundle.model_type == name
    text = bundle.encode_text(CAPTIONS)
    assert text[text_apart.HIDDEN].shape[-1] == 32 and torch.isfinite(text[text_apart.HIDDEN]).all()


def test_sample_prompts_come_from_the_cache(tandem_home, tmp_path):
    """A sampling reads its prompts' embeddings from the text cache (no encoder), and renders."""
    from modules.model.sampling import render_samples

    bundle = demo("qwen")
    side = bundle.extra["text_side"]
    prompt = SamplePromptConfig(prompt="a red circle", seed=1)
    entries = {}
    for text in ("a red circle", " "):
        path = tmp_path / f"{len(entries)}.safetensors"
        encoded = side.encode([text])
        from safetensors.torch import save_file
        save_file({k: v[0].contiguous() for k, v in encoded.items()}, str(path))
        entries[text] = path
    side.release()
    side.cached.update(entries)
    before = text_apart.LOADS
    images = render_samples(bundle, [prompt], 64, inference_steps=2, guidance_scale=4.0)
    assert images[0].size == (64, 64) and text_apart.LOADS == before and side.encoder is None


def test_the_text_encoder_benchmark_runs_the_trainers_placement(tandem_home, capsys):
    """scripts/benchmark_text_encoder.py on the tiny encoder, on the CPU (its GPU numbers come from
    scripts/gpu/qwen_zimage.sh text): one JSON line with the placement and its timings."""
    import json

    from modules.benchmark.text_placement import main

    assert main(["--family", "zimage", "--tiny", "--device", "cpu", "--placement", "offload", "--texts", "8"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (result["placement"], result["texts"], result["encoded_by_rank0"]) == ("offload", 8, 8)
    assert result["encode_s"] > 0 and result["texts_per_s"] > 0
    # The random build is timed apart from the placement (the tiny encoder's can take under a millisecond).
    assert all(isinstance(result[k], float) and result[k] >= 0 for k in ("build_s", "place_s")), result


def test_auto_placement_puts_the_encoder_where_it_fits(monkeypatch):
    """`model.text_encoder_placement` auto: whole on each GPU when its weights and 4 GiB fit the smallest free
    memory of all GPUs, else sharded over them when a share does, else offloaded; CPU runs encode on the CPU."""
    from types import SimpleNamespace

    from modules.trainer import text_encoding
    from modules.util import dist_utils as du

    side = SimpleNamespace(parameter_bytes=lambda: 15 * 2 ** 30)
    cuda = torch.device("cuda", 0)
    for free_gib, world, expected in ((80, 1, "gpu"), (18, 1, "offload"), (18, 4, "sharded"), (5, 4, "offload")):
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device, free=free_gib: (free * 2 ** 30, 80 * 2 ** 30))
        monkeypatch.setattr(du, "world_size", lambda world=world: world)
        assert text_encoding.choose_placement("auto", side, cuda) == expected, (free_gib, world)
    assert text_encoding.choose_placement("gpu", side, cuda) == "gpu"
    assert text_encoding.choose_placement("auto", side, torch.device("cpu")) == "cpu"
    with pytest.raises(ValueError, match="model.text_encoder_placement is 'disk'"):
        text_encoding.choose_placement("disk", side, cuda)


@pytest.mark.parametrize("name", ["qwen", "zimage"])
def test_a_padded_caption_predicts_what_it_predicts_alone(tandem_home, name):
    """Captions of different lengths share a batch padded to the longest, with their mask (padding from
    the cache's own encoding batches on top): each sample's prediction is the one it gets alone, unpadded.
    (Not Qwen-Image 2.1's: its image sits after the text slots, padding included, on the rotary frame axis - as in
    its pipeline's batches of prompts; a batch of one, or of captions of one length, is exact.)"""
    from modules.data.dataset import pad_and_stack

    bundle = demo(name)
    objective = bundle.family.objective(bundle, TrainingConfig())
    long_caption = "a red circle on a blue background with a small green square in the corner"
    texts = [bundle.encode_text([caption]) for caption in ("a star", long_caption)]
    extra = {k: torch.cat([v, torch.zeros_like(v[:, :3])], dim=1) for k, v in texts[0].items()}  # an entry's padding
    batch = {k: pad_and_stack([extra[k][0], texts[1][k][0]]) for k in texts[0]}
    assert text_apart.trimmed(batch)[1] is not None and text_apart.trimmed(texts[1])[1] is None
    latents = torch.randn(2, 16, 8, 8, generator=torch.Generator().manual_seed(0))
    timesteps = torch.tensor([0.3, 0.7])
    with torch.no_grad():
        together = objective.predict(bundle.denoiser, latents, timesteps, batch)
        for i, text in enumerate(texts):
            alone = objective.predict(bundle.denoiser, latents[i:i + 1], timesteps[i:i + 1], text)
            torch.testing.assert_close(together[i:i + 1], alone, rtol=0, atol=1e-5)


@pytest.mark.slow  # building Qwen3-VL 8B, even on `meta`, takes tens of seconds on a busy CPU
def test_the_qwen_image21_configs_have_the_released_sizes():
    """The shipped configs built on `meta`: the transformer's 7.12 B parameters (the release's 14.5 GB of bf16
    shards) and Qwen3-VL 8B's 8.77 B (its language model 7.57 B: what encoding keeps)."""
    import transformers
    from diffusers import QwenImage21Transformer2DModel

    from modules.model.families.flow_base import shipped

    with torch.device("meta"):
        transformer = QwenImage21Transformer2DModel.from_config(shipped("qwen_image21", "transformer"))
        config = {k: v for k, v in shipped("qwen_image21", "text_encoder").items() if not k.startswith("_")}
        cls = getattr(transformers, config["architectures"][0])
        encoder = cls(cls.config_class(**config))
    assert sum(p.numel() for p in transformer.parameters()) == 7_115_124_736
    assert sum(p.numel() for p in encoder.parameters()) == 8_767_123_696
    kept = sum(p.numel() for name, p in encoder.named_parameters() if ".visual." not in name and "lm_head" not in name)
    assert kept == 7_568_405_504


def test_the_qwen_image21_demo_vae_is_a_thumbnail_codec(tandem_home, tmp_path):
    """64 px demo images encode to their 4x4 thumbnails (every copy in the 64 channels, normalised to about unit
    spread, alpha read as opaque) and decode back to them in 16 px blocks, RGB (the alpha plane left out)."""
    from tests.integration.test_dit_demo_quality import demo_codec

    pixels, latents, decoded = demo_codec("qwen_image21", tmp_path)
    assert latents.shape == (16, 64, 4, 4) and decoded.shape == (16, 3, 64, 64)
    colours = latents[:, :63].unflatten(1, (21, 3))
    assert (colours - colours[:, :1]).abs().max() < 0.05  # the copies agree up to the posterior noise
    assert 0.7 < colours.std().item() < 1.3 and abs(colours.mean().item()) < 0.5
    thumbnail = torch.nn.functional.avg_pool2d(pixels, 16).repeat_interleave(16, 2).repeat_interleave(16, 3)
    assert (decoded - thumbnail).abs().max().item() < 4 / 127.5


def test_a_foreign_qwen_image21_single_file_loads_by_its_weights(tandem_home, tmp_path):
    """A file as ComfyUI holds the release (`model.diffusion_model.` + diffusers' names, `img_mlp.gate_up` fused, no
    Tandem metadata): recognised by its `txt_in.text_norm`, sized from its weights, loaded exactly."""
    from safetensors.torch import save_file

    from modules.model.families import detect_checkpoint

    bundle = demo("qwen_image21")
    single = save_full_single_file(bundle, tmp_path / "single.safetensors", "fp32")
    foreign = tmp_path / "foreign.safetensors"
    save_file({"model.diffusion_model." + k: v for k, v in load_file(str(single)).items()}, str(foreign))
    assert detect_checkpoint(load_file(str(foreign)).keys()) == "qwen_image21"
    loaded = load_model(ModelConfig(base_model=str(foreign), components_folder=str(bundle.family.build_demo())))
    config = {k: loaded.denoiser.config[k] for k in ("num_layers", "num_attention_heads", "attention_head_dim",
                                                     "in_channels", "out_channels", "context_in_dim", "mlp_ratio")}
    assert config == {k: bundle.denoiser.config[k] for k in config}
    expected = bundle.denoiser.state_dict()
    assert all(torch.equal(loaded.denoiser.state_dict()[k], v) for k, v in expected.items())

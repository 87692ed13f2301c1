"""Lumina 2 on its built-in tiny model: what `Lumina2Pipeline` computes (text with its system prompt, the time
input running the other way, the negated output, guided samples), the original single-file layout against
diffusers' converter, detection beside Z-Image, LoRA files in ComfyUI, and models from the random builder.

Training through the real trainer (LoRA and full fine-tune, N processes x B == 1 x N*B, the peft file in diffusers,
saves loaded back) is in tests/integration/test_family_training.py, as for every registered family; ComfyUI's and diffusers'
readings of each file kind in tests/integration/test_lora_clients.py."""
from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file

from modules.families.registry import family_of_keys
from modules.config.train_config import ModelConfig, SamplePromptConfig, TrainingConfig
from modules.model import add_lora, load_model, save_lora
from modules.model import text_apart
from modules.model.families import original_layout as layout
from modules.util.batch_slice import BatchSlice
from tests import comfy_lora_rules as comfy

CAPTIONS = ["a red circle on a blue background", "a white triangle"]
RANK, ALPHA = 4, 8.0

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def demo():
    bundle = load_model(ModelConfig(base_model="builtin:demo-lumina2"))
    for module in bundle.modules().values():
        module.eval()
    return bundle


def pipeline_of(folder=None):
    from diffusers import Lumina2Pipeline

    from modules.model.families import family

    pipeline = Lumina2Pipeline.from_pretrained(folder or family("lumina2").build_demo(), local_files_only=True)
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


# ------------------------------------------------------------------ torch-free: detection, the layout table


def test_single_files_of_lumina2_and_z_image_are_told_apart():
    """Both carry the release's `cap_embedder.*`; Z-Image's own `cap_pad_token` decides for it (it is asked first)."""
    lumina = ["cap_embedder.0.weight", "layers.0.attention.qkv.weight", "t_embedder.mlp.0.weight"]
    zimage = [*lumina, "cap_pad_token", "x_pad_token"]
    assert family_of_keys(lumina) == "lumina2"
    assert family_of_keys(["model.diffusion_model." + k for k in lumina]) == "lumina2"
    assert family_of_keys(zimage) == "zimage"
    assert family_of_keys(["model.diffusion_model." + k for k in zimage]) == "zimage"


@pytest.mark.slow
def test_the_single_file_layout_is_the_reverse_of_diffusers_converter(tandem_home):
    """Tandem's original names, converted by diffusers' `convert_lumina2_to_diffusers`, are the model's own. The
    converter splits `attention.qkv` at the released model's widths (2304 + 768 + 768 rows), so the fused weights
    are checked by Tandem's split, every other tensor by the converter."""
    from diffusers.loaders.single_file_utils import convert_lumina2_to_diffusers

    bundle = demo()
    state = bundle.denoiser.state_dict()
    entries = bundle.family.layout(bundle.denoiser.config, state)
    original = layout.to_original(state, entries)
    assert {"layers.0.attention.qkv.weight", "context_refiner.0.attention_norm1.weight", "noise_refiner.0.adaLN_modulation.1.weight",
            "final_layer.linear.weight", "t_embedder.mlp.2.bias", "cap_embedder.1.weight"} <= set(original)
    released = {k: torch.zeros(3840, 1) if k.endswith("attention.qkv.weight") else v for k, v in original.items()}
    converted = convert_lumina2_to_diffusers(dict(released))
    assert converted.keys() == state.keys()
    assert all(torch.equal(converted[k], state[k]) for k in state if ".attn.to_" not in k or ".to_out" in k)
    shapes = {k: v.shape for k, v in state.items()}
    back = layout.from_original(original, entries, shapes)
    assert all(torch.equal(back[k], state[k]) for k in state)
    qkv = original["layers.0.attention.qkv.weight"]
    assert qkv.shape[0] == 64 + 2 * 32, "k and v of the grouped heads are narrower than q"


# ------------------------------------------------------------------ what the pipeline computes


@pytest.mark.slow
def test_text_is_encoded_as_the_pipeline_encodes_it(tandem_home):
    """Each caption after the system prompt; a negative prompt without it. The pipeline pads to 256 tokens, the
    cache keeps each text's own."""
    from modules.model.families.lumina2 import Lumina2Family

    bundle = demo()
    pipeline = pipeline_of()
    text = bundle.encode_text(CAPTIONS)
    rows = text_apart.masked_rows(text[text_apart.HIDDEN], text[text_apart.MASK])
    with torch.no_grad():
        embeds, mask, negative, negative_mask = pipeline.encode_prompt(list(CAPTIONS), device="cpu",
                                                                       do_classifier_free_guidance=True)
    expected = text_apart.masked_rows(embeds, mask)
    assert [r.shape for r in rows] == [e.shape for e in expected] and rows[0].shape[0] > 30  # the system prompt too
    for row, want in zip(rows, expected):
        torch.testing.assert_close(row, want, rtol=0, atol=1e-5)
    unguided = bundle.family.negative_prompt(SamplePromptConfig(prompt="x"))
    assert isinstance(bundle.family, Lumina2Family)
    empty = bundle.encode_text([unguided])
    (want,) = text_apart.masked_rows(negative[:1], negative_mask[:1])
    torch.testing.assert_close(text_apart.masked_rows(empty[text_apart.HIDDEN], empty[text_apart.MASK])[0], want,
                               rtol=0, atol=1e-5)
    assert want.shape[0] == 1, "the empty negative prompt is its <bos> alone"


@pytest.mark.slow
def test_a_sampling_step_is_the_pipelines(tandem_home):
    """The pipeline's second Euler step equals x + (sigma' - sigma) x velocity with the family's objective: its time
    input (1 - sigma), the sign of its output and the caption tokens (the pipeline's own encoding, padded to 256)."""
    bundle = demo()
    pipeline = pipeline_of()
    steps = []

    def keep(pipe, step, timestep, tensors):
        steps.append(tensors["latents"].clone())
        return tensors

    pipeline(prompt=CAPTIONS[:1], height=64, width=64, num_inference_steps=3, guidance_scale=1.0,
             generator=torch.Generator().manual_seed(0), output_type="latent", callback_on_step_end=keep)
    sigmas = pipeline.scheduler.sigmas
    objective = bundle.family.objective(bundle, TrainingConfig())
    with torch.no_grad():
        velocity = objective.predict(bundle.denoiser, steps[0], sigmas[1:2], bundle.encode_text(CAPTIONS[:1]))
    torch.testing.assert_close(steps[0] + (sigmas[2] - sigmas[1]) * velocity, steps[1], rtol=0, atol=1e-5)


@pytest.mark.slow
def test_guided_samples_are_the_pipelines_own(tandem_home):
    """Tandem's pipeline arguments (cached embeddings, the negative prompt "" without the system prompt, both padded
    to one length) render what the pipeline renders from the prompt itself at guidance 4."""
    from modules.config.train_config import SamplingConfig

    bundle = demo()
    prompt = SamplePromptConfig(prompt=CAPTIONS[0], seed=1)
    sampling = SamplingConfig(prompts=[prompt], guidance_scale=4.0)
    assert bundle.family.sample_texts(sampling) == [CAPTIONS[0], "\x00"]
    common = {"height": 64, "width": 64, "num_inference_steps": 3, "output_type": "latent"}
    ours = bundle.family.pipeline(bundle)(generator=torch.Generator().manual_seed(0), **common,
                                          **bundle.family.pipeline_arguments(bundle, prompt, 4.0)).images
    theirs = pipeline_of()(prompt=CAPTIONS[0], guidance_scale=4.0, generator=torch.Generator().manual_seed(0),
                           **common).images
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


@pytest.mark.slow
def test_training_times_are_shifted_as_the_scheduler_shifts_them(tandem_home):
    """Lumina-Image 2.0's scheduler: a fixed 6. A scheduler that shifts by size gets the pipeline's size: the latent
    channels (`latents.shape[1]`), whatever the image."""
    from modules.model.families.lumina2 import Lumina2Objective

    bundle = demo()
    training = TrainingConfig(timestep_logit_mean=0.0, timestep_logit_std=1e-6)
    objective = bundle.family.objective(bundle, training)
    for size in (8, 64):
        draw = objective.draw((1, 16, size, size), 0, 0, 0, BatchSlice(0, 1, 1), torch.device("cpu"))
        assert draw.timesteps.item() == pytest.approx(6 / 7, abs=1e-4)  # t = 0.5, shifted by 6
    bundle.noise_scheduler.register_to_config(use_dynamic_shifting=True)
    dynamic = Lumina2Objective(bundle, training)
    mu = 0.5 + (1.15 - 0.5) * (16 - 256) / (4096 - 256)
    for size in (8, 64):
        draw = dynamic.draw((1, 16, size, size), 0, 0, 0, BatchSlice(0, 1, 1), torch.device("cpu"))
        assert draw.timesteps.item() == pytest.approx(math.exp(mu) / (1 + math.exp(mu)), abs=1e-4)


# ------------------------------------------------------------------ LoRA variants in ComfyUI


@pytest.mark.slow
@pytest.mark.parametrize("lora_type", ["dora", "loha", "lokr"])
def test_comfyui_applies_lycoris_adapters_but_those_of_q_k_v(tandem_home, tmp_path, lora_type):
    """Adapters of the layers the release keeps whole are applied exactly under their original names
    (`lora_unet_layers_0_attention_out`); those of q, k and v, fused there in one weight of unequal parts, not at
    all - what `lora_clients` says."""
    from modules.families.lora_clients import WRONG, comfyui_reading
    from tests.integration.test_lora_clients import comfy_verdict

    bundle = demo()
    add_lora(bundle, TrainingConfig(lora_type=lora_type, lora_rank=RANK, lora_alpha=ALPHA, precision="fp32",
                                    lora_target_modules=["to_q", "to_out.0", "feed_forward.linear_1"]))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for key, param in bundle.denoiser.named_parameters():
            if param.requires_grad:
                noise = torch.randn(param.shape, generator=generator) * 0.2
                param.copy_(param.abs() + noise.abs() if "magnitude" in key else noise)
    bundle.denoiser.eval()
    model = comfy.comfy_model(bundle)
    trained = comfy.trained_weights(bundle)
    kohya = load_file(str(save_lora(bundle, tmp_path / "kohya.safetensors", "kohya", "fp32")))
    assert any(k.startswith("lora_unet_layers_0_attention_out.") for k in kohya)
    assert comfy_verdict(model, model.place(trained), kohya)[0] == comfyui_reading("lumina2", lora_type, "kohya",
                                                                                  ALPHA, RANK).verdict == WRONG
    whole = {key: value for key, value in trained.items() if ".attn.to_q." not in key[1]}
    patched, left = model.apply(kohya)
    assert left and all("_attn_to_q." in k for k in left), left[:3]
    expected = model.place(whole)
    for key in expected:
        torch.testing.assert_close(patched[key], expected[key], rtol=1e-4, atol=2e-5, msg=key)


# ------------------------------------------------------------------ the random builder


@pytest.mark.slow
def test_random_model_folders_load(tandem_home, tmp_path):
    """scripts/make_random_model.py's builder, at a tiny size (real size needs the GPU machine): a Gemma 2 text
    encoder with the demo's Gemma tokenizer."""
    from modules.model.families import family

    tiny = {"transformer": {"hidden_size": 64, "num_layers": 1, "num_refiner_layers": 1, "num_attention_heads": 4,
                            "num_kv_heads": 2, "multiple_of": 16, "cap_feat_dim": 32, "axes_dim_rope": [4, 6, 6]},
            "vae": {"block_out_channels": [8, 8, 8, 8], "norm_num_groups": 4},
            "text_encoder": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                             "num_key_value_heads": 1, "head_dim": 16, "query_pre_attn_scalar": 16, "vocab_size": 1000}}
    folder = family("lumina2").write_random_model(tmp_path / "random", torch.float32, configs=tiny)
    bundle = load_model(ModelConfig(base_model=str(folder)))
    assert bundle.model_type == "lumina2" and type(bundle.extra["text_side"].tokenizer).__name__ == "GemmaTokenizer"
    text = bundle.encode_text(CAPTIONS)
    assert text[text_apart.HIDDEN].shape[-1] == 32 and torch.isfinite(text[text_apart.HIDDEN]).all()

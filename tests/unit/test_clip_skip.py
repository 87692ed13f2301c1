"""Clip skip: SD 1.x/2.x and SDXL condition on an earlier CLIP layer, as kohya and the diffusers pipelines
do, in training and in samples; the families whose conditioning is not CLIP's alone refuse it."""
from __future__ import annotations

import pytest
import torch

from modules.config import TrainConfig, validate
from modules.config.train_config import ModelConfig, TrainingConfig
from modules.model import load_model
from modules.model.bundle import ModelBundle

pytestmark = pytest.mark.usefixtures("one_torch_thread")
CAPTIONS = ["a red circle", "a blue square on a white background"]


@pytest.fixture(scope="module")
def demo(tandem_home) -> ModelBundle:
    return load_model(ModelConfig())


@pytest.fixture(scope="module")
def skipping(tandem_home) -> ModelBundle:
    return load_model(ModelConfig(), training_cfg=TrainingConfig(clip_skip=2))


def _inner(encoder):
    """CLIP's layers (transformers 5 dropped the `text_model` wrapper that version 4 has)."""
    return getattr(encoder, "text_model", encoder)


def _sd_pipeline(bundle):
    from diffusers import StableDiffusionPipeline
    return StableDiffusionPipeline(vae=bundle.vae, text_encoder=bundle.text_encoders[0],
                                   tokenizer=bundle.tokenizers[0], unet=bundle.unet, scheduler=bundle.noise_scheduler,
                                   safety_checker=None, feature_extractor=None, requires_safety_checker=False)


def test_sd_clip_skip_conditions_on_the_earlier_layer_and_samples_follow(demo, skipping):
    from modules.config.train_config import SamplePromptConfig
    from modules.model.sampling import render_samples

    encoder = skipping.text_encoders[0]
    with torch.no_grad():
        plain = demo.encode_text(CAPTIONS)["encoder_hidden_states"]
        skipped = skipping.encode_text(CAPTIONS)["encoder_hidden_states"]
        # kohya's and diffusers' clip skip: the penultimate hidden state through CLIP's final norm.
        hidden = encoder(skipping.tokenize(CAPTIONS)[0], output_hidden_states=True).hidden_states
        reference = _inner(encoder).final_layer_norm(hidden[-2])
    assert skipped.shape == plain.shape and not torch.allclose(skipped, plain)
    assert torch.equal(skipped, reference)
    # Samples are conditioned on the same layer, the negative prompt too.
    prompt = SamplePromptConfig(prompt=CAPTIONS[0], negative_prompt="blurry", seed=3, width=64, height=64)
    arguments = skipping.family.pipeline_arguments(skipping, prompt, 7.0)
    assert torch.equal(arguments["prompt_embeds"], skipped[:1])
    with torch.no_grad():
        assert torch.equal(arguments["negative_prompt_embeds"], skipping.encode_text(["blurry"])["encoder_hidden_states"])
    assert "prompt_embeds" not in demo.family.pipeline_arguments(demo, prompt, 7.0)
    (with_skip,), (without,) = (render_samples(b, [prompt], 64, inference_steps=2, guidance_scale=7.0)
                                for b in (skipping, demo))
    assert with_skip.size == (64, 64) and with_skip.tobytes() != without.tobytes()
    # Another layer gives other embeddings: the text cache must not mix them up.
    assert skipping.fingerprint() != demo.fingerprint()
    assert load_model(ModelConfig(), training_cfg=TrainingConfig(clip_skip=1)).fingerprint() != demo.fingerprint()
    # The layers after the one read never reach the conditioning: frozen for DDP when the encoder trains.
    layers = _inner(skipping.text_encoders[0]).encoder.layers
    assert skipping.family.unused_text_encoder_modules(skipping) == [layers[-1]]
    assert demo.family.unused_text_encoder_modules(demo) == []


def test_sdxl_clip_skip_reads_both_encoders_one_layer_earlier(demo):
    from diffusers import StableDiffusionXLPipeline
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    tokenizer = demo.tokenizers[0]
    torch.manual_seed(0)
    common = dict(vocab_size=len(tokenizer), intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
                  max_position_embeddings=77, eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    encoder_1 = CLIPTextModel(CLIPTextConfig(hidden_size=32, **common)).eval()
    encoder_2 = CLIPTextModelWithProjection(CLIPTextConfig(hidden_size=48, projection_dim=40, **common)).eval()
    sdxl = ModelBundle("sdxl", demo.unet, demo.vae, [encoder_1, encoder_2], [tokenizer, tokenizer],
                       demo.noise_scheduler, "epsilon", "test")
    with torch.no_grad():
        own = sdxl.encode_text(CAPTIONS)
        sdxl.extra["clip_skip"] = 2  # SDXL's own choice: the same as 0
        assert torch.equal(sdxl.encode_text(CAPTIONS)["encoder_hidden_states"], own["encoder_hidden_states"])
        sdxl.extra["clip_skip"] = sdxl.family.checked_clip_skip(3)
        text = sdxl.encode_text(CAPTIONS)
        pipeline = StableDiffusionXLPipeline(
            vae=demo.vae, text_encoder=encoder_1, text_encoder_2=encoder_2, tokenizer=tokenizer,
            tokenizer_2=tokenizer, unet=demo.unet, scheduler=demo.noise_scheduler, add_watermarker=False)
        skip = sdxl.family.diffusers_clip_skip(3)
        embeds, _, pooled, _ = pipeline.encode_prompt(CAPTIONS, device="cpu", do_classifier_free_guidance=False,
                                                      clip_skip=skip)
    assert skip == 1 and not torch.equal(text["encoder_hidden_states"], own["encoder_hidden_states"])
    assert torch.equal(text["encoder_hidden_states"], embeds) and torch.equal(text["pooled"], pooled)
    inner = _inner(encoder_1)
    assert sdxl.family.unused_text_encoder_modules(sdxl) == [*inner.encoder.layers[-2:], inner.final_layer_norm]
    with pytest.raises(ValueError, match="training.clip_skip: 1 would take the last CLIP layer"):
        sdxl.family.checked_clip_skip(1)


@pytest.mark.parametrize("base_model", ["builtin:demo-sd3", "builtin:demo-flux"])
def test_families_without_clip_only_conditioning_refuse_clip_skip(base_model, tandem_home):
    cfg = TrainConfig()
    cfg.model.base_model, cfg.training.clip_skip = base_model, 2
    problems = validate(cfg, check_paths=False)
    assert [p for p in problems if p.startswith("training.clip_skip: 2 does not apply to")], problems
    cfg.training.clip_skip = 0
    assert validate(cfg, check_paths=False) == []
    # A family detected only at load time refuses it there.
    with pytest.raises(ValueError, match="training.clip_skip: 2 does not apply"):
        load_model(ModelConfig(base_model=base_model), training_cfg=TrainingConfig(clip_skip=2))


def test_sdxl_clip_skip_below_two_is_refused_by_the_config_check():
    cfg = TrainConfig()
    cfg.model.model_type, cfg.model.base_model, cfg.training.clip_skip = "sdxl", "some/sdxl", 1
    assert any(p.startswith("training.clip_skip: 1 would take the last CLIP layer")
               for p in validate(cfg, check_paths=False))
    cfg.training.clip_skip = 2
    assert not any(p.startswith("training.clip_skip") for p in validate(cfg, check_paths=False))
    cfg.model.model_type, cfg.model.base_model, cfg.training.clip_skip = "auto", "builtin:demo", 2
    assert validate(cfg, check_paths=False) == []


def test_the_new_recipe_fields_are_greyed_out_when_they_do_nothing():
    """The window disables a field whose value is ignored, and its tooltip says what would make it count."""
    from ui.applicability import unused_fields

    cfg = TrainConfig()
    unused = unused_fields(cfg)
    for path in ("training.lr_cycles", "training.lr_power", "training.lr_decay_fraction", "training.lokr_factor",
                 "data.tag_separator"):
        assert path in unused, path
    assert "cosine with restarts" in unused["training.lr_cycles"]
    cfg.training.lr_scheduler, cfg.training.lora_type, cfg.data.caption_prefix = "cosine_with_restarts", "lokr", "ohwx"
    unused = unused_fields(cfg)
    assert not {"training.lr_cycles", "training.lokr_factor", "data.tag_separator"} & set(unused)
    assert "training.lr_power" in unused
    cfg.data.aspect_bucketing = False
    assert "data.min_bucket_size" in unused_fields(cfg) and "data.max_bucket_size" in unused_fields(cfg)
    cfg.training.method = "full"
    assert {"training.lora_type", "training.lora_init", "training.lokr_factor"} <= set(unused_fields(cfg))

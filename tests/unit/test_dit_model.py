"""SD3 and Flux behind the family interface (CPU, the built-in tiny models): built offline, conditioned and
trained exactly as their diffusers pipelines condition and sample, saved in layouts other tools load."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from modules.util.batch_slice import BatchSlice
from modules.config.train_config import ModelConfig, SamplePromptConfig, TrainingConfig
from modules.model import load_model, render_samples, save_full_diffusers, save_full_single_file
from modules.model.families import detect_checkpoint, detect_folder, family
from modules.model.families.dit_demo import ensure_dit_demo
from modules.model.families.flux import flux_entries, image_ids, pack_latents, unpack_latents
from modules.model.families.sd3 import sd3_entries
from modules.model.families import original_layout as layout
from modules.model.objective import NoiseDraw, draw_flow_noise, flow_shift, shift_times

FAMILIES = ("sd3", "flux")
CAPTIONS = ["a red circle on a blue background", "Zebra! naïve 🙂"]
CPU = torch.device("cpu")

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def demos(tandem_home) -> dict:
    return {name: load_model(ModelConfig(base_model=f"builtin:demo-{name}", t5_max_length=24)) for name in FAMILIES}


def _pipeline_class(name: str):
    from diffusers import FluxPipeline, StableDiffusion3Pipeline

    return {"sd3": StableDiffusion3Pipeline, "flux": FluxPipeline}[name]


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# ------------------------------------------------------------------ the built-in models

@pytest.mark.parametrize("name", FAMILIES)
def test_demo_builds_identically_and_loads_as_its_family(tmp_path, name):
    first, second = _files(ensure_dit_demo(name, tmp_path / "a")), _files(ensure_dit_demo(name, tmp_path / "b"))
    assert first == second
    assert "transformer/diffusion_pytorch_model.safetensors" in first and "tokenizer_2/tokenizer.json" in first
    assert detect_folder(tmp_path / "a")[0] == name
    pipeline = _pipeline_class(name).from_pretrained(tmp_path / "a", local_files_only=True)
    assert pipeline.vae.config.latent_channels == 16 and pipeline.vae.config.shift_factor


def test_demo_bundles(demos):
    for name, bundle in demos.items():
        assert (bundle.model_type, bundle.prediction_type, bundle.denoiser_name) == (name, "flow_matching", "transformer")
        assert set(bundle.modules()) == {"transformer", "vae", *(f"text_encoder{s}" for s in (
            ("", "_2", "_3") if name == "sd3" else ("", "_2")))}
        assert bundle.text_lengths()[-1] == 24
        assert type(bundle.text_encoders[-1]).__name__ == "T5EncoderModel"
        assert bundle.trainable_text_encoders() == bundle.text_encoders[:-1], "T5 never trains"
        t5_ids = bundle.tokenize(CAPTIONS)[-1]
        assert t5_ids.shape == (2, 24) and (t5_ids[:, -1] == 0).all(), "T5 pads to the length with <pad>"


def test_default_t5_lengths_follow_the_pipelines(tandem_home):
    assert load_model(ModelConfig(base_model="builtin:demo-sd3")).text_lengths() == [77, 77, 256]
    assert load_model(ModelConfig(base_model="builtin:demo-flux")).text_lengths() == [77, 512]  # dev


# ------------------------------------------------------------------ conditioning = the pipeline's

@pytest.mark.parametrize("name", FAMILIES)
def test_text_encoding_equals_the_pipelines(demos, name):
    bundle = demos[name]
    pipeline = bundle.family.pipeline(bundle)
    with torch.no_grad():
        text = bundle.encode_text(CAPTIONS)
        if name == "sd3":
            embeds, _, pooled, _ = pipeline.encode_prompt(CAPTIONS, CAPTIONS, CAPTIONS, device=CPU,
                                                          do_classifier_free_guidance=False, max_sequence_length=24)
            assert text["encoder_hidden_states"].shape == (2, 77 + 24, 64)
        else:
            embeds, pooled, _ = pipeline.encode_prompt(CAPTIONS, CAPTIONS, device=CPU, max_sequence_length=24)
            assert text["encoder_hidden_states"].shape == (2, 24, 64)
    assert torch.equal(text["encoder_hidden_states"], embeds)
    assert torch.equal(text["pooled"], pooled)


def test_flux_packing_and_position_ids_are_the_pipelines():
    from diffusers import FluxPipeline

    latents = torch.randn(2, 16, 6, 10)
    packed = pack_latents(latents)
    assert torch.equal(packed, FluxPipeline._pack_latents(latents, 2, 16, 6, 10))
    assert torch.equal(unpack_latents(packed, 6, 10), latents)
    assert torch.equal(unpack_latents(packed, 6, 10), FluxPipeline._unpack_latents(packed, 48, 80, 8))
    assert torch.equal(image_ids(6, 10, CPU, torch.float32),
                       FluxPipeline._prepare_latent_image_ids(2, 3, 5, CPU, torch.float32))


@pytest.mark.parametrize("name", FAMILIES)
def test_training_prediction_is_one_pipeline_step(demos, name):
    """The denoiser call in training is the one the pipeline makes at the same noise level: one Euler step
    of the stock pipeline from the trainer's noisy latents lands where the training prediction says."""
    bundle = demos[name]
    objective = bundle.family.objective(bundle, TrainingConfig(flux_guidance=2.5))
    pipeline = bundle.family.pipeline(bundle)
    generator = torch.Generator().manual_seed(3)
    latents = torch.randn(1, 16, 8, 8, generator=generator)
    with torch.no_grad():
        text = bundle.encode_text(CAPTIONS[:1])
        # One step from t = 1 (pure noise): the scheduler's first sigma is 1 for both families.
        noise = torch.randn(1, 16, 8, 8, generator=generator)
        draw = NoiseDraw(noise, torch.ones(1))
        velocity = objective.predict(bundle.denoiser, objective.noisy(latents, draw), draw.timesteps, text)
        kwargs = {"guidance_scale": 2.5} if name == "flux" else {"guidance_scale": 1.0}
        packed = pack_latents(noise) if name == "flux" else noise
        result = pipeline(prompt_embeds=text["encoder_hidden_states"], pooled_prompt_embeds=text["pooled"],
                          latents=packed, num_inference_steps=1, sigmas=[1.0] if name == "flux" else None,
                          height=64, width=64, output_type="latent", **kwargs).images
    stepped = unpack_latents(result, 8, 8) if name == "flux" else result
    # An Euler step of the full interval from sigma 1 to 0: x0 = noise - velocity.
    torch.testing.assert_close(stepped, noise - velocity, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ the objective

def test_flow_draw_does_not_depend_on_world_size_and_is_logit_normal():
    whole = draw_flow_noise((8, 16, 4, 4), seed=3, step=5, micro=1, part=BatchSlice(0, 8, 8), device=CPU)
    halves = [draw_flow_noise((4, 16, 4, 4), 3, 5, 1, BatchSlice.of([4, 4], rank), CPU) for rank in range(2)]
    assert torch.equal(torch.cat([h.noise for h in halves]), whole.noise)
    assert torch.equal(torch.cat([h.timesteps for h in halves]), whole.timesteps)
    many = draw_flow_noise((20000, 1, 1, 1), 0, 0, 0, BatchSlice(0, 20000, 20000), CPU, logit_mean=0.5,
                           logit_std=0.8).timesteps
    logits = torch.log(many / (1 - many))
    assert abs(logits.mean().item() - 0.5) < 0.03 and abs(logits.std().item() - 0.8) < 0.03


def test_flow_shift_is_the_schedulers():
    from diffusers import FlowMatchEulerDiscreteScheduler

    from modules.model.families.flow_base import shipped

    t = torch.linspace(0.01, 0.99, 50)
    sd3 = FlowMatchEulerDiscreteScheduler.from_config(shipped("sd3", "scheduler"))
    # A fixed shift: the scheduler's own sigmas are shift(t) of its unshifted ones.
    unshifted = FlowMatchEulerDiscreteScheduler(shift=1.0).sigmas
    torch.testing.assert_close(shift_times(unshifted, flow_shift(sd3.config, 4096)), sd3.sigmas, rtol=1e-5, atol=1e-6)
    flux = FlowMatchEulerDiscreteScheduler.from_config(shipped("flux", "scheduler"))
    for tokens in (16, 256, 1024, 4096):  # 64 px ... 1024 px
        from diffusers.pipelines.flux.pipeline_flux import calculate_shift

        mu = calculate_shift(tokens, 256, 4096, 0.5, 1.15)
        torch.testing.assert_close(shift_times(t, flow_shift(flux.config, tokens)), flux.time_shift(mu, 1.0, t))
    assert flow_shift(flux.config, 4096) > flow_shift(flux.config, 1024) > 1.0


def test_noisy_input_and_target_are_rectified_flow(demos):
    from diffusers import FlowMatchEulerDiscreteScheduler

    bundle = demos["sd3"]
    objective = bundle.family.objective(bundle, TrainingConfig())
    latents = torch.randn(4, 16, 8, 8)
    draw = objective.draw(tuple(latents.shape), 1, 2, 0, BatchSlice(0, latents.shape[0], latents.shape[0]), CPU)
    # The scheduler's own noising (img2img's scale_noise) at these times gives the same input.
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(bundle.noise_scheduler.config)
    scheduler.timesteps, scheduler.sigmas = draw.timesteps * 1000, draw.timesteps
    expected = scheduler.scale_noise(latents, draw.timesteps * 1000, draw.noise)
    torch.testing.assert_close(objective.noisy(latents, draw), expected)
    assert torch.equal(objective.target(latents, draw), draw.noise - latents)
    assert objective.loss(draw.noise - latents, objective.target(latents, draw), draw).item() == 0.0


# ------------------------------------------------------------------ detection

def test_single_files_are_told_apart_by_key_names():
    assert detect_checkpoint(["double_blocks.0.img_attn.qkv.weight", "img_in.weight"]) == "flux"
    assert detect_checkpoint(["model.diffusion_model.double_blocks.0.img_mod.lin.weight"]) == "flux"
    assert detect_checkpoint(["model.diffusion_model.joint_blocks.0.x_block.attn.qkv.weight"]) == "sd3"
    with pytest.raises(ValueError, match=r"odd\.safetensors: cannot detect.*SD3.*Flux.*First keys: a\.b"):
        detect_checkpoint(["a.b"], source="odd.safetensors")


def test_explicit_model_type_must_match(tandem_home, demos):
    with pytest.raises(ValueError, match=r"model.model_type is 'sd3' but builtin:demo-flux.*'flux'"):
        load_model(ModelConfig(base_model="builtin:demo-flux", model_type="sd3"))
    with pytest.raises(ValueError, match=r"prediction_type.*rectified flow.*auto"):
        load_model(ModelConfig(base_model="builtin:demo-sd3", prediction_type="epsilon"))


# ------------------------------------------------------------------ saving

def _same(a: dict, b: dict, where: str) -> None:
    assert a.keys() == b.keys(), where
    for key in a:
        assert torch.equal(a[key], b[key]), f"{where}: {key}"


@pytest.mark.parametrize("name", FAMILIES)
def test_full_saves_load_back_exactly(demos, tmp_path, name):
    bundle = demos[name]
    with torch.no_grad():  # move the weights off their initial values, so the checks cannot pass by chance
        for p in bundle.denoiser.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    folder = save_full_diffusers(bundle, tmp_path / "folder", "fp32")
    single = save_full_single_file(bundle, tmp_path / "model.safetensors", "fp32")
    from_folder = load_model(ModelConfig(base_model=str(folder), t5_max_length=24))
    from_file = load_model(ModelConfig(base_model=str(single), components_folder=str(folder), t5_max_length=24))
    for loaded in (from_folder, from_file):
        assert loaded.model_type == name
        for part, module in bundle.modules().items():
            _same(loaded.modules()[part].state_dict(), module.state_dict(), f"{part} of {loaded.source}")
    # The folder is what the stock pipeline loads.
    pipeline = _pipeline_class(name).from_pretrained(folder, local_files_only=True)
    _same(pipeline.transformer.state_dict(), bundle.denoiser.state_dict(), "pipeline transformer")
    with pytest.raises(ValueError, match="model.components_folder"):
        load_model(ModelConfig(base_model=str(single)))


def test_sd3_single_file_is_stabilitys_layout(demos, tmp_path):
    """The file is what diffusers' own SD3 converter and `SD3Transformer2DModel.from_single_file` read."""
    from diffusers import SD3Transformer2DModel
    from diffusers.loaders.single_file_utils import convert_sd3_transformer_checkpoint_to_diffusers
    from safetensors.torch import load_file

    bundle = demos["sd3"]
    path = save_full_single_file(bundle, tmp_path / "sd3.safetensors", "fp32")
    state = load_file(str(path))
    assert any(k.startswith("first_stage_model.decoder.") for k in state), "SD3.5 single files carry the VAE"
    transformer = {k: v for k, v in state.items() if k.startswith("model.diffusion_model.")}
    assert "model.diffusion_model.joint_blocks.0.x_block.attn.qkv.weight" in transformer
    _same(convert_sd3_transformer_checkpoint_to_diffusers(dict(transformer)), bundle.denoiser.state_dict(),
          "diffusers' converter")
    folder = ensure_dit_demo("sd3")
    loaded = SD3Transformer2DModel.from_single_file(str(path), config=str(folder), subfolder="transformer",
                                                    local_files_only=True, torch_dtype=torch.float32)
    _same(loaded.state_dict(), bundle.denoiser.state_dict(), "from_single_file")


def test_flux_single_file_is_black_forest_labs_layout(demos, tmp_path):
    from safetensors.torch import load_file

    bundle = demos["flux"]
    state = load_file(str(save_full_single_file(bundle, tmp_path / "flux.safetensors", "fp32")))
    config = bundle.denoiser.config
    inner = config.num_attention_heads * config.attention_head_dim
    assert state["double_blocks.0.img_attn.qkv.weight"].shape == (3 * inner, inner)
    assert state["single_blocks.1.linear1.weight"].shape == (3 * inner + 4 * inner, inner)
    assert "guidance_in.in_layer.weight" in state and "final_layer.adaLN_modulation.1.bias" in state
    assert not any(k.startswith(("transformer_blocks.", "vae.")) for k in state)
    expected = {e.original_name(o) for e in flux_entries(2, 2) for o, _ in e.params}
    assert set(state) == expected
    # ComfyUI saves the same weights under `model.diffusion_model.`: read alike.
    from modules.model.families.flow_base import META_CONFIGS, plain_config

    wrapped = {f"model.diffusion_model.{k}": v for k, v in state.items()}
    metadata = {META_CONFIGS: json.dumps({"transformer": plain_config(config)})}
    loaded = family("flux").transformer_from_file(wrapped, metadata, tmp_path / "comfy.safetensors")
    _same(loaded.state_dict(), bundle.denoiser.state_dict(), "model.diffusion_model.-prefixed file")


@pytest.mark.slow
def test_flux_table_agrees_with_diffusers_at_real_width(tmp_path):
    """diffusers' Flux converter assumes the real width (3072): check the table there, and that
    `FluxTransformer2DModel.from_single_file` reads the file Tandem writes (1 double + 1 single block)."""
    from diffusers import FluxTransformer2DModel
    from diffusers.loaders.single_file_utils import convert_flux_transformer_checkpoint_to_diffusers

    from modules.model.families.flow_base import META_CONFIGS
    from modules.model.families.flux import FluxFamily
    from modules.util.atomic import save_safetensors_atomically

    config = {"patch_size": 1, "in_channels": 64, "num_layers": 1, "num_single_layers": 1, "attention_head_dim": 128,
              "num_attention_heads": 24, "joint_attention_dim": 32, "pooled_projection_dim": 32,
              "guidance_embeds": True, "axes_dims_rope": [16, 56, 56]}
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in FluxTransformer2DModel(**config).state_dict().items()}
    generator = torch.Generator().manual_seed(0)
    state = {k: torch.randn(shape, generator=generator, dtype=torch.float32).to(torch.bfloat16)
             for k, shape in shapes.items()}
    original = layout.to_original(state, layout.keep_present(flux_entries(1, 1), shapes))
    _same(convert_flux_transformer_checkpoint_to_diffusers(dict(original)), state, "diffusers' converter")
    path = save_safetensors_atomically(original, tmp_path / "flux.safetensors")
    loaded = FluxTransformer2DModel.from_single_file(str(path), config=_write_config(tmp_path, config),
                                                     subfolder="transformer", torch_dtype=torch.bfloat16)
    _same(loaded.state_dict(), state, "from_single_file")
    del loaded
    ours = FluxFamily("flux").transformer_from_file(original, {META_CONFIGS: json.dumps({"transformer": config})}, path)
    _same(ours.state_dict(), state, "Tandem's loader")


def _write_config(root: Path, config: dict) -> str:
    (root / "cfg" / "transformer").mkdir(parents=True)
    (root / "cfg" / "transformer" / "config.json").write_text(
        json.dumps({"_class_name": "FluxTransformer2DModel", **config}))
    return str(root / "cfg")


def test_sd3_table_covers_the_real_models():
    """Every parameter of SD3.5 Medium and Large (built on meta) has an original name, and the names
    are the ones in Stability's files (spot checks of both variants' special cases)."""
    from diffusers import SD3Transformer2DModel

    from modules.model.families.flow_base import shipped

    for config_name, dual in (("transformer", True), ("transformer_large", False)):
        config = shipped("sd3", config_name)
        with torch.device("meta"):
            state = SD3Transformer2DModel.from_config(config).state_dict()
        # to_original refuses any parameter without an original name.
        original = layout.to_original(state, layout.keep_present(sd3_entries(config["num_layers"]), state))
        assert original["pos_embed"].shape[1] == config["pos_embed_max_size"] ** 2
        last = config["num_layers"] - 1
        assert f"joint_blocks.{last}.context_block.adaLN_modulation.1.weight" in original
        assert f"joint_blocks.{last}.context_block.attn.proj.weight" not in original
        assert ("joint_blocks.0.x_block.attn2.qkv.weight" in original) == dual


# ------------------------------------------------------------------ samples

@pytest.mark.parametrize("name", FAMILIES)
def test_samples_render_through_the_pipeline_and_are_seeded(demos, name):
    bundle = demos[name]
    bundle.denoiser.train()
    prompts = [SamplePromptConfig(prompt="a red circle", seed=3),
               SamplePromptConfig(prompt="a blue square", seed=4, width=96, height=72)]
    images = render_samples(bundle, prompts, resolution=64, inference_steps=2, guidance_scale=3.0)
    assert [image.size for image in images] == [(64, 64), (96, 64)]  # rounded down to multiples of 16
    assert bundle.denoiser.training, "train/eval modes must be restored"
    again = render_samples(bundle, prompts[:1], 64, 2, 3.0)
    assert np.array_equal(np.asarray(images[0]), np.asarray(again[0]))
    bundle.denoiser.eval()


def _text_encoders_refused(bundle, monkeypatch) -> None:
    """Any use of the bundle's text encoders (a forward, a move) fails the test from here on."""
    def refused(*args, **kwargs):
        raise AssertionError("the sampling used a text encoder")

    for encoder in bundle.text_encoders:
        monkeypatch.setattr(encoder, "forward", refused)
        monkeypatch.setattr(encoder, "to", refused)


@pytest.mark.parametrize("name", FAMILIES)
def test_samples_from_texts_kept_at_the_start_are_the_pipelines_and_leave_the_encoders(demos, name, monkeypatch):
    """Texts encoded once at the start (as the trainer does after the cache) render the pixels the pipeline
    renders from the prompts, without the text encoders: with the text cached they wait in host memory, and
    T5-XXL is 9.5 GB each way."""
    from modules.config.train_config import SamplingConfig
    from modules.model.sample_texts import KEY, encode_sample_texts, texts_ready

    bundle = demos[name]
    prompts = [SamplePromptConfig(prompt="a red circle", seed=3),
               SamplePromptConfig(prompt="a blue square", negative_prompt="blurry", seed=4)]
    bundle.extra.pop(KEY, None)
    assert not texts_ready(bundle, prompts, 3.0)
    from_prompts = render_samples(bundle, prompts, 64, 2, 3.0)
    # SD3 guides with the negative prompts ("" where none, as its pipeline); Flux.1's guidance is a model input.
    expected = 4 if name == "sd3" else 2
    try:
        assert encode_sample_texts(bundle, SamplingConfig(prompts=prompts, guidance_scale=3.0)) == expected
        assert texts_ready(bundle, prompts, 3.0)
        assert not texts_ready(bundle, [SamplePromptConfig(prompt="not encoded at the start")], 3.0)
        with monkeypatch.context() as patched:
            _text_encoders_refused(bundle, patched)
            from_kept = render_samples(bundle, prompts, 64, 2, 3.0)
    finally:
        bundle.extra.pop(KEY, None)
    for a, b in zip(from_prompts, from_kept):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    if name == "sd3":  # without guidance no negative prompt is encoded
        assert encode_sample_texts(bundle, SamplingConfig(prompts=prompts, guidance_scale=1.0)) == 2
        bundle.extra.pop(KEY, None)


def test_trained_text_encoders_are_not_kept_encoded(demos):
    from modules.config.train_config import SamplingConfig
    from modules.model.sample_texts import KEY, encode_sample_texts

    bundle = demos["sd3"]
    clip = bundle.text_encoders[0]
    first = next(clip.parameters())
    first.requires_grad_(True)
    try:
        assert encode_sample_texts(bundle, SamplingConfig(prompts=[SamplePromptConfig(prompt="a")])) == 0
        assert KEY not in bundle.extra
    finally:
        first.requires_grad_(False)


# ------------------------------------------------------------------ benchmark models

@pytest.mark.slow
@pytest.mark.parametrize("name,tokens", [("sd3", 333), ("flux", 512)])
def test_benchmark_items_fit_the_real_size_transformers(name, tokens):
    """scripts/benchmark.py --model sd35m|flux: the synthetic cache entries have the real models' shapes
    (checked by running the real-size transformer on the meta device) and match the raw reference's."""
    from modules.benchmark.synthetic import SyntheticCachedLatents, random_bundle

    bundle = random_bundle(name, torch.device("meta"), torch.bfloat16)
    assert bundle.denoiser.dtype == torch.bfloat16
    expected_params = {"sd3": 2_243_171_520, "flux": 11_901_408_320}[name]  # SD3.5 Medium, Flux.1-dev
    assert abs(sum(p.numel() for p in bundle.denoiser.parameters()) - expected_params) < 0.01 * expected_params
    item = SyntheticCachedLatents(name, 1024, 4, pool=1)[0]  # one item is read: a pool of one
    assert item["latents"].shape == (16, 128, 128) and item["text"]["encoder_hidden_states"].shape == (tokens, 4096)
    objective = bundle.family.objective(bundle, TrainingConfig())
    meta = lambda t: torch.empty((1, *t.shape), device="meta", dtype=torch.bfloat16)  # noqa: E731
    text = {k: meta(v) for k, v in item["text"].items()}
    out = objective.predict(bundle.denoiser, meta(item["latents"]), torch.empty(1, device="meta", dtype=torch.bfloat16), text)
    assert out.shape == (1, 16, 128, 128)


# ------------------------------------------------------------------ guards

def test_text_cache_key_follows_t5_length_and_components_folder(demos, tmp_path):
    short, long = (load_model(ModelConfig(base_model="builtin:demo-flux", t5_max_length=n)) for n in (24, 32))
    assert short.fingerprint() != long.fingerprint(), "cached embeddings of another length must not be reused"
    assert short.fingerprint() == demos["flux"].fingerprint()
    folder = save_full_diffusers(demos["flux"], tmp_path / "components", "fp32")
    single = save_full_single_file(demos["flux"], tmp_path / "flux.safetensors", "fp32")
    bundle = load_model(ModelConfig(base_model=str(single), components_folder=str(folder), t5_max_length=24))
    before = bundle.fingerprint()
    (folder / "text_encoder_2" / "model.safetensors").write_bytes(
        (folder / "text_encoder_2" / "model.safetensors").read_bytes())  # replaced: new modification time
    assert load_model(ModelConfig(base_model=str(single), components_folder=str(folder),
                                  t5_max_length=24)).fingerprint() != before


def test_image_sizes_of_a_detected_family_are_checked(tandem_home, tmp_path):
    """Validation knows the family only when the config names it; a Flux folder found by `auto` with
    72 px images (a multiple of 8, not of 16) is refused once loaded, before any training."""
    from modules.config import load_config
    from modules.trainer.generic_trainer import GenericTrainer

    with pytest.raises(ValueError, match=r"multiples of 16 px.*72x72.*data.resolution"):
        family("flux").check_image_sizes([(64, 64), (72, 72)])
    family("sd1").check_image_sizes([(72, 72)])  # SD takes multiples of 8
    cfg = load_config("#demo_flux", [f"model.base_model={ensure_dit_demo('flux')}", "data.resolution=72",
                                     "data.aspect_bucketing=false", "data.bucket_step=8",
                                     f"general.workspace_dir={tmp_path / 'ws'}", "general.tensorboard=false"])
    with pytest.raises(ValueError, match=r"Flux.*multiples of 16 px.*72x72"):
        GenericTrainer(cfg).start()


def test_memory_estimate_sizes_the_transformer_families_and_their_activations():
    """Weights, gradients and optimizer state are exact for Flux's shapes (from the built-in model's files);
    the activations come from the transformer's geometry and grow with the batch."""
    from modules.config import TrainConfig
    from modules.distributed.memory_estimate import estimate

    cfg = TrainConfig()
    cfg.model.base_model = "builtin:demo-flux"
    cfg.training.method = "full"
    est = estimate(cfg)
    parts = est["parts"]
    assert est["model_type"] == "flux" and est["activations_known"] and parts["activations"] > 0
    assert parts["weights"] > 0 and parts["gradients"] > 0 and parts["optimizer state"] > 0
    assert "built-in model" in est["architecture_source"]
    cfg.training.batch_size *= 2
    assert estimate(cfg)["parts"]["activations"] == pytest.approx(2 * parts["activations"])


def test_flux_schnell_has_no_guidance_input_and_a_shorter_t5(tmp_path):
    """A transformer without `guidance_embeds` (Flux.1-schnell): no guidance given in training, no
    `guidance_in` in its single file, which loads back as schnell from its key names alone."""
    from diffusers import FluxTransformer2DModel

    from modules.model.families.flux import FluxObjective

    flux = family("flux")
    torch.manual_seed(0)
    schnell = FluxTransformer2DModel(patch_size=1, in_channels=64, num_layers=1, num_single_layers=1,
                                     attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                     pooled_projection_dim=32, guidance_embeds=False, axes_dims_rope=(4, 6, 6))
    assert flux.t5_length_default(schnell) == 256
    bundle = type("Bundle", (), {"denoiser": schnell, "noise_scheduler": type("S", (), {"config": {}})()})()
    assert FluxObjective(bundle, TrainingConfig(flux_guidance=3.0)).guidance is None
    state = schnell.state_dict()
    original = layout.to_original(state, flux.layout(schnell.config, state))
    assert not any(k.startswith("guidance_in.") for k in original)
    config = flux.shipped_transformer_config(original)
    assert (config["guidance_embeds"], config["num_layers"], config["num_single_layers"]) == (False, 1, 1)


@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILIES)
def test_random_model_folders_load_like_downloaded_ones(tmp_path, monkeypatch, name):
    """scripts/make_random_model.py --type sd3|flux: every part built from the shipped configs (shrunk here
    to a tiny size) and written as a folder that Tandem and the stock pipeline load."""
    from modules.model.families import flow_base, flux, sd3

    real = flow_base.shipped
    clip = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
            "projection_dim": 32}
    tiny = {
        ("sd3", "transformer"): {"num_layers": 2, "attention_head_dim": 16, "num_attention_heads": 2,
                                 "joint_attention_dim": 64, "caption_projection_dim": 32,
                                 "pooled_projection_dim": 64, "pos_embed_max_size": 16, "dual_attention_layers": [0]},
        ("flux", "transformer"): {"num_layers": 1, "num_single_layers": 1, "attention_head_dim": 16,
                                  "num_attention_heads": 2, "joint_attention_dim": 64, "pooled_projection_dim": 32,
                                  "axes_dims_rope": [4, 6, 6]},
        "vae": {"block_out_channels": [16, 16], "down_block_types": ["DownEncoderBlock2D"] * 2,
                "up_block_types": ["UpDecoderBlock2D"] * 2, "layers_per_block": 1, "norm_num_groups": 8},
        "clip": clip,
        "t5": {"d_model": 64, "d_kv": 16, "d_ff": 64, "num_layers": 1, "num_heads": 4},
    }

    def shrunk(family_name, component):
        config = real(family_name, component)
        if component.startswith("transformer"):
            return {**config, **tiny[(family_name, "transformer")]}
        if component == "vae":
            return {**config, **tiny["vae"]}
        if component.startswith("text_encoder"):
            return {**config, **tiny["t5" if config["architectures"] == ["T5EncoderModel"] else "clip"]}
        return config

    for module in (flow_base, flux, sd3):
        monkeypatch.setattr(module, "shipped", shrunk)
    folder = family(name).write_random_model(tmp_path / "random", torch.float32)
    bundle = load_model(ModelConfig(base_model=str(folder), t5_max_length=16))
    assert bundle.model_type == name and bundle.vae.config.latent_channels == 16
    with torch.no_grad():
        text = bundle.encode_text(["a photo of a cat"])
    assert torch.isfinite(text["encoder_hidden_states"]).all()
    pipeline = _pipeline_class(name).from_pretrained(folder, local_files_only=True)
    _same(pipeline.transformer.state_dict(), bundle.denoiser.state_dict(), "pipeline transformer")

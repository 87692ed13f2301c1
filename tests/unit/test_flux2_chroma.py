"""Flux.2 (dev and Klein) and Chroma behind the family interface (CPU, the built-in tiny models): conditioned
and trained as their diffusers pipelines condition and sample, saved in the layouts other tools load -
full models in Black Forest Labs' / Chroma's release layout and as diffusers folders, LoRAs through
diffusers' `load_lora_weights` and by ComfyUI's key rules."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from modules.families.registry import FAMILIES
from modules.config.train_config import ModelConfig, SamplePromptConfig, TrainingConfig
from modules.model import load_model, render_samples, save_full_diffusers, save_full_single_file
from modules.model.families import detect_checkpoint, detect_folder, family
from modules.model.families.dit_demo import ensure_dit_demo
from modules.model.families.flux import pack_latents, unpack_latents
from modules.model.families.flux2 import pack, patchify, unpack
from modules.model.objective import NoiseDraw
from modules.util.batch_slice import BatchSlice

CAPTIONS = ["a red circle on a blue background", "Zebra! naïve 🙂"]
CPU = torch.device("cpu")
DEMOS = ("chroma", "flux2", "flux2-klein")
"""The built-in Chroma and Flux.2-dev models, and a Klein-shaped tiny folder built the same way."""
EACH_FAMILY_QUICK = ("chroma", "flux2", pytest.param("flux2-klein", marks=pytest.mark.slow))
"""DEMOS for the checks where Klein is Flux.2 at another size (same classes, same code): the quick set runs
each family once, the full suite Klein too. Where Klein takes its own path (its text encoder, pipeline and
single-file layout) its tests stay quick."""

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def demos(tandem_home) -> dict:
    return {name: load_model(ModelConfig(base_model=str(ensure_dit_demo(name)), t5_max_length=24)) for name in DEMOS}


def family_of(name: str) -> str:
    return name.split("-")[0]


def pipeline_class(name: str):
    from diffusers import ChromaPipeline, Flux2KleinPipeline, Flux2Pipeline

    return {"chroma": ChromaPipeline, "flux2": Flux2Pipeline, "flux2-klein": Flux2KleinPipeline}[name]


def latents_of(name: str, batch: int = 1, seed: int = 3) -> torch.Tensor:
    channels = 16 if name == "chroma" else 32
    return torch.randn(batch, channels, 8, 8, generator=torch.Generator().manual_seed(seed))


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _same(actual: dict, expected: dict, what: str) -> None:
    assert actual.keys() == expected.keys(), what
    for key in expected:
        assert torch.equal(actual[key], expected[key]), f"{what}: {key}"


# ------------------------------------------------------------------ the built-in models

@pytest.mark.parametrize("name", EACH_FAMILY_QUICK)
def test_demo_builds_identically_and_loads_as_its_family(tandem_home, tmp_path, name):
    first, second = _files(ensure_dit_demo(name, tmp_path / "a")), _files(ensure_dit_demo(name, tmp_path / "b"))
    assert first == second
    assert detect_folder(tmp_path / "a")[0] == family_of(name)
    pipeline = pipeline_class(name).from_pretrained(tmp_path / "a", local_files_only=True)
    assert pipeline.vae.config.latent_channels == (16 if name == "chroma" else 32)


def test_demo_bundles(demos):
    chroma, dev, klein = demos["chroma"], demos["flux2"], demos["flux2-klein"]
    assert set(chroma.modules()) == set(dev.modules()) == {"transformer", "vae", "text_encoder"}
    assert chroma.text_lengths() == [24] and dev.text_lengths() == [512] == klein.text_lengths()
    assert load_model(ModelConfig(base_model="builtin:demo-chroma")).text_lengths() == [512]
    short = load_model(ModelConfig(base_model="builtin:demo-flux2", text_max_length=64))
    assert short.text_lengths() == [64] and short.encode_text(CAPTIONS)["encoder_hidden_states"].shape[1] == 64
    assert short.fingerprint() != dev.fingerprint(), "cached embeddings of another length must not be reused"
    assert [type(e).__name__ for e in (chroma.text_encoders[0], dev.text_encoders[0], klein.text_encoders[0])] == [
        "T5EncoderModel", "Mistral3ForConditionalGeneration", "Qwen3ForCausalLM"]
    for bundle in demos.values():
        assert bundle.trainable_text_encoders() == [], "T5 and the language models never train"
    assert dev.family.variant(dev) == "dev" and klein.family.variant(klein) == "klein"


# ------------------------------------------------------------------ conditioning = the pipeline's

def test_chroma_text_is_the_pipelines_with_a_boolean_mask(demos):
    """The embeddings are ChromaPipeline's; the transformer mask keeps the real tokens and the first pad, as
    the pipeline's does - but as booleans (the pipeline's floats would be added to the scores, not mask)."""
    bundle = demos["chroma"]
    pipeline = bundle.family.pipeline(bundle)
    with torch.no_grad():
        text = bundle.encode_text(CAPTIONS)
        embeds, mask = pipeline._get_t5_prompt_embeds(CAPTIONS, max_sequence_length=24, device=CPU)
    assert torch.equal(text["encoder_hidden_states"], embeds)
    assert text["attention_mask"].dtype == torch.bool and torch.equal(text["attention_mask"], mask > 0)
    lengths = text["attention_mask"].sum(dim=1)
    tokens = bundle.tokenizers[0](CAPTIONS, padding="max_length", max_length=24, return_tensors="pt").attention_mask
    assert torch.equal(lengths, tokens.sum(dim=1) + 1), "every real token and the first pad"


@pytest.mark.parametrize("name", ["flux2", "flux2-klein"])
def test_flux2_text_is_the_pipelines(demos, name):
    bundle = demos[name]
    pipeline = bundle.family.pipeline(bundle)
    with torch.no_grad():
        text = bundle.encode_text(CAPTIONS)
        embeds, ids = pipeline.encode_prompt(CAPTIONS, device=CPU, max_sequence_length=512)
    assert text["encoder_hidden_states"].shape == (2, 512, 96)  # three hidden layers of a 32-wide model
    assert torch.equal(text["encoder_hidden_states"], embeds)
    from modules.model.families.flux2 import text_ids
    assert torch.equal(ids[0], text_ids(512, CPU))


def test_flux2_tokenizer_takes_the_chat_template_beside_it(demos, tmp_path):
    """A processor's folder (Flux.2-dev's Pixtral processor) may keep the chat template in its own file; the
    tokenizer gets it from there, and a folder without any is refused by name."""
    import shutil

    from modules.model.families.flux2 import _with_chat_template

    tokenizer = demos["flux2"].tokenizers[0]
    template = tokenizer.chat_template
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    bare = type(tokenizer).from_pretrained(tmp_path / "tokenizer")
    bare.chat_template = None
    (tmp_path / "tokenizer" / "chat_template.jinja").write_text(template)
    _with_chat_template(bare, tmp_path / "tokenizer")
    assert bare.chat_template == template
    bare.chat_template = None
    shutil.rmtree(tmp_path / "tokenizer")
    (tmp_path / "tokenizer").mkdir()
    with pytest.raises(ValueError, match="no chat template"):
        _with_chat_template(bare, tmp_path / "tokenizer")


def test_a_flux2_dev_folder_with_a_processor_as_tokenizer_passes_the_start_check(demos, tmp_path):
    """FLUX.2-dev's model_index.json names a `PixtralProcessor` as its tokenizer: no weights to look for."""
    import json

    from modules.model.probe import probe_model

    folder = save_full_diffusers(demos["flux2"], tmp_path / "dev", "fp32")
    index = json.loads((folder / "model_index.json").read_text())
    index["tokenizer"] = ["transformers", "PixtralProcessor"]
    (folder / "model_index.json").write_text(json.dumps(index))
    assert probe_model(ModelConfig(base_model=str(folder))) == "flux2"


def test_flux2_packing_and_latent_normalisation_are_the_pipelines(demos):
    """Tandem's latents are the VAE's, normalised per patch channel: patchified, they are exactly what the
    pipeline encodes an image to, and they decode as the pipeline decodes its tokens."""
    from diffusers import Flux2Pipeline

    bundle = demos["flux2"]
    latents = torch.randn(2, 32, 6, 10)
    assert torch.equal(pack(latents), Flux2Pipeline._pack_latents(Flux2Pipeline._patchify_latents(latents)))
    assert torch.equal(unpack(pack(latents), 6, 10), latents)
    pipeline = bundle.family.pipeline(bundle)
    pixels = torch.rand(2, 3, 64, 64) * 2 - 1
    with torch.no_grad():
        mean, _ = bundle.encode_latent_distribution(pixels)
        expected = pipeline._encode_vae_image(pixels, generator=None)  # the mode, normalised
        torch.testing.assert_close(patchify(mean), expected, rtol=0, atol=1e-6)
        decoded = bundle.decode_latents(mean)
        mean_bn, std_bn = bundle.family._batch_norm(bundle, expected)
        reference = bundle.vae.decode(pipeline._unpatchify_latents(expected * std_bn + mean_bn)).sample.clamp(-1, 1)
    torch.testing.assert_close(decoded, reference, rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", EACH_FAMILY_QUICK)
def test_training_prediction_is_one_pipeline_step(demos, name):
    """The training call is the pipeline's: one Euler step of the stock pipeline from pure noise lands where
    the training prediction says (dev with its guidance input, Klein and Chroma without guidance)."""
    bundle = demos[name]
    objective = bundle.family.objective(bundle, TrainingConfig(flux_guidance=2.5))
    pipeline = bundle.family.pipeline(bundle)
    latents, noise = latents_of(name, seed=3), latents_of(name, seed=4)
    draw = NoiseDraw(noise, torch.ones(1))
    with torch.no_grad():
        text = bundle.encode_text(CAPTIONS[:1])
        velocity = objective.predict(bundle.denoiser, objective.noisy(latents, draw), draw.timesteps, text)
        common = dict(num_inference_steps=1, sigmas=[1.0], height=64, width=64, output_type="latent")
        if name == "chroma":
            result = pipeline(prompt_embeds=text["encoder_hidden_states"], prompt_attention_mask=text["attention_mask"],
                              latents=pack_latents(noise), guidance_scale=1.0, **common).images
            stepped = unpack_latents(result, 8, 8)
        else:
            result = pipeline(prompt_embeds=text["encoder_hidden_states"], latents=patchify(noise),
                              guidance_scale=2.5 if name == "flux2" else 1.0, **common).images
            # Flux2Pipeline returns the tokens, Flux2KleinPipeline the VAE's latents (what it would decode).
            stepped = unpack(result, 8, 8) if name == "flux2" else bundle.family.normalize_latents(bundle, result)
    torch.testing.assert_close(stepped, noise - velocity, rtol=1e-5, atol=1e-5)


def test_flux2_dev_guidance_reaches_the_transformer_and_klein_has_none(demos):
    dev, klein = demos["flux2"], demos["flux2-klein"]
    assert klein.family.objective(klein, TrainingConfig(flux_guidance=3.0)).guidance is None
    latents = latents_of("flux2")
    outputs = []
    for guidance in (1.0, 4.0):
        objective = dev.family.objective(dev, TrainingConfig(flux_guidance=guidance))
        draw = objective.draw(tuple(latents.shape), 0, 0, 0, BatchSlice(0, 1, 1), CPU)
        with torch.no_grad():
            outputs.append(objective.predict(dev.denoiser, objective.noisy(latents, draw), draw.timesteps,
                                             dev.encode_text(["a red circle"])))
    assert not torch.allclose(outputs[0], outputs[1])


def test_chroma_padding_beyond_the_first_pad_does_not_reach_the_prediction(demos):
    """With the boolean mask the prediction ignores what the hidden padding positions hold."""
    bundle = demos["chroma"]
    objective = bundle.family.objective(bundle, TrainingConfig())
    latents = latents_of("chroma")
    draw = objective.draw(tuple(latents.shape), 0, 0, 0, BatchSlice(0, 1, 1), CPU)
    with torch.no_grad():
        text = bundle.encode_text(["a red circle"])
        changed = dict(text, encoder_hidden_states=text["encoder_hidden_states"].clone())
        changed["encoder_hidden_states"][~text["attention_mask"]] = 7.0
        outputs = [objective.predict(bundle.denoiser, objective.noisy(latents, draw), draw.timesteps, t)
                   for t in (text, changed)]
    assert not text["attention_mask"].all()
    torch.testing.assert_close(outputs[0], outputs[1], rtol=0, atol=1e-6)


def test_chroma_cuts_the_text_to_the_longest_caption_exactly(demos):
    """Cutting the hidden tail of the text off (and the mask where all captions are as long) gives what the
    transformer gives for the whole masked sequence, as the pipeline calls it."""
    bundle = demos["chroma"]
    objective = bundle.family.objective(bundle, TrainingConfig())
    latents = latents_of("chroma", batch=2)
    draw = objective.draw(tuple(latents.shape), 0, 0, 0, BatchSlice(0, 2, 2), CPU)
    noisy = objective.noisy(latents, draw)
    with torch.no_grad():
        for captions in (["a red circle", "a white triangle on a blue background"], ["a red circle"] * 2):
            text = bundle.encode_text(captions)
            mask = torch.cat([text["attention_mask"], torch.ones(2, 16, dtype=torch.bool)], dim=1)
            whole = bundle.denoiser(hidden_states=pack_latents(noisy), timestep=draw.timesteps,
                                    encoder_hidden_states=text["encoder_hidden_states"], txt_ids=torch.zeros(24, 3),
                                    img_ids=objective_image_ids(), attention_mask=mask, return_dict=False)[0]
            cut = objective.predict(bundle.denoiser, noisy, draw.timesteps, text)
            torch.testing.assert_close(cut, unpack_latents(whole, 8, 8), rtol=0, atol=1e-5)


def objective_image_ids():
    from modules.model.families.flux import image_ids

    return image_ids(8, 8, CPU, torch.float32)


def test_flow_shift_follows_the_scheduler_by_image_size(demos):
    from modules.model.objective import flow_shift

    for name in ("chroma", "flux2"):
        config = dict(demos[name].noise_scheduler.config)
        assert config["use_dynamic_shifting"]
        assert flow_shift(config, 256) == pytest.approx(np.exp(0.5)) and flow_shift(config, 4096) == pytest.approx(np.exp(1.15))


# ------------------------------------------------------------------ saving: diffusers folders and single files

@pytest.mark.parametrize("name", EACH_FAMILY_QUICK)
def test_full_saves_load_back_exactly(demos, tmp_path, name):
    bundle = demos[name]
    folder = save_full_diffusers(bundle, tmp_path / "folder", "fp32")
    single = save_full_single_file(bundle, tmp_path / "model.safetensors", "fp32")
    expected = bundle.denoiser.state_dict()
    assert detect_checkpoint(list(load_file(single))) == family_of(name)
    again = load_model(ModelConfig(base_model=str(folder), t5_max_length=24))
    _same(again.denoiser.state_dict(), expected, "diffusers folder")
    assert again.extra.get("is_distilled", False) is False
    from_file = load_model(ModelConfig(base_model=str(single), components_folder=str(folder), t5_max_length=24))
    _same(from_file.denoiser.state_dict(), expected, "single file")
    pipeline = pipeline_class(name).from_pretrained(folder, local_files_only=True)
    _same(pipeline.transformer.state_dict(), expected, "pipeline transformer")


@pytest.mark.parametrize("name", ["flux2", "flux2-klein"])
def test_flux2_single_file_is_black_forest_labs_layout(demos, tmp_path, name):
    """diffusers' own converter of BFL's Flux.2 files gives back every tensor; its `from_single_file` reads
    the file (offline, with the saved folder as config); a ComfyUI-style `model.diffusion_model.` prefix
    and a file without Tandem's recorded config load too."""
    from diffusers import Flux2Transformer2DModel
    from diffusers.loaders.single_file_utils import convert_flux2_transformer_checkpoint_to_diffusers
    from safetensors.torch import save_file

    bundle = demos[name]
    folder = save_full_diffusers(bundle, tmp_path / "folder", "fp32")
    path = save_full_single_file(bundle, tmp_path / "flux2.safetensors", "fp32")
    state = load_file(path)
    assert "single_blocks.0.linear1.weight" in state and "double_blocks.1.img_attn.qkv.weight" in state
    assert ("guidance_in.in_layer.weight" in state) == (name == "flux2")
    _same(convert_flux2_transformer_checkpoint_to_diffusers(dict(state)), bundle.denoiser.state_dict(), "converter")
    loaded = Flux2Transformer2DModel.from_single_file(str(path), config=str(folder), subfolder="transformer",
                                                      local_files_only=True)
    _same(loaded.state_dict(), bundle.denoiser.state_dict(), "from_single_file")
    bare = tmp_path / "comfy.safetensors"
    save_file({f"model.diffusion_model.{k}": v for k, v in state.items()}, str(bare))  # no metadata
    again = load_model(ModelConfig(base_model=str(bare), components_folder=str(folder)))
    _same(again.denoiser.state_dict(), bundle.denoiser.state_dict(), "prefixed file without metadata")


def test_chroma_single_file_is_the_release_layout(demos, tmp_path):
    """Chroma's release names: diffusers' converter (which assumes the real width for the fused single-block
    projection, so it runs on stand-in tensors of that height) consumes every tensor of the file and names
    exactly the diffusers model's; a file without Tandem's recorded config loads by its shapes."""
    from diffusers.loaders.single_file_utils import convert_chroma_transformer_checkpoint_to_diffusers
    from safetensors.torch import save_file

    bundle = demos["chroma"]
    folder = save_full_diffusers(bundle, tmp_path / "folder", "fp32")
    state = load_file(save_full_single_file(bundle, tmp_path / "chroma.safetensors", "fp32"))
    assert "distilled_guidance_layer.layers.1.in_layer.weight" in state and "single_blocks.1.linear1.weight" in state
    assert not any(k.startswith(("time_in.", "vector_in.", "guidance_in.")) or "_mod." in k for k in state)
    stand_ins = {k: torch.zeros(21504 if ".linear1." in k else 3 if ".qkv." in k else 1) for k in state}
    converted = convert_chroma_transformer_checkpoint_to_diffusers(stand_ins)
    assert not stand_ins, f"the converter left {sorted(stand_ins)[:3]}"
    assert set(converted) == set(bundle.denoiser.state_dict())
    bare = tmp_path / "bare.safetensors"
    save_file(state, str(bare))
    again = load_model(ModelConfig(base_model=str(bare), components_folder=str(folder), t5_max_length=24))
    _same(again.denoiser.state_dict(), bundle.denoiser.state_dict(), "file without metadata")


# ------------------------------------------------------------------ sampling, guards, real sizes

@pytest.mark.parametrize("name", DEMOS)
def test_samples_render_through_the_pipeline_and_are_seeded(demos, name):
    bundle = demos[name]
    prompts = [SamplePromptConfig(prompt="a red circle", negative_prompt="a blue square", seed=1),
               SamplePromptConfig(prompt="a white triangle", seed=2, width=100, height=64)]
    images = render_samples(bundle, prompts, resolution=64, inference_steps=2, guidance_scale=3.0)
    assert [image.size for image in images] == [(64, 64), (96, 64)]  # rounded down to multiples of 16
    again = render_samples(bundle, prompts[:1], 64, 2, 3.0)
    assert np.array_equal(np.asarray(images[0]), np.asarray(again[0]))


def test_chroma_samples_from_texts_kept_at_the_start_leave_the_encoder(demos, monkeypatch):
    """Chroma's samples from the prompts' and negative prompts' embeddings kept at the start are the ones
    its encoder gives, and the T5 (9.5 GB at real size) is neither run nor moved for them."""
    from modules.config.train_config import SamplingConfig
    from modules.model.sample_texts import KEY, encode_sample_texts, texts_ready

    bundle = demos["chroma"]
    prompts = [SamplePromptConfig(prompt="a red circle", negative_prompt="a blue square", seed=1),
               SamplePromptConfig(prompt="a white triangle", seed=2)]
    encoded = render_samples(bundle, prompts, 64, 2, 3.0)
    try:
        # Both prompts and both negative prompts ("" where none), whatever the scale.
        assert encode_sample_texts(bundle, SamplingConfig(prompts=prompts, guidance_scale=1.0)) == 4
        assert texts_ready(bundle, prompts, 3.0)
        with monkeypatch.context() as patched:
            for encoder in bundle.text_encoders:
                for name in ("forward", "to"):
                    patched.setattr(encoder, name, lambda *a, **k: pytest.fail("the sampling used the text encoder"))
            kept = render_samples(bundle, prompts, 64, 2, 3.0)
    finally:
        bundle.extra.pop(KEY, None)
    for a, b in zip(encoded, kept):
        assert np.array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("model,params,text", [  # real-size builds: slow, but for one that keeps the path quick
    pytest.param("chroma", 8.9e9, (512, 4096), marks=pytest.mark.slow),
    pytest.param("flux2-dev", 32.2e9, (512, 15360), marks=pytest.mark.slow), ("flux2-klein-4b", 3.9e9, (512, 7680)),
    pytest.param("flux2-klein-9b", 9.1e9, (512, 12288), marks=pytest.mark.slow)])
def test_benchmark_models_are_the_published_sizes(model, params, text):
    """scripts/benchmark.py --model chroma|flux2-<variant>: the real-size transformer (on the meta device)
    has the published parameter count and takes the synthetic cache entries."""
    from modules.benchmark.cli import MODEL_ALIASES, model_variant
    from modules.benchmark.synthetic import SyntheticCachedLatents, random_bundle

    name, variant = MODEL_ALIASES[model], model_variant(model)
    bundle = random_bundle(name, torch.device("meta"), torch.bfloat16, variant)
    count = sum(p.numel() for p in bundle.denoiser.parameters())
    assert abs(count - params) < 0.03 * params, count
    item = SyntheticCachedLatents(name, 1024, 2, pool=1, variant=variant)[0]  # one item is read: a pool of one
    assert item["text"]["encoder_hidden_states"].shape == text
    objective = bundle.family.objective(bundle, TrainingConfig())
    meta = lambda t: torch.empty((1, *t.shape), device="meta", dtype=torch.bfloat16)  # noqa: E731
    out = objective.predict(bundle.denoiser, meta(item["latents"]), torch.empty(1, device="meta"),
                            {k: meta(v) for k, v in item["text"].items()})
    assert out.shape == (1, *item["latents"].shape)


def test_memory_estimate_sizes_a_language_model_text_encoder(tandem_home):
    from modules.config import TrainConfig
    from modules.distributed.memory_estimate import estimate

    cfg = TrainConfig()
    cfg.model.base_model, cfg.training.method = "builtin:demo-flux2", "lora"
    cfg.training.lora_target_modules = list(FAMILIES["flux2"].lora_targets)
    est = estimate(cfg)
    demo = load_model(ModelConfig(base_model="builtin:demo-flux2"))
    assert est["model_type"] == "flux2"
    assert est["params"]["text_encoder"] == sum(p.numel() for p in demo.text_encoders[0].parameters())
    assert est["params"]["trainable"] > 0


def test_image_sizes_are_multiples_of_16():
    for name in ("chroma", "flux2"):
        with pytest.raises(ValueError, match=r"multiples of 16 px"):
            family(name).check_image_sizes([(72, 72)])


@pytest.mark.parametrize("name,variant", [("chroma", ""), ("flux2", "dev"), ("flux2", "klein-4b")])
def test_random_model_folders_load_like_downloaded_ones(tmp_path, monkeypatch, name, variant):
    """scripts/make_random_model.py --type chroma|flux2 [--variant]: every part built from the shipped real-size
    configs (shrunk here: real sizes are built on the GPU machine) and written as a folder that Tandem and
    the stock pipeline load; the language models keep the depth the pipelines read hidden layers from."""
    from modules.benchmark.synthetic import write_random_model
    from modules.model.families import chroma, flow_base, flux2

    real = flow_base.shipped
    language = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1,
                "head_dim": 16, "vocab_size": 128}  # above the demo tokenizer's ids
    tiny = {
        "chroma": {"num_layers": 1, "num_single_layers": 1, "attention_head_dim": 16, "num_attention_heads": 2,
                   "joint_attention_dim": 64, "axes_dims_rope": [4, 6, 6], "approximator_num_channels": 16,
                   "approximator_hidden_dim": 32, "approximator_layers": 1},
        "flux2": {"num_layers": 1, "num_single_layers": 1, "attention_head_dim": 16, "num_attention_heads": 2,
                  "joint_attention_dim": 96, "timestep_guidance_channels": 32, "axes_dims_rope": [4, 4, 4, 4]},
        "vae": {"block_out_channels": [16, 16], "down_block_types": ["DownEncoderBlock2D"] * 2,
                "up_block_types": ["UpDecoderBlock2D"] * 2, "layers_per_block": 1, "norm_num_groups": 8},
        "T5EncoderModel": {"d_model": 64, "d_kv": 16, "d_ff": 64, "num_layers": 1, "num_heads": 4},
        "Qwen3ForCausalLM": {**language, "num_hidden_layers": 27},
        "Mistral3ForConditionalGeneration": {
            "text_config": {"model_type": "mistral", **language, "num_hidden_layers": 30},
            "vision_config": {"model_type": "pixtral", "hidden_size": 16, "intermediate_size": 32,
                              "num_hidden_layers": 1, "num_attention_heads": 2, "head_dim": 8, "image_size": 64,
                              "patch_size": 16}},
    }

    def shrunk(family_name, component):
        config = real(family_name, component)
        if component.startswith("transformer"):
            return {**config, **tiny[family_name]}
        if component == "vae":
            return {**config, **tiny["vae"]}
        if component.startswith("text_encoder"):
            return {**config, **tiny[config["architectures"][0]]}
        return config

    # Every family module imported first: one imported while the patch is on would bind `shrunk` as its own
    # `shipped` for good (`from .flow_base import shipped`), and a later test in this process would build
    # that family with this test's sizes (seen: Qwen-Image's random folder test failing with KeyError 'qwen').
    import importlib
    import pkgutil

    from modules.model import families
    for found in pkgutil.iter_modules(families.__path__):
        importlib.import_module(f"{families.__name__}.{found.name}")
    for module in (flow_base, chroma, flux2):
        monkeypatch.setattr(module, "shipped", shrunk)
    folder = write_random_model(name, tmp_path / "random", torch.float32, variant=variant)
    bundle = load_model(ModelConfig(base_model=str(folder), t5_max_length=16))
    assert bundle.model_type == name
    with torch.no_grad():
        text = bundle.encode_text(["a photo of a cat"])
    assert torch.isfinite(text["encoder_hidden_states"]).all()
    cls = pipeline_class("flux2-klein" if variant.startswith("klein") else name)
    pipeline = cls.from_pretrained(folder, local_files_only=True)
    _same(pipeline.transformer.state_dict(), bundle.denoiser.state_dict(), "pipeline transformer")

"""Model package: demo model build, loading, conditioning, full saves and sampling (CPU, demo model)."""
from __future__ import annotations

import json
import multiprocessing
from pathlib import Path

import numpy as np
import pytest
import torch

from modules.config.train_config import ModelConfig, SamplePromptConfig, TrainingConfig
from modules.model import demo as demo_module
from modules.model import ensure_demo_model, frozen_dtypes, load_model, render_samples, save_full_diffusers
from modules.model.bundle import ModelBundle
from tests.patience import patience


# The tiny models are far slower with several threads on a busy 2-core machine.
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def demo(tandem_home) -> ModelBundle:
    return load_model(ModelConfig())


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# ---------------------------------------------------------------------------- demo model

def test_demo_model_builds_identically_every_time(tmp_path):
    first = _files(ensure_demo_model(tmp_path / "a"))
    second = _files(ensure_demo_model(tmp_path / "b"))
    assert first == second
    for required in ("model_index.json", "unet/diffusion_pytorch_model.safetensors", "vae/config.json",
                     "text_encoder/model.safetensors", "tokenizer/vocab.json", "tokenizer/merges.txt",
                     "scheduler/scheduler_config.json"):
        assert required in first
    scheduler = json.loads(first["scheduler/scheduler_config.json"])
    assert (scheduler["beta_schedule"], scheduler["num_train_timesteps"], scheduler["prediction_type"]) == (
        "scaled_linear", 1000, "epsilon")


def _build_racing(root: Path, barrier) -> None:
    # Every builder finishes building before any renames, so all but one must lose the race.
    real_build = demo_module._build_into

    def build_then_wait(folder):
        real_build(folder)
        barrier.wait()

    demo_module._build_into = build_then_wait
    ensure_demo_model(root)


@pytest.mark.slow
def test_concurrent_builds_end_with_one_complete_folder(tmp_path):
    # Separate processes, as ranks are; fork keeps it fast (torch is already imported).
    context = multiprocessing.get_context("fork")
    barrier = context.Barrier(2, timeout=patience(120))
    root = tmp_path / "demo"
    workers = [context.Process(target=_build_racing, args=(root, barrier)) for _ in range(2)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=patience(180))
    assert [worker.exitcode for worker in workers] == [0, 0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo"], "a temporary build folder was left behind"
    assert _files(root) == _files(ensure_demo_model(tmp_path / "fresh"))


def test_outdated_demo_model_is_rebuilt_and_foreign_folder_refused(tmp_path):
    old = tmp_path / "old"
    old.mkdir()
    (old / "tandem_demo.json").write_text(json.dumps({"version": 0}))
    assert (ensure_demo_model(old) / "unet" / "config.json").is_file()

    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(RuntimeError, match="foreign"):
        ensure_demo_model(foreign)
    assert (foreign / "notes.txt").read_text() == "mine"


def test_demo_tokenizer_handles_any_text(demo):
    tokenizer = demo.tokenizers[0]
    ids = tokenizer("a red circle on a blue background").input_ids
    assert len(ids) == 2 + 7, "each demo caption word should be one token"
    odd = tokenizer("Zebra! naïve 🙂 " * 40, truncation=True, max_length=77).input_ids
    assert len(odd) == 77 and odd[-1] == tokenizer.eos_token_id


# ---------------------------------------------------------------------------- loading

def test_load_demo_gives_frozen_sd1_bundle(demo):
    assert (demo.model_type, demo.prediction_type, demo.source) == ("sd1", "epsilon", "builtin:demo")
    assert type(demo.noise_scheduler).__name__ == "DDPMScheduler"
    for module in demo.modules().values():
        assert not module.training
        assert not any(p.requires_grad for p in module.parameters())
    assert demo.trainable_modules() == {}


def test_encode_shapes_and_pipeline_equivalence(demo):
    from diffusers import StableDiffusionPipeline

    pixels = torch.rand(2, 3, 64, 96) * 2 - 1
    with torch.no_grad():
        latents = demo.encode_images(pixels, generator=torch.Generator().manual_seed(0))
        again = demo.encode_images(pixels, generator=torch.Generator().manual_seed(0))
        text = demo.encode_text(["a red circle", "a blue square on a white background"])
    assert latents.shape == (2, 4, 8, 12)
    assert torch.equal(latents, again)
    assert set(text) == {"encoder_hidden_states"}
    assert text["encoder_hidden_states"].shape == (2, 77, 64)
    assert demo.added_cond(text, [(64, 96)] * 2, [(0, 0)] * 2, [(64, 96)] * 2) is None

    pipeline = StableDiffusionPipeline(
        vae=demo.vae, text_encoder=demo.text_encoders[0], tokenizer=demo.tokenizers[0], unet=demo.unet,
        scheduler=demo.noise_scheduler, safety_checker=None, feature_extractor=None, requires_safety_checker=False)
    with torch.no_grad():
        reference, _ = pipeline.encode_prompt(["a red circle", "a blue square on a white background"], "cpu", 1, False)
    assert torch.equal(text["encoder_hidden_states"], reference)


def test_latent_distribution_is_what_encode_images_samples(demo):
    """The cache stores (mean, std) and draws mean + std * noise; encode_images draws exactly that."""
    pixels = torch.rand(2, 3, 64, 64) * 2 - 1
    with torch.no_grad():
        mean, std = demo.encode_latent_distribution(pixels)
        sampled = demo.encode_images(pixels, generator=torch.Generator().manual_seed(7))
    noise = torch.randn(mean.shape, generator=torch.Generator().manual_seed(7))
    assert mean.shape == std.shape == (2, 4, 8, 8) and bool((std > 0).all())
    torch.testing.assert_close(mean + std * noise, sampled)


def test_sdxl_conditioning_matches_the_sdxl_pipeline(demo):
    from diffusers import StableDiffusionXLPipeline
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    tokenizer = demo.tokenizers[0]
    torch.manual_seed(0)
    common = dict(vocab_size=len(tokenizer), intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
                  max_position_embeddings=77, eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    encoder_1 = CLIPTextModel(CLIPTextConfig(hidden_size=32, **common)).eval()
    encoder_2 = CLIPTextModelWithProjection(CLIPTextConfig(hidden_size=48, projection_dim=40, **common)).eval()
    sdxl = ModelBundle("sdxl", demo.unet, demo.vae, [encoder_1, encoder_2], [tokenizer, tokenizer],
                       demo.noise_scheduler, "epsilon", "test")
    captions = ["a red circle", "green star"]
    with torch.no_grad():
        text = sdxl.encode_text(captions)
        pipeline = StableDiffusionXLPipeline(
            vae=demo.vae, text_encoder=encoder_1, text_encoder_2=encoder_2, tokenizer=tokenizer,
            tokenizer_2=tokenizer, unet=demo.unet, scheduler=demo.noise_scheduler, add_watermarker=False)
        embeds, _, pooled, _ = pipeline.encode_prompt(captions, device="cpu", do_classifier_free_guidance=False)
    assert text["encoder_hidden_states"].shape == (2, 77, 32 + 48)
    assert torch.equal(text["encoder_hidden_states"], embeds)
    assert torch.equal(text["pooled"], pooled) and pooled.shape == (2, 40)

    cond = sdxl.added_cond(text, [(1024, 768), (512, 512)], [(0, 16), (8, 0)], [(1024, 1024), (512, 512)])
    assert torch.equal(cond["text_embeds"], text["pooled"])
    assert cond["time_ids"].tolist() == [[1024, 768, 0, 16, 1024, 1024], [512, 512, 8, 0, 512, 512]]


def test_fingerprint_is_stable_and_follows_the_vae(demo, tandem_home):
    assert demo.fingerprint() == load_model(ModelConfig()).fingerprint()
    assert load_model(ModelConfig(vae_dtype="bf16")).fingerprint() != demo.fingerprint()
    other_vae = load_model(ModelConfig(vae_path=str(ensure_demo_model())))
    assert other_vae.vae_source and other_vae.fingerprint() != demo.fingerprint()


def test_type_mismatch_and_overrides(tandem_home):
    with pytest.raises(ValueError, match=r"model.model_type is 'sdxl'.*SD1.*'sd1'"):
        load_model(ModelConfig(model_type="sdxl"))
    with pytest.raises(ValueError, match="model.prediction_type"):
        load_model(ModelConfig(prediction_type="x0"))
    v_pred = load_model(ModelConfig(prediction_type="v_prediction"))
    assert v_pred.prediction_type == v_pred.noise_scheduler.config.prediction_type == "v_prediction"


def test_frozen_dtypes_follow_what_is_trained(tandem_home):
    cfg = ModelConfig(unet_dtype="bf16", text_encoder_dtype="fp16", vae_dtype="bf16")
    assert frozen_dtypes(cfg, TrainingConfig(method="lora")) == {
        "unet": torch.bfloat16, "text_encoder": torch.float16, "vae": torch.bfloat16}
    full = frozen_dtypes(cfg, TrainingConfig(method="full", train_text_encoder=True))
    assert full == {"unet": torch.float32, "text_encoder": torch.float32, "vae": torch.bfloat16}
    bundle = load_model(cfg, training_cfg=TrainingConfig(method="lora"))
    assert {next(m.parameters()).dtype for m in bundle.modules().values()} == {torch.bfloat16, torch.float16}
    with pytest.raises(ValueError, match="model.unet_dtype is 'int8'"):
        frozen_dtypes(ModelConfig(unet_dtype="int8"))


def test_missing_or_wrong_paths_name_the_problem(tmp_path, tandem_home):
    missing = tmp_path / "nowhere" / "model"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        load_model(ModelConfig(base_model=str(missing)))
    not_a_model = tmp_path / "folder"
    not_a_model.mkdir()
    (not_a_model / "model_index.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="unet/config.json is missing"):
        load_model(ModelConfig(base_model=str(not_a_model)))
    with pytest.raises(FileNotFoundError, match="vae_path"):
        load_model(ModelConfig(vae_path=str(tmp_path / "no-vae")))
    with pytest.raises(ValueError, match="builtin:demo"):
        load_model(ModelConfig(base_model="builtin:other"))


# ---------------------------------------------------------------------------- saving and sampling

@pytest.mark.slow
def test_full_diffusers_save_reloads_identical_weights(tmp_path, tandem_home):
    from diffusers import StableDiffusionPipeline

    bundle = load_model(ModelConfig())
    bundle.unet.requires_grad_(True)
    with torch.no_grad():
        for param in bundle.unet.parameters():
            param.add_(torch.randn_like(param) * 0.01)
    out = tmp_path / "out" / "model"
    ema = {key: value + 0.5 for key, value in bundle.unet.state_dict().items()}
    save_full_diffusers(bundle, out, "fp32", unet_state_override=ema)
    saved_ema = load_model(ModelConfig(base_model=str(out)))
    assert all(torch.equal(saved_ema.unet.state_dict()[k], ema[k]) for k in ema)

    save_full_diffusers(bundle, out, "fp32")  # replaces the earlier output whole
    assert sorted(p.name for p in out.parent.iterdir()) == ["model"], "temporary folders were left behind"
    reloaded = load_model(ModelConfig(base_model=str(out)))
    for name, module in bundle.modules().items():
        original, saved = module.state_dict(), reloaded.modules()[name].state_dict()
        assert original.keys() == saved.keys(), name
        assert all(torch.equal(original[k], saved[k]) for k in original), name
    assert reloaded.model_type == "sd1" and reloaded.vae.config.scaling_factor == bundle.vae.config.scaling_factor
    assert StableDiffusionPipeline.from_pretrained(out, local_files_only=True).unet.dtype == torch.float32

    save_full_diffusers(bundle, tmp_path / "half", "fp16")
    assert load_model(ModelConfig(base_model=str(tmp_path / "half"), unet_dtype="fp16")).unet.dtype == torch.float16


def test_single_file_outputs_route_through_the_single_file_module(tmp_path, demo):
    from modules.model import save_full_single_file

    path = save_full_single_file(demo, tmp_path / "demo.safetensors", "fp32")
    with_file_vae = load_model(ModelConfig(vae_path=str(path)))
    assert with_file_vae.vae_source == str(path.resolve())
    original = demo.vae.state_dict()
    assert all(torch.equal(original[k], v) for k, v in with_file_vae.vae.state_dict().items())
    # A single file has no tokenizer; the demo's own small vocabulary cannot come back from one.
    with pytest.raises(ValueError, match="its own tokenizer.*diffusers folder"):
        load_model(ModelConfig(base_model=str(path)))


def test_samples_have_the_requested_size_and_are_seeded(demo):
    demo.unet.train()
    prompts = [SamplePromptConfig(prompt="a red circle", seed=3),
               SamplePromptConfig(prompt="a blue square", seed=4, width=96, height=64)]
    images = render_samples(demo, prompts, resolution=64, inference_steps=3, guidance_scale=5.0)
    assert [image.size for image in images] == [(64, 64), (96, 64)]
    assert demo.unet.training and not demo.vae.training, "train/eval modes must be restored"
    again = render_samples(demo, prompts[:1], resolution=64, inference_steps=3, guidance_scale=5.0)
    assert np.array_equal(np.asarray(images[0]), np.asarray(again[0]))
    other_seed = render_samples(demo, [SamplePromptConfig(prompt="a red circle", seed=5)], 64, 3, 5.0)
    assert not np.array_equal(np.asarray(images[0]), np.asarray(other_seed[0]))
    demo.unet.eval()


def test_samples_are_rendered_without_cudnn_autotuning(demo, monkeypatch):
    """Autotuning the few dozen sampling calls' new shapes costs more than it saves; training's setting
    (`training.cudnn_benchmark`) comes back afterwards, also when rendering fails."""
    import modules.model.sampling as sampling
    seen = []

    def render_one(*args):
        seen.append(torch.backends.cudnn.benchmark)
        if len(seen) == 2:
            raise RuntimeError("a failed render")
        return "image"

    monkeypatch.setattr(sampling, "render_one", render_one)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", True)
    assert render_samples(demo, [SamplePromptConfig(prompt="a red circle")], 64, 2) == ["image"]
    assert seen == [False] and torch.backends.cudnn.benchmark is True
    with pytest.raises(RuntimeError, match="a failed render"):
        render_samples(demo, [SamplePromptConfig(prompt="a red circle")], 64, 2)
    assert seen == [False, False] and torch.backends.cudnn.benchmark is True


# ---------------------------------------------------------------------------- fp16-variant folders

def _as_fp16_variant(folder: Path) -> None:
    """Turn every weight file into the fp16 variant only, as many hub downloads hold them."""
    from safetensors.torch import load_file, save_file

    for file in list(folder.rglob("*.safetensors")):
        state = {k: v.half() if v.is_floating_point() else v for k, v in load_file(file).items()}
        save_file(state, file.with_name(file.name.replace(".safetensors", ".fp16.safetensors")), {"format": "pt"})
        file.unlink()


def test_a_folder_with_only_fp16_variant_weights_loads(tmp_path, demo):
    import shutil

    folder = tmp_path / "downloaded"
    shutil.copytree(ensure_demo_model(), folder)
    _as_fp16_variant(folder)
    assert not list(folder.rglob("diffusion_pytorch_model.safetensors"))
    bundle = load_model(ModelConfig(base_model=str(folder), unet_dtype="fp32"))
    for name, module in bundle.modules().items():
        expected = demo.modules()[name].state_dict()
        for key, value in module.state_dict().items():
            if value.is_floating_point():  # the fp16 file's values, in the configured storage dtype
                assert value.dtype == torch.float32
                assert torch.equal(value, expected[key].half().float()), (name, key)
    # A VAE folder with only the variant loads too (model.vae_path).
    vae = load_model(ModelConfig(vae_path=str(folder / "vae"))).vae
    assert torch.equal(vae.decoder.conv_out.weight, demo.vae.decoder.conv_out.weight.half().float())


def test_a_folder_without_weights_names_the_component_folder(tmp_path, tandem_home):
    import shutil

    folder = tmp_path / "incomplete"
    shutil.copytree(ensure_demo_model(), folder)
    (folder / "text_encoder" / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError) as error:
        load_model(ModelConfig(base_model=str(folder)))
    message = str(error.value)
    assert str(folder / "text_encoder") in message and "model.fp16.safetensors" in message
    assert "download the text_encoder folder of the model again" in message

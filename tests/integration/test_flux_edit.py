"""Flux.1 Kontext (`flux_kontext`) and Flux.2 with reference images (`flux2` on pairs): what is their own beside what
every family gets from tests/integration/test_family_training.py (Kontext: LoRA and full fine-tune on 2 processes
equal 1 on its pairs, samples with their controls, its saves load back, its LoRA in `FluxKontextPipeline` gives the
trained edit prediction).

- the training prediction with a control image is one step of diffusers' pipeline given that image (`image=`):
  Kontext's, Flux.2-dev's and Klein's (their ids, packing, normalisation and the target-only output);
- samples render at the prompt's size from its control cropped as training crops it (the stock pipelines size both
  their own way);
- one short LoRA run of `#demo_flux2_edit` on the first pairs (module-scoped, shared by the checks): samples render
  with a prompt's reference image and without one, and the saved LoRA, loaded by diffusers' `Flux2Pipeline`,
  changes the edit it renders from the reference."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from modules.config.train_config import ModelConfig, SamplePromptConfig, TrainingConfig
from modules.data.controls import control_picture, sample_controls
from modules.model import load_model
from modules.model.families import family
from modules.model.families.dit_demo import ensure_dit_demo
from modules.model.families.flux import pack_latents, unpack_latents
from modules.model.families.flux2 import patchify, unpack
from modules.model.sampling import render_one, sampling_pipeline
from tests.trainer_helpers import demo_config, demo_data_subset, train

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]


def demo_folder(name: str) -> Path:
    """The built-in model's folder (`flux2-klein`: a Klein-shaped one the tests build)."""
    return family(name).build_demo() if name == "flux_kontext" else ensure_dit_demo(name)


@pytest.fixture(scope="module")
def demos(tandem_home):
    """name -> its built-in model, loaded once for the module's tests."""
    loaded = {}

    def demo(name: str):
        if name not in loaded:
            loaded[name] = load_model(ModelConfig(base_model=str(demo_folder(name))))
        return loaded[name]
    return demo


@pytest.mark.parametrize("name", ["flux_kontext", "flux2", "flux2-klein"])
def test_the_prediction_with_a_control_is_one_step_of_the_pipeline_given_the_image(demos, name):
    bundle = demos(name)
    objective = bundle.family.objective(bundle, TrainingConfig(flux_guidance=2.5))
    control = Image.fromarray((np.random.default_rng(0).random((64, 64, 3)) * 255).astype(np.uint8))
    pixels = torch.from_numpy(np.array(control)).permute(2, 0, 1)[None].float() / 127.5 - 1
    noise = torch.randn(1, bundle.vae.config.latent_channels, 8, 8, generator=torch.Generator().manual_seed(4))
    stock = bundle.family.stock_pipeline(demo_folder(name))
    common = dict(image=control, num_inference_steps=1, sigmas=[1.0], height=64, width=64, output_type="latent")
    with torch.no_grad():
        reference, _ = bundle.encode_latent_distribution(pixels)  # the mode: what the pipelines encode
        text = bundle.encode_text(["make the circle red"])
        velocity = objective.predict(bundle.denoiser, noise, torch.ones(1), text, controls=reference[:, None])
        plain = objective.predict(bundle.denoiser, noise, torch.ones(1), text)
        if name == "flux_kontext":  # at the asked size from the image as given (the stock pipeline resizes both)
            result = stock(prompt_embeds=text["encoder_hidden_states"], pooled_prompt_embeds=text["pooled"],
                           latents=pack_latents(noise), guidance_scale=2.5, max_area=64 * 64, _auto_resize=False,
                           max_sequence_length=512, **common)
            stepped = unpack_latents(result.images, 8, 8)
        else:  # Flux.2's pipelines return the packed tokens
            stepped = unpack(stock(prompt_embeds=text["encoder_hidden_states"], latents=patchify(noise),
                                   guidance_scale=2.5, **common).images, 8, 8)
    torch.testing.assert_close(stepped, noise - velocity, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(stepped, noise - plain, atol=1e-3), "the control changed nothing: the check is vacuous"


def test_samples_render_at_their_size_from_the_control_cropped_to_it(demos, tmp_path):
    """Kontext's stock pipeline renders about a megapixel and Flux.2's keeps a reference's own size: samples render
    at the prompt's size, from its control cropped as training crops a control to its image's bucket."""
    Image.fromarray((np.random.default_rng(1).random((96, 192, 3)) * 255).astype(np.uint8)).save(tmp_path / "c.png")
    prompt = SamplePromptConfig(prompt="make the circle red", control=str(tmp_path / "c.png"), seed=1, width=96,
                                height=64)
    kontext = demos("flux_kontext")
    assert render_one(kontext, sampling_pipeline(kontext), prompt, 64, 1, 2.5).size == (96, 64)
    flux2 = demos("flux2")
    ours = render_one(flux2, sampling_pipeline(flux2), prompt, 64, 1, 1.0)
    stock = flux2.family.stock_pipeline(demo_folder("flux2"))

    def stock_render(image):
        return np.asarray(stock(image=[image], prompt=prompt.prompt, width=96, height=64, num_inference_steps=1,
                                guidance_scale=1.0, generator=torch.Generator().manual_seed(1)).images[0])

    assert np.array_equal(np.asarray(ours), stock_render(control_picture(tmp_path / "c.png", 96, 64)))
    with Image.open(tmp_path / "c.png") as whole:  # the stock pipeline's own size for it: another picture
        assert not np.array_equal(np.asarray(ours), stock_render(whole.convert("RGB")))


@pytest.fixture(scope="module")
def flux2_edit(tandem_home, tmp_path_factory):
    """A LoRA of `#demo_flux2_edit` trained 2 steps on 4 pairs, sampling at its end one prompt with its reference
    image and one without."""
    workspace = tmp_path_factory.mktemp("flux2_edit")
    data = demo_data_subset(workspace / "data", "#demo_flux2_edit", 4)
    cfg = demo_config(workspace, workspace / "cache", *data, "training.max_steps=2", "training.batch_size=2",
                      "training.learning_rate=1.0", "sampling.every_n_steps=2", "sampling.inference_steps=2",
                      "save.lora_format=both", preset="#demo_flux2_edit")
    cfg.sampling.prompts = cfg.sampling.prompts[:2]
    cfg.sampling.prompts[1].control = ""  # Flux.2 renders from the text alone too
    return cfg, train(cfg)


def test_samples_render_with_and_without_a_reference_image(flux2_edit):
    cfg, _ = flux2_edit
    samples = sorted((Path(cfg.general.workspace_dir) / "samples").rglob("step-0000002-*.png"))
    assert [p.name for p in samples] == ["step-0000002-0.png", "step-0000002-1.png"]
    assert all(Image.open(p).size == (64, 64) for p in samples)


def test_the_saved_lora_changes_the_edit_flux2s_pipeline_renders(flux2_edit):
    from diffusers import Flux2Pipeline

    cfg, trainer = flux2_edit
    output = Path(trainer.callbacks.of_type("done")[-1]["output"])
    pipeline = Flux2Pipeline.from_pretrained(ensure_dit_demo("flux2"), local_files_only=True)
    prompt = cfg.sampling.prompts[0]
    with Image.open(sample_controls(prompt.control)[0].path) as img:
        reference = img.convert("RGB")

    def render():
        return np.asarray(pipeline(image=[reference], prompt=prompt.prompt, height=64, width=64, num_inference_steps=2,
                                   guidance_scale=1.0, max_sequence_length=cfg.model.text_max_length, output_type="np",
                                   generator=torch.Generator().manual_seed(1)).images[0])

    base = render()
    pipeline.load_lora_weights(str(output.with_name(output.name.replace(".safetensors", ".peft.safetensors"))))
    assert np.abs(render() - base).mean() > 1e-3, "the LoRA changed nothing the pipeline renders"

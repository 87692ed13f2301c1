"""Qwen-Image-Edit (`qwen_edit`): what is its own beside what every family gets from tests/integration/test_family_training.py
(LoRA and full fine-tune on 2 processes equal 1, its saves load back).

- its text encoding equals `QwenImageEditPlusPipeline.encode_prompt` with the control image, bit for bit;
- one short LoRA run of `#demo_qwen_edit` (module-scoped, shared by the checks): its samples edit each prompt's
  control image, its validation loss scores the held-out pairs with their controls, and its saved LoRA, loaded by
  diffusers' stock edit pipeline, changes the edit it renders."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from modules.data.controls import ControlImage, sample_controls, text_with_controls
from tests.trainer_helpers import demo_config, train

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]


def processor_of(folder: Path):
    """The folder's `Qwen2VLProcessor`, put together by hand: its constructor needs torchvision, which the tests'
    environment lacks (its tokenizer and image processor are the folder's own)."""
    from transformers import AutoTokenizer, Qwen2VLImageProcessorPil, Qwen2VLProcessor

    processor = object.__new__(Qwen2VLProcessor)
    processor.tokenizer = AutoTokenizer.from_pretrained(folder, subfolder="tokenizer")
    processor.image_processor = Qwen2VLImageProcessorPil.from_pretrained(folder, subfolder="processor")
    processor.video_processor, processor.chat_template = None, None
    processor.image_token, processor.video_token = "<|image_pad|>", "<|video_pad|>"
    processor.image_token_id = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    processor.video_token_id = -1
    return processor


def test_text_with_its_control_is_encoded_as_the_edit_pipeline_encodes_it(tandem_home, tmp_path):
    from diffusers import QwenImageEditPlusPipeline
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import CONDITION_IMAGE_SIZE, calculate_dimensions

    from modules.config.train_config import ModelConfig
    from modules.model import load_model

    bundle = load_model(ModelConfig(base_model="builtin:demo-qwen_edit"))
    folder = bundle.family.build_demo()
    control = Image.new("RGB", (96, 64), (200, 0, 0))
    control.putpixel((3, 3), (0, 0, 255))
    control.save(tmp_path / "before.png")
    pipeline = QwenImageEditPlusPipeline.from_pretrained(folder, processor=processor_of(folder))
    width, height = calculate_dimensions(CONDITION_IMAGE_SIZE, 96 / 64)
    expected, _ = pipeline.encode_prompt(prompt=["make the circle red"],
                                         image=[pipeline.image_processor.resize(control, height, width)])
    text = text_with_controls("make the circle red", (ControlImage(tmp_path / "before.png", 96, 64, "-"),))
    ours = bundle.encode_text([text])["encoder_hidden_states"]
    assert ours.shape == expected.shape and ours.shape[1] > 100  # the image's tokens are in it
    torch.testing.assert_close(ours, expected, rtol=0, atol=0)
    plain = bundle.encode_text(["make the circle red"])["encoder_hidden_states"]
    assert plain.shape[1] < 20  # without its control, the caption alone


@pytest.fixture(scope="module")
def trained(tandem_home, tmp_path_factory):
    workspace = tmp_path_factory.mktemp("qwen_edit")
    cfg = demo_config(workspace, workspace / "cache", "training.max_steps=6", "training.learning_rate=0.01",
                      "data.validation_fraction=0.1", "training.validation_every_n_steps=6",
                      "sampling.every_n_steps=6", "sampling.inference_steps=2", "save.lora_format=both", preset="#demo_qwen_edit")
    cfg.sampling.prompts = cfg.sampling.prompts[:2]
    trainer = train(cfg)
    return cfg, trainer


def test_samples_edit_each_prompts_control_image(trained):
    cfg, trainer = trained
    samples = sorted((Path(cfg.general.workspace_dir) / "samples").rglob("step-0000006-*.png"))
    assert [p.name for p in samples] == ["step-0000006-0.png", "step-0000006-1.png"]
    assert all(Image.open(p).size == (64, 64) for p in samples)


def test_the_saved_lora_changes_the_edit_diffusers_renders(trained):
    cfg, trainer = trained
    output = Path(trainer.callbacks.of_type("done")[-1]["output"])
    peft_file = output.with_name(output.name.replace(".safetensors", ".peft.safetensors"))
    bundle = trainer.bundle
    pipeline = bundle.family.stock_pipeline(bundle.family.build_demo())
    prompt = cfg.sampling.prompts[0]
    controls = sample_controls(prompt.control)
    embeds, mask = bundle.family.prompt_embeddings(bundle, text_with_controls(prompt.prompt, controls))

    def render():
        with Image.open(controls[0].path) as control:
            image = pipeline(image=[control.convert("RGB")], prompt_embeds=embeds.cpu(), prompt_embeds_mask=mask.cpu(),
                             height=64, width=64, num_inference_steps=2, true_cfg_scale=1.0, output_type="np",
                             generator=torch.Generator().manual_seed(1)).images[0]
        return np.asarray(image)

    base = render()
    pipeline.load_lora_weights(str(peft_file))
    edited = render()
    assert np.abs(edited - base).mean() > 1e-3, "the LoRA changed nothing the pipeline renders"


def test_the_validation_loss_scores_the_held_out_pairs_with_their_controls(trained):
    cfg, trainer = trained
    validation = trainer.validation
    reported = trainer.callbacks.of_type("validation")[-1]
    batch = __import__("modules.data", fromlist=["collate"]).collate(
        [validation.dataset[i] for i in range(len(validation.dataset))])
    assert "control_latents" in batch
    model = trainer.parallel.unwrap(trainer.model)
    with torch.no_grad():
        scored = validation.batch_losses(model, batch).mean().item()
        without = validation.batch_losses(model, {k: v for k, v in batch.items() if k != "control_latents"}).mean().item()
    assert scored == pytest.approx(reported["loss"], rel=1e-4)
    assert abs(scored - without) > 1e-4 * abs(scored)  # the controls change what is scored

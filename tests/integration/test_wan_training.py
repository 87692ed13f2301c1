"""Wan through the real trainer on the built-in tiny model and the demo's clips and images (CPU): the demo preset's
loss falls, and the saved LoRA, in both layouts, loads into diffusers' WanPipeline with the weights trained.
2 trainer runs. N processes x B == 1 x N*B, clips sampled from 2 processes and the peft file in diffusers are
tests/integration/test_family_training.py's, as for every family; context parallelism: tests/unit/test_context_parallel.py."""
from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from modules.trainer.callbacks import RecordingCallbacks
from modules.util.animation import read_frames
from tests.trainer_helpers import demo_config, train

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800), pytest.mark.usefixtures("one_torch_thread")]

LORA_TARGETS = 'training.lora_target_modules=["to_q","to_k","to_v","to_out.0","ffn.net.0.proj","ffn.net.2"]'


def config(workspace: Path, cache: Path, *overrides: str, method: str = "lora"):
    return demo_config(workspace, cache, "training.precision=fp32", *overrides, method=method, preset="#demo_wan")


def test_the_demo_preset_trains_and_its_loss_falls(tandem_home, tmp_path):
    """The preset's full fine-tune on the demo clips and images: the loss of the last steps is clearly below the
    first steps'; the clips cache 3 latent frames (9 frames at 8 fps), the images 1; the samples render as clips
    of the preset's 9 frames (sampling.video_frames), written as animated WebPs played at data.video_fps and
    logged to TensorBoard as animated GIFs."""
    callbacks = RecordingCallbacks()
    trainer = train(config(tmp_path / "ws", tmp_path / "cache", "training.max_steps=40",
                           "training.learning_rate=0.002", "sampling.every_n_steps=40", "sampling.inference_steps=2",
                           "general.tensorboard=true", method="full"), callbacks)
    samples = sorted((tmp_path / "ws" / "samples").rglob("step-*"))
    assert [p.name for p in samples] == ["step-0000040-0.webp", "step-0000040-1.webp"]
    assert [e["path"] for e in callbacks.of_type("sample")] == [str(p) for p in samples]
    for path in samples:
        with Image.open(path) as clip:
            assert (clip.format, clip.is_animated, clip.size, clip.info["loop"]) == ("WEBP", True, (64, 64), 0)
        # 9 frames of 125 ms (8 fps); equal neighbours (the demo VAE's frames between its latent frames may be)
        # are stored once for their summed time.
        assert sum(ms for _, ms in read_frames(path)) == 9 * 125
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    logs = EventAccumulator(str(trainer.paths.tensorboard / trainer.run_id), size_guidance={"images": 0}).Reload()
    for tag in ("sample/0", "sample/1"):
        (event,) = logs.Images(tag)
        with Image.open(io.BytesIO(event.encoded_image_string)) as gif:
            assert (event.step, gif.format, gif.is_animated, gif.size) == (40, "GIF", True, (64, 64))
        frames = read_frames(io.BytesIO(event.encoded_image_string))
        # GIF counts hundredths of a second: each stored frame's time is rounded down to 10 ms.
        assert 9 * 125 - 10 * len(frames) <= sum(ms for _, ms in frames) <= 9 * 125
    losses = [event["loss"] for event in callbacks.of_type("loss")]
    assert len(losses) == 40
    first, last = sum(losses[:8]) / 8, sum(losses[-8:]) / 8
    assert last < 0.8 * first, losses
    frames = {load_file(path)["mean"].shape[1] for path in (tmp_path / "cache" / "latents").glob("*.safetensors")}
    assert frames == {1, 3}


def test_the_lora_loads_in_wan_pipeline_in_both_layouts(tandem_home, tmp_path):
    """The LoRA, saved in the kohya layout (diffusion_model.* original names) and in peft's, loads into diffusers'
    WanPipeline: each makes the transformer compute what the base weights plus (alpha / rank) B A of the trained
    adapters compute; and Tandem reads its kohya file back as its peft file."""
    from diffusers import WanPipeline

    common = ("training.max_steps=2", "save.lora_format=both", "save.output_name=tiny", "optimizer.name=sgd",
              "training.learning_rate=0.05", "training.batch_size=8", LORA_TARGETS)
    train(config(tmp_path / "one", tmp_path / "cache", *common))

    output = tmp_path / "one" / "output"
    peft = load_file(output / "tiny.peft.safetensors")
    demo = tandem_home / "demo-wan"
    torch.manual_seed(0)
    x, text, t = torch.randn(1, 16, 2, 8, 8), torch.randn(1, 16, 32), torch.tensor([500.0])

    def transformer_output(pipe):
        with torch.no_grad():
            return pipe.transformer(hidden_states=x, timestep=t, encoder_hidden_states=text, return_dict=False)[0]

    # What the trained adapters make of the base weights: W + (alpha / rank) B A, by hand.
    expected_pipe = WanPipeline.from_pretrained(demo)
    state = expected_pipe.transformer.state_dict()
    scale = float(load_file(output / "tiny.safetensors")["diffusion_model.blocks.0.self_attn.q.alpha"]) / 16
    adapted = {k.removeprefix("transformer.").removesuffix(".lora_A.weight") for k in peft if ".lora_A." in k}
    assert len(adapted) == 2 * 10  # 2 blocks x (4 self-attention + 4 cross-attention + 2 feed-forward)
    for module in adapted:
        delta = peft[f"transformer.{module}.lora_B.weight"] @ peft[f"transformer.{module}.lora_A.weight"]
        state[f"{module}.weight"] += scale * delta
    expected_pipe.transformer.load_state_dict(state)
    expected = transformer_output(expected_pipe)
    base = transformer_output(WanPipeline.from_pretrained(demo))
    assert (expected - base).abs().max() > 2e-4  # the adapters changed it, 20x the tolerance below
    for name in ("tiny.safetensors", "tiny.peft.safetensors"):
        pipe = WanPipeline.from_pretrained(demo)
        pipe.load_lora_weights(output / name)
        torch.testing.assert_close(transformer_output(pipe), expected, atol=1e-5, rtol=1e-5, msg=name)

    # Tandem reads its own kohya file back (training.lora_init): the weights and alpha of the peft file.
    from modules.config.train_config import ModelConfig
    from modules.model import load_model
    from modules.model.lora_reading import read_lora

    bundle = load_model(ModelConfig(base_model="builtin:demo-wan"))
    kohya, peft_read = read_lora(output / "tiny.safetensors", bundle), read_lora(output / "tiny.peft.safetensors", bundle)
    assert kohya.layout == "kohya" and kohya.alpha == peft_read.alpha == {"transformer": 16.0}
    assert kohya.state.keys() == peft_read.state.keys()
    for component, weights in peft_read.state.items():
        assert weights.keys() == kohya.state[component].keys()
        assert all(torch.equal(weights[k], kohya.state[component][k]) for k in weights)


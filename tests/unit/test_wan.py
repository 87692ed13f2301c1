"""Wan 2.1: the family's pieces (the demo VAE's frames, the objective's draw and shift, the LoRA names) and
video data (clip windows, bad clips named and skipped, clips and images in one dataset), without training;
the training runs are in test_wan_training.py."""
from __future__ import annotations

import logging
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from modules.config import ConfigError, load_config
from modules.config.train_config import ConceptConfig, DataConfig
from modules.data.concepts import scan_concepts
from modules.data.dataset import TrainDataset, build_dataset, collate
from modules.data.video import Window, load_clip, probe_clip, write_clip
from modules.data.buckets import plan_crop
from modules.model.families import family
from modules.model.families.wan import original_module_name, scheduler_shift
from modules.util.batch_slice import BatchSlice

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def solid_frames(colours, side=32):
    return [np.full((side, side, 3), colour, dtype=np.uint8) for colour in colours]


def clip(folder, name, frames, fps=16, caption="a clip"):
    path = folder / name
    write_clip(path, frames, fps)
    (folder / f"{path.stem}.txt").write_text(caption, encoding="utf-8")
    return path


# ---------------------------------------------------------------------------------------------- the family

def test_the_demo_vae_codes_the_first_frame_and_one_in_four_after_it(tandem_home):
    """Latent frame k of a clip is the thumbnail of video frame 4k (k >= 1) and frame 0 of the first, so the
    demo's samples show what the transformer learned of motion."""
    from diffusers import AutoencoderKLWan

    wan = family("wan")
    vae = AutoencoderKLWan.from_pretrained(wan.build_demo() / "vae")
    colours = [(220, 40, 40), (40, 170, 60), (40, 70, 210), (235, 210, 40), (240, 140, 30),
               (140, 60, 180), (245, 245, 245), (20, 20, 20), (40, 170, 60)]
    pixels = torch.tensor(np.stack(solid_frames(colours, 16)), dtype=torch.float32).permute(3, 0, 1, 2) / 127.5 - 1
    bundle = SimpleNamespace(vae=vae)
    with torch.no_grad():
        mean, _ = wan.encode_latent_distribution(bundle, pixels.unsqueeze(0))
        decoded = wan.decode_latents(bundle, mean)
    assert mean.shape == (1, 16, 3, 2, 2)  # 9 frames -> 1 + 8 / 4 latent frames; 16 px -> 2
    for latent_frame, video_frame in ((0, 0), (1, 4), (2, 8)):
        expected = pixels[:, video_frame, 0, 0]
        assert torch.allclose(decoded[0, :, 4 * latent_frame, 0, 0], expected, atol=0.02), (latent_frame, video_frame)
    image = pixels[:, :1]  # one frame: an image, [B, 3, H, W] in and out
    with torch.no_grad():
        latents, _ = wan.encode_latent_distribution(bundle, image.squeeze(1).unsqueeze(0))
        assert latents.shape == (1, 16, 1, 2, 2)
        assert wan.decode_latents(bundle, latents).shape == (1, 3, 16, 16)


def test_the_objective_draws_video_noise_per_global_batch_and_shifts_as_the_scheduler():
    """2 ranks x 2 clips draw what 1 rank x 4 does; offset noise is one value per channel over all frames; t is
    shifted by the scheduler's fixed shift (UniPC's flow_shift, a flow-match Euler scheduler's shift)."""
    from modules.model.families.wan import WanObjective

    bundle = SimpleNamespace(noise_scheduler=SimpleNamespace(config={"flow_shift": 3.0, "shift": 1.0}))
    objective = WanObjective(bundle)
    shape = (2, 4, 3, 4, 4)
    whole = objective.draw((4, *shape[1:]), 7, 1, 0, BatchSlice(0, 4, 4), torch.device("cpu"), offset_noise=0.5)
    halves = [objective.draw(shape, 7, 1, 0, BatchSlice(o, 2, 4), torch.device("cpu"), offset_noise=0.5) for o in (0, 2)]
    assert torch.equal(torch.cat([h.noise for h in halves]), whole.noise)
    assert torch.equal(torch.cat([h.timesteps for h in halves]), whole.timesteps)
    plain = WanObjective(SimpleNamespace(noise_scheduler=SimpleNamespace(config={"shift": 1.0})))
    raw = plain.draw((4, *shape[1:]), 7, 1, 0, BatchSlice(0, 4, 4), torch.device("cpu"), offset_noise=0.5).timesteps
    assert torch.allclose(whole.timesteps, 3 * raw / (1 + 2 * raw))
    assert scheduler_shift({"shift": 5.0}) == 5.0 and scheduler_shift({"flow_shift": 3.0}) == 3.0
    # The offset (one normal draw per sample and channel) moves every frame's mean alike.
    assert whole.noise.mean(dim=(3, 4)).std(dim=2).max() < whole.noise.mean(dim=(2, 3, 4)).abs().max() + 1


def test_lora_modules_take_the_original_wan_names_and_others_are_refused():
    assert original_module_name("blocks.3.attn1.to_q") == "blocks.3.self_attn.q"
    assert original_module_name("blocks.0.attn2.to_out.0") == "blocks.0.cross_attn.o"
    assert original_module_name("blocks.12.ffn.net.0.proj") == "blocks.12.ffn.0"
    with pytest.raises(ValueError, match="condition_embedder.time_proj.*save.lora_format to peft"):
        original_module_name("condition_embedder.time_proj")


def test_clip_lengths_wan_cannot_take_are_refused_and_image_families_refuse_clips(tmp_path):
    with pytest.raises(ConfigError, match=r"data.video_frames: 8 is not 4k \+ 1.*set it to 9"):
        load_config("#demo_wan", ["data.video_frames=8", f"general.workspace_dir={tmp_path}"])
    with pytest.raises(ValueError, match=r"set it to 13"):
        family("wan").check_clips([], 12)
    family("wan").check_clips([tmp_path / "a.mp4"], 17)
    with pytest.raises(ValueError, match=r"Flux.1 .* trains images only.*a\.mp4.*train a video model \(Wan"):
        family("flux").check_clips([tmp_path / "a.mp4"], 17)
    family("flux").check_clips([], 17)


def test_video_sample_lengths_wan_cannot_render_are_refused_and_image_families_ignore_the_field(tmp_path):
    with pytest.raises(ConfigError, match=r"sampling.video_frames: 10 is not 4k \+ 1.*set it to 9"):
        load_config("#demo_wan", ["sampling.video_frames=10", f"general.workspace_dir={tmp_path}"])
    for frames in (1, 5, 17):  # 1: a still image
        assert load_config("#demo_wan", [f"sampling.video_frames={frames}",
                                         f"general.workspace_dir={tmp_path}"]).sampling.video_frames == frames
    assert load_config("#demo_wan", [f"general.workspace_dir={tmp_path}"]).sampling.video_frames == 9
    # An image family renders images whatever the field says.
    assert load_config("#demo", ["sampling.video_frames=10", f"general.workspace_dir={tmp_path}"])


# ---------------------------------------------------------------------------------------------- video data

def test_a_clip_window_is_taken_at_the_configured_rate_and_fixed_by_its_seed(tmp_path):
    window = Window(frames=5, fps=8.0)
    indices = window.indices(30, 16.0, random.Random("a"))
    assert indices == window.indices(30, 16.0, random.Random("a"))
    assert [b - a for a, b in zip(indices, indices[1:])] == [2, 2, 2, 2]  # 16 fps source, 8 fps window
    assert 0 <= indices[0] and indices[-1] < 30
    starts = {window.indices(30, 16.0, random.Random(seed))[0] for seed in range(50)}
    assert min(starts) == 0 and max(starts) == 30 - 9  # every start that fits, none that does not
    colours = [(10 * k, 0, 0) for k in range(12)]
    path = clip(tmp_path, "ramp.mp4", solid_frames(colours), fps=16)
    pixels = load_clip(path, plan_crop(32, 32, (16, 16)), (1, 3, 3, 11))
    assert pixels.shape == (3, 4, 16, 16)
    red = (pixels[0, :, 8, 8] + 1) * 127.5
    assert torch.allclose(red, torch.tensor([10.0, 30, 30, 110]), atol=4)


def test_bad_clips_are_named_once_and_skipped(tmp_path, caplog):
    """A truncated clip, a file that is no video and one too short for the window are each named in one warning
    with the reason; the good clip and the image train."""
    from PIL import Image

    good = clip(tmp_path, "good.mp4", solid_frames([(200, 0, 0)] * 20))
    short = clip(tmp_path, "short.mp4", solid_frames([(0, 200, 0)] * 4))
    whole = clip(tmp_path, "cut.mp4", solid_frames([(0, 0, 200)] * 20)).read_bytes()
    (tmp_path / "cut.mp4").write_bytes(whole[: len(whole) // 3])
    (tmp_path / "noise.webm").write_bytes(bytes(range(256)) * 8)
    (tmp_path / "empty.mov").write_bytes(b"")
    Image.new("RGB", (32, 32), (9, 9, 9)).save(tmp_path / "still.png")
    caplog.set_level(logging.WARNING)
    scan = scan_concepts([ConceptConfig(path=str(tmp_path))], window=Window(frames=9, fps=16.0))
    assert sorted(im.path.name for im in scan.images) == ["good.mp4", "still.png"]
    text = caplog.text
    for name, reason in (("short.mp4", "too short for data.video_frames=9"), ("cut.mp4", "unreadable clip"),
                         ("noise.webm", "unreadable clip"), ("empty.mov", "the file is empty")):
        assert text.count(name) == 1, (name, text)
        assert reason in [line for line in text.splitlines() if name in line][0], (name, text)
    assert "Skipped 4 unreadable image(s) or clip(s) of 6" in text
    assert probe_clip(good, Window(frames=9, fps=16.0)).frame_count == 20


def test_clips_and_images_share_a_dataset_in_buckets_of_their_own(tmp_path):
    from PIL import Image

    for k in range(2):
        clip(tmp_path, f"clip{k}.mp4", solid_frames([(200, 10 * k, 0)] * 20), caption=f"clip {k}")
        Image.new("RGB", (32, 32), (0, 10 * k, 200)).save(tmp_path / f"still{k}.png")
    data = DataConfig(concepts=[ConceptConfig(path=str(tmp_path))], resolution=32, bucket_step=16,
                      aspect_bucketing=False, cache_latents=False, video_frames=9, video_fps=8.0)
    dataset = build_dataset(data, tmp_path / "cache", seed=3)
    assert len(set(dataset.buckets)) == 2
    items = {dataset.images[i].path.name: dataset[n] for n, i in enumerate(dataset.item_images)}
    assert items["clip0.mp4"]["pixels"].shape == (3, 9, 32, 32)
    assert items["still0.png"]["pixels"].shape == (3, 32, 32)
    batch = collate([items["clip0.mp4"], items["clip1.mp4"]])
    assert batch["pixels"].shape == (2, 3, 9, 32, 32)
    assert [p.name for p in dataset.clip_paths()] == ["clip0.mp4", "clip1.mp4"]
    again = TrainDataset(dataset.scan(), dataset.bucket_sizes, data, tmp_path / "cache", seed=3)
    assert again._frames(0) == dataset._frames(0)  # a window is fixed by the clip and the seed


def test_the_demo_clips_are_moving_shapes_with_captions(tandem_home):
    from modules.data.demo_clips import COUNT, FRAMES, ensure_demo_clips

    root = ensure_demo_clips()
    clips = sorted(root.glob("*.mp4"))
    assert len(clips) == COUNT
    info = probe_clip(clips[0], Window(frames=FRAMES, fps=16.0))
    assert (info.width, info.height, info.frame_count, info.frame_rate) == (64, 64, FRAMES, 16.0)
    caption = (root / f"{clips[0].stem}.txt").read_text()
    assert caption.startswith("a red circle moving right on a ")
    frames = load_clip(clips[0], plan_crop(64, 64, (64, 64)), (0, FRAMES - 1))
    assert (frames[:, 0] - frames[:, 1]).abs().amax() > 1.0  # the shape moved


@pytest.mark.parametrize("model,params,channels,side", [("wan-1.3b", 1.42e9, 16, 8), ("wan-14b", 14.3e9, 16, 8),
                                                        ("wan-a14b", 14.3e9, 16, 8), ("wan-ti2v-5b", 5.0e9, 48, 4)])
def test_benchmark_models_are_the_published_sizes_and_take_video_latents(model, params, channels, side):
    """scripts/benchmark.py --model wan-1.3b|wan-14b|wan-a14b|wan-ti2v-5b (scripts/gpu/wan.sh): the real-size
    transformer (on the meta device; A14B's trained expert) has the published parameter count and takes the
    synthetic clips of `data.video_frames` frames (TI2V 5B: 48 channels at 1/16 of each side)."""
    from modules.benchmark.cli import MODEL_ALIASES, model_variant
    from modules.benchmark.synthetic import SyntheticCachedLatents, random_bundle
    from modules.config.train_config import TrainingConfig

    name, variant = MODEL_ALIASES[model], model_variant(model)
    bundle = random_bundle(name, torch.device("meta"), torch.bfloat16, variant)
    count = sum(p.numel() for p in bundle.denoiser.parameters())
    assert abs(count - params) < 0.03 * params, count
    item = SyntheticCachedLatents(name, 64, 2, variant=variant, frames=81)[0]
    assert item["latents"].shape == (channels, 21, side, side)
    assert item["text"]["encoder_hidden_states"].shape == (512, 4096)
    assert SyntheticCachedLatents("flux", 64, 2, frames=81)[0]["latents"].shape == (16, 8, 8)  # images: no frame axis
    objective = bundle.family.objective(bundle, TrainingConfig())
    meta = lambda t: torch.empty((1, *t.shape), device="meta", dtype=torch.bfloat16)  # noqa: E731
    out = objective.predict(bundle.denoiser, meta(item["latents"]), torch.empty(1, device="meta"),
                            {k: meta(v) for k, v in item["text"].items()})
    assert out.shape == (1, *item["latents"].shape)


def test_a_tiny_random_model_folder_loads_as_wan(tandem_home, tmp_path):
    """make_random_model.py --type wan writes what the releases hold (UniPC scheduler with flow_shift, UMT5);
    built here at a tiny size through the same code, it loads back as a Wan model whose objective shifts by 3."""
    from modules.config.train_config import ModelConfig
    from modules.model import load_model

    tiny = {"transformer": {"num_attention_heads": 2, "attention_head_dim": 12, "ffn_dim": 32, "num_layers": 1,
                            "text_dim": 16, "freq_dim": 16},
            "vae": {"base_dim": 8, "num_res_blocks": 1},
            "text_encoder": {"d_model": 16, "d_ff": 32, "d_kv": 4, "num_heads": 4, "num_layers": 1}}
    folder = family("wan").write_random_model(tmp_path / "random-wan", torch.float32, configs=tiny)
    bundle = load_model(ModelConfig(base_model=str(folder)))
    assert bundle.model_type == "wan" and type(bundle.noise_scheduler).__name__ == "UniPCMultistepScheduler"
    assert type(bundle.text_encoders[0]).__name__ == "UMT5EncoderModel"
    assert scheduler_shift(bundle.noise_scheduler.config) == 3.0
    text = bundle.encode_text(["a cat"])["encoder_hidden_states"]
    assert text.shape == (1, 512, 16) and text[0, 10:].abs().max() == 0  # zero past the caption's tokens

"""A video family's samples: rendered as clips of `sampling.video_frames` frames, written as looping animated WebPs
beside the image samples' PNGs, logged to TensorBoard as animated GIFs, and able to cross processes (each rank
renders its share of the prompts). The trainer's whole path on the demo Wan: tests/integration/test_wan_training.py."""
from __future__ import annotations

import io
import pickle
from types import SimpleNamespace

import pytest
from PIL import Image

from modules.config.train_config import SamplePromptConfig
from modules.trainer.outputs import sample_suffix, write_sample
from modules.trainer.progress import ProgressReporter
from modules.util.animation import Clip, read_frames


def clip(frames: int = 5, fps: float = 8.0) -> Clip:
    """A square moving right, one colour per frame."""
    pictures = []
    for k in range(frames):
        picture = Image.new("RGB", (32, 16), (20 * k, 40, 200 - 20 * k))
        picture.paste((255, 255, 0), (4 * k, 4, 4 * k + 6, 10))
        pictures.append(picture)
    return Clip(tuple(pictures), fps)


def test_a_clip_is_a_looping_animated_webp_and_an_image_stays_a_png(tmp_path):
    sample = clip(5, 8.0)
    assert sample_suffix(sample) == ".webp" and sample_suffix(sample.frames[0]) == ".png"
    write_sample(sample, tmp_path / "a.webp")
    write_sample(sample.frames[0], tmp_path / "b.png")
    with Image.open(tmp_path / "a.webp") as webp:
        assert (webp.format, webp.is_animated, webp.n_frames, webp.size, webp.info["loop"]) == \
            ("WEBP", True, 5, (32, 16), 0)
    frames = read_frames(tmp_path / "a.webp")
    assert [ms for _, ms in frames] == [125] * 5  # 8 fps
    # Lossless: the frames as rendered.
    assert [f.tobytes() for f, _ in frames] == [f.tobytes() for f in sample.frames]
    with Image.open(tmp_path / "b.png") as png:
        assert (png.format, getattr(png, "n_frames", 1)) == ("PNG", 1)
    assert [(f.size, ms) for f, ms in read_frames(tmp_path / "b.png")] == [((32, 16), 0)]


def test_identical_frames_are_stored_once_and_shown_for_their_summed_time(tmp_path):
    """libwebp's and Pillow's GIF encoder merge a run of equal frames: the clip still plays frames / fps seconds."""
    first, *rest = clip(3).frames
    sample = Clip((first, first, first, *rest), 8.0)
    write_sample(sample, tmp_path / "a.webp")
    assert [ms for _, ms in read_frames(tmp_path / "a.webp")] == [375, 125, 125]
    (tmp_path / "a.gif").write_bytes(sample.gif_bytes())
    assert [ms for _, ms in read_frames(tmp_path / "a.gif")] == [370, 120, 120]  # GIF counts hundredths


def test_a_clip_has_frames_to_play_at_a_positive_rate():
    with pytest.raises(ValueError, match="at least 2 frames"):
        Clip((Image.new("RGB", (8, 8)),), 16.0)
    with pytest.raises(ValueError, match="frame rate must be above 0"):
        Clip(clip().frames, 0.0)


def test_a_clip_crosses_processes_whole():
    """Ranks send their rendered samples to rank 0 pickled (`dist_utils.gather_objects`)."""
    sample = clip(3)
    back = pickle.loads(pickle.dumps(sample))
    assert back.fps == sample.fps and [f.tobytes() for f in back.frames] == [f.tobytes() for f in sample.frames]


def test_tensorboard_gets_a_clip_as_an_animated_image_and_an_image_as_before(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    numbers = SimpleNamespace(total_steps=10, global_batch=8, epochs=1)
    reporter = ProgressReporter(numbers, lambda *a, **k: None, 0, tmp_path, True)
    reporter.log_image("sample/0", clip(5), 3)
    reporter.log_image("sample/1", clip(2).frames[0], 3)
    reporter.close()
    logs = EventAccumulator(str(tmp_path), size_guidance={"images": 0}).Reload()
    (video,), (still,) = logs.Images("sample/0"), logs.Images("sample/1")
    with Image.open(io.BytesIO(video.encoded_image_string)) as gif:
        assert (video.step, gif.format, gif.n_frames, gif.info["loop"]) == (3, "GIF", 5, 0)
        assert (video.width, video.height) == gif.size == (32, 16)
    with Image.open(io.BytesIO(still.encoded_image_string)) as png:
        assert (png.format, png.size) == ("PNG", (32, 16))


@pytest.mark.usefixtures("one_torch_thread")
def test_wan_renders_clips_of_the_frames_asked_for_and_one_frame_as_an_image(tandem_home):
    from modules.config.train_config import ModelConfig
    from modules.model import load_model
    from modules.model.sampling import render_samples

    bundle = load_model(ModelConfig(base_model="builtin:demo-wan", t5_max_length=16))
    prompt = SamplePromptConfig(prompt="a red circle moving right", seed=1)
    (five,) = render_samples(bundle, [prompt], 32, inference_steps=1, guidance_scale=1.0, frames=5, fps=8.0)
    assert isinstance(five, Clip) and len(five.frames) == 5 and five.size == (32, 32) and five.fps == 8.0
    (still,) = render_samples(bundle, [prompt], 32, inference_steps=1, guidance_scale=1.0, frames=1)
    assert isinstance(still, Image.Image) and still.size == (32, 32)

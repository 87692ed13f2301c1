"""What the launcher can know about the model's family and a LoRA file is refused before any worker starts, in one
line naming the field, the file and the fix, instead of failing in the workers a minute later or warning about a
setting the model does not use."""
from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from modules.config import load_config
from modules.preflight import PreflightError, check_family, preflight
from modules.util.run_protocol import parse_event_line
from tests.trainer_helpers import overrides_for, run_script

MULTI = ("train_multi_gpu.py", "--device", "cpu", "--num-gpus", "2")


@pytest.fixture(scope="module")
def cache_dir(tandem_home, tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("latent_cache")


def damaged_lora(path: Path) -> Path:
    """A .safetensors file whose header claims a terabyte: safetensors' "header too large"."""
    path.write_bytes(struct.pack("<Q", 10 ** 12) + b"{}" * 16)
    return path


def concept_with_a_short_clip(folder: Path) -> Path:
    from modules.data.video import write_clip
    folder.mkdir(parents=True)
    for i in range(4):
        Image.new("RGB", (64, 64), (60 * i, 30, 200)).save(folder / f"picture{i}.png")
    write_clip(folder / "short.mp4", [np.full((64, 64, 3), 40 * k, np.uint8) for k in range(5)], 8)
    return folder


def demo(tmp_path: Path, *overrides: str):
    return load_config("#demo", [f"general.workspace_dir={tmp_path / 'ws'}", *overrides])


# -- the checks ------------------------------------------------------------------------------------------

def test_context_parallel_with_a_family_that_cannot_split_a_sample_is_refused(tmp_path, tandem_home):
    cfg = demo(tmp_path)
    with pytest.raises(PreflightError, match=r"^multi_gpu.context_parallel: 2 .* Stable Diffusion 1.x cannot .* "
                                             r"Set it to 1.$"):
        preflight(cfg, context_parallel=2)
    preflight(cfg, context_parallel=1)
    check_family(cfg, ("wan",), context_parallel=2)  # a family that can
    with pytest.raises(PreflightError, match="context_parallel"):
        check_family(cfg, ("sd1", "sd2"), context_parallel=2)  # a folder only loading tells apart: neither can


def test_a_damaged_lora_init_file_is_named_with_its_field_before_the_model_loads(tmp_path, tandem_home):
    bad = damaged_lora(tmp_path / "start.safetensors")
    cfg = demo(tmp_path, "training.method=lora", f"training.lora_init={bad}")
    with pytest.raises(PreflightError) as refused:
        preflight(cfg)
    text = str(refused.value)
    assert text.startswith(f"training.lora_init: {str(bad)!r} is not a readable .safetensors file (") \
        and "header too large" in text and "download or copy it again" in text, text
    empty = tmp_path / "empty.safetensors"
    from safetensors.numpy import save_file
    save_file({}, str(empty))
    cfg = demo(tmp_path, "training.method=lora", f"training.lora_init={empty}")
    with pytest.raises(PreflightError, match="holds no tensors"):
        preflight(cfg)


def test_clips_in_an_image_models_concept_are_refused_naming_the_concept_and_the_clips(tmp_path, tandem_home):
    folder = concept_with_a_short_clip(tmp_path / "concept")
    (tmp_path / "images").mkdir()
    cfg = demo(tmp_path, f'data.concepts=[{{"path": "{tmp_path / "images"}"}}, {{"path": "{folder}"}}]')
    with pytest.raises(PreflightError) as refused:
        preflight(cfg)
    text = str(refused.value)
    assert text.startswith(f"data.concepts[1].path: {str(folder)!r} holds 1 video clip(s) (short.mp4), but "
                           "'builtin:demo' is Stable Diffusion 1.x, which trains images only;"), text
    assert "data.video_frames" not in text, "a setting the model does not use"
    check_family(cfg, ("wan",))  # a video family trains them (the scan judges their length)
    cfg.data.concepts[1].enabled = False
    preflight(cfg)


def small_concept(folder: Path, square: int, wide: int = 0) -> Path:
    """`square` 64x64 images and `wide` 128x64 ones (another aspect-ratio bucket at the demo's resolution with
    `data.bucket_step=16`)."""
    folder.mkdir(parents=True)
    for i in range(square + wide):
        Image.new("RGB", (64, 64) if i < square else (128, 64), (40 * i, 90, 160)).save(folder / f"image{i}.png")
    return folder


def test_data_that_fills_no_step_is_refused_in_the_windows_words_before_the_model_loads(tmp_path, tandem_home):
    """Issue 55, item 4: the sampler refused it after the model loaded, as "ValueError: ... training.batch_size
    ... data.aspect_bucketing ... Use fewer GPUs" on one CPU process."""
    from modules.config.field_labels import field_label
    from modules.preflight import check_data
    folder = small_concept(tmp_path / "three", square=3)
    cfg = demo(tmp_path, f'data.concepts=[{{"path": "{folder}"}}]', "training.batch_size=4")
    with pytest.raises(PreflightError) as refused:
        check_data(cfg)
    window, command_line = refused.value.in_window, str(refused.value)
    batch, repeats = field_label("training.batch_size"), field_label("data.concepts[0].repeats")
    assert window == (f"The 3 training images (repeats counted) give no full batches of 4, and one step takes 4 "
                      f"images: {batch} 4. To train, lower {batch}, raise a concept's {repeats} or add images."), window
    assert command_line == window.replace(batch, f"{batch} (training.batch_size)").replace(
        repeats, f"{repeats} (data.concepts[].repeats)"), command_line
    # Only what helps: one process has no GPUs to drop, one bucket no buckets to merge.
    for advice in ("GPUs", "ValueError", "aspect", "Aspect"):
        assert advice not in window, f"{advice!r} in {window!r}"
    check_data(demo(tmp_path, f'data.concepts=[{{"path": "{folder}"}}]', "training.batch_size=3"))  # one step: fine

    # Two buckets of 2 that would fill a batch of 4 together; with 2 processes and accumulation, each is named.
    mixed = small_concept(tmp_path / "mixed", square=2, wide=2)
    cfg = demo(tmp_path, f'data.concepts=[{{"path": "{mixed}"}}]', "data.bucket_step=16", "training.batch_size=2",
               "training.gradient_accumulation_steps=2")
    with pytest.raises(PreflightError) as refused:
        check_data(cfg, data_world=2)
    buckets, accumulation = field_label("data.aspect_bucketing"), field_label("training.gradient_accumulation_steps")
    window = refused.value.in_window
    assert f"one step takes 2 batches of 4: {batch} 2 x 2 processes x {accumulation} 2." in window, window
    assert f"with {buckets} on, a batch comes from one bucket: 2 at 64x64, 2 at " in window, window
    assert "train on fewer GPUs" in window and f"turn off {buckets}" not in window, window  # 4 images < 8 a step
    cfg = demo(tmp_path, f'data.concepts=[{{"path": "{mixed}"}}]', "data.bucket_step=16", "training.batch_size=4")
    with pytest.raises(PreflightError) as refused:
        check_data(cfg)  # 4 images, a batch of 4: in one bucket they would fill it
    assert f"turn off {buckets} to put all images in one bucket" in refused.value.in_window
    assert "fewer GPUs" not in refused.value.in_window


# -- through both scripts: refused before any worker (or, in one process, the trainer) starts -------------

def human_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.strip() and parse_event_line(line) is None]


def _refused(result, workspace: Path) -> str:
    """The one line a refused start printed; fails naming what was printed and what was started instead."""
    output = result.stdout + result.stderr
    assert result.returncode == 2 and "Traceback" not in output, f"exit {result.returncode}:\n{output[-4000:]}"
    lines = [line for line in human_lines(output) if not line.startswith("CPU threads:")]
    assert len(lines) == 1 and lines[0].startswith("error: "), output[-4000:]
    started = [p for p in (workspace / ".tandem" / "launch.json", workspace / ".tandem" / "workers",
                           workspace / ".tandem" / "failures", workspace / "config") if p.exists()]
    assert not started, f"something started before the refusal: {started}\n{output[-4000:]}"
    return lines[0]


SCRIPTS = [("train.py",), MULTI]


@pytest.mark.slow
def test_context_parallel_that_the_model_cannot_use_is_refused_by_the_launcher(tmp_path, cache_dir):
    """Only the multi-process launcher: `scripts/train.py` trains in one process whatever multi_gpu says."""
    ws = tmp_path / "ws"
    result = run_script(*MULTI, "--config-path", "#demo", *overrides_for(ws, cache_dir, "multi_gpu.context_parallel=2"))
    line = _refused(result, ws)
    assert line.startswith("error: multi_gpu.context_parallel: 2 ") and "Stable Diffusion 1.x cannot" in line, line


@pytest.mark.slow
def test_a_damaged_lora_init_file_is_refused_before_any_worker_starts(tmp_path, cache_dir):
    """Through `scripts/train.py`. The file is checked by `preflight`, which both scripts call before anything
    starts: the launcher's call is run by the clips and context-parallel tests below."""
    ws = tmp_path / "ws"
    bad = damaged_lora(tmp_path / "start.safetensors")
    result = run_script("train.py", "--config-path", "#demo", *overrides_for(ws, cache_dir, f"training.lora_init={bad}"))
    line = _refused(result, ws)
    assert line.startswith(f"error: training.lora_init: {str(bad)!r} is not a readable .safetensors file"), line


@pytest.mark.slow
def test_clips_in_an_image_models_concept_are_refused_before_any_worker_starts(tmp_path, cache_dir):
    """Through the multi-process launcher; `preflight` refuses them, as it refuses the damaged LoRA file above
    for `scripts/train.py`."""
    ws = tmp_path / "ws"
    folder = concept_with_a_short_clip(tmp_path / "concept")
    result = run_script(*MULTI, "--config-path", "#demo",
                        *overrides_for(ws, cache_dir, f'data.concepts=[{{"path": "{folder}"}}]'))
    line = _refused(result, ws)
    assert line.startswith(f"error: data.concepts[0].path: {str(folder)!r} holds 1 video clip(s) (short.mp4)"), line
    assert "too short" not in result.stdout + result.stderr


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS)
def test_data_that_fills_no_step_is_refused_before_the_model_loads_in_config_words(tmp_path, cache_dir, script):
    """The command line names the label and the path; the window's error event the label alone."""
    ws = tmp_path / "ws"
    folder = small_concept(tmp_path / "three", square=3)
    result = run_script(*script, "--config-path", "#demo",
                        *overrides_for(ws, cache_dir, f'data.concepts=[{{"path": "{folder}"}}]', "training.batch_size=4"))
    line = _refused(result, ws)
    assert line.startswith("error: The 3 training images (repeats counted) give no full batches of ") \
        and "Batch size per GPU (training.batch_size) 4" in line, line
    errors = [event for event in map(parse_event_line, (result.stdout + result.stderr).splitlines())
              if event is not None and event.get("type") == "error"]
    assert [e["text"] for e in errors] == [line[len("error: "):].replace(" (training.batch_size)", "").replace(
        " (data.concepts[].repeats)", "")], errors

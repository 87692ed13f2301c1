"""What the launcher can know about the model's family and a LoRA file is refused before any worker starts, in one
line naming the field, the file and the fix (issue 54, item 16: these failed in the workers 58-122 s later, or
warned about a setting the model does not use)."""
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
@pytest.mark.parametrize("script", SCRIPTS)
def test_a_damaged_lora_init_file_is_refused_before_any_worker_starts(tmp_path, cache_dir, script):
    ws = tmp_path / "ws"
    bad = damaged_lora(tmp_path / "start.safetensors")
    result = run_script(*script, "--config-path", "#demo", *overrides_for(ws, cache_dir, f"training.lora_init={bad}"))
    line = _refused(result, ws)
    assert line.startswith(f"error: training.lora_init: {str(bad)!r} is not a readable .safetensors file"), line


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS)
def test_clips_in_an_image_models_concept_are_refused_before_any_worker_starts(tmp_path, cache_dir, script):
    ws = tmp_path / "ws"
    folder = concept_with_a_short_clip(tmp_path / "concept")
    result = run_script(*script, "--config-path", "#demo",
                        *overrides_for(ws, cache_dir, f'data.concepts=[{{"path": "{folder}"}}]'))
    line = _refused(result, ws)
    assert line.startswith(f"error: data.concepts[0].path: {str(folder)!r} holds 1 video clip(s) (short.mp4)"), line
    assert "too short" not in result.stdout + result.stderr

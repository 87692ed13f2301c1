"""Bad input through the real scripts: one clear message (no traceback) before any worker starts, and
warnings about the data once per run, whichever launcher."""
from __future__ import annotations

from pathlib import Path

import pytest
from PIL import Image

from modules.trainer.callbacks import parse_event_line
from tests.trainer_helpers import overrides_for, run_script

MULTI = ("train_multi_gpu.py", "--device", "cpu", "--num-gpus", "2")


@pytest.fixture(scope="module")
def cache_dir(tandem_home, tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("latent_cache")


def human_lines(output: str) -> list[str]:
    """What a person reads: the output without event lines (the GUI's protocol) and progress bars."""
    return [line for line in output.splitlines() if line.strip() and parse_event_line(line) is None]


def concept(folder: Path) -> str:
    return f'data.concepts=[{{"path": "{folder}"}}]'


def write_pictures(folder: Path, count: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        Image.new("RGB", (64, 64), (60 * i % 256, 30, 200)).save(folder / f"picture{i}.png")


@pytest.mark.parametrize("script", [("train.py",), MULTI])
def test_empty_dataset_is_one_line(tmp_path, cache_dir, script):
    empty = tmp_path / "empty"
    empty.mkdir()
    result = run_script(*script, "--config-path", "#demo", *overrides_for(tmp_path / "ws", cache_dir, concept(empty)))
    assert result.returncode == 2
    output = result.stdout + result.stderr
    assert "Traceback" not in output
    (line,) = human_lines(output)
    assert line.startswith("error: No usable image found in the concept folders") and str(empty) in line


def test_only_unreadable_images_one_warning_each_then_one_error(tmp_path, cache_dir):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "noise.png").write_bytes(b"\x89PNG not really")
    (bad / "nothing.jpg").write_bytes(b"")
    result = run_script(*MULTI, "--config-path", "#demo", *overrides_for(tmp_path / "ws", cache_dir, concept(bad)))
    assert result.returncode == 2
    lines = human_lines(result.stdout + result.stderr)
    assert lines == [
        f"Skipping unreadable image {bad / 'noise.png'}: not an image format PIL can read (damaged, or not an image)",
        f"Skipping unreadable image {bad / 'nothing.jpg'}: the file is empty",
        f"Skipped 2 unreadable image(s) of 2 in {bad} (each named above).",
        f"error: No usable image found in the concept folders '{bad}' (the 2 image file(s) there are unreadable, "
        "see above). Add .png/.jpg/.jpeg/.webp images there, fix data.concepts[].path, or enable a concept that "
        "has images."]


@pytest.mark.parametrize("launcher", ["spawn", "torchrun"])
def test_data_warnings_come_once_per_run_and_the_run_goes_on(tmp_path, cache_dir, launcher):
    """A cp1252 caption (which aborted the launch) and a broken image: warned about once - by the
    launcher, not again by every rank - and training runs."""
    data = tmp_path / "data"
    write_pictures(data, 4)
    (data / "picture0.txt").write_bytes("caf\u00e9 cr\u00e8me".encode("cp1252"))
    (data / "zz-broken.png").write_bytes(b"garbage")
    result = run_script(*MULTI, *(["--spawn"] if launcher == "spawn" else []), "--config-path", "#demo",
                        *overrides_for(tmp_path / "ws", cache_dir, concept(data), "training.batch_size=1",
                                       "training.max_steps=1"))
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert output.count(f"Caption {data / 'picture0.txt'} is not UTF-8") == 1
    assert output.count(f"Skipping unreadable image {data / 'zz-broken.png'}") == 1
    assert output.count("Skipped 1 unreadable image(s) of 5") == 1

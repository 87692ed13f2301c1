"""Automatic captions from a local model (modules/model/captioner.py, scripts/caption.py), with a tiny random
BLIP built offline: captions only for images without one, every image once over 2 processes, progress per
image, and one clear line for a folder that is no captioning model."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from modules.data.caption_edit import read_folder
from modules.model import captioner
from tests.caption_model import build_tiny_blip
from tests.patience import patience
from tests.test_caption_edit import make_folder

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny_blip(tmp_path_factory):
    return build_tiny_blip(tmp_path_factory.mktemp("models") / "tiny-blip")


def test_shares_over_two_ranks_cover_every_image_once():
    items = [f"img{i}.png" for i in range(7)]
    shares = [captioner.share(items, rank, 2) for rank in range(2)]
    assert sorted(shares[0] + shares[1]) == sorted(items) and not set(shares[0]) & set(shares[1])
    assert [len(s) for s in shares] == [4, 3]
    assert captioner.share(items[:1], 1, 2) == []
    with pytest.raises(ValueError, match="outside"):
        captioner.share(items, 2, 2)


def test_only_uncaptioned_images_are_jobs(tmp_path):
    folder = make_folder(tmp_path / "f", {"a": "kept caption", "b": None, "c": None})
    jobs, left_out = captioner.jobs_for(read_folder(folder), overwrite=False)
    assert [j.image.name for j in jobs] == ["b.png", "c.png"] and left_out == []
    jobs, _ = captioner.jobs_for(read_folder(folder), overwrite=True)
    assert [(j.image.name, j.expected) for j in jobs] == [("a.png", "kept caption"), ("b.png", None), ("c.png", None)]


def _one_line(argv) -> str:
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "caption.py"), *argv], capture_output=True,
                            text=True, timeout=patience(120), cwd=REPO)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


@pytest.mark.slow
def test_bad_model_folders_get_one_line_naming_folder_and_fix(tmp_path):
    images = make_folder(tmp_path / "imgs", {"a": None})
    line = _one_line(["--model", str(tmp_path / "nowhere"), "--folder", str(images)])
    assert line == (f"caption.py: Captioning model folder {tmp_path / 'nowhere'} does not exist: choose "
                    f"{captioner.EXAMPLES}.")
    empty = tmp_path / "empty"
    empty.mkdir()
    line = _one_line(["--model", str(empty), "--folder", str(images)])
    assert f"{empty} is not a captioning model folder (no config.json): choose the folder of a BLIP" in line
    text_only = tmp_path / "bert"
    text_only.mkdir()
    (text_only / "config.json").write_text(json.dumps({"model_type": "bert"}))
    line = _one_line(["--model", str(text_only), "--folder", str(images)])
    assert f"{text_only} holds a 'bert' model, which is not an image-to-text model" in line
    assert "choose the folder of a BLIP, Florence-2 or Qwen2-VL model (its config.json" in line
    line = _one_line(["--model", str(text_only), "--folder", str(tmp_path / "no-images")])
    assert "holds a 'bert' model" in line  # the model is checked first, then the folder


@pytest.mark.slow
def test_script_captions_only_images_without_captions(tiny_blip, tmp_path):
    folder = make_folder(tmp_path / "imgs", {"a": "my own caption", "b": None, "c": None})
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "caption.py"), "--model", str(tiny_blip),
                             "--folder", str(folder), "--prefix", "sks", "--max-new-tokens", "5"],
                            capture_output=True, text=True, timeout=patience(240), cwd=REPO)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == f"2 image(s) to caption in {folder} (1 already captioned are kept; --overwrite replaces them)."
    assert [line.split(" ")[0] for line in lines[1:3]] == ["[1/2]", "[2/2]"]
    assert lines[-1].startswith("Captioned 2 of 2 image(s)")
    assert (folder / "a.txt").read_text() == "my own caption"
    for name in ("b", "c"):
        text = (folder / f"{name}.txt").read_text()
        assert text.startswith("sks, ") and len(text) > len("sks, "), text
    # Nothing left to do: a second run writes nothing.
    again = subprocess.run([sys.executable, str(REPO / "scripts" / "caption.py"), "--model", str(tiny_blip),
                            "--folder", str(folder)], capture_output=True, text=True, timeout=patience(240), cwd=REPO)
    assert again.returncode == 0 and again.stdout.splitlines()[0].startswith("0 image(s) to caption")


@pytest.mark.slow
def test_two_processes_caption_every_image_once_with_progress(tiny_blip, tmp_path):
    names = [f"img{i}" for i in range(5)]
    folder = make_folder(tmp_path / "imgs", {name: None for name in names})
    jobs, _ = captioner.jobs_for(read_folder(folder), overwrite=False)
    events = []
    captioner.run(jobs, captioner.Settings(model=str(tiny_blip), max_new_tokens=4, batch_size=2), processes=2,
                  report=events.append)
    assert sorted(Path(e["image"]).name for e in events) == sorted(f"{n}.png" for n in names)
    assert all("caption" in e for e in events)
    for name in names:
        assert (folder / f"{name}.txt").read_text() == next(e["caption"] for e in events
                                                            if Path(e["image"]).name == f"{name}.png")


@pytest.mark.slow
def test_a_caption_written_meanwhile_is_kept(tiny_blip, tmp_path):
    folder = make_folder(tmp_path / "imgs", {"a": None})
    jobs, _ = captioner.jobs_for(read_folder(folder), overwrite=False)
    (folder / "a.txt").write_text("typed by the user while the model loaded")
    events = []
    captioner.run(jobs, captioner.Settings(model=str(tiny_blip), max_new_tokens=4), report=events.append)
    assert (folder / "a.txt").read_text() == "typed by the user while the model loaded"
    assert "changed on disk" in events[0]["skipped"]


@pytest.mark.slow
def test_a_chat_model_is_asked_through_its_template_and_its_prompt_cut(tmp_path):
    from PIL import Image

    from tests.caption_model import build_tiny_llava
    model = captioner.Captioner(build_tiny_llava(tmp_path / "tiny-llava"), max_new_tokens=4)
    assert model.chat and model.prompt == captioner.CHAT_PROMPT
    texts = model.caption([Image.new("RGB", (60, 40), (200, 10, 10)), Image.new("RGB", (30, 50), (0, 10, 200))])
    # Only what the model answered (at most 4 tokens), not the 12-token question before it.
    assert len(texts) == 2 and all(0 < len(text.split()) <= 4 for text in texts), texts


@pytest.mark.slow
def test_an_unreadable_image_is_skipped_and_named(tiny_blip, tmp_path):
    folder = make_folder(tmp_path / "imgs", {"a": None})
    (folder / "broken.png").write_bytes(b"not a picture")
    jobs = [captioner.Job(folder / "broken.png", folder / "broken.txt", None),
            captioner.Job(folder / "a.png", folder / "a.txt", None)]
    events = []
    captioner.run(jobs, captioner.Settings(model=str(tiny_blip), max_new_tokens=4), report=events.append)
    assert events[0]["skipped"].startswith("unreadable image") and "caption" in events[1]
    assert not (folder / "broken.txt").exists() and (folder / "a.txt").read_text()

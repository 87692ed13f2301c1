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
from tests.unit.test_caption_edit import make_folder

REPO = Path(__file__).resolve().parents[2]


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


def _one_line(argv, capsys) -> str:
    """caption.py's main in this process (the script is `sys.exit(main())`; one test runs it as a script)."""
    assert captioner.main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def _caption_script(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "scripts" / "caption.py"), *argv], capture_output=True,
                          text=True, timeout=patience(240), cwd=REPO)


@pytest.mark.slow
def test_bad_model_folders_get_one_line_naming_folder_and_fix(tmp_path, capsys):
    images = make_folder(tmp_path / "imgs", {"a": None})
    # As a script once: exit code 2 and the one line, no traceback.
    result = _caption_script("--model", str(tmp_path / "nowhere"), "--folder", str(images))
    assert result.returncode == 2 and result.stderr.strip() == (
        f"caption.py: Captioning model folder {tmp_path / 'nowhere'} does not exist: choose {captioner.EXAMPLES}.")
    empty = tmp_path / "empty"
    empty.mkdir()
    line = _one_line(["--model", str(empty), "--folder", str(images)], capsys)
    assert f"{empty} is not a captioning model folder (no config.json): choose the folder of a BLIP" in line
    text_only = tmp_path / "bert"
    text_only.mkdir()
    (text_only / "config.json").write_text(json.dumps({"model_type": "bert"}))
    line = _one_line(["--model", str(text_only), "--folder", str(images)], capsys)
    assert f"{text_only} holds a 'bert' model, which is not an image-to-text model" in line
    assert "choose the folder of a BLIP, Florence-2 or Qwen2-VL model (its config.json" in line
    line = _one_line(["--model", str(text_only), "--folder", str(tmp_path / "no-images")], capsys)
    assert "holds a 'bert' model" in line  # the model is checked first, then the folder


@pytest.mark.slow
def test_script_captions_only_images_without_captions_every_image_once_over_two_processes(tiny_blip, tmp_path,
                                                                                        capsys):
    """The script end to end, on 2 CPU processes (--num-gpus 2 without GPUs) in batches of 2: the captioned
    image is kept, each other image is captioned once by one of the processes, with a progress line each
    naming the caption it wrote."""
    names = [f"img{i}" for i in range(5)]
    folder = make_folder(tmp_path / "imgs", {"a": "my own caption", **{name: None for name in names}})
    result = _caption_script("--model", str(tiny_blip), "--folder", str(folder), "--prefix", "sks",
                             "--max-new-tokens", "4", "--num-gpus", "2", "--batch-size", "2")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == f"5 image(s) to caption in {folder} (1 already captioned are kept; --overwrite replaces them)."
    progress = lines[1:6]
    assert [line.split(" ")[0] for line in progress] == [f"[{k}/5]" for k in range(1, 6)]
    written = dict(line.split(" ", 1)[1].split(": ", 1) for line in progress)
    assert sorted(written) == sorted(f"{name}.png" for name in names), "every image once"
    assert lines[-1].startswith("Captioned 5 of 5 image(s)") and lines[-1].endswith("(2 processes).")
    assert (folder / "a.txt").read_text() == "my own caption"
    for name in names:
        text = (folder / f"{name}.txt").read_text()
        assert text == written[f"{name}.png"] and text.startswith("sks, ") and len(text) > len("sks, "), text
    # Nothing left to do: a second run writes nothing (in this process: no model is loaded for no image).
    assert captioner.main(["--model", str(tiny_blip), "--folder", str(folder)]) == 0
    assert capsys.readouterr().out.splitlines()[0].startswith("0 image(s) to caption")


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

"""The Run tab's sample gallery plays a video family's samples (animated WebPs) in their cells under Xvfb, shows
image samples as before, and stops playing when another sampling is shown or the gallery goes away."""
from __future__ import annotations

import time
from pathlib import Path

import pytest
from PIL import Image

from modules.util.animation import Clip
from ui.sample_gallery import samplings
from tests.patience import patience


def write_clip(path: Path, frames: int = 4) -> Path:
    Clip(tuple(Image.new("RGB", (64, 64), (60 * k, 100, 200 - 40 * k)) for k in range(frames)), 25.0).save_webp(path)
    return path


def write_png(path: Path) -> Path:
    Image.new("RGB", (64, 64), (200, 30, 30)).save(path)
    return path


def pump(root, until, timeout: float) -> bool:
    deadline = time.monotonic() + patience(timeout)
    while time.monotonic() < deadline:
        root.update()
        if until():
            return True
        time.sleep(0.01)
    return until()


@pytest.fixture
def gallery(display, tmp_path):
    import customtkinter as ctk

    from ui.views.sample_gallery import SampleGallery

    root = ctk.CTk()
    samples = tmp_path / "samples"
    (samples / "run-a").mkdir(parents=True)
    view = SampleGallery(root, lambda: (samples, tmp_path))
    view.grid()
    yield view, samples / "run-a", root
    root.destroy()


def test_the_folder_reading_takes_clips_beside_images(tmp_path):
    write_clip(tmp_path / "step-0000004-0.webp")
    write_png(tmp_path / "step-0000004-1.png")
    (tmp_path / "step-0000004-2.gif").write_bytes(b"")  # not a sample the trainer writes
    (found,) = samplings(tmp_path, {0: "a moving circle", 1: "a square"})
    assert [(s.path.name, s.prompt) for s in found.samples] == [("step-0000004-0.webp", "a moving circle"),
                                                              ("step-0000004-1.png", "a square")]


def test_a_clip_plays_in_its_cell_and_an_image_stays_still(gallery):
    view, folder, root = gallery
    write_clip(folder / "step-0000004-0.webp")
    write_png(folder / "step-0000004-1.png")
    view.refresh()
    assert view.showing()[1] == 4 and len(view.players) == 1
    (player,) = view.players
    assert player.label is view.cells[0][0] and len(player.frames) == 4 and player.playing
    # The frame shown moves on by itself (40 ms a frame), through the loop, wrapping around.
    seen = {player.index}
    assert pump(root, lambda: seen.add(player.index) or len(seen) == 4, timeout=30), seen
    assert view.cells[1][0].cget("image") != "" and all(p.label is not view.cells[1][0] for p in view.players)


def test_a_live_clip_plays_and_playing_stops_with_another_sampling_and_with_the_gallery(gallery):
    view, folder, root = gallery
    write_png(folder / "step-0000002-0.png")
    view.refresh()
    assert view.players == []
    view.add_live({"type": "sample", "step": 6, "path": str(write_clip(folder / "step-0000006-0.webp")),
                   "prompt": "a moving circle"})
    assert view.showing()[1:] == (6, ["a moving circle"])
    (player,) = view.players
    assert pump(root, lambda: player.index > 0, timeout=30)
    view.step_to(-1)  # the image sampling before it
    assert view.showing()[1] == 2 and view.players == [] and not player.playing
    view.step_to(+1)
    (player,) = view.players
    assert player.playing
    view.destroy()
    assert not player.playing
    root.update()  # no tick is left to run on the destroyed label

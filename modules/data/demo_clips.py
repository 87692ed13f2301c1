"""The built-in `builtin:demo-clips` dataset: captioned moving shapes as short video clips, generated on first use.

The video counterpart of `builtin:demo-shapes` (`demo_dataset.py`): a fresh install, the tests and the Wan
demo (`#demo_wan`) get real .mp4 files with captions, without downloading anything. Each clip is a shape of
one colour crossing a plain background in one of four directions, which its caption names ("a red circle
moving right on a blue background"), so what a model learns of motion shows in its samples. Written with
PyAV (`video.write_clip`), 64x64 px, 24 frames at 16 fps (1.5 s).
"""
from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from modules.util.atomic import build_folder_once

from .demo_dataset import COLOURS, SHAPES, draw_shape

DEMO_CLIPS_SCHEME = "builtin:demo-clips"
DEMO_CLIPS_VERSION = "1"
"""Bump when the generated clips change, so that old copies are rebuilt."""
_MARKER = ".tandem-demo-clips"
SIDE, FRAMES, FPS, COUNT = 64, 24, 16, 24
DIRECTIONS = {"right": (1, 0), "left": (-1, 0), "down": (0, 1), "up": (0, -1)}


def default_clips_root() -> Path:
    home = os.environ.get("TANDEM_HOME")
    return (Path(home) if home else Path(__file__).resolve().parents[2] / ".cache") / "demo-clips"


def _frame(shape: str, colour: tuple, background: tuple, left: int, top: int, side: int) -> np.ndarray:
    img = Image.new("RGB", (SIDE, SIDE), background)
    draw_shape(ImageDraw.Draw(img), shape, colour, left, top, side)
    return np.asarray(img, dtype=np.uint8)


def _write_clips(folder: Path) -> None:
    from .video import write_clip

    rng = random.Random(4321)
    names, directions = list(COLOURS), list(DIRECTIONS)
    for index in range(COUNT):
        shape, colour = SHAPES[index % len(SHAPES)], names[index % len(names)]
        background = names[(index + 3) % len(names)]
        direction = directions[index % len(directions)]
        side = rng.randint(16, 24)
        dx, dy = DIRECTIONS[direction]
        travel = SIDE - side
        # Start at the edge it moves away from; the other coordinate stays put.
        x0 = 0 if dx > 0 else travel if dx < 0 else rng.randint(0, travel)
        y0 = 0 if dy > 0 else travel if dy < 0 else rng.randint(0, travel)
        frames = [_frame(shape, COLOURS[colour], COLOURS[background], x0 + dx * travel * k // (FRAMES - 1),
                         y0 + dy * travel * k // (FRAMES - 1), side) for k in range(FRAMES)]
        stem = f"{index:03d}_{colour}_{shape}_{direction}"
        write_clip(folder / f"{stem}.mp4", frames, FPS)
        (folder / f"{stem}.txt").write_text(f"a {colour} {shape} moving {direction} on a {background} background\n",
                                            encoding="utf-8")
    (folder / _MARKER).write_text(DEMO_CLIPS_VERSION, encoding="utf-8")


def _is_complete(root: Path) -> bool:
    marker = root / _MARKER
    return marker.is_file() and marker.read_text(encoding="utf-8").strip() == DEMO_CLIPS_VERSION


def ensure_demo_clips(root: Path | None = None) -> Path:
    """Generate the demo clips once at `root` (default `default_clips_root()`) and return it; safe from
    several ranks at once, as `demo_dataset.ensure_demo_dataset`."""
    root = Path(root) if root is not None else default_clips_root()
    if _is_complete(root):
        return root
    return build_folder_once(root, _write_clips, _is_complete)

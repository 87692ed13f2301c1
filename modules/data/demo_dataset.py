"""The built-in `builtin:demo-shapes` dataset: captioned coloured shapes, generated on first use.

It exists so that a fresh install, the tests and the multi-GPU smoke runs have real image files
with real captions, several aspect ratios included, without downloading anything.
"""
from __future__ import annotations

import os
import random
from pathlib import Path

from PIL import Image, ImageDraw

from modules.util.atomic import build_folder_once

DEMO_SCHEME = "builtin:demo-shapes"
DEMO_VERSION = "1"
"""Bump when the generated images change, so that old copies are rebuilt."""
_MARKER = ".tandem-demo-shapes"

COLOURS = {
    "red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 70, 210), "yellow": (235, 210, 40),
    "orange": (240, 140, 30), "purple": (140, 60, 180), "white": (245, 245, 245), "black": (20, 20, 20),
}
SHAPES = ("circle", "square", "triangle")
# (width, height, how many): mostly square, a few of each orientation so buckets get exercised.
SIZES = ((64, 64, 56), (96, 64, 4), (64, 96, 4))


def default_demo_root() -> Path:
    home = os.environ.get("TANDEM_HOME")
    if home:
        return Path(home) / "demo-shapes"
    return Path(__file__).resolve().parents[2] / ".cache" / "demo-shapes"


def _draw(shape: str, colour: tuple, background: tuple, width: int, height: int,
          rng: random.Random) -> Image.Image:
    img = Image.new("RGB", (width, height), background)
    side = rng.randint(min(width, height) // 3, min(width, height) * 3 // 4)
    left = rng.randint(0, width - side)
    top = rng.randint(0, height - side)
    draw_shape(ImageDraw.Draw(img), shape, colour, left, top, side)
    return img


def draw_shape(draw: ImageDraw.ImageDraw, shape: str, colour: tuple, left: int, top: int, side: int) -> None:
    """A circle, square or triangle filling the `side` x `side` square at (`left`, `top`)."""
    box = (left, top, left + side - 1, top + side - 1)
    if shape == "circle":
        draw.ellipse(box, fill=colour)
    elif shape == "square":
        draw.rectangle(box, fill=colour)
    else:
        draw.polygon([(left + side // 2, top), (left, top + side - 1), (left + side - 1, top + side - 1)],
                     fill=colour)


def _write_dataset(folder: Path) -> None:
    rng = random.Random(1234)
    names = list(COLOURS)
    index = 0
    for width, height, count in SIZES:
        for _ in range(count):
            shape = SHAPES[index % len(SHAPES)]
            colour = names[index % len(names)]
            # Offset by a step that never lands on the shape colour itself.
            background = names[(index + 1 + (index // len(names)) % (len(names) - 1)) % len(names)]
            img = _draw(shape, COLOURS[colour], COLOURS[background], width, height, rng)
            stem = f"{index:03d}_{colour}_{shape}"
            img.save(folder / f"{stem}.png", format="PNG")
            (folder / f"{stem}.txt").write_text(f"a {colour} {shape} on a {background} background\n",
                                                encoding="utf-8")
            index += 1
    (folder / _MARKER).write_text(DEMO_VERSION, encoding="utf-8")


def _is_complete(root: Path) -> bool:
    marker = root / _MARKER
    return marker.is_file() and marker.read_text(encoding="utf-8").strip() == DEMO_VERSION


def ensure_demo_dataset(root: Path | None = None) -> Path:
    """Generate the demo dataset once at `root` (default `default_demo_root()`) and return it.

    Safe when several ranks call it at once: each builds in its own temporary folder and
    renames it into place; whoever loses the race discards its copy (all copies are identical).
    """
    root = Path(root) if root is not None else default_demo_root()
    if _is_complete(root):
        return root
    return build_folder_once(root, _write_dataset, _is_complete)

"""The built-in `builtin:demo-shapes-edit` dataset: pairs of the demo's shapes, the edit a recolouring.

Each control image (`control/<name>.png`) is a coloured shape on a background, drawn like `builtin:demo-shapes`;
its target (`<name>.png`) is the same picture with the shape in another colour, and the caption is the
instruction (`make the circle red`). A tiny edit model learns it visibly on a CPU in minutes: the shape keeps its
place and form, only its colour follows the instruction. Generated on first use, nothing downloaded.
"""
from __future__ import annotations

import os
import random
from pathlib import Path

from PIL import Image, ImageDraw

from modules.util.atomic import build_folder_once

from .demo_dataset import COLOURS, SHAPES, draw_shape

DEMO_PAIRS_SCHEME = "builtin:demo-shapes-edit"
DEMO_PAIRS_VERSION = "1"
"""Bump when the generated images change, so that old copies are rebuilt."""
CONTROL_FOLDER = "control"
"""Where the control images are, beside the targets (the concept's `control` setting)."""
PAIRS = 24
SIDE = 64
_MARKER = ".tandem-demo-shapes-edit"
EDIT_COLOURS = ("red", "blue", "yellow")
"""The colours the instructions ask for (few, so a tiny model sees each often)."""


def default_pairs_root() -> Path:
    home = os.environ.get("TANDEM_HOME")
    if home:
        return Path(home) / "demo-shapes-edit"
    return Path(__file__).resolve().parents[2] / ".cache" / "demo-shapes-edit"


def demo_pair(index: int, rng: random.Random) -> tuple[Image.Image, Image.Image, str]:
    """(control, target, instruction) of pair `index`."""
    names = list(COLOURS)
    shape = SHAPES[index % len(SHAPES)]
    wanted = EDIT_COLOURS[index % len(EDIT_COLOURS)]
    before = [c for c in names if c != wanted][(index // len(EDIT_COLOURS)) % (len(names) - 1)]
    background = next(c for c in names[(index * 5) % len(names):] + names if c not in (before, wanted))
    side = rng.randint(SIDE // 3, SIDE * 3 // 4)
    left, top = rng.randint(0, SIDE - side), rng.randint(0, SIDE - side)
    pictures = []
    for colour in (before, wanted):
        img = Image.new("RGB", (SIDE, SIDE), COLOURS[background])
        draw_shape(ImageDraw.Draw(img), shape, COLOURS[colour], left, top, side)
        pictures.append(img)
    return pictures[0], pictures[1], f"make the {shape} {wanted}"


def _write_pairs(folder: Path) -> None:
    rng = random.Random(4321)
    (folder / CONTROL_FOLDER).mkdir()
    for index in range(PAIRS):
        control, target, caption = demo_pair(index, rng)
        stem = f"{index:03d}"
        control.save(folder / CONTROL_FOLDER / f"{stem}.png", format="PNG")
        target.save(folder / f"{stem}.png", format="PNG")
        (folder / f"{stem}.txt").write_text(caption + "\n", encoding="utf-8")
    (folder / _MARKER).write_text(DEMO_PAIRS_VERSION, encoding="utf-8")


def _is_complete(root: Path) -> bool:
    marker = root / _MARKER
    return marker.is_file() and marker.read_text(encoding="utf-8").strip() == DEMO_PAIRS_VERSION


def ensure_demo_pairs(root: Path | None = None) -> Path:
    """Generate the paired demo dataset once at `root` (default `default_pairs_root()`) and return it; safe when
    several ranks call it at once (`build_folder_once`)."""
    root = Path(root) if root is not None else default_pairs_root()
    if _is_complete(root):
        return root
    return build_folder_once(root, _write_pairs, _is_complete)

"""A video sample's frames and their rate, and the two ways it is written: an animated WebP file (small, lossless
colours, played by browsers and most image viewers) and GIF bytes for TensorBoard, whose image dashboard shows
animated GIFs but serves WebP as an unknown type. Pillow encodes both, so no video library is needed.

Both encoders store a run of identical frames once, shown for the run's summed time: a clip plays for
frames / fps seconds whatever the count of frames stored (`read_frames` gives each stored frame its time).
"""
from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, ImageSequence

SUFFIX = ".webp"
"""The file suffix of a written clip (a still image stays a `.png`)."""


@dataclass(frozen=True)
class Clip:
    """The frames of one video sample, shown at `fps` frames per second."""
    frames: tuple[Image.Image, ...]
    fps: float

    def __post_init__(self) -> None:
        if len(self.frames) < 2:
            raise ValueError(f"a clip has at least 2 frames, got {len(self.frames)}; write one frame as an image")
        if self.fps <= 0:
            raise ValueError(f"a clip's frame rate must be above 0, got {self.fps}")

    @property
    def size(self) -> tuple[int, int]:
        return self.frames[0].size

    @property
    def frame_ms(self) -> int:
        """How long each frame shows, in whole milliseconds (what both formats store)."""
        return max(1, round(1000 / self.fps))

    def save_webp(self, path: str | Path) -> None:
        """An animated WebP that loops; lossless, since samples are looked at for detail."""
        first, *rest = [frame.convert("RGB") for frame in self.frames]
        first.save(path, format="WEBP", save_all=True, append_images=rest, duration=self.frame_ms, loop=0,
                   lossless=True, method=4)

    def gif_bytes(self) -> bytes:
        """An animated GIF that loops (256 colours per frame: enough to see the motion)."""
        first, *rest = [frame.convert("RGB") for frame in self.frames]
        out = io.BytesIO()
        first.save(out, format="GIF", save_all=True, append_images=rest, duration=self.frame_ms, loop=0)
        return out.getvalue()


def read_frames(path: "str | Path | io.BytesIO") -> list[tuple[Image.Image, int]]:
    """Every stored frame of an image file as RGB with how long it shows in milliseconds; a still image is one
    frame shown for 0 ms. An OSError where the file cannot be read."""
    with Image.open(path) as picture:
        if not getattr(picture, "is_animated", False):
            picture.load()
            return [(picture.convert("RGB"), 0)]
        frames = []
        for frame in ImageSequence.Iterator(picture):
            frame.load()  # the frame's duration is known once it is decoded
            frames.append((frame.convert("RGB"), int(frame.info.get("duration", 0))))
        return frames

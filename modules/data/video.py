"""Video clips as training items: found beside the images, probed once, a fixed window of frames decoded.

A clip (`.mp4`, `.webm`, `.mov`) trains on `data.video_frames` frames taken at `data.video_fps` frames per
second. PyAV (FFmpeg's libraries) decodes it. The scan decodes each clip once to the end (as it loads each
image once): a truncated or unreadable clip, or one too short for the window, is named in one warning with
the reason and skipped, so training never meets it. A clip longer than the window trains on one window,
whose start is fixed by the clip's content and the seed (the same on every rank, every run, and in the
latent cache, whose entries key the window's frames).

Frames are taken by index at the clip's average rate (`frame k` of the window is source frame
`start + floor(k * clip fps / video_fps)`); each frame is resized and cropped like an image of the clip's
size (`buckets.apply_plan`), so a clip and its frames share one bucket.
"""
from __future__ import annotations

import hashlib
import logging
import math
import random
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from .buckets import CropPlan, apply_plan

log = logging.getLogger(__name__)

VIDEO_EXTENSIONS = (".mp4", ".webm", ".mov")


@dataclass(frozen=True)
class ClipInfo:
    width: int
    height: int
    frame_count: int
    """Frames the clip decodes to (all of them: the scan decodes it to the end)."""
    frame_rate: float
    """Its average frames per second."""
    content_hash: str


@dataclass(frozen=True)
class Window:
    """The frames a clip trains on: `data.video_frames` of them at `data.video_fps`."""

    frames: int
    fps: float

    def span(self, frame_rate: float) -> int:
        """Source frames from the window's first to its last, inclusive, at a clip's `frame_rate`."""
        return math.floor((self.frames - 1) * frame_rate / self.fps) + 1

    def indices(self, frame_count: int, frame_rate: float, rng: random.Random) -> tuple[int, ...]:
        """The window's source frame indices: its start drawn from `rng` among the starts that fit."""
        span = self.span(frame_rate)
        if span > frame_count:
            raise ValueError(f"a clip of {frame_count} frames at {frame_rate:g} fps is too short for {self.frames} "
                             f"frames at {self.fps:g} fps")
        start = rng.randint(0, frame_count - span)
        return tuple(start + math.floor(k * frame_rate / self.fps) for k in range(self.frames))


def probe_clip(path: Path, window: Window) -> ClipInfo | None:
    """Size, frame count, rate and sha256 of a clip that decodes to the end and holds `window`; else None
    after one warning naming it and why."""
    import av

    try:
        data = path.read_bytes()
        with av.open(str(path)) as container:
            if not container.streams.video:
                raise ValueError("it has no video stream")
            stream = container.streams.video[0]
            rate = stream.average_rate or stream.guessed_rate
            count, width, height = 0, stream.codec_context.width, stream.codec_context.height
            for frame in container.decode(stream):
                width, height = frame.width, frame.height
                count += 1
    except (OSError, ValueError, av.error.FFmpegError) as err:
        log.warning("Skipping unreadable clip %s: %s", path, _reason(err, path))
        return None
    if not count or not rate:
        log.warning("Skipping unreadable clip %s: %s", path,
                    "no frame decodes (damaged or cut short)" if not count else "it gives no frame rate")
        return None
    info = ClipInfo(width, height, count, float(Fraction(rate)), hashlib.sha256(data).hexdigest())
    if window.span(info.frame_rate) > count:
        log.warning("Skipping clip %s: %d frames at %.3g fps (%.2f s) is too short for data.video_frames=%d at "
                    "data.video_fps=%g (%.2f s); use a longer clip, or fewer frames or a higher rate", path, count,
                    info.frame_rate, count / info.frame_rate, window.frames, window.fps,
                    (window.frames - 1) / window.fps)
        return None
    return info


def _reason(err: Exception, path: Path) -> str:
    if isinstance(err, FileNotFoundError):
        return "the file is gone"
    if isinstance(err, PermissionError):
        return "no permission to read it"
    if path.exists() and path.stat().st_size == 0:
        return "the file is empty"
    # FFmpeg's errors repeat the file name after their text (`strerror` is the text alone).
    text = (getattr(err, "strerror", None) or str(err)).strip() or type(err).__name__
    return f"damaged, cut short or not a video ({text})"


def load_clip(path: Path, plan: CropPlan, indices: Sequence[int]) -> torch.Tensor:
    """The window's frames after `plan`, as a float tensor [3, frames, H, W] in [-1, 1]."""
    import av

    wanted: dict[int, list[int]] = {}
    for position, index in enumerate(indices):
        wanted.setdefault(index, []).append(position)
    frames: list[np.ndarray | None] = [None] * len(indices)
    with av.open(str(path)) as container:
        for number, frame in enumerate(container.decode(video=0)):
            if number in wanted:
                image = frame.to_image()
                if image.size != (plan.original_size[1], plan.original_size[0]):
                    raise ValueError(f"Clip {path} is now {image.size[0]}x{image.size[1]} but was "
                                     f"{plan.original_size[1]}x{plan.original_size[0]} when scanned; restart to rescan.")
                array = np.asarray(apply_plan(image, plan), dtype=np.uint8).copy()
                for position in wanted[number]:
                    frames[position] = array
            if number >= indices[-1]:
                break
    missing = [indices[i] for i, f in enumerate(frames) if f is None]
    if missing:
        raise ValueError(f"Clip {path} no longer decodes to frame {missing[0]} (changed since it was scanned?); "
                         "restart to rescan")
    pixels = torch.from_numpy(np.stack(frames)).permute(3, 0, 1, 2).float()
    return pixels / 127.5 - 1.0


def write_clip(path: Path, frames: Sequence[np.ndarray], fps: int) -> None:
    """Frames (H x W x 3 uint8, even sides) as an H.264 .mp4 (or VP9 .webm, by the suffix) at `fps`."""
    import av

    codec = "libvpx-vp9" if path.suffix.lower() == ".webm" else "libx264"
    with av.open(str(path), mode="w") as container:
        stream = container.add_stream(codec, rate=fps)
        stream.height, stream.width = frames[0].shape[:2]
        stream.pix_fmt = "yuv420p"
        # Near-lossless, so the demo's flat colours survive the codec.
        stream.options = {"crf": "4"} if codec == "libx264" else {"crf": "4", "b": "0"}
        for array in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(array), format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)

"""The GUI's side of the training protocol: `@tandem {json}` event lines on the trainer's stdout.

Rank 0 prints one line per event; every other line is plain log output. The event types and
their fields are listed in `EVENT_FIELDS`; a line that starts with the marker but is not a valid
event becomes a log line (with the reason) rather than being dropped or crashing the reader.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

EVENT_MARKER = "@tandem "

EVENT_FIELDS: dict[str, tuple[str, ...]] = {
    "config": ("world_size", "per_gpu_batch", "accumulation", "global_batch", "steps_per_epoch",
               "total_steps", "base_lr", "lr"),
    "status": ("text",),
    "cache": ("seconds", "world_size", "shared"),
    "progress": ("epoch", "epochs", "step", "total_steps", "images_per_s", "eta_s", "rank_images_per_s"),
    "loss": ("step", "loss", "lr", "rank_losses"),
    "sample": ("step", "path", "prompt"),
    "saved": ("path",),
    "backup": ("path",),
    "error": ("text", "rank"),
    "done": ("output",),
}


@dataclass(frozen=True)
class TrainingEvent:
    type: str
    data: dict[str, Any] = field(default_factory=dict)

    def get(self, key: str, default: Any = None) -> Any:
        return self.data.get(key, default)


@dataclass(frozen=True)
class LogLine:
    text: str


_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def clean_log_text(text: str) -> str:
    """What a terminal would show: progress bars redraw with carriage returns and cursor escapes."""
    text = _ANSI.sub("", text.rstrip("\r\n"))
    return text.rsplit("\r", 1)[-1] if "\r" in text.rstrip("\r") else text.rstrip("\r")


def parse_line(line: str) -> TrainingEvent | LogLine:
    """One line of trainer output -> an event, or a log line for everything else."""
    text = clean_log_text(line)
    if not text.startswith(EVENT_MARKER):
        return LogLine(text)
    payload = text[len(EVENT_MARKER):]
    try:
        data = json.loads(payload)
    except json.JSONDecodeError as e:
        return LogLine(f"{text}  [unreadable event: {e.msg}]")
    if not isinstance(data, dict) or data.get("type") not in EVENT_FIELDS:
        kind = data.get("type") if isinstance(data, dict) else type(data).__name__
        return LogLine(f"{text}  [unknown event type {kind!r}]")
    kind = data.pop("type")
    return TrainingEvent(kind, data)


def format_duration(seconds: float | None) -> str:
    """ETA text: `1:02:03`, `4:05`, or `-` when unknown."""
    if seconds is None or seconds < 0:
        return "-"
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"

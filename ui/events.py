"""The GUI's side of the training protocol (modules/util/run_protocol.py): `@tandem {json}` event
lines on the trainer's stdout.

Rank 0 prints one line per event; every other line is plain log output. A line that starts with the
marker but is not a valid event becomes a log line (with the reason) rather than being dropped or
crashing the reader.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from modules.util.run_protocol import parse_event


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
    event = parse_event(text)
    if event is None:
        return LogLine(text)
    if isinstance(event, str):
        return LogLine(f"{text}  [{event}]")
    kind = event.pop("type")
    return TrainingEvent(kind, event)


def format_duration(seconds: float | None) -> str:
    """ETA text: `1:02:03`, `4:05`, or `-` when unknown."""
    if seconds is None or seconds < 0:
        return "-"
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"

"""How a training run reports to whoever watches it (CLI, GUI, tests).

Only rank 0 reports. The GUI runs training in a subprocess with TANDEM_EVENTS=1 and reads
`EventLineReporter` output: one line `@tandem {json}` per event on stdout, everything else being plain
log text. Without that variable a log is for people (a terminal, `| tee`, `nohup`, a job scheduler):
no event lines, a progress line every few seconds (see progress.py).
"""
from __future__ import annotations

import json
import os
import sys
from typing import Any, TextIO

EVENT_PREFIX = "@tandem "
EVENT_TYPES = ("config", "status", "progress", "loss", "sample", "saved", "backup", "error", "done")


class TrainingCallbacks:
    """Receives training events; the default ignores them. Subclass and override what you need."""

    def on_event(self, type_: str, **fields: Any) -> None:
        """Every event ends up here; `type_` is one of EVENT_TYPES."""


class RecordingCallbacks(TrainingCallbacks):
    """Keeps every event in memory (for tests and embedding)."""

    def __init__(self) -> None:
        self.events: list[dict] = []

    def on_event(self, type_: str, **fields: Any) -> None:
        self.events.append({"type": type_, **fields})

    def of_type(self, type_: str) -> list[dict]:
        return [e for e in self.events if e["type"] == type_]


class EventLineReporter(TrainingCallbacks):
    """Writes each event as one `@tandem {json}` line, flushed at once so a reading GUI sees it live."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stdout

    def on_event(self, type_: str, **fields: Any) -> None:
        line = EVENT_PREFIX + json.dumps({"type": type_, **fields}, default=str)
        self.stream.write(line + "\n")
        self.stream.flush()


EVENTS_VARIABLE = "TANDEM_EVENTS"
"""Set to 1 by whoever reads the event lines (the GUI, tests); a log read by people has none."""


def default_callbacks() -> TrainingCallbacks:
    """Event lines when asked for (TANDEM_EVENTS=1); none otherwise, whether stdout is a terminal or not."""
    if os.environ.get(EVENTS_VARIABLE) == "1":
        return EventLineReporter()
    return TrainingCallbacks()


def parse_event_line(line: str) -> dict | None:
    """The event in a `@tandem` line, or None for a plain log line."""
    if not line.startswith(EVENT_PREFIX):
        return None
    try:
        event = json.loads(line[len(EVENT_PREFIX):])
    except json.JSONDecodeError:
        return None
    return event if isinstance(event, dict) and "type" in event else None

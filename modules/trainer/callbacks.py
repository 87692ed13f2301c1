"""How a training run reports to whoever watches it (CLI, GUI, tests).

Only rank 0 reports. The GUI runs training in a subprocess and reads `EventLineReporter` output:
one line `@tandem {json}` per event on stdout, everything else being plain log text.
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


def default_callbacks() -> TrainingCallbacks:
    """Event lines when stdout goes to a pipe (the GUI) or TANDEM_EVENTS=1; silent in a terminal."""
    wanted = os.environ.get("TANDEM_EVENTS")
    if wanted == "1" or (wanted is None and not sys.stdout.isatty()):
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

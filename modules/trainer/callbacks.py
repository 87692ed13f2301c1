"""How a training run reports to whoever watches it (CLI, GUI, tests).

Only rank 0 reports (modules/trainer/rank_duties.py). The GUI runs training in a subprocess with
TANDEM_EVENTS=1 and reads `EventLineReporter` output: one line `@tandem {json}` per event on stdout,
everything else being plain log text; the events and their fields are declared in
modules/util/run_protocol.py. Without that variable a log is for people (a terminal, `| tee`, `nohup`,
a job scheduler): no event lines, a progress line every few seconds (see progress.py).
"""
from __future__ import annotations

import os
import sys
from typing import Any, TextIO

from modules.util.run_protocol import EVENTS_VARIABLE, event_line, event_problem


class TrainingCallbacks:
    """Receives training events; the default ignores them. Subclass and override what you need."""

    def on_event(self, type_: str, **fields: Any) -> None:
        """Every event ends up here; `type_` is one of `run_protocol.EVENTS`."""


class RecordingCallbacks(TrainingCallbacks):
    """Keeps every event in memory (for tests and embedding); an event the protocol does not declare raises."""

    def __init__(self) -> None:
        self.events: list[dict] = []

    def on_event(self, type_: str, **fields: Any) -> None:
        problem = event_problem(type_, fields)
        if problem:
            raise ValueError(f"{problem} (declared in modules/util/run_protocol.py)")
        self.events.append({"type": type_, **fields})

    def of_type(self, type_: str) -> list[dict]:
        return [e for e in self.events if e["type"] == type_]


class EventLineReporter(TrainingCallbacks):
    """Writes each event as one `@tandem {json}` line, flushed at once so a reading GUI sees it live."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stdout

    def on_event(self, type_: str, **fields: Any) -> None:
        self.stream.write(event_line(type_, **fields) + "\n")
        self.stream.flush()


def default_callbacks() -> TrainingCallbacks:
    """Event lines when asked for (TANDEM_EVENTS=1); none otherwise, whether stdout is a terminal or not."""
    if os.environ.get(EVENTS_VARIABLE) == "1":
        return EventLineReporter()
    return TrainingCallbacks()

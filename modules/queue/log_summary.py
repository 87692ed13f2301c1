"""What a job's run log says, for the queue's views and for the runner when the run ends.

A run's log (`<runs root>/runs/<id>/output.log`) holds its log lines and `@tandem` event lines
(`modules/util/run_protocol.py`). Only its head (the run's `config` event: run id and total steps) and its
tail (the newest progress, the saved model, the error) are read, so a week-long run's log costs the same.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from modules.util.run_protocol import parse_event_line

HEAD_BYTES = 256 * 1024
TAIL_BYTES = 256 * 1024
ERROR_LINES = 8
"""Log lines kept as a failed run's reason when it reported no `error` event."""


@dataclass(frozen=True)
class LogSummary:
    step: int = 0
    total_steps: int = 0
    eta_s: float | None = None
    images_per_s: float | None = None
    output: str | None = None
    completed: bool = False
    error: str | None = None
    train_run_id: str | None = None
    last_lines: tuple[str, ...] = ()
    """The last log lines that are not events."""

    @property
    def fraction(self) -> float:
        return min(self.step / self.total_steps, 1.0) if self.total_steps else 0.0

    def failure(self) -> str:
        """Why the run failed, in a few lines: its error event, else its last log lines."""
        if self.error:
            return self.error
        return "\n".join(self.last_lines[-ERROR_LINES:])


def _read(path: Path) -> tuple[str, str]:
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            f.seek(0)
            head = f.read(min(size, HEAD_BYTES))
            if size <= HEAD_BYTES:
                return head.decode("utf-8", errors="replace"), ""
            f.seek(max(size - TAIL_BYTES, HEAD_BYTES))
            tail = f.read()
    except OSError:
        return "", ""
    tail = tail[tail.find(b"\n") + 1:]  # from the first whole line
    return head.decode("utf-8", errors="replace"), tail.decode("utf-8", errors="replace")


def summarize(log: str | Path) -> LogSummary:
    head, tail = _read(Path(log))
    values: dict = {}
    plain: list[str] = []
    for text in (head, tail):
        for line in text.splitlines():
            event = parse_event_line(line)
            if event is None:
                if line.strip() and not line.startswith("@tandem"):
                    plain.append(line)
                continue
            kind = event["type"]
            if kind == "config":
                values["total_steps"] = int(event.get("total_steps") or 0)
                if isinstance(event.get("run_id"), str):
                    values["train_run_id"] = event["run_id"]
            elif kind == "progress":
                values.update(step=int(event.get("step") or 0), total_steps=int(event.get("total_steps") or 0),
                              eta_s=event.get("eta_s"), images_per_s=event.get("images_per_s"))
            elif kind == "done":
                values.update(output=event.get("output"), completed=bool(event.get("completed")),
                              step=int(event.get("step") or values.get("step", 0)))
            elif kind == "error":
                values["error"] = str(event.get("text", "unknown error"))
            elif kind == "restart":
                values.pop("error", None)  # the failure before an automatic restart was gone past
    return LogSummary(**values, last_lines=tuple(plain[-ERROR_LINES * 2:]))

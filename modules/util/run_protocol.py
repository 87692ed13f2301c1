"""The protocol between a training run and whoever watches it (the GUI, tests, scripts), declared once.

Events: rank 0 writes one line per event on stdout, `@tandem {"type": ..., <fields>}`, when asked to
(`TANDEM_EVENTS=1`); every other line is log text. `EVENTS` lists each type with the fields it always
carries and those it may carry. The trainer writes lines with `event_line`, readers parse them with
`parse_event`; both sides check them against `EVENTS` (`event_problem`).

Commands: a watcher appends one word per line to `<workspace>/.tandem/commands` (`COMMANDS`); rank 0
reads them, and a stop may also come as SIGINT/SIGTERM (modules/trainer/commands.py).

Torch-free and free of training code: the GUI imports it.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from .no_follow import open_text_no_follow

EVENT_PREFIX = "@tandem "
EVENTS_VARIABLE = "TANDEM_EVENTS"
"""Set to 1 by whoever reads the event lines (the GUI, tests); a log read by people has none."""


@dataclass(frozen=True)
class EventType:
    fields: tuple[str, ...]
    """Always present."""
    optional: tuple[str, ...] = ()
    """Present when they apply (several processes, a failed rank, ...)."""


EVENTS: dict[str, EventType] = {
    "config": EventType(("world_size", "per_gpu_batch", "accumulation", "global_batch", "micro_batches_per_epoch",
                         "steps_per_epoch", "epochs", "total_steps", "base_lr", "lr_scaling", "lr", "split",
                         "items_per_epoch", "items_left_out"), ("run_id", "processes", "context", "text_encoder_lr", "lr_factor")),
    "status": EventType(("text",)),
    "cache": EventType(("seconds", "world_size", "shared")),
    "progress": EventType(("epoch", "epochs", "step", "total_steps", "images_per_s", "eta_s"),
                          ("rank_images_per_s",)),
    "loss": EventType(("step", "loss", "lr"), ("rank_losses",)),
    "validation": EventType(("step", "loss", "images")),
    "sample": EventType(("step", "path", "prompt", "rank")),
    "saved": EventType(("path", "step")),
    "backup": EventType(("path", "step"), ("paused_s", "pinned_alloc_s")),
    "error": EventType(("text",), ("rank", "failed_rank")),
    "restart": EventType(("text", "restart", "max_restarts", "step", "resumed_step")),
    "done": EventType(("output", "step", "completed", "images", "train_s", "images_per_s")),
    "profile": EventType(("first", "last", "ranks")),
}
"""Every event type and its fields: `config` is the run's `RunNumbers` and its `run_id` (the name of its
backups, samples, TensorBoard folder and config, which the GUI keeps its loss curve by), `validation` the held-out images'
mean loss (`loss`) over `images` images at `step`, `error` names the rank that failed (`rank`: the rank
reporting its own failure; `failed_rank`: the launcher naming the first); `restart` is a restarted
round's first word (`step`: where the failed round was, `resumed_step`: the backup it continues from;
either None when unknown / none); `backup`'s `paused_s` is what taking it cost the training loop (rank 0's
seconds: the snapshot and hand-over to the writer thread, or the whole write when sharded), `pinned_alloc_s`
the part of it spent growing PyTorch's pinned host memory pool (the first backup's snapshot; later ones reuse it);
`profile` is each rank's profile summary of steps `first`-`last` (`TANDEM_PROFILE_STEPS`, `modules/trainer/step_profile.py`)."""

COMMANDS = ("stop", "sample", "backup", "save")
"""What a watcher may ask a running training to do (one word per line in the commands file)."""


def event_problem(type_: str, fields: dict[str, Any]) -> str | None:
    """What is wrong with an event as the protocol declares it, or None."""
    declared = EVENTS.get(type_)
    if declared is None:
        return f"unknown event type {type_!r}"
    missing = [f for f in declared.fields if f not in fields]
    unknown = [f for f in fields if f not in declared.fields and f not in declared.optional]
    if missing or unknown:
        return f"event {type_!r}: " + "; ".join(
            part for part in (f"missing {missing}" if missing else "", f"undeclared {unknown}" if unknown else "") if part)
    return None


def event_line(type_: str, **fields: Any) -> str:
    """The line for one event (without the newline)."""
    return EVENT_PREFIX + json.dumps({"type": type_, **fields}, default=str)


def parse_event(line: str) -> dict | str | None:
    """The event of a `@tandem` line as a dict with its `type`; None for a log line; for a line that
    starts like an event but is none, the reason (a string)."""
    if not line.startswith(EVENT_PREFIX):
        return None
    try:
        event = json.loads(line[len(EVENT_PREFIX):])
    except json.JSONDecodeError as e:
        return f"unreadable event: {e.msg}"
    if not isinstance(event, dict):
        return f"unknown event type {type(event).__name__!r}"
    if event.get("type") not in EVENTS:
        return f"unknown event type {event.get('type')!r}"
    return event


def parse_event_line(line: str) -> dict | None:
    """The event in a `@tandem` line, or None (a log line, or a line that is no valid event)."""
    event = parse_event(line)
    return event if isinstance(event, dict) else None


def command_problem(command: str) -> str | None:
    if command in COMMANDS:
        return None
    return f"unknown command {command!r}; known: {', '.join(COMMANDS)}"


def write_command(commands_file: str | os.PathLike, command: str) -> None:
    """Append one command line to a run's commands file (the GUI, the launcher's stop, tests)."""
    problem = command_problem(command)
    if problem:
        raise ValueError(problem)
    with open_text_no_follow(commands_file, "a") as f:  # a link there is refused, naming it
        f.write(command + "\n")

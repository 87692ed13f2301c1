"""The run <-> GUI protocol (modules/util/run_protocol.py), tested once: both sides use its declaration."""
from __future__ import annotations

import io

import pytest

from modules.config import TrainConfig
from modules.trainer.callbacks import EventLineReporter, RecordingCallbacks
from modules.trainer.commands import CommandInbox
from modules.trainer.run_numbers import derive_run_numbers
from modules.util.run_protocol import COMMANDS, EVENTS, event_problem, write_command
from ui.events import LogLine, TrainingEvent, parse_line
from ui.run_controller import RunController


def _example(type_: str) -> dict:
    return {name: f"{name}-value" for name in EVENTS[type_].fields}


@pytest.mark.parametrize("type_", sorted(EVENTS))
def test_every_event_the_trainer_writes_the_gui_reads(type_):
    out = io.StringIO()
    EventLineReporter(out).on_event(type_, **_example(type_))
    assert parse_line(out.getvalue()) == TrainingEvent(type_, _example(type_))


def test_events_outside_the_declaration_are_caught():
    assert event_problem("party", {}) == "unknown event type 'party'"
    assert "missing ['text']" in event_problem("status", {})
    assert "undeclared ['colour']" in event_problem("saved", {"path": "p", "step": 1, "colour": "red"})
    assert event_problem("loss", {"step": 1, "loss": 0.5, "lr": 1e-4, "rank_losses": [0.4, 0.6]}) is None
    with pytest.raises(ValueError, match="undeclared"):  # trainer tests record through this
        RecordingCallbacks().on_event("backup", path="p", step=1, size=3)
    assert isinstance(parse_line('@tandem {"type": "party"}'), LogLine)


def test_the_config_event_is_the_run_numbers():
    numbers = derive_run_numbers(TrainConfig(), 2, 10, items_per_epoch=40)
    assert event_problem("config", numbers.as_dict()) is None


def test_every_command_the_gui_may_send_reaches_the_trainer(tmp_path):
    commands = tmp_path / "commands"
    inbox = CommandInbox(commands)
    for command in COMMANDS:
        write_command(commands, command)
    inbox.poll()
    assert inbox.take() == set(COMMANDS)
    with pytest.raises(ValueError, match="unknown command 'pause'"):
        RunController().send("pause")
    with pytest.raises(ValueError, match="unknown command 'pause'"):
        write_command(commands, "pause")

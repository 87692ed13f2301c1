"""No file Tandem writes in a workspace is written through a symbolic link (modules/util/no_follow.py).

Each test plants a link where Tandem keeps a file (`.tandem/lock`, `workers/rank-N.lock`, `commands`, an
atomically written file) pointing at a victim file: the victim keeps its bytes and the refusal names the link.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from modules.distributed import failures
from modules.trainer.commands import CommandInbox
from modules.util.atomic import atomic_directory, write_text_atomically
from modules.util.no_follow import LinkRefused
from modules.util.run_protocol import write_command
from modules.util.workspace_lock import WorkerLock, WorkspaceBusy, WorkspaceLock, workspace_in_use, workers_alive

pytestmark = pytest.mark.skipif(os.name == "nt", reason="symbolic links need privileges on Windows")

VICTIM_TEXT = "the user's own file\n"


@pytest.fixture
def victim(tmp_path) -> Path:
    path = tmp_path / "elsewhere" / "victim.txt"
    path.parent.mkdir()
    path.write_text(VICTIM_TEXT)
    return path


def plant_link(link: Path, target: Path) -> Path:
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(target)
    return link


def test_a_linked_workspace_lock_is_refused_naming_it_and_its_target_is_untouched(tmp_path, victim):
    link = plant_link(tmp_path / "ws" / ".tandem" / "lock", victim)
    with pytest.raises(WorkspaceBusy, match=rf"{link} is a symbolic link \(to {victim}\).*Delete the link"):
        WorkspaceLock(tmp_path / "ws").acquire()
    assert victim.read_text() == VICTIM_TEXT
    with pytest.raises(LinkRefused, match=str(link)):  # the GUI asks before a start: refused there too
        workspace_in_use(tmp_path / "ws")


def test_a_linked_worker_lock_is_refused_naming_it_and_its_target_is_untouched(tmp_path, victim):
    link = plant_link(tmp_path / "ws" / ".tandem" / "workers" / "rank-1.lock", victim)
    with pytest.raises(LinkRefused, match=rf"{link} is a symbolic link"):
        WorkerLock(tmp_path / "ws", 1).acquire()
    with pytest.raises(LinkRefused, match=str(link)):
        workers_alive(tmp_path / "ws")
    with pytest.raises(WorkspaceBusy, match=str(link)):  # a launcher refuses before any worker starts
        WorkspaceLock(tmp_path / "ws").acquire()
    assert victim.read_text() == VICTIM_TEXT


def test_a_linked_commands_file_gets_no_stop_appended(tmp_path, victim):
    link = plant_link(tmp_path / "ws" / ".tandem" / "commands", victim)
    with pytest.raises(LinkRefused, match=rf"{link} is a symbolic link"):
        write_command(link, "stop")
    inbox = CommandInbox(link, start=0)
    with pytest.raises(LinkRefused, match=str(link)):  # nor is the victim read as commands
        inbox.poll()
    with pytest.raises(WorkspaceBusy, match=str(link)):  # a run refuses the workspace at its start
        WorkspaceLock(tmp_path / "ws").acquire()
    assert victim.read_text() == VICTIM_TEXT


def test_the_gui_start_does_not_empty_a_linked_commands_file(tmp_path, victim):
    from modules.config import load_config
    from ui.run_host import LocalHost

    cfg = load_config("#demo", [f"general.workspace_dir={tmp_path / 'ws'}"])
    link = plant_link(tmp_path / "ws" / ".tandem" / "commands", victim)
    with pytest.raises(OSError, match=str(link)):  # the Run tab shows it: "Could not start training: ..."
        LocalHost().prepare(cfg)  # what a local start writes first
    assert victim.read_text() == VICTIM_TEXT


def test_a_linked_private_folder_is_refused_and_nothing_is_written_where_it_points(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    link = plant_link(tmp_path / "ws" / ".tandem", elsewhere)
    with pytest.raises(WorkspaceBusy, match=rf"{link} is a symbolic link .*Tandem's own folder"):
        WorkspaceLock(tmp_path / "ws").acquire()
    with pytest.raises(LinkRefused, match=str(link)):
        write_command(link / "commands", "stop")
    with pytest.raises(LinkRefused, match=str(link)):
        write_text_atomically(link / "launch.json", "{}")
    assert list(elsewhere.iterdir()) == []
    (link).unlink()
    workers = plant_link(tmp_path / "ws" / ".tandem" / "workers", elsewhere)
    with pytest.raises(LinkRefused, match=rf"{workers} is a symbolic link"):
        WorkerLock(tmp_path / "ws", 0).acquire()
    assert list(elsewhere.iterdir()) == []


def test_an_atomic_write_refuses_a_link_as_its_target_unless_it_is_the_users_own_file(tmp_path, victim):
    link = plant_link(tmp_path / "ws" / "samples" / "step-1.png", victim)
    with pytest.raises(LinkRefused, match=rf"{link} is a symbolic link \(to {victim}\)"):
        write_text_atomically(link, "new")
    assert victim.read_text() == VICTIM_TEXT and link.is_symlink()
    assert not [p for p in link.parent.iterdir() if p != link]  # no temporary file left behind
    # A config the user saves may be a link on purpose (dotfiles): its target is written, the link kept.
    write_text_atomically(link, "saved config", follow_link=True)
    assert victim.read_text() == "saved config" and link.is_symlink()


def test_a_backup_folder_that_is_a_link_is_replaced_not_written_through(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("kept")
    link = plant_link(tmp_path / "ws" / "backups" / "run-1", elsewhere)
    with atomic_directory(link, replace=True) as folder:
        (folder / "state.pt").write_text("state")
    assert (link / "state.pt").read_text() == "state" and not link.is_symlink()
    assert [p.name for p in elsewhere.iterdir()] == ["keep.txt"]


def test_a_failure_record_is_not_written_through_a_link(tmp_path, victim):
    folder = tmp_path / "ws" / ".tandem" / "failures"
    plant_link(folder / "rank-0.json", victim)
    plant_link(failures.details_file(folder, 0), victim)
    failures.record_error(folder, 0, RuntimeError("boom"))  # never raises: the error handled matters more
    assert victim.read_text() == VICTIM_TEXT


def test_the_loss_curve_is_not_written_through_a_link(tmp_path, victim, capsys):
    from ui.loss_history import LossHistory

    history = LossHistory(plant_link(tmp_path / "ws" / ".tandem" / "gui-losses.csv", victim))
    assert history.begin(1) == []
    history.append(1, 0.5)  # kept in memory only
    assert victim.read_text() == VICTIM_TEXT
    assert "is a symbolic link" in capsys.readouterr().err

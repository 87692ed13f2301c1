"""A worker whose launcher has ended publishes no backup, even in the moments before the parent-death signal
reaches it (tests/integration/test_fault_stops.py kills a real launcher)."""
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from modules.trainer import backup
from modules.util import exit as exits
from tests.patience import patience


def test_a_zombie_counts_as_ended_and_a_live_process_as_running():
    child = subprocess.Popen(["sleep", "0.2"])
    assert exits.process_running(child.pid)
    deadline = time.monotonic() + patience(30)
    while Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
        assert time.monotonic() < deadline, "the child never ended"
        time.sleep(0.01)  # ended, not reaped: a zombie
    assert exits.pid_exists(child.pid) and not exits.process_running(child.pid)
    child.wait()
    assert not exits.process_running(child.pid)
    assert exits.process_running(os.getpid())


def test_a_backup_is_not_published_once_the_launcher_is_gone(tmp_path, monkeypatch):
    weights, state = {"w": torch.ones(2)}, {"step": 1}
    first = backup.write_backup(tmp_path, "run", 1, weights, state, {}, keep=3)
    assert first.is_dir()
    launcher = subprocess.Popen([sys.executable, "-c", "pass"])
    launcher.wait()
    monkeypatch.setattr(exits, "_must_outlive", {launcher.pid})
    with pytest.raises(backup.OrphanedWorkerError, match="launcher has ended"):
        backup.write_backup(tmp_path, "run", 2, weights, state, {}, keep=3)
    assert [b.step for b in backup.list_backups(tmp_path)] == [1]
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [first.name]  # nothing half-written left

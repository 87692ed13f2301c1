"""A remote machine's queue through a real OpenSSH server on 127.0.0.1 (tests/integration/test_remote_ssh.py's): jobs added
from the desktop run there, side by side on the machine's two CPU slots, as ordinary remote runs; a job larger
than the machine is refused there with the same words as here; list, and log, answer from the machine - and the
GUI's Queue tab (ui/remote_queue_controller.py) reads and changes that same queue through the same calls."""
from __future__ import annotations

import getpass
import json
import os
import subprocess
import sys
import time

import pytest

from tests.patience import patience
from tests.integration.test_remote_ssh import REPO, fingerprint, installed_remote, server, sshd_ready  # noqa: F401 - fixtures

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


def test_a_remote_queue_runs_its_jobs_there_side_by_side(server, installed_remote, tmp_path, tandem_home):  # noqa: F811
    home = tmp_path / "desktop-home"
    host = ["--host", f"{getpass.getuser()}@127.0.0.1:{server.port}", "--identity", str(server.user_key),
            "--remote-folder", str(installed_remote), "--accept-host-key", fingerprint(server),
            "--remote-env", f"TANDEM_HOME={tandem_home}", "--remote-env", "OMP_NUM_THREADS=1"]
    quick = [part for value in ("training.max_steps=1", "training.batch_size=2", "sampling.every_n_epochs=0",
                                "general.tensorboard=false", "save.backup_every_n_epochs=0")
             for part in ("--config-value", value)]

    def queue(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(REPO / "scripts" / "train_queue.py"), *host, *args],
                              capture_output=True, text=True, cwd=tmp_path, timeout=patience(600),
                              stdin=subprocess.DEVNULL, env=dict(os.environ, TANDEM_HOME=str(home)))

    from modules.model.demo import ensure_demo_model
    ensure_demo_model()  # the session's demo model serves the remote's jobs, as in tests/integration/test_remote_ssh.py
    refused = queue("--slots", "2", "add", "#demo", "--gpus", "3", *quick)
    assert refused.returncode == 2 and "it needs 3 CPU slots, but this machine has 2 CPU slots" in refused.stderr, \
        refused.stderr[-2000:]
    for name in ("left", "right"):
        added = queue("--json", "add", "#demo", "--gpus", "1", "--name", name, *quick,
                      "--config-value", f"general.workspace_dir={tmp_path / name}")
        assert added.returncode == 0, added.stderr[-3000:]
        assert json.loads(added.stdout)["cwd"] == str(installed_remote)  # the job runs in the remote folder

    def remote_jobs() -> dict:
        listed = queue("--json", "list")
        assert listed.returncode == 0, listed.stderr[-2000:]
        return {job["name"]: job for job in json.loads(listed.stdout)["jobs"]}
    def ended_there() -> bool:
        """The machine's queue file, read here (the remote folder is on this machine): asking through
        train_queue.py every few seconds cost an interpreter, an ssh login and a remote Python each time."""
        try:
            states = [job["state"] for job in json.loads((installed_remote / "queue" / "queue.json").read_text())["jobs"]]
        except (OSError, ValueError, KeyError):
            return False
        return len(states) == 2 and all(state in ("done", "failed") for state in states)
    deadline = time.monotonic() + patience(600)
    while not ended_there() and time.monotonic() < deadline:
        time.sleep(0.5)
    jobs = remote_jobs()  # what the desktop is answered
    assert [jobs[name]["state"] for name in ("left", "right")] == ["done", "done"], jobs
    assert sorted(jobs[name]["gpus"] for name in ("left", "right")) == ["0", "1"]  # side by side on its 2 slots
    for name in ("left", "right"):
        output = jobs[name]["output"]
        assert output.startswith(str(installed_remote / "work")) and (  # the uploaded workspace's twin there
            installed_remote / output / "unet" / "diffusion_pytorch_model.safetensors").is_file()
    queued = json.loads((installed_remote / "queue" / "queue.json").read_text())
    runs = [job["runs"][-1] for job in queued["jobs"]]
    from modules.remote.remote_side import Runs
    registry = {entry["id"]: entry for entry in Runs(installed_remote).all()}
    assert all(registry[run]["state"] == "ended" and registry[run]["exit_code"] == 0 for run in runs)
    log = queue("log", "left")
    assert log.returncode == 0 and "Model saved" in log.stdout

    # The Queue tab with this machine chosen in "Run on": the same queue, the same calls (one ssh login each).
    from modules.config import load_config
    from modules.queue.remote import RemoteQueueError
    from ui.remote_queue_controller import RemoteQueueController
    server.trust()
    remote = server.remote(installed_remote, environment=f"TANDEM_HOME={tandem_home} OMP_NUM_THREADS=1")
    gui = RemoteQueueController(remote, server.known())
    shown = gui.snapshot()
    assert shown.header.startswith(f"{remote.label} · Queue {installed_remote / 'queue'}"), shown.header
    assert [(row.name, row.state) for row in shown.rows] == [("left", "done"), ("right", "done")]
    assert "Model saved" in gui.log_text(shown.rows[0])  # the end of a finished job's log, read there
    gui.pause()  # the job added next stays queued: it is moved and cancelled, never run
    cfg = load_config("#demo", [*quick[1::2], f"general.workspace_dir={tmp_path / 'third'}"])
    assert gui.add(cfg, "third").startswith(f"Queued #3 third on {remote.label}")  # prepared as the CLI's add is
    gui.move(3, "top")
    shown = gui.snapshot()
    assert [(row.name, row.state) for row in shown.rows] == [("third", "queued"), ("left", "done"), ("right", "done")]
    assert shown.paused and shown.waiting
    gui.cancel(3)
    with pytest.raises(RemoteQueueError, match=r"127\.0\.0\.1.*#3 third has already ended \(cancelled\)"):
        gui.cancel(3)  # the remote's refusal: one line naming the machine
    gui.resume()
    shown = gui.snapshot()
    assert not shown.paused and [row.state for row in shown.rows] == ["cancelled", "done", "done"]

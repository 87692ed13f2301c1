"""The GUI's queue: "Add to queue" on the Run tab (the job the config's Multi-GPU settings ask for, or why it is
refused) and the Queue tab (each job's status, GPUs, progress and ETA, its model and log one click away, and the
buttons that move, pause and cancel jobs). The runner is replaced by a recorder here: the jobs running for
real are tests/integration/test_queue_runs.py's. The Queue tab follows the Run tab's "Run on": a remote machine's
queue through a stand-in for ssh here (the rest of the path is the real one), through a real sshd in
tests/integration/test_queue_remote.py."""
from __future__ import annotations

import getpass
import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from modules.queue.store import QueueStore
from modules.remote.host import RemoteHost
from tests.patience import patience
from tests.gui.test_ui_widgets import make_app, pump
from ui.queue_controller import QueueController

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow

PLAYER = """
import json, sys, time
events = [{"type": "config", "world_size": 1, "per_gpu_batch": 2, "accumulation": 1, "global_batch": 2,
           "micro_batches_per_epoch": 5, "steps_per_epoch": 5, "epochs": 2, "total_steps": 10, "base_lr": 1.0,
           "lr_scaling": "none", "lr": 1.0, "split": [], "items_per_epoch": 10, "items_left_out": 0, "run_id": "r-dogs"},
          {"type": "progress", "epoch": 1, "epochs": 2, "step": 4, "total_steps": 10, "images_per_s": 2.0, "eta_s": 75}]
print("training dogs", flush=True)
for event in events:
    print("@tandem " + json.dumps(event), flush=True)
time.sleep(300)
"""


def _queue_with_jobs(folder: Path, tmp_path: Path) -> int:
    """A queue of 2 CPU slots holding a finished job, a running one (a player standing in for training) and a
    failed one; returns the running one's process id."""
    from modules.remote.remote_side import Runs, start
    store = QueueStore(folder)
    (tmp_path / "cats-model").mkdir()
    start(folder, {"id": "run-dogs", "workspace": str(tmp_path / "dogs"), "command": ["-c", PLAYER], "cwd": str(tmp_path)})
    jobs = [
        {"id": 1, "name": "cats", "need": "1", "config": "", "cwd": str(tmp_path), "workspace": str(tmp_path / "cats"),
         "state": "done", "devices": [0], "output": str(tmp_path / "cats-model")},
        {"id": 2, "name": "dogs", "need": "1", "config": "", "cwd": str(tmp_path), "workspace": str(tmp_path / "dogs"),
         "state": "running", "devices": [1], "runs": ["run-dogs"], "started": time.time()},
        {"id": 3, "name": "birds", "need": "2", "config": "", "cwd": str(tmp_path), "workspace": str(tmp_path / "b"),
         "state": "failed", "devices": [0, 1], "message": "PreflightError: data.concepts[0].path: no such folder"},
    ]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "queue.json").write_text(json.dumps({"slots": 2, "next_id": 4, "jobs": jobs}))
    assert Runs(folder).status("run-dogs")["state"] == "running"
    return Runs(folder).status("run-dogs")["training_pid"]


def test_add_to_queue_and_the_queue_tab(display, tmp_path, tandem_home):
    folder = tmp_path / "home" / "queue"  # the app's settings folder (make_app's) holds its queue
    player = _queue_with_jobs(folder, tmp_path)
    started: list[Path] = []
    controller = QueueController(QueueStore(folder), start_runner=lambda store: started.append(store.folder) or True,
                                 cwd=tmp_path)
    from ui.views.app import TandemApp
    import ui.views.app as app_module
    original = app_module.QueueController
    app_module.QueueController = lambda store: controller  # the window's own, with the runner recorded
    try:
        app, dialogs = make_app(tmp_path)
    finally:
        app_module.QueueController = original
    try:
        assert isinstance(app, TandemApp) and app.queue is controller
        view = app.queue_view
        app.tabs.set("Queue")
        assert pump(app, lambda: len(view.table_text()) == 3 and view.table_text()[1][4], timeout=10)
        assert view.table_text() == [["1", "cats", "done", "0", "", ""],
                                     ["2", "dogs", "running", "1", "step 4/10", "1m15s"],
                                     ["3", "birds", "failed", "0,1", "", ""]]
        assert "2 CPU slot(s)" in view.header.cget("text")
        lines = view.lines
        assert lines[1].model.cget("state") == "normal" and lines[2].model.cget("state") == "disabled"
        assert lines[3].pause.cget("state") == "disabled" and lines[3].cancel.cget("state") == "disabled"
        lines[2].log.invoke()  # the log one click away (read off the Tk thread)
        assert pump(app, lambda: "training dogs" in view.log.get("1.0", "end"), timeout=10)
        assert "#2 dogs" in view.log_title.cget("text")

        # Add to queue: what the Training tab's CPU processes ask for; three are more than the queue's 2 slots.
        for path, value in (("training.max_steps", "3"), ("general.workspace_dir", str(tmp_path / "new"))):
            app.binder.fields[path].var.set(value)
        app.multi_gpu._cpu_chosen("3")  # as the Training tab's menu does (it also turns Multi-GPU on)
        app.tabs.set("Run")
        app.run_view.queue_button.invoke()
        assert pump(app, lambda: app.run_view.error_text(), timeout=10)
        assert app.run_view.error_text() == ("Not queued: 'demo' was not queued: it needs 3 CPU slots, but this "
                                             "machine has 2 CPU slots. Ask for at most 2 CPU slots (--gpus 2 or "
                                             "all), or queue it on a machine with more.")
        assert len(QueueStore(folder).read().jobs) == 3 and not started
        app.multi_gpu._cpu_chosen("2")
        app.run_view.queue_button.invoke()
        assert app.run_view.notice_text() == "Adding to the queue..."  # at once; the queue answers in the background
        assert pump(app, lambda: app.run_view.notice_text().startswith("Queued"), timeout=10)
        assert app.run_view.notice_text().startswith("Queued #4 demo (2 CPU slots of 2 CPU slots)")
        assert started == [folder]  # the runner is asked to start; the window does not run the job
        queued = QueueStore(folder).read().find(4)
        assert (queued.state, queued.need, queued.workspace) == ("queued", "2", str(tmp_path / "new"))
        assert json.loads(Path(queued.config).read_text())["training"]["max_steps"] == 3

        app.tabs.set("Queue")
        assert pump(app, lambda: len(view.table_text()) == 4, timeout=10)
        assert view.table_text()[3][:4] == ["4", "demo", "queued", "2 CPU slots"]
        view.lines[4].up.invoke()
        assert pump(app, lambda: [r[1] for r in view.table_text()] == ["cats", "dogs", "demo", "birds"], timeout=10)
        view.lines[2].cancel.invoke()  # a running job: the runner ends it; the queue says so at once
        assert pump(app, lambda: view.table_text()[1][2] == "cancelling", timeout=10)
        assert QueueStore(folder).read().find(2).request == "cancel"
        view.lines[4].pause.invoke()
        assert pump(app, lambda: view.table_text()[2][2] == "paused", timeout=10)
        assert view.lines[4].pause.cget("text") == "Resume"
        app.destroy()
    finally:
        os.killpg(player, signal.SIGKILL)


def test_reopening_shows_a_job_whose_run_vanished_as_interrupted(tmp_path):
    """The machine restarted: the queue file still says running, the run has no supervisor and no exit code."""
    folder = tmp_path / "queue"
    player = _queue_with_jobs(folder, tmp_path)
    from modules.remote.remote_side import Runs
    supervisor = Runs(folder).status("run-dogs")["pid"]
    log = folder / "runs" / "run-dogs" / "output.log"
    deadline = time.monotonic() + patience(30)
    while '"progress"' not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    os.killpg(player, signal.SIGKILL)
    os.kill(supervisor, signal.SIGKILL)
    deadline = time.monotonic() + patience(30)
    while Runs(folder).status("run-dogs")["state"] != "lost" and time.monotonic() < deadline:
        time.sleep(0.1)
    snapshot = QueueController(QueueStore(folder), start_runner=lambda store: pytest.fail("no runner is started")).snapshot()
    dogs = next(row for row in snapshot.rows if row.name == "dogs")
    assert dogs.status == "interrupted - continue from backup" and dogs.step == 4
    assert QueueStore(folder).read().find("dogs").resume == "r-dogs"
    assert not snapshot.runner_alive


@pytest.fixture
def stand_in_remote(tmp_path, monkeypatch, tandem_home) -> RemoteHost:
    """A remote machine standing in on this one: an `ssh` first on PATH runs the remote command in a local sh - the
    transport is the only part that is not the real one - and a remote folder where this checkout is installed
    (`source/current`) at the desktop's version (taken once: other files of the tree may change meanwhile)."""
    from modules.remote import session
    from modules.remote.prepare import INSTALLED_MARK
    from modules.remote.source import local_source
    tools = tmp_path / "bin"
    tools.mkdir()
    ssh = tools / "ssh"
    ssh.write_text('#!/bin/sh\n# ssh OPTIONS... DESTINATION "sh -c SCRIPT": run the last word here\n'
                   'for last; do :; done\nexec sh -c "$last"\n')
    ssh.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tools}{os.pathsep}{os.environ['PATH']}")
    source = local_source()
    monkeypatch.setattr(session, "local_source", lambda: source)
    folder = tmp_path / "remote"
    (folder / "source" / source.version).mkdir(parents=True)
    (folder / "source" / source.version / INSTALLED_MARK).touch()
    (folder / "source" / "current").symlink_to(REPO)
    return RemoteHost(host="127.0.0.1", user=getpass.getuser(), folder=str(folder), python=sys.executable)


def test_the_queue_tab_shows_the_machine_run_on_chooses_and_adds_there(display, tmp_path, stand_in_remote,
                                                                        monkeypatch):
    from PIL import Image

    from modules.queue import actions
    from modules.remote import uploads
    from ui.remote_queue_controller import RemoteQueueController
    from ui.settings import SavedRemotes
    from ui.views.remote_frame import NEW_REMOTE, THIS_MACHINE
    host = stand_in_remote
    saved = SavedRemotes(tmp_path / "home")
    saved.save(host)
    saved.choose("")  # the window opens on this machine
    remote_queue = QueueStore(Path(host.folder) / "queue")
    actions.set_slots(remote_queue, 1)  # its CPU slot is not counted with torch there at each add: quicker
    app, dialogs = make_app(tmp_path)
    try:
        view = app.queue_view
        header = lambda: view.header.cget("text")  # noqa: E731
        pump(app, timeout=0.5)  # more than a tick
        assert header() == ""  # the Queue tab not shown: no queue is read
        app.tabs.set("Queue")
        assert pump(app, lambda: header().startswith("This computer · Queue "), timeout=10), header()
        local = view.controller
        app.remote.choose(app.remote.menu.cget("values")[1])  # Run on: the remote machine
        assert isinstance(view.controller, RemoteQueueController) and view.controller.host == host
        assert pump(app, lambda: header().startswith(f"{host.label} · Queue {host.folder}/queue"), timeout=30), \
            (header(), view.notice_text())
        view.pause_queue_button.invoke()  # the remote queue's own words, there: nothing it holds starts
        assert pump(app, lambda: view.pause_queue_button.cget("text") == "Resume queue", timeout=30), view.notice_text()
        assert remote_queue.read().paused

        # Add to queue with the remote chosen: prepared as a remote start is - its data uploaded, a large upload
        # asked about as a remote start asks (here every upload is "large") - and queued there.
        checked = app.remote.current
        assert pump(app, lambda: checked.report is not None, timeout=60), checked.notice  # what Start checks too
        data = tmp_path / "cats"
        data.mkdir()
        for i in range(2):
            Image.new("RGB", (32, 32), (i * 90, 0, 0)).save(data / f"{i}.png")
            (data / f"{i}.txt").write_text(f"a cat {i}")
        app.binder.fields["data.concepts[0].path"].var.set(str(data))
        app.binder.fields["training.max_steps"].var.set("3")
        monkeypatch.setattr(uploads, "LARGE_UPLOAD_BYTES", 100)
        app.tabs.set("Run")
        dialogs.yes_no_answer = False
        app.run_view.queue_button.invoke()
        assert pump(app, lambda: app.run_view.error_text(), timeout=120), app.run_view.notice_text()
        assert app.run_view.error_text() == f"Not queued: {host.label}: the upload was declined; nothing was queued"
        assert app.run_view.notice_text() == ""
        assert "Upload now?" in dialogs.questions[-1] and not remote_queue.read().jobs
        dialogs.yes_no_answer = True
        app.run_view.queue_button.invoke()
        assert pump(app, lambda: app.run_view.notice_text().startswith("Queued"), timeout=120), \
            (app.run_view.notice_text(), app.run_view.error_text())
        assert app.run_view.notice_text().startswith(f"Queued #1 demo on {host.label}")
        assert len(list((Path(host.folder) / "files" / "data").glob("cats-*/0.png"))) == 1  # uploaded
        job = remote_queue.read().find(1)
        assert (job.state, job.cwd) == ("queued", host.folder)  # it runs in the remote folder, on the uploads
        queued = json.loads(Path(job.config).read_text())
        assert queued["training"]["max_steps"] == 3
        assert queued["general"]["workspace_dir"].startswith("work/")  # the config as the remote runs it
        app.tabs.set("Queue")
        assert pump(app, lambda: [row[:3] for row in view.table_text()] == [["1", "demo", "queued"]], timeout=30)

        app.remote.choose(NEW_REMOTE)  # no machine yet: one line says so, no traceback
        assert pump(app, lambda: "No machine to ask yet" in view.notice_text(), timeout=10)
        assert view.table_text() == []
        app.remote.choose(THIS_MACHINE)
        assert view.controller is local
        assert pump(app, lambda: header().startswith("This computer · Queue ") and not view.notice_text(), timeout=10)
        assert view.table_text() == []  # this machine's queue is empty: the job went to the remote's
    finally:
        app.remote.detach_all()
        app.destroy()

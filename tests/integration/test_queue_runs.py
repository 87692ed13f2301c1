"""The queue running real jobs (the demo, a few steps) through scripts/train_queue.py, CPU processes standing in
for GPUs (`--slots 2`): 1- and 2-process jobs on the right slots and never two on one slot, a failing job that
stops no other, a job larger than the machine refused, the machine "restarting" mid-job (the runner and the
job's processes killed) and the queue reopened: the job interrupted, to continue from its backup, and the
queued ones still queued; resumed, it continues from that backup; paused, it stops with a backup; cancelled
while it runs, its processes end and the job says so. One run of the queue covers it all; the scheduling rules themselves are
tests/unit/test_queue.py's."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.patience import patience

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]
QUICK = ["sampling.every_n_epochs=0", "general.tensorboard=false", "save.backup_every_n_epochs=0",
         "training.batch_size=2", "data.num_workers=0"]


def queue(folder: Path, home: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "train_queue.py"), "--folder", str(folder), *args],
                          capture_output=True, text=True, cwd=REPO, timeout=patience(120), stdin=subprocess.DEVNULL,
                          env=dict(os.environ, TANDEM_HOME=str(home), OMP_NUM_THREADS="1"))
    assert not check or done.returncode == 0, done.stderr + done.stdout
    return done


def overrides(*values: str) -> list[str]:
    return [part for value in (*QUICK, *values) for part in ("--config-value", value)]


def jobs(folder: Path) -> dict[str, dict]:
    return {job["name"]: job for job in json.loads((folder / "queue.json").read_text())["jobs"]}


def wait_for(what: str, check, seconds: float):
    deadline = time.monotonic() + patience(seconds)
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}")


def run_dir(folder: Path, job: dict) -> Path:
    return folder / "runs" / job["runs"][-1]


def log_of(folder: Path, job: dict) -> str:
    try:
        return (run_dir(folder, job) / "output.log").read_text(errors="replace")
    except (OSError, IndexError):
        return ""


def test_a_queue_of_one_and_two_process_jobs_survives_a_restart_and_a_failing_job(tmp_path, tandem_home):
    folder, home = tmp_path / "queue", tandem_home
    images = tmp_path / "images"  # the failing job's data, gone by the time it runs
    images.mkdir()
    from PIL import Image
    for i in range(4):
        Image.new("RGB", (64, 64), (60 * i, 0, 0)).save(images / f"{i}.png")
        (images / f"{i}.txt").write_text(f"a square {i}")
    queue(folder, home, "--slots", "2", "pause")  # nothing starts until all are queued
    queue(folder, home, "add", "#demo", "--gpus", "1", "--name", "long", *overrides(
        f"general.workspace_dir={tmp_path / 'long'}", "training.max_steps=100000", "save.backup_every_n_steps=1"))
    queue(folder, home, "add", "#demo", "--gpus", "1", "--name", "broken", *overrides(
        f"general.workspace_dir={tmp_path / 'broken'}", "training.max_steps=1", f"data.concepts[0].path={images}"))
    queue(folder, home, "add", "#demo", "--gpus", "2", "--name", "pair", *overrides(
        f"general.workspace_dir={tmp_path / 'pair'}", "training.max_steps=1", "general.device=cpu"))
    queue(folder, home, "add", "#demo", "--name", "short", *overrides(
        f"general.workspace_dir={tmp_path / 'short'}", "training.max_steps=1"))
    refused = queue(folder, home, "add", "#demo", "--gpus", "3", "--name", "big", *overrides(), check=False)
    assert refused.returncode == 2
    assert refused.stderr.strip() == ("error: 'big' was not queued: it needs 3 CPU slots, but this machine has 2 CPU "
                                      "slots. Ask for at most 2 CPU slots (--gpus 2 or all), or queue it on a machine "
                                      "with more.")
    assert "Queued #4 short" not in refused.stdout and "big" not in jobs(folder)
    assert queue(folder, home, "move", "short", "3").stdout.strip() == "#4 short is now number 3 in the queue."
    assert list(jobs(folder)) == ["long", "broken", "short", "pair"]
    shutil.rmtree(images)
    queue(folder, home, "resume")  # the whole queue: its runner starts

    # long takes slot 0, broken slot 1 and fails; short takes slot 1; pair waits for both and keeps slot 1.
    long = wait_for("long's first backup", lambda: (j := jobs(folder)["long"])["state"] == "running"
                    and '"type": "backup"' in log_of(folder, j) and j, 600)
    training = json.loads((run_dir(folder, long) / "run.json").read_text())["training_pid"]
    environment = Path(f"/proc/{training}/environ").read_bytes().split(b"\0")
    assert b"CUDA_VISIBLE_DEVICES=0" in environment  # the job sees its own slot only
    broken = wait_for("broken to fail", lambda: (j := jobs(folder)["broken"])["state"] == "failed" and j, 600)
    assert str(images) in broken["message"] and broken["devices"] == [1], broken["message"]
    short = wait_for("short to finish", lambda: (j := jobs(folder)["short"])["state"] in ("done", "failed") and j, 600)
    assert short["state"] == "done" and short["devices"] == [1], short["message"] + log_of(folder, short)[-3000:]
    assert Path(short["output"]).is_dir()
    assert jobs(folder)["pair"]["state"] == "queued" and jobs(folder)["long"]["state"] == "running"

    # The machine restarts: the runner and the job's processes die at once, no exit code written.
    state = json.loads((folder / "queue.json").read_text())
    long = jobs(folder)["long"]
    supervisor = json.loads((run_dir(folder, long) / "run.json").read_text())
    os.kill(state["runner"]["pid"], signal.SIGKILL)
    os.killpg(supervisor["training_pid"], signal.SIGKILL)
    os.kill(supervisor["pid"], signal.SIGKILL)
    wait_for("the killed processes to go", lambda: not Path(f"/proc/{supervisor['pid']}").exists()
             and not Path(f"/proc/{state['runner']['pid']}").exists(), 30)
    listed = queue(folder, home, "list").stdout  # reopened: the file tells what it knew, the runs what became of them
    lines = {line.split()[1]: line for line in listed.splitlines()[2:]}
    assert "runner not going" in listed.splitlines()[0]
    assert "interrupted - continue from backup" in lines["long"], listed
    assert " failed " in lines["broken"] and "queued" in lines["pair"] and f"model: {short['output']}" in lines["short"]
    assert jobs(folder)["pair"]["state"] == "queued"

    queue(folder, home, "resume", "long")  # continues from its backup; pair still waits for both slots
    resumed = wait_for("long to continue from its backup",
                       lambda: len((j := jobs(folder)["long"])["runs"]) == 2 and "Continuing" in log_of(folder, j) and j,
                       600)
    assert "--resume" in json.loads((run_dir(folder, resumed) / "run.json").read_text())["command"]
    assert resumed["devices"] == [0] and jobs(folder)["pair"]["state"] == "queued"
    assert queue(folder, home, "pause", "long").stdout.strip() == "#1 long: pausing - it stops with a backup at its next step"
    paused = wait_for("long to pause", lambda: (j := jobs(folder)["long"])["state"] == "paused" and j, 300)
    assert paused["resume"] and paused["resume"] == paused["train_run_id"] and paused["exit_code"] == 0
    queue(folder, home, "resume", "long")  # running again, then cancelled while it runs
    running = wait_for("long to run a third time", lambda: len((j := jobs(folder)["long"])["runs"]) == 3
                       and j["state"] == "running" and "Continuing" in log_of(folder, j) and j, 600)
    training = json.loads((run_dir(folder, running) / "run.json").read_text())["training_pid"]
    assert queue(folder, home, "cancel", "long").stdout.strip() == "#1 long: cancelling - it stops at its next step"
    cancelled = wait_for("long to be cancelled", lambda: (j := jobs(folder)["long"])["state"] == "cancelled" and j, 300)
    assert cancelled["message"] == "cancelled while it ran", cancelled
    wait_for("the cancelled run's processes to end", lambda: not Path(f"/proc/{training}").exists(), 60)
    assert "Traceback" not in log_of(folder, cancelled), log_of(folder, cancelled)[-3000:]
    pair = wait_for("pair to finish", lambda: (j := jobs(folder)["pair"])["state"] in ("done", "failed") and j, 600)
    assert pair["state"] == "done" and pair["devices"] == [0, 1], pair["message"] + log_of(folder, pair)[-3000:]
    assert '"world_size": 2' in log_of(folder, pair)  # two CPU processes
    assert jobs(folder)["long"]["state"] == "cancelled"
    wait_for("the runner to leave an empty queue", lambda: "runner not going" in queue(folder, home, "list").stdout, 60)

    # Never two runs on one slot at once, each on as many slots as it asked for.
    runs = [(name, entry) for name, job in jobs(folder).items() for entry in job["history"]]
    assert sorted(len(entry["devices"]) for _, entry in runs) == [1, 1, 1, 1, 1, 2]
    for i, (name, one) in enumerate(runs):
        for other_name, other in runs[i + 1:]:
            overlap = one["started"] < (other["ended"] or 1e12) and other["started"] < (one["ended"] or 1e12)
            assert not (overlap and set(one["devices"]) & set(other["devices"])), (name, one, other_name, other)
    log = queue(folder, home, "log", "broken")
    assert str(images) in log.stdout and "#2 broken failed" in log.stderr

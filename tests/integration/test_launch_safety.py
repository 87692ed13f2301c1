"""What the launchers guarantee while workers run, through the real scripts on 2 CPU processes (gloo):
the rendezvous listens on the configured address only; a failed job names the rank that failed first;
SIGINT/SIGTERM stop every rank with a backup, whatever signal dispositions the launcher inherited."""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
from pathlib import Path

import pytest

from modules.util.run_protocol import parse_event_line
from tests.integration.test_distributed import _worker_pids, read_until_step
from tests.trainer_helpers import REPO, launcher_flag, overrides_for, start_script
from tests.patience import patience

LAUNCHERS = ["torchrun", "spawn"]


@pytest.fixture(scope="module")
def cache_dir(tandem_home, tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("latent_cache")


def start_training(workspace: Path, cache: Path, launcher: str, *extra: str, **popen_kwargs) -> subprocess.Popen:
    args = ["--config-path", "#demo", "--device", "cpu", "--num-gpus", "2",
            *overrides_for(workspace, cache, "training.max_steps=100000", "multi_gpu.timeout_minutes=1", *extra)]
    args += launcher_flag(launcher)
    return start_script("train_multi_gpu.py", *args, start_new_session=True, **popen_kwargs)


def finish(proc: subprocess.Popen, lines: list[str], timeout: float = 150) -> tuple[int | str, str]:
    """The exit code (or "timed out") and whole output of a run; the process group is killed whatever happens."""
    try:
        rest, _ = proc.communicate(timeout=patience(timeout))
        code: int | str = proc.returncode
    except subprocess.TimeoutExpired:
        code = f"timed out after {timeout:g} s"
        os.killpg(proc.pid, signal.SIGKILL)
        rest, _ = proc.communicate()
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return code, "".join(lines) + (rest or "")


def events(output: str) -> list[dict]:
    return [e for e in map(parse_event_line, output.splitlines()) if e]


def process_tree(root: int) -> list[int]:
    rows = subprocess.run(["ps", "-eo", "pid,ppid"], capture_output=True, text=True).stdout.split("\n")[1:]
    children: dict[int, list[int]] = {}
    for row in filter(None, map(str.split, rows)):
        children.setdefault(int(row[1]), []).append(int(row[0]))
    found, stack = [], [root]
    while stack:
        pid = stack.pop()
        found.append(pid)
        stack += children.get(pid, [])
    return found


def listening_sockets(pids: list[int]) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket the processes listen on, from /proc (no psutil, no ss)."""
    inodes = set()
    for pid in pids:
        try:
            fds = list(Path(f"/proc/{pid}/fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[len("socket:["):-1])
    found = []
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        for row in Path(table).read_text().splitlines()[1:]:
            fields = row.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state != "0A" or inode not in inodes:  # 0A: LISTEN
                continue
            address, port = local.split(":")
            raw = bytes.fromhex(address)
            # The kernel prints each 32-bit word of the address in host (little-endian) order.
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            found.append((socket.inet_ntop(family, raw), int(port, 16)))
    return found


# -- item 8: the rendezvous listens on the configured address only --------------------------------
# Through the launchers: test_killed_rank_is_the_headline_... and test_signal_to_the_launcher_... (torchrun)
# below look at the sockets of the running job (torchrun's agent store and spawn's rank-0 store) before they
# end it.

def test_rendezvous_store_binds_the_named_address_only():
    import datetime

    from modules.distributed import rendezvous
    with rendezvous.serve("127.0.0.1", 0, datetime.timedelta(seconds=30)) as address:
        host, port = rendezvous.split_endpoint(address)
        assert host == "127.0.0.1" and ("127.0.0.1", port) in listening_sockets([os.getpid()])
        assert not [s for s in listening_sockets([os.getpid()]) if s[1] == port and s[0] != "127.0.0.1"]
        store = rendezvous.connect(address, datetime.timedelta(seconds=30))
        store.set("k", "v")
        assert store.get("k") == b"v"
        with pytest.raises(rendezvous.RendezvousError, match=f"cannot listen on 127.0.0.1:{port}"):
            with rendezvous.serve("127.0.0.1", port, datetime.timedelta(seconds=5)):
                pass


# -- item 15: the headline names the rank that failed first ---------------------------------------

def test_first_failure_prefers_the_rank_that_died_over_its_peers_complaints():
    from modules.distributed.failures import WorkerError, WorkerExit, first_failure, is_secondary
    reset = "RuntimeError", "[gloo/pair.cc:553] Connection closed by peer [127.0.0.1]:29588"
    rank0 = WorkerError(0, 100.0, *reset, is_secondary(*reset))
    assert rank0.secondary
    # rank 1 was killed; rank 0 complained first, and both were seen in the same poll.
    first = first_failure([WorkerExit(0, 1, 101.0), WorkerExit(1, -9, 101.0)], {0: rank0})
    assert first.rank == 1 and first.text.startswith("rank 1 died first (signal SIGKILL")
    # A real error on rank 1 beats rank 0's earlier complaint about the lost connection.
    boom = WorkerError(1, 100.5, "ValueError", "bad value", False)
    assert first_failure([WorkerExit(0, 1, 101.0), WorkerExit(1, 1, 101.0)], {0: rank0, 1: boom}).rank == 1
    # Two real errors: the earlier one.
    early = WorkerError(0, 99.0, "OSError", "disk full", False)
    assert first_failure([], {0: early, 1: boom}).text == "rank 0 failed first: OSError: disk full"
    # Only complaints (a timeout on both): the earliest; nothing known: say so.
    later = WorkerError(1, 130.0, "DistBackendError", "wait timed out", True)
    assert first_failure([WorkerExit(0, 1, 131.0), WorkerExit(1, 1, 131.0)], {0: rank0, 1: later}).rank == 0
    assert first_failure([WorkerExit(1, 3, 5.0)], {}).text.startswith("rank 1 died first (exit code 3")
    assert first_failure([], {}).rank is None


def test_a_failed_write_on_rank_0_is_the_headline_whichever_rank_noted_its_error_first(tmp_path):
    """A failed final save: rank 1 learns it through MainRankFailed and may note that before rank 0 notes its
    own error; the headline must still name rank 0 and its error (3 of 6 trials named rank 1)."""
    from modules.distributed.failures import WorkerExit, first_failure, read_errors, record_error
    from modules.util.dist_utils import MainRankFailed
    record_error(tmp_path, 1, MainRankFailed("rank 0 failed: PermissionError: [Errno 13] Permission denied: '/out'"),
                 step=3)
    assert first_failure([WorkerExit(1, 1, 101.0)], read_errors(tmp_path)).text == \
        "rank 0 failed first: PermissionError: [Errno 13] Permission denied: '/out'"  # rank 0 had no time to note it
    record_error(tmp_path, 0, PermissionError(13, "Permission denied", "/out"), step=3)
    first = first_failure([WorkerExit(0, 1, 101.0), WorkerExit(1, 1, 101.0)], read_errors(tmp_path))
    assert first.rank == 0 and first.text == "rank 0 failed first: PermissionError: [Errno 13] Permission denied: '/out'"


def test_a_rank_named_stuck_by_a_watchdog_is_the_headline_not_the_kill_that_ended_it(tmp_path):
    """Rank 0's watchdog ends it because rank 1 stopped answering; the launcher then kills the stuck rank 1.
    The headline says what the watchdog saw, where rank 1 was, not that rank 1 'died first'."""
    from modules.distributed.failures import WorkerExit, first_failure, read_errors, record_blame
    record_blame(tmp_path, 0, 1, "rank 1 stopped answering: no sign of life for 30 s", step=24, phase="training step")
    errors = read_errors(tmp_path)
    late_kill = [WorkerExit(0, 3, errors[0].time + 0.5), WorkerExit(1, -9, errors[0].time + 15)]
    first = first_failure(late_kill, errors)
    assert (first.rank, first.text) == (1, "rank 1 stopped answering: no sign of life for 30 s at step 24 "
                                           "(training step); the other ranks ended because of it.")
    # A rank that died before any watchdog spoke died first, and its step is known if one saw it.
    early = [WorkerExit(2, -9, errors[0].time - 5)]
    assert first_failure(early, errors).text.startswith("rank 2 died first (signal SIGKILL")


@pytest.mark.slow
@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_killed_rank_is_the_headline_of_the_log_and_the_gui_and_its_only_error_event(tmp_path, cache_dir, launcher):
    """SIGKILL on rank 1 of a run the GUI's controller started: the log's last error line and the GUI's red
    headline name rank 1 and SIGKILL (the headline said "Connection reset/closed by peer ... (rank 0)").
    On the same launch (one each instead of a third under torchrun): the events hold one `error`, the
    headline naming rank 1 - under torchrun the surviving rank's gloo error ("Connection closed by peer") was
    sent as an `error` event before the launcher's headline, 4 of 7 kills, and the GUI showed it first - and
    nothing of what torchrun prints above a failure (tracebacks, ChildFailedError) reaches the log.
    Item 8, while the job runs: the store (spawn's on rank 0, torchrun's in its agent) listened on every
    interface (*:port); it must listen on 127.0.0.1 only."""
    import time

    from tests.integration.test_faults import NOISE
    from tests.trainer_helpers import demo_config
    from ui.events import TrainingEvent
    from ui.run_controller import RunController
    cfg = demo_config(tmp_path / "ws", cache_dir, "training.max_steps=100000", "multi_gpu.timeout_minutes=1",
                      "multi_gpu.enabled=true", "multi_gpu.num_gpus=2", f"multi_gpu.launcher={launcher}")
    controller = RunController(cwd=REPO)
    controller.start(cfg, visible_gpus=0)
    seen: list[TrainingEvent] = []
    sockets: list[tuple[str, int]] | None = None

    def poll() -> None:
        seen.extend(item for item in controller.poll() if isinstance(item, TrainingEvent))
    try:
        deadline = time.monotonic() + patience(240)
        while controller.state.step < 2 and controller.state.active and time.monotonic() < deadline:
            poll()
            time.sleep(0.05)
        assert controller.state.step >= 2, "\n".join(controller.log)[-3000:]
        launcher_pid = controller.run_host.process.pid
        if Path("/proc/net/tcp").exists():  # read from Linux's /proc
            sockets = listening_sockets(process_tree(launcher_pid))
        os.kill(_worker_pids(launcher_pid)[-1], signal.SIGKILL)  # the worker started last: rank 1
        deadline = time.monotonic() + patience(150)
        while controller.state.active and time.monotonic() < deadline:
            poll()
            time.sleep(0.05)
        assert not controller.state.active, "the job did not end after a worker died"
        poll()
    finally:
        controller.terminate()
    assert controller.state.status == "failed"
    headline = controller.state.error.splitlines()[0]
    assert headline.startswith("rank 1 died first (signal SIGKILL"), controller.state.error[:1500]
    errors = [e.data for e in seen if e.type == "error"]
    assert len(errors) == 1, f"{len(errors)} error events: {errors}"
    assert errors[0].get("failed_rank") == 1 and errors[0]["text"].startswith("rank 1 died first (signal SIGKILL"), \
        errors[0]
    from modules.util.run_protocol import EVENTS
    echoed = re.compile(rf"\[({'|'.join(EVENTS)})\] ")  # the controller echoes events as "[error] ..."
    log_lines = [line for line in controller.log if not echoed.match(line)]
    last_error = [line for line in log_lines if re.search(r"fail|error", line, re.IGNORECASE)][-1]
    assert last_error.startswith("Training failed: rank 1 died first (signal SIGKILL"), last_error
    assert not [word for word in NOISE if any(word in line for line in log_lines)], "\n".join(log_lines)[-3000:]
    assert not _worker_pids(launcher_pid), "worker processes left behind"
    if sockets is not None:
        assert_rendezvous_on_loopback_only("\n".join(controller.log), sockets)


# -- item 16: SIGINT/SIGTERM stop every rank with a backup, whatever was inherited ----------------

def _ignore(*signums: int):
    def preexec() -> None:
        for signum in signums:
            signal.signal(signum, signal.SIG_IGN)
    return preexec


@pytest.mark.slow
@pytest.mark.parametrize("launcher, signum, when", [("spawn", signal.SIGINT, "start-up"),
                                                    ("torchrun", signal.SIGTERM, "step 2"),
                                                    ("spawn", signal.SIGTERM, "step 2, to the group")],
                         ids=["SIGINT-at-start-up-spawn", "SIGTERM-torchrun", "SIGTERM-to-the-group-spawn"])
def test_signal_to_the_launcher_stops_with_a_backup_even_if_inherited_ignored(tmp_path, cache_dir, launcher, signum,
                                                                             when):
    """`nohup train_multi_gpu.py &` starts the launcher with SIGINT (and here SIGTERM) ignored: `kill -INT`
    or a scheduler's SIGTERM to the launcher must still stop every rank at one step, with one backup.
    Each signal once and each launcher once: the launcher takes both signals with one handler
    (supervision.StopSignals) and the stop reaches the ranks the same way whichever signal it was (the
    commands file), so the other two pairs ran the same code again (two launches of CI time).
    `start-up`: the signal comes as the launcher announces its workers, so the stop it writes comes before
    rank 0 has opened the commands file, and must still stop the run (commands reach every rank with the next
    step's report: the first step a stop can end is step 2).
    `to the group`: SIGTERM to every process of the launch at once (a scheduler's, the GUI's terminate), the
    forkserver the spawn launcher's workers are forked from and the ranks' DataLoader workers included
    (data.num_workers=1): still one clean stop - the forkserver must not end and take the workers with it
    mid-step, and the loader workers must not die of it (their ranks failed, "DataLoader worker ... killed
    by signal: Terminated", no backup, 4 of 4). That launch inherits only SIGINT ignored, so that SIGTERM
    reaches every process with its default action; SIGTERM inherited ignored is the torchrun case's.
    Item 8, on the torchrun launch (its store is looked at while its job runs): torchrun's agent store listened
    on every interface (*:port); it must listen on 127.0.0.1 only (spawn's rank-0 store: the killed-rank test)."""
    ws = tmp_path / "ws"
    group = when.endswith("to the group")
    ignored = (signal.SIGINT,) if group else (signal.SIGINT, signal.SIGTERM)
    loaders = ("data.num_workers=1",) if group else ()
    proc = start_training(ws, cache_dir, launcher, *loaders, preexec_fn=_ignore(*ignored))
    lines: list[str] = []
    sockets: list[tuple[str, int]] | None = None
    try:
        if when == "start-up":
            for line in proc.stdout:
                lines.append(line)
                if line.startswith("Tandem multi-GPU:"):
                    break
        else:
            lines += read_until_step(proc, 2)
            if launcher == "torchrun" and Path("/proc/net/tcp").exists():  # read from Linux's /proc
                sockets = listening_sockets(process_tree(proc.pid))
        if group:
            os.killpg(proc.pid, signum)
        else:
            os.kill(proc.pid, signum)  # the launcher only, as `kill -INT <pid>` does
    finally:
        code, output = finish(proc, lines)
    assert code == 0, output[-3000:]
    assert f"{signal.Signals(signum).name}: stopping every rank at the next step (with a backup)" in output, \
        output[-3000:]
    found = events(output)
    done = [e for e in found if e["type"] == "done"]
    backups = [e for e in found if e["type"] == "backup"]
    assert len(done) == 1 and not done[0]["completed"], f"no clean stop: done events {done}\n{output[-3000:]}"
    done = done[0]
    assert len(backups) == 1 and backups[0]["step"] == done["step"], \
        f"the signal did not stop every rank at one step with one backup: {backups}, stopped at {done['step']}"
    if when == "start-up":
        assert done["step"] <= 2, f"a stop sent during the start-up ended step {done['step']}"
    assert not [e for e in found if e["type"] == "error"], output[-3000:]
    assert "killed by signal" not in output, output[-3000:]
    assert [p.name for p in (ws / "backups").rglob("step-*")] == [f"step-{done['step']:08d}"]  # backups/<run>/
    assert not _worker_pids(proc.pid), "worker processes left behind"
    if sockets is not None:
        assert_rendezvous_on_loopback_only(output, sockets)


def assert_rendezvous_on_loopback_only(output: str, sockets: list[tuple[str, int]]) -> None:
    """The launch's rendezvous store (named in its "Tandem multi-GPU: ..." line) listens on 127.0.0.1, and nothing
    of the launch listens on every interface."""
    port = int(re.search(r"rendezvous 127\.0\.0\.1:(\d+)", output).group(1))
    assert ("127.0.0.1", port) in sockets, f"the rendezvous store does not listen on 127.0.0.1:{port}: {sockets}"
    wildcard = [s for s in sockets if s[0] in ("0.0.0.0", "::")]
    assert not wildcard, f"listening on every interface: {wildcard} (all: {sockets})"


@pytest.mark.slow
def test_a_second_stop_signal_names_the_backup_left_to_continue(tmp_path, cache_dir):
    """Two Ctrl-C in a row under torchrun: the workers end at once, and the last line names this run's newest
    backup (it said "the workers were ended without a backup" although one was written)."""
    from modules.trainer import backup as backups
    ws = tmp_path / "ws"
    proc = start_training(ws, cache_dir, "torchrun", "save.backup_every_n_steps=2")
    lines: list[str] = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if '"type": "backup"' in line:
                break
        os.kill(proc.pid, signal.SIGINT)
        for line in proc.stdout:  # two signals sent at once reach a process as one
            lines.append(line)
            if line.startswith("SIGINT: stopping every rank"):
                break
        os.kill(proc.pid, signal.SIGINT)
    finally:
        code, output = finish(proc, lines)
    assert code == 130, output[-3000:]
    newest = backups.latest_backup(ws / "backups")
    assert newest is not None, output[-3000:]
    assert (f"Training aborted by a second stop signal: the workers were ended; the newest backup of this run is "
            f"step {newest.step} ({newest.path})") in output, output[-3000:]
    assert "without a backup" not in output

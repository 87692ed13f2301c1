"""How a job ends when its launcher dies, through the real spawn launcher on 2 CPU processes (gloo): the
workers of a killed spawn launcher end with it, write nothing after it and hold the workspace until they are
gone. (A SIGTERM to a spawn run's whole process group with DataLoader workers is a clean stop:
tests/integration/test_launch_safety.py's signal test, its `group` case; a killed rank gives the GUI one `error` event, its
own: tests/integration/test_launch_safety.py's killed-rank test; a killed torchrun launcher: tests/integration/test_faults.py.)

Every time limit here detects a hang only (the machine may be busy): the waits end when the awaited thing
happens, and each failure says what was seen."""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from modules.benchmark.fault_trials import _alive, _children, _descendants, _is_forkserver, _ranks
from tests.integration.test_faults import Run
from tests.patience import patience


@pytest.fixture(scope="module")
def cache_dir(tandem_home, tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("latent_cache")


@pytest.mark.slow
def test_the_workers_of_a_killed_spawn_launcher_end_at_once_and_write_no_backup_after_it(tmp_path, cache_dir):
    """kill -9 of the spawn launcher: its workers trained on for 2.8-16.4 s (4 of 4) and wrote backups after it was
    gone, while the docs say they die with it. Every process it started - the forkserver, the ranks and their
    loader workers - must be gone at once, and no backup completed after the launcher died. A backup every step
    makes a worker that lives on write one. A new run's start on the workspace (the launcher's own lock went
    with it) waits for the workers' locks: no rank may still live once it has the workspace (they lived on for
    1.6-33 s while the workspace already looked free). tests/integration/test_faults.py kills a torchrun launcher."""
    from modules.trainer.backup import list_backups
    from modules.util.workspace_lock import WorkspaceLock
    ws = tmp_path / "ws"
    run = Run(ws, cache_dir, "spawn", "save.backup_every_n_steps=1")
    run.wait_for_step(3)
    launcher = run.proc.pid
    ranks = _ranks(launcher)
    watched = {pid: "forkserver" for pid in _children().get(launcher, []) if _is_forkserver(pid)}
    watched.update({pid: f"rank {rank}" for rank, pid in enumerate(sorted(ranks))})
    for rank, pid in enumerate(sorted(ranks)):
        watched.update({loader: f"a loader worker of rank {rank}" for loader in _descendants(pid)})
    assert len(ranks) == 2 and len(watched) >= 5, f"the processes of the launch: {watched}"
    os.kill(launcher, signal.SIGKILL)
    killed = time.time()
    run.proc.wait(timeout=patience(60))
    launcher_gone = time.time()
    WorkspaceLock(ws).acquire().release()  # a new run's start: it may have to wait for the workers' own locks
    ranks_when_free = _alive(sorted(ranks))
    ended: dict[int, float] = {}
    limit_s = 60.0  # a hang detector: on an idle machine they end within milliseconds
    while len(ended) < len(watched) and time.time() - killed < limit_s:
        alive = set(_alive(list(watched)))
        ended.update({pid: time.time() for pid in watched if pid not in alive and pid not in ended})
        time.sleep(0.02)
    try:
        assert not ranks_when_free, f"ranks {ranks_when_free} of the killed launcher lived on while a new run took " \
                                    "the workspace"
        still = {f"{watched[pid]} (pid {pid})" for pid in watched if pid not in ended}
        assert not still, f"{', '.join(sorted(still))} still ran {limit_s:.0f} s after their launcher was killed"
        late = {f"{watched[pid]} (pid {pid})": round(at - killed, 2) for pid, at in ended.items() if at - killed > 5}
        assert not late, f"seconds each process lived on after its launcher was killed: {late}"
        after = [(b.step, round(b.written - launcher_gone, 2)) for b in list_backups(ws / "backups")
                 if b.written > launcher_gone]
        assert not after, f"backups (step, seconds after the launcher was gone) written by orphaned workers: {after}"
    finally:
        run.finish()


def test_only_a_users_own_torchrun_has_its_workers_send_their_error_events():
    """Tandem's launchers send the one `error` event, their headline; a worker's own would come first and may be
    only a peer's complaint. Under a user's own torchrun the worker's error is all there is, unless it is about
    another rank."""
    from types import SimpleNamespace

    from modules.distributed.worker import sends_error_event
    from modules.launch.spec import EXTERNAL, SPAWN
    ours, theirs = (SimpleNamespace(spec=SimpleNamespace(launcher=name)) for name in ("torchrun", EXTERNAL))
    own, peer = ("OSError", "[Errno 28] No space left on device"), ("RuntimeError", "Connection closed by peer")
    assert not sends_error_event(ours, *own) and not sends_error_event(ours, *peer)
    assert not sends_error_event(SimpleNamespace(spec=SimpleNamespace(launcher=SPAWN)), *own)
    assert sends_error_event(theirs, *own) and not sends_error_event(theirs, *peer)

"""How a job ends when it is stopped or its launcher dies, through the real launchers on 2 CPU processes (gloo):
a SIGTERM to a spawn run's whole process group with DataLoader workers is a clean stop; the workers of a killed
spawn launcher end with it and write nothing after it; a killed rank gives the GUI one `error` event, its own.

Every time limit here detects a hang only (the machine may be busy): the waits end when the awaited thing
happens, and each failure says what was seen."""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from modules.benchmark.fault_trials import _alive, _children, _descendants, _is_forkserver, _ranks
from modules.util.run_protocol import parse_event_line
from tests.test_faults import NOISE, Run
from tests.patience import patience


@pytest.fixture(scope="module")
def cache_dir(tandem_home, tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("latent_cache")


def events(run: Run) -> list[dict]:
    return [e for e in map(parse_event_line, run.output().splitlines()) if e]


@pytest.mark.slow
def test_sigterm_to_a_spawn_runs_process_group_stops_cleanly_with_loader_workers(tmp_path, cache_dir):
    """What a scheduler's or the GUI's "terminate" does: SIGTERM to every process of the launch at once, the ranks'
    DataLoader workers included. The loader workers died of it and their ranks failed ("DataLoader worker ...
    killed by signal: Terminated", no backup), 4 of 4; it must stop every rank at one step with a backup."""
    ws = tmp_path / "ws"
    run = Run(ws, cache_dir, "spawn")  # data.num_workers=1: one loader worker per rank
    run.wait_for_step(2)
    loaders = [run.rank_and_its_loader(rank)[1] for rank in (0, 1)]
    os.killpg(run.proc.pid, signal.SIGTERM)
    code, took = run.finish()
    output = run.output()
    assert code == 0, f"exit code {code} {took:.0f} s after the SIGTERM (loader workers {loaders}):\n{output[-3000:]}"
    found = events(run)
    done = [e for e in found if e["type"] == "done"]
    backups = [e for e in found if e["type"] == "backup"]
    assert len(done) == 1 and not done[0]["completed"], f"no clean stop: done events {done}\n{output[-3000:]}"
    assert [e["step"] for e in backups] == [done[0]["step"]], f"backups {backups}, stopped at {done[0]['step']}"
    written = sorted(p.name for p in (ws / "backups").rglob("step-*"))
    assert written == [f"step-{done[0]['step']:08d}"], f"backup folders {written}"
    assert not [e for e in found if e["type"] == "error"], output[-3000:]
    assert "killed by signal" not in output, output[-3000:]


@pytest.mark.slow
def test_the_workers_of_a_killed_spawn_launcher_end_at_once_and_write_no_backup_after_it(tmp_path, cache_dir):
    """kill -9 of the spawn launcher: its workers trained on for 2.8-16.4 s (4 of 4) and wrote backups after it was
    gone, while the docs say they die with it. Every process it started - the forkserver, the ranks and their
    loader workers - must be gone at once, and no backup completed after the launcher died. A backup every step
    makes a worker that lives on write one."""
    from modules.trainer.backup import list_backups
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
    ended: dict[int, float] = {}
    limit_s = 60.0  # a hang detector: on an idle machine they end within milliseconds
    while len(ended) < len(watched) and time.time() - killed < limit_s:
        alive = set(_alive(list(watched)))
        ended.update({pid: time.time() for pid in watched if pid not in alive and pid not in ended})
        time.sleep(0.02)
    try:
        still = {f"{watched[pid]} (pid {pid})" for pid in watched if pid not in ended}
        assert not still, f"{', '.join(sorted(still))} still ran {limit_s:.0f} s after their launcher was killed"
        late = {f"{watched[pid]} (pid {pid})": round(at - killed, 2) for pid, at in ended.items() if at - killed > 5}
        assert not late, f"seconds each process lived on after its launcher was killed: {late}"
        after = [(b.step, round(b.written - launcher_gone, 2)) for b in list_backups(ws / "backups")
                 if b.written > launcher_gone]
        assert not after, f"backups (step, seconds after the launcher was gone) written by orphaned workers: {after}"
    finally:
        run.finish()


@pytest.mark.slow
def test_a_killed_rank_under_torchrun_gives_exactly_one_error_event_its_own(tmp_path, cache_dir):
    """SIGKILL of rank 1 under torchrun: the surviving rank's gloo error ("Connection closed by peer") was sent as an
    `error` event before the launcher's headline, 4 of 7 kills, and the GUI showed it first. The events hold one
    `error`: the headline naming rank 1."""
    run = Run(tmp_path / "ws", cache_dir, "torchrun")
    run.wait_for_step(3)
    rank_1, _ = run.rank_and_its_loader(1)
    os.kill(rank_1, signal.SIGKILL)
    code, took = run.finish()
    output = run.output()
    assert code == 1, f"exit code {code} {took:.0f} s after the kill:\n{output[-3000:]}"
    errors = [e for e in events(run) if e["type"] == "error"]
    assert len(errors) == 1, f"{len(errors)} error events: {errors}"
    assert errors[0].get("failed_rank") == 1 and errors[0]["text"].startswith("rank 1 died first (signal SIGKILL"), \
        errors[0]
    assert not [word for word in NOISE if word in output], output[-3000:]


def test_only_a_users_own_torchrun_has_its_workers_send_their_error_events():
    """Tandem's launchers send the one `error` event, their headline; a worker's own would come first and may be
    only a peer's complaint. Under a user's own torchrun the worker's error is all there is, unless it is about
    another rank."""
    from types import SimpleNamespace

    from modules.config.launch_spec import EXTERNAL, SPAWN
    from modules.distributed.worker import sends_error_event
    ours, theirs = (SimpleNamespace(spec=SimpleNamespace(launcher=name)) for name in ("torchrun", EXTERNAL))
    own, peer = ("OSError", "[Errno 28] No space left on device"), ("RuntimeError", "Connection closed by peer")
    assert not sends_error_event(ours, *own) and not sends_error_event(ours, *peer)
    assert not sends_error_event(SimpleNamespace(spec=SimpleNamespace(launcher=SPAWN)), *own)
    assert sends_error_event(theirs, *own) and not sends_error_event(theirs, *peer)

"""The workers' watchdog (modules/distributed/watchdog.py): its verdicts from beats, and what it does with them.
The launched cases (a killed loader worker, a frozen rank, a stuck loader) are in tests/integration/test_faults.py."""
from __future__ import annotations

import pytest
import torch

from modules.distributed import failures
from modules.distributed.watchdog import Beat, Judge, Watchdog, previous_round_position
from modules.util.heartbeat import Heartbeat


def beats(*rows) -> dict[int, Beat]:
    """(count, step, phase, long[, slowest]) per rank."""
    return {r: Beat(*row) for r, row in enumerate(rows)}


def test_a_rank_without_a_beat_for_the_stall_time_stopped_answering():
    judge = Judge(rank=0, world_size=2, stall_s=10, now=0.0)
    assert judge.look(1.0, beats((1, 7, "training step", False), (1, 7, "training step", False))) is None
    for t in range(2, 11):  # rank 0 beats on, rank 1 is frozen at its count 1
        assert judge.look(float(t), beats((t, 7, "training step", False), (1, 7, "training step", False))) is None
    verdict = judge.look(11.5, beats((12, 7, "training step", False), (1, 7, "training step", False)))
    assert (verdict.rank, verdict.step, verdict.phase) == (1, 7, "training step")
    assert verdict.text == "rank 1 stopped answering (no sign of life for 10 s)"


def test_a_finished_rank_and_a_rank_never_heard_from_are_not_judged():
    judge = Judge(rank=0, world_size=3, stall_s=5, now=0.0)
    judge.look(1.0, {0: Beat(1, 9, "ending", True), 1: Beat(1, 9, "finished", True), 2: None})
    for t in range(2, 30):
        assert judge.look(float(t), {0: Beat(t, 9, "ending", True), 1: Beat(1, 9, "finished", True), 2: None}) is None


def test_the_rank_behind_the_others_stopped_making_progress_unless_its_phase_is_a_long_one():
    judge = Judge(rank=0, world_size=3, stall_s=10, now=0.0)
    stuck = ((1, 8, "training step", False), (1, 8, "loading a batch", False), (1, 8, "training step", False))
    for t in range(1, 11):  # counts move (every process is alive), positions do not
        rows = [(t, *row[1:]) for row in stuck]
        assert judge.look(float(t), beats(*rows)) is None
    verdict = judge.look(11.5, beats(*[(12, *row[1:]) for row in stuck]))  # 10.5 s since they were first seen
    assert (verdict.rank, verdict.step, verdict.phase) == (1, 8, "loading a batch")
    assert verdict.text == "rank 1 stopped making progress (the others waited 10 s for it)", verdict.text
    # The same picture with rank 1 saving (a long phase): not judged; all at one place: a collective, not judged.
    for rows in ([(1, 8, "training step", False), (1, 8, "writing outputs", True), (1, 8, "training step", False)],
                 [(1, 8, "training step", False)] * 3):
        judge = Judge(rank=0, world_size=3, stall_s=10, now=0.0)
        for t in range(1, 60):
            assert judge.look(float(t), beats(*[(t, *row[1:]) for row in rows])) is None


def test_slow_steps_raise_the_time_a_stall_must_last():
    judge = Judge(rank=0, world_size=2, stall_s=10, now=0.0)
    rows = ((0, 3, "training step", False, 25.0), (0, 3, "loading a batch", False, 20.0))
    for t in range(1, 102):  # 4 x the slowest phase seen: 100 s from the first look
        assert judge.look(float(t), beats(*[(t, *row[1:]) for row in rows])) is None
    assert judge.look(101.5, beats(*[(102, *row[1:]) for row in rows])).rank == 1


def test_a_watchdog_that_did_not_run_for_a_while_judges_nothing_it_did_not_see():
    judge = Judge(rank=0, world_size=2, stall_s=10, now=0.0)
    judge.look(1.0, beats((1, 2, "training step", False), (1, 2, "training step", False)))
    # This process was stopped for a minute: rank 1 beat meanwhile, unseen.
    assert judge.look(61.0, beats((2, 2, "training step", False), (1, 2, "training step", False))) is None


def watchdogs(tmp_path, world: int, stall_s: float = 10):
    store = torch.distributed.HashStore()
    left: dict[int, list[int]] = {r: [] for r in range(world)}
    hearts = [Heartbeat() for _ in range(world)]
    dogs = [Watchdog(hearts[r], store, r, world, stall_s, tmp_path, leave=left[r].append) for r in range(world)]
    return store, hearts, dogs, left


def test_a_failure_reaches_every_rank_before_the_failing_ones_clean_up(tmp_path):
    """Rank 1's loader worker died: rank 1 notes it, the others end at their next look, naming rank 1."""
    store, hearts, dogs, left = watchdogs(tmp_path, 3)
    for heart in hearts:
        heart.at("training step", 12)
    for dog in dogs:
        dog.beat()
    hearts[1].failed(RuntimeError("DataLoader worker (pid 4242) is killed by signal: Killed."))
    for dog in (dogs[0], dogs[2]):
        dog.tick(100.0)
    assert left == {0: [failures.ENDED_BY_WATCHDOG], 1: [], 2: [failures.ENDED_BY_WATCHDOG]}
    errors = failures.read_errors(tmp_path)
    assert errors[1].kind == "RuntimeError" and errors[1].step == 12 and errors[1].phase == "training step"
    assert errors[0].blames == 1 and errors[2].blames == 1
    first = failures.first_failure([failures.WorkerExit(0, 3, errors[0].time)], errors)
    assert first.rank == 1 and first.text.startswith("rank 1 failed first: RuntimeError: DataLoader worker (pid 4242)")
    assert "lack of memory" in first.text and "data.num_workers" in first.text
    # Rank 1's clean-up hangs (a collective with NCCL work in flight): its watchdog ends it after the grace.
    dogs[1].tick(dogs[1].failing_since + 5)
    assert left[1] == []
    dogs[1].tick(dogs[1].failing_since + 10.5)
    assert left[1] == [1]


def test_a_secondary_failure_is_no_verdict(tmp_path):
    """A rank that lost its connection to a dead one says nothing about who failed: the launcher finds that out."""
    store, hearts, dogs, left = watchdogs(tmp_path, 2)
    for dog in dogs:
        dog.beat()
    hearts[0].failed(RuntimeError("[gloo/pair.cc:553] Connection closed by peer [127.0.0.1]:29588"))
    dogs[1].tick(1.0)
    assert left[1] == [] and failures.read_errors(tmp_path)[0].secondary


def test_a_verdict_is_shared_and_the_stuck_rank_notes_it_too(tmp_path):
    store, hearts, dogs, left = watchdogs(tmp_path, 2, stall_s=5)
    hearts[0].at("training step", 4)
    hearts[1].at("loading a batch", 4)
    now = 1000.0
    for dog in dogs:
        dog.judge = Judge(dog.rank, 2, 5, now)
    for t in range(8):
        for dog in dogs:
            dog.tick(now + t)
    assert left[0] == [failures.ENDED_BY_WATCHDOG] and left[1] == [failures.ENDED_BY_WATCHDOG]
    errors = failures.read_errors(tmp_path)
    assert errors[0].blames == errors[1].blames == 1 and errors[1].phase == "loading a batch"
    first = failures.first_failure([], errors)
    assert first.text == ("rank 1 stopped making progress (the others waited 6 s for it) at step 4 (loading a batch); "
                          "the other ranks ended because of it.")


def test_a_restarted_round_finds_where_the_round_before_it_was(monkeypatch, tmp_path):
    from modules.distributed.agent import ROUND_VARIABLE
    store = torch.distributed.HashStore()
    monkeypatch.setenv(ROUND_VARIABLE, "1")
    heart = Heartbeat()
    dog = Watchdog(heart, store, 0, 2, 10, tmp_path, leave=lambda code: None)
    store.append("tandem-watch/rounds", dog.prefix + ",")
    heart.at("training step", 24)
    dog.beat()
    other = Watchdog(Heartbeat(), store, 1, 2, 10, tmp_path, leave=lambda code: None)
    other.heartbeat.at("training step", 25)
    other.beat()
    monkeypatch.setenv(ROUND_VARIABLE, "2")
    assert previous_round_position(store, "tandem-watch/round-2/") == (25, "training step")
    assert previous_round_position(torch.distributed.HashStore(), "tandem-watch/round-2/") == (None, None)


@pytest.mark.parametrize("phase, long", [("loading a batch", False), ("writing outputs", True)])
def test_a_heartbeat_times_only_the_steady_phases(phase, long, monkeypatch):
    clock = iter([0.0, 5.0, 6.0, 60.0, 61.0])
    monkeypatch.setattr("time.monotonic", lambda: next(clock))
    heart = Heartbeat()  # 0.0
    heart.at("training step", 1)  # 5.0: start-up was long, not timed
    heart.at(phase, long=long)  # 6.0: the training step took 1 s
    heart.at("training step", 2)  # 60.0: 54 s in `phase`
    assert heart.slowest_phase_s == (1.0 if long else 54.0)


def test_a_rank_that_died_without_a_word_is_placed_where_its_watchdog_last_saw_it():
    """kill -9 leaves no note; the headline says where the rank was from the beats its watchdog published."""
    exits = [failures.WorkerExit(1, -9, 10.0), failures.WorkerExit(0, 1, 11.0)]
    first = failures.first_failure(exits, {}, {0: (24, "training step"), 1: (24, "loading a batch")})
    assert first.text == ("rank 1 died first (signal SIGKILL - killed from outside, or by the system for lack of "
                          "memory) at step 24 (loading a batch); the other ranks stopped because of it.")
    store = torch.distributed.HashStore()
    from modules.distributed.watchdog import last_round_positions
    heart = Heartbeat()
    dog = Watchdog(heart, store, 0, 1, 10, "/nonexistent", leave=lambda code: None)
    store.append("tandem-watch/rounds", dog.prefix + ",")
    heart.at("after the step", 7)
    dog.beat()
    assert last_round_positions(store) == {0: (7, "after the step")}


@pytest.fixture(scope="module")
def cache_dir(tandem_home, tmp_path_factory):
    return tmp_path_factory.mktemp("latent_cache")


@pytest.mark.slow  # trains three epochs
def test_each_epochs_loader_start_is_told_as_loading_the_next_batch(tmp_path, cache_dir, monkeypatch):
    """A later epoch's `iter(loader)` waits for every persistent worker: a stuck one must be named while
    loading a batch, not at the previous epoch's last step ("after the step")."""
    from torch.utils.data import DataLoader
    from tests.trainer_helpers import demo_config, train
    said: list[tuple[int, str]] = []
    at, iterate = Heartbeat.at, DataLoader.__iter__

    def remember_at(self, phase, step=None, long=False):
        at(self, phase, step, long)
        said.append((self.step, self.phase))

    def remember_iter(self):
        said.append(("iter", said[-1] if said else (0, "nothing said yet")))
        return iterate(self)

    monkeypatch.setattr(Heartbeat, "at", remember_at)
    monkeypatch.setattr(DataLoader, "__iter__", remember_iter)
    trainer = train(demo_config(tmp_path / "ws", cache_dir, "training.epochs=3", "training.max_steps=0"))
    starts = [before for tag, before in said if tag == "iter"]
    assert trainer.epoch == 2 and len(starts) >= 3, said  # the last epoch (0-based) ends the run
    for epoch, (step, phase) in enumerate(starts[-3:]):
        assert phase == "loading a batch", (epoch, said)

"""Each worker's watchdog: a thread that ends the job within seconds when a rank fails, freezes or stalls.

A rank that fails can hang on its way out (its clean-up waits in a collective or in the process group's
end while NCCL work is in flight) and the ranks waiting for it sit in a collective until
`multi_gpu.timeout_minutes` runs out - 10 minutes of idle GPUs, after which NCCL aborts the waiting rank
and the headline names it instead. So every worker runs this thread, which talks through the rendezvous
store (a TCP connection of its own, independent of NCCL and gloo) once a second:

- it publishes this rank's `Heartbeat` (step, phase, whether the phase is a long one) with a counter that
  moves with every beat, whatever the training loop is doing;
- a rank that fails publishes why (`failed`), before its clean-up; the other ranks' watchdogs note that
  they end because of it and leave the process (`ENDED_BY_WATCHDOG`); the failing rank itself is left
  `FAILURE_GRACE_S` to finish its clean-up, then ended too;
- `Judge` names a rank whose counter stopped for `multi_gpu.stall_seconds` (the process is frozen, or its
  machine gone: "stopped answering"), and a rank that is behind the others while no rank's position has
  moved for that long - or for 4 x the slowest step so far, if longer - unless it is in a phase that
  announces itself as long (start-up, the first step, compiling, sampling, backups, saving, validation):
  "stopped making progress". The first verdict is shared through the store, so every rank names the same.

Every rank that ends this way notes whom it blames and where that rank was (`failures.record_blame`), so
the launcher's headline and a restarted round name the right rank, step and phase. When the store itself
stops answering for `stall_seconds`, the launcher that serves it is gone, and the worker ends too; a worker
whose parent (the spawn launcher, or its forkserver) has ended leaves at the next beat.
`timeout_minutes` still bounds a collective that every rank waits in (a slow network).
"""
from __future__ import annotations

import datetime
import json
import logging
import os
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from modules.distributed import failures
from modules.distributed.failures import ENDED_BY_WATCHDOG
from modules.util.exit import parent_gone
from modules.util.heartbeat import FINISHED, PHASE_ORDER, Heartbeat

log = logging.getLogger("tandem")

BEAT_S = 1.0
"""How often each watchdog publishes and looks."""
FAILURE_GRACE_S = 10.0
"""How long a failing rank's clean-up may take before its watchdog ends the process."""
STEP_MARGIN = 4.0
"""A stall counts only once it lasts this many times the slowest steady phase any rank has seen."""
PREFIX = "tandem-watch/"
ROUNDS_KEY = PREFIX + "rounds"
"""Every round's key prefix, appended by its rank 0: a restarted round finds the one before it."""


@dataclass(frozen=True)
class Beat:
    """What one rank publishes each second."""

    count: int
    step: int
    phase: str
    long: bool
    slowest_s: float = 0.0

    @property
    def position(self) -> tuple[int, int]:
        return self.step, PHASE_ORDER.get(self.phase, len(PHASE_ORDER) + 1)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: bytes | str) -> Beat:
        return cls(**json.loads(text))


@dataclass(frozen=True)
class Verdict:
    """Rank `rank` is the cause: `text` says what happened (a headline adds where it was)."""

    rank: int
    text: str
    step: int | None = None
    phase: str | None = None
    failed: bool = False
    """The rank raised an error itself (its own note tells it; the others only point to it)."""

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: bytes | str) -> Verdict:
        return cls(**json.loads(text))


class Judge:
    """Decides from the ranks' beats, as one watchdog sees them over time, whether a rank is the cause of a stall."""

    def __init__(self, rank: int, world_size: int, stall_s: float, now: float) -> None:
        self.rank, self.world_size, self.stall_s = rank, world_size, stall_s
        self.beats: dict[int, Beat] = {}
        self.last_seen = {r: now for r in range(world_size)}
        self.last_move = now
        self.last_look = now

    def look(self, now: float, beats: dict[int, Beat | None]) -> Verdict | None:
        """The verdict after seeing `beats` (None for a rank not heard from yet) at time `now`, if there is one."""
        if now - self.last_look > 5 * BEAT_S:
            # This watchdog itself did not run for a while (its process stopped, or starved of CPU): what it
            # did not see, it cannot judge.
            self.last_seen = {r: now for r in range(self.world_size)}
            self.last_move = now
        self.last_look = now
        for r, beat in beats.items():
            if beat is None:
                continue
            before = self.beats.get(r)
            if before is None or before.count != beat.count:
                self.last_seen[r] = now
            if before is None or (before.step, before.phase) != (beat.step, beat.phase):
                self.last_move = now
            self.beats[r] = beat
        return self._silent(now) or self._stalled(now)

    def _silent(self, now: float) -> Verdict | None:
        for r, beat in self.beats.items():  # a rank never heard from may have no watchdog: not judged
            if r == self.rank or beat.phase == FINISHED:
                continue
            if now - self.last_seen[r] > self.stall_s:
                return Verdict(r, f"rank {r} stopped answering (no sign of life for {self.stall_s:g} s)",
                               beat.step or None, beat.phase)
        return None

    def _stalled(self, now: float) -> Verdict | None:
        if len(self.beats) < self.world_size or any(b.long for b in self.beats.values()):
            return None  # a rank in a long phase (or finished) may be the one the others wait for: not judged
        waited = now - self.last_move
        limit = max(self.stall_s, STEP_MARGIN * max(b.slowest_s for b in self.beats.values()))
        if waited <= limit:
            return None
        positions = {r: b.position for r, b in self.beats.items()}
        behind = min(positions.values())
        if behind == max(positions.values()):
            return None  # every rank at the same place: a collective they all wait in (timeout_minutes)
        laggards = sorted(r for r, p in positions.items() if p == behind)
        first = laggards[0]
        who = f"rank {first}" if len(laggards) == 1 else f"ranks {', '.join(map(str, laggards))}"
        beat = self.beats[first]
        return Verdict(first, f"{who} stopped making progress (the others waited {waited:.0f} s for it)",
                       beat.step or None, beat.phase)


def round_key() -> str:
    """The key prefix of this round of workers: restarted rounds (torchrun's agent) get their own."""
    from modules.distributed.agent import ROUND_VARIABLE
    round_ = os.environ.get(ROUND_VARIABLE)
    if round_ is None:
        round_ = f"attempt-{failures.current_attempt()}"
    return f"{PREFIX}round-{round_}/"


def store_address(served: str | None) -> tuple[str, int] | None:
    """Where this worker's rendezvous store listens: its launcher's (`served`), else torchrun's (MASTER_ADDR/PORT)."""
    from modules.distributed.rendezvous import split_endpoint
    if served:
        return split_endpoint(served)
    if os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT"):
        return os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    return None


def connect(served: str | None, timeout_s: float):
    """A store client of its own (a blocking call of the training loop's client must not hold the beats up)."""
    import torch.distributed as dist
    address = store_address(served)
    if address is None:
        return None
    return dist.TCPStore(address[0], address[1], None, False, datetime.timedelta(seconds=timeout_s))


class Watchdog:
    """The thread described in the module docstring, for one rank."""

    def __init__(self, heartbeat: Heartbeat, store, rank: int, world_size: int, stall_s: float,
                 failures_folder: Path, leave: Callable[[int], None] = os._exit) -> None:
        self.heartbeat, self.store = heartbeat, store
        self.rank, self.world_size, self.stall_s = rank, world_size, stall_s
        self.folder = Path(failures_folder)
        self.leave = leave
        self.prefix = round_key()
        self.judge = Judge(rank, world_size, stall_s, time.monotonic())
        self.count = 0
        self.failing_since: float | None = None
        self.store_lost_since: float | None = None
        self.stopped = threading.Event()
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, name="tandem-watchdog", daemon=True)
        heartbeat.on_failure = self.failed
        heartbeat.on_finish = self.beat_now

    @classmethod
    def start(cls, heartbeat: Heartbeat, rank: int, world_size: int, stall_s: float, failures_folder: Path,
              served: str | None = None):
        """The watchdog of this worker, running; None where no store is reachable (then nothing watches).
        `served`: `host:port` of the store Tandem's launcher serves (None: MASTER_ADDR/MASTER_PORT)."""
        try:
            store = connect(served, timeout_s=min(10.0, stall_s))
        except Exception as error:  # noqa: BLE001 - the run goes on without it, as before it existed
            log.warning("The watchdog could not reach the rendezvous store (%s): a stuck rank is found only "
                        "after multi_gpu.timeout_minutes.", error)
            return None
        if store is None:
            return None
        watchdog = cls(heartbeat, store, rank, world_size, stall_s, failures_folder)
        if rank == 0:
            store.append(ROUNDS_KEY, watchdog.prefix + ",")
        watchdog.beat()
        watchdog.thread.start()
        return watchdog

    def stop(self) -> None:
        self.stopped.set()

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        while not self.stopped.wait(BEAT_S):
            try:
                self.tick(time.monotonic())
            except Exception as error:  # noqa: BLE001 - a store that stopped answering; judged in tick
                self._store_trouble(error)

    def tick(self, now: float) -> None:
        """One look: beat, then end this process if a rank is the cause of a stall or a failure."""
        if self.stopped.is_set():
            return
        if parent_gone():
            # The launcher was killed (Linux's parent-death signal ends this process before it sees this; macOS
            # has none): a worker must not train on, nor write a backup, where a new run may start.
            failures.record_blame(self.folder, self.rank, self.rank, "the process that started this worker ended: "
                                  "the launcher ended", self.heartbeat.step, self.heartbeat.phase, kind="LauncherGone")
            self._leave(ENDED_BY_WATCHDOG)
            return
        if self.failing_since is not None:
            if now - self.failing_since > FAILURE_GRACE_S:
                self._leave(1)  # this rank failed and its clean-up hangs (a collective, the process group)
            self.beat()
            return
        self.beat()
        verdict = self._shared_verdict()
        if verdict is None:
            verdict = self.judge.look(now, self._beats())
            if verdict is not None:
                verdict = self._share(verdict)
        if verdict is not None:
            self._end_because_of(verdict)
        self.store_lost_since = None

    def beat_now(self) -> None:
        """Publish at once (the rank finished and may leave before the next beat); never raises."""
        try:
            self.beat()
        except Exception:  # noqa: BLE001 - the others then learn it from the launcher
            pass

    def beat(self) -> None:
        h = self.heartbeat
        with self.lock:
            self.count += 1
            beat = Beat(self.count, h.step, h.phase, h.long, round(h.slowest_phase_s, 3))
            self.store.set(f"{self.prefix}beat/{self.rank}", beat.to_json())

    def _beats(self) -> dict[int, Beat | None]:
        keys = [f"{self.prefix}beat/{r}" for r in range(self.world_size)]
        if self.store.check(keys):
            return {r: Beat.from_json(v) for r, v in enumerate(self.store.multi_get(keys))}
        return {r: Beat.from_json(self.store.get(k)) if self.store.check([k]) else None for r, k in enumerate(keys)}

    def _shared_verdict(self) -> Verdict | None:
        key = self.prefix + "verdict"
        return Verdict.from_json(self.store.get(key)) if self.store.check([key]) else None

    def _share(self, verdict: Verdict) -> Verdict:
        """The verdict every rank goes by: the first one written to the store."""
        return Verdict.from_json(self.store.compare_set(self.prefix + "verdict", "", verdict.to_json()))

    def _store_trouble(self, error: Exception) -> None:
        now = time.monotonic()
        if self.store_lost_since is None:
            self.store_lost_since = now
        elif now - self.store_lost_since > self.stall_s and self.failing_since is None:
            # The store lives in the launcher (or torchrun's agent): it is gone, and nothing will end this worker.
            failures.record_blame(self.folder, self.rank, self.rank, "the launcher's rendezvous store stopped "
                                  f"answering ({type(error).__name__}): the launcher ended", self.heartbeat.step,
                                  self.heartbeat.phase, kind="LauncherGone")
            self._leave(ENDED_BY_WATCHDOG)

    # ------------------------------------------------------------------ ending
    def failed(self, error: BaseException) -> None:
        """This rank's run ends with `error` (called by the loop before its clean-up)."""
        h = self.heartbeat
        if not failures.recorded(self.folder, self.rank):
            failures.record_error(self.folder, self.rank, error, step=h.step or None, phase=h.phase)
        self.failing_since = time.monotonic()
        kind, text = type(error).__name__, " ".join(str(error).split())[:300]
        if failures.is_secondary(kind, text):
            return  # about another rank: that one's own failure, or a watchdog, names the cause
        try:
            self._share(Verdict(self.rank, f"rank {self.rank} failed ({kind}: {text})", h.step or None, h.phase,
                                failed=True))
        except Exception:  # noqa: BLE001 - the launcher still names it from the note above
            pass

    def _end_because_of(self, verdict: Verdict) -> None:
        if verdict.rank != self.rank or not verdict.failed:
            if not failures.recorded(self.folder, self.rank):
                failures.record_blame(self.folder, self.rank, verdict.rank, verdict.text, verdict.step, verdict.phase)
            speaker = 0 if verdict.rank != 0 else 1
            if self.rank == speaker and not verdict.failed:  # a rank that failed says so itself
                where = f" at step {verdict.step}" if verdict.step else ""
                log.error("%s%s%s: ending every rank.", verdict.text, where,
                          f" ({verdict.phase})" if verdict.phase else "")
        self._leave(ENDED_BY_WATCHDOG)

    def _leave(self, code: int) -> None:
        self.stopped.set()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - leaving anyway
                pass
        self.leave(code)


def round_beats(store, prefix: str) -> dict[int, Beat]:
    """The last beat each rank of the round under `prefix` published."""
    found = {}
    for r in range(4096):
        key = f"{prefix}beat/{r}"
        try:
            if not store.check([key]):
                break
            found[r] = Beat.from_json(store.get(key))
        except Exception:  # noqa: BLE001 - a store that went away: what was read so far
            break
    return found


def last_round_positions(store) -> dict[int, tuple[int, str]]:
    """(step, phase) of each rank of the last round whose watchdogs ran, as they last published it: where a
    rank that died without a word was (the launcher's headline says it)."""
    try:
        if not store.check([ROUNDS_KEY]):
            return {}
        rounds = [r for r in store.get(ROUNDS_KEY).decode().split(",") if r]
    except Exception:  # noqa: BLE001 - not known
        return {}
    return {r: (b.step, b.phase) for r, b in round_beats(store, rounds[-1]).items()} if rounds else {}


def previous_round_position(store, prefix: str) -> tuple[int | None, str | None]:
    """(the furthest step, that rank's phase) the round before `prefix` reached, as its watchdogs published it:
    what a restarted round says its predecessor had reached when no rank could note its error."""
    try:
        if not store.check([ROUNDS_KEY]):
            return None, None
        rounds = [r for r in store.get(ROUNDS_KEY).decode().split(",") if r]
    except Exception:  # noqa: BLE001 - no store to ask: not known
        return None, None
    earlier = [r for r in rounds if r != prefix]
    if not earlier:
        return None, None
    best: Beat | None = None
    for beat in round_beats(store, earlier[-1]).values():
        if beat.phase != FINISHED and (best is None or beat.step > best.step):
            best = beat
    return (best.step or None, best.phase) if best else (None, None)

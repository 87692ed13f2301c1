"""Runs on a remote machine as the desktop sees them: start, list, follow, commands, stop.

A run's whole output - log lines and `@tandem` events - is a file on the remote (`runs/<id>/output.log`).
Following a run streams that file through ssh from a byte offset: from 0 on (re)attaching, so that the GUI
rebuilds the whole loss curve, and from where the stream broke after a dropped connection, so that no line
is seen twice. The run itself never depends on a follower: it was started detached (`remote_side.start`).
"""
from __future__ import annotations

import json
import secrets
import subprocess
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from .host import slug
from .machine import RemoteMachine
from .remote_side import END_MARKER
from .ssh import SshError, last_lines

RECONNECT_DELAYS_S = (1, 2, 5, 10, 20, 30)
"""Waits between attempts to follow a run again after its connection dropped (the last one repeats)."""
HELD_S = 120
"""A connection up this long counts as one that held, data or not (a quiet run prints nothing for minutes).
Longer than ssh takes to notice a dead link (ServerAlive: 4 x 15 s), so a connection that froze and died
silently does not count."""


class Backoff:
    """The wait before each reconnect: growing along RECONNECT_DELAYS_S while attempts fail, back to the first
    once a connection held - it delivered a line, or stayed up HELD_S - so that a short outage after a long
    one is retried in a second, not in 30 s. `clock` is a parameter for the tests."""

    def __init__(self, delays: tuple[float, ...] = RECONNECT_DELAYS_S, held_s: float = HELD_S,
                 clock: Callable[[], float] = time.monotonic):
        self.delays, self.held_s, self.clock = delays, held_s, clock
        self.failures = 0
        self._since: float | None = None
        self._delivered = False

    def connecting(self) -> None:
        """A new attempt starts now."""
        self._since, self._delivered = self.clock(), False

    def delivered(self) -> None:
        """The current connection brought data."""
        self._delivered = True

    def next_delay(self) -> float:
        """The current connection ended: how long to wait before the next attempt."""
        held = self._delivered or (self._since is not None and self.clock() - self._since >= self.held_s)
        if held:
            self.failures = 0
        delay = self.delays[min(self.failures, len(self.delays) - 1)]
        self.failures += 1
        self._since, self._delivered = None, False
        return delay


@dataclass(frozen=True)
class RunInfo:
    """A run's registry entry on the remote and its state there: `starting`, `running`, `ended`, `lost`."""
    id: str
    state: str
    exit_code: int | None = None
    workspace: str = ""
    """Relative to the remote folder."""
    local_workspace: str = ""
    """The desktop workspace it was started from."""
    config_name: str = ""
    node_rank: int = 0
    nnodes: int = 1
    hosts: tuple[str, ...] = ()
    source: str = ""
    created: float = 0.0
    resume: str | None = None
    log_bytes: int = 0
    extra: dict = field(default_factory=dict, compare=False)

    @classmethod
    def from_json(cls, data: dict) -> RunInfo:
        return cls(id=data["id"], state=data.get("state", "?"), exit_code=data.get("exit_code"),
                   workspace=data.get("workspace", ""), local_workspace=data.get("local_workspace", ""),
                   config_name=data.get("config_name", ""), node_rank=int(data.get("node_rank", 0)),
                   nnodes=int(data.get("nnodes", 1)), hosts=tuple(data.get("hosts", ())),
                   source=data.get("source", ""), created=float(data.get("created", 0.0)),
                   resume=data.get("resume"), log_bytes=int(data.get("log_bytes", 0)), extra=data)

    @property
    def active(self) -> bool:
        return self.state in ("starting", "running")

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(self.created)) if self.created else "?"
        state = self.state if self.state != "ended" else f"ended, exit code {self.exit_code}"
        nodes = f", node {self.node_rank} of {self.nnodes}" if self.nnodes > 1 else ""
        return f"{self.id} ({self.config_name or '?'}, {state}{nodes}, started {when})"


def new_run_id(name: str) -> str:
    """Sorts by start time; the random tail keeps two desktops starting the same second apart."""
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{slug(name.lstrip('#'), 24)}-{secrets.token_hex(2)}"


def node_run_id(run_id: str, node_rank: int) -> str:
    """The run's folder on machine `node_rank`: the id on node 0, `<id>-node<k>` on the others (distinct, so
    machines sharing one remote folder on shared storage do not collide)."""
    return run_id if node_rank == 0 else f"{run_id}-node{node_rank}"


def start_run(machine: RemoteMachine, spec: dict) -> RunInfo:
    """Create the run there and start it detached; `spec`: id, workspace, command (after the Python), config,
    env, and what the registry shows (config_name, local_workspace, hosts, node_rank, nnodes, source, resume)."""
    return RunInfo.from_json(machine.side("start", input=spec, timeout=120))


def list_runs(machine: RemoteMachine) -> list[RunInfo]:
    """The runs there; none where Tandem was never installed."""
    try:
        return [RunInfo.from_json(entry) for entry in machine.side("runs")]
    except SshError as e:
        if e.kind == "not_installed":
            return []
        raise


def run_status(machine: RemoteMachine, run_id: str) -> RunInfo:
    return RunInfo.from_json(machine.side("status", run_id))


def send_command(machine: RemoteMachine, run_id: str, word: str) -> None:
    machine.side("command", run_id, word)


def kill_run(machine: RemoteMachine, run_id: str) -> RunInfo:
    return RunInfo.from_json(machine.side("kill", run_id, timeout=60))


def newest_backup(machine: RemoteMachine, workspace: str) -> dict | None:
    """The newest complete backup in the remote workspace ({step, run_id, written, path}) or None."""
    try:
        return machine.side("backup", workspace)
    except SshError as e:
        if e.kind == "not_installed":
            return None
        raise


def remote_backups(machine: RemoteMachine, workspace: str) -> list[dict]:
    """Every complete backup in the remote workspace, newest first ({step, run_id, written, path,
    finished_step}; `path` relative to the remote folder, where a run's `--resume` reads it)."""
    try:
        return machine.side("backups", workspace) or []
    except SshError as e:
        if e.kind == "not_installed":
            return []
        raise


def pick_run(runs: list[RunInfo], wanted: str | None = None, workspace: str | None = None,
             unique: bool = False) -> RunInfo | None:
    """The run a command means: `wanted` (an id, or its unique start), else the newest active run (of
    `workspace` when given), else the newest run. `unique`: with several runs going and none named, raise
    ValueError naming them rather than choose (for Stop)."""
    if wanted:
        found = [r for r in runs if r.id == wanted] or [r for r in runs if r.id.startswith(wanted)]
        return found[0] if len(found) == 1 else None
    mine = [r for r in runs if workspace is None or r.workspace == workspace]
    active = [r for r in mine if r.active]
    if unique and len(active) > 1:
        raise ValueError(f"{len(active)} runs are going ({', '.join(r.id for r in active)}): name the one you mean")
    pool = active or mine
    return max(pool, key=lambda r: (r.created, r.id)) if pool else None


@dataclass(frozen=True)
class RunEnd:
    exit_code: int | None
    """None when the run's supervisor vanished without one (the machine rebooted, or it was killed)."""
    state: str


class Follower:
    """Streams one run's output lines to `on_line`, reconnecting when the connection drops, until the run
    ends (returns its `RunEnd`) or `close()` is called (returns None)."""

    def __init__(self, machine: RemoteMachine, run_id: str, offset: int = 0):
        self.machine, self.run_id, self.offset = machine, run_id, offset
        self._closed = threading.Event()
        self._process: subprocess.Popen | None = None

    def close(self) -> None:
        self._closed.set()
        process = self._process
        if process is not None and process.poll() is None:
            process.terminate()

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def follow(self, on_line: Callable[[str], None], on_notice: Callable[[str], None] = lambda text: None) -> RunEnd | None:
        backoff = Backoff()

        def deliver(line: str) -> None:
            backoff.delivered()
            on_line(line)
        while not self.closed:
            backoff.connecting()
            try:
                end = self._stream(deliver)
            except SshError as e:
                if e.kind in ("host_key_changed", "host_key_unknown", "auth", "missing"):
                    raise
                reason = str(e)
            else:
                if end is not None:
                    return end
                reason = "the connection ended"
            if self.closed:
                return None
            delay = backoff.next_delay()
            on_notice(f"lost the connection to {self.machine.label} ({reason}); the run goes on there. "
                      f"Reconnecting in {delay} s.")
            if self._closed.wait(delay):
                return None
        return None

    def _stream(self, on_line: Callable[[str], None]) -> RunEnd | None:
        process = self.machine.side_stream("follow", self.run_id, "--offset", str(self.offset))
        self._process = process
        assert process.stdout is not None
        end = None
        try:
            for raw in process.stdout:
                if raw.startswith(END_MARKER.encode()):
                    data = json.loads(raw[len(END_MARKER):])
                    end = RunEnd(data.get("exit_code"), data.get("state", "ended"))
                    break
                self.offset += len(raw)
                on_line(raw.decode("utf-8", errors="replace"))
        finally:
            if process.poll() is None and end is not None:
                process.wait(30)
            stderr = process.stderr.read().decode("utf-8", errors="replace") if process.stderr else ""
            code = process.wait()
            self._process = None
        if end is not None:
            return end
        if code == 255:
            raise self.machine.ssh.error(stderr)
        if code not in (0, None) and not self.closed:
            if code == 2 or code == 3:  # remote_side refused (no such run, Tandem not installed): no retry helps
                raise SshError("failed", f"{self.machine.label}: {last_lines(stderr)}")
            raise SshError("unreachable", last_lines(stderr) or f"exit code {code}")
        return None

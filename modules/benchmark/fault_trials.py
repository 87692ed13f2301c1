"""Fault trials: kill a training the way machines and people do, then check that nothing was lost.

Each trial launches the real launcher (torchrun and spawn alternately) on N processes - CPU processes over
gloo on the built-in demo, or GPUs over NCCL with `--device cuda` and a base model of your choice - waits for
its first backup and a random moment after it, and does one of these (`--kind`, repeatable):

- `rank`: SIGKILL one worker rank;
- `loader`: SIGKILL one DataLoader worker of a random rank (what the kernel's OOM killer does);
- `stuck`: SIGSTOP one rank (a frozen process: its watchdog peers must name it after
  `multi_gpu.stall_seconds`);
- `agent`: SIGKILL torchrun's agent (torchrun only);
- `launcher`: SIGKILL the launcher itself (its workers must end with it);
- `backup`: SIGKILL the whole job (every process at once: a power cut, `kill -9` of the group) while a
  backup is being written.

The job must end by itself (no hang) - or, with `--max-restarts` under torchrun, restart - leave no
process behind, name the rank the killed process belonged to, and every backup it wrote must load; then
a run with `--resume` must continue from the newest backup and train on. A summary counts hangs, orphans,
wrong names, corrupt or lost backups; all must be 0. `--table` prints, last, one row per trial: kind,
launcher, seconds from the fault to the end (or restart), the rank named, whether the backup resumed.

    python scripts/fault_trials.py --trials 10 --kind rank --kind backup
    python scripts/fault_trials.py --trials 1 --kind loader --kind agent --kind stuck --kind launcher --table
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from modules.util.exit import pid_exists
from modules.util.run_protocol import parse_event_line

REPO = Path(__file__).resolve().parents[2]
KINDS = ("rank", "loader", "stuck", "agent", "launcher", "backup")
WHOLE_JOB = ("agent", "launcher", "backup")
"""Kinds whose fault belongs to no one rank."""


@dataclass
class Outcome:
    kind: str
    launcher: str
    killed_at_s: float = 0.0
    exit_code: int | None = None
    hung: bool = False
    orphans: list[int] = field(default_factory=list)
    backups: list[int] = field(default_factory=list)
    """Steps of the complete backups found after the kill."""
    corrupt: list[str] = field(default_factory=list)
    lost: bool = False
    """The kill came after a complete backup existed, yet none was found."""
    resumed: bool = False
    note: str = ""
    seconds_to_end: float | None = None
    """From the fault to the job's end (its launcher's exit; `launcher`: its last worker's) or, restarted, to the
    end of the failed round (torchrun's agent saw the failure and ended its workers)."""
    seconds_to_restart_line: float | None = None
    """Restarted: from the fault to the new round's restart line (its workers' start-up included)."""
    expected_rank: int | None = None
    """The rank the killed or stopped process belonged to (None for the agent, the launcher, the whole job)."""
    named: str = ""
    """Whom the job's last line (or its restart line) named: "rank 1", "agent", or empty."""
    headline: str = ""
    """That line itself (what a wrong or empty `named` was read from)."""
    restarted: bool = False

    @property
    def named_right(self) -> bool:
        if self.kind in ("launcher", "backup"):
            return True  # nobody is left to say it
        if self.kind == "agent":
            return self.named == "agent"
        return self.named == f"rank {self.expected_rank}"

    @property
    def ok(self) -> bool:
        return not self.hung and not self.orphans and not self.corrupt and not self.lost and self.named_right and \
            (self.resumed or not self.backups)


def _children() -> dict[int, list[int]]:
    rows = subprocess.run(["ps", "-eo", "pid,ppid"], capture_output=True, text=True).stdout.splitlines()[1:]
    children: dict[int, list[int]] = {}
    for row in rows:
        child, parent = (int(x) for x in row.split())
        children.setdefault(parent, []).append(child)
    return children


def _descendants(pid: int) -> list[int]:
    children = _children()
    found, stack = [], [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _agent(launcher: int) -> int | None:
    return next((p for p in _children().get(launcher, []) if _is_torchrun(p)), None)


def _ranks(launcher: int) -> list[int]:
    """The training ranks under `launcher`, in rank order: the children of torchrun's agent, or under spawn of
    the launcher's forkserver (Linux) or the launcher itself - not multiprocessing's resource tracker, not the
    ranks' own DataLoader workers."""
    children = _children()
    starters = [p for p in children.get(launcher, []) if _is_torchrun(p) or _is_forkserver(p)]
    return sorted(c for parent in [launcher, *starters] for c in children.get(parent, [])
                  if c not in starters and b"resource_tracker" not in _cmdline(c) and _cmdline(c))


def _is_forkserver(pid: int) -> bool:
    """The spawn launcher's forkserver (its workers are forked from it and show the same command line)."""
    return b"multiprocessing.forkserver" in _cmdline(pid)


def _is_torchrun(pid: int) -> bool:
    """torchrun's agent: Tandem's launcher runs it through modules.distributed.agent (a thin wrapper)."""
    return any(name in _cmdline(pid) for name in (b"torch.distributed.run", b"modules.distributed.agent"))


def _alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        if not pid_exists(pid):
            continue
        stat = Path(f"/proc/{pid}/stat")
        if stat.exists() and stat.read_text().split(") ")[-1].startswith("Z"):
            continue  # a zombie is dead (its parent will reap it)
        alive.append(pid)
    return alive


@dataclass
class Setup:
    """What every trial's job trains: N processes of `device`, the base model, and extra overrides."""
    world: int = 2
    device: str = "cpu"
    extra: tuple[str, ...] = ()
    max_restarts: int = 0
    timeout: float = 240.0


def _command(workspace: Path, cache: Path, launcher: str, setup: Setup, extra: list[str]) -> list[str]:
    values = [f"general.workspace_dir={workspace}", f"general.cache_dir={cache}", "general.tensorboard=false",
              "sampling.every_n_epochs=0", "save.backup_every_n_epochs=0", "save.backup_every_n_steps=3",
              "data.num_workers=1", "training.max_steps=100000", "multi_gpu.timeout_minutes=2", *setup.extra, *extra]
    command = [sys.executable, str(REPO / "scripts" / "train_multi_gpu.py"), "--config-path", "#demo", "--device",
               setup.device, "--num-gpus", str(setup.world), "--launcher", launcher]
    if setup.max_restarts and launcher == "torchrun":
        command += ["--max-restarts", str(setup.max_restarts)]
    for value in values:
        command += ["--config-value", value]
    return command


class Job:
    """A launched training whose output is read on a thread: a stopped process that keeps the pipe open
    must not keep the trial from seeing the launcher end."""

    def __init__(self, command: list[str]):
        self.proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True, env=dict(os.environ, TANDEM_EVENTS="1", PYTHONUNBUFFERED="1"))
        self.lines: list[str] = []
        self.events: list[tuple[float, dict]] = []
        self.changed = threading.Condition()
        self.family: set[int] = set()
        self.read_to_the_end = False
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            event = parse_event_line(line)
            with self.changed:
                self.lines.append(line)
                if event:
                    self.events.append((time.monotonic(), event))
                self.changed.notify_all()
        with self.changed:
            self.read_to_the_end = True
            self.changed.notify_all()

    def wait_until_read(self, timeout: float) -> None:
        """After the launcher ended: until its last lines are read (the reading thread lags behind on a busy
        machine: a headline not yet read named nobody), or `timeout` - a process of the job that outlived the
        launcher keeps the pipe open, and is an orphan the trial reports."""
        deadline = time.monotonic() + timeout
        with self.changed:
            while not self.read_to_the_end and time.monotonic() < deadline:
                self.changed.wait(max(0.0, deadline - time.monotonic()))

    def wait_for(self, predicate, timeout: float) -> dict | None:
        """The first event (after those seen so far, if `predicate` says so) that matches; None when the job ended."""
        deadline = time.monotonic() + timeout
        with self.changed:
            while True:
                found = next((e for _, e in self.events if predicate(e)), None)
                if found is not None or self.proc.poll() is not None or time.monotonic() >= deadline:
                    return found
                self.changed.wait(min(1.0, max(0.0, deadline - time.monotonic())))
                self.family.update(_descendants(self.proc.pid))

    def output(self) -> str:
        return "".join(self.lines)

    def end(self) -> None:
        """Whatever is left of the job, killed (the trial's own doing: stopped processes included)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for pid in _alive(sorted(self.family)):
            os.kill(pid, signal.SIGKILL)


def _inflict(kind: str, job: Job, rng: random.Random, outcome: Outcome) -> bool:
    """Do `kind` to the running job; False when there was nothing to do it to."""
    ranks = _ranks(job.proc.pid)
    job.family.update(_descendants(job.proc.pid))
    if kind in ("rank", "stuck", "loader"):
        if not ranks:
            return False
        outcome.expected_rank = rng.randrange(len(ranks))
        victim = ranks[outcome.expected_rank]
        if kind == "loader":
            loaders = _descendants(victim)
            if not loaders:
                return False
            victim = rng.choice(loaders)
        os.kill(victim, signal.SIGSTOP if kind == "stuck" else signal.SIGKILL)
    elif kind == "agent":
        agent = _agent(job.proc.pid)
        if agent is None:
            return False
        os.kill(agent, signal.SIGKILL)
    elif kind == "launcher":
        os.kill(job.proc.pid, signal.SIGKILL)
    return True


def _named(text: str) -> str:
    if text.startswith("torchrun's agent"):
        return "agent"
    found = re.search(r"\branks? (\d+)", text)
    return f"rank {found.group(1)}" if found else ""


def _watch_the_end(kind: str, job: Job, outcome: Outcome, ranks: list[int], faulted: float, timeout: float,
                   workspace: Path) -> None:
    """How long the job took to end (or restart) after the fault, and whom it named."""
    faulted_wall = time.time() - (time.monotonic() - faulted)
    if kind == "launcher":
        deadline = faulted + timeout
        while _alive(ranks) and time.monotonic() < deadline:
            time.sleep(0.1)
        outcome.hung = bool(_alive(ranks))
        outcome.seconds_to_end = round(time.monotonic() - faulted, 1)
        return
    restarted = job.wait_for(lambda e: e["type"] == "restart", timeout)
    if restarted is not None:
        when = next(t for t, e in job.events if e is restarted)
        outcome.restarted, outcome.seconds_to_restart_line = True, round(when - faulted, 1)
        ended = _failed_round_ended(workspace)
        outcome.seconds_to_end = round(ended - faulted_wall, 1) if ended else None
        outcome.headline = restarted["text"]
        outcome.named = _named(outcome.headline)
        outcome.resumed = restarted.get("resumed_step") is not None  # its line says where it resumed
        job.family.update(_descendants(job.proc.pid))
        job.end()  # the restarted round would train on: the trial has seen what it came for
        return
    try:
        outcome.exit_code = job.proc.wait(timeout=max(1.0, faulted + timeout - time.monotonic()))
    except subprocess.TimeoutExpired:
        outcome.hung = True
        return
    outcome.seconds_to_end = round(time.monotonic() - faulted, 1)
    job.wait_until_read(10.0)
    error = next((e for _, e in reversed(job.events) if e["type"] == "error" and "failed_rank" in e), None)
    if error is not None:
        outcome.headline = error["text"]
        outcome.named = _named(outcome.headline)


def _failed_round_ended(workspace: Path) -> float | None:
    """When torchrun's agent saw the first round fail (the latest of its noted exits; seconds since the epoch): it
    then ends the round's other workers within seconds and starts the next round."""
    try:
        entries = json.loads((workspace / ".tandem" / "worker-exits.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    seen = [e["seen_at"] for e in entries if e.get("attempt") == 0 and "seen_at" in e]
    return max(seen) if seen else None


def _backup_being_written(workspace: Path, job: Job, outcome: Outcome) -> None:
    tmp_seen = False
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not tmp_seen:  # a backup folder being written right now
        tmp_seen = any(p.name.endswith(".tmp") for p in (workspace / "backups").rglob(".step-*"))
        time.sleep(0.005)
    job.family.update(_descendants(job.proc.pid))
    outcome.note = "killed during a write" if tmp_seen else "no write caught in 60 s; killed anyway"
    os.killpg(job.proc.pid, signal.SIGKILL)


def _check_backups(workspace: Path, outcome: Outcome) -> None:
    import torch
    from modules.trainer import backup as backups
    for info in backups.list_backups(workspace / "backups"):
        try:
            weights, state, _ = backups.read_backup(info.path)
            if state["global_step"] != info.step or not all(torch.isfinite(w).all() for w in weights.values()):
                raise ValueError("step or weights wrong")
            outcome.backups.append(info.step)
        except Exception as e:  # noqa: BLE001 - any failure to read is a corrupt backup
            outcome.corrupt.append(f"{info.path.name}: {type(e).__name__}: {e}")


def _resume(workspace: Path, cache: Path, launcher: str, setup: Setup, outcome: Outcome) -> None:
    newest = max(outcome.backups)
    command = _command(workspace, cache, launcher, setup, [f"training.max_steps={newest + 2}"]) + ["--resume"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=setup.timeout,
                            env=dict(os.environ, TANDEM_EVENTS="1", PYTHONUNBUFFERED="1"))
    # A backup's interrupted write (.tmp) or delete (.old), removed by the resumed run.
    leftovers = [str(p) for p in (workspace / "backups").rglob(".step-*") if p.name.endswith((".tmp", ".old"))]
    outcome.resumed = (result.returncode == 0 and f'"step": {newest + 2}, "completed": true' in result.stdout
                       and not leftovers)
    if leftovers:
        outcome.note = f"half-written folders left after the resume: {leftovers}"
    elif not outcome.resumed:
        outcome.note = (result.stdout + result.stderr)[-1500:]


def run_trial(kind: str, launcher: str, rng: random.Random, root: Path, cache: Path, world: int = 2,
              timeout: float = 240, setup: Setup | None = None) -> Outcome:
    setup = setup or Setup(world=world, timeout=timeout)
    workspace = Path(tempfile.mkdtemp(prefix=f"{kind}-{launcher}-", dir=root))
    outcome = Outcome(kind, launcher)
    job = Job(_command(workspace, cache, launcher, setup, []))
    started = time.monotonic()
    try:
        # Wait for training to run (first backup written), then for a random moment of it.
        if job.wait_for(lambda e: e["type"] == "backup", setup.timeout * 4) is None:
            outcome.note = "the job ended before its first backup: " + job.output()[-1500:]
            return outcome
        if kind == "backup":
            _backup_being_written(workspace, job, outcome)
            outcome.killed_at_s = round(time.monotonic() - started, 1)
            faulted = time.monotonic()
        else:
            time.sleep(rng.uniform(0.0, 3.0))
            ranks = _ranks(job.proc.pid)
            outcome.killed_at_s = round(time.monotonic() - started, 1)
            faulted = time.monotonic()
            if not _inflict(kind, job, rng, outcome):
                outcome.note = f"nothing to {kind} found"
                return outcome
            _watch_the_end(kind, job, outcome, ranks, faulted, setup.timeout, workspace)
        if kind == "backup":
            try:
                outcome.exit_code = job.proc.wait(timeout=setup.timeout)
            except subprocess.TimeoutExpired:
                outcome.hung = True
            outcome.seconds_to_end = round(time.monotonic() - faulted, 1)
        outcome.orphans = _orphans_after(job, kind, ORPHAN_GRACE_S)
    finally:
        job.end()
    _check_backups(workspace, outcome)
    outcome.lost = not outcome.backups
    if outcome.backups and not outcome.restarted:  # a restart showed already whether it resumed
        _resume(workspace, cache, launcher, setup, outcome)
    return outcome


ORPHAN_GRACE_S = 2.0
"""The system reaps what the job left within this time; anything of it still alive after that is an orphan."""


def _orphans_after(job: Job, kind: str, grace_s: float) -> list[int]:
    """The job's processes still alive `grace_s` after its end: the same verdict as looking once at the end of
    the grace time, found sooner where nothing is left (the usual case: trials do not wait the whole time)."""
    deadline = time.monotonic() + grace_s
    while True:
        job.family.update(_descendants(job.proc.pid))
        left = [pid for pid in _alive(sorted(job.family)) if pid != job.proc.pid or kind != "launcher"]
        if kind == "stuck":  # the stopped process is the trial's doing; its end is the launcher's to make
            left = [pid for pid in left if not _stopped(pid)]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.1)


def _stopped(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[-1].startswith("T")
    except OSError:
        return False


def table(outcomes: list[Outcome]) -> str:
    """kind | launcher | seconds to the end | rank named | backup resumed - one row per trial."""
    rows = ["| kind | launcher | seconds to the end | killed process belonged to | named | backup resumed | ok |",
            "|---|---|---|---|---|---|---|"]
    # Restarted: the failed round's end, and (in parentheses) the new round's restart line, its start-up included.
    for o in outcomes:
        owner = f"rank {o.expected_rank}" if o.expected_rank is not None else \
            {"agent": "agent", "launcher": "launcher", "backup": "the whole job"}.get(o.kind, "?")
        end = "-" if o.seconds_to_end is None else f"{o.seconds_to_end:g}"
        if o.restarted:
            end += f" (restart line {o.seconds_to_restart_line:g})"
        rows.append(f"| {o.kind} | {o.launcher} | {end} | {owner} | {o.named or '-'} | "
                    f"{'yes' if o.resumed else 'no'} | {'yes' if o.ok else 'NO'} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=10, help="trials of each kind")
    p.add_argument("--kind", action="append", choices=KINDS, help="default: rank and backup")
    p.add_argument("--launcher", action="append", choices=["torchrun", "spawn"],
                   help="default: torchrun and spawn alternately (the agent kind: torchrun only)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work", type=Path, default=None, help="folder for the trials' workspaces (default: a temp dir)")
    p.add_argument("--json", type=Path, help="append one JSON line per trial")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: GPUs over NCCL")
    p.add_argument("--num-gpus", type=int, default=2, help="processes (GPUs) per job")
    p.add_argument("--max-restarts", type=int, default=0, help="torchrun trials restart instead of ending")
    p.add_argument("--timeout", type=float, default=240, help="seconds a job may take to end after the fault")
    p.add_argument("--config-value", action="append", default=[], metavar="K=V",
                   help="extra overrides of every job (e.g. model.base_model=/tmp/random-sd15)")
    p.add_argument("--table", action="store_true", help="print a table of the trials last")
    p.add_argument("--table-from", type=Path, metavar="JSONL", help="only print the table of the trials in this file "
                                                                    "(what --json wrote)")
    args = p.parse_args(argv)
    if args.table_from:
        known = set(Outcome.__dataclass_fields__)
        lines = [json.loads(line) for line in args.table_from.read_text().splitlines() if line.startswith("{")]
        trials = [t for t in lines if "killed_at_s" in t]  # the file may hold other scripts' results too
        outcomes = [Outcome(**{k: v for k, v in t.items() if k in known}) for t in trials]
        print(table(outcomes))
        return 0 if all(o.ok for o in outcomes) else 1
    rng = random.Random(args.seed)
    root = args.work or Path(tempfile.mkdtemp(prefix="tandem-faults-"))
    root.mkdir(parents=True, exist_ok=True)
    cache = root / "cache"
    setup = Setup(world=args.num_gpus, device=args.device, extra=tuple(args.config_value),
                  max_restarts=args.max_restarts, timeout=args.timeout)
    outcomes = []
    for kind in args.kind or ["rank", "backup"]:
        launchers = ["torchrun"] if kind == "agent" else (args.launcher or ["torchrun", "spawn"])
        for i in range(args.trials):
            launcher = launchers[i % len(launchers)]
            outcome = run_trial(kind, launcher, rng, root, cache, setup=setup)
            outcomes.append(outcome)
            line = {**outcome.__dict__, "ok": outcome.ok}
            print(json.dumps(line), flush=True)
            if args.json:
                with open(args.json, "a", encoding="utf-8") as f:
                    f.write(json.dumps(line) + "\n")
    bad = [o for o in outcomes if not o.ok]
    print(f"{len(outcomes)} trials: {sum(o.hung for o in outcomes)} hangs, {sum(bool(o.orphans) for o in outcomes)} "
          f"with orphans, {sum(not o.named_right for o in outcomes)} naming the wrong rank, "
          f"{sum(bool(o.corrupt) for o in outcomes)} with corrupt backups, {sum(o.lost for o in outcomes)} with "
          f"lost backups, {sum(o.resumed for o in outcomes)} resumed")
    if args.table:
        print(table(outcomes))
    return 1 if bad else 0

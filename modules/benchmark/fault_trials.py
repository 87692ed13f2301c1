"""Fault trials: kill a training the way machines and people do, then check that nothing was lost.

Two kinds of trial, each on N CPU processes over gloo through the real launcher (torchrun and spawn
alternately) on the built-in demo:

- `rank`: SIGKILL one worker rank at a random moment. The job must end by itself (no hang) with a
  non-zero exit, leave no process behind, and every backup it wrote must load and resume.
- `backup`: SIGKILL the whole job (every process at once: a power cut, the OOM killer, `kill -9` of
  the group) while a backup is being written. The backups completed before must be intact, the half
  written one must never be picked, and the next run must resume the newest complete one.

Each trial ends with a resume from the newest backup that must train on and exit 0. A summary counts
hangs, orphans, and corrupt or lost backups; all must be 0.

    python scripts/fault_trials.py --trials 10 --kind rank --kind backup
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


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

    @property
    def ok(self) -> bool:
        return not self.hung and not self.orphans and not self.corrupt and not self.lost and \
            (self.resumed or not self.backups)


def _descendants(pid: int) -> list[int]:
    rows = subprocess.run(["ps", "-eo", "pid,ppid"], capture_output=True, text=True).stdout.splitlines()[1:]
    children: dict[int, list[int]] = {}
    for row in rows:
        child, parent = (int(x) for x in row.split())
        children.setdefault(parent, []).append(child)
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


def _ranks(launcher: int) -> list[int]:
    """The training ranks under `launcher`: the children of torchrun's agent, or of the launcher itself under
    spawn (not multiprocessing's resource tracker, not the ranks' own DataLoader workers)."""
    rows = subprocess.run(["ps", "-eo", "pid,ppid"], capture_output=True, text=True).stdout.splitlines()[1:]
    children: dict[int, list[int]] = {}
    for row in rows:
        child, parent = (int(x) for x in row.split())
        children.setdefault(parent, []).append(child)
    parents = [launcher] + [p for p in children.get(launcher, []) if _is_torchrun(p)]
    return [c for parent in parents for c in children.get(parent, [])
            if not _is_torchrun(c) and b"resource_tracker" not in _cmdline(c) and _cmdline(c)]


def _is_torchrun(pid: int) -> bool:
    """torchrun's agent: Tandem's launcher runs it through modules.distributed.agent (a thin wrapper)."""
    return any(name in _cmdline(pid) for name in (b"torch.distributed.run", b"modules.distributed.agent"))


def _alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        stat = Path(f"/proc/{pid}/stat")
        if stat.exists() and stat.read_text().split(") ")[-1].startswith("Z"):
            continue  # a zombie is dead (its parent will reap it)
        alive.append(pid)
    return alive


def _command(workspace: Path, cache: Path, launcher: str, world: int, extra: list[str]) -> list[str]:
    values = [f"general.workspace_dir={workspace}", f"general.cache_dir={cache}", "general.tensorboard=false",
              "sampling.every_n_epochs=0", "save.backup_every_n_epochs=0", "save.backup_every_n_steps=3",
              "data.num_workers=1", "training.max_steps=100000", "multi_gpu.timeout_minutes=2", *extra]
    command = [sys.executable, str(REPO / "scripts" / "train_multi_gpu.py"), "--config-path", "#demo", "--device",
               "cpu", "--num-gpus", str(world), "--launcher", launcher]
    for value in values:
        command += ["--config-value", value]
    return command


def _check_backups(workspace: Path, outcome: Outcome) -> None:
    from modules.trainer import backup as backups
    for info in backups.list_backups(workspace / "backups"):
        try:
            weights, state, _ = backups.read_backup(info.path)
            import torch
            if state["global_step"] != info.step or not all(torch.isfinite(w).all() for w in weights.values()):
                raise ValueError("step or weights wrong")
            outcome.backups.append(info.step)
        except Exception as e:  # noqa: BLE001 - any failure to read is a corrupt backup
            outcome.corrupt.append(f"{info.path.name}: {type(e).__name__}: {e}")


def _resume(workspace: Path, cache: Path, launcher: str, world: int, outcome: Outcome, timeout: float) -> None:
    newest = max(outcome.backups)
    command = _command(workspace, cache, launcher, world, [f"training.max_steps={newest + 2}"]) + ["--resume"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                            env=dict(os.environ, TANDEM_EVENTS="1", PYTHONUNBUFFERED="1"))
    leftovers = [str(p) for p in (workspace / "backups").rglob(".step-*.tmp")]  # removed by the resumed run
    outcome.resumed = (result.returncode == 0 and f'"step": {newest + 2}, "completed": true' in result.stdout
                       and not leftovers)
    if leftovers:
        outcome.note = f"half-written folders left after the resume: {leftovers}"
    elif not outcome.resumed:
        outcome.note = (result.stdout + result.stderr)[-1500:]


def run_trial(kind: str, launcher: str, rng: random.Random, root: Path, cache: Path, world: int = 2,
              timeout: float = 240) -> Outcome:
    workspace = Path(tempfile.mkdtemp(prefix=f"{kind}-{launcher}-", dir=root))
    outcome = Outcome(kind, launcher)
    proc = subprocess.Popen(_command(workspace, cache, launcher, world, []), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env=dict(os.environ, TANDEM_EVENTS="1", PYTHONUNBUFFERED="1"))
    started = time.monotonic()
    family: set[int] = set()
    try:
        # Wait for training to run (first backup written), then for a random moment of it.
        first_backup = None
        for line in proc.stdout:
            family.update(_descendants(proc.pid))
            if '"type": "backup"' in line:
                first_backup = time.monotonic()
                break
        if first_backup is None:
            outcome.note = "the job ended before its first backup"
            return outcome
        if kind == "rank":
            time.sleep(rng.uniform(0.0, 3.0))
            workers = _ranks(proc.pid)
            family.update(_descendants(proc.pid))
            if not workers:
                outcome.note = "no worker process found to kill"
                return outcome
            victim = rng.choice(workers)  # any rank, rank 0 included
            outcome.killed_at_s = round(time.monotonic() - started, 1)
            os.kill(victim, signal.SIGKILL)
        else:
            tmp_seen = False
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not tmp_seen:  # a backup folder being written right now
                tmp_seen = any(p.name.endswith(".tmp") for p in (workspace / "backups").rglob(".step-*"))
                time.sleep(0.005)
            family.update(_descendants(proc.pid))
            outcome.killed_at_s = round(time.monotonic() - started, 1)
            outcome.note = "killed during a write" if tmp_seen else "no write caught in 60 s; killed anyway"
            os.killpg(proc.pid, signal.SIGKILL)
        try:
            outcome.exit_code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            outcome.hung = True
        proc.stdout.read()
        time.sleep(2)  # the system reaps what the job left; anything still alive after that is an orphan
        outcome.orphans = _alive(sorted(family))
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for pid in _alive(sorted(family)):
            os.kill(pid, signal.SIGKILL)
    _check_backups(workspace, outcome)
    outcome.lost = not outcome.backups
    if outcome.backups:
        _resume(workspace, cache, launcher, world, outcome, timeout)
    return outcome


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=10, help="trials of each kind")
    p.add_argument("--kind", action="append", choices=["rank", "backup"], help="default: both")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work", type=Path, default=None, help="folder for the trials' workspaces (default: a temp dir)")
    p.add_argument("--json", type=Path, help="append one JSON line per trial")
    args = p.parse_args(argv)
    rng = random.Random(args.seed)
    root = args.work or Path(tempfile.mkdtemp(prefix="tandem-faults-"))
    root.mkdir(parents=True, exist_ok=True)
    cache = root / "cache"
    outcomes = []
    for kind in args.kind or ["rank", "backup"]:
        for i in range(args.trials):
            launcher = "torchrun" if i % 2 == 0 else "spawn"
            outcome = run_trial(kind, launcher, rng, root, cache)
            outcomes.append(outcome)
            line = {**outcome.__dict__, "ok": outcome.ok}
            print(json.dumps(line), flush=True)
            if args.json:
                with open(args.json, "a", encoding="utf-8") as f:
                    f.write(json.dumps(line) + "\n")
    bad = [o for o in outcomes if not o.ok]
    print(f"{len(outcomes)} trials: {sum(o.hung for o in outcomes)} hangs, {sum(bool(o.orphans) for o in outcomes)} "
          f"with orphans, {sum(bool(o.corrupt) for o in outcomes)} with corrupt backups, "
          f"{sum(o.lost for o in outcomes)} with lost backups, {sum(o.resumed for o in outcomes)} resumed")
    return 1 if bad else 0

"""A run on a remote machine as `RunController` sees it (the `RunHost` of ui/run_host.py). No Tk in here.

Its event lines are read from the run's output file there through ssh (`modules.remote.runs.Follower`) instead
of from a local process's stdout, commands go through the remote's helper, and the files the Run tab shows are
the fetched copies under the workspace's mirror folder. The start itself (connect, upload, start) runs on a
worker thread and says how it goes on the run's queue, so the window never waits on the network.
"""
from __future__ import annotations

import queue
import threading
from pathlib import Path
from typing import Any, Callable, Protocol

from modules.config import RunPaths, TrainConfig
from modules.remote.fetch import fetch_outputs, mirror_folder
from modules.remote.host import RemoteHost
from modules.remote.known_hosts import KnownHosts
from modules.remote.machine import RemoteMachine
from modules.remote.prepare import SetupError
from modules.remote.remote_config import workspace_of
from modules.remote.runs import Follower, RunInfo, kill_run, send_command
from modules.remote.session import RemoteSession, StartRefused
from modules.remote.ssh import SshError

from .backup_choices import BackupChoice
from .events import LogLine, TrainingEvent, parse_line
from .run_host import Begun, Detached, Exited, Failed, LossFiles, Started, rank_gpus

CONNECTING = "connecting"
REMOTE_ERRORS = (SshError, SetupError, StartRefused, OSError, ValueError)


class Owner(Protocol):
    """What the host reads from the controller it serves (`remote_controller.RemoteRunController`): the machine's
    check and listings, which the Run tab's other buttons keep up to date."""

    report: Any
    """The last set-up check, or None."""
    notice: str
    notice_error: bool
    backups: list[BackupChoice]
    """The remote workspace's backups, newest first, as last looked up."""

    def active(self) -> bool: ...

    def backups_of(self, cfg: TrainConfig) -> list[BackupChoice]: ...

    def background(self, name: str, work: Callable[[], Any], kind: str) -> None: ...

    def confirm(self, text: str) -> bool: ...

    def run_started(self, run: RunInfo) -> None: ...

    def run_exited(self) -> None: ...


class RemoteRunHost:
    """One remote machine's runs, for the Run tab, serving `owner` (network work runs on its worker threads)."""

    uses_local_gpus = False
    others_may_stop = True
    """Another desktop, or `train_remote.py --stop`, may stop the run."""

    def __init__(self, host: RemoteHost, known: KnownHosts, session_factory: Callable[..., RemoteSession], owner: Owner):
        self.host = host
        self.owner = owner
        self.machine = RemoteMachine(host, known)
        self.session = session_factory([host], known, progress=self.progress, confirm=owner.confirm)
        self.where = f" on {host.label}"
        self.run: RunInfo | None = None
        """The run shown (started here, or attached to)."""
        self._feed: queue.Queue = queue.Queue()
        self._follower: Follower | None = None
        self._fetched_samples: set[str] = set()
        self._local_workspace = Path(".")

    # --- starting and following -------------------------------------------------------------------
    def start(self, cfg: TrainConfig, visible_gpus: int, command: list[str] | None, resume: str | None,
              feed: queue.Queue) -> Begun:
        """Start `cfg` on the machine from a worker thread (connect, upload, start), then follow it."""
        problems = self.host.problems()
        if problems:
            raise RuntimeError("; ".join(problems))
        begun = self._begin(feed, cfg.general.workspace_dir, f"{CONNECTING} to {self.host.label}",
                            f"$ train on {self.host.label}" + (f" --resume {resume}" if resume else ""),
                            rank_gpus(cfg, visible_gpus))
        name = Path(cfg.general.workspace_dir).name or "run"

        def body() -> None:
            try:
                started = self.session.start(cfg, resume, name=name)
            except REMOTE_ERRORS as e:
                feed.put(LogLine(f"[remote] {e}"))
                feed.put(Failed(str(e)))
                return
            run = started.infos[0]
            feed.put(Started(f"started {run.id} on {self.host.label}",
                             f"[remote] started {run.id} in {self.host.folder} on {self.host.label}", run))
            self.follow(run, feed)
        threading.Thread(target=body, daemon=True, name="tandem-remote-start").start()
        return begun

    def attach(self, run: RunInfo, feed: queue.Queue, instead: bool) -> Begun:
        """Follow a run that is (or was) on the machine, replayed from its first line; `instead`: stop following
        the run shown first (it goes on there)."""
        if instead and self._follower is not None:
            self._follower.close()
        begun = self._begin(feed, run.local_workspace or ".", f"following {run.id} on {self.host.label}", "", None)
        self.run = run
        threading.Thread(target=self.follow, args=(run, feed), daemon=True, name="tandem-remote-follow").start()
        return begun

    def _begin(self, feed: queue.Queue, local_workspace: str, message: str, line: str,
               gpus: list[int] | None) -> Begun:
        self._feed = feed
        self._fetched_samples = set()
        self._local_workspace = Path(local_workspace).expanduser().resolve()
        # The plot of a continued run goes on from the earlier run's points, as a local run's does.
        tandem = self._local_workspace / ".tandem"
        losses = LossFiles(tandem / f"remote-{self.host.key}-losses.csv",
                           tandem / f"remote-{self.host.key}-validation-losses.csv",
                           tandem / f"remote-{self.host.key}-losses")  # each run's own, once it says its id
        return Begun(message, line, losses, started=["train_remote", self.host.label], rank_gpus=gpus)

    def follow(self, run: RunInfo, out: queue.Queue) -> None:
        """The follower thread: every line parsed into the queue, sample pictures fetched, outputs at the end."""
        follower = Follower(self.machine, run.id)
        self._follower = follower
        try:
            end = follower.follow(lambda line: out.put(self._localise(parse_line(line), run)),
                                  lambda note: out.put(LogLine(f"[remote] {note}")))
        except REMOTE_ERRORS as e:
            out.put(LogLine(f"[remote] {e}"))
            out.put(Failed(f"following the run on {self.host.label} failed: {e}"))
            return
        if end is None:  # detached: the run goes on
            out.put(Detached(f"detached: the run goes on on {self.host.label}"))
            return
        if end.state == "lost":
            out.put(Failed(f"the run's processes on {self.host.label} ended without an exit code (the machine "
                           "restarted, or they were killed); its backups are still there"))
            return
        out.put(LogLine(f"[remote] the run ended on {self.host.label}; fetching its outputs"))
        try:
            fetched = fetch_outputs(self.machine, run.workspace, self.mirror(run))
            out.put(LogLine(f"[remote] fetched {fetched.files} file(s) into {fetched.folder}"))
        except REMOTE_ERRORS as e:
            out.put(LogLine(f"[remote] could not fetch the outputs: {e} (Fetch outputs tries again)"))
        out.put(Exited(end.exit_code if end.exit_code is not None else 1))

    def detach(self) -> None:
        """Stop following (the run goes on there)."""
        if self._follower is not None:
            self._follower.close()

    def mirror(self, run: RunInfo | None = None) -> Path:
        """Where the run's fetched files land on this machine."""
        return Path((run.local_workspace if run else None) or self._local_workspace) / "remote" / self.host.key

    def _localise(self, item: TrainingEvent | LogLine, run: RunInfo) -> TrainingEvent | LogLine:
        """Remote paths in events become the fetched copies (samples) or `host:path` (models, backups)."""
        if not isinstance(item, TrainingEvent):
            return item
        if item.type == "sample":
            name = str(item.get("path", ""))
            local = self.mirror(run) / Path(name).relative_to(run.workspace) if name.startswith(run.workspace) else None
            if local is not None and not local.exists() and name not in self._fetched_samples:
                try:  # every sample new so far in one fetch: a replayed run's pictures come at once
                    fetch_outputs(self.machine, run.workspace, self.mirror(run))
                except REMOTE_ERRORS as e:
                    return LogLine(f"[remote] could not fetch the sample {name}: {e}")
                self._fetched_samples.add(name)
            if local is not None:
                return TrainingEvent(item.type, {**item.data, "path": str(local)})
        if item.type in ("saved", "backup", "done"):
            key = "output" if item.type == "done" else "path"
            if item.get(key):
                return TrainingEvent(item.type, {**item.data, key: f"{self.host.label}:{self.host.folder}/{item.get(key)}"})
        return item

    def progress(self, text: str) -> None:
        """A start's step, said in the log and the status."""
        self._feed.put(LogLine(f"[remote] {text}"))
        self._feed.put(TrainingEvent("status", {"text": text}))

    def shown(self, item: Started) -> None:
        self.run = item.run
        self.owner.run_started(item.run)

    def exited(self) -> None:
        self.owner.run_exited()

    # --- commands ---------------------------------------------------------------------------------
    def send(self, command: str) -> str | None:
        if self.run is None:
            raise RuntimeError(f"no training is running to {command}")
        run_id = self.run.id
        self.owner.background(f"sending {command}", lambda: send_command(self.machine, run_id, command) or
                              f"{command} sent to {run_id}", "notice")
        return f"[remote] {command} -> {self.host.label}"

    def terminate(self) -> bool:
        """End the run's processes on the remote now."""
        if self.run is None or not self.owner.active():
            return False
        run_id = self.run.id
        self.owner.background("ending the run", lambda: kill_run(self.machine, run_id).describe(), "notice")
        return True

    # --- where its files are ------------------------------------------------------------------------
    def absolute(self, path: Path) -> Path:
        """Paths of the run's events are this machine's already (`_localise`)."""
        return path if path.is_absolute() else Path.cwd() / path

    def output_folder(self, cfg: TrainConfig) -> Path:
        return mirror_folder(cfg, self.host) / "output"

    def sample_folders(self, cfg: TrainConfig) -> tuple[Path, Path]:
        """The fetched copies: the remote workspace's files land under the mirror folder as they are there."""
        mirror = mirror_folder(cfg, self.host)
        return mirror / RunPaths(cfg).samples.relative_to(RunPaths(cfg).workspace), mirror

    def backups_folder(self, cfg: TrainConfig) -> str:
        return f"{workspace_of(cfg)}/backups on {self.host.label}"

    def backup_choices(self, cfg: TrainConfig) -> list[BackupChoice]:
        """The remote workspace's backups, newest first, as last looked up (never a network call here: the view
        asks at every redraw; the owner looks them up in the background)."""
        return self.owner.backups_of(cfg)

    def backup_present(self, choice: BackupChoice) -> bool:
        """Listed by the last look there; a backup deleted since makes the run's start fail with its path."""
        return any(c.path == choice.path for c in self.owner.backups)

    def start_problems(self, problems: list[str], cfg: TrainConfig) -> list[str]:
        """A base model already on the remote need not exist here; the machine must have been checked (its GPUs
        decide what a start runs, as this machine's do for a local start)."""
        if self.host.base_model.strip():
            problems = [p for p in problems if "model.base_model" not in p and "Base model" not in p]
        if self.host.problems():
            return [*problems, *self.host.problems(), "then Check connection (Run tab, Run on)"]
        if self.owner.report is None:
            why = self.owner.notice if self.owner.notice_error else "the check is under way"
            problems = [*problems, f"{self.host.label} has not been checked yet ({why}): press Check connection "
                                   "(Run tab, Run on) and Start when it answered"]
        return problems

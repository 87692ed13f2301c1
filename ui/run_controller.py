"""Starts a training run, follows its output and sends it commands - on this machine or, with another
`RunHost` handed in, on a remote one (ui/run_host.py). No Tk in here.

The host's reader thread turns each output line into an event or a log line and puts it on a queue; the
GUI calls `poll()` from `after(...)` on its own thread, which applies the queued items to
`RunState`. Tests call `poll()` the same way, so the whole run cycle is tested without a display.
"""
from __future__ import annotations

import queue
import signal
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path, PurePath
from typing import Any, Callable

from modules.config import TrainConfig
from modules.util.run_protocol import command_problem

from .backup_choices import BackupChoice, default_choice
from .events import LogLine, TrainingEvent
from .loss_history import LossHistory, run_histories
from .run_host import Begun, Detached, Exited, Failed, LocalHost, RunHost, Started

ERROR_TAIL_LINES = 25
ASKED = {"sample": "sampling at the next step", "backup": "writing a backup at the next step",
         "save": "saving the model at the next step"}
"""What the status says from the click until the run says it began (a sampling may come a minute later)."""


@dataclass
class RunState:
    status: str = "idle"
    """idle, running, stopping, finished, stopped or failed."""
    message: str = ""
    epoch: int = 0
    epochs: int = 0
    step: int = 0
    total_steps: int = 0
    images_per_s: float = 0.0
    """The recent rate of the steps (as the trainer smooths it)."""
    run_images_per_s: float | None = None
    """Once the run has ended: images trained over the seconds the run took (its `done` event)."""
    eta_s: float | None = None
    lr: float | None = None
    losses: list[tuple[int, float]] = field(default_factory=list)
    """The loss curve: a resumed run's earlier points (from the run folder), then this run's."""
    validation_losses: list[tuple[int, float]] = field(default_factory=list)
    """The validation-loss curve of this run (a held-out set: `validation` concepts, data.validation_fraction)."""
    rank_losses: list[float] = field(default_factory=list)
    """The last step's loss of each rank (several processes only)."""
    rank_images_per_s: list[float] = field(default_factory=list)
    rank_gpus: list[int] | None = None
    """The GPU each rank trains on (NVML / nvidia-smi numbers); None for CPU processes."""
    run_info: dict[str, Any] = field(default_factory=dict)
    """The trainer's `config` event: world size, global batch, LR after scaling."""
    samples: list[dict[str, Any]] = field(default_factory=list)
    saved: list[str] = field(default_factory=list)
    backups: list[str] = field(default_factory=list)
    written_backups: list[tuple[str, int]] = field(default_factory=list)
    """(run id, step) of each backup the run wrote, in order: Continue offers the last once it ended."""
    output: str | None = None
    error: str | None = None
    restarts: list[str] = field(default_factory=list)
    """The automatic restarts so far, as the trainer said them ("restart 1 of 3: rank 1 died ...")."""
    command: list[str] = field(default_factory=list)
    multi_process: bool = False
    """Whether the run was started as several processes (before the trainer says its world size)."""
    run_id: str | None = None
    """The run's id as the trainer said it (its `config` event): its backups, samples and loss curve go by it."""
    asked: str = ""
    """The status of a command sent and not yet begun (`ASKED`); steps trained meanwhile do not clear it."""
    completed: bool | None = None
    """Whether the run trained all its steps, as its `done` event said (None: it said nothing yet)."""

    @property
    def active(self) -> bool:
        return self.status in ("running", "stopping")

    @property
    def fraction(self) -> float:
        return min(self.step / self.total_steps, 1.0) if self.total_steps else 0.0

    @property
    def headline(self) -> str:
        """`Running - loading the model`, `Failed`: the status, and the message when it adds something."""
        status = self.status.capitalize()
        message = self.message.strip()
        return f"{status} - {message}" if message and message.lower() != self.status else status


def _exit_reason(returncode: int, log_tail: list[str]) -> str:
    text = "\n".join(log_tail)
    if "OutOfMemoryError" in text or "out of memory" in text.lower():
        return (f"Training ran out of memory (exit code {returncode}). Lower training.batch_size, "
                "turn on gradient checkpointing or use a lower resolution.")
    if returncode < 0:
        name = signal.Signals(-returncode).name if -returncode in signal.Signals._value2member_map_ else "?"
        hint = " - possibly killed by the system for lack of memory" if -returncode == 9 else ""
        return f"Training was killed by signal {-returncode} ({name}){hint}."
    return f"Training failed with exit code {returncode}."


class RunController:
    """One run shown in the Run tab, wherever it runs: `run_host` says how it starts, how its lines arrive, how
    commands and an end reach it and where its files are (default: this machine, `LocalHost`)."""

    def __init__(self, python: str = sys.executable, cwd: str | Path | None = None,
                 env: dict[str, str] | None = None, stop_timeout_s: float = 120.0, log_limit: int = 5000,
                 run_host: RunHost | None = None):
        self.python = python
        """The Python the GUI's own helpers run with (TensorBoard, checks)."""
        self.run_host: RunHost = run_host or LocalHost(python, cwd, env)
        self.stop_timeout_s = stop_timeout_s
        self.state = RunState()
        self.log: deque[str] = deque(maxlen=log_limit)
        self.log_count = 0
        """Lines ever logged in this run; a view compares it with what it has shown."""
        self._queue: queue.Queue = queue.Queue()
        self._soon: queue.Queue = queue.Queue()
        """Work handed to the GUI's thread from others (`call_soon`), done first at the next `poll()`."""
        self._stop_deadline: float | None = None
        self._terminated = False
        self.history: LossHistory | None = None
        self.validation_history: LossHistory | None = None
        """The validation curve on disk, continued like the loss curve."""
        self.losses_folder: Path | None = None
        """Where each run's loss curves are kept by run id (`ui/loss_history.py`); None: the one file above."""
        self.run_workspace: Path | None = None
        """The workspace of the run shown (None: none, or one this machine does not know)."""

    # --- starting --------------------------------------------------------------------------
    def absolute(self, path: Path) -> Path:
        """`path` as the training process sees it."""
        return self.run_host.absolute(path)

    def backups_folder(self, cfg: TrainConfig) -> Path | str:
        """The folder of the workspace's backups, as the training process sees it."""
        return self.run_host.backups_folder(cfg)

    def backup_choices(self, cfg: TrainConfig) -> list[BackupChoice]:
        """The workspace's backups, newest first, each marked when its run finished after it."""
        return self.run_host.backup_choices(cfg)

    def backup_present(self, choice: BackupChoice) -> bool:
        """Whether the backup `choice` names is still there to continue from."""
        return self.run_host.backup_present(choice)

    def newest_backup(self, cfg: TrainConfig) -> BackupChoice | None:
        """The backup Continue resumes unless another is picked: the newest of a run that has not finished."""
        return default_choice(self.backup_choices(cfg))

    def start(self, cfg: TrainConfig, visible_gpus: int, command: list[str] | None = None,
              resume: str | None = None) -> list[str]:
        """Launch training for `cfg` (continuing the backup `resume` names, e.g. `latest`); `command`
        replaces the built command line (tests use a fake trainer). Returns the command line started."""
        if self.state.active:
            raise RuntimeError("a training run is already active; stop it first")
        feed: queue.Queue = queue.Queue()
        begun = self.run_host.start(cfg, visible_gpus, command, resume, feed)
        self.begin(begun, feed)
        return begun.started

    def begin(self, begun: Begun, feed: queue.Queue) -> None:
        """Show the run the host began: a fresh state and log, its lines from `feed`, its loss curves' files."""
        self.state = RunState(status="running", message=begun.message, command=list(begun.command),
                              rank_gpus=begun.rank_gpus, multi_process=begun.multi_process)
        self.run_workspace = begun.workspace
        self.log.clear()
        self.log_count = 0
        if begun.first_line:
            self._log(begun.first_line)
        self._stop_deadline = None
        self._terminated = False
        self._queue = feed
        for history in (self.history, self.validation_history):
            if history is not None:
                history.close()
        # Until the trainer says its run id (an older trainer never does): the files of before.
        self.history = LossHistory(begun.losses.losses)
        self.validation_history = LossHistory(begun.losses.validation)
        self.losses_folder = begun.losses.folder

    def _log(self, text: str) -> None:
        self.log.append(text)
        self.log_count += 1

    def new_log_lines(self, shown: int) -> list[str]:
        """The lines logged after the first `shown` (those that still fit in the buffer)."""
        fresh = min(self.log_count - shown, len(self.log))
        return list(self.log)[len(self.log) - fresh:] if fresh > 0 else []

    # --- commands --------------------------------------------------------------------------
    def send(self, command: str) -> None:
        """Hand a command to the run (rank 0 reads it at its next step)."""
        problem = command_problem(command)
        if problem:
            raise ValueError(problem)
        if not self.state.active:
            raise RuntimeError(f"no training is running to {command}")
        line = self.run_host.send(command)
        if line:
            self._log(line)
        self.asked(command)

    def asked(self, command: str) -> None:
        """Say at once that `command` was sent: the run acts on it one or two steps later (a sampling then
        takes its time), and until it says so itself the status says it is coming."""
        if command in ASKED and self.state.status == "running":
            self.state.asked = ASKED[command]
            self.state.message = ASKED[command]

    def shows_workspace(self, workspace: Path) -> bool:
        """Whether the run shown (if any) belongs to `workspace` (as the training process sees it)."""
        return self.run_workspace is None or self.run_workspace == self.absolute(Path(workspace))

    def forget_run(self) -> None:
        """Show no run: another workspace was chosen, and an ended run of the previous one is not its run."""
        if self.state.active:
            raise RuntimeError("a run is going on; it is shown until it ends")
        self.state = RunState()
        self.log.clear()
        self.log_count = 0
        self.run_workspace = None

    def stop(self) -> None:
        """Ask every rank to stop at the same step (and back up); if the process is still there
        after `stop_timeout_s`, `poll()` ends its whole process group."""
        if self.state.status != "running":
            return
        self.send("stop")
        self.state.status = "stopping"
        self.state.asked = ""  # a sampling asked for before is not waited for: the run ends
        several = int(self.state.run_info.get("world_size") or 0) > 1 or self.state.multi_process
        self.state.message = ("every rank stops after the current step" if several
                              else "training stops after the current step")
        self._stop_deadline = time.monotonic() + self.stop_timeout_s

    def terminate(self) -> None:
        """End the run's processes now (all ranks, launcher included). Returns at once: the GUI's thread never
        waits (`RunHost.terminate`)."""
        if self.run_host.terminate():
            self._terminated = True

    # --- following the run -----------------------------------------------------------------
    def call_soon(self, work: Callable[[], None]) -> None:
        """Have the GUI's thread do `work` at its next `poll()` (from any thread)."""
        self._soon.put(work)

    def poll(self, limit: int = 2000) -> list[TrainingEvent | LogLine]:
        """Do what other threads handed over (`call_soon`), then apply what the reader thread queued (at most
        `limit` items) and return it."""
        while True:
            try:
                self._soon.get_nowait()()
            except queue.Empty:
                break
        items = []
        for _ in range(limit):
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if self._control(item):
                continue
            items.append(item)
            if isinstance(item, LogLine):
                self._log(item.text)
            else:
                self._apply(item)
        if (self._stop_deadline is not None and self.state.status == "stopping"
                and time.monotonic() > self._stop_deadline):
            self._log(f"[gui] training did not stop within {self.stop_timeout_s:g}s; ending it{self._where()}")
            self._stop_deadline = None
            self.terminate()
        return items

    def _control(self, item) -> bool:
        """Act on a queued message about the run rather than from it (True when `item` was one): a start made
        in the background that took or failed, the run no longer followed, its processes' exit."""
        s = self.state
        if isinstance(item, Exited):
            self._finish(item.returncode)
            self.run_host.exited()
        elif isinstance(item, Started):
            s.message = item.message
            self._log(item.line)
            self.run_host.shown(item)
        elif isinstance(item, Failed):
            s.status, s.message, s.error = "failed", "", item.text
        elif isinstance(item, Detached):
            s.status, s.message = "idle", item.text
        else:
            return False
        return True

    def _where(self) -> str:
        """Where the run is, for log lines ("" on this machine)."""
        return self.run_host.where

    def _apply(self, event: TrainingEvent) -> None:
        s = self.state
        if event.type == "config":
            s.run_info = dict(event.data)
            s.total_steps = int(event.get("total_steps", s.total_steps) or 0)
            self._follow_run_id(event.get("run_id"))
        elif event.type == "status":
            s.message = str(event.get("text", ""))
            if s.asked and s.message.split(" ")[0] == s.asked.split(" ")[0]:
                s.asked = ""  # the run began what was asked ("sampling - prompt 1 of 4"): it says how it goes
        elif event.type == "progress":
            # A step trained since: what the run was busy with (starting, saving) is over. An automatic
            # restart's note stays, so that the status keeps saying why the run went back.
            if s.message and (not s.restarts or s.message != s.restarts[-1]) and s.message != s.asked:
                s.message = ""
            s.epoch = int(event.get("epoch", s.epoch))
            s.epochs = int(event.get("epochs", s.epochs))
            s.step = int(event.get("step", s.step))
            s.total_steps = int(event.get("total_steps", s.total_steps))
            s.images_per_s = float(event.get("images_per_s", 0.0) or 0.0)
            s.eta_s = event.get("eta_s")
            s.rank_images_per_s = list(event.get("rank_images_per_s") or [])
        elif event.type == "loss":
            step, loss = int(event.get("step", len(s.losses))), float(event.get("loss"))
            if not s.losses and self.history is not None:
                s.losses = self.history.begin(step)  # a resumed run continues its earlier curve
            s.losses.append((step, loss))
            if self.history is not None:
                self.history.append(step, loss)
            s.lr = event.get("lr", s.lr)
            s.rank_losses = list(event.get("rank_losses") or [])
        elif event.type == "validation":
            step, loss = int(event.get("step", 0)), float(event.get("loss"))
            if not s.validation_losses and self.validation_history is not None:
                # A new run scores its start (step 0): the file starts over. A resumed run's first point is
                # later, and the earlier points of the same training stay on the plot.
                s.validation_losses = self.validation_history.begin(step)
            s.validation_losses.append((step, loss))
            if self.validation_history is not None:
                self.validation_history.append(step, loss)
        elif event.type == "sample":
            s.samples.append(dict(event.data))
            if s.asked == ASKED["sample"]:
                self._answered()
        elif event.type == "saved":
            s.saved.append(str(event.get("path")))
            if s.asked == ASKED["save"]:
                self._answered()
            if s.message == f"saving {Path(str(event.get('path'))).name}":
                s.message = ""
        elif event.type == "backup":
            s.backups.append(str(event.get("path")))
            # backups/<run id>/step-<N>: named by the folder it is in (a remote run's path is the remote's)
            s.written_backups.append((PurePath(str(event.get("path"))).parent.name, int(event.get("step", -1))))
            if s.asked == ASKED["backup"]:
                self._answered()
        elif event.type == "error":
            rank = event.get("rank")
            where = f" (rank {rank})" if rank is not None else ""
            s.error = f"{event.get('text', 'unknown error')}{where}"
        elif event.type == "restart":
            # The failure before it was restarted past: the run goes on, its error stays in the log only.
            s.restarts.append(str(event.get("text", "")))
            s.message = s.restarts[-1]
            s.error = None
        elif event.type == "done":
            s.output = event.get("output")
            s.completed = bool(event.get("completed", True))
            if isinstance(event.get("images_per_s"), (int, float)) and event.get("images"):
                s.run_images_per_s = float(event.get("images_per_s"))

    def _answered(self) -> None:
        """What was asked is done (a trainer that does not announce its start said so by its result)."""
        if self.state.message == self.state.asked:
            self.state.message = ""
        self.state.asked = ""

    def _follow_run_id(self, run_id) -> None:
        """The trainer said its run id: the loss curves are that run's own files from here on (the same run
        again after an automatic restart keeps the files it has)."""
        s = self.state
        if not isinstance(run_id, str) or Path(run_id).name != run_id or run_id in ("", ".", ".."):
            return
        if run_id == s.run_id or self.losses_folder is None:
            s.run_id = run_id
            return
        s.run_id = run_id
        for history in (self.history, self.validation_history):
            if history is not None:
                history.close()
        self.history, self.validation_history = run_histories(self.losses_folder, run_id)

    def _finish(self, returncode: int) -> None:
        s = self.state
        s.asked = ""
        stopping = s.status == "stopping"
        self._stop_deadline = None
        for history in (self.history, self.validation_history):
            if history is not None:
                history.close()
        if returncode == 0 and s.error is None:
            s.status = "stopped" if stopping else "finished"
            s.message = f"model saved to {s.output}" if s.output and not stopping else ""
            if s.status == "finished" and s.completed is False and self.run_host.others_may_stop:
                s.status = "stopped"  # stopped from elsewhere: another desktop, train_remote.py --stop
            return
        if stopping and self._terminated:
            s.status = "stopped"
            s.message = "the process was ended after it did not stop in time"
            return
        tail = [line for line in self.log if not line.startswith("$ ")][-ERROR_TAIL_LINES:]
        reason = _exit_reason(returncode, tail) if returncode != 0 else "Training reported an error."
        if s.error:
            reason = f"{s.error}\n{reason}"
        s.status = "failed"
        s.message = ""  # the error box below says what happened
        s.error = reason + "\n\nLast log lines:\n" + "\n".join(tail)

    # --- what the run view asks (the host answers for the machine the run is on) ------------------------
    @property
    def uses_local_gpus(self) -> bool:
        """Whether this machine's GPU readings belong in the per-GPU view."""
        return self.run_host.uses_local_gpus

    def sample_folders(self, cfg: TrainConfig) -> tuple[Path, Path]:
        """The workspace's samples folder and the workspace, where the Run tab's gallery reads them."""
        return self.run_host.sample_folders(cfg)

    def output_folder(self, cfg: TrainConfig) -> Path:
        return self.run_host.output_folder(cfg)

    def start_problems(self, problems: list[str], cfg: TrainConfig) -> list[str]:
        """The config problems that stop a start there."""
        return self.run_host.start_problems(problems, cfg)

    def wait(self, timeout: float) -> bool:
        """Poll until the run ends or `timeout` seconds pass (for scripts and tests)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.poll()
            if not self.state.active:
                return True
            time.sleep(0.05)
        return False

"""Where the run the Run tab shows lives, handed to `RunController` (ui/run_controller.py). No Tk in here.

The controller keeps the run's state, log, loss curves, Stop deadline and error the same wherever the run is;
its host says what differs: how a run starts, how its output lines reach the controller's queue (a reader
thread puts each one there, then the run's `Exited`), how a command and an end reach it, and where its files
are. `LocalHost` runs training as a process of this machine; a remote machine's host is
`remote_controller.RemoteRunHost`.
"""
from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from modules.config import TrainConfig, save_config
from modules.config.run_paths import RunPaths
from modules.util.no_follow import open_text_no_follow
from modules.util.run_protocol import EVENTS_VARIABLE, write_command
from modules.util.workspace_lock import workspace_in_use

from .backup_choices import BackupChoice, backup_choices
from .events import parse_line
from .launch_command import build_command, is_multi_process, run_config
from .multi_gpu_settings import selected_gpus


@dataclass(frozen=True)
class Exited:
    """The run's processes ended with `returncode` (queued after its last line)."""
    returncode: int


@dataclass(frozen=True)
class Failed:
    """The run could not be started or followed; `text` says why (the run's error)."""
    text: str


@dataclass(frozen=True)
class Detached:
    """The run is no longer followed here; it goes on where it runs."""
    text: str


@dataclass(frozen=True)
class Started:
    """A start the host made in the background took: the status says `message`, the log `line`; `run` is what
    the host follows (its own record of the run)."""
    message: str
    line: str
    run: Any = None


@dataclass(frozen=True)
class LossFiles:
    """Where a run's loss curves are kept (`ui/loss_history.py`): the files used until the run says its id,
    and the folder of each run's own files by id."""
    losses: Path
    validation: Path
    folder: Path


@dataclass(frozen=True)
class Begun:
    """A run as its host began (or attached to) it, for the controller to show."""
    message: str
    first_line: str
    """Logged first: what was started."""
    losses: LossFiles
    started: list[str] = field(default_factory=list)
    """What `RunController.start` returns (the command line of a local run)."""
    command: list[str] = field(default_factory=list)
    """The command line the state shows (none for a remote run)."""
    rank_gpus: list[int] | None = None
    multi_process: bool = False
    workspace: Path | None = None
    """The run's workspace as this machine's processes see it; None where it has none here."""


def rank_gpus(cfg: TrainConfig, visible_gpus: int) -> list[int] | None:
    """The GPU of each rank a start with `cfg` runs: the chosen GPUs in order, or GPU 0 for one process."""
    if cfg.general.device == "cpu" or visible_gpus == 0:
        return None
    if not is_multi_process(cfg, visible_gpus):
        return [0]
    return selected_gpus(cfg, list(range(visible_gpus)))


class RunHost(Protocol):
    """What `RunController` asks of the place a run lives."""

    uses_local_gpus: bool
    """Whether this machine's GPU readings belong in the per-GPU view."""
    where: str
    """Where the run is, for log lines ("" on this machine, " on box")."""
    others_may_stop: bool
    """Whether something other than this window may stop the run (then an uncompleted end shows as stopped)."""

    def start(self, cfg: TrainConfig, visible_gpus: int, command: list[str] | None, resume: str | None,
              feed: queue.Queue) -> Begun: ...

    def send(self, command: str) -> str | None:
        """Deliver `command` to the run; returns a line for the log, or None."""

    def terminate(self) -> bool:
        """End the run's processes now; False when there was nothing to end."""

    def shown(self, item: Started) -> None:
        """A background start took (on the GUI's thread, in order with the run's lines)."""

    def exited(self) -> None:
        """The run's processes ended (on the GUI's thread)."""

    def absolute(self, path: Path) -> Path: ...

    def backups_folder(self, cfg: TrainConfig) -> Path | str: ...

    def backup_choices(self, cfg: TrainConfig) -> list[BackupChoice]: ...

    def backup_present(self, choice: BackupChoice) -> bool: ...

    def sample_folders(self, cfg: TrainConfig) -> tuple[Path, Path]: ...

    def output_folder(self, cfg: TrainConfig) -> Path: ...

    def start_problems(self, problems: list[str], cfg: TrainConfig) -> list[str]: ...


class LocalHost:
    """Training as a process of this machine: its stdout read line by line, commands appended to the
    workspace's commands file, Stop's last resort the process group ended."""

    uses_local_gpus = True
    where = ""
    others_may_stop = False

    def __init__(self, python: str = sys.executable, cwd: str | Path | None = None, env: dict[str, str] | None = None):
        self.python = python
        self.cwd = cwd
        self.env = env
        self.commands_file: Path | None = None
        self.process: subprocess.Popen | None = None

    def prepare(self, cfg: TrainConfig) -> tuple[Path, LossFiles]:
        """Write the config the run uses and clear stale commands; returns the config's path and where the loss
        curves go. A `stop` left in the commands file by an earlier run would stop the new one at its first step,
        so the file is emptied before every start."""
        commands = self.absolute(RunPaths(cfg).commands_file)
        open_text_no_follow(commands, "w").close()  # emptied; a link there is refused (OSError), not emptied
        self.commands_file = commands
        config_path = commands.parent / "gui-config.json"
        save_config(cfg, config_path)
        # Until the trainer says its run id (an older trainer never does): the workspace's one file of before.
        return config_path, LossFiles(commands.parent / "gui-losses.csv", commands.parent / "gui-validation-losses.csv",
                                      commands.parent / "losses")

    def start(self, cfg: TrainConfig, visible_gpus: int, command: list[str] | None, resume: str | None,
              feed: queue.Queue) -> Begun:
        """Start training for `cfg` (`command` replaces the built command line: tests use a fake trainer)."""
        holder = workspace_in_use(self.absolute(RunPaths(cfg).workspace))
        if holder:
            raise RuntimeError(f"the workspace {cfg.general.workspace_dir} is in use by another run ({holder}). "
                               "Wait for it to finish or stop it, or choose another workspace folder.")
        cfg = run_config(cfg, visible_gpus)
        config_path, losses = self.prepare(cfg)
        command = command or build_command(cfg, config_path, visible_gpus, self.python, resume)
        env = dict(self.env if self.env is not None else os.environ)
        env["PYTHONUNBUFFERED"] = "1"  # event lines must arrive as they are printed
        env[EVENTS_VARIABLE] = "1"  # the run reports through event lines only when asked to
        # CUDA numbers GPUs fastest first, NVML (the GPU list, the usage view) by PCI bus: make CUDA
        # follow the bus too, so that "GPU 1" is the same card in the GUI and in training.
        env.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
        kwargs: dict[str, Any] = {}
        if os.name == "nt":
            kwargs["creationflags"] = subprocess.CREATE_NEW_PROCESS_GROUP
        else:
            kwargs["start_new_session"] = True  # its own process group: Stop can end all ranks
        self.process = subprocess.Popen(command, cwd=self.cwd, env=env, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
                                        encoding="utf-8", errors="replace", bufsize=1, **kwargs)
        threading.Thread(target=self._read, args=(self.process, feed), daemon=True, name="tandem-run-reader").start()
        return Begun("starting the training processes", "$ " + subprocess.list2cmdline(command), losses,
                     started=list(command), command=list(command), rank_gpus=rank_gpus(cfg, visible_gpus),
                     multi_process=is_multi_process(cfg, visible_gpus),
                     workspace=self.absolute(RunPaths(cfg).workspace))

    @staticmethod
    def _read(process: subprocess.Popen, out: queue.Queue) -> None:
        assert process.stdout is not None
        for line in process.stdout:
            out.put(parse_line(line))
        out.put(Exited(process.wait()))

    def send(self, command: str) -> str | None:
        """Append a command line for rank 0, which reads the file every step."""
        if self.commands_file is None:
            raise RuntimeError(f"no training is running to {command}")
        write_command(self.commands_file, command)
        return None

    def terminate(self) -> bool:
        """End the training process group now (all ranks, launcher included). Returns at once: a group
        still there 10 s after SIGTERM gets SIGKILL from a helper thread (the GUI's thread never waits)."""
        process = self.process
        if process is None or process.poll() is not None:
            return False
        if os.name == "nt":
            subprocess.Popen(["taskkill", "/T", "/F", "/PID", str(process.pid)], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
            return True
        try:
            os.killpg(process.pid, signal.SIGTERM)
        except ProcessLookupError:
            return True

        def kill_if_still_there() -> None:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

        threading.Thread(target=kill_if_still_there, daemon=True, name="tandem-run-kill").start()
        return True

    def shown(self, item: Started) -> None:
        """A local start is never made in the background."""

    def exited(self) -> None:
        """Nothing to look up: the workspace's files are here."""

    def absolute(self, path: Path) -> Path:
        """`path` as the training process (started in `cwd`) sees it."""
        return path if path.is_absolute() else (Path(self.cwd) if self.cwd else Path.cwd()) / path

    def backups_folder(self, cfg: TrainConfig) -> Path:
        """The folder of the workspace's backups, as the training process sees it."""
        return self.absolute(RunPaths(cfg).backups)

    def backup_choices(self, cfg: TrainConfig) -> list[BackupChoice]:
        """The workspace's backups, newest first, each marked when its run finished after it."""
        return backup_choices(self.backups_folder(cfg))

    def backup_present(self, choice: BackupChoice) -> bool:
        """Whether the backup `choice` names is still there to continue from."""
        return Path(choice.path).is_dir()

    def sample_folders(self, cfg: TrainConfig) -> tuple[Path, Path]:
        """The workspace's samples folder and the workspace, where the Run tab's gallery reads them."""
        paths = RunPaths(cfg)
        return self.absolute(paths.samples), self.absolute(paths.workspace)

    def output_folder(self, cfg: TrainConfig) -> Path:
        return self.absolute(RunPaths(cfg).output_dir)

    def start_problems(self, problems: list[str], cfg: TrainConfig) -> list[str]:
        """The config problems that stop a start here (all of them: the files must exist on this machine)."""
        return problems

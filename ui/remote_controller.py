"""A run on a remote machine, for the Run tab: the same `RunController` interface (state, poll, send, stop,
Continue), fed by the same `@tandem` event lines - read from the run's output file on the remote through
ssh instead of from a local process's stdout. No Tk in here.

Everything that talks to the remote runs on a worker thread and hands its result over a queue that `poll()`
(the GUI's thread) applies, so the window never waits on the network. What needs the user's answer while a
start is under way (a large upload) is put in `question`; the view asks and calls `answer()`.
Closing the window only `detach()`es: the run goes on there, and choosing the machine again (or reopening
Tandem) finds it through the remote's run registry and follows it from its first line, so the loss plot is
whole again.
"""
from __future__ import annotations

import queue
import sys
import threading
import webbrowser
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Callable

from modules.config import RunPaths, TrainConfig
from modules.remote.fetch import fetch_outputs, mirror_folder
from modules.remote.host import RemoteHost
from modules.remote.known_hosts import KnownHosts, ScannedKey, accept
from modules.remote.machine import RemoteMachine
from modules.remote.prepare import Report, SetupError
from modules.remote.remote_config import workspace_of
from modules.remote.runs import Follower, RunInfo, kill_run, list_runs, pick_run, remote_backups, send_command
from modules.remote.session import RemoteSession, StartRefused, host_keys
from modules.remote.ssh import SshError
from modules.remote.tunnel import Tunnel
from modules.util.run_protocol import command_problem

from .backup_choices import BackupChoice
from .events import LogLine, TrainingEvent, parse_line
from .external import Opened
from .loss_history import LossHistory
from .run_controller import RunController, RunState, _Exited, rank_gpus

CONNECTING = "connecting"
REMOTE_ERRORS = (SshError, SetupError, StartRefused, OSError, ValueError)


@dataclass(frozen=True)
class RemoteBackup:
    """A backup in the remote workspace, as the Run tab's list shows it (the `info` of a `BackupChoice`)."""
    step: int
    run_id: str
    path: PurePosixPath
    """Relative to the remote folder, where the run's `--resume` reads it."""
    written: float


@dataclass
class Question:
    text: str
    answer: bool | None = None
    event: threading.Event = field(default_factory=threading.Event)


@dataclass(frozen=True)
class _Result:
    """A background action's outcome for `poll()` to apply on the GUI thread."""
    kind: str
    value: Any = None


class RemoteRunController(RunController):
    uses_local_gpus = False

    def __init__(self, host: RemoteHost, known: KnownHosts | None = None, python: str = sys.executable,
                 stop_timeout_s: float = 120.0, session_factory: Callable[..., RemoteSession] = RemoteSession):
        super().__init__(python=python, stop_timeout_s=stop_timeout_s)
        self.host = host
        self.known = known or KnownHosts.default()
        self.machine = RemoteMachine(host, self.known)
        self.session = session_factory([host], self.known, progress=self._progress, confirm=self._confirm)
        self.report: Report | None = None
        """The last set-up check (its GPU count is what Start plans with)."""
        self.runs: list[RunInfo] = []
        self.run: RunInfo | None = None
        """The run shown (started here, or attached to)."""
        self.notice = ""
        """The last outcome of a background action in words (check, fetch, errors), for the view."""
        self.notice_error = False
        self.unknown_keys: list[ScannedKey] | None = None
        """Set when the machine's host key is not known yet: the view asks whether to trust these keys."""
        self.question: Question | None = None
        self.backups: list[BackupChoice] = []
        """The remote workspace's backups, newest first, as last looked up."""
        self.busy: str | None = None
        self.changes = 0
        """Counts the background results applied: the view redraws when it moves (Continue's backup)."""
        self.listed = 0
        """Counts the run listings received (the view attaches to a run still going after a fresh one)."""
        self._results: queue.Queue = queue.Queue()
        self._follower: Follower | None = None
        self._cfg_workspace: str | None = None
        self._listings_asked = 0
        self._listing_shown = 0
        """Which look-ups of runs and backups were asked for and which one is shown: a slower earlier one that
        answers last is dropped."""
        self._fetched_samples: set[str] = set()
        self._completed: bool | None = None
        self.tunnel = Tunnel(self.machine)

    # --- what the run view asks -------------------------------------------------------------------
    def visible_gpus(self) -> int:
        return self.report.gpu_count if self.report else 0

    def output_folder(self, cfg: TrainConfig) -> Path:
        return mirror_folder(cfg, self.host) / "output"

    def sample_folders(self, cfg: TrainConfig) -> tuple[Path, Path]:
        """The fetched copies: the remote workspace's files land under the mirror folder as they are there."""
        mirror = mirror_folder(cfg, self.host)
        return mirror / RunPaths(cfg).samples.relative_to(RunPaths(cfg).workspace), mirror

    def start_problems(self, problems: list[str], cfg: TrainConfig) -> list[str]:
        """A base model already on the remote need not exist here; the machine must have been checked (its GPUs
        decide what a start runs, as this machine's do for a local start)."""
        if self.host.base_model.strip():
            problems = [p for p in problems if "model.base_model" not in p and "Base model" not in p]
        if self.host.problems():
            return [*problems, *self.host.problems(), "then Check connection (Run tab, Run on)"]
        if self.report is None:
            why = self.notice if self.notice_error else "the check is under way"
            problems = [*problems, f"{self.host.label} has not been checked yet ({why}): press Check connection "
                                   "(Run tab, Run on) and Start when it answered"]
        return problems

    def backup_choices(self, cfg: TrainConfig) -> list[BackupChoice]:
        """The remote workspace's backups, newest first, as last looked up (never a network call here: the view
        asks at every redraw; `refresh` looks them up in the background)."""
        if self._cfg_workspace != workspace_of(cfg):
            self._cfg_workspace = workspace_of(cfg)
            self.backups = []
            self.refresh()
        return self.backups

    def backups_folder(self, cfg: TrainConfig) -> str:
        return f"{workspace_of(cfg)}/backups on {self.host.label}"

    def backup_present(self, choice: BackupChoice) -> bool:
        """Listed by the last look there; a backup deleted since makes the run's start fail with its path."""
        return any(c.path == choice.path for c in self.backups)

    # --- background actions ------------------------------------------------------------------------
    def _background(self, name: str, work: Callable[[], Any], kind: str) -> None:
        self.busy = name

        def body() -> None:
            try:
                self._results.put(_Result(kind, work()))
            except REMOTE_ERRORS as e:
                key_unknown = isinstance(e, SshError) and e.kind == "host_key_unknown"
                if key_unknown:
                    try:
                        self._results.put(_Result("unknown_keys", host_keys(self.machine)))
                        return
                    except Exception as scan_error:  # noqa: BLE001 - the scan's own failure is the message then
                        e = scan_error
                text = str(e)
                self._results.put(_Result("error", text if self.host.label in text else f"{self.host.label}: {text}"))
        threading.Thread(target=body, daemon=True, name=f"tandem-remote-{name}").start()

    def check(self) -> None:
        """The set-up check (result in `report`, or `unknown_keys`, or an error in `notice`)."""
        self._background("checking", lambda: self.session.check()[0], "report")

    def trust(self, keys: list[ScannedKey]) -> None:
        """The user accepted these host keys: remember them, then check again."""
        accept(self.known, keys)
        self.unknown_keys = None
        self.check()

    def refresh(self) -> None:
        """Look up the runs there and the newest backup of the current workspace."""
        workspace = self._cfg_workspace
        self._listings_asked += 1
        number = self._listings_asked

        def work():
            runs = list_runs(self.machine)
            backups = remote_backups(self.machine, workspace) if workspace else []
            return number, runs, backups
        self._background("listing runs", work, "runs")

    def _apply_result(self, result: _Result) -> None:
        self.changes += 1
        self.busy = None
        self.notice_error = result.kind == "error"
        if result.kind == "report":
            self.report = result.value
            self.notice = result.value.message()
        elif result.kind == "unknown_keys":
            self.unknown_keys = result.value
            self.notice = f"{self.host.label} is not known yet: accept its host key to connect"
        elif result.kind == "runs":
            number, runs, found = result.value
            if number < self._listing_shown:
                return  # an earlier look that answered after a later one: its backups may be gone or miss new ones
            self._listing_shown = number
            self.listed += 1
            self.runs = runs
            self.backups = [BackupChoice(RemoteBackup(b["step"], b["run_id"], PurePosixPath(b["path"]), b["written"]),
                                         b.get("finished_step")) for b in found]
        elif result.kind == "error":
            self.notice = str(result.value)
        elif result.kind == "notice":
            self.notice = str(result.value)

    # --- starting and following -------------------------------------------------------------------
    def start(self, cfg: TrainConfig, visible_gpus: int, command: list[str] | None = None,
              resume: str | None = None) -> list[str]:
        if self.state.active:
            raise RuntimeError("a training run is already active; stop it first")
        problems = self.host.problems()
        if problems:
            raise RuntimeError("; ".join(problems))
        self._begin(RunState(status="running", message=f"{CONNECTING} to {self.host.label}",
                             rank_gpus=rank_gpus(cfg, visible_gpus)), cfg.general.workspace_dir)
        name = Path(cfg.general.workspace_dir).name or "run"
        self._log(f"$ train on {self.host.label}" + (f" --resume {resume}" if resume else ""))

        def body() -> None:
            try:
                started = self.session.start(cfg, resume, name=name)
            except REMOTE_ERRORS as e:
                self._queue.put(LogLine(f"[remote] {e}"))
                self._queue.put(_Result("failed", str(e)))
                return
            self._queue.put(_Result("started", started.infos[0]))
            self._follow(started.infos[0])
        threading.Thread(target=body, daemon=True, name="tandem-remote-start").start()
        return ["train_remote", self.host.label]

    def attach(self, run: RunInfo, instead: bool = False) -> None:
        """Show a run that is (or was) on the machine, replayed from its first line; `instead`: stop following the
        run shown first (it goes on there)."""
        if self.state.active:
            if not instead:
                raise RuntimeError("a run is shown and still going; it must end (or be detached) first")
            if self._follower is not None:
                self._follower.close()
        self._begin(RunState(status="running", message=f"following {run.id} on {self.host.label}"),
                    run.local_workspace or ".")
        self.run = run
        threading.Thread(target=self._follow, args=(run,), daemon=True, name="tandem-remote-follow").start()

    def _begin(self, state: RunState, local_workspace: str) -> None:
        self.state = state
        self.log.clear()
        self.log_count = 0
        self._stop_deadline = None
        self._terminated = False
        self._queue = queue.Queue()
        self._fetched_samples = set()
        self._completed: bool | None = None
        self._local_workspace = Path(local_workspace).expanduser().resolve()
        for history in (self.history, self.validation_history):
            if history is not None:
                history.close()
        # The plot of a continued run goes on from the earlier run's points, as a local run's does.
        tandem = self._local_workspace / ".tandem"
        self.history = LossHistory(tandem / f"remote-{self.host.key}-losses.csv")
        self.validation_history = LossHistory(tandem / f"remote-{self.host.key}-validation-losses.csv")
        self.losses_folder = tandem / f"remote-{self.host.key}-losses"  # each run's own, once it says its id

    def _follow(self, run: RunInfo) -> None:
        """The follower thread: every line parsed into the queue, sample pictures fetched, outputs at the end."""
        out = self._queue
        follower = Follower(self.machine, run.id)
        self._follower = follower
        try:
            end = follower.follow(lambda line: out.put(self._localise(parse_line(line), run)),
                                  lambda note: out.put(LogLine(f"[remote] {note}")))
        except REMOTE_ERRORS as e:
            out.put(LogLine(f"[remote] {e}"))
            out.put(_Result("failed", f"following the run on {self.host.label} failed: {e}"))
            return
        if end is None:  # detached: the run goes on
            out.put(_Result("detached"))
            return
        if end.state == "lost":
            out.put(_Result("failed", f"the run's processes on {self.host.label} ended without an exit code (the "
                                      "machine restarted, or they were killed); its backups are still there"))
            return
        out.put(LogLine(f"[remote] the run ended on {self.host.label}; fetching its outputs"))
        try:
            fetched = fetch_outputs(self.machine, run.workspace, self._mirror(run))
            out.put(LogLine(f"[remote] fetched {fetched.files} file(s) into {fetched.folder}"))
        except REMOTE_ERRORS as e:
            out.put(LogLine(f"[remote] could not fetch the outputs: {e} (Fetch outputs tries again)"))
        out.put(_Exited(end.exit_code if end.exit_code is not None else 1))

    def _mirror(self, run: RunInfo) -> Path:
        return Path(run.local_workspace or self._local_workspace) / "remote" / self.host.key

    def _localise(self, item: TrainingEvent | LogLine, run: RunInfo) -> TrainingEvent | LogLine:
        """Remote paths in events become the fetched copies (samples) or `host:path` (models, backups)."""
        if not isinstance(item, TrainingEvent):
            return item
        if item.type == "sample":
            name = str(item.get("path", ""))
            local = self._mirror(run) / Path(name).relative_to(run.workspace) if name.startswith(run.workspace) else None
            if local is not None and not local.exists() and name not in self._fetched_samples:
                try:  # every sample new so far in one fetch: a replayed run's pictures come at once
                    fetch_outputs(self.machine, run.workspace, self._mirror(run))
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

    def poll(self, limit: int = 2000) -> list[TrainingEvent | LogLine]:
        while True:
            try:
                self._apply_result(self._results.get_nowait())
            except queue.Empty:
                break
        return super().poll(limit)

    def _control(self, item) -> bool:
        if isinstance(item, _Result):
            self._apply_run_result(item)
            return True
        if super()._control(item):
            self.refresh()  # after the exit: the backup Continue offers, and the run's state in the list
            return True
        return False

    def _where(self) -> str:
        return f" on {self.host.label}"

    def _apply(self, event: TrainingEvent) -> None:
        if event.type == "done":
            self._completed = bool(event.get("completed", True))
        super()._apply(event)

    def _finish(self, returncode: int) -> None:
        super()._finish(returncode)
        if self.state.status == "finished" and self._completed is False:
            self.state.status = "stopped"  # stopped from elsewhere: another desktop, train_remote.py --stop

    def _apply_run_result(self, result: _Result) -> None:
        if result.kind == "started":
            self.run = result.value
            self.state.message = f"started {self.run.id} on {self.host.label}"
            self._log(f"[remote] started {self.run.id} in {self.host.folder} on {self.host.label}")
            self.notice, self.notice_error = (f"{self.run.id} runs on {self.host.label}; closing this window leaves "
                                              "it running there, and reopening Tandem shows it again"), False
            self.refresh()  # the runs there now list it
        elif result.kind == "failed":
            self.state.status = "failed"
            self.state.message = ""
            self.state.error = str(result.value)
        elif result.kind == "detached":
            self.state.status = "idle"
            self.state.message = f"detached: the run goes on on {self.host.label}"

    # --- commands ---------------------------------------------------------------------------------
    def send(self, command: str) -> None:
        problem = command_problem(command)
        if problem:
            raise ValueError(problem)
        if not self.state.active or self.run is None:
            raise RuntimeError(f"no training is running to {command}")
        run_id = self.run.id
        self._log(f"[remote] {command} -> {self.host.label}")
        self.asked(command)
        self._background(f"sending {command}", lambda: send_command(self.machine, run_id, command) or
                         f"{command} sent to {run_id}", "notice")

    def terminate(self) -> None:
        """End the run's processes on the remote now."""
        if self.run is None or not self.state.active:
            return
        self._terminated = True
        run_id = self.run.id
        self._background("ending the run", lambda: kill_run(self.machine, run_id).describe(), "notice")

    def detach(self) -> None:
        """Stop following (the run goes on there) and close the TensorBoard tunnel."""
        if self._follower is not None:
            self._follower.close()
        self.tunnel.close()

    def fetch(self, cfg: TrainConfig) -> None:
        """Fetch the outputs of the run shown (or of the config's workspace) now."""
        run = self.run
        workspace = run.workspace if run else workspace_of(cfg)
        folder = self._mirror(run) if run else mirror_folder(cfg, self.host)

        def work() -> str:
            done = fetch_outputs(self.machine, workspace, folder)
            return f"fetched {done.files} new file(s) into {done.folder}"
        self._background("fetching", work, "notice")

    def choose_run(self, wanted: str | None, cfg: TrainConfig | None) -> RunInfo | None:
        return pick_run(self.runs, wanted, workspace_of(cfg) if cfg else None)

    # --- questions during a start ------------------------------------------------------------------
    def _progress(self, text: str) -> None:
        self._queue.put(LogLine(f"[remote] {text}"))
        self._queue.put(TrainingEvent("status", {"text": text}))

    def _confirm(self, text: str) -> bool:
        question = Question(text)
        self.question = question
        question.event.wait()
        self.question = None
        return bool(question.answer)

    def answer(self, yes: bool) -> None:
        question = self.question
        if question is not None:
            question.answer = yes
            question.event.set()


class RemoteTensorBoard:
    """The Run tab's TensorBoard button for a remote run: TensorBoard there, through an ssh tunnel; the tunnel
    opens on a worker thread and the browser follows when TensorBoard answers."""

    def __init__(self, controller: RemoteRunController, open_browser=webbrowser.open):
        self.controller = controller
        self.open_browser = open_browser
        self.url: str | None = None
        self.problem: str | None = None

    def open(self, _local_logdir, browser: bool = True) -> Opened:
        run = self.controller.run
        workspace = run.workspace if run else self.controller._cfg_workspace
        if not workspace:
            return Opened(False, "No remote run yet: start one (or choose one of the machine's runs) first")
        tunnel = self.controller.tunnel
        if tunnel.open_ and tunnel.url and tunnel.logdir == f"{workspace}/tensorboard":
            if browser:
                self.open_browser(tunnel.url)
            return Opened(True, f"TensorBoard: {tunnel.url} (through an ssh tunnel to {self.controller.host.label})")

        def work() -> None:
            try:
                self.url = tunnel.open(f"{workspace}/tensorboard")
                self.problem = None
                if browser:
                    self.open_browser(self.url)
            except REMOTE_ERRORS as e:
                self.problem = str(e)
        threading.Thread(target=work, daemon=True, name="tandem-remote-tensorboard").start()
        return Opened(True, f"Starting TensorBoard on {self.controller.host.label} through an ssh tunnel; the "
                            "browser opens when it answers (on 127.0.0.1 only)")

    def close(self) -> None:
        self.controller.tunnel.close()

"""A run on a remote machine, for the Run tab: one `RunController` with the remote's `RunHost` handed in
(ui/remote_run_host.py), so state, poll, send, stop and Continue are the local run's - fed by the same
`@tandem` event lines, read from the run's output file on the remote through ssh. What is the remote's own
lives here: the set-up check, its host keys, the listing of its runs and backups, attaching to a run, fetching
outputs, the TensorBoard tunnel. No Tk in here.

Everything that talks to the remote runs on a worker thread and hands its result to `poll()` (the GUI's
thread, `RunController.call_soon`), so the window never waits on the network. What needs the user's answer
while a start is under way (a large upload) is put in `question`; the view asks and calls `answer()`.
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
from pathlib import PurePosixPath
from typing import Any, Callable

from modules.config import TrainConfig
from modules.remote.fetch import fetch_outputs, mirror_folder
from modules.remote.host import RemoteHost
from modules.remote.known_hosts import KnownHosts, ScannedKey, accept
from modules.remote.machine import RemoteMachine
from modules.remote.prepare import Report
from modules.remote.remote_config import workspace_of
from modules.remote.runs import RunInfo, list_runs, pick_run, remote_backups
from modules.remote.session import RemoteSession, host_keys
from modules.remote.ssh import SshError
from modules.remote.tunnel import Tunnel

from .backup_choices import BackupChoice
from .external import Opened
from .remote_run_host import REMOTE_ERRORS, RemoteRunHost
from .run_controller import RunController


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
    def __init__(self, host: RemoteHost, known: KnownHosts | None = None, python: str = sys.executable,
                 stop_timeout_s: float = 120.0, session_factory: Callable[..., RemoteSession] = RemoteSession):
        self.host = host
        self.known = known or KnownHosts.default()
        self.remote = RemoteRunHost(host, self.known, session_factory, self)
        """The run's side of the machine (start, follow, commands, files), handed to `RunController`."""
        super().__init__(python=python, stop_timeout_s=stop_timeout_s, run_host=self.remote)
        self.report: Report | None = None
        """The last set-up check (its GPU count is what Start plans with)."""
        self.runs: list[RunInfo] = []
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
        self._cfg_workspace: str | None = None
        self._listings_asked = 0
        self._listing_shown = 0
        """Which look-ups of runs and backups were asked for and which one is shown: a slower earlier one that
        answers last is dropped."""
        self.tunnel = Tunnel(self.machine)

    @property
    def machine(self) -> RemoteMachine:
        """The machine every ssh call of this controller and its host goes to."""
        return self.remote.machine

    @machine.setter
    def machine(self, machine: RemoteMachine) -> None:
        self.remote.machine = machine

    @property
    def session(self) -> RemoteSession:
        return self.remote.session

    @property
    def run(self) -> RunInfo | None:
        """The run shown (started here, or attached to)."""
        return self.remote.run

    # --- what the run view and the host ask ---------------------------------------------------------
    def visible_gpus(self) -> int:
        return self.report.gpu_count if self.report else 0

    def active(self) -> bool:
        return self.state.active

    def backups_of(self, cfg: TrainConfig) -> list[BackupChoice]:
        """The remote workspace's backups, newest first, as last looked up (never a network call here: the view
        asks at every redraw; `refresh` looks them up in the background)."""
        if self._cfg_workspace != workspace_of(cfg):
            self._cfg_workspace = workspace_of(cfg)
            self.backups = []
            self.refresh()
        return self.backups

    # --- background actions ------------------------------------------------------------------------
    def background(self, name: str, work: Callable[[], Any], kind: str) -> None:
        """Run `work` on a worker thread; its result (or its error, in words) is applied at the next `poll()`."""
        self.busy = name

        def body() -> None:
            try:
                result = _Result(kind, work())
            except REMOTE_ERRORS as e:
                result = self._failure(e)
            self.call_soon(lambda: self._apply_result(result))
        threading.Thread(target=body, daemon=True, name=f"tandem-remote-{name}").start()

    def _failure(self, e: Exception) -> _Result:
        """A background action's error: the host keys to ask about when the machine is not known yet."""
        if isinstance(e, SshError) and e.kind == "host_key_unknown":
            try:
                return _Result("unknown_keys", host_keys(self.machine))
            except Exception as scan_error:  # noqa: BLE001 - the scan's own failure is the message then
                e = scan_error
        text = str(e)
        return _Result("error", text if self.host.label in text else f"{self.host.label}: {text}")

    def check(self) -> None:
        """The set-up check (result in `report`, or `unknown_keys`, or an error in `notice`)."""
        self.background("checking", lambda: self.session.check()[0], "report")

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
        self.background("listing runs", work, "runs")

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

    # --- the runs there -----------------------------------------------------------------------------
    def attach(self, run: RunInfo, instead: bool = False) -> None:
        """Show a run that is (or was) on the machine, replayed from its first line; `instead`: stop following the
        run shown first (it goes on there)."""
        if self.state.active and not instead:
            raise RuntimeError("a run is shown and still going; it must end (or be detached) first")
        feed: queue.Queue = queue.Queue()
        self.begin(self.remote.attach(run, feed, instead=self.state.active), feed)

    def run_started(self, run: RunInfo) -> None:
        """A start from this window took (the host follows it now)."""
        self.notice, self.notice_error = (f"{run.id} runs on {self.host.label}; closing this window leaves "
                                          "it running there, and reopening Tandem shows it again"), False
        self.refresh()  # the runs there now list it

    def run_exited(self) -> None:
        self.refresh()  # after the exit: the backup Continue offers, and the run's state in the list

    def detach(self) -> None:
        """Stop following (the run goes on there) and close the TensorBoard tunnel."""
        self.remote.detach()
        self.tunnel.close()

    def fetch(self, cfg: TrainConfig) -> None:
        """Fetch the outputs of the run shown (or of the config's workspace) now."""
        run = self.run
        workspace = run.workspace if run else workspace_of(cfg)
        folder = self.remote.mirror(run) if run else mirror_folder(cfg, self.host)

        def work() -> str:
            done = fetch_outputs(self.machine, workspace, folder)
            return f"fetched {done.files} new file(s) into {done.folder}"
        self.background("fetching", work, "notice")

    def choose_run(self, wanted: str | None, cfg: TrainConfig | None) -> RunInfo | None:
        return pick_run(self.runs, wanted, workspace_of(cfg) if cfg else None)

    # --- questions during a start ------------------------------------------------------------------
    def confirm(self, text: str) -> bool:
        """Ask the user (from the start's worker thread) and wait for the answer."""
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

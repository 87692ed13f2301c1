"""The Queue tab for a remote machine's queue: `QueueController`'s methods, each one call of
modules/queue/remote.py - the code `scripts/train_queue.py --host ...` runs - so the GUI and the shell queue on a
remote machine the same way. No Tk in here.

The queue and its runner live on that machine (`<remote folder>/queue/`); every read and change is one ssh call
running train_queue.py there. The Queue tab calls these off the Tk thread; every failure - the connection, a
refusal there, Tandem not installed yet - is one `RemoteQueueError` whose message is the line the tab shows.
"""
from __future__ import annotations

import json
from typing import Callable

from modules.config import ConfigError, TrainConfig
from modules.queue.remote import RemoteQueueError, add_job, answer, call, naming, words
from modules.queue.view import JobRow
from modules.remote.host import RemoteHost
from modules.remote.known_hosts import KnownHosts, ScanError
from modules.remote.machine import RemoteMachine
from modules.remote.prepare import SetupError
from modules.remote.session import RemoteSession, StartRefused
from modules.remote.ssh import SshError

from .queue_controller import QueueSnapshot

FAILURES = (SshError, SetupError, StartRefused, ScanError, ConfigError, OSError, ValueError)
LOG_LIMIT = 200_000


def refuse_large_upload(text: str) -> bool:
    """Without someone to ask, a large upload is not made."""
    raise RemoteQueueError(f"{text.strip().removesuffix('Upload now?').strip()} - not uploaded without your yes: "
                           "choose the machine in the Run tab's Run on (it asks), or queue from the shell with "
                           "scripts/train_queue.py --host ... add CONFIG --yes")


class RemoteQueueController:
    """One remote machine's queue. `confirm` asks the user about a large upload (from a worker thread, waiting
    for the answer): the Run tab's remote controller's, so the question comes as a remote start's does."""

    on_this_machine = False
    refresh_ms = 3000
    """An ssh login and a Python there per read: less often than this machine's queue."""

    def __init__(self, host: RemoteHost, known: KnownHosts | None = None,
                 confirm: Callable[[str], bool] = refuse_large_upload,
                 session_factory: Callable[..., RemoteSession] = RemoteSession):
        self.host = host
        self.known = known or KnownHosts.default()
        self.machine = RemoteMachine(host, self.known)
        self.confirm = confirm
        self.session_factory = session_factory

    @property
    def machine_name(self) -> str:
        return self.host.label

    # --- the calls ---------------------------------------------------------------------------------------------
    def _run(self, work: Callable[[], object]) -> object:
        problems = self.host.problems()
        if problems:
            raise RemoteQueueError("No machine to ask yet: " + "; ".join(problems) + " (Run tab, Run on)")
        try:
            return work()
        except RemoteQueueError:
            raise
        except FAILURES as e:
            # One line in the Queue tab's notice.
            raise RemoteQueueError(naming(self.host.label, " ".join(str(e).split()))) from None

    def _ask(self, verb: str, *args: str, as_json: bool = False) -> str:
        return self._run(lambda: answer(self.machine, call(self.machine, *words(verb, *args, as_json=as_json))))

    def _json(self, text: str) -> dict:
        try:
            found = json.loads(text)
            if not isinstance(found, dict):
                raise ValueError(text)
            return found
        except ValueError:
            raise RemoteQueueError(f"{self.host.label}: unexpected answer from its queue: {text[:200]!r}") from None

    # --- what the Queue tab and the Run tab's "Add to queue" do -------------------------------------------------
    def add(self, cfg: TrainConfig, name: str, visible_gpus: int = 0) -> str:
        """Queue `cfg` there with the GPUs its Multi-GPU settings ask for (the machine's own GPUs decide whether
        it fits: `visible_gpus` is this machine's, not used). Prepared as a remote start is: Tandem installed there
        at this version, the data and models it lacks uploaded."""
        session = self.session_factory([self.host], self.known, progress=lambda line: None, confirm=self.confirm)
        done = self._run(lambda: answer(self.machine, add_job(self.machine, session, cfg, None, name, name,
                                                              as_json=True)))
        job = self._json(done)
        return (f"Queued #{job.get('id')} {job.get('name')} on {self.host.label}: the Queue tab shows it; it starts "
                "there when its GPUs are free, whether this window (or this computer) is on or not.")

    def snapshot(self) -> QueueSnapshot:
        listed = self._json(self._ask("list", as_json=True))
        try:
            found = [JobRow.from_dict(job) for job in listed.get("jobs", [])]
        except (TypeError, AttributeError):  # rows of another Tandem version there
            raise RemoteQueueError(f"{self.host.label}: its queue answered in another form (another Tandem "
                                   "version there?): add a job from here to install this one") from None
        return QueueSnapshot(header=f"{self.host.label} · {listed.get('header') or listed.get('queue', '')}",
                             rows=found, paused=bool(listed.get("paused")),
                             runner_alive=bool(listed.get("runner_alive")),
                             waiting=any(row.state == "queued" for row in found))

    def cancel(self, job_id: int) -> str:
        return self._ask("cancel", str(job_id))

    def move(self, job_id: int, where: str) -> str:
        return self._ask("move", str(job_id), where)

    def pause(self, job_id: int | None = None) -> str:
        return self._ask("pause", *([str(job_id)] if job_id is not None else []))

    def resume(self, job_id: int | None = None) -> str:
        return self._ask("resume", *([str(job_id)] if job_id is not None else []))

    def run(self) -> str:
        return self._ask("run")

    def log_text(self, row: JobRow, limit: int = LOG_LIMIT) -> str:
        """The end of a job's log there (its current or last run)."""
        if not row.log:
            return f"#{row.id} {row.name} has not run yet."
        return self._ask("log", str(row.id), "--tail", str(limit))

"""The Queue tab: the jobs queued with "Add to queue" (or scripts/train_queue.py) - each one's status, GPUs,
progress and ETA - with buttons to reorder, pause, resume and cancel them, open a finished job's model and
read any job's log.

It shows the queue of the machine the Run tab's "Run on" chooses (`use`): this computer's
(ui/queue_controller.py) or a remote machine's (ui/remote_queue_controller.py), whose header names it. While the
tab is shown, what it shows is read off the Tk thread (`snapshot`) every second or few, and so are the logs; every button's change runs
off it too: the window never waits on the queue, and a remote machine that does not answer is one line in the
notice.
"""
from __future__ import annotations

from typing import Callable

import customtkinter as ctk

from ..external import open_folder
from ..queue_controller import QueueController, QueueSnapshot
from ..remote_queue_controller import RemoteQueueController
from .background import in_background
from .buttons import Button
from .fields import ERROR_COLOR
from .notice_line import NoticeLine
from .tooltip import Tooltip

REFRESH_MS = 1000
HEADERS = ("#", "Job", "Status", "GPUs", "Progress", "ETA", "")
STATUS_COLORS = {"failed": ERROR_COLOR, "done": ("#2f8f46", "#5cbf74"), "interrupted": ("#a06000", "#e0a040")}
TIPS = {
    "run": "Start the queue's runner if none is going (adding or resuming a job starts it too). It is a process of "
           "its own: it goes on when this window closes, and ends when no job is left to run.",
    "pause_queue": "No new job starts while the queue is paused; running jobs go on. Resume queue starts them again.",
    "up": "Move the job up the queue: queued jobs start in this order as their GPUs free up.",
    "pause": "Pause: a running job stops at its next step with a backup and later continues from it; a queued "
             "job waits. Resume puts it back in the queue at its place (an interrupted job continues from its "
             "newest backup).",
    "cancel": "Cancel: a queued job never starts; a running one stops at its next step.",
    "model": "Open the folder of the model the job saved.",
    "log": "Show the job's log below.",
}


class JobLine:
    """The widgets of one job's row."""

    def __init__(self, table: ctk.CTkFrame, view: QueueView, job_id: int):
        self.job_id = job_id
        self.labels = [ctk.CTkLabel(table, text="", anchor="w") for _ in range(4)]
        self.progress_cell = ctk.CTkFrame(table, fg_color="transparent")
        self.bar = ctk.CTkProgressBar(self.progress_cell, width=110)
        self.bar.set(0)
        self.bar.pack(side="left")
        self.progress = ctk.CTkLabel(self.progress_cell, text="", anchor="w", width=90)
        self.progress.pack(side="left", padx=(6, 0))
        self.eta = ctk.CTkLabel(table, text="", anchor="w")
        self.buttons = ctk.CTkFrame(table, fg_color="transparent")
        small = {"width": 28, "height": 24}
        self.up = Button(self.buttons, text="↑", command=lambda: view.act(lambda c: c.move(job_id, "up")), **small)
        self.down = Button(self.buttons, text="↓", command=lambda: view.act(lambda c: c.move(job_id, "down")), **small)
        self.pause = Button(self.buttons, text="Pause", width=70, height=24, command=lambda: view.pause_or_resume(job_id))
        self.cancel = Button(self.buttons, text="Cancel", width=64, height=24, fg_color="#b03a3a",
                             hover_color="#8c2e2e", command=lambda: view.act(lambda c: c.cancel(job_id)))
        self.model = Button(self.buttons, text="Open model", width=90, height=24, fg_color="gray40",
                            command=lambda: view.open_model(job_id))
        self.log = Button(self.buttons, text="Log", width=44, height=24, fg_color="gray40",
                          command=lambda: view.show_log(job_id))
        for button, tip in ((self.up, "up"), (self.down, "up"), (self.pause, "pause"), (self.cancel, "cancel"),
                            (self.model, "model"), (self.log, "log")):
            button.pack(side="left", padx=(0, 4))
            Tooltip(button, TIPS[tip])

    def cells(self) -> list:
        return [*self.labels, self.progress_cell, self.eta, self.buttons]

    def place(self, row: int) -> None:
        for column, cell in enumerate(self.cells()):
            cell.grid(row=row, column=column, sticky="w", padx=(6, 10), pady=2)

    def destroy(self) -> None:
        for cell in self.cells():
            cell.destroy()

    def show(self, row) -> None:
        texts = (str(row.id), row.name, row.status, row.gpus)
        for label, text in zip(self.labels, texts):
            if label.cget("text") != text:
                label.configure(text=text)
        self.labels[2].configure(text_color=STATUS_COLORS.get(row.state, ("gray10", "gray90")))
        self.bar.set(row.fraction)
        self.progress.configure(text=row.progress_text())
        self.eta.configure(text=row.eta_text())
        ended = row.state in ("done", "failed", "cancelled")
        resumable = row.state in ("paused", "interrupted")
        pausable = row.state in ("queued", "running") and row.status == row.state
        self.pause.configure(text="Resume" if resumable else "Pause",
                             state="normal" if resumable or pausable else "disabled")
        self.cancel.configure(state="disabled" if ended or row.status == "cancelling" else "normal")
        self.model.configure(state="normal" if row.output else "disabled")
        self.log.configure(state="normal" if row.log else "disabled")


class QueueView(ctk.CTkFrame):
    def __init__(self, master, controller: QueueController | RemoteQueueController, refresh_ms: int | None = None):
        super().__init__(master, fg_color="transparent")
        self.controller = controller
        self.refresh_ms = refresh_ms
        """None: as often as the controller asks (a remote one less often)."""
        self._reading_log = False
        self.snapshot = QueueSnapshot()
        self.lines: dict[int, JobLine] = {}
        self._reading = False
        self._log_job: int | None = None
        self._read_problem = ""

        top = ctk.CTkFrame(self, fg_color="transparent")
        top.pack(fill="x", padx=8, pady=(8, 2))
        self.run_button = Button(top, text="Run queue", width=100, fg_color="#2f8f46", hover_color="#256f37",
                                 command=self.run_queue)
        self.pause_queue_button = Button(top, text="Pause queue", width=110, command=self.pause_or_resume_queue)
        self.run_button.pack(side="left")
        self.pause_queue_button.pack(side="left", padx=(6, 0))
        Tooltip(self.run_button, TIPS["run"])
        Tooltip(self.pause_queue_button, TIPS["pause_queue"])
        self.header = ctk.CTkLabel(top, text="", anchor="w", text_color="gray60")
        self.header.pack(side="left", padx=10)
        self.notice = NoticeLine(self)
        self.notice.pack(fill="x", padx=8)
        self.notice.pack_forget()
        self.table = ctk.CTkScrollableFrame(self, height=260)
        self.table.pack(fill="both", expand=True, padx=8, pady=4)
        for column, text in enumerate(HEADERS):
            ctk.CTkLabel(self.table, text=text, anchor="w", font=ctk.CTkFont(weight="bold")).grid(
                row=0, column=column, sticky="w", padx=(6, 10))
        self.empty = ctk.CTkLabel(self.table, text="No job queued yet: \"Add to queue\" on the Run tab queues the "
                                                   "config open now.", anchor="w", text_color="gray60")
        self.log_title = ctk.CTkLabel(self, text="Log", anchor="w")
        self.log_title.pack(fill="x", padx=10)
        self.log = ctk.CTkTextbox(self, height=180, wrap="none", font=ctk.CTkFont(family="monospace", size=12))
        self.log.pack(fill="both", expand=True, padx=8, pady=(0, 8))
        master.bind("<Map>", lambda _event: self.refresh(), add="+")  # the tab is shown: read it now
        self.after(10, self._tick)

    # --- reading the queue ------------------------------------------------------------------------------------
    def _tick(self) -> None:
        if self.winfo_viewable():  # another tab shown: nothing is read (a remote queue's read is an ssh login)
            self.refresh()
        self.after(self.refresh_ms or getattr(self.controller, "refresh_ms", REFRESH_MS), self._tick)

    def use(self, controller: QueueController | RemoteQueueController) -> None:
        """Show another machine's queue (the Run tab's "Run on" changed); nothing of the one before stays."""
        if controller is self.controller:
            return
        self.controller = controller
        self._log_job = None
        self.show(QueueSnapshot(header=f"{controller.machine_name} · reading its queue..."))
        self.log_title.configure(text="Log")
        self.log.delete("1.0", "end")
        self.notice.pack_forget()
        self._reading = self._reading_log = False  # a read of the machine before is dropped when it answers
        self.refresh()

    def refresh(self) -> None:
        """Read the queue off the Tk thread and show it (one read at a time); a read that fails is one line in
        the notice."""
        if self._reading:
            return
        self._reading = True
        controller = self.controller

        def read():
            try:
                return controller.snapshot(), None
            except (KeyError, ValueError, RuntimeError, OSError) as e:
                return None, str(e)

        def shown(result) -> None:
            if controller is not self.controller:
                return  # the machine was switched meanwhile
            self._reading = False
            snapshot, problem = result
            if problem:
                self._read_problem = problem
                self.say(problem, error=True)
                return
            if self._read_problem and self.notice_text() == self._read_problem:
                self.notice.pack_forget()  # it answers again
            self.show(snapshot)
        in_background(self, read, shown, name="tandem-queue-read")

    def show(self, snapshot: QueueSnapshot) -> None:
        self.snapshot = snapshot
        self.header.configure(text=snapshot.header)
        self.pause_queue_button.configure(text="Resume queue" if snapshot.paused else "Pause queue")
        self.run_button.configure(state="disabled" if snapshot.runner_alive or not snapshot.waiting else "normal")
        wanted = [row.id for row in snapshot.rows]
        for job_id in [j for j in self.lines if j not in wanted]:
            self.lines.pop(job_id).destroy()
        for place, row in enumerate(snapshot.rows, start=1):
            line = self.lines.get(row.id)
            if line is None:
                line = self.lines[row.id] = JobLine(self.table, self, row.id)
            line.place(place)
            line.show(row)
        if snapshot.rows:
            self.empty.grid_forget()
        else:
            self.empty.grid(row=1, column=0, columnspan=len(HEADERS), sticky="w", padx=6, pady=6)
        if self._log_job is not None:
            self._fill_log(self._log_job, keep_place=True)

    def row(self, job_id: int):
        return next((r for r in self.snapshot.rows if r.id == job_id), None)

    def table_text(self) -> list[list[str]]:
        """The rows as shown (tests read them): #, job, status, GPUs, progress, ETA."""
        return [[label.cget("text") for label in self.lines[r.id].labels]
                + [self.lines[r.id].progress.cget("text"), self.lines[r.id].eta.cget("text")]
                for r in self.snapshot.rows if r.id in self.lines]

    # --- the buttons -------------------------------------------------------------------------------------------
    def act(self, change: Callable[[QueueController], object]) -> None:
        """Change the queue off the Tk thread; a refusal is shown, not raised."""
        def work():
            try:
                change(self.controller)
                return None
            except (KeyError, ValueError, RuntimeError) as e:
                return e.args[0] if isinstance(e, KeyError) and e.args else str(e)

        def done(problem) -> None:
            if problem:
                self.say(problem, error=True)
            self.refresh()
        in_background(self, work, done, name="tandem-queue-change")

    def pause_or_resume(self, job_id: int) -> None:
        row = self.row(job_id)
        if row is not None and row.state in ("paused", "interrupted"):
            self.act(lambda c: c.resume(job_id))
        else:
            self.act(lambda c: c.pause(job_id))

    def pause_or_resume_queue(self) -> None:
        if self.snapshot.paused:
            self.act(lambda c: c.resume())
        else:
            self.act(lambda c: c.pause())

    def run_queue(self) -> None:
        self.act(lambda c: c.run())

    def open_model(self, job_id: int) -> None:
        row = self.row(job_id)
        if row is None or not row.output:
            return
        if not self.controller.on_this_machine:
            self.say(f"The model is on {self.controller.machine_name}: {row.output}. To copy it here, choose its run "
                     "under \"Runs there\" on the Run tab, Show, then Fetch outputs.")
            return
        self.say(f"Opening {row.output} ...")
        in_background(self, lambda: open_folder(row.output), lambda opened: self.say(opened.message, not opened.ok),
                      name="tandem-open-folder")

    def show_log(self, job_id: int) -> None:
        self._log_job = job_id
        self._fill_log(job_id, keep_place=False)

    def _fill_log(self, job_id: int, keep_place: bool) -> None:
        """Read the job's log off the Tk thread (a remote one's through ssh) and show it (one read at a time)."""
        row = self.row(job_id)
        if row is None or self._reading_log:
            return
        self._reading_log = True
        controller = self.controller

        def read() -> str:
            try:
                return controller.log_text(row)
            except (ValueError, RuntimeError, OSError) as e:
                return f"The log of #{row.id} {row.name} cannot be read: {e}"

        def shown(text: str) -> None:
            self._reading_log = False
            if controller is not self.controller or self._log_job is None:
                return
            if self._log_job == job_id:
                self._show_log_text(row, text, keep_place)
            else:
                self._fill_log(self._log_job, keep_place=False)  # another job's Log was clicked meanwhile
        in_background(self, read, shown, name="tandem-queue-log")

    def _show_log_text(self, row, text: str, keep_place: bool) -> None:
        where = "" if self.controller.on_this_machine else f" on {self.controller.machine_name}"
        self.log_title.configure(text=f"Log of #{row.id} {row.name}" + (f" - {row.log}{where}" if row.log else ""))
        if self.log.get("1.0", "end-1c") == text:
            return
        at_end = self.log.yview()[1] >= 0.999
        self.log.delete("1.0", "end")
        self.log.insert("1.0", text)
        if at_end or not keep_place:
            self.log.see("end")

    def say(self, text: str, error: bool = False) -> None:
        self.notice.pack(fill="x", padx=8, after=self.header.master)
        self.notice.show(text, ERROR_COLOR if error else ("gray10", "gray90"))

    def notice_text(self) -> str:
        return self.notice.text() if self.notice.winfo_manager() else ""


"""The Run tab: start/stop and commands, the backup to continue, progress, loss plot, sample gallery, per-GPU
view, log.

Everything sits in one scrolling column, so a small window (or a low screen) reaches every part.
"""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Callable

import customtkinter as ctk

from modules.config import TrainConfig
from modules.config.run_paths import RunPaths
from modules.launch.backends import backend_problem

from ..backup_choices import backup_the_run_wrote
from ..events import format_duration
from ..external import Opened, TensorBoard, open_folder
from ..gpu_info import GpuUsage, UsageMonitor
from ..launch_command import start_check
from ..multi_gpu_summary import format_lr
from ..per_gpu import HEADERS, per_gpu_rows
from ..run_controller import RunController
from .background import in_background
from .backup_picker import BackupPicker
from .buttons import Button
from .fields import ERROR_COLOR, Binder
from .loss_plot import LossPlot
from .notice_line import NoticeLine
from .sample_gallery import SampleGallery
from .tooltip import Tooltip
from .wheel import chain_wheel_to_page

POLL_MS = 100
GPU_POLL_MS = 2000
LOG_KEEP_LINES = 5000
CANNOT_START = "Cannot start - fix these first:"

BUTTON_TIPS = {
    "start": "Check the config (every field, and that its files and folders exist), save it to "
             "<workspace>/.tandem/gui-config.json and start training in a separate process - one per GPU with "
             "Multi-GPU on. The exact command is the first line of the log.",
    "queue": "Check the config as Start does and add it to the queue of the machine chosen in Run on (the Queue tab) "
             "with the GPUs its Multi-GPU settings ask for: it starts there when they are free, in its own process, "
             "whether this window is open or not.",
    "continue": "Start as Start does, but continue from the backup picked below (its step is on the button): "
                "weights, optimizer, position in the data and random state as they were, and the loss plot goes "
                "on from there.",
    "stop": "Stop every rank at the same step. With 'Backup when stopped' on, a backup is written first, from "
            "which 'Continue from the newest backup' resumes. Processes still running 2 minutes later are ended.",
    "sample": "Render the sample prompts (Sampling tab) with the weights of the next step; training goes on.",
    "backup": "Write a training-state backup at the next step: weights, optimizer, position in the data and the "
              "random state of every rank, so a resumed run continues exactly.",
    "save": "Save the model as it is at the next step, as an extra output named with its step; training goes on.",
    "output": "Open the folder the trained model is written to (Backup & Save › Output folder) in the file "
              "manager. Its path is also shown here.",
    "tensorboard": "Start TensorBoard on this run's logs (loss, learning rate, images/s, samples) and open it in "
                   "the web browser. Its address is also shown here.",
}


class RunView(ctk.CTkScrollableFrame):
    def __init__(self, master, binder: Binder, controller: RunController,
                 visible_gpus: Callable[[], int], tensorboard: TensorBoard | None = None,
                 ask: Callable[[str, str], bool] | None = None, monitor: UsageMonitor | None = None,
                 queue_add: Callable[[TrainConfig], str] | None = None):
        super().__init__(master, fg_color="transparent")
        self.binder, self.controller, self.visible_gpus = binder, controller, visible_gpus
        self.ask = ask or (lambda title, text: True)
        self.queue_add = queue_add
        """Queues a config on the chosen machine's queue (ui/queue_controller.py, remote_queue_controller.py) and
        says so; raises `Refused` when the machine is too small, RemoteQueueError when a remote one says no."""
        self.tensorboard = tensorboard or TensorBoard(controller.python)
        self._shown_lines = 0
        self._shown_samples = 0
        self._last_status = None
        self._cannot_start = False
        self._offer_what_the_run_wrote = False
        self._usage: list[GpuUsage] = []
        self.grid_columnconfigure(0, weight=1)

        commands = ctk.CTkFrame(self, fg_color="transparent")
        commands.grid(row=0, column=0, columnspan=2, sticky="w", padx=8, pady=(8, 2))
        self.start_button = Button(commands, text="Start", width=90, fg_color="#2f8f46",
                                          hover_color="#256f37", command=self.start)
        self.queue_button = Button(commands, text="Add to queue", width=90, command=self.add_to_queue)
        self.continue_button = Button(commands, text="Continue from backup", width=160, fg_color="#2f6f8f",
                                             hover_color="#25586f", command=self.continue_run)
        self.stop_button = Button(commands, text="Stop", width=80, fg_color="#b03a3a",
                                         hover_color="#8c2e2e", command=self.stop)
        self.sample_button = Button(commands, text="Sample now", width=100,
                                           command=lambda: self.send("sample"))
        self.backup_button = Button(commands, text="Backup now", width=100,
                                           command=lambda: self.send("backup"))
        self.save_button = Button(commands, text="Save now", width=90,
                                         command=lambda: self.send("save"))
        self.backups = BackupPicker(self, on_pick=self._update_buttons)
        self.backups.grid(row=1, column=0, columnspan=2, sticky="w", padx=8, pady=(2, 2))
        places = ctk.CTkFrame(self, fg_color="transparent")
        places.grid(row=2, column=0, columnspan=2, sticky="we", padx=8, pady=(2, 2))
        places.grid_columnconfigure(2, weight=1)
        self.output_button = Button(places, text="Open output folder", width=140, fg_color="gray40",
                                           command=self.open_output_folder)
        self.tensorboard_button = Button(places, text="Open TensorBoard", width=140, fg_color="gray40",
                                                command=self.open_tensorboard)
        for col, (button, tip) in enumerate(((self.start_button, "start"), (self.continue_button, "continue"),
                                             (self.stop_button, "stop"),
                                             (self.sample_button, "sample"), (self.backup_button, "backup"),
                                             (self.save_button, "save"))):
            button.grid(row=0, column=col, padx=(0, 6))
            Tooltip(button, BUTTON_TIPS[tip])
        # Under Start, its alternative: the row beside it is full at the smallest window.
        self.queue_button.grid(row=1, column=0, padx=(0, 6), pady=(4, 0))
        Tooltip(self.queue_button, BUTTON_TIPS["queue"])
        if queue_add is None:
            self.queue_button.configure(state="disabled")
        for col, (button, tip) in enumerate(((self.output_button, "output"), (self.tensorboard_button, "tensorboard"))):
            button.grid(row=0, column=col, padx=(0, 6))
            Tooltip(button, BUTTON_TIPS[tip])
        # The folder or address just opened, or why it could not be: selectable, so it can be copied, and
        # wrapped under the buttons (an opener's message is long); the next action takes it away.
        self.notice = NoticeLine(places)
        self.notice.grid(row=1, column=0, columnspan=3, sticky="we", pady=(2, 0))
        self.notice.grid_remove()

        self.status = ctk.CTkLabel(self, text="Idle", anchor="w", font=ctk.CTkFont(size=14, weight="bold"))
        self.status.grid(row=3, column=0, columnspan=2, sticky="w", padx=10)
        self.progress = ctk.CTkProgressBar(self)
        self.progress.set(0)
        self.progress.grid(row=4, column=0, columnspan=2, sticky="we", padx=10, pady=4)
        self.progress_text = ctk.CTkLabel(self, text="", anchor="w")
        self.progress_text.grid(row=5, column=0, columnspan=2, sticky="w", padx=10)
        self.run_info = ctk.CTkLabel(self, text="", anchor="w", text_color="gray60")
        self.run_info.grid(row=6, column=0, columnspan=2, sticky="w", padx=10)
        self.error = ctk.CTkTextbox(self, height=120, text_color=ERROR_COLOR, wrap="word")
        self.error.grid(row=7, column=0, columnspan=2, sticky="we", padx=10, pady=4)
        self.error.grid_remove()

        self.loss_plot = LossPlot(self, width=300, height=220)
        self.loss_plot.grid(row=8, column=0, columnspan=2, sticky="nsew", padx=10, pady=6)
        self.gallery = SampleGallery(self, self._sample_folders)
        self.gallery.grid(row=9, column=0, columnspan=2, sticky="we", padx=10, pady=(2, 4))
        self._gallery_folders = self._sample_folders()

        self.per_gpu = ctk.CTkFrame(self, fg_color=("gray90", "gray17"))
        self.per_gpu.grid(row=10, column=0, columnspan=2, sticky="we", padx=10, pady=(2, 4))
        self.per_gpu.grid_remove()
        self.per_gpu_cells: list[list[ctk.CTkLabel]] = []

        self.log = ctk.CTkTextbox(self, height=200, wrap="none", font=ctk.CTkFont(family="monospace", size=12))
        self.log.grid(row=11, column=0, columnspan=2, sticky="nsew", padx=10, pady=(4, 10))
        for box in (self.log, self.error):
            chain_wheel_to_page(box, self)
        self.monitor = monitor or UsageMonitor()
        self.binder.on_change.append(lambda _path: self._recheck_cannot_start())
        self.binder.on_change.append(lambda _path: self._hide_notice())  # it was about what was before
        # Another workspace or config has other backups: Continue must never offer the previous one's.
        self.binder.on_change.append(lambda _path: self._update_buttons())
        self.binder.on_change.append(lambda _path: self._follow_workspace())
        self._update_buttons()
        self.after(POLL_MS, self._tick)
        if self.monitor.available:
            self.after(10, self._poll_gpus)

    # --- actions -----------------------------------------------------------------------------
    def start(self, resume: str | None = None) -> bool:
        """Start training with the current config (continuing the newest backup with `resume="latest"`),
        or say why it cannot start."""
        self._hide_notice()
        problems = self.controller.start_problems(self.binder.all_problems(check_paths=True), self.binder.model.cfg)
        machine = backend_problem(self.binder.model.cfg, self.visible_gpus())
        if machine:
            problems.append(machine)
        if problems:
            self._show_cannot_start(problems)
            return False
        visible = self.visible_gpus()
        check = start_check(self.binder.model.cfg, visible)
        if check.refuse:
            self._show_error("Cannot start: " + check.refuse)
            return False
        if check.ask and not self.ask("Train in one process?", check.ask):
            return False
        self._hide_error()
        self._reset_for_new_run()
        try:
            self.controller.start(self.binder.model.cfg, visible, resume=resume)
        except (OSError, RuntimeError) as e:
            self._show_error(f"Could not start training: {e}")
            return False
        self._render()
        return True

    def add_to_queue(self) -> bool:
        """Check the config as Start does, then queue it (off the Tk thread); the notice says where it went, or
        the error box why it was refused."""
        self._hide_notice()
        if self.queue_add is None:
            return False
        # The checks of a start on the machine "Run on" chose: a remote one queues on its own queue.
        problems = self.controller.start_problems(self.binder.all_problems(check_paths=True), self.binder.model.cfg)
        machine = backend_problem(self.binder.model.cfg, self.visible_gpus())
        if machine:
            problems.append(machine)
        if problems:
            self._show_cannot_start(problems)
            return False
        self._hide_error()
        self._show_notice(Opened(True, "Adding to the queue..."))  # a remote one's first checks and uploads
        cfg, queue_add = copy.deepcopy(self.binder.model.cfg), self.queue_add

        def work() -> tuple[bool, str]:
            try:
                return True, queue_add(cfg)
            except (OSError, ValueError, RuntimeError) as e:  # Refused: too many GPUs, with the fix; a remote's error
                return False, str(e)

        def done(result: tuple[bool, str]) -> None:
            ok, text = result
            if ok:
                self._show_notice(Opened(True, text))
            else:
                self._hide_notice()
                self._show_error(f"Not queued: {text}")
        in_background(self, work, done, name="tandem-queue-add")
        return True

    def stop(self) -> None:
        self._hide_notice()
        self.controller.stop()
        self._render()

    def send(self, command: str) -> None:
        """Sample, back up or save at the next step; the status says so at once (a sampling may come a minute later)."""
        self._hide_notice()
        self.controller.send(command)
        self._render()

    def continue_run(self) -> bool:
        """Start from the backup picked in the list - if it is still there; a finished run's only when asked."""
        self._hide_notice()
        backup = self.backups.picked
        if backup is None or not self.controller.backup_present(backup):
            self._update_buttons()
            folder = self.controller.backups_folder(self.binder.model.cfg)
            now = self.backups.picked
            self._show_error(f"There is no backup to continue in {folder} (it may have been deleted); "
                             "Start trains from the beginning." if now is None else
                             f"The backup at step {backup.step if backup else '?'} is gone; the list now offers "
                             f"step {now.step} of {now.info.run_id}.")
            return False
        if backup.finished and not self.ask(
                "Continue a finished run?",
                f"Run {backup.info.run_id} finished at step {backup.finished_step} after this backup was written, "
                "and its model was saved. Continuing trains only if Epochs or Max steps were raised since; "
                "otherwise it writes another copy of the model. Continue anyway?"):
            return False
        return self.start(resume=str(backup.path))

    def open_output_folder(self) -> None:
        """Open the output folder in the file manager; the notice says where, and whether it worked."""
        folder = self.controller.output_folder(self.binder.model.cfg)
        self._show_notice(Opened(True, f"Opening {folder.resolve()} ..."))
        in_background(self, lambda: open_folder(folder), self._show_notice, name="tandem-open-folder")

    def open_tensorboard(self) -> None:
        """Start TensorBoard on the run's logs (if needed) and show it in the browser."""
        self._show_notice(Opened(True, "Starting TensorBoard ..."))
        logs = RunPaths(self.binder.model.cfg).tensorboard
        in_background(self, lambda: self.tensorboard.open(logs), self._show_notice, name="tandem-tensorboard")

    def _show_notice(self, result: Opened) -> None:
        self.notice.grid()
        self.notice.show(result.message, ERROR_COLOR if not result.ok else ("gray10", "gray90"))

    def _hide_notice(self) -> None:
        self.notice.grid_remove()

    def use(self, controller: RunController, tensorboard, visible_gpus: Callable[[], int]) -> None:
        """Show another controller's run (this machine's, or a remote one's: ui/views/remote_frame.py)."""
        if controller is self.controller:
            return
        self.controller, self.tensorboard, self.visible_gpus = controller, tensorboard, visible_gpus
        self._reset_for_new_run()
        self._last_status = None
        self._hide_error()
        self._render()

    def redraw(self) -> None:
        """Show what changed outside the run's own events (a remote machine's newest backup was looked up)."""
        self._render()

    def notice_text(self) -> str:
        return self.notice.text() if self.notice.winfo_manager() else ""

    def _reset_for_new_run(self) -> None:
        """Nothing of the previous run may look like part of this one."""
        self.log.delete("1.0", "end")
        self._shown_lines = self._shown_samples = 0
        self.gallery.new_run()
        self.progress.set(0)
        self.progress_text.configure(text="")
        self.run_info.configure(text="")
        self._set_per_gpu_rows([])

    # --- following the run -------------------------------------------------------------------
    def _tick(self) -> None:
        try:
            if self.controller.poll() or self.controller.state.status != self._last_status:
                self._render()
        finally:
            self.after(POLL_MS, self._tick)

    def _render(self) -> None:
        s = self.controller.state
        ended = self._last_status in ("running", "stopping") and not s.active
        self._last_status = s.status
        self.status.configure(text=s.headline)
        self.progress.set(s.fraction)
        if s.total_steps:
            # An ended run shows the rate its user waited for, not the last steps' (a short run's last
            # report may come right after the one before it).
            rate = (f"{s.run_images_per_s:.2f} images/s over the whole run" if s.run_images_per_s is not None
                    else f"{s.images_per_s:.2f} images/s · ETA {format_duration(s.eta_s)}")
            self.progress_text.configure(
                text=f"Epoch {s.epoch}/{s.epochs} · step {s.step}/{s.total_steps} · {rate}"
                     + (f" · LR {s.lr:.3g}" if isinstance(s.lr, (int, float)) else ""))
        info = s.run_info
        if info:
            lr = f"LR {format_lr(info.get('base_lr', 0))}"
            if info.get("lr") != info.get("base_lr"):
                lr += f" -> {format_lr(info.get('lr', 0))}"
            left_out = info.get("items_left_out")
            left_out = f" · {left_out} items left out per epoch" if left_out else ""
            self.run_info.configure(text=f"World size {info.get('world_size')} · global batch "
                                         f"{info.get('global_batch')} · {info.get('steps_per_epoch')} "
                                         f"steps/epoch{left_out} · {lr}")
        if ended:
            self._offer_what_the_run_wrote = True  # Continue offers the backup the run wrote (a Stop's)
        self.loss_plot.set_points(s.losses, s.validation_losses)
        for sample in s.samples[self._shown_samples:]:
            self.gallery.add_live({**sample, "path": self.controller.absolute(Path(str(sample.get("path", ""))))})
        self._shown_samples = len(s.samples)
        if ended:
            self.gallery.refresh()  # what the run left on disk
        self._set_per_gpu_rows(per_gpu_rows(s, self._usage))
        lines = self.controller.new_log_lines(self._shown_lines)
        if lines:
            self._shown_lines = self.controller.log_count
            self.log.insert("end", "\n".join(lines) + "\n")
            excess = int(self.log.index("end-1c").split(".")[0]) - LOG_KEEP_LINES
            if excess > 0:
                self.log.delete("1.0", f"{excess + 1}.0")
            self.log.see("end")
        if s.status == "failed" and s.error:
            self._show_error(s.error)
        self._update_buttons()

    def _sample_folders(self) -> tuple[Path, Path]:
        return self.controller.sample_folders(self.binder.model.cfg)

    def _follow_workspace(self) -> None:
        """Another workspace has other runs: an ended run of the previous one is no longer shown (its status,
        plot, log and samples), and the gallery reads the new one's samples (only then: reading is not free).
        A run going on is shown until it ends."""
        if self.controller.state.active:
            return
        if not self.controller.shows_workspace(RunPaths(self.binder.model.cfg).workspace):
            self.controller.forget_run()
            self._reset_for_new_run()
            self._hide_error()
            self._render()
        folders = self._sample_folders()
        if folders != self._gallery_folders:
            self._gallery_folders = folders
            self.gallery.other_workspace()

    def _poll_gpus(self) -> None:
        try:
            self._usage = self.monitor.read() if self.controller.uses_local_gpus else []
            self._set_per_gpu_rows(per_gpu_rows(self.controller.state, self._usage))
        finally:
            self.after(GPU_POLL_MS, self._poll_gpus)

    def _set_per_gpu_rows(self, rows) -> None:
        """The per-GPU table: a header and one line per rank or GPU; hidden while there is nothing to show."""
        if not rows:
            self.per_gpu.grid_remove()
        else:
            self.per_gpu.grid()
        wanted = len(rows) + 1 if rows else 0
        if len(self.per_gpu_cells) != wanted:
            for line in self.per_gpu_cells:
                for cell in line:
                    cell.destroy()
            self.per_gpu_cells = []
            for r in range(wanted):
                font = ctk.CTkFont(weight="bold") if r == 0 else None
                line = [ctk.CTkLabel(self.per_gpu, text="", anchor="w", font=font) for _ in HEADERS]
                for c, cell in enumerate(line):
                    cell.grid(row=r, column=c, sticky="w", padx=(8, 12))
                self.per_gpu_cells.append(line)
            if wanted:
                for cell, text in zip(self.per_gpu_cells[0], HEADERS):
                    cell.configure(text=text)
        for line, row in zip(self.per_gpu_cells[1:], rows):
            for cell, text in zip(line, row.cells()):
                if cell.cget("text") != text:
                    cell.configure(text=text)

    def per_gpu_text(self) -> list[list[str]]:
        """The table as shown (tests read it)."""
        return [[cell.cget("text") for cell in line] for line in self.per_gpu_cells]

    def _update_buttons(self) -> None:
        running = self.controller.state.status == "running"
        active = self.controller.state.active
        self.start_button.configure(state="disabled" if active else "normal")
        # While a run goes on the list stays as it was (read again when it ends): no folder scans per step.
        choices = self.backups.choices if active else self.controller.backup_choices(self.binder.model.cfg)
        offer = None
        if self._offer_what_the_run_wrote and not active:
            self._offer_what_the_run_wrote = False
            self.backups.forget_pick()
            offer = backup_the_run_wrote(choices, self.controller.state.written_backups)
        self.backups.set_choices(choices, enabled=not active, offer=offer)
        picked = None if active else self.backups.picked
        self.continue_button.configure(state="normal" if picked else "disabled",
                                       text=f"Continue from step {picked.step}" if picked else "Continue from backup")
        for button in (self.stop_button, self.sample_button, self.backup_button, self.save_button):
            button.configure(state="normal" if running else "disabled")

    def _show_cannot_start(self, problems: list[str]) -> None:
        self._show_error(CANNOT_START + "\n" + "\n".join(f"• {p}" for p in problems))
        self._cannot_start = True

    def _recheck_cannot_start(self) -> None:
        """A "Cannot start" list follows the edits: fixed problems leave it, and it goes when none is left."""
        if not self._cannot_start:
            return
        problems = self.controller.start_problems(self.binder.all_problems(check_paths=True), self.binder.model.cfg)
        if problems:
            self._show_cannot_start(problems)
        else:
            self._hide_error()

    def _show_error(self, text: str) -> None:
        self._cannot_start = False
        self.error.grid()
        self.error.configure(state="normal")
        self.error.delete("1.0", "end")
        self.error.insert("1.0", text)
        self.error.configure(state="disabled")

    def _hide_error(self) -> None:
        self._cannot_start = False
        self.error.grid_remove()

    def error_text(self) -> str:
        return self.error.get("1.0", "end").strip() if self.error.winfo_manager() else ""

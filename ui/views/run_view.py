"""The Run tab: start/stop and commands, progress, loss plot, GPU use, latest sample, log."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import customtkinter as ctk
from PIL import Image, ImageOps

from modules.config.run_paths import RunPaths

from ..events import format_duration
from ..external import TensorBoard, open_folder
from ..gpu_info import UsageMonitor
from ..multi_gpu_summary import format_lr
from ..run_controller import RunController
from .fields import ERROR_COLOR, Binder
from .loss_plot import LossPlot

POLL_MS = 100
GPU_POLL_MS = 2000
LOG_KEEP_LINES = 5000
SAMPLE_PX = 240


class RunView(ctk.CTkFrame):
    def __init__(self, master, binder: Binder, controller: RunController,
                 visible_gpus: Callable[[], int], tensorboard: TensorBoard | None = None):
        super().__init__(master, fg_color="transparent")
        self.binder, self.controller, self.visible_gpus = binder, controller, visible_gpus
        self.tensorboard = tensorboard or TensorBoard(controller.python)
        self._shown_lines = 0
        self._shown_samples = 0
        self._last_status = None
        self.grid_columnconfigure(0, weight=1)

        buttons = ctk.CTkFrame(self, fg_color="transparent")
        buttons.grid(row=0, column=0, columnspan=2, sticky="w", padx=8, pady=(8, 4))
        self.start_button = ctk.CTkButton(buttons, text="Start", width=90, fg_color="#2f8f46",
                                          hover_color="#256f37", command=self.start)
        self.continue_button = ctk.CTkButton(buttons, text="Continue from backup", width=160, fg_color="#2f6f8f",
                                             hover_color="#25586f", command=lambda: self.start(resume="latest"))
        self.stop_button = ctk.CTkButton(buttons, text="Stop", width=80, fg_color="#b03a3a",
                                         hover_color="#8c2e2e", command=self.controller.stop)
        self.sample_button = ctk.CTkButton(buttons, text="Sample now", width=100,
                                           command=lambda: self.controller.send("sample"))
        self.backup_button = ctk.CTkButton(buttons, text="Backup now", width=100,
                                           command=lambda: self.controller.send("backup"))
        self.save_button = ctk.CTkButton(buttons, text="Save now", width=90,
                                         command=lambda: self.controller.send("save"))
        self.output_button = ctk.CTkButton(buttons, text="Open output folder", width=140, fg_color="gray40",
                                           command=lambda: open_folder(RunPaths(self.binder.model.cfg).output_dir))
        self.tensorboard_button = ctk.CTkButton(buttons, text="Open TensorBoard", width=140, fg_color="gray40",
                                                command=self.open_tensorboard)
        for col, button in enumerate((self.start_button, self.continue_button, self.stop_button, self.sample_button,
                                      self.backup_button, self.save_button, self.output_button,
                                      self.tensorboard_button)):
            button.grid(row=0, column=col, padx=(0, 6))

        self.status = ctk.CTkLabel(self, text="Idle", anchor="w", font=ctk.CTkFont(size=14, weight="bold"))
        self.status.grid(row=1, column=0, columnspan=2, sticky="w", padx=10)
        self.progress = ctk.CTkProgressBar(self)
        self.progress.set(0)
        self.progress.grid(row=2, column=0, columnspan=2, sticky="we", padx=10, pady=4)
        self.progress_text = ctk.CTkLabel(self, text="", anchor="w")
        self.progress_text.grid(row=3, column=0, columnspan=2, sticky="w", padx=10)
        self.run_info = ctk.CTkLabel(self, text="", anchor="w", text_color="gray60")
        self.run_info.grid(row=4, column=0, columnspan=2, sticky="w", padx=10)
        self.error = ctk.CTkTextbox(self, height=120, text_color=ERROR_COLOR, wrap="word")
        self.error.grid(row=5, column=0, columnspan=2, sticky="we", padx=10, pady=4)
        self.error.grid_remove()

        self.loss_plot = LossPlot(self, width=560, height=220)
        self.loss_plot.grid(row=6, column=0, sticky="nsew", padx=10, pady=6)
        side = ctk.CTkFrame(self, fg_color="transparent")
        side.grid(row=6, column=1, sticky="n", padx=10, pady=6)
        self.sample_image = ctk.CTkLabel(side, text="No sample yet", width=SAMPLE_PX, height=SAMPLE_PX,
                                         fg_color=("gray85", "gray20"), corner_radius=6)
        self.sample_image.grid(row=0, column=0)
        self.sample_caption = ctk.CTkLabel(side, text="", wraplength=SAMPLE_PX, justify="left")
        self.sample_caption.grid(row=1, column=0, sticky="w")
        self.gpu_usage = ctk.CTkLabel(side, text="", justify="left", anchor="w")
        self.gpu_usage.grid(row=2, column=0, sticky="w", pady=(6, 0))
        self.monitor = UsageMonitor()
        if not self.monitor.available:
            self.gpu_usage.grid_remove()

        self.log = ctk.CTkTextbox(self, height=200, wrap="none", font=ctk.CTkFont(family="monospace", size=12))
        self.log.grid(row=7, column=0, columnspan=2, sticky="nsew", padx=10, pady=(4, 10))
        self.grid_rowconfigure(7, weight=1)
        self._update_buttons()
        self.after(POLL_MS, self._tick)
        if self.monitor.available:
            self.after(GPU_POLL_MS, self._poll_gpus)

    # --- actions -----------------------------------------------------------------------------
    def start(self, resume: str | None = None) -> bool:
        """Start training with the current config (continuing the newest backup with `resume="latest"`),
        or list why it cannot start."""
        problems = self.binder.all_problems(check_paths=True)
        if problems:
            self._show_error("Cannot start - fix these first:\n" + "\n".join(f"• {p}" for p in problems))
            return False
        self._hide_error()
        self.log.delete("1.0", "end")
        self._shown_lines = self._shown_samples = 0
        try:
            self.controller.start(self.binder.model.cfg, self.visible_gpus(), resume=resume)
        except (OSError, RuntimeError) as e:
            self._show_error(f"Could not start training: {e}")
            return False
        self._render()
        return True

    def open_tensorboard(self) -> None:
        self.tensorboard.open(RunPaths(self.binder.model.cfg).tensorboard)

    # --- following the run -------------------------------------------------------------------
    def _tick(self) -> None:
        try:
            if self.controller.poll() or self.controller.state.status != self._last_status:
                self._render()
        finally:
            self.after(POLL_MS, self._tick)

    def _render(self) -> None:
        s = self.controller.state
        self._last_status = s.status
        self.status.configure(text=f"{s.status.capitalize()}" + (f" - {s.message}" if s.message else ""))
        self.progress.set(s.fraction)
        if s.total_steps:
            self.progress_text.configure(
                text=f"Epoch {s.epoch}/{s.epochs} · step {s.step}/{s.total_steps} · "
                     f"{s.images_per_s:.2f} images/s · ETA {format_duration(s.eta_s)}"
                     + (f" · LR {s.lr:.3g}" if isinstance(s.lr, (int, float)) else ""))
        info = s.run_info
        if info:
            lr = f"LR {format_lr(info.get('base_lr', 0))}"
            if info.get("lr") != info.get("base_lr"):
                lr += f" -> {format_lr(info.get('lr', 0))}"
            self.run_info.configure(text=f"World size {info.get('world_size')} · global batch "
                                         f"{info.get('global_batch')} · {info.get('steps_per_epoch')} "
                                         f"steps/epoch · {lr}")
        self.loss_plot.set_points(s.losses)
        if len(s.samples) > self._shown_samples:
            self._shown_samples = len(s.samples)
            self._show_sample(s.samples[-1])
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

    def _show_sample(self, sample: dict) -> None:
        path = Path(str(sample.get("path", "")))
        try:
            with Image.open(path) as img:
                img.load()
                picture = img.copy()
        except OSError as e:
            self.sample_caption.configure(text=f"Sample {path.name} could not be read: {e}")
            return
        # Fit the box both ways: the demo's 64 px samples are shown enlarged, large ones shrunk.
        picture = ImageOps.contain(picture, (SAMPLE_PX, SAMPLE_PX), Image.Resampling.NEAREST
                                   if max(picture.size) < SAMPLE_PX else Image.Resampling.LANCZOS)
        self._sample_ctk = ctk.CTkImage(light_image=picture, dark_image=picture, size=picture.size)
        self.sample_image.configure(image=self._sample_ctk, text="")
        self.sample_caption.configure(text=f"step {sample.get('step')}: {sample.get('prompt', '')}")

    def _poll_gpus(self) -> None:
        try:
            self.gpu_usage.configure(text="\n".join(u.label() for u in self.monitor.read()))
        finally:
            self.after(GPU_POLL_MS, self._poll_gpus)

    def _update_buttons(self) -> None:
        running = self.controller.state.status == "running"
        self.start_button.configure(state="disabled" if self.controller.state.active else "normal")
        newest = None if self.controller.state.active else self.controller.newest_backup(self.binder.model.cfg)
        self.continue_button.configure(state="normal" if newest else "disabled",
                                       text=f"Continue from step {newest.step}" if newest else "Continue from backup")
        for button in (self.stop_button, self.sample_button, self.backup_button, self.save_button):
            button.configure(state="normal" if running else "disabled")

    def _show_error(self, text: str) -> None:
        self.error.grid()
        self.error.configure(state="normal")
        self.error.delete("1.0", "end")
        self.error.insert("1.0", text)
        self.error.configure(state="disabled")

    def _hide_error(self) -> None:
        self.error.grid_remove()

    def error_text(self) -> str:
        return self.error.get("1.0", "end").strip() if self.error.winfo_manager() else ""

"""The multi-GPU settings: GPUs to use, strategy, backend, launcher, LR scaling, and the live summary and
memory lines."""
from __future__ import annotations

import copy
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import tkinter as tk
from pathlib import Path

import customtkinter as ctk

from modules.config import config_to_dict, save_config

from ..gpu_info import GpuInfo
from ..launch_command import REPO_ROOT
from ..multi_gpu_settings import (CPU_PROCESS_CHOICES, cpu_process_values, cpu_processes,
                                  gpu_selection_values, selected_gpus)
from ..multi_gpu_summary import memory_line, nodes_and_restarts_line, one_gpu_memory_line, summarize
from .buttons import Button, OptionMenu
from .fields import Binder
from .form import Form
from .tooltip import Tooltip

CHECK_SCRIPT = REPO_ROOT / "scripts" / "check_multi_gpu.py"


def using_cpu_processes(cfg) -> bool:
    return cpu_processes(cfg) != "off"


_ONE_ESTIMATE_AT_A_TIME = threading.Lock()
"""Estimates run on worker threads, one at a time: two importing diffusers' model classes together failed
("cannot import name 'UNet2DConditionModel' from 'diffusers'"), as could two building the built-in
model's folder."""


class MultiGPUFrame(ctk.CTkFrame):
    def __init__(self, master, binder: Binder, python: str = sys.executable):
        super().__init__(master)
        self.binder, self.python = binder, python
        self.gpus: list[GpuInfo] = []
        form = Form(self, binder, tab="Training")
        form.section("Multi-GPU")
        self.enable = form.field("multi_gpu.enabled")
        # The fields the controls below write without a bound widget of their own.
        for path in ("multi_gpu.device_indexes", "multi_gpu.num_gpus"):
            binder.places.add(path, "Training", "Multi-GPU GPU list")

        self.gpu_box = ctk.CTkFrame(self, fg_color="transparent")
        self.gpu_box.grid(row=form.row, column=0, columnspan=4, sticky="w", padx=10)
        form.row += 1
        self.all_var = tk.BooleanVar(self, True)
        self.gpu_vars: dict[int, tk.BooleanVar] = {}
        self.gpu_checks: list[ctk.CTkCheckBox] = []
        self.explanation = ctk.CTkLabel(self, text="Looking for GPUs...", anchor="w", justify="left",
                                        wraplength=560, text_color="gray60")
        self.explanation.grid(row=form.row, column=0, columnspan=4, sticky="w", padx=10)
        form.row += 1

        cpu_label = ctk.CTkLabel(self, text="CPU processes (for trying)", anchor="w")
        cpu_label.grid(row=form.row, column=0, sticky="w", padx=(10, 6), pady=3)
        Tooltip(cpu_label, lambda: binder.places.describe(
            "Run N processes on the CPU over GLOO: the multi-GPU code path, slowly, without GPUs. Sets "
            "general.device to cpu and the number of processes to N; off (or Multi-GPU off) sets the device "
            "back to what it was. Needs Multi-GPU on."))
        self._device_before_cpu: str | None = None
        """General › Device as it was before CPU processes set it to cpu (None: they did not)."""
        self.cpu_var = tk.StringVar(self, cpu_processes(binder.model.cfg))
        self.cpu_menu = OptionMenu(self, values=list(CPU_PROCESS_CHOICES), variable=self.cpu_var,
                                          width=100, command=self._cpu_chosen)
        self.cpu_menu.grid(row=form.row, column=1, sticky="w", padx=4)
        form.row += 1

        self.backend = form.field("multi_gpu.backend")
        self.data_loading = form.field("multi_gpu.distributed_data_loading")
        self.launcher = form.field("multi_gpu.launcher")
        self.strategy = form.field("multi_gpu.strategy")
        self.memory_limit = form.field("multi_gpu.memory_limit_gib", width=100)
        self.cpu_offload = form.field("multi_gpu.fsdp_cpu_offload")
        self.activation_offload = form.field("multi_gpu.activation_offload")
        self.layer_offload = form.field("multi_gpu.layer_offload", width=100)
        self.lr_scaling = form.field("multi_gpu.lr_scaling")
        self.batch_split = form.field("multi_gpu.batch_split", width=120)
        self.context_parallel = form.field("multi_gpu.context_parallel", width=100)
        self.port = form.field("multi_gpu.master_port", width=100)

        self.summary = ctk.CTkLabel(self, text="", anchor="w", font=ctk.CTkFont(weight="bold"))
        self.summary.grid(row=form.row, column=0, columnspan=4, sticky="w", padx=10, pady=(8, 2))
        Tooltip(self.summary, "What Start will run: the number of processes (one per GPU), the global batch "
                              "(batch size per GPU x gradient accumulation x processes: the images behind each "
                              "optimizer step) and the learning rate before and after multi-GPU scaling. The "
                              "trainer computes the same numbers and prints them when it starts.")
        form.row += 1
        self.memory = ctk.CTkLabel(self, text="", anchor="w", justify="left", wraplength=620)
        self.memory.grid(row=form.row, column=0, columnspan=4, sticky="w", padx=10, pady=(0, 4))
        Tooltip(self.memory, lambda: binder.places.describe(
            "The memory plan for the chosen GPUs (or multi_gpu.memory_limit_gib, when set): the fastest way to "
            "spread the model that fits every GPU - DDP, an fp8 base, FSDP, checkpointing, layer offload, "
            "offloading - its estimated peak per GPU and the fields it sets; or the smallest change that would "
            "fit. With Multi-GPU off, the plan of one process on the first GPU. The same plan as Check setup and "
            "the trainer's start."))
        self._memory_key: str | None = None
        form.row += 1
        self.check_button = Button(self, text="Check setup", width=120, command=self.check_setup)
        self.check_button.grid(row=form.row, column=0, sticky="w", padx=10, pady=6)
        Tooltip(self.check_button, "Run scripts/check_multi_gpu.py on this config: versions, the GPUs and how "
                                   "they connect (P2P), a real all-reduce between them, and the memory plan "
                                   "for these GPUs. Takes up to a few minutes; nothing is "
                                   "trained.")
        form.row += 1
        self.check_output = ctk.CTkTextbox(self, height=140, width=620, wrap="none")
        self.check_output.grid(row=form.row, column=0, columnspan=4, sticky="we", padx=10, pady=(0, 10))
        self.check_output.grid_remove()
        form.row += 1
        form.section("Restarts and several machines")
        for path in ("multi_gpu.max_restarts", "multi_gpu.nnodes", "multi_gpu.node_rank", "multi_gpu.min_gpus"):
            form.field(path, width=100)
        self.nodes_hint = ctk.CTkLabel(self, text="", anchor="w", justify="left", wraplength=560, text_color="gray60")
        self.nodes_hint.grid(row=form.row, column=0, columnspan=4, sticky="w", padx=10)
        form.row += 1
        form.section("Multi-GPU advanced")
        for path, label in (("multi_gpu.stall_seconds", "Stuck rank after (seconds)"),
                            ("multi_gpu.timeout_minutes", "Timeout (minutes)"),
                            ("multi_gpu.bucket_cap_mb", "DDP bucket size (MB)"),
                            ("multi_gpu.gradient_compression", "Gradient compression"),
                            ("multi_gpu.static_graph", "Static graph (DDP)"),
                            ("multi_gpu.find_unused_parameters", "Find unused parameters (DDP)"),
                            ("multi_gpu.gradient_as_bucket_view", "Gradients as bucket views (DDP)"),
                            ("multi_gpu.master_addr", "Rendezvous address")):
            form.field(path, label, width=140)
        binder.on_change.append(self._config_changed)
        self.detecting = True
        self._build_checks()
        self.sync()

    # --- GPUs --------------------------------------------------------------------------------
    def set_gpus(self, gpus: list[GpuInfo]) -> None:
        """Show the detected GPUs (called when detection finishes)."""
        self.detecting = False
        self.gpus = list(gpus)
        self._build_checks()
        self.sync()

    def _build_checks(self) -> None:
        for check in self.gpu_checks:
            check.destroy()
        self.gpu_vars.clear()
        self.gpu_checks = [ctk.CTkCheckBox(self.gpu_box, text="All GPUs", variable=self.all_var,
                                           command=self._all_toggled)]
        Tooltip(self.gpu_checks[0], "Train on every GPU this machine shows. Saved as \"every visible GPU\" "
                                    "(no list of numbers), so the config also works on a machine with another "
                                    "number of GPUs. Untick single GPUs below to leave them out.")
        for gpu in self.gpus:
            var = tk.BooleanVar(self, True)
            self.gpu_vars[gpu.index] = var
            self.gpu_checks.append(ctk.CTkCheckBox(self.gpu_box, text=gpu.label(), variable=var,
                                                   command=self._gpu_toggled))
        for row, check in enumerate(self.gpu_checks):
            check.grid(row=row, column=0, sticky="w", pady=2)

    def _visible(self) -> list[int]:
        return [g.index for g in self.gpus]

    def _all_toggled(self) -> None:
        chosen = self._visible() if self.all_var.get() else self._visible()[:1]
        self.binder.model.update(gpu_selection_values(chosen, self._visible()))

    def _gpu_toggled(self) -> None:
        chosen = [i for i, var in self.gpu_vars.items() if var.get()]
        if not chosen:  # an empty selection is not a run; keep the last GPU ticked
            self.sync()
            return
        self.binder.model.update(gpu_selection_values(chosen, self._visible()))

    def _cpu_chosen(self, choice: str) -> None:
        cfg = self.binder.model.cfg
        if choice != "off" and not using_cpu_processes(cfg):
            self._device_before_cpu = cfg.general.device
        values = cpu_process_values(choice)
        if choice == "off":
            values["general.device"] = self._device_before_cpu or values["general.device"]
            self._device_before_cpu = None
        self.binder.model.update(values)

    def _config_changed(self, path: str | None) -> None:
        cfg = self.binder.model.cfg
        if path is None:
            # Another config, or several fields at once (a choice here): a device remembered for CPU
            # processes belongs to the config it was chosen in.
            if not using_cpu_processes(cfg):
                self._device_before_cpu = None
        elif path == "multi_gpu.enabled" and not cfg.multi_gpu.enabled and self._device_before_cpu is not None:
            # Multi-GPU turned off: the CPU processes it ran go, and the device they set goes back.
            self._cpu_chosen("off")
            return  # that change comes back here and syncs
        self.sync()

    # --- keeping the controls in step with the config ---------------------------------------
    def sync(self) -> None:
        cfg = self.binder.model.cfg
        visible = self._visible()
        chosen = selected_gpus(cfg, visible)
        self.all_var.set(bool(visible) and sorted(chosen) == visible)
        for index, var in self.gpu_vars.items():
            var.set(index in chosen)
        self.cpu_var.set(cpu_processes(cfg))
        self.cpu_menu.configure(state="normal" if cfg.multi_gpu.enabled else "disabled")
        enough = len(visible) >= 2
        using_cpu = using_cpu_processes(cfg)
        for check in self.gpu_checks:
            check.configure(state="normal" if enough and cfg.multi_gpu.enabled and not using_cpu else "disabled")
        if self.detecting:
            self.explanation.configure(text="Looking for GPUs...")
        elif using_cpu:
            self.explanation.configure(text=f"CPU processes: General › Device is {cfg.general.device} while they "
                                            "are on; choosing off or turning Multi-GPU off sets it back.")
        elif not enough:
            found = "No GPU visible" if not visible else "1 GPU visible"
            self.explanation.configure(text=f"{found}: multi-GPU training needs 2 or more. Turn Multi-GPU on "
                                            "and choose CPU processes below to try the multi-process path.")
        else:
            self.explanation.configure(text="Untick GPUs to leave them out.")
        self.summary.configure(text=summarize(cfg, len(visible)).line() if cfg.multi_gpu.enabled
                               else "Multi-GPU off: one process. " + summarize(cfg, len(visible)).line())
        self.nodes_hint.configure(text=nodes_and_restarts_line(cfg) if cfg.multi_gpu.enabled else "")
        self._estimate_memory(cfg, chosen)

    def destroy(self) -> None:
        self._memory_key = None  # estimates still waiting for their turn are dropped
        super().destroy()

    def _estimate_memory(self, cfg, chosen: list[int]) -> None:
        """The memory line, estimated on a worker thread (building the shapes of a large model takes a
        moment) whenever the config or the GPUs change; the newest request wins. Multi-GPU off: the plan of one
        process for the first GPU (the one it trains on), where there is one and the device is not the CPU."""
        one_process = not cfg.multi_gpu.enabled
        if using_cpu_processes(cfg) or (one_process and (not self.gpus or cfg.general.device == "cpu")):
            self._memory_key = None
            self.memory.configure(text="")
            return
        if one_process:
            sizes, world = [self.gpus[0].memory_mib / 1024], 1
        else:
            sizes = [g.memory_mib / 1024 for g in self.gpus if g.index in chosen]
            world = summarize(cfg, len(self._visible())).world_size
        key = json.dumps([config_to_dict(cfg), world, sizes], sort_keys=True, default=str)
        if key == self._memory_key:
            return
        self._memory_key = key
        self.memory.configure(text="Memory per GPU: estimating...")
        cfg = copy.deepcopy(cfg)  # the worker reads its own copy while the form goes on editing
        result: list[str] = []

        def run() -> None:
            with _ONE_ESTIMATE_AT_A_TIME:
                if self._memory_key != key:
                    return  # replaced by a newer request (or the frame closed) while it waited its turn
                try:
                    result.append(one_gpu_memory_line(cfg, sizes[0]) if one_process else memory_line(cfg, world, sizes or None))
                except Exception as e:  # noqa: BLE001 - shown, never raised into Tk
                    result.append(f"Memory estimate failed: {e}")

        def wait() -> None:
            if self._memory_key != key:
                return  # a newer estimate replaced this one
            if result:  # the fields it names (a refusal's changes), by their tab and label
                self.memory.configure(text=self.binder.places.describe(result[0]))
            else:
                self.after(100, wait)

        threading.Thread(target=run, daemon=True, name="tandem-memory-estimate").start()
        self.after(100, wait)

    # --- Check setup -------------------------------------------------------------------------
    def check_setup(self) -> None:
        """Run the diagnostics script on the current config and show its report here."""
        config_file = Path(tempfile.mkdtemp(prefix="tandem-check-")) / "config.json"
        save_config(self.binder.model.cfg, config_file)
        command = [self.python, str(CHECK_SCRIPT), "--config-path", str(config_file)]
        self.check_button.configure(state="disabled", text="Checking...")
        self._show_check("$ " + subprocess.list2cmdline(command) + "\n")

        report: list[str] = []  # filled by the worker thread, read by this (the Tk) thread

        def run() -> None:
            try:
                result = subprocess.run(command, capture_output=True, text=True, timeout=300)
                text = result.stdout + result.stderr
                verdict = ("No problems found." if result.returncode == 0
                           else f"Problems found (exit code {result.returncode}).")
            except (OSError, subprocess.TimeoutExpired) as e:
                text, verdict = str(e), "The check could not run."
            finally:
                shutil.rmtree(config_file.parent, ignore_errors=True)
            report.append(text + "\n" + verdict)

        def wait() -> None:
            if report:
                self._check_done(report[0])
            else:
                self.after(200, wait)

        threading.Thread(target=run, daemon=True, name="tandem-check-setup").start()
        self.after(200, wait)

    def _check_done(self, text: str) -> None:
        self.check_button.configure(state="normal", text="Check setup")
        self._show_check(self.check_output.get("1.0", "end") + text)

    def _show_check(self, text: str) -> None:
        self.check_output.grid()
        self.check_output.delete("1.0", "end")
        self.check_output.insert("1.0", text)

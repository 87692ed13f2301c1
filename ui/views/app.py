"""The main window: the config bar (presets, Load, Save, Save as), the tabs, and closing."""
from __future__ import annotations

import sys
import threading
from typing import Callable

import customtkinter as ctk

from modules.config import ConfigError
from modules.config.presets import list_presets

from ..config_model import ConfigModel
from ..gpu_info import GpuInfo, detect_gpus
from ..run_controller import RunController
from ..settings import RecentConfigs, SavedRemotes
from .dialogs import Dialogs
from .fields import Binder
from .remote_frame import RemoteFrame
from .run_view import RunView
from .simple_tabs import build_data_tab, build_general_tab, build_model_tab, build_sampling_tab, build_save_tab
from .training_tab import build_training_tab

TABS = ("General", "Model", "Data", "Training", "Sampling", "Backup & Save", "Run")
MIN_SIZE = (760, 540)
"""Below this the config bar's buttons or the Run tab's first row would be cut off; every tab scrolls, so
everything else is reachable at this size."""
DEFAULT_PRESET = "#demo"
PRESET_PREFIX = "preset: "


class TandemApp(ctk.CTk):
    def __init__(self, recent: RecentConfigs | None = None,
                 gpu_probe: Callable[[], list[GpuInfo]] | None = None,
                 controller: RunController | None = None, dialogs: Dialogs | None = None,
                 python: str = sys.executable):
        super().__init__()
        self.geometry("1100x820")
        self.minsize(*MIN_SIZE)
        self.recent = recent or RecentConfigs()
        self.dialogs = dialogs or Dialogs()
        self.model = ConfigModel()
        self.binder = Binder(self.model)
        self.controller = controller or RunController(python=python)
        self.gpus: list[GpuInfo] = []

        self._build_top_bar()
        self.tabs = ctk.CTkTabview(self)
        self.tabs.pack(fill="both", expand=True, padx=8, pady=(0, 8))
        for name in TABS:
            self.tabs.add(name)
        build_general_tab(self.tabs.tab("General"), self.binder)
        build_model_tab(self.tabs.tab("Model"), self.binder)
        self.concepts = build_data_tab(self.tabs.tab("Data"), self.binder)
        self.multi_gpu = build_training_tab(self.tabs.tab("Training"), self.binder, python)
        self.prompts = build_sampling_tab(self.tabs.tab("Sampling"), self.binder)
        build_save_tab(self.tabs.tab("Backup & Save"), self.binder)
        self.run_view = RunView(self.tabs.tab("Run"), self.binder, self.controller, lambda: len(self.gpus),
                                ask=self.dialogs.ask_yes_no)
        self.remote = RemoteFrame(self.tabs.tab("Run"), self.run_view, self.binder, self.dialogs,
                                  SavedRemotes(self.recent.file.parent), self.controller, lambda: len(self.gpus))
        self.remote.pack(fill="x", padx=4, pady=(0, 4))
        self.run_view.pack(fill="both", expand=True)

        self.binder.on_change.append(lambda _path: self._update_title())
        self.protocol("WM_DELETE_WINDOW", self.close)
        self._restore()
        self._detect_gpus(gpu_probe or (lambda: detect_gpus(python)))

    # --- config bar ---------------------------------------------------------------------------
    def _build_top_bar(self) -> None:
        bar = ctk.CTkFrame(self, fg_color="transparent")
        bar.pack(fill="x", padx=8, pady=8)
        ctk.CTkLabel(bar, text="Config").pack(side="left", padx=(4, 6))
        self.config_menu = ctk.CTkOptionMenu(bar, values=self._config_choices(), width=320,
                                             command=self.choose_config, dynamic_resizing=False)
        self.config_menu.pack(side="left")
        self.load_button = ctk.CTkButton(bar, text="Load", width=80, command=self.load_dialog)
        self.save_button = ctk.CTkButton(bar, text="Save", width=80, command=self.save)
        self.save_as_button = ctk.CTkButton(bar, text="Save as", width=80, command=self.save_as)
        for button in (self.load_button, self.save_button, self.save_as_button):
            button.pack(side="left", padx=(6, 0))
        self.file_label = ctk.CTkLabel(bar, text="", text_color="gray60", anchor="w")
        self.file_label.pack(side="left", padx=10)

    def _config_choices(self) -> list[str]:
        return [PRESET_PREFIX + name for name in list_presets()] + self.recent.existing()

    def _refresh_choices(self) -> None:
        self.config_menu.configure(values=self._config_choices())

    def choose_config(self, choice: str) -> None:
        """Load a preset or a recent file picked in the menu."""
        self.load(choice[len(PRESET_PREFIX):] if choice.startswith(PRESET_PREFIX) else choice)

    # --- files --------------------------------------------------------------------------------
    def load(self, path_or_preset: str) -> bool:
        if not self._may_discard():
            self._show_current_choice()
            return False
        try:
            self.model.load_file(path_or_preset)
        except ConfigError as e:
            self.dialogs.show_error("Could not load config", str(e))
            self._show_current_choice()
            return False
        if self.model.path is not None:
            self.recent.remember(self.model.path)
            self._refresh_choices()
        else:
            self.recent.set_last(path_or_preset)
        self._show_current_choice()
        return True

    def load_dialog(self) -> None:
        path = self.dialogs.ask_open_path()
        if path:
            self.load(path)

    def save(self) -> bool:
        if self.model.path is None:
            return self.save_as()
        self.model.save()
        self.recent.remember(self.model.path)
        return True

    def save_as(self, path: str | None = None) -> bool:
        path = path or self.dialogs.ask_save_path(f"{self.model.source_name.lstrip('#')}.json")
        if not path:
            return False
        self.model.save(path)
        self.recent.remember(path)
        self._refresh_choices()
        self._show_current_choice()
        return True

    def _may_discard(self) -> bool:
        """Ask about unsaved changes; False when the user cancels."""
        if not self.model.dirty:
            return True
        answer = self.dialogs.ask_save_changes(self.model.source_name)
        if answer is None:
            return False
        return self.save() if answer else True

    def _show_current_choice(self) -> None:
        if self.model.path is not None:
            self.config_menu.set(str(self.model.path.resolve()))
        else:
            self.config_menu.set(PRESET_PREFIX + self.model.source_name)
        self._update_title()

    def _update_title(self) -> None:
        mark = " *" if self.model.dirty else ""
        self.title(f"Tandem - {self.model.source_name}{mark}")
        self.file_label.configure(text=str(self.model.path) if self.model.path else "preset (Save as to keep changes)")

    def _restore(self) -> None:
        """Open the config in use when the app was last closed, else the demo preset."""
        for candidate in (self.recent.last, DEFAULT_PRESET):
            if not candidate:
                continue
            try:
                self.model.load_file(candidate)
            except ConfigError:
                continue
            break
        self._show_current_choice()

    # --- GPUs ---------------------------------------------------------------------------------
    def _detect_gpus(self, probe: Callable[[], list[GpuInfo]]) -> None:
        # Tk may only be touched from this thread: the probe thread hands its answer over in a
        # list that this thread polls with after().
        found: list[list[GpuInfo]] = []
        threading.Thread(target=lambda: found.append(probe()), daemon=True, name="tandem-gpu-probe").start()

        def check() -> None:
            if found:
                self._gpus_found(found[0])
            else:
                self.after(100, check)

        self.after(50, check)

    def _gpus_found(self, gpus: list[GpuInfo]) -> None:
        self.gpus = gpus
        self.multi_gpu.set_gpus(gpus)

    # --- closing ------------------------------------------------------------------------------
    def close(self) -> None:
        if self.controller.state.active:
            if not self.dialogs.ask_yes_no("Training is running", "Stop training and quit?"):
                return
            self.controller.stop()
            if not self.controller.wait(30):
                self.controller.terminate()
        if not self._may_discard():
            return
        self.recent.set_last(str(self.model.path.resolve()) if self.model.path else self.model.source_name)
        self.remote.detach_all()  # remote runs go on there; reopening Tandem shows them again
        self.remote.local_tensorboard.close()
        self.destroy()

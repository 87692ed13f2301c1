"""The main window: the config bar (presets, Load, Save, Save as, Import), the tabs, and closing."""
from __future__ import annotations

import sys
import threading
import traceback
from pathlib import Path
from typing import Callable

import customtkinter as ctk

from modules.config import ConfigError
from modules.importing.config_import import import_config, import_error_line
from modules.config.presets import list_presets
from modules.queue.store import QueueStore

from ..config_model import ConfigModel
from ..queue_controller import QueueController
from ..remote_queue_controller import RemoteQueueController
from ..gpu_info import GpuInfo, detect_gpus
from ..run_controller import RunController
from ..settings import RecentConfigs, SavedRemotes
from .crash_bar import CrashBar
from .dialogs import Dialogs, start_folder
from .first_run_hint import FirstRunHint
from .fields import Binder
from .lora_tools_view import LoraToolsView
from .queue_view import QueueView
from .remote_frame import RemoteFrame
from .run_view import RunView
from .tooltip import Tooltip
from .simple_tabs import build_data_tab, build_general_tab, build_model_tab, build_sampling_tab, build_save_tab
from .training_tab import build_training_tab

TABS = ("General", "Model", "Data", "Training", "Sampling", "Backup & Save", "Run", "Queue", "Tools")
MIN_SIZE = (760, 540)
"""Below this the config bar's buttons or the Run tab's first row would be cut off; every tab scrolls, so
everything else is reachable at this size."""
DEFAULT_PRESET = "#demo"
PRESET_PREFIX = "preset: "


class TandemApp(ctk.CTk):
    def __init__(self, recent: RecentConfigs | None = None,
                 gpu_probe: Callable[[], list[GpuInfo]] | None = None,
                 controller: RunController | None = None, dialogs: Dialogs | None = None,
                 python: str = sys.executable, queue: QueueController | None = None):
        super().__init__()
        self.geometry("1100x820")
        self.minsize(*MIN_SIZE)
        self.recent = recent or RecentConfigs()
        self.dialogs = dialogs or Dialogs()
        self.model = ConfigModel()
        self.binder = Binder(self.model, self.dialogs)
        self.controller = controller or RunController(python=python)
        self.queue = queue or QueueController(QueueStore(self.recent.file.parent / "queue"))
        self.gpus: list[GpuInfo] = []
        self._closing = False
        self.closed = False
        """True once the window is gone (tests wait for it)."""

        self._build_top_bar()
        self.tabs = ctk.CTkTabview(self)
        self.tabs.pack(fill="both", expand=True, padx=8, pady=(0, 8))
        for name in TABS:
            self.tabs.add(name)
        self.hint = build_general_tab(self.tabs.tab("General"), self.binder, None if self.recent.hint_hidden else
                                      lambda master: FirstRunHint(master, self.try_demo, self.recent.hide_hint))
        self.model_picker = build_model_tab(self.tabs.tab("Model"), self.binder)
        self.concepts = build_data_tab(self.tabs.tab("Data"), self.binder, lambda: len(self.gpus))
        self.multi_gpu = build_training_tab(self.tabs.tab("Training"), self.binder, python)
        self.prompts = build_sampling_tab(self.tabs.tab("Sampling"), self.binder)
        build_save_tab(self.tabs.tab("Backup & Save"), self.binder)
        self.run_view = RunView(self.tabs.tab("Run"), self.binder, self.controller, lambda: len(self.gpus),
                                ask=self.dialogs.ask_yes_no,
                                queue_add=lambda cfg: self.queue_view.controller.add(
                                    cfg, self.model.source_name.lstrip("#"), len(self.gpus)))
        self.queue_view = QueueView(self.tabs.tab("Queue"), self.queue)  # the queue of the machine "Run on" chooses
        self.queue_view.pack(fill="both", expand=True)
        self.remote = RemoteFrame(self.tabs.tab("Run"), self.run_view, self.binder, self.dialogs,
                                  SavedRemotes(self.recent.file.parent), self.controller, lambda: len(self.gpus),
                                  on_machine=self._show_queue_of)
        self.remote.pack(fill="x", padx=4, pady=(0, 4))
        self.run_view.pack(fill="both", expand=True)
        self.lora_tools = LoraToolsView(self.tabs.tab("Tools"), self.dialogs)
        self.lora_tools.pack(fill="both", expand=True)
        self.crash_bar = CrashBar(self, below=self.tabs)

        self.binder.on_change.append(lambda _path: self._update_title())
        self.protocol("WM_DELETE_WINDOW", self.close)
        self._bind_select_all()
        self._restore()
        self._detect_gpus(gpu_probe or (lambda: detect_gpus(python)))

    def _show_queue_of(self, remote) -> None:
        """The Run tab's "Run on" chose this machine (None) or a remote (its run controller, whose large-upload
        question the Run tab asks): the Queue tab and "Add to queue" work on that machine's queue."""
        shown = self.queue_view.controller
        if remote is None:
            self.queue_view.use(self.queue)
        elif not (isinstance(shown, RemoteQueueController) and shown.confirm == remote.confirm):  # not this one's
            self.queue_view.use(RemoteQueueController(remote.host, remote.known, confirm=remote.confirm))

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
        self.import_button = ctk.CTkButton(bar, text="Import...", width=80, command=self.import_dialog)
        for button in (self.load_button, self.save_button, self.save_as_button, self.import_button):
            button.pack(side="left", padx=(6, 0))
        Tooltip(self.import_button, "Open a kohya_ss / sd-scripts (.toml, .json) or OneTrainer (.json) config: the "
                                    "settings Tandem has are filled in, and a message lists the ones it has not. "
                                    "Save as keeps the result.")
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
        if "model.base_model" in self.model.placeholders:
            self.tabs.set("Model")  # a real-model preset starts with choosing the model
        return True

    def _config_folder(self) -> str:
        """Where Load and Save as open: the current config file's folder, else the last one opened."""
        known = self.model.path or next(iter(self.recent.existing()), None)
        return start_folder(Path(known).parent if known else None)

    def try_demo(self) -> None:
        """The getting-started box's button: the demo preset, on the Run tab."""
        if self.load(DEFAULT_PRESET):
            self.tabs.set("Run")

    def load_dialog(self) -> None:
        path = self.dialogs.ask_open_path(self._config_folder())
        if path:
            self.load(path)

    def import_dialog(self) -> None:
        path = self.dialogs.ask_import_path()
        if path:
            self.import_file(path)

    def import_file(self, path: str) -> bool:
        """Load another trainer's config into the editor (unsaved: Save as writes it) and show what was not
        taken over."""
        if not self._may_discard():
            return False
        try:
            result = import_config(path)
            if result.unread and self.dialogs.ask_yes_no("Read the files it names?", result.unread_question()):
                result = import_config(path, **result.unread)  # the user named them now: read them too
            cfg = result.config()
        except ConfigError as e:
            self.dialogs.show_error("Could not import config", import_error_line(e))
            return False
        self.model.adopt(cfg, f"imported {Path(path).stem}")
        self._show_current_choice()
        self.config_menu.set(f"imported: {Path(path).name}")
        if self.model_picker.needed:
            self.tabs.set("Model")  # its base model is not here: the picker asks for one, as for a preset
        self.dialogs.show_info("Config imported", result.report())
        return True

    def save(self) -> bool:
        if self.model.path is None:
            return self.save_as()
        if not self._may_save_with_problems():
            return False
        self.model.save()
        self.recent.remember(self.model.path)
        return True

    def save_as(self, path: str | None = None) -> bool:
        if not self._may_save_with_problems():
            return False
        path = path or self.dialogs.ask_save_path(f"{self.model.source_name.lstrip('#')}.json", self._config_folder())
        if not path:
            return False
        self.model.save(path)
        self.recent.remember(path)
        self._refresh_choices()
        self._show_current_choice()
        return True

    def _may_save_with_problems(self) -> bool:
        """A config with problems is saved only when the user says so; text no field could take is not
        in the file, and the question says which."""
        problems = self.binder.all_problems(check_paths=False)
        if not problems:
            return True
        unread = [self.binder.places.name(path) or path for path in self.binder.type_errors]
        kept = ("\n\nNot saved (the file keeps the previous value): " + ", ".join(unread) + ".") if unread else ""
        listed = "\n".join(f"• {p}" for p in problems[:12]) + (f"\n• ... {len(problems) - 12} more"
                                                               if len(problems) > 12 else "")
        return self.dialogs.ask_yes_no("The config has problems",
                                       f"{listed}{kept}\n\nSave it anyway? Start refuses it until they are fixed.")

    def _may_discard(self) -> bool:
        """Ask about unsaved changes; False when the user cancels."""
        if not self.binder.dirty:
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
        mark = " *" if self.binder.dirty else ""
        self.title(f"Tandem - {self.model.source_name}{mark}")
        unsaved = "imported (Save as to keep it)" if self.model.source_name.startswith("imported ") else \
            "preset (Save as to keep changes)"
        self.file_label.configure(text=str(self.model.path) if self.model.path else unsaved)

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

    def _bind_select_all(self) -> None:
        """Ctrl+A selects a field's whole text, as everywhere else (Tk's own binding on X11 moves the
        cursor to the start of the line)."""
        def entry(event) -> str:
            event.widget.select_range(0, "end")
            event.widget.icursor("end")
            return "break"

        def text(event) -> str:
            event.widget.tag_add("sel", "1.0", "end-1c")
            return "break"

        for sequence in ("<Control-a>", "<Control-A>"):
            self.bind_class("Entry", sequence, entry)
            self.bind_class("Text", sequence, text)

    # --- errors inside the window ---------------------------------------------------------------
    def report_callback_exception(self, exc, value, tb) -> None:
        """Tk's hook for an exception in a callback: shown in the window, not only on the terminal."""
        traceback.print_exception(exc, value, tb)
        try:
            self.crash_bar.show(exc, value, tb)
        except Exception:  # noqa: BLE001 - the window itself is going; the terminal has it
            pass

    def crash_text(self) -> str:
        """The errors the crash bar shows ("" when hidden)."""
        return self.crash_bar.text()

    @property
    def crash_dismiss(self) -> ctk.CTkButton:
        return self.crash_bar.dismiss

    # --- closing ------------------------------------------------------------------------------
    def close(self) -> None:
        """Ask about unsaved changes first (Cancel keeps everything as it is), then whether to stop a run;
        a stopping run is waited for with after(), never on the Tk thread, so the window stays alive."""
        if self._closing:
            return
        if not self._may_discard():
            return
        if self.controller.state.active:
            if not self.dialogs.ask_yes_no("Training is running",
                                           "Stop training and quit? Every rank stops after its current step "
                                           "(with a backup if 'Backup when stopped' is on); the window closes "
                                           "once they have."):
                return
            self._closing = True
            self.controller.stop()
            self.title(f"Tandem - {self.model.source_name} - closing when training has stopped")
            self._close_when_stopped()
            return
        self._close_now()

    def _close_when_stopped(self) -> None:
        # The Run tab polls the run; a run that ignores stop is ended by the controller after its timeout.
        if self.controller.state.active:
            self.after(200, self._close_when_stopped)
        else:
            self._close_now()

    def _close_now(self) -> None:
        self.recent.set_last(str(self.model.path.resolve()) if self.model.path else self.model.source_name)
        self.remote.detach_all()  # remote runs go on there; reopening Tandem shows them again
        self.remote.local_tensorboard.close()
        self.closed = True
        self.destroy()

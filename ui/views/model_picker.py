"""The Model tab's prompt to choose the base model, shown while the config has none (a real-model preset
just picked: its example path is left empty rather than pointing at a file that is not there) or names one
that is not on this machine (an imported config's, kept in the field so that the user sees what it named)."""
from __future__ import annotations

import customtkinter as ctk

from modules.families.registry import FAMILIES

from .dialogs import start_folder
from .fields import Binder
from .tooltip import Tooltip

HINT_COLOR = ("#e6f0fa", "#1f3040")


class ModelPicker(ctk.CTkFrame):
    def __init__(self, master, binder: Binder):
        super().__init__(master, fg_color=HINT_COLOR, corner_radius=8)
        self.binder = binder
        self.grid_columnconfigure(2, weight=1)  # the buttons side by side at the left, the space after them
        self.text = ctk.CTkLabel(self, text="", anchor="w", justify="left", wraplength=640)
        self.text.grid(row=0, column=0, columnspan=3, sticky="w", padx=12, pady=(10, 4))
        self.file_button = ctk.CTkButton(self, text="Choose a model file...", width=170,
                                         command=lambda: self.choose("file"))
        self.file_button.grid(row=1, column=0, sticky="w", padx=(12, 6), pady=(0, 10))
        self.folder_button = ctk.CTkButton(self, text="Choose a diffusers folder...", width=190,
                                           command=lambda: self.choose("folder"))
        self.folder_button.grid(row=1, column=1, sticky="w", padx=6, pady=(0, 10))
        Tooltip(self.file_button, "A single .safetensors or .ckpt checkpoint of the model (as shared on model sites).")
        Tooltip(self.folder_button, "A folder in diffusers layout (model_index.json and one folder per part), as "
                                    "downloaded from Hugging Face.")
        binder.on_change.append(lambda _path: self.sync())
        self.sync()

    @property
    def needed(self) -> bool:
        """While the base model is empty, or is the one an imported config named that is not on this machine."""
        base = self.binder.model.cfg.model.base_model.strip()
        return not base or base == self.binder.model.missing_base_model

    def sync(self) -> None:
        """Shown while `needed`, naming the family the config trains (and the missing model, if one is named)."""
        if not self.needed:
            self.grid_remove()
            return
        family = FAMILIES.get(self.binder.model.cfg.model.model_type)
        what = f"a {family.title} model" if family else "the model to train"
        missing = self.binder.model.missing_base_model
        first = (f"The base model this config names, {missing}, is not on this machine. Choose {what} here"
                 if missing else f"Choose the base model: {what}")
        self.text.configure(text=f"{first}, as one .safetensors/.ckpt file or a diffusers folder. Nothing is "
                                 "downloaded: the file or folder must be on this machine.")
        self.grid()

    def choose(self, kind: str) -> None:
        dialogs, title = self.binder.dialogs, "Base model"
        start = start_folder(None)
        chosen = dialogs.ask_file(title, start) if kind == "file" else dialogs.ask_folder(title, start)
        if chosen:
            self.binder.fields["model.base_model"].var.set(chosen)

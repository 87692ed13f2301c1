"""The General tab's getting-started box: what to do first - try the demo, or pick a model and a dataset.

Shown until the user hides it (remembered in the settings file, ui/settings.py)."""
from __future__ import annotations

from typing import Callable

import customtkinter as ctk

from .model_picker import HINT_COLOR
from .tooltip import Tooltip

TEXT = ("Getting started\n"
        "1. Try the demo first: it trains a tiny built-in model on pictures it makes itself, on the CPU in a few "
        "minutes, with nothing to download - Try the demo opens it on the Run tab; press Start there.\n"
        "2. Then your own: pick the preset for your model in the Config menu above (sd15_lora, sdxl_lora, "
        "flux_lora, ...), choose the model file or folder (Model tab), add the folder of your images with "
        "Add concept folder (Data tab; a caption .txt beside each image), and press Start on the Run tab.\n"
        "Every field explains itself when the mouse rests on it.")


class FirstRunHint(ctk.CTkFrame):
    def __init__(self, master, try_demo: Callable[[], None], hide: Callable[[], None]):
        super().__init__(master, fg_color=HINT_COLOR, corner_radius=8)
        self.grid_columnconfigure(0, weight=1)
        self.text = ctk.CTkLabel(self, text=TEXT, anchor="w", justify="left", wraplength=680)
        self.text.grid(row=0, column=0, columnspan=3, sticky="w", padx=12, pady=(10, 4))
        self.demo_button = ctk.CTkButton(self, text="Try the demo", width=130, command=try_demo)
        self.demo_button.grid(row=1, column=0, sticky="w", padx=12, pady=(0, 10))
        Tooltip(self.demo_button, "Open the #demo preset and go to the Run tab (asks first if the config open now "
                                  "has unsaved changes).")
        self.hide_button = ctk.CTkButton(self, text="Hide", width=70, fg_color="gray40", command=self._hide)
        self.hide_button.grid(row=1, column=2, sticky="e", padx=12, pady=(0, 10))
        Tooltip(self.hide_button, "Hide this box; it stays hidden in later sessions.")
        self._on_hide = hide

    def _hide(self) -> None:
        self.grid_remove()
        self._on_hide()

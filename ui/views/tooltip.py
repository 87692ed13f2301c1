"""Hover tooltips. The text of a field's tooltip is its docstring in `TrainConfig`."""
from __future__ import annotations

import tkinter as tk

DELAY_MS = 500
WRAP_PX = 420


class Tooltip:
    def __init__(self, widget: tk.Misc, text: str):
        self.widget = widget
        self.text = text
        self._window: tk.Toplevel | None = None
        self._pending: str | None = None
        widget.bind("<Enter>", self._schedule, add="+")
        widget.bind("<Leave>", self.hide, add="+")
        widget.bind("<ButtonPress>", self.hide, add="+")

    def _schedule(self, _event=None) -> None:
        self._cancel()
        self._pending = self.widget.after(DELAY_MS, self.show)

    def _cancel(self) -> None:
        if self._pending is not None:
            self.widget.after_cancel(self._pending)
            self._pending = None

    def show(self) -> None:
        if self._window is not None or not self.text:
            return
        x = self.widget.winfo_rootx() + 16
        y = self.widget.winfo_rooty() + self.widget.winfo_height() + 4
        self._window = window = tk.Toplevel(self.widget)
        window.wm_overrideredirect(True)
        window.wm_geometry(f"+{x}+{y}")
        tk.Label(window, text=self.text, justify="left", wraplength=WRAP_PX, background="#fdf6d8",
                 foreground="#222", relief="solid", borderwidth=1, padx=6, pady=4).pack()

    def hide(self, _event=None) -> None:
        self._cancel()
        if self._window is not None:
            self._window.destroy()
            self._window = None

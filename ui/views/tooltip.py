"""Hover tooltips. The text of a field's tooltip is its docstring in `TrainConfig`."""
from __future__ import annotations

import tkinter as tk
from typing import Callable

from ..binding import plain_text

DELAY_MS = 500
WRAP_PX = 420


_BY_WIDGET: dict[str, "Tooltip"] = {}


class Tooltip:
    """`text` may be a function, asked each time the tooltip shows (a field's text names its state)."""

    def __init__(self, widget: tk.Misc, text: str | Callable[[], str]):
        self.widget = widget
        self._text = text
        self._window: tk.Toplevel | None = None
        self._pending: str | None = None
        widget.bind("<Enter>", self._schedule, add="+")
        widget.bind("<Leave>", self.hide, add="+")
        widget.bind("<ButtonPress>", self.hide, add="+")
        _BY_WIDGET[str(widget)] = self
        widget.bind("<Destroy>", lambda _e: _BY_WIDGET.pop(str(widget), None), add="+")

    @property
    def text(self) -> str:
        return plain_text(self._text() if callable(self._text) else self._text)

    @staticmethod
    def of(widget: tk.Misc) -> "Tooltip | None":
        """The tooltip attached to `widget` (tests look them up this way)."""
        return _BY_WIDGET.get(str(widget))

    @staticmethod
    def _by_widget() -> dict[str, "Tooltip"]:
        return dict(_BY_WIDGET)

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

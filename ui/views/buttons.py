"""Buttons that look disabled when they are: CTkButton greys only its text, so a disabled green Start or
red Stop still looked ready to click."""
from __future__ import annotations

import customtkinter as ctk

DISABLED_COLOR = ("gray80", "gray28")
DISABLED_TEXT = ("gray50", "gray55")
"""Readable on DISABLED_COLOR (customtkinter's own disabled text nearly vanishes on a grey button)."""


class Button(ctk.CTkButton):
    def __init__(self, *args, **kwargs):
        kwargs.setdefault("text_color_disabled", DISABLED_TEXT)
        super().__init__(*args, **kwargs)
        self._enabled_color = self._fg_color
        self._show_state()

    def configure(self, require_redraw=False, **kwargs):
        if "fg_color" in kwargs:
            self._enabled_color = kwargs.pop("fg_color")
        super().configure(require_redraw, **kwargs)
        self._show_state()

    def _show_state(self) -> None:
        wanted = DISABLED_COLOR if self._state == "disabled" else self._enabled_color
        if self._fg_color != wanted:
            super().configure(fg_color=wanted)

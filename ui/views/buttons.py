"""Buttons and menus that look disabled when they are: customtkinter greys only their text, so a disabled
green Start or red Stop still looked ready to click."""
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


class OptionMenu(ctk.CTkOptionMenu):
    """A CTkOptionMenu that looks disabled when it is (customtkinter greys only its text)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("text_color_disabled", DISABLED_TEXT)
        super().__init__(*args, **kwargs)
        self._enabled_colors = (self._fg_color, self._button_color)
        self._show_state()

    def configure(self, require_redraw=False, **kwargs):
        colors = list(self._enabled_colors) if hasattr(self, "_enabled_colors") else None
        if colors is not None:
            if "fg_color" in kwargs:
                colors[0] = kwargs.pop("fg_color")
            if "button_color" in kwargs:
                colors[1] = kwargs.pop("button_color")
            self._enabled_colors = tuple(colors)
        super().configure(require_redraw, **kwargs)
        if colors is not None:
            self._show_state()

    def _show_state(self) -> None:
        wanted = (DISABLED_COLOR, DISABLED_COLOR) if self._state == "disabled" else self._enabled_colors
        if (self._fg_color, self._button_color) != wanted:
            super().configure(fg_color=wanted[0], button_color=wanted[1])

"""A message under a row of buttons that wraps at the width it has and is as tall as its text: read-only
but selectable, so a path or an opener's error can be copied. A one-line entry cut such a message off
("... (gio failed: gi")."""
from __future__ import annotations

import tkinter.font as tkfont

import customtkinter as ctk

PADDING_PX = 2


class NoticeLine(ctk.CTkTextbox):
    def __init__(self, master):
        super().__init__(master, width=200, height=28, wrap="word", border_width=0, fg_color="transparent",
                         activate_scrollbars=False)
        self.configure(state="disabled")
        # The wrapped lines change with the width the tab gives it: the height follows.
        self._textbox.bind("<Configure>", lambda _event: self._fit(), add="+")

    def show(self, message: str, color) -> None:
        self.configure(state="normal", text_color=color)
        self.delete("1.0", "end")
        self.insert("1.0", message)
        self.configure(state="disabled")  # still selectable: disabled Tk text takes no typing, only selection
        self._fit()

    def text(self) -> str:
        return self.get("1.0", "end-1c")

    def display_lines(self) -> int:
        """The lines the message takes at the current width (1 before it is drawn)."""
        # Counted to "end", the start of the line after the text: the lines crossed are the lines it takes.
        counted = self._textbox.count("1.0", "end", "update", "displaylines")
        lines = counted[-1] if isinstance(counted, (tuple, list)) else counted
        return max(int(lines or 0), 1)

    def _fit(self) -> None:
        text = self._textbox
        counted = text.count("1.0", "end", "update", "ypixels")
        pixels = counted[-1] if isinstance(counted, (tuple, list)) else counted
        pixels = pixels or tkfont.Font(font=text.cget("font")).metrics("linespace")
        # Around the text: customtkinter's inset of the Tk text in its frame, then the text's border and padding.
        inset = self.winfo_height() - text.winfo_height() if text.winfo_ismapped() else 2 * self.cget("corner_radius")
        chrome = 2 * (int(text.cget("borderwidth")) + int(text.cget("pady")) + int(text.cget("highlightthickness")))
        height = pixels + max(inset, 0) + chrome + PADDING_PX
        if abs(self.cget("height") - height) > 1:
            self.configure(height=height)

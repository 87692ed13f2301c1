"""A strip that scrolls sideways when its content is wider than the window (a list editor's rows).

Built from a plain Tk canvas rather than a horizontal CTkScrollableFrame: customtkinter's page scrolling
ignores the mouse wheel over a nested CTkScrollableFrame, so the tab would stop scrolling down while the
pointer is over the list. Here the wheel keeps scrolling the page, Shift+wheel scrolls the strip, and the
scroll bar shows only while the content does not fit.
"""
from __future__ import annotations

import sys
import tkinter as tk

import customtkinter as ctk


class HorizontalScroller(ctk.CTkFrame):
    def __init__(self, master, **kwargs):
        super().__init__(master, fg_color="transparent", **kwargs)
        self.grid_columnconfigure(0, weight=1)
        self.canvas = tk.Canvas(self, highlightthickness=0, height=1, width=1,
                                bg=self._apply_appearance_mode(self._bg_color), xscrollincrement=30)
        self.canvas.grid(row=0, column=0, sticky="we")
        self.scrollbar = ctk.CTkScrollbar(self, orientation="horizontal", command=self.canvas.xview)
        self.canvas.configure(xscrollcommand=self._scrolled)
        self.content = ctk.CTkFrame(self.canvas, fg_color="transparent")
        """Put the strip's widgets in here."""
        self.canvas.create_window(0, 0, window=self.content, anchor="nw")
        self.content.bind("<Configure>", lambda _e: self._fit(), add="+")
        self.canvas.bind("<Configure>", lambda _e: self._fit(), add="+")
        for sequence in (("<Shift-Button-4>", "<Shift-Button-5>") if sys.platform.startswith("linux")
                         else ("<Shift-MouseWheel>",)):
            self.canvas.bind_all(sequence, self._wheel, add="+")

    def _fit(self) -> None:
        """The canvas as high as the content, its scroll region the content; the bar only when it is needed."""
        self.canvas.configure(height=self.content.winfo_reqheight(),
                              scrollregion=(0, 0, self.content.winfo_reqwidth(), self.content.winfo_reqheight()))

    def _scrolled(self, first: str, last: str) -> None:
        self.scrollbar.set(first, last)
        if float(first) <= 0.0 and float(last) >= 1.0:
            self.scrollbar.grid_remove()
        else:
            self.scrollbar.grid(row=1, column=0, sticky="we")

    def _wheel(self, event) -> None:
        widget = event.widget
        while widget is not None and widget is not self:
            widget = getattr(widget, "master", None)
        if widget is None:
            return  # the pointer is elsewhere
        if sys.platform.startswith("linux"):
            self.canvas.xview_scroll(-1 if event.num == 4 else 1, "units")
        else:
            self.canvas.xview_scroll(-1 if event.delta > 0 else 1, "units")

    def visible_right_edge(self) -> int:
        """The screen x where the strip's visible part ends (tests compare widgets with it)."""
        return self.canvas.winfo_rootx() + self.canvas.winfo_width()

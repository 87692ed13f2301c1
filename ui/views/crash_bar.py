"""The red bar at the bottom of the window that shows an error raised inside the window itself.

Tk catches an exception raised in a callback (a button, a timer, a key), prints it on the terminal and
carries on, so a window user saw a click do nothing. `TandemApp.report_callback_exception` puts it here
instead (and on the terminal): what broke, and the traceback to copy into a report.
"""
from __future__ import annotations

import traceback

import customtkinter as ctk

from .fields import ERROR_COLOR

HEADLINE = "Something went wrong inside the window (training runs in its own process and is not affected):"


class CrashBar(ctk.CTkFrame):
    """Packed at the bottom of `master`, above `below` (so a small window keeps it in sight), while it has
    something to show."""

    def __init__(self, master, below):
        super().__init__(master, border_width=1, border_color=ERROR_COLOR)
        self.below = below
        self.grid_columnconfigure(0, weight=1)
        self.headline = ctk.CTkLabel(self, text=HEADLINE, text_color=ERROR_COLOR, anchor="w")
        self.headline.grid(row=0, column=0, sticky="w", padx=8, pady=(4, 0))
        self.dismiss = ctk.CTkButton(self, text="Dismiss", width=80, fg_color="gray40", command=self.clear)
        self.dismiss.grid(row=0, column=1, sticky="e", padx=8, pady=(4, 0))
        self.details = ctk.CTkTextbox(self, height=90, wrap="none", text_color=ERROR_COLOR)
        self.details.grid(row=1, column=0, columnspan=2, sticky="we", padx=8, pady=(2, 6))
        self.shown = False

    def show(self, exc: type[BaseException], value: BaseException, tb) -> None:
        """Add one exception (newest first; earlier ones stay below it until dismissed)."""
        text = "".join(traceback.format_exception(exc, value, tb)).rstrip()
        self.details.configure(state="normal")
        self.details.insert("1.0", text + "\n\n")
        self.details.configure(state="disabled")
        self.details.see("1.0")
        self.shown = True
        self.pack(side="bottom", fill="x", padx=8, pady=(0, 8), before=self.below)

    def clear(self) -> None:
        self.details.configure(state="normal")
        self.details.delete("1.0", "end")
        self.details.configure(state="disabled")
        self.shown = False
        self.pack_forget()

    def text(self) -> str:
        return self.details.get("1.0", "end").strip() if self.shown else ""

"""The mouse wheel over a text box inside a scrolling page: the box scrolls while it can, then the page.

customtkinter's page scrolling ignores the wheel over any CTkTextbox, so with the pointer on the Run
tab's log (half the tab) the page could not be scrolled at all once the log was at its end, or when it
had nothing to scroll.
"""
from __future__ import annotations

import sys

import customtkinter as ctk


def chain_wheel_to_page(box: ctk.CTkTextbox, page: ctk.CTkScrollableFrame) -> None:
    """Bind the wheel on `box` so that it scrolls `page` once `box` is at its top or bottom."""
    text = box._textbox  # the Tk text widget inside; bindings on the CTk wrapper do not see its events

    def wheel(event) -> str | None:
        if sys.platform.startswith("linux"):
            down = event.num == 5
        else:
            down = event.delta < 0
        top, bottom = text.yview()
        if (down and bottom < 1.0) or (not down and top > 0.0):
            return None  # the box scrolls itself (its own binding)
        page._parent_canvas.yview_scroll(1 if down else -1, "units")
        return "break"

    for sequence in (("<Button-4>", "<Button-5>") if sys.platform.startswith("linux") else ("<MouseWheel>",)):
        text.bind(sequence, wheel, add="+")

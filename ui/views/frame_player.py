"""Plays a video sample's frames on a label: each frame for its own time, looping, through the Tk loop's `after()`
so the window never waits for it. Whoever starts a player stops it (another sampling shown, the widget gone):
a pending tick on a destroyed label would raise in the Tk loop.
"""
from __future__ import annotations

import customtkinter as ctk

SHORTEST_MS = 20
"""A frame shows at least this long (a file may say 0 ms), so a clip never keeps the Tk loop busy."""


class FramePlayer:
    def __init__(self, label: ctk.CTkLabel, frames: list[tuple[ctk.CTkImage, int]]) -> None:
        """`frames`: each picture with how long it shows in milliseconds."""
        self.label = label
        self.frames = frames
        self.index = 0
        """The frame shown now (tests read it)."""
        self._pending: str | None = None

    @property
    def playing(self) -> bool:
        return self._pending is not None

    def start(self) -> None:
        self.stop()
        self.index = 0
        self.label.configure(image=self.frames[0][0], text="")
        self._schedule()

    def stop(self) -> None:
        if self._pending is not None:
            try:
                self.label.after_cancel(self._pending)
            except Exception:  # the label's interpreter is already gone: nothing is left to run
                pass
            self._pending = None

    def _schedule(self) -> None:
        self._pending = self.label.after(max(SHORTEST_MS, self.frames[self.index][1]), self._advance)

    def _advance(self) -> None:
        self._pending = None
        if not self.label.winfo_exists():
            return
        self.index = (self.index + 1) % len(self.frames)
        self.label.configure(image=self.frames[self.index][0])
        self._schedule()

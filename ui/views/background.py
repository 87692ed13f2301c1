"""Work that takes seconds (opening a file manager, starting TensorBoard) runs off the Tk thread, so the
window never freezes; its result comes back on the Tk thread, where widgets may be touched."""
from __future__ import annotations

import threading
from typing import Any, Callable

POLL_MS = 100


def in_background(widget, work: Callable[[], Any], done: Callable[[Any], None], name: str = "tandem-work") -> None:
    """Run `work()` on a worker thread, then `done(result)` on `widget`'s Tk thread. An exception in `work`
    is raised there instead, so it reaches the window's error bar like any other callback's."""
    outcome: list[tuple[bool, Any]] = []

    def run() -> None:
        try:
            outcome.append((True, work()))
        except BaseException as e:  # noqa: BLE001 - handed to the Tk thread, raised there
            outcome.append((False, e))

    def check() -> None:
        if not outcome:
            widget.after(POLL_MS, check)
            return
        ok, value = outcome[0]
        if not ok:
            raise value
        done(value)

    threading.Thread(target=run, daemon=True, name=name).start()
    widget.after(POLL_MS, check)

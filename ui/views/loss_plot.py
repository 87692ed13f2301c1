"""A live loss curve drawn on a plain Tk canvas (no plotting library needed)."""
from __future__ import annotations

import tkinter as tk

PAD_LEFT, PAD_RIGHT, PAD_TOP, PAD_BOTTOM = 56, 12, 12, 24


def smooth(values: list[float], weight: float = 0.9) -> list[float]:
    """Exponential moving average, as TensorBoard's smoothing slider does it."""
    out, last = [], None
    for v in values:
        last = v if last is None else last * weight + v * (1 - weight)
        out.append(last)
    return out


class LossPlot(tk.Canvas):
    def __init__(self, master, width=560, height=220):
        super().__init__(master, width=width, height=height, background="#1e1e1e", highlightthickness=0)
        self.points: list[tuple[int, float]] = []
        self.validation: list[tuple[int, float]] = []
        """Validation-loss points, drawn over the training loss in the same axes (orange)."""
        self.bind("<Configure>", lambda _e: self.redraw())

    def set_points(self, points: list[tuple[int, float]], validation: list[tuple[int, float]] | None = None) -> None:
        validation = list(validation or [])
        if len(points) != len(self.points) or points[-1:] != self.points[-1:] or validation != self.validation:
            self.points = list(points)
            self.validation = validation
            self.redraw()

    def redraw(self) -> None:
        self.delete("all")
        width, height = max(self.winfo_width(), 100), max(self.winfo_height(), 60)
        if int(self.cget("width")) > width:
            width, height = int(self.cget("width")), int(self.cget("height"))
        x0, y0, x1, y1 = PAD_LEFT, PAD_TOP, width - PAD_RIGHT, height - PAD_BOTTOM
        self.create_rectangle(x0, y0, x1, y1, outline="#555")
        if len(self.points) < 2:
            self.create_text((x0 + x1) / 2, (y0 + y1) / 2, text="Loss appears here once training runs",
                             fill="#888")
            return
        steps = [s for s, _ in self.points]
        losses = [v for _, v in self.points]
        low, high = min(losses + [v for _, v in self.validation]), max(losses + [v for _, v in self.validation])
        if high - low < 1e-12:
            low, high = low - 0.5, high + 0.5
        first = min([steps[0]] + [s for s, _ in self.validation])
        last = max(steps[-1], first + 1)

        def xy(step, value):
            return (x0 + (step - first) / (last - first) * (x1 - x0),
                    y1 - (value - low) / (high - low) * (y1 - y0))

        for value in (low, (low + high) / 2, high):
            _, y = xy(first, value)
            self.create_line(x0, y, x1, y, fill="#333")
            self.create_text(x0 - 4, y, text=f"{value:.3g}", anchor="e", fill="#aaa", font=("TkDefaultFont", 8))
        self.create_text(x0, y1 + 4, text=str(first), anchor="nw", fill="#aaa", font=("TkDefaultFont", 8))
        self.create_text(x1, y1 + 4, text=f"step {last}", anchor="ne", fill="#aaa", font=("TkDefaultFont", 8))
        raw = [c for s, v in self.points for c in xy(s, v)]
        self.create_line(*raw, fill="#4a6a8a", width=1, tags="raw")
        smoothed = [c for s, v in zip(steps, smooth(losses)) for c in xy(s, v)]
        self.create_line(*smoothed, fill="#5fb0ff", width=2, tags="smoothed")
        held_out = [c for s, v in self.validation for c in xy(s, v)]
        if len(self.validation) >= 2:
            self.create_line(*held_out, fill="#ffa040", width=2, tags="validation")
        for s, v in self.validation:
            x, y = xy(s, v)
            self.create_oval(x - 3, y - 3, x + 3, y + 3, outline="#ffa040", fill="#ffa040", tags="validation")
        if self.validation:
            self.create_text(x1 - 4, y0 + 4, text="training (blue) · validation (orange)", anchor="ne", fill="#aaa",
                             font=("TkDefaultFont", 8))

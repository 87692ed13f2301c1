"""Durations as the logs print them."""
from __future__ import annotations


def format_seconds(seconds: float | None) -> str:
    """`1h02m`, `4m05s`, `12s`; `?` when unknown."""
    if seconds is None:
        return "?"
    seconds = int(round(seconds))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    if seconds >= 60:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds}s"

"""How a long-running tool (`scripts/lora_tools.py`) tells whoever started it how far it is and how it ended.

One JSON object per line on stdout, `@tandem-tool {"type": ..., ...}`, when `TANDEM_EVENTS=1` is set (the GUI
sets it; a person at a terminal sees tqdm's bar instead):
- `progress`: `done`, `total`, `what` (the loop's name, e.g. "merging");
- `result`: `text`, the one line that says what was written;
- `error`: `text`, the one line that says what is wrong and how to fix it.
Every other line is log text. Torch-free: the GUI imports it.
"""
from __future__ import annotations

import json
from typing import Any

TOOL_PREFIX = "@tandem-tool "
TOOL_TYPES = {"progress": ("done", "total", "what"), "result": ("text",), "error": ("text",)}


def tool_line(kind: str, **fields: Any) -> str:
    """The line for one message; refuses a type or fields that `TOOL_TYPES` does not declare."""
    if kind not in TOOL_TYPES or set(fields) != set(TOOL_TYPES[kind]):
        raise ValueError(f"a {kind!r} tool line carries {TOOL_TYPES.get(kind)}, not {sorted(fields)}")
    return TOOL_PREFIX + json.dumps({"type": kind, **fields}, sort_keys=True)


def parse_tool_line(line: str) -> dict[str, Any] | None:
    """The message of a tool line (a dict with `type`), or None for log text and malformed lines."""
    if not line.startswith(TOOL_PREFIX):
        return None
    try:
        message = json.loads(line[len(TOOL_PREFIX):])
    except json.JSONDecodeError:
        return None
    if not isinstance(message, dict) or not isinstance(message.get("type"), str) or \
            set(message) - {"type"} != set(TOOL_TYPES.get(message["type"], ("?",))):
        return None
    return message

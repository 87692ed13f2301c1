"""The one error a config raises: every problem found, each a full sentence naming the field and the fix.

Its own module so that everything that reads or checks a config (serialization, migrations, validation,
presets, overrides) can raise it without importing each other.
"""
from __future__ import annotations


class ConfigError(ValueError):
    """One or more problems in a config; `problems` lists each as a full sentence."""

    def __init__(self, problems: list[str], source: str | None = None):
        self.problems = list(problems)
        self.source = source
        where = f" in {source}" if source else ""
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{len(self.problems)} problem(s){where}:\n{lines}")

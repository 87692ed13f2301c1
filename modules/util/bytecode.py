"""A bytecode cache for a Python that may not write bytecode next to the installed packages.

Some environments ship torch, diffusers and transformers without compiled bytecode and tell Python not to
write any (`PYTHONDONTWRITEBYTECODE=1`, common in container images; uv installs without bytecode by
default), or install them where the user cannot write. Then every process compiles each module it imports
from source, on every start: about 3,000 modules, 6 s per process on H100 hosts (docs/MultiGPUTraining.md,
"Slow start"), in every rank. Tandem then keeps the bytecode in a folder of its own (Python's
`sys.pycache_prefix`), outside the installed packages: the first run writes it, later runs and every
worker read it. Nothing changes where the packages have bytecode or the user chose a prefix.

    TANDEM_BYTECODE_CACHE=off   never do this
    PYTHONPYCACHEPREFIX=DIR     the user's own choice, always kept
"""
from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

CACHE_VARIABLE = "TANDEM_BYTECODE_CACHE"
"""The folder once a Tandem process turned the cache on (its workers inherit it), or `off`."""

PROBES = ("torch", "diffusers", "transformers")
"""The packages whose imports dominate a start: the cache pays when one of them lacks bytecode."""


def default_folder() -> Path:
    return Path.home() / ".cache" / "tandem" / "bytecode"


def _lacks_bytecode(package: str) -> bool:
    """Whether `package` (found, not imported) has no bytecode next to its `__init__` that Python could read or write."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return False
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return False
    source = Path(spec.origin)
    # Next to the source, whatever this process's own prefix is (a test process may have one already).
    cached = source.parent / "__pycache__" / f"{source.stem}.{sys.implementation.cache_tag}.pyc"
    if cached.exists():
        return False
    if sys.dont_write_bytecode:
        return True
    folder = cached.parent if cached.parent.exists() else cached.parent.parent
    return not os.access(folder, os.W_OK)


def keep_bytecode(folder: Path | None = None, probes: tuple[str, ...] = PROBES) -> Path | None:
    """Turn the cache on for this process and the processes it starts, where it pays. Call it before importing
    torch: modules imported earlier are not cached. Returns the cache folder, or None where it stays off."""
    inherited = os.environ.get(CACHE_VARIABLE)
    if inherited == "off":
        return None
    if inherited:
        # A worker of a process that turned it on: spawn starts its children with `-B` (it passes the
        # interpreter's flags on), which would let them read the cache but not add what only they import.
        _use(Path(inherited))
        return Path(inherited)
    if os.environ.get("PYTHONPYCACHEPREFIX") or sys.pycache_prefix:
        return None
    if not any(_lacks_bytecode(package) for package in probes):
        return None
    chosen = folder or default_folder()
    try:
        chosen.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None  # a read-only home: start as before, only slower
    if not os.access(chosen, os.W_OK):
        return None
    _use(chosen)
    return chosen


def _use(folder: Path) -> None:
    sys.pycache_prefix = str(folder)
    sys.dont_write_bytecode = False
    os.environ["PYTHONPYCACHEPREFIX"] = str(folder)
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    os.environ[CACHE_VARIABLE] = str(folder)

"""Which installed distribution provides which top-level module: scanned once per installation, kept between starts.

diffusers 0.42 and transformers 5.17 (the GPU image's; 5.24 builds it only when asked) each build that map
when they are imported (`importlib.metadata.packages_distributions()`), and the scan reads every installed
distribution's file list. On the GPU image of the benchmarks (198 distributions; torch and the nvidia wheels
list thousands of files) the two scans took 3.3 s of every process start (docs/MultiGPUTraining.md,
"Slow start") - on N GPUs in the process that starts the workers, on one GPU inside the "model" part. Tandem answers
the second scan from memory, and later starts from a small file in `~/.cache/tandem/package-map`
(`$TANDEM_HOME/package-map` where set) named after the places packages are installed: each `sys.path` entry
with its modification time, which changes whenever a package is installed, upgraded or removed there (pip and
uv add and remove the distribution's `*.dist-info` folder).

    TANDEM_PACKAGE_MAP_CACHE=off   scan as the packages do
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import sys
from pathlib import Path
from typing import Callable

CACHE_VARIABLE = "TANDEM_PACKAGE_MAP_CACHE"
KEPT_FILES = 8
"""Maps kept for as many installations (one file each; the least recently written go first)."""

Mapping = dict[str, list[str]]


def kept_folder(name: str) -> Path:
    """Where a start-up answer kept between starts lives: `~/.cache/tandem/<name>`, `$TANDEM_HOME/<name>` where set."""
    home = os.environ.get("TANDEM_HOME")  # tests, a portable install
    return Path(home) / name if home else Path.home() / ".cache" / "tandem" / name


def default_folder() -> Path:
    return kept_folder("package-map")


def installation_key(path_entries: list[str]) -> str:
    """Names the installation: the interpreter and every `sys.path` entry with its modification time."""
    entries = []
    for entry in path_entries:
        try:
            entries.append([entry, os.stat(entry or ".").st_mtime_ns])
        except OSError:
            entries.append([entry, None])
    text = json.dumps([sys.version, sys.prefix, entries])
    return hashlib.sha256(text.encode()).hexdigest()[:24]


class KeptPackageMap:
    """Stands in for `importlib.metadata.packages_distributions`: the same answer, scanned once per installation."""

    def __init__(self, scan: Callable[[], Mapping], folder: Path) -> None:
        self.scan, self.folder = scan, folder
        self.kept: tuple[str, Mapping] | None = None

    def __call__(self) -> Mapping:
        key = installation_key(sys.path)
        if self.kept is None or self.kept[0] != key:
            mapping = self._read(key)
            if mapping is None:
                mapping = self.scan()
                self._write(key, mapping)
            self.kept = (key, mapping)
        # A copy: a caller that changes its answer must not change the next caller's.
        return {name: list(distributions) for name, distributions in self.kept[1].items()}

    def _read(self, key: str) -> Mapping | None:
        try:
            mapping = json.loads((self.folder / f"{key}.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        if not isinstance(mapping, dict) or not all(
                isinstance(name, str) and isinstance(dists, list) and all(isinstance(d, str) for d in dists)
                for name, dists in mapping.items()):
            return None  # not a file this module wrote: scan again, and write it anew
        return mapping

    def _write(self, key: str, mapping: Mapping) -> None:
        write_kept(self.folder, key, mapping)


def write_kept(folder: Path, name: str, data) -> None:
    """`data` as `folder/name.json`, keeping the KEPT_FILES most recently written files there. Best effort: a
    read-only home or a full disk only costs the next start its scan."""
    target = folder / f"{name}.json"
    temporary = folder / f".{name}.{os.getpid()}.tmp"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        temporary.write_text(json.dumps(data), encoding="utf-8")
        os.replace(temporary, target)  # whole or not at all: ranks starting at once may write the same key
        kept = sorted(folder.glob("*.json"), key=lambda p: p.stat().st_mtime_ns, reverse=True)
        for old in kept[KEPT_FILES:]:
            old.unlink(missing_ok=True)
    except OSError:
        try:
            temporary.unlink(missing_ok=True)
        except OSError:
            pass  # the folder itself could not be made


def remember_package_map(folder: Path | None = None) -> KeptPackageMap | None:
    """Make `importlib.metadata.packages_distributions` scan once per installation, in this process. Call it
    before importing diffusers or transformers. Returns the stand-in, or None where it stays off."""
    if os.environ.get(CACHE_VARIABLE) == "off":
        return None
    current = importlib.metadata.packages_distributions
    if isinstance(current, KeptPackageMap):
        return current
    kept = KeptPackageMap(current, folder or default_folder())
    importlib.metadata.packages_distributions = kept
    return kept

"""Which classes transformers' model folders hold: scanned once per installation of transformers, kept between starts.

transformers 5 finds what its ~450 model folders export by reading every one of their files (2,600 in 5.24)
for `__all__`: once when it is imported and once more when a model class is first asked for
(`define_import_structure` on the `models` package, by two paths): 0.7-0.9 s of CPU for the imports alone in
every process that loads a text encoder or imports peft (which imports transformers' auto classes), and a
one-step demo training run took 1.3-1.5 s of CPU less with the answer kept (2-core development machine,
2026-11-29). Tandem answers both from a small file in `~/.cache/tandem/transformers-structure`
(`$TANDEM_HOME/transformers-structure` where set) named after the installed transformers: its folder and the
modification times of its `__init__.py`, `models` folder and `utils/import_utils.py`, which installing,
upgrading or removing transformers changes. The per-model scans that follow (a few files each) stay as they are.

The answer has to be in place before transformers' package uses the function, which it imports at its top:
so a one-time import hook wraps `transformers.utils.import_utils` as it is first executed.

    TANDEM_PACKAGE_MAP_CACHE=off   scan as transformers does (this and modules/util/package_map.py)
"""
from __future__ import annotations

import hashlib
import importlib.abc
import json
import os
import sys
from pathlib import Path
from typing import Callable

from modules.util.package_map import CACHE_VARIABLE, kept_folder, write_kept

MODULE = "transformers.utils.import_utils"

Structure = dict  # transformers' IMPORT_STRUCTURE_T: {frozenset(backends): {module: {names}}}


def default_folder() -> Path:
    return kept_folder("transformers-structure")


def installation_key(package: Path) -> str:
    """Names an installed transformers: its folder and the modification times a reinstall changes."""
    stamps = []
    for part in ("__init__.py", "models", "utils/import_utils.py"):
        try:
            stamps.append(os.stat(package / part).st_mtime_ns)
        except OSError:
            stamps.append(None)
    return hashlib.sha256(json.dumps([sys.version, str(package), stamps]).encode()).hexdigest()[:24]


def encode(structure: Structure) -> list:
    return [[sorted(backends), {module: sorted(names) for module, names in modules.items()}]
            for backends, modules in structure.items()]


def decode(entries) -> Structure | None:
    """The structure back from `encode`'s form; None for anything this module did not write."""
    if not isinstance(entries, list) or not all(
            isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], list) and isinstance(entry[1], dict)
            and all(isinstance(names, list) for names in entry[1].values()) for entry in entries):
        return None
    try:
        structure = {frozenset(backends): {module: set(names) for module, names in modules.items()}
                     for backends, modules in entries}
    except TypeError:  # an unhashable name
        return None
    if not all(isinstance(b, str) for backends in structure for b in backends) or not all(
            isinstance(module, str) and all(isinstance(name, str) for name in names)
            for modules in structure.values() for module, names in modules.items()):
        return None
    return structure


class KeptStructure:
    """Stands in for `define_import_structure`: the same answer, the `models` package's scanned once per
    installation. `scanned` and `served` name the calls answered each way (for the tests and curiosity)."""

    def __init__(self, scan: Callable[..., Structure], package: Path, folder: Path) -> None:
        self.scan, self.folder = scan, folder
        self.models = package / "models"
        self.key = installation_key(package)
        self.answers: dict[str, Structure] = {}
        self.kept: dict[str, list] | None = None
        self.scanned: list[str] = []
        self.served: list[str] = []

    def __call__(self, module_path, prefix=None) -> Structure:
        path = Path(module_path)
        if path != self.models and path != self.models / "__init__.py":
            return self.scan(module_path, prefix)  # one model's folder: a few files
        name = json.dumps([str(path), prefix])
        if name not in self.answers:
            kept = self._kept()
            structure = decode(kept[name]) if name in kept else None
            if structure is None:
                structure = self.scan(module_path, prefix)
                kept[name] = encode(structure)
                self._write(kept)
                self.scanned.append(name)
            else:
                self.served.append(name)
            self.answers[name] = structure
        return self.answers[name]

    def _kept(self) -> dict[str, list]:
        if self.kept is None:
            try:
                kept = json.loads((self.folder / f"{self.key}.json").read_text(encoding="utf-8"))
            except (OSError, ValueError):
                kept = {}
            self.kept = kept if isinstance(kept, dict) else {}
        return self.kept

    def _write(self, kept: dict[str, list]) -> None:
        write_kept(self.folder, self.key, kept)


def keep(module, folder: Path) -> KeptStructure | None:
    """Wrap `define_import_structure` of an executed `transformers.utils.import_utils`; None where it has none."""
    scan = getattr(module, "define_import_structure", None)
    if isinstance(scan, KeptStructure):
        return scan
    if scan is None or not getattr(module, "__file__", None):
        return None
    kept = KeptStructure(scan, Path(module.__file__).parents[1], folder)
    module.define_import_structure = kept
    return kept


class _Hook(importlib.abc.MetaPathFinder):
    """Finds `transformers.utils.import_utils` through the other finders and wraps it once executed."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def find_spec(self, name, path, target=None):
        if name != MODULE:
            return None
        sys.meta_path.remove(self)  # once: the next finders answer from here on
        for finder in sys.meta_path:
            spec = finder.find_spec(name, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None:
                break
        else:
            return None
        loader, folder = spec.loader, self.folder
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run = loader.exec_module

        def exec_module(module):
            run(module)
            keep(module, folder)
        loader.exec_module = exec_module
        return spec


def remember_import_structure(folder: Path | None = None) -> None:
    """Keep transformers' scan of its model folders between starts, in this process. Call it before importing
    diffusers, peft or transformers (a later call only helps the scans still to come)."""
    if os.environ.get(CACHE_VARIABLE) == "off":
        return
    folder = folder or default_folder()
    if MODULE in sys.modules:
        keep(sys.modules[MODULE], folder)
    elif not any(isinstance(finder, _Hook) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Hook(folder))

"""Ordered migrations of saved configs.

`MIGRATIONS[v]` turns the JSON data of version `v` into version `v + 1`. Files without a
`__version` key are version 0 (hand-written or from before versioning) and pass through every step.
"""
from __future__ import annotations

from typing import Callable

from .errors import ConfigError
from .train_config import CONFIG_VERSION

VERSION_KEY = "__version"
"""The key of a saved config that holds its version (missing: version 0)."""


def _v0_to_v1(data: dict) -> dict:
    # Version 0 is the same schema without the version key: nothing to rename yet.
    return data


def _v1_to_v2(data: dict) -> dict:
    # general.continue_from_backup made every later Start resume the newest backup, also after a finished
    # run; resuming is now an explicit action (--resume, the Run tab's Continue button), so it is dropped.
    general = data.get("general")
    if isinstance(general, dict):
        general.pop("continue_from_backup", None)
    return data


def _v2_to_v3(data: dict) -> dict:
    # training.cudnn_benchmark was a switch whose default (true) every saved config wrote out; it is now
    # auto | on | off, and `auto` is what that default does today. An explicit false stays off.
    training = data.get("training")
    if isinstance(training, dict) and isinstance(training.get("cudnn_benchmark"), bool):
        training["cudnn_benchmark"] = "auto" if training["cudnn_benchmark"] else "off"
    return data


def _v3_to_v4(data: dict) -> dict:
    # multi_gpu.launcher gained `auto` (torchrun where its elastic agent is needed, else spawn, which starts
    # sooner). `torchrun` was the default every saved config wrote out, and `auto` runs torchrun wherever
    # it does something spawn cannot, so it becomes `auto`; an explicit spawn stays.
    multi_gpu = data.get("multi_gpu")
    if isinstance(multi_gpu, dict) and multi_gpu.get("launcher") == "torchrun":
        multi_gpu["launcher"] = "auto"
    return data


def _v4_to_v5(data: dict) -> dict:
    # training.compile and training.cuda_graphs were switches whose default (false) every saved config wrote out;
    # they are now auto | on | off, and `auto` compiles (with graphs) only where it pays. A true stays on.
    training = data.get("training")
    if isinstance(training, dict):
        for name in ("compile", "cuda_graphs"):
            if isinstance(training.get(name), bool):
                training[name] = "on" if training[name] else "auto"
    return data


def _v5_to_v6(data: dict) -> dict:
    # multi_gpu.fsdp_activation_offload worked under FSDP only; activation offloading now works in one process and
    # with DDP too, so the setting is multi_gpu.activation_offload, with the same meaning.
    multi_gpu = data.get("multi_gpu")
    if isinstance(multi_gpu, dict) and "fsdp_activation_offload" in multi_gpu:
        multi_gpu.setdefault("activation_offload", multi_gpu.pop("fsdp_activation_offload"))
    return data


MIGRATIONS: dict[int, Callable[[dict], dict]] = {0: _v0_to_v1, 1: _v1_to_v2, 2: _v2_to_v3, 3: _v3_to_v4,
                                                 4: _v4_to_v5, 5: _v5_to_v6}


def migrate(data: dict, source: str | None = None, migrations: dict | None = None,
            target: int = CONFIG_VERSION) -> dict:
    """Apply every migration from the data's `__version` (missing: 0) up to `target`, in order.

    `migrations` and `target` exist for tests of the mechanism; callers use the defaults.
    A migration receives the data of its version and returns the data of the next one; it must
    tolerate missing keys, because presets are sparse overlays and are migrated before merging.
    """
    steps = MIGRATIONS if migrations is None else migrations
    version = data.get(VERSION_KEY, 0)
    if not isinstance(version, int) or isinstance(version, bool) or version < 0:
        raise ConfigError([f"__version: expected a non-negative integer, got {version!r}."], source)
    if version > target:
        raise ConfigError([f"__version: {version} is newer than this Tandem understands ({target}). "
                           "Update Tandem, or save the config again from this version."], source)
    while version < target:
        if version not in steps:
            # A programming error, not a user error: a version bump shipped without its migration.
            raise RuntimeError(f"no config migration from version {version} to {version + 1}; "
                               f"add MIGRATIONS[{version}] in modules/config/migrations.py.")
        data = steps[version](data)
        version += 1
        data[VERSION_KEY] = version
    return data

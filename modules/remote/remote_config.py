"""The config as a remote machine runs it, and what must be uploaded for it.

Every path in the desktop's config names something on the desktop. The remote config names the uploaded
copies instead, relative to the remote folder (the run's working directory there), so the same config
runs on every machine of a multi-machine run whatever each one's folder is - the launchers compare the
configs of all machines before they train (modules/distributed/nodes.py):

    data.concepts[i].path        files/data/<name>-<hash>        (built-in data stays built-in)
    model.base_model             files/models/<name>-<hash>[/<file>], or RemoteHost.base_model
    model.vae_path, model.components_folder   likewise
    general.workspace_dir        work/<name>-<hash>              (the desktop workspace's twin)
    general.cache_dir, save.output_dir        empty: inside that workspace

`<hash>` comes from the desktop path, so one folder is one upload, reused by every run that names it.
"""
from __future__ import annotations

import copy
import hashlib
from dataclasses import dataclass
from pathlib import Path

from modules.config import TrainConfig
from modules.config.validation import BUILTIN_PREFIX

from .host import RemoteHost, slug


@dataclass(frozen=True)
class Upload:
    """One file or folder of the desktop to copy under `<remote folder>/files/<remote>`."""
    label: str
    """What it is, for messages: `base model`, `concept 'cats'`."""
    local: Path
    remote: str
    """Relative to `<remote folder>/files`, forward slashes: a folder, or a file's path."""
    recursive: bool = True


@dataclass(frozen=True)
class RemotePlan:
    config: TrainConfig
    uploads: tuple[Upload, ...]
    workspace: str
    """The run's workspace, relative to the remote folder."""


def _name(path: Path) -> str:
    """`<name>-<hash of the absolute path>`: one remote copy per desktop file or folder."""
    resolved = path.expanduser().resolve()
    return f"{slug(resolved.stem or 'root')}-{hashlib.sha256(str(resolved).encode()).hexdigest()[:8]}"


def workspace_of(cfg: TrainConfig) -> str:
    return "work/" + _name(Path(cfg.general.workspace_dir))


def _model_upload(label: str, value: str) -> tuple[str, Upload | None]:
    """The remote value of a model path field, and the upload it needs (None for built-in models)."""
    if not value.strip() or value.startswith(BUILTIN_PREFIX):
        return value, None
    local = Path(value).expanduser().resolve()
    folder = "models/" + _name(local)
    if local.is_file():
        remote = f"{folder}/{local.name}"
        return "files/" + remote, Upload(label, local, remote)
    return "files/" + folder, Upload(label, local, folder)


def remote_plan(cfg: TrainConfig, host: RemoteHost) -> RemotePlan:
    remote = copy.deepcopy(cfg)
    uploads: list[Upload] = []
    for i, concept in enumerate(remote.data.concepts):
        if not concept.enabled or concept.path.startswith(BUILTIN_PREFIX):
            continue
        local = Path(concept.path).expanduser().resolve()
        target = "data/" + _name(local)
        uploads.append(Upload(f"concept '{concept.name or local.name}'", local, target, concept.recursive))
        concept.path = "files/" + target
    if host.base_model.strip():
        remote.model.base_model = host.base_model.strip()
    else:
        remote.model.base_model, upload = _model_upload("base model", cfg.model.base_model)
        uploads += [upload] if upload else []
    for field, label in (("vae_path", "VAE"), ("components_folder", "components folder")):
        value, upload = _model_upload(label, getattr(cfg.model, field))
        setattr(remote.model, field, value)
        uploads += [upload] if upload else []
    workspace = workspace_of(cfg)
    remote.general.workspace_dir = workspace
    remote.general.cache_dir = ""
    remote.save.output_dir = ""
    return RemotePlan(remote, tuple(uploads), workspace)

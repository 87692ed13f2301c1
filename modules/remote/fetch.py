"""Bringing a remote run's outputs to the desktop: models, samples and TensorBoard logs.

They land in `<desktop workspace>/remote/<machine>/` (`output/`, `samples/`, `tensorboard/`, as on the
remote), never over the desktop's own outputs. Only files that are new or differ in size or time are
sent (the remote lists them, `remote_side.outputs`), as one tar stream. What arrives is checked member
by member: regular files under the run's workspace only - no links, no absolute paths, no `..` - and
each file is written under a temporary name and renamed into place, so an interrupted fetch leaves no
half file behind.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import tarfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import IO

from modules.config import TrainConfig
from modules.util.atomic import atomic_path

from .host import RemoteHost
from .machine import RemoteMachine
from .ssh import SshError, last_lines


@dataclass(frozen=True)
class Fetched:
    folder: Path
    files: int
    bytes: int


def mirror_folder(cfg: TrainConfig, host: RemoteHost) -> Path:
    """Where a remote run's outputs land on the desktop."""
    return Path(cfg.general.workspace_dir).expanduser().resolve() / "remote" / host.key


def _local(folder: Path, workspace: str, name: str) -> Path | None:
    """The desktop path of a remote `name` (relative to the remote folder), or None when it is not a plain
    path inside the workspace."""
    path = PurePosixPath(name)
    try:
        inside = path.relative_to(workspace)
    except ValueError:
        return None
    if path.is_absolute() or ".." in path.parts or not inside.parts:
        return None
    return folder.joinpath(*inside.parts)


def fetch_outputs(machine: RemoteMachine, workspace: str, folder: Path, only: list[str] | None = None) -> Fetched:
    """Fetch what is new of the workspace's outputs (or just the files `only` names) into `folder`."""
    listing = machine.side("outputs", workspace)
    wanted = []
    for name, size, mtime in listing:
        local = _local(folder, workspace, name)
        if local is None or (only is not None and name not in only):
            continue
        try:
            stat = local.stat()
            if stat.st_size == size and int(stat.st_mtime) == mtime:
                continue
        except OSError:
            pass
        wanted.append(name)
    if not wanted:
        return Fetched(folder, 0, 0)
    return _receive(machine, workspace, folder, wanted)


def _receive(machine: RemoteMachine, workspace: str, folder: Path, names: list[str]) -> Fetched:
    process = machine.side_stream("pack", stdin=subprocess.PIPE)
    assert process.stdin is not None and process.stdout is not None
    process.stdin.write(json.dumps(names).encode())
    process.stdin.close()
    try:
        files, size = extract(process.stdout, workspace, folder)
    except tarfile.TarError as e:
        process.kill()
        raise SshError("failed", f"the outputs from {machine.label} arrived damaged ({e}); fetch again") from None
    stderr = process.stderr.read().decode("utf-8", errors="replace") if process.stderr else ""
    code = process.wait()
    if code == 255:
        raise machine.ssh.error(stderr)
    if code != 0:
        raise SshError("failed", f"fetching from {machine.label} failed: {last_lines(stderr) or code}")
    return Fetched(folder, files, size)


def extract(stream: IO[bytes], workspace: str, folder: Path) -> tuple[int, int]:
    """Write the regular files of a tar stream that lie inside `workspace` into `folder` (see the module's
    docstring); returns (files, bytes) written."""
    files = size = 0
    with tarfile.open(fileobj=stream, mode="r|") as tar:
        for member in tar:
            local = _local(folder, workspace, member.name)
            if local is None or not member.isfile():
                continue  # never a link, a device or a path outside the workspace
            source = tar.extractfile(member)
            if source is None:
                continue
            with atomic_path(local) as tmp:
                with open(tmp, "wb") as out:
                    shutil.copyfileobj(source, out, 1 << 20)
            os.utime(local, (member.mtime, member.mtime))
            files += 1
            size += member.size
    return files, size

"""One remote machine's connection settings, as the GUI saves them and the command line gives them."""
from __future__ import annotations

import hashlib
import re
import shlex
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

from .torch_build import spec_problems

DEFAULT_FOLDER = "~/tandem-remote"
SAFE_NAME = re.compile(r"[^A-Za-z0-9._-]+")
CONTROL_CHARACTER = re.compile(r"[\x00-\x1f\x7f]")
"""Never part of a setting: a line break would end the value in the remote's line-by-line answers."""


@dataclass(frozen=True)
class RemoteHost:
    host: str
    """Host name or address, as `ssh` reaches it (an alias of ~/.ssh/config works too)."""
    user: str = ""
    """User name on the remote; empty: ssh's default (your ~/.ssh/config, else your local user name)."""
    port: int = 22
    identity: str = ""
    """Private key file (`ssh -i`); empty: ssh's own keys and agent. Passwords are never stored or asked."""
    folder: str = DEFAULT_FOLDER
    """Folder on the remote for Tandem, its environment, uploads and runs (`~/` is the remote home)."""
    python: str = ""
    """An existing Python on the remote with Tandem's packages (e.g. a conda environment); empty: Tandem
    installs its own environment there with the README's install.sh."""
    torch_spec: str = ""
    """The torch build of that install: `[REQUIREMENT] [--index-url URL]` (e.g. `torch==2.11.0`; see
    `torch_build.py`); empty: install.sh's default, the CPU build on a machine without NVIDIA's driver."""
    base_model: str = ""
    """A base model already on the remote (a path there): used instead of uploading the config's."""
    environment: str = ""
    """Variables for runs on the remote, `KEY=VALUE` separated by spaces (e.g. NCCL_SOCKET_IFNAME=eth0)."""

    @property
    def destination(self) -> str:
        return f"{self.user}@{self.host}" if self.user else self.host

    @property
    def label(self) -> str:
        """`user@host` or `user@host:port`: how messages name the machine."""
        return self.destination + (f":{self.port}" if self.port != 22 else "")

    @property
    def key(self) -> str:
        """A short name for local folders of this remote (fetched outputs)."""
        text = SAFE_NAME.sub("_", self.label).strip("_") or "remote"
        return f"{text}-{hashlib.sha256(self.folder.encode()).hexdigest()[:6]}"

    def problems(self) -> list[str]:
        """What is wrong with the settings themselves (before any connection), each with its fix."""
        found = []
        if not self.host.strip():
            found.append("remote host: empty; give the machine's name or address (user@host)")
        elif re.search(r"\s", self.host) or self.host.startswith("-"):
            found.append(f"remote host {self.host!r}: not a host name or address")
        if self.user and (re.search(r"[\s@]", self.user) or self.user.startswith("-")):
            found.append(f"remote user {self.user!r}: not a user name")
        if not 1 <= self.port <= 65535:
            found.append(f"remote port {self.port}: must be 1 to 65535 (ssh's is 22)")
        if self.identity and not Path(self.identity).expanduser().is_file():
            found.append(f"identity key {self.identity}: no such file; choose your private key file (e.g. "
                         "~/.ssh/id_ed25519) or leave it empty to use ssh's own keys and agent")
        found += folder_problems(self.folder)
        if self.python.startswith("-"):
            found.append(f"remote Python {self.python!r}: not a program (it starts with '-'); give its path there")
        elif self.python.startswith("~") and not self.python.startswith("~/"):
            found.append(f"remote Python {self.python!r}: only '~/' (your home there) is understood; give its full path")
        for name, value in (("remote Python", self.python), ("remote base model", self.base_model),
                            ("remote environment", self.environment)):
            if CONTROL_CHARACTER.search(value):
                found.append(f"{name}: contains a line break or another control character; type it on one line")
        found += spec_problems(self.torch_spec)
        try:
            environment_pairs(self.environment)
        except ValueError as e:
            found.append(str(e))
        return found

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> RemoteHost:
        """From saved settings; unknown keys are ignored, a wrong type raises ValueError."""
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        if "port" in values:
            values["port"] = int(values["port"])
        for name, value in values.items():
            if name != "port" and not isinstance(value, str):
                raise ValueError(f"remote setting {name}: {value!r} is not text")
        return cls(**values)

    def with_destination(self, destination: str) -> RemoteHost:
        user, host, port = parse_destination(destination)
        return replace(self, user=user or self.user, host=host, port=port or self.port)


def parse_destination(text: str) -> tuple[str, str, int | None]:
    """`user@host`, `host`, `user@host:2222` or `[::1]:2222` -> (user, host, port or None)."""
    text = text.strip()
    user, _, rest = text.rpartition("@")
    port = None
    if rest.startswith("["):
        host, _, tail = rest[1:].partition("]")
        if tail.startswith(":") and tail[1:].isdigit():
            port = int(tail[1:])
    elif rest.count(":") == 1:
        host, _, tail = rest.partition(":")
        if not tail.isdigit():
            raise ValueError(f"{text!r}: the part after ':' must be a port number")
        port = int(tail)
    else:
        host = rest
    return user, host, port


def folder_problems(folder: str) -> list[str]:
    """What makes `folder` unusable as Tandem's remote folder, each with its fix. Any other character works,
    quotes and `$` included: every remote command quotes it (`ssh.remote_path`)."""
    if not folder.strip():
        return [f"remote folder: empty; give a folder on the remote, e.g. {DEFAULT_FOLDER}"]
    if CONTROL_CHARACTER.search(folder):
        return [f"remote folder {folder!r}: contains a line break or another control character; give a folder "
                f"name without them, e.g. {DEFAULT_FOLDER}"]
    if folder.startswith("~") and not folder.startswith("~/") and folder != "~":
        return [f"remote folder {folder!r}: only '~/' (your home there) is understood; give the full path"]
    if folder.rstrip("/") in ("", "~") or folder.strip("/") == "":
        # Tandem deletes old versions in <folder>/source and makes the folder private: never a whole home
        return [f"remote folder {folder!r}: give Tandem a folder of its own there, e.g. {DEFAULT_FOLDER}"]
    return []


def environment_pairs(text: str) -> dict[str, str]:
    """`A=1 B="two words"` -> {"A": "1", "B": "two words"}; raises ValueError naming the bad part."""
    pairs = {}
    try:
        parts = shlex.split(text or "")
    except ValueError as e:  # an unbalanced quote
        raise ValueError(f"remote environment: {e} in {text!r}; quote a value with spaces or quotes in it, "
                         "e.g. NOTE=\"Bob's runs\"") from None
    for part in parts:
        name, sep, value = part.partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise ValueError(f"remote environment: {part!r} is not KEY=VALUE")
        pairs[name] = value
    return pairs


def slug(text: str, limit: int = 40) -> str:
    """A file-name-safe form of `text` for folder names on the remote."""
    return SAFE_NAME.sub("-", text).strip("-.")[:limit] or "x"

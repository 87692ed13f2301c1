"""One remote machine as the desktop talks to it: its folders, its Python, and calls of `remote_side` there."""
from __future__ import annotations

import json
import shlex
import subprocess

from .host import RemoteHost
from .known_hosts import KnownHosts
from .ssh import Result, Ssh, SshError, last_lines, remote_path, say

NOT_INSTALLED = 3
"""remote_side's exit code when Tandem is not installed in the remote folder (no `source/current`)."""
CURRENT = "current"
"""`<folder>/source/current`: a link to the newest installed version, whose remote_side every call runs."""


class RemoteMachine:
    def __init__(self, host: RemoteHost, known: KnownHosts | None = None):
        self.host = host
        self.ssh = Ssh(host, known)

    @property
    def label(self) -> str:
        return self.host.label

    def path(self, *parts: str) -> str:
        """A path under the remote folder as one word of an sh command (`~` is the remote home, and so is the
        start of a relative folder: remote_side runs in another folder, so it is given the full path)."""
        folder = self.host.folder.rstrip("/") or "/"
        if not folder.startswith(("/", "~")):
            folder = "~/" + folder
        return remote_path("/".join([folder, *parts]) if parts else folder)

    @property
    def python(self) -> str:
        """The Python that runs Tandem there, as one word of an sh command: a command name (`python3`) as it is,
        a relative path from the home, as the check finds it (remote_side runs in another folder)."""
        python = self.host.python
        if not python:
            return self.path("venv", "bin", "python")
        if "/" in python and not python.startswith(("/", "~")):
            python = "~/" + python
        return remote_path(python)

    def side_script(self, verb: str, *args: str) -> str:
        missing = (f"Tandem is not installed in {self.host.folder} on this machine: check the connection or start "
                   "a run to install it")
        return (f"cd {self.path('source', CURRENT)} 2>/dev/null || {{ {say(missing)} >&2; exit {NOT_INSTALLED}; }}; "
                f"exec {self.python} -m modules.remote.remote_side --root {self.path()} "
                + " ".join(shlex.quote(a) for a in (verb, *args)))

    def side(self, verb: str, *args: str, input: object = None, timeout: float | None = 120):
        """Run a remote_side verb and return its JSON answer; `input` goes to it as JSON."""
        data = json.dumps(input).encode() if input is not None else None
        result = self.ssh.run(self.side_script(verb, *args), input=data, timeout=timeout, check=False)
        if result.returncode == NOT_INSTALLED:
            raise SshError("not_installed", result.stderr.strip())
        if result.returncode != 0:
            raise SshError("failed", f"on {self.label}: {last_lines(result.stderr) or f'exit code {result.returncode}'}")
        try:
            return json.loads(result.text)
        except ValueError:
            raise SshError("failed", f"{self.label}: unexpected answer to {verb}: {result.text[:300]!r}") from None

    def side_stream(self, verb: str, *args: str, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE) -> subprocess.Popen:
        return self.ssh.popen(self.side_script(verb, *args), stdin=stdin, stdout=stdout)

    def run(self, script: str, **kwargs) -> Result:
        return self.ssh.run(script, **kwargs)

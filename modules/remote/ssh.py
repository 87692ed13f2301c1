"""The `ssh` command lines Tandem runs, and what their failures mean in words a user can act on.

Every call uses the system's OpenSSH client with:
- `BatchMode=yes`: keys only (a file, or the user's ssh agent); ssh never asks for a password or a
  passphrase, which a GUI could not answer and Tandem never stores;
- `StrictHostKeyChecking=yes` against Tandem's and the user's known_hosts (`known_hosts.py`);
- `ServerAliveInterval`: a dropped network ends the call within a minute instead of hanging it.
The user's ~/.ssh/config still applies (aliases, ProxyJump); these options win over it.

Remote commands are POSIX sh scripts run as `sh -c '<script>'`, whatever the login shell is, each after
`umask 077`: every file and folder Tandem or a run makes there is its user's alone (the umask is inherited by
the detached runs). Every value in a script is one quoted word (`remote_path`, `shlex.quote`, `say`).
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
from dataclasses import dataclass
from typing import IO

from .host import RemoteHost
from .known_hosts import KnownHosts, host_pattern

CONNECT_TIMEOUT_S = 15
ALIVE_INTERVAL_S = 15
ALIVE_COUNT = 4
SSH_FAILED = 255
"""ssh's own exit code for a failed connection; any other code is the remote command's."""
PRIVATE_UMASK = "umask 077"


class SshError(RuntimeError):
    """A connection that failed; `kind` is one of `host_key_unknown`, `host_key_changed`, `auth`,
    `unreachable`, `failed` (the remote command failed), `missing` (no ssh client)."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class Result:
    returncode: int
    stdout: bytes
    stderr: str

    @property
    def text(self) -> str:
        return self.stdout.decode("utf-8", errors="replace")


def remote_path(path: str) -> str:
    """`path` as one word of a remote sh command, with `~` as the remote home (`"$HOME"/...`)."""
    if path == "~":
        return '"$HOME"'
    if path.startswith("~/"):
        return '"$HOME"/' + shlex.quote(path[2:])
    return shlex.quote(path)


def say(text: str) -> str:
    """A remote sh command that prints `text` as it is (printf: dash's echo would read backslashes in it)."""
    return "printf '%s\\n' " + shlex.quote(text)


def no_window() -> dict:
    """No console window per ssh call when the GUI runs on Windows."""
    return {"creationflags": subprocess.CREATE_NO_WINDOW} if os.name == "nt" else {}


class Ssh:
    def __init__(self, host: RemoteHost, known: KnownHosts | None = None, executable: str = "ssh"):
        self.host = host
        self.known = known or KnownHosts.default()
        self.executable = executable

    def options(self) -> list[str]:
        options = ["-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes", "-o", self.known.option(),
                   "-o", f"ConnectTimeout={CONNECT_TIMEOUT_S}", "-o", f"ServerAliveInterval={ALIVE_INTERVAL_S}",
                   "-o", f"ServerAliveCountMax={ALIVE_COUNT}", "-p", str(self.host.port)]
        if self.host.identity:
            options += ["-i", os.path.expanduser(self.host.identity), "-o", "IdentitiesOnly=yes"]
        return options

    def command(self, script: str | None, *extra: str) -> list[str]:
        """The ssh command line running `script` (None: no remote command, e.g. a tunnel with -N)."""
        tail = [] if script is None else ["sh -c " + shlex.quote(f"{PRIVATE_UMASK}; {script}")]
        return [self.executable, *self.options(), *extra, self.host.destination, *tail]

    def run(self, script: str, input: bytes | None = None, timeout: float | None = 120,
            check: bool = True) -> Result:
        """Run `script` on the remote and wait; raises SshError for a failed connection, and (with `check`)
        for a script that failed, with its error output."""
        try:
            done = subprocess.run(self.command(script), input=input if input is not None else b"",
                                  capture_output=True, timeout=timeout, **no_window())
        except FileNotFoundError:
            raise missing_client(self.executable) from None
        except subprocess.TimeoutExpired:
            raise SshError("unreachable", f"{self.host.label} did not answer within {timeout:g} s") from None
        result = Result(done.returncode, done.stdout, done.stderr.decode("utf-8", errors="replace"))
        if result.returncode == SSH_FAILED:
            raise self.error(result.stderr)
        if check and result.returncode != 0:
            raise SshError("failed", f"on {self.host.label}: {last_lines(result.stderr) or 'exit code %d' % result.returncode}")
        return result

    def popen(self, script: str | None, *extra: str, stdin: int | IO | None = subprocess.DEVNULL,
              stdout: int | IO | None = subprocess.PIPE, stderr: int | IO | None = subprocess.PIPE) -> subprocess.Popen:
        """Start `script` on the remote without waiting (streams: following a log, tar, a tunnel)."""
        try:
            return subprocess.Popen(self.command(script, *extra), stdin=stdin, stdout=stdout, stderr=stderr,
                                    **no_window())
        except FileNotFoundError:
            raise missing_client(self.executable) from None

    def error(self, stderr: str) -> SshError:
        """What a failed connection (exit code 255) means, from ssh's own messages."""
        label, pattern = self.host.label, host_pattern(self.host.host, self.host.port)
        if "REMOTE HOST IDENTIFICATION HAS CHANGED" in stderr or re.search(r"Host key for .* has changed", stderr):
            offending = re.search(r"Offending \S+ key in (.+):(\d+)", stderr)
            where = f" (the known key is in {offending.group(1)}, line {offending.group(2)})" if offending else ""
            shown = re.search(r"(SHA256:[A-Za-z0-9+/=]+)", stderr)
            now = f" It now offers {shown.group(1).rstrip('.')}." if shown else ""
            file = offending.group(1) if offending else self.known.write_to.as_posix()
            return SshError("host_key_changed", (
                f"The host key of {label} has CHANGED since it was accepted{where}.{now} This happens when the "
                "machine was reinstalled - or when someone is intercepting the connection, so Tandem refuses to "
                "connect. If you know why the key changed, remove the old key and check the connection again "
                f"to accept the new one: ssh-keygen -f \"{file}\" -R \"{pattern}\""))
        if "Host key verification failed" in stderr or "host key is known" in stderr:
            return SshError("host_key_unknown", (
                f"The host key of {label} is not known yet. Check the connection to see its fingerprint and "
                "accept it once (scripts/train_remote.py asks, or takes --accept-host-key FINGERPRINT)."))
        if "Permission denied" in stderr:
            return SshError("auth", (
                f"{self.host.destination} refused the login (Permission denied). Tandem logs in with keys only: "
                "give the private key (identity) whose public key is in ~/.ssh/authorized_keys on the remote, "
                "or add it to your ssh agent (ssh-add)." + (f" Key given: {self.host.identity}." if self.host.identity
                                                            else "")))
        return SshError("unreachable", f"cannot connect to {label}: {last_lines(stderr) or 'ssh failed'}. "
                                       "Check the host name, the port and that the machine is on.")


def missing_client(executable: str) -> SshError:
    return SshError("missing", f"the OpenSSH client ({executable}) is not installed. Linux: install "
                               "openssh-client; Windows 10+: Settings > Apps > Optional features > OpenSSH Client.")


def last_lines(text: str, count: int = 3) -> str:
    lines = [line.strip() for line in text.strip().splitlines()
             if line.strip() and not line.startswith(("Warning: Permanently added", "Pseudo-terminal"))]
    return " / ".join(lines[-count:])

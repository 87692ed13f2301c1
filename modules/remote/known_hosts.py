"""Host keys: which machine is at the other end is checked by ssh itself against known_hosts files.

ssh runs with `StrictHostKeyChecking=yes` and `UserKnownHostsFile` naming Tandem's own file
(`<settings>/known_hosts`) and the user's (`~/.ssh/known_hosts`), so a machine the user already trusts
in a terminal is trusted here too, and nothing Tandem accepts is written into the user's own file.
A machine with no known key is refused until its fingerprint was shown and accepted once (`scan`, then
`accept`); a machine whose key differs from the known one is refused, always (ssh's own check: Tandem
offers no way around it but the user removing the old key with the command the message gives).
"""
from __future__ import annotations

import os
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from modules.util.settings_dir import settings_dir

SCAN_TIMEOUT_S = 10


def project_file() -> Path:
    return settings_dir() / "known_hosts"


def user_file() -> Path:
    return Path.home() / ".ssh" / "known_hosts"


def host_pattern(host: str, port: int) -> str:
    """How known_hosts names a machine: `host` on port 22, `[host]:port` on any other."""
    return host if port == 22 else f"[{host}]:{port}"


@dataclass(frozen=True)
class KnownHosts:
    """The files ssh checks host keys against; accepted keys are added to `write_to`."""
    files: tuple[Path, ...]
    write_to: Path

    @classmethod
    def default(cls) -> KnownHosts:
        return cls((project_file(), user_file()), project_file())

    def option(self) -> str:
        # ssh_config splits this value at spaces; a path with spaces is quoted.
        return "UserKnownHostsFile=" + " ".join(f'"{p.as_posix()}"' if " " in str(p) else p.as_posix()
                                                for p in self.files)


@dataclass(frozen=True)
class ScannedKey:
    line: str
    """The known_hosts line: `pattern type base64`."""
    fingerprint: str
    """`SHA256:...`, as `ssh-keygen -l` and ssh's own messages show it."""
    key_type: str
    """ED25519, ECDSA, RSA."""

    def describe(self) -> str:
        return f"{self.key_type} {self.fingerprint}"


class ScanError(RuntimeError):
    """ssh-keyscan found no key (the machine is not reachable on that port, or speaks no SSH)."""


def _no_window() -> dict:
    return {"creationflags": subprocess.CREATE_NO_WINDOW} if os.name == "nt" else {}


def scan(host: str, port: int, timeout_s: float = SCAN_TIMEOUT_S) -> list[ScannedKey]:
    """The keys the machine offers, with their fingerprints (`ssh-keyscan`, then `ssh-keygen -lf`)."""
    try:
        result = subprocess.run(["ssh-keyscan", "-p", str(port), "-T", str(int(timeout_s)), host],
                                capture_output=True, text=True, timeout=timeout_s + 20, **_no_window())
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ScanError(f"ssh-keyscan could not run ({e}); is the OpenSSH client installed?") from None
    lines = [line.strip() for line in result.stdout.splitlines() if line.strip() and not line.startswith("#")]
    if not lines:
        why = result.stderr.strip().splitlines()[-1:] or ["no answer"]
        raise ScanError(f"{host_pattern(host, port)} offered no SSH host key ({why[0]}); check the host name, "
                        "the port and that the machine is on")
    return [ScannedKey(line, *_fingerprint(line)) for line in lines]


def _fingerprint(line: str) -> tuple[str, str]:
    with tempfile.TemporaryDirectory(prefix="tandem-key-") as folder:
        path = Path(folder) / "key"
        path.write_text(line + "\n", encoding="utf-8")
        result = subprocess.run(["ssh-keygen", "-lf", str(path)], capture_output=True, text=True, timeout=30,
                                **_no_window())
    # "256 SHA256:abc... [host]:port (ED25519)"
    match = re.search(r"(SHA256:\S+).*\((\w+)\)\s*$", result.stdout.strip())
    if result.returncode != 0 or not match:
        raise ScanError(f"ssh-keygen could not read the key the machine offered: {result.stderr.strip() or line}")
    return match.group(1), match.group(2)


def accept(known: KnownHosts, keys: list[ScannedKey]) -> Path:
    """Trust `keys` from now on: append them to Tandem's known_hosts file; returns the file."""
    known.write_to.parent.mkdir(parents=True, exist_ok=True)
    with open(known.write_to, "a", encoding="utf-8") as f:
        f.writelines(key.line + "\n" for key in keys)
    if os.name != "nt":
        os.chmod(known.write_to, 0o600)
    return known.write_to

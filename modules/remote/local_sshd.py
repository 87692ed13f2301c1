"""A throwaway OpenSSH server on 127.0.0.1, for the remote-training tests and the documentation's pictures
(ui/screenshots.py --remote): its own host and user keys in a given folder, a free non-default port, the
system's `sshd -D` (foreground) started and stopped by the caller. Not used by a real remote run.

The 'remote' is this machine, logged into as the current user with the user key generated here; nothing
outside the folder is read or changed except the privilege-separation folder sshd insists on (/run/sshd,
created when missing and running as root, as in CI). Listens on 127.0.0.1 only.
"""
from __future__ import annotations

import getpass
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

from modules.remote.host import RemoteHost
from modules.remote.known_hosts import KnownHosts
from modules.util.ports import find_free_port

SSHD = "/usr/sbin/sshd"
PRIVSEP = Path("/run/sshd")


def sshd_problem() -> str | None:
    """Why no sshd can run here (the tests fail with it), or None."""
    if not Path(SSHD).is_file() or shutil.which("ssh-keygen") is None or shutil.which("ssh") is None:
        return "OpenSSH's server is not installed: run-tests.sh installs it (apt-get install openssh-server)"
    if not PRIVSEP.is_dir():
        if os.geteuid() != 0:
            return f"sshd needs the folder {PRIVSEP} (mkdir -p {PRIVSEP} as root)"
        PRIVSEP.mkdir(mode=0o755, parents=True, exist_ok=True)
    return None


def keygen(path: Path) -> None:
    path.unlink(missing_ok=True)
    Path(str(path) + ".pub").unlink(missing_ok=True)
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "tandem-test", "-f", str(path)], check=True)


class SshServer:
    def __init__(self, folder: Path):
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self.port = find_free_port()
        self.host_key = folder / "host_key"
        self.user_key = folder / "user_key"
        self.known_hosts = folder / "known_hosts"
        keygen(self.host_key)
        keygen(self.user_key)
        authorized = folder / "authorized_keys"
        authorized.write_text(Path(str(self.user_key) + ".pub").read_text())
        authorized.chmod(0o600)
        self.config = folder / "sshd_config"
        self.config.write_text("\n".join([
            f"HostKey {self.host_key}", f"AuthorizedKeysFile {authorized}", "ListenAddress 127.0.0.1",
            "PasswordAuthentication no", "KbdInteractiveAuthentication no", "PubkeyAuthentication yes",
            "PermitRootLogin prohibit-password", "StrictModes no", "UsePAM no", "PidFile none",
            "AllowTcpForwarding local", "MaxStartups 100", "LogLevel ERROR", ""]))
        self.process: subprocess.Popen | None = None

    def start(self) -> SshServer:
        self.process = subprocess.Popen([SSHD, "-D", "-e", "-f", str(self.config), "-p", str(self.port)],
                                        stdout=subprocess.DEVNULL, stderr=open(self.folder / "sshd.log", "ab"))
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError("sshd exited: " + (self.folder / "sshd.log").read_text()[-2000:])
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return self
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"sshd did not listen on port {self.port} within 20 s")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(10)
        self.process = None

    def new_host_key(self) -> None:
        """The machine 'reinstalled': another host key, the same address and port."""
        self.stop()
        keygen(self.host_key)
        self.start()

    def sessions(self) -> list[int]:
        """Process ids of the sshd processes serving connections (children of the listening one)."""
        assert self.process is not None
        found = subprocess.run(["pgrep", "-P", str(self.process.pid)], capture_output=True, text=True).stdout
        return [int(pid) for pid in found.split()]

    def remote(self, folder: Path, **settings) -> RemoteHost:
        return RemoteHost(host="127.0.0.1", user=getpass.getuser(), port=self.port, identity=str(self.user_key),
                          folder=str(folder), **settings)

    def known(self) -> KnownHosts:
        return KnownHosts((self.known_hosts,), self.known_hosts)

    def trust(self) -> None:
        """Put the server's key into the known_hosts file (what accepting it once does)."""
        line = Path(str(self.host_key) + ".pub").read_text().split()
        with open(self.known_hosts, "a") as f:
            f.write(f"[127.0.0.1]:{self.port} {line[0]} {line[1]}\n")

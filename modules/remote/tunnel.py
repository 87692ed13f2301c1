"""TensorBoard of a remote run, through an SSH tunnel: never on a public port.

TensorBoard runs on the remote bound to 127.0.0.1 (only that machine can reach it), started by the same ssh
connection that forwards a port of the desktop's 127.0.0.1 to it (`ssh -L 127.0.0.1:L:127.0.0.1:R`): the
address to open is `http://127.0.0.1:L/` on the desktop. Closing the tunnel (or losing the connection)
ends that TensorBoard too (`remote_side.tensorboard` ends when its stdin closes).
"""
from __future__ import annotations

import socket
import subprocess
import time
import urllib.error
import urllib.request

from modules.util.ports import find_free_port

from .machine import RemoteMachine
from .ssh import SshError, last_lines

READY_TIMEOUT_S = 120


class Tunnel:
    def __init__(self, machine: RemoteMachine):
        self.machine = machine
        self.process: subprocess.Popen | None = None
        self.url: str | None = None
        self.logdir: str | None = None

    @property
    def open_(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def open(self, logdir: str, timeout_s: float = READY_TIMEOUT_S) -> str:
        """Start TensorBoard on `logdir` (relative to the remote folder) and the tunnel; returns the local address
        once TensorBoard answers through it. Reuses an open tunnel to the same folder."""
        if self.open_ and self.logdir == logdir and self.url:
            return self.url
        self.close()
        remote_port = int(self.machine.side("free-port"))
        local_port = find_free_port()
        forward = f"127.0.0.1:{local_port}:127.0.0.1:{remote_port}"
        self.process = self.machine.ssh.popen(self.machine.side_script("tensorboard", logdir, str(remote_port)),
                                              "-L", forward, "-o", "ExitOnForwardFailure=yes",
                                              stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{local_port}/"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                stderr = self.process.stderr.read().decode("utf-8", errors="replace") if self.process.stderr else ""
                self.process = None
                if "Address already in use" in stderr or "cannot listen" in stderr:
                    raise SshError("failed", f"the tunnel could not listen on 127.0.0.1:{local_port}; try again")
                raise SshError("failed", f"TensorBoard on {self.machine.label} did not start: {last_lines(stderr)}")
            if _answers(url):
                self.url, self.logdir = url, logdir
                return url
            time.sleep(0.5)
        self.close()
        raise SshError("failed", f"TensorBoard on {self.machine.label} did not answer within {timeout_s:g} s")

    def close(self) -> None:
        process, self.process, self.url = self.process, None, None
        if process is None:
            return
        if process.stdin is not None:
            try:
                process.stdin.close()
            except OSError:
                pass
        try:
            process.wait(5)
        except subprocess.TimeoutExpired:
            process.terminate()
            try:
                process.wait(5)
            except subprocess.TimeoutExpired:
                process.kill()


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as reply:
            return reply.status == 200
    except (urllib.error.URLError, socket.timeout, ConnectionError, OSError):
        return False

"""The run's rendezvous store: served by the launcher on the address the config names, and only there.

PyTorch's TCPStore listens on every interface (`*:<port>`) whatever host name it is given, both as
rank 0 of `init_process_group` and as torchrun's agent store, so a machine on the network could join
a run's rendezvous although `multi_gpu.master_addr` says 127.0.0.1. So the launcher binds the
listening socket itself - on `master_addr` (loopback unless the user names another address; the
wildcard only when the user names 0.0.0.0 or ::) - and hands it to a TCPStore it keeps for the whole
run. torchrun's agent and every worker connect to it as clients: the workers find it in their job
(`job.WorkerJob.rendezvous`); without one (a user's own torchrun or launcher) they use
MASTER_ADDR/MASTER_PORT as PyTorch does.

Serving from the launcher also ends the race of "find a free port, release it, let rank 0 bind it".
"""
from __future__ import annotations

import contextlib
import datetime
import os
import socket
from typing import Iterator

WORKER_PREFIX = "tandem-workers/"
"""The workers' keys, apart from those of torchrun's agent, which shares the store."""


class RendezvousError(RuntimeError):
    """The store could not listen where the config says; the message names the address and the fix."""


def endpoint(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def split_endpoint(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host.strip("[]"), int(port)


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket listening on `host` (an address or a name; not every interface unless it says so)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise RendezvousError(f"multi_gpu.master_addr {host!r} is not an address of this machine ({e}); "
                              "use 127.0.0.1 for one machine.") from None
    sock = socket.socket(family, kind, proto)
    try:
        if os.name == "posix":  # allow a quick restart on a port in TIME_WAIT (Windows' flag means more)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(1024)
    except OSError as e:
        sock.close()
        raise RendezvousError(f"cannot listen on {endpoint(host, port)} for the rendezvous ({e.strerror or e}); "
                              "pick another port with --port (0 = a free one) or check multi_gpu.master_addr.") from None
    return sock


@contextlib.contextmanager
def serve(host: str, port: int, timeout: datetime.timedelta) -> Iterator[str]:
    """Serve the rendezvous store on host:port (0 = a free port) for the block; yields its `host:port`."""
    import torch.distributed as dist

    sock = listening_socket(host, port)
    port = sock.getsockname()[1]
    if os.name == "posix":
        # The store takes the socket over (and closes it when it is deleted).
        store = dist.TCPStore(host, port, None, True, timeout, wait_for_workers=False, master_listen_fd=sock.detach())
    else:
        # PyTorch's Windows store cannot adopt a socket; there it listens as it always does (and without
        # libuv, which its Windows wheels lack: worker_environment.store_environment).
        sock.close()
        store = dist.TCPStore(host, port, None, True, timeout, wait_for_workers=False, use_libuv=False)
    try:
        yield endpoint(host, port)
    finally:
        del store


CONNECT_TIMEOUT = datetime.timedelta(seconds=60)
"""How long a worker tries to reach its launcher's store: the store is up before any worker starts, so
failing to connect means the launcher is gone - better to exit than to wait the whole rendezvous timeout."""


def connect(address: str, timeout: datetime.timedelta):
    """The workers' view of the store a launcher serves at `address` (`host:port`); `timeout` then
    applies to waiting for the other ranks."""
    import torch.distributed as dist

    from modules.distributed.agent import ROUND_VARIABLE

    store = client(address, min(timeout, CONNECT_TIMEOUT))
    store.set_timeout(timeout)
    # Each round of workers (a restart makes a new one) has keys of its own: a dead round's would mislead it.
    return dist.PrefixStore(f"{WORKER_PREFIX}round-{os.environ.get(ROUND_VARIABLE, '0')}/", store)


def client(address: str, timeout: datetime.timedelta):
    """A client of the store served at `address` (`host:port`), trying to reach it for up to `timeout`."""
    import torch.distributed as dist

    host, port = split_endpoint(address)
    return dist.TCPStore(host, port, None, False, timeout)

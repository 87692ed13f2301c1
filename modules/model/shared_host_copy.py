"""One host copy of layer offload's swapped weights for all the ranks of a machine, not one each.

Under DDP every rank loads the same frozen base, and layer offload keeps the swapped blocks' weights in host
memory (`layer_offload.py`): a copy per rank would multiply host memory by the ranks of the machine. Instead its
first rank (local rank 0) writes the weights into an anonymous shared-memory file (`memfd_create`), each other rank
of the machine maps that same file (through `/proc/<pid>/fd/<n>` of the first rank) and lets its own copy go, and
each rank page-locks its mapping on CUDA (`layer_offload.py`): the pages exist once.

An anonymous file rather than a named one in /dev/shm: there is no name for two runs to share, and nothing to
clean up - the kernel frees the pages when the last process mapping them ends, however it ends (a normal end, an
exception, SIGTERM, the SIGKILL of PDEATHSIG); the first rank closes its descriptor once every rank has mapped it.
Nor is it held to /dev/shm's size (64 MiB in a default Docker container). Where sharing cannot be had (not
Linux, the file not created or not opened), that rank keeps its own copy and the log says why.
"""
from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from modules.util import dist_utils as du

log = logging.getLogger("tandem")

NAME = "tandem-layer-offload"
"""The shared file's name as `/proc/<pid>/maps` shows it (`/memfd:tandem-layer-offload (deleted)`)."""


def machine() -> tuple[str, str]:
    """What tells the ranks of one machine from another's: the host name and this boot of its kernel."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return socket.gethostname(), boot


@dataclass(frozen=True)
class _Offer:
    """What one rank tells the others as the buffer is made."""
    machine: tuple[str, str]
    local_rank: int
    pid: int
    fd: int | None
    """The first rank's open shared file (None elsewhere, or where it could not make one)."""
    nbytes: int


def _create(nbytes: int) -> tuple[int, torch.Tensor]:
    """A new shared file of `nbytes`, its pages reserved (a write to one that could not be had would end the
    process with SIGBUS), mapped."""
    fd = os.memfd_create(NAME, os.MFD_CLOEXEC)
    try:
        os.posix_fallocate(fd, 0, nbytes)
        return fd, _map(f"/proc/self/fd/{fd}", nbytes)
    except BaseException:
        os.close(fd)
        raise


def _map(path: str, nbytes: int) -> torch.Tensor:
    return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)


class MachineShare:
    """The ranks of this machine, sharing one host buffer (`buffer`, which every rank of the run calls at once)."""

    def __init__(self, local_rank: int) -> None:
        self.local_rank = local_rank
        self.sharing = 1
        """How many ranks of this machine map the buffer (1: this rank's copy is its own)."""

    def buffer(self, nbytes: int, write: Callable[[torch.Tensor], None]) -> torch.Tensor:
        """A host buffer of `nbytes` holding what `write` writes into it: the first rank's shared file, written by
        it alone, mapped by the others; a rank's own buffer, written by itself, where sharing failed."""
        fd, buffer, failed = None, None, ""
        if self.local_rank == 0:
            try:
                if not hasattr(os, "memfd_create"):
                    raise OSError("no anonymous shared memory (memfd_create) on this system")
                fd, buffer = _create(nbytes)
                write(buffer)
            except (OSError, RuntimeError) as e:
                failed = f"the shared file of {nbytes / 2**30:.2f} GiB was not made ({e})"
                if fd is not None:
                    os.close(fd)
                fd, buffer = None, None
        here = machine()
        offers = du.all_gather_objects(_Offer(here, self.local_rank, os.getpid(), fd, nbytes))
        first = next((o for o in offers if o.machine == here and o.local_rank == 0), None)
        if self.local_rank != 0:
            if first is None or first.fd is None:
                failed = "the machine's first rank made no shared copy"
            elif first.nbytes != nbytes:
                failed = f"the first rank swaps {first.nbytes} bytes and this rank {nbytes}"
            else:
                try:
                    buffer = _map(f"/proc/{first.pid}/fd/{first.fd}", nbytes)
                except (OSError, RuntimeError) as e:
                    failed = f"the first rank's shared file could not be opened ({e})"
        if buffer is None:
            buffer = torch.empty(nbytes, dtype=torch.uint8)
            write(buffer)
            log.warning("Layer offload: rank %d keeps its own host copy of the swapped blocks: %s.", du.rank(), failed)
        # Every rank has mapped the file (or made its own) before the first closes it: from here on the
        # mappings alone keep it.
        shared = du.all_gather_objects((here, not failed))
        if fd is not None:
            os.close(fd)
        self.sharing = sum(1 for where, ok in shared if where == here and ok) if not failed else 1
        return buffer


def machine_share() -> MachineShare | None:
    """The share of this process's machine in a run of several processes (None in one process). Every rank takes
    part, also the only rank of a machine: `buffer` is a collective of the whole run."""
    return MachineShare(du.local_rank()) if du.world_size() > 1 else None


def host_figures(offload) -> dict:
    """This rank's host memory and its layer offload copy's (`LayerOffload`), for `host_memory_line`."""
    from modules.util.host_memory import process_usage
    return {"machine": machine(), "process": process_usage(), "copy": offload.host_usage(),
            "bytes": offload.host_bytes, "sharing": offload.sharing}


def host_memory_line(figures: list[dict]) -> str:
    """Each rank's host memory (`host_figures`, by rank) and how much of it is layer offload's copy: its pages once
    per machine when the ranks share it (their PSS add up to one copy)."""
    from modules.util.host_memory import size

    ranks = [f"rank {r} PSS {size(f['process']['pss'])} (RSS {size(f['process']['rss'])})"
             for r, f in enumerate(figures) if f["process"]]
    text = "Host memory after the first step: " + (", ".join(ranks) if ranks else "not known on this system")
    copies = []
    for where in dict.fromkeys(f["machine"] for f in figures):
        here = [(r, f) for r, f in enumerate(figures) if f["machine"] == where]
        nbytes, sharing = here[0][1]["bytes"], max(f["sharing"] for _, f in here)
        files = {f["copy"]["inode"] for _, f in here if f["copy"]}
        shares = " + ".join(f"{size(f['copy']['pss'])} (rank {r})" for r, f in here if f["copy"])
        if sharing > 1 and len(files) == 1:
            copies.append(f"one copy of {size(nbytes)} shared by {sharing} processes, their shares of it {shares}")
        else:
            copies.append(f"{len(here)} copies of {size(nbytes)}, one per process")
    return f"{text}; layer offload's host copy: {'; '.join(copies)}."

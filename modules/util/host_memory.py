"""How much host memory a process holds, and how much of it is its own: Linux's RSS and PSS.

RSS counts every page a process has in memory, also those it shares with others; PSS divides each shared page
by the number of processes that map it, so the PSS of the processes of a machine add up to what they hold
together. Layer offload's host copy, shared by the ranks of a machine (`modules/model/shared_host_copy.py`),
is in each rank's RSS whole and in its PSS once divided: the PSS is what says the copy exists once. Read from
`/proc/self/smaps_rollup` and `/proc/self/smaps`; None where there are none (not Linux).
"""
from __future__ import annotations

from pathlib import Path

GIB = 1024 ** 3


def _fields(lines) -> dict[str, int]:
    """Bytes of the `Rss:` and `Pss:` lines among `lines` of a smaps file (values in kB)."""
    found = {}
    for line in lines:
        key, _, value = line.partition(":")
        if key in ("Rss", "Pss"):
            found[key.lower()] = int(value.split()[0]) * 1024
    return found


def process_usage() -> dict[str, int] | None:
    """{"rss": bytes, "pss": bytes} of this whole process."""
    try:
        return _fields(Path("/proc/self/smaps_rollup").read_text().splitlines()) or None
    except OSError:
        return None


def peak_rss() -> int | None:
    """Bytes of the most this process has had in memory at once (`VmHWM`: its RSS at its peak, loading included)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def rank_figures(offload=None) -> dict[str, float | None]:
    """This process's host memory in GiB, for a benchmark's or a log's table: PSS and RSS now, the peak RSS, and
    layer offload's host copy (`LayerOffload`, if any) with this process's share of it."""
    usage, peak = process_usage() or {}, peak_rss()
    copy = offload.host_usage() if offload is not None else None

    def gib(value):
        return round(value / GIB, 3) if value is not None else None

    return {"host_pss_gib": gib(usage.get("pss")), "host_rss_gib": gib(usage.get("rss")), "host_peak_rss_gib": gib(peak),
            "offload_copy_gib": gib(offload.host_bytes) if offload is not None else None,
            "offload_copy_pss_gib": gib(copy["pss"]) if copy else None}


def mapping_usage(address: int) -> dict[str, int] | None:
    """{"rss", "pss"} in bytes of the mapping of this process that holds `address`, with its `name` (the file or
    shared-memory object it maps) and `inode` (the same in every process that maps the same file); None where it
    is not found."""
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return None
    for at, line in enumerate(lines):
        head = line.split(maxsplit=5)
        if not head or "-" not in head[0] or ":" in head[0]:
            continue
        try:
            start, end = (int(part, 16) for part in head[0].split("-"))
        except ValueError:
            continue
        if start <= address < end:
            body = []
            for following in lines[at + 1:]:
                first = following.split(maxsplit=1)[0] if following.strip() else ""
                if "-" in first and ":" not in first:
                    break  # the next mapping's header
                body.append(following)
            usage: dict = _fields(body)
            usage["name"] = head[5] if len(head) > 5 else ""
            usage["inode"] = int(head[4]) if len(head) > 4 and head[4].isdigit() else 0
            return usage
    return None


def size(nbytes: float) -> str:
    """`nbytes` as a log line says it: GiB from 1 GiB on, MiB below."""
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB else f"{nbytes / 2**20:.1f} MiB"

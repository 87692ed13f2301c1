"""Layer offload under DDP: the ranks of a machine hold one host copy of the swapped blocks together
(`modules/model/shared_host_copy.py`), not one each - and train what they train without it; the copy is gone
when the run ends, also when it is killed. CPU processes over gloo, through the real launch paths."""
from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest
import torch

from modules.model.shared_host_copy import NAME, host_memory_line
from modules.util.host_memory import mapping_usage
from tests.patience import patience
from tests.trainer_helpers import (assert_weights_close, demo_config, latest_backup_weights, launcher_flag,
                                   overrides_for, start_script)

pytestmark = pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="anonymous shared memory is Linux's")

RUN = ("training.max_steps=3", "save.backup_every_n_steps=3", "training.gradient_checkpointing=true",
       "training.precision=fp32", "training.batch_size=2", "optimizer.name=sgd", "training.learning_rate=0.05")
BLOCKS = 6
"""Of the SD demo UNet's repeated blocks (its ResNet and transformer blocks)."""


def test_a_mappings_figures_name_the_shared_file():
    fd = os.memfd_create(NAME, os.MFD_CLOEXEC)
    try:
        os.posix_fallocate(fd, 0, 1 << 20)
        mapped = torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=1 << 20, dtype=torch.uint8)
        mapped.fill_(1)
        usage = mapping_usage(mapped.data_ptr() + 4096)
    finally:
        os.close(fd)
    assert usage is not None and f"/memfd:{NAME}" in usage["name"] and usage["inode"] > 0
    assert usage["rss"] == 1 << 20 and usage["pss"] == 1 << 20  # this process alone maps it
    assert mapping_usage(0) is None


def test_the_host_memory_line_says_one_copy_only_when_the_ranks_map_one_file():
    here = ("host", "boot")
    process = {"rss": 3 << 30, "pss": 2 << 30}

    def rank(inode, pss, sharing):
        return {"machine": here, "process": process, "copy": {"rss": 1 << 30, "pss": pss, "inode": inode},
                "bytes": 1 << 30, "sharing": sharing}

    shared = host_memory_line([rank(7, 1 << 29, 2), rank(7, 1 << 29, 2)])
    assert shared.startswith("Host memory after the first step: rank 0 PSS 2.00 GiB (RSS 3.00 GiB), rank 1 PSS")
    assert "one copy of 1.00 GiB shared by 2 processes, their shares of it 512.0 MiB (rank 0) + 512.0 MiB (rank 1)" \
        in shared
    apart = host_memory_line([rank(7, 1 << 30, 1), rank(8, 1 << 30, 1)])
    assert "2 copies of 1.00 GiB, one per process" in apart


@pytest.fixture(scope="module")
def cache_dir(tandem_home, tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("latent_cache")


def _two_ranks(workspace: Path, cache: Path, *overrides: str) -> None:
    from modules.distributed.launch import launch
    cfg = demo_config(workspace, cache, *RUN, *overrides, "multi_gpu.enabled=true", "multi_gpu.num_gpus=2",
                      "multi_gpu.launcher=spawn")
    assert launch(cfg) == 0


def _sizes(text: str) -> list[float]:
    return [float(n) * (2 ** 30 if unit == "GiB" else 2 ** 20) for n, unit in re.findall(r"([\d.]+) (GiB|MiB)", text)]


def _shm_files() -> set[str]:
    """Tandem's files in /dev/shm (other processes of the machine keep theirs there too)."""
    return {name for name in os.listdir("/dev/shm") if "tandem" in name.lower()} if os.path.isdir("/dev/shm") else set()


@pytest.mark.slow
def test_two_ranks_share_one_host_copy_and_train_what_they_train_without_offload(tmp_path, cache_dir, capfd):
    before = _shm_files()
    _two_ranks(tmp_path / "off", cache_dir, "multi_gpu.layer_offload=off")
    capfd.readouterr()
    _two_ranks(tmp_path / "on", cache_dir, f"multi_gpu.layer_offload={BLOCKS}")
    out = capfd.readouterr().out
    assert f"Layer offload (multi_gpu.layer_offload): {BLOCKS} of " in out, out[-3000:]
    assert "host memory shared by the 2 processes of this machine (one copy" in out, out[-3000:]
    line = next(line for line in out.splitlines() if "Host memory after the first step" in line)
    copy = line.split("layer offload's host copy: ", 1)[1]
    assert copy.startswith("one copy of ") and "shared by 2 processes" in copy, line
    whole, *shares = _sizes(copy)
    assert len(shares) == 2 and whole > 0
    # Each rank's PSS of the copy is its share of pages both map: together one copy, not two.
    assert sum(shares) <= 1.2 * whole, line
    off, on = latest_backup_weights(tmp_path / "off"), latest_backup_weights(tmp_path / "on")
    assert off.keys() == on.keys() and any("lora" in k for k in off)
    assert_weights_close(on, off, atol=1e-6)
    assert _shm_files() <= before, "the run left files in /dev/shm"


def _mapping_of_copy(pid: int) -> int | None:
    """The inode of the shared host copy `pid` maps (None: none)."""
    try:
        maps = Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return None
    found = [line.split()[4] for line in maps.splitlines() if f"/memfd:{NAME}" in line]
    return int(found[0]) if found else None


def _mapped_anywhere(inode: int) -> list[int]:
    """Processes that still map the shared file `inode`."""
    holders = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                maps = Path(f"/proc/{entry}/maps").read_text()
            except OSError:
                continue
            if any(f"/memfd:{NAME}" in line and line.split()[4] == str(inode) for line in maps.splitlines()):
                holders.append(int(entry))
    return holders


@pytest.mark.slow
def test_a_killed_run_leaves_no_shared_copy_behind(tmp_path, cache_dir):
    """The launcher SIGKILLed mid-run: its workers die with it (PDEATHSIG), and with them the last mappings of the
    shared copy - which had no name to leave behind in /dev/shm."""
    from tests.integration.test_distributed import _worker_pids, read_until_step

    before = _shm_files()
    args = ["--config-path", "#demo", "--device", "cpu", "--num-gpus", "2", *launcher_flag("spawn"),
            *overrides_for(tmp_path / "ws", cache_dir, "training.max_steps=100000", "training.gradient_checkpointing=true",
                           f"multi_gpu.layer_offload={BLOCKS}")]
    proc = start_script("train_multi_gpu.py", *args, start_new_session=True)
    try:
        read_until_step(proc, 2)
        mapped = {pid: _mapping_of_copy(pid) for pid in _worker_pids(proc.pid)}  # with the launch's helpers
        mapped = {pid: inode for pid, inode in mapped.items() if inode is not None}
        assert len(mapped) == 2 and len(set(mapped.values())) == 1, mapped  # both ranks map one file
        inode = next(iter(mapped.values()))
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=patience(30))
        deadline = time.monotonic() + patience(60)
        while _mapped_anywhere(inode) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _mapped_anywhere(inode), "processes still map the shared copy after the run was killed"
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert _shm_files() <= before, "the run left files in /dev/shm"

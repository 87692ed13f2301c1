"""GPU detection and live utilisation, without initialising CUDA in the GUI process.

The GUI later starts training that may fork (spawn launcher, DataLoader workers); a CUDA context
created here first would be of no use to them and costs memory on every GPU. So detection uses
nvidia-ml-py when it is installed and otherwise asks torch in a short subprocess.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass

_PROBE = ("import json, torch\n"
          "n = torch.cuda.device_count() if torch.cuda.is_available() else 0\n"
          "props = [torch.cuda.get_device_properties(i) for i in range(n)]\n"
          "print(json.dumps([[i, p.name, p.total_memory // 2**20] for i, p in enumerate(props)]))\n")


@dataclass(frozen=True)
class GpuInfo:
    index: int
    name: str
    memory_mib: int

    def label(self) -> str:
        return f"GPU {self.index}: {self.name} ({self.memory_mib / 1024:.0f} GiB)"


@dataclass(frozen=True)
class GpuUsage:
    index: int
    utilisation_pct: int
    memory_used_mib: int
    memory_total_mib: int

    def label(self) -> str:
        return (f"GPU {self.index}: {self.utilisation_pct}% · "
                f"{self.memory_used_mib / 1024:.1f}/{self.memory_total_mib / 1024:.0f} GiB")


def _nvml():
    if os.environ.get("CUDA_VISIBLE_DEVICES") is not None:
        return None  # NVML numbers all GPUs; training numbers only the visible ones
    try:
        import pynvml
        pynvml.nvmlInit()
        return pynvml
    except Exception:  # not installed, no driver, or no GPU: the features that need it hide
        return None


def detect_gpus(python: str = sys.executable, timeout_s: float = 60.0) -> list[GpuInfo]:
    """The GPUs training would see, by index. Empty when there are none or torch cannot tell."""
    nvml = _nvml()
    if nvml is not None:
        gpus = []
        for i in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(i)
            name = nvml.nvmlDeviceGetName(handle)
            name = name.decode() if isinstance(name, bytes) else name
            gpus.append(GpuInfo(i, name, nvml.nvmlDeviceGetMemoryInfo(handle).total // 2**20))
        return gpus
    try:
        result = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True, timeout=timeout_s)
        rows = json.loads(result.stdout.strip().splitlines()[-1]) if result.returncode == 0 else []
    except (subprocess.TimeoutExpired, OSError, ValueError, IndexError):
        rows = []
    return [GpuInfo(int(i), str(name), int(mem)) for i, name, mem in rows]


class UsageMonitor:
    """Per-GPU utilisation and memory through NVML; `available` is False without nvidia-ml-py."""

    def __init__(self):
        self._nvml = _nvml()

    @property
    def available(self) -> bool:
        return self._nvml is not None

    def read(self) -> list[GpuUsage]:
        if self._nvml is None:
            return []
        nvml, usage = self._nvml, []
        for i in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(i)
            memory = nvml.nvmlDeviceGetMemoryInfo(handle)
            rates = nvml.nvmlDeviceGetUtilizationRates(handle)
            usage.append(GpuUsage(i, int(rates.gpu), memory.used // 2**20, memory.total // 2**20))
        return usage

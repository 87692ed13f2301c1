"""GPU detection and live utilisation, without initialising CUDA in the GUI process.

The GUI later starts training that may fork (spawn launcher, DataLoader workers); a CUDA context
created here first would be of no use to them and costs memory on every GPU. So detection uses NVML
(nvidia-ml-py, a dependency on Linux and Windows) and otherwise asks torch in a short subprocess.
NVML numbers GPUs in PCI bus order, as nvidia-smi does; the GUI starts training with
CUDA_DEVICE_ORDER=PCI_BUS_ID so that CUDA's numbers (device_indexes, ranks) are the same ones.
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
    temperature_c: int | None = None

    def label(self) -> str:
        temperature = f" · {self.temperature_c} °C" if self.temperature_c is not None else ""
        return (f"GPU {self.index}: {self.utilisation_pct}% · "
                f"{self.memory_used_mib / 1024:.1f}/{self.memory_total_mib / 1024:.0f} GiB{temperature}")


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
    """Per-GPU utilisation, memory and temperature through NVML (nvidia-ml-py, installed with Tandem on
    Linux and Windows). `available` is False without it or without an NVIDIA driver; a GPU whose reading
    fails (fallen off the bus, a driver reset) is left out of that reading rather than failing the GUI."""

    def __init__(self, nvml=None):
        self._nvml = nvml if nvml is not None else _nvml()

    @property
    def available(self) -> bool:
        return self._nvml is not None

    def read(self) -> list[GpuUsage]:
        if self._nvml is None:
            return []
        nvml, usage = self._nvml, []
        try:
            count = nvml.nvmlDeviceGetCount()
        except Exception:  # noqa: BLE001 - the driver went away: nothing to show this time
            return []
        for i in range(count):
            try:
                handle = nvml.nvmlDeviceGetHandleByIndex(i)
                memory = nvml.nvmlDeviceGetMemoryInfo(handle)
                rates = nvml.nvmlDeviceGetUtilizationRates(handle)
            except Exception:  # noqa: BLE001
                continue
            try:
                temperature = int(nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU))
            except Exception:  # noqa: BLE001 - some boards (and vGPUs) have no sensor
                temperature = None
            usage.append(GpuUsage(i, int(rates.gpu), memory.used // 2**20, memory.total // 2**20, temperature))
        return usage

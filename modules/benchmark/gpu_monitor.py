"""What the GPUs' clocks, power and temperature did during a run (`nvidia-smi`, once a second).

A run whose steps slow down over time, or a multi-GPU run slower per GPU than a single-GPU run, may be
the card (power or heat lowering its clock) rather than the code; the end-to-end harness keeps this
summary beside each run's timings so the two can be told apart.
"""
from __future__ import annotations

import shutil
import statistics
import subprocess
import threading

FIELDS = ("index", "clocks.sm", "power.draw", "temperature.gpu", "utilization.gpu")


class GpuMonitor:
    """Samples every GPU from `start()` to `stop()`; `summary()` then describes the GPUs in `devices`
    (indices as nvidia-smi numbers them; None: all). Does nothing where there is no nvidia-smi."""

    def __init__(self, devices: str | None = None, interval_ms: int = 1000):
        self.devices = None if devices is None else {int(d) for d in devices.split(",") if d.strip()}
        self.interval_ms = interval_ms
        self.lines: list[str] = []
        self._proc: subprocess.Popen | None = None
        self._reader: threading.Thread | None = None

    def start(self) -> "GpuMonitor":
        smi = shutil.which("nvidia-smi")
        if smi:
            self._proc = subprocess.Popen([smi, f"--query-gpu={','.join(FIELDS)}", "--format=csv,noheader,nounits",
                                           f"--loop-ms={self.interval_ms}"], stdout=subprocess.PIPE,
                                          stderr=subprocess.DEVNULL, text=True)
            self._reader = threading.Thread(target=lambda: self.lines.extend(self._proc.stdout), daemon=True)
            self._reader.start()
        return self

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
            self._reader.join(5)

    def summary(self) -> dict[str, dict[str, float]]:
        return summarize(self.lines, self.devices)


def summarize(lines: list[str], devices: set[int] | None = None) -> dict[str, dict[str, float]]:
    """Per GPU: the SM clock's median over the run and over its first and last quarter (a drop between them
    is the card slowing down), its lowest, the median power and utilization, the highest temperature."""
    samples: dict[int, list[tuple[float, float, float, float]]] = {}
    for line in lines:
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != len(FIELDS):
            continue
        try:
            index, clock, power, temperature, utilization = int(parts[0]), *map(float, parts[1:])
        except ValueError:  # "[N/A]" where a card does not report a field
            continue
        if devices is None or index in devices:
            samples.setdefault(index, []).append((clock, power, temperature, utilization))
    result = {}
    for index, rows in sorted(samples.items()):
        clocks = [r[0] for r in rows]
        quarter = max(1, len(rows) // 4)
        result[str(index)] = {"samples": len(rows), "sm_mhz_median": statistics.median(clocks),
                              "sm_mhz_first_quarter": statistics.median(clocks[:quarter]),
                              "sm_mhz_last_quarter": statistics.median(clocks[-quarter:]), "sm_mhz_min": min(clocks),
                              "power_w_median": round(statistics.median(r[1] for r in rows), 1),
                              "temperature_c_max": max(r[2] for r in rows),
                              "utilization_median": statistics.median(r[3] for r in rows)}
    return result

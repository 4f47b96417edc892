"""How busy the GPU was over a run: NVML utilisation where NVML answers, else the CUDA-event spans of the steps,
else (reference runner) forward + encode time over wall. One row field with its source named, so numbers from
different sources are never compared unlabelled.
"""
from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np


class NvmlSampler:
    """GPU utilisation (% of time a kernel ran, as nvidia-smi reports it) and memory used, every `period_s`."""

    def __init__(self, period_s: float = 0.05) -> None:
        self.samples: list[tuple[float, float, float]] = []  # (perf_counter, util %, memory used bytes)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml, self._handle = pynvml, pynvml.nvmlDeviceGetHandleByIndex(0)
        except Exception:  # no NVML here (CPU, or a machine without the library)
            self._nvml = self._handle = None
        self.period_s = period_s

    @property
    def available(self) -> bool:
        return self._handle is not None

    def __enter__(self) -> NvmlSampler:
        if self.available:
            self._thread = threading.Thread(target=self._run, daemon=True, name="nvml-sampler")
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        nv, h = self._nvml, self._handle
        while not self._stop.wait(self.period_s):
            util = nv.nvmlDeviceGetUtilizationRates(h).gpu
            mem = nv.nvmlDeviceGetMemoryInfo(h).used
            self.samples.append((time.perf_counter(), float(util), float(mem)))

    def summary(self, t0: float, t1: float) -> dict[str, float | None]:
        inside = [s for s in self.samples if t0 <= s[0] <= t1]
        if not inside:
            return {"nvml_util_mean": None, "nvml_samples": 0, "nvml_memory_used_max_bytes": None}
        return {"nvml_util_mean": float(np.mean([s[1] for s in inside])) / 100, "nvml_samples": len(inside),
                "nvml_memory_used_max_bytes": max(s[2] for s in inside)}


def busy_fields(nvml_util_mean: float | None, device_s: list[float], runner_s: float, wall: float) -> dict[str, Any]:
    """event_busy_fraction, and gpu_busy_fraction from the best source this run has, with gpu_busy_source."""
    row: dict[str, Any] = {"event_busy_fraction": sum(device_s) / wall if device_s else None}
    if nvml_util_mean is not None:
        row["gpu_busy_fraction"], row["gpu_busy_source"] = nvml_util_mean, "nvml utilization.gpu, 50 ms samples"
    elif row["event_busy_fraction"] is not None:
        row["gpu_busy_fraction"], row["gpu_busy_source"] = row["event_busy_fraction"], "cuda events around each step"
    else:
        row["gpu_busy_fraction"] = runner_s / wall
        row["gpu_busy_source"] = "reference runner: forward + encode time / wall"
    return row

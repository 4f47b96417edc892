"""A GPU context stand-in for CPU tests of the op launchers' argument checks: any launch is a failure."""
from __future__ import annotations

from types import SimpleNamespace

from gpu_engine.cuda.arena import Arena
from gpu_engine.cuda.context import DArray


class NoLaunch:
    """Stands in for CudaDevice: any launch means validation let a bad call through."""

    info = SimpleNamespace(sm_count=132)

    def launch(self, *args, **kwargs):
        raise AssertionError(f"launch reached with bad arguments: {args[:2]}")


def no_launch_ctx() -> SimpleNamespace:
    """What the launchers read from a GpuContext: the device (here refusing every launch) and the arena."""
    return SimpleNamespace(device=NoLaunch(), arena=Arena(base=1 << 30, capacity=1 << 30))


def arr(shape: tuple[int, ...], dtype: str = "bf16") -> DArray:
    """A device array descriptor at a fixed fake address (nothing is ever read or written there)."""
    return DArray(1 << 20, shape, dtype)

"""Exceptions of the CUDA backend (each message says what to do about it)."""
from __future__ import annotations

from ..errors import EngineError


class CudaBackendError(EngineError, RuntimeError):
    """Base class of every error this package raises on purpose."""


class CudaUnavailable(CudaBackendError):
    """No usable GPU, driver or cuda-python here (the CPU reference runner still works)."""


class KernelCompileError(CudaBackendError):
    """NVRTC rejected a kernel source; the message carries the compiler log."""


class ArenaExhausted(CudaBackendError):
    """The start-up memory budget is too small for what was asked of it."""


class ShapeError(CudaBackendError, ValueError):
    """An op was called with arrays whose shapes or dtypes do not fit together."""

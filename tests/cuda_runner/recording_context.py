"""A stand-in for the CUDA runner's context in upload tests: empty() hands out distinct pointers and
device.upload() records the host bytes sent to each, checked against the shape and dtype that were asked for."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from gpu_engine.cuda.context import DArray

NUMPY_OF = {"bf16": np.uint16, "f32": np.float32, "u8": np.uint8, "u32": np.uint32}


class RecordingContext:
    def __init__(self) -> None:
        self.names: dict[int, tuple[str, tuple[int, ...], str]] = {}
        self.sent: dict[str, np.ndarray] = {}
        self.device = SimpleNamespace(upload=self._upload)
        self._next = 4096

    def empty(self, shape: tuple[int, ...], dtype: str, name: str) -> DArray:
        ptr, self._next = self._next, self._next + 4096
        self.names[ptr] = (name, tuple(shape), dtype)
        return DArray(ptr, tuple(shape), dtype)

    def _upload(self, ptr: int, host: np.ndarray) -> None:
        name, shape, dtype = self.names[ptr]
        assert host.shape == shape and host.dtype == NUMPY_OF[dtype], (name, host.shape, host.dtype)
        self.sent[name] = np.array(host, copy=True)

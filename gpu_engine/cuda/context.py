"""GpuContext: the device, the start-up arena and the cuBLASLt handle, plus typed device arrays.

Everything the runner puts on the GPU is a DArray carved from the arena; there are no other allocations.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import prod
from pathlib import Path

import numpy as np

from .arena import Arena
from .bf16 import bf16_bits_to_f32, f32_to_bf16_bits
from .device import CudaDevice, ModuleCache
from .errors import ArenaExhausted, ShapeError
from .gemm import CublasLt

ITEMSIZE = {"bf16": 2, "f32": 4, "i32": 4, "u32": 4, "u8": 1}  # u8: FP8 (e4m3) bytes, carried raw
_HOST_DTYPE = {"bf16": np.uint16, "f32": np.float32, "i32": np.int32, "u32": np.uint32, "u8": np.uint8}
WORKSPACE_BYTES = 32 << 20  # cuBLASLt workspace; Hopper kernels ask for up to 32 MiB


@dataclass(frozen=True)
class DArray:
    """A typed view of arena memory (C-contiguous, row-major)."""

    ptr: int
    shape: tuple[int, ...]
    dtype: str

    @property
    def size(self) -> int:
        return prod(self.shape)

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.dtype]

    @property
    def nbytes(self) -> int:
        return self.size * self.itemsize

    def view(self, shape: tuple[int, ...], offset_elems: int = 0) -> DArray:
        """Reinterpret part of this array (same dtype) with another shape."""
        if offset_elems + prod(shape) > self.size:
            raise ShapeError(f"view {shape} at +{offset_elems} exceeds array of {self.shape}")
        return DArray(self.ptr + offset_elems * self.itemsize, shape, self.dtype)

    def at(self, offset_elems: int) -> DArray:
        """Flat view from an element offset to the end: a column slice of a wider row-major buffer, to be read
        with that buffer's row stride (e.g. the gate half of a fused q|gate projection)."""
        if not 0 <= offset_elems < self.size:
            raise ShapeError(f"offset {offset_elems} outside array of {self.shape}")
        return DArray(self.ptr + offset_elems * self.itemsize, (self.size - offset_elems,), self.dtype)


class GpuContext:
    def __init__(self, budget_bytes: int, device_id: int = 0, module_cache: Path | None = None) -> None:
        self.device = CudaDevice(device_id, ModuleCache(module_cache))
        free, _ = self.device.mem_info()
        if budget_bytes > free:
            raise ArenaExhausted(f"GPU memory budget {budget_bytes} bytes exceeds the {free} bytes free on the device; "
                                 f"lower the budget (DOCPIPE_CUDA_MEMORY_FRACTION or memory_budget=)")
        self.arena = Arena(self.device.malloc(budget_bytes), budget_bytes)
        self.blas = CublasLt(self.device, self.arena.alloc(WORKSPACE_BYTES, "cublaslt-workspace"), WORKSPACE_BYTES)

    def empty(self, shape: tuple[int, ...], dtype: str, name: str) -> DArray:
        if dtype not in ITEMSIZE:
            raise ShapeError(f"unknown dtype {dtype!r}")
        arr = DArray(0, tuple(int(s) for s in shape), dtype)
        return DArray(self.arena.alloc(arr.nbytes, name), arr.shape, dtype)

    def to_device(self, host: np.ndarray, dtype: str, name: str, out: DArray | None = None) -> DArray:
        """Upload (float arrays are rounded to bf16 when dtype == 'bf16')."""
        data = f32_to_bf16_bits(host) if dtype == "bf16" else np.ascontiguousarray(host, _HOST_DTYPE[dtype])
        arr = out or self.empty(host.shape, dtype, name)
        if arr.nbytes != data.nbytes or arr.dtype != dtype:
            raise ShapeError(f"upload of {host.shape} {dtype} into {arr.shape} {arr.dtype}")
        self.device.upload(arr.ptr, data)
        return arr

    def to_host(self, arr: DArray) -> np.ndarray:
        """Download; bf16 comes back as float32 (exact)."""
        host = np.empty(arr.shape, _HOST_DTYPE[arr.dtype])
        self.device.download(host, arr.ptr)
        return bf16_bits_to_f32(host).reshape(arr.shape) if arr.dtype == "bf16" else host

    def poison(self, arr: DArray) -> None:
        """Fill with 0xFF bytes: NaN for floats, -1 for ints (catches unwritten outputs)."""
        self.device.memset(arr.ptr, 0xFF, arr.nbytes)

    def close(self) -> None:
        self.blas.close()
        self.device.free_all()

"""Checkpoint tensors as they sit in the files, and the float32 view the reference runner reads.

`read_safetensors` maps one file: every tensor is a read-only view of one `np.memmap` at the offsets of the
safetensors header (8-byte little-endian header length, JSON header, data), because numpy has no bfloat16 or
float8 (safetensors' numpy API reads them only once ml_dtypes has registered the names, and copies them). BF16 is
kept as its uint16 bit pattern, F8_E4M3 as uint8.

`Tensors` is a component's tensors by name. Reading an entry gives float32: F32 a view of the mapped file, F16 and
BF16 widened (BF16 = the high 16 bits of a float32), block-FP8 weights dequantised exactly. The float32 copy is made
the first time an entry is read and kept, so only a runner that wants float32 (the reference) pays for it.
`raw(name)` gives the stored form with no conversion (uint16 bf16 bits, float16, float32: views of the mapped file);
`fp8(name)` the Fp8Tensor (e4m3 bits + block scales) of a block-FP8 weight.
"""
from __future__ import annotations

import json
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors import safe_open

from . import fp8
from .config import ModelLoadError

# safetensors dtype tag -> how its bytes are viewed (BF16 as its bit pattern, F8_E4M3 as its byte)
STORED_DTYPES: dict[str, np.dtype] = {
    "F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2"), "F8_E4M3": np.dtype("u1"),
}


class CheckpointError(ModelLoadError):
    """Weight files are missing, unreadable, or do not match config.json (names / shapes / formats)."""


@dataclass(frozen=True)
class StoredTensor:
    """One tensor as it sits in the mapped file."""

    dtype: str  # safetensors dtype tag, a key of STORED_DTYPES
    raw: np.ndarray  # read-only view of the file bytes in STORED_DTYPES[dtype]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.raw.shape)

    def to_float32(self) -> np.ndarray:
        if self.dtype == "F32":
            return self.raw  # zero-copy view of the mapped file
        if self.dtype == "F16":
            return self.raw.astype(np.float32)
        if self.dtype == "BF16":
            return (self.raw.astype(np.uint32) << 16).view(np.float32)  # BF16 is the upper half of a float32
        return fp8.e4m3_to_float32(self.raw)  # a bare F8_E4M3 tensor: the loader pairs weights with scales first


@dataclass(frozen=True)
class Fp8Tensor:
    """A block-FP8 Linear weight: e4m3fn bits and the inverse scale of each block (gpu_engine/fp8.py)."""

    bits: np.ndarray  # uint8 [out, in]: a view of the file, or quantised at load
    scale_inv: np.ndarray  # float32 [ceil(out / block[0]), ceil(in / block[1])]
    block: tuple[int, int]
    scale_dtype: str  # how the scales were stored ("BF16" or "F32"; "F32" when quantised at load)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.bits.shape)

    def dequantize(self) -> np.ndarray:
        return fp8.dequantize(self.bits, self.scale_inv, self.block)


Entry = StoredTensor | Fp8Tensor


class Tensors(Mapping[str, np.ndarray]):
    """A component's tensors by name, float32 on read (see the module docstring)."""

    def __init__(self, entries: Mapping[str, Entry]) -> None:
        self._entries = dict(entries)
        self._float32: dict[str, np.ndarray] = {}

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self._float32:
            entry = self._entries[name]
            self._float32[name] = entry.dequantize() if isinstance(entry, Fp8Tensor) else entry.to_float32()
        return self._float32[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def raw(self, name: str) -> np.ndarray:
        """The stored array with no conversion; a block-FP8 weight has none (use fp8())."""
        entry = self._entries[name]
        if isinstance(entry, Fp8Tensor):
            raise TypeError(f"{name} is a block-FP8 weight: read its bits and scales with fp8({name!r})")
        return entry.raw

    def stored_dtype(self, name: str) -> str:
        """The dtype tag as stored ("F32", "F16", "BF16"), or "FP8" for a block-FP8 weight."""
        entry = self._entries[name]
        return "FP8" if isinstance(entry, Fp8Tensor) else entry.dtype

    def fp8(self, name: str) -> Fp8Tensor | None:
        entry = self._entries[name]
        return entry if isinstance(entry, Fp8Tensor) else None

    def fp8_names(self) -> list[str]:
        return [n for n, e in self._entries.items() if isinstance(e, Fp8Tensor)]


def raw_tensor(tensors: Mapping[str, np.ndarray], name: str) -> np.ndarray:
    """The stored form of `name` when `tensors` came from the loader, else the array itself (a plain dict built by
    a benchmark or check is already in the form its builder chose, e.g. uint16 bf16 bits)."""
    return tensors.raw(name) if isinstance(tensors, Tensors) else tensors[name]


def read_safetensors(path: Path) -> dict[str, StoredTensor]:
    """Index one safetensors file: every tensor as a view into one read-only memory map of the file."""
    try:
        with safe_open(str(path), framework="np") as f:  # validates header and sizes against the file
            names = list(f.keys())
    except Exception as exc:  # safetensors raises its own SafetensorError for truncated / corrupt files
        raise CheckpointError(f"{path}: not a readable safetensors file (truncated or corrupt?): {exc}") from exc
    with open(path, "rb") as fh:
        (header_len,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(header_len))
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + header_len)
    tensors: dict[str, StoredTensor] = {}
    for name in names:
        info = header[name]
        dtype = STORED_DTYPES.get(info["dtype"])
        if dtype is None:
            raise CheckpointError(f"{path}: tensor {name} has dtype {info['dtype']}; only "
                                  f"{', '.join(STORED_DTYPES)} are supported")
        begin, end = info["data_offsets"]
        tensors[name] = StoredTensor(info["dtype"], data[begin:end].view(dtype).reshape(tuple(info["shape"])))
    return tensors

"""The device layer: one GPU, one stream, kernels compiled by NVRTC (cached on disk), raw memory copies.

Built on `cuda.core` (Device, Program, ObjectCode, LaunchConfig, launch, events, graph builders) with
`cuda.bindings.driver` for what cuda.core leaves out (plain cuMemAlloc of the start-up budget, async memcpy and
memset on raw addresses). Nothing here is tied to one card: the compile target is read off the device.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .errors import CudaUnavailable, KernelCompileError
from .staging import STAGING_BYTES, StagingRing

KERNEL_DIR = Path(__file__).parent / "kernels"
_DEFAULT_SHARED_LIMIT = 48 * 1024  # dynamic shared memory a kernel may take without opting in
_INCLUDE = re.compile(r'^#include "([\w.]+)"\s*$', re.MULTILINE)


def _import_cuda() -> tuple[Any, Any, Any]:
    try:
        import cuda.core as core
        from cuda.bindings import driver, nvrtc
    except ImportError as exc:  # pragma: no cover - depends on the host
        raise CudaUnavailable(f"cuda-python is not installed ({exc}); pip install 'docpipe[cuda]'") from exc
    return core, driver, nvrtc


def require_gpu() -> None:
    """Raise CudaUnavailable (with the reason) unless cuda-python imports and sees at least one GPU."""
    core, _, _ = _import_cuda()
    try:
        count = len(core.Device.get_all_devices())
    except Exception as exc:  # noqa: BLE001 - any driver failure means "no GPU here"
        raise CudaUnavailable(f"no CUDA driver / GPU usable here: {exc}") from exc
    if count == 0:
        raise CudaUnavailable("cuda-python found no GPU")


def check(result: tuple[Any, ...], what: str) -> Any:
    """cuda.bindings calls return (CUresult, *values); raise on failure, return the values."""
    _, driver, _ = _import_cuda()
    err, *values = result
    if err != driver.CUresult.CUDA_SUCCESS:
        _, name = driver.cuGetErrorName(err)
        raise RuntimeError(f"{what} failed: {name.decode() if isinstance(name, bytes) else name}")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def expand_source(path: Path) -> str:
    """Source text with our own `#include "x.cuh"` lines inlined (NVRTC then needs no include path, and the
    cache key covers the headers too). A header is looked up beside the file, then in the package's kernels/
    (so that bench/ and tests/ kernels can use common.cuh)."""
    text = path.read_text()

    def header(m: re.Match[str]) -> str:
        own = path.parent / m.group(1)
        return (own if own.exists() else KERNEL_DIR / m.group(1)).read_text()

    return _INCLUDE.sub(header, text)


# A kernel file holding this line uses instructions of the arch-specific target (wgmma, setmaxnreg: sm_90a on Hopper)
# and is compiled for it; such code runs only on that exact arch, so its launcher must check DeviceInfo.arch first.
ARCH_SPECIFIC_MARK = "// docpipe: arch-specific target"
ARCH_SPECIFIC = ("sm_90",)  # archs whose "a" target NVRTC builds (compute capability 9.0 -> sm_90a)


def compile_arch(arch: str, source: str) -> str:
    """The NVRTC target for `source` on a device of `arch`: `arch`, or its arch-specific form for marked files."""
    return arch + "a" if ARCH_SPECIFIC_MARK in source and arch in ARCH_SPECIFIC else arch


@dataclass(frozen=True)
class DeviceInfo:
    name: str
    arch: str  # e.g. "sm_90"
    sm_count: int
    l2_bytes: int
    total_mem: int


class ModuleCache:
    """cubins on disk, keyed by sha256(source + arch + options + NVRTC version)."""

    def __init__(self, directory: Path | None = None) -> None:
        self.directory = directory or Path.home() / ".cache" / "docpipe" / "cuda_modules"  # CudaOptions.module_cache
        self.directory.mkdir(parents=True, exist_ok=True)
        self.hits = 0
        self.misses = 0

    @staticmethod
    def key(source: str, arch: str, options: tuple[str, ...], compiler: str) -> str:
        h = hashlib.sha256()
        for part in (source, arch, "\0".join(options), compiler):
            h.update(part.encode())
            h.update(b"\x00\x01")
        return h.hexdigest()

    def get(self, key: str) -> bytes | None:
        path = self.directory / f"{key}.cubin"
        if path.exists():
            self.hits += 1
            return path.read_bytes()
        self.misses += 1
        return None

    def put(self, key: str, cubin: bytes) -> None:
        path = self.directory / f"{key}.cubin"
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_bytes(cubin)
        tmp.replace(path)  # atomic: concurrent workers never read half a file


class CudaDevice:
    """One GPU: current context, a non-default stream, compiled modules, raw memory helpers."""

    def __init__(self, device_id: int = 0, cache: ModuleCache | None = None) -> None:
        core, driver, nvrtc = _import_cuda()
        self._core, self._driver = core, driver
        try:
            count = len(core.Device.get_all_devices())
        except Exception as exc:  # noqa: BLE001 - any driver failure means "no GPU here"
            raise CudaUnavailable(f"no CUDA driver / GPU usable here: {exc}") from exc
        if device_id >= count:
            raise CudaUnavailable(f"GPU {device_id} requested but {count} visible")
        self.dev = core.Device(device_id)
        self.dev.set_current()
        self.stream = self.dev.create_stream()
        props = self.dev.properties
        self.info = DeviceInfo(
            name=self.dev.name,
            arch=f"sm_{self.dev.arch}",
            sm_count=props.multiprocessor_count,
            l2_bytes=props.l2_cache_size,
            total_mem=check(driver.cuDeviceTotalMem(self.dev.device_id), "cuDeviceTotalMem"),
        )
        major, minor = _nvrtc_version(nvrtc)
        self._compiler = f"nvrtc-{major}.{minor}"
        self.cache = cache or ModuleCache()
        self._modules: dict[str, Any] = {}
        # Folders searched for <family>.cu, in order; benches and checks add their own (add_kernel_dir).
        self.kernel_dirs: list[Path] = [KERNEL_DIR]
        self._kernels: dict[tuple[str, str], Any] = {}
        self._shared_limits: dict[tuple[str, str], int] = {}  # dynamic shared memory raised per kernel
        self._allocations: list[int] = []
        self._staging: tuple[StagingRing, int, np.ndarray] | None = None  # ring, pinned address, its bytes (lazy)
        self._capturing = False
        # Launch kernels with programmatic dependent launch (see pdl_entry in kernels/common.cuh); sm_90+ only.
        self.pdl = False

    # ---- compilation -------------------------------------------------------------------------------------
    def add_kernel_dir(self, folder: Path) -> None:
        """Also look for kernel files in `folder` (bench- and test-only kernels do not ship in the package)."""
        if folder not in self.kernel_dirs:
            self.kernel_dirs.append(folder)

    def module(self, family: str) -> Any:
        """Compiled module of <family>.cu from the first of kernel_dirs that has it (NVRTC for this device's
        arch; disk-cached)."""
        if family in self._modules:
            return self._modules[family]
        found = [d / f"{family}.cu" for d in self.kernel_dirs if (d / f"{family}.cu").exists()]
        if not found:
            raise KernelCompileError(f"no kernel file {family}.cu in {', '.join(map(str, self.kernel_dirs))}")
        path = found[0]
        source = expand_source(path)
        options = ("std=c++17",)
        arch = compile_arch(self.info.arch, source)
        key = ModuleCache.key(source, arch, options, self._compiler)
        cubin = self.cache.get(key)
        core = self._core
        if cubin is None:
            opts = core.ProgramOptions(arch=arch, std="c++17", name=family)
            try:
                obj = core.Program(source, "c++", opts).compile("cubin")
            except Exception as exc:  # NVRTC errors carry the log in the message
                raise KernelCompileError(f"compiling {path.name} for {arch} failed:\n{exc}") from exc
            cubin = bytes(obj.code)
            self.cache.put(key, cubin)
        mod = core.ObjectCode.from_cubin(cubin, name=family)
        self._modules[family] = mod
        return mod

    def kernel(self, family: str, name: str) -> Any:
        k = self._kernels.get((family, name))
        if k is None:
            k = self.module(family).get_kernel(name)
            self._kernels[(family, name)] = k
        return k

    def launch(self, family: str, name: str, grid: Any, block: Any, *args: Any, shmem: int = 0,
               stream: Any = None) -> None:
        core = self._core
        if shmem > _DEFAULT_SHARED_LIMIT:
            self._allow_shared(family, name, shmem)
        config = core.LaunchConfig(grid=grid, block=block, shmem_size=shmem,
                                   programmatic_stream_serialization=self.pdl)
        core.launch(stream or self.stream, config, self.kernel(family, name), *args)

    def _allow_shared(self, family: str, name: str, nbytes: int) -> None:
        """Raise a kernel's dynamic shared memory limit above the default 48 KiB (once per kernel and size)."""
        if self._shared_limits.get((family, name), 0) >= nbytes:
            return
        driver = self._driver
        attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        check(driver.cuKernelSetAttribute(attr, nbytes, self.kernel(family, name).handle,
                                          driver.CUdevice(self.dev.device_id)),
              f"cuKernelSetAttribute(max dynamic shared memory {nbytes}) of {name}")
        self._shared_limits[(family, name)] = nbytes

    # ---- memory ------------------------------------------------------------------------------------------
    def malloc(self, nbytes: int) -> int:
        """Plain cuMemAlloc (the start-up budget; everything else is sub-allocated from it)."""
        ptr = int(check(self._driver.cuMemAlloc(nbytes), f"cuMemAlloc({nbytes})"))
        self._allocations.append(ptr)
        return ptr

    def free_all(self) -> None:
        self.sync()
        for ptr in self._allocations:
            check(self._driver.cuMemFree(ptr), "cuMemFree")
        self._allocations.clear()
        if self._staging is not None:
            ring, base, _ = self._staging
            ring.drain()
            self._staging = None
            check(self._driver.cuMemFreeHost(base), "cuMemFreeHost")

    def mem_info(self) -> tuple[int, int]:
        free, total = check(self._driver.cuMemGetInfo(), "cuMemGetInfo")
        return int(free), int(total)

    def upload(self, dst: int, host: np.ndarray, stream: Any = None) -> None:
        """Copy `host` to device address `dst`, ordered on the stream; returns without waiting for the GPU (the
        bytes go through the pinned staging ring, staging.py), and `host` may be reused at once."""
        if self._capturing:
            raise RuntimeError("upload inside a CUDA graph capture: a graph must not hold a staging-ring copy")
        raw = np.ascontiguousarray(host).reshape(-1).view(np.uint8)
        ring, base, pinned = self._staging_ring()
        target = stream or self.stream
        for offset, n in ring.pieces(raw.nbytes):
            if n == 0:
                return
            at = ring.reserve(n)
            pinned[at : at + n] = raw[offset : offset + n]
            check(self._driver.cuMemcpyHtoDAsync(dst + offset, base + at, n, target.handle), "cuMemcpyHtoDAsync")
            ring.busy(at, n, target.record())

    def _staging_ring(self) -> tuple[StagingRing, int, np.ndarray]:
        if self._staging is None:
            base = int(check(self._driver.cuMemHostAlloc(STAGING_BYTES, 0), f"cuMemHostAlloc({STAGING_BYTES})"))
            pinned = np.ctypeslib.as_array((ctypes.c_uint8 * STAGING_BYTES).from_address(base))
            self._staging = (StagingRing(STAGING_BYTES), base, pinned)
        return self._staging

    def download(self, host: np.ndarray, src: int, stream: Any = None) -> np.ndarray:
        if not host.flags.c_contiguous:
            raise ValueError("download target must be C-contiguous")
        check(self._driver.cuMemcpyDtoHAsync(host.ctypes.data, src, host.nbytes, self._handle(stream)),
              "cuMemcpyDtoHAsync")
        self.sync(stream)
        return host

    def memset(self, dst: int, byte: int, nbytes: int, stream: Any = None) -> None:
        check(self._driver.cuMemsetD8Async(dst, byte, nbytes, self._handle(stream)), "cuMemsetD8Async")

    def copy(self, dst: int, src: int, nbytes: int, stream: Any = None) -> None:
        check(self._driver.cuMemcpyDtoDAsync(dst, src, nbytes, self._handle(stream)), "cuMemcpyDtoDAsync")

    # ---- ordering and timing -----------------------------------------------------------------------------
    def sync(self, stream: Any = None) -> None:
        (stream or self.stream).sync()

    def event(self) -> Any:
        return self.dev.create_event(self._core.EventOptions(timing_enabled=True))

    def capture(self, enqueue: Any) -> Any:
        """Record everything `enqueue()` launches on this device's stream into an executable CUDA graph.

        During capture the device's stream is swapped for the graph builder's capturing stream, so every op
        (kernels and cuBLASLt alike) records into the graph without knowing about it.
        """
        builder = self.stream.create_graph_builder()
        builder.begin_building()
        saved = self.stream
        self.stream, self._capturing = builder.stream, True
        try:
            enqueue()
        finally:
            self.stream, self._capturing = saved, False
            builder.end_building()
        return builder.complete()

    def launch_graph(self, graph: Any, stream: Any = None) -> None:
        graph.launch(stream or self.stream)

    def stream_handle(self, stream: Any = None) -> int:
        """Raw CUstream address (for cuBLASLt)."""
        return int((stream or self.stream).handle)

    def _handle(self, stream: Any) -> Any:
        return (stream or self.stream).handle


def _nvrtc_version(nvrtc: Any) -> tuple[int, int]:
    err, major, minor = nvrtc.nvrtcVersion()
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise CudaUnavailable(f"NVRTC unusable: {err}")
    return int(major), int(minor)

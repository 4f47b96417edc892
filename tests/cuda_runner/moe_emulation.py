"""A GpuContext stand-in whose memory is a numpy byte buffer and whose MoE-path launches run numpy emulations of
kernels/moe.cu (and of the cuBLASLt GEMM and silu_mul the layer also uses), so that moe.py's host code and
check_moe's checks run end to end on the CPU (tests/cuda_runner/test_moe_emulated.py).

The emulations follow the kernels' contracts, not their arithmetic order: moe_route's rule (largest probability
first, ties toward the lower id, renormalised), moe_plan's tables with each expert's rows in a shuffled order (the
device's order within an expert is atomic), the grouped GEMMs walking the tile table and rounding as the kernels
store (bf16: gate and up rounded before silu, the product rounded), the combine in float32 rounded once.
The fused decode kernels (moe_decode_*) run moe_decode_emulation's mirror of their arithmetic order.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np

from gpu_engine.cuda.arena import Arena
from gpu_engine.cuda.bf16 import bf16_bits_to_f32, f32_to_bf16_bits
from gpu_engine.cuda.context import ITEMSIZE, DArray
from gpu_engine.cuda.moe_decode import DOWN_WARPS, GATE_UP_WARPS, ROUTE_WARPS
from gpu_engine.cuda.moe_plan import host_plan
from tests.cuda_runner import moe_decode_emulation as fused

_NP = {"bf16": np.uint16, "f32": np.float32, "i32": np.int32, "u32": np.uint32, "u8": np.uint8}
BASE = 1 << 16


class _Event:
    """Host-clock stand-in for a timing event (emulated work runs at once)."""

    def __init__(self) -> None:
        self.t = 0.0

    @staticmethod
    def record(event: _Event) -> None:
        import time

        event.t = time.perf_counter()

    def sync(self) -> None:
        pass

    def __sub__(self, other: _Event) -> float:
        return (self.t - other.t) * 1e3


def _capture(enqueue: Any) -> Any:
    """A 'graph' that runs `enqueue` again on every launch (the emulation records nothing)."""
    enqueue()
    return enqueue


class EmulatedContext:
    def __init__(self, nbytes: int = 256 << 20, seed: int = 0) -> None:
        self.mem = np.zeros(nbytes, np.uint8)
        self.arena = Arena(base=BASE, capacity=nbytes)
        self.rng = np.random.default_rng(seed)
        self.device = SimpleNamespace(info=SimpleNamespace(sm_count=132, name="numpy", arch="emulated"),
                                      launch=self._launch, upload=self._upload, download=self._download,
                                      memset=self._memset, copy=self._copy, sync=lambda stream=None: None,
                                      event=_Event, stream=SimpleNamespace(record=_Event.record),
                                      capture=_capture, launch_graph=lambda graph, stream=None: graph(), pdl=False)
        self.blas = SimpleNamespace(linear=self._linear)
        self.launches: list[str] = []

    # ---- memory ----------------------------------------------------------------------------------------------
    def _bytes(self, ptr: int, nbytes: int) -> np.ndarray:
        off = ptr - BASE
        assert 0 <= off and off + nbytes <= self.mem.size, f"access outside the arena at {ptr:#x}+{nbytes}"
        return self.mem[off: off + nbytes]

    def raw(self, ptr: int, dtype: str, count: int) -> np.ndarray:
        return self._bytes(ptr, count * ITEMSIZE[dtype]).view(_NP[dtype])

    def read(self, ptr: int, dtype: str, shape: tuple[int, ...], ld: int | None = None) -> np.ndarray:
        """float32 (or int) values of a row-major [rows, cols] operand with row stride ld."""
        rows, cols = shape
        ld = ld or cols
        flat = self.raw(ptr, dtype, (rows - 1) * ld + cols) if rows else self.raw(ptr, dtype, 0)
        out = np.lib.stride_tricks.as_strided(flat, (rows, cols), (ld * flat.itemsize, flat.itemsize)).copy()
        return bf16_bits_to_f32(out) if dtype == "bf16" else out

    def write(self, ptr: int, dtype: str, values: np.ndarray, ld: int | None = None) -> None:
        values = np.asarray(values)
        rows, cols = values.shape
        ld = ld or cols
        bits = f32_to_bf16_bits(values.astype(np.float32)) if dtype == "bf16" else values.astype(_NP[dtype])
        for r in range(rows):
            self.raw(ptr + r * ld * ITEMSIZE[dtype], dtype, cols)[:] = bits[r]

    def empty(self, shape: tuple[int, ...], dtype: str, name: str) -> DArray:
        arr = DArray(0, tuple(int(s) for s in shape), dtype)
        return DArray(self.arena.alloc(arr.nbytes, name), arr.shape, dtype)

    def to_device(self, host: np.ndarray, dtype: str, name: str, out: DArray | None = None) -> DArray:
        data = f32_to_bf16_bits(host) if dtype == "bf16" else np.ascontiguousarray(host, _NP[dtype])
        arr = out or self.empty(host.shape, dtype, name)
        self._upload(arr.ptr, data)
        return arr

    def to_host(self, arr: DArray) -> np.ndarray:
        host = self.raw(arr.ptr, arr.dtype, arr.size).copy().reshape(arr.shape)
        return bf16_bits_to_f32(host).reshape(arr.shape) if arr.dtype == "bf16" else host

    def poison(self, arr: DArray) -> None:
        self._memset(arr.ptr, 0xFF, arr.nbytes)

    def _upload(self, ptr: int, host: np.ndarray, stream: Any = None) -> None:
        host = np.ascontiguousarray(host)
        self._bytes(ptr, host.nbytes)[:] = host.reshape(-1).view(np.uint8)

    def _download(self, host: np.ndarray, ptr: int, stream: Any = None) -> np.ndarray:
        host.reshape(-1).view(np.uint8)[:] = self._bytes(ptr, host.nbytes)
        return host

    def _memset(self, ptr: int, byte: int, nbytes: int, stream: Any = None) -> None:
        self._bytes(ptr, nbytes)[:] = byte

    def _copy(self, dst: int, src: int, nbytes: int, stream: Any = None) -> None:
        self._bytes(dst, nbytes)[:] = self._bytes(src, nbytes).copy()

    # ---- GEMM and kernels ------------------------------------------------------------------------------------
    def _linear(self, y: int, x: int, w: int, m: int, n: int, k: int, *, dtype: str = "bf16",
                y_dtype: str | None = None, x_ld: int | None = None, y_ld: int | None = None, **_: Any) -> None:
        xv = self.read(x, dtype, (m, k), x_ld).astype(np.float64)
        wv = self.read(w, dtype, (n, k)).astype(np.float64)
        self.write(y, y_dtype or dtype, (xv @ wv.T).astype(np.float32), y_ld)

    def _launch(self, family: str, name: str, grid: Any, block: Any, *args: Any, shmem: int = 0) -> None:
        self.launches.append(name)
        a = [int(v) if not isinstance(v, float) else v for v in args]
        if name in ("moe_route", "moe_route_v2"):
            self._route(*a)
        elif name == "moe_plan":
            self._plan(*a)
        elif name == "moe_plan_v2":  # the same tables; shared_last: expert E - 1's rows in token order
            self._plan(*a[:6], *a[7:], shared_last=bool(a[6]))
        elif name.startswith("moe_gemm_"):
            self._gemm(name, grid, *a)
        elif name.startswith("moe_decode_route_"):  # moe_decode_route_<dtype>_e<experts>
            self._decode_route(name.split("_")[3], grid, *a)
        elif name.startswith("moe_decode_gate_up_"):
            self._decode_gate_up(name.rsplit("_", 1)[1], grid, *a)
        elif name.startswith("moe_decode_down_"):
            self._decode_down(name.rsplit("_", 1)[1], grid, *a)
        elif name.startswith("moe_combine_"):
            self._combine(name.rsplit("_", 1)[1], *a)
        elif name.startswith("silu_mul_"):
            out, gu, rows, inter = a
            t = name.rsplit("_", 1)[1]
            v = self.read(gu, t, (rows, 2 * inter))
            g, u = v[:, :inter], v[:, inter:]
            self.write(out, t, g / (1 + np.exp(-g)) * u)
        else:
            raise AssertionError(f"no emulation of {family}/{name}")

    def _route(self, logits: int, ld: int, n: int, e: int, k: int, stride: int, ids: int, weights: int,
               gate: int) -> None:
        z = self.read(logits, "f32", (n, e + 1), ld).astype(np.float64)
        p = np.exp(z[:, :e] - z[:, :e].max(axis=-1, keepdims=True))
        p /= p.sum(axis=-1, keepdims=True)
        chosen = np.argsort(-p, axis=-1, kind="stable")[:, :k]
        top = np.take_along_axis(p, chosen, axis=-1)
        sg = 1 / (1 + np.exp(-z[:, e]))
        w = top / top.sum(axis=-1, keepdims=True)
        if stride > k:  # the stacked shared expert as every token's last entry
            chosen = np.concatenate([chosen, np.full((n, 1), e)], axis=1)
            w = np.concatenate([w, sg[:, None]], axis=1)
        self.write(ids, "i32", chosen)
        self.write(weights, "f32", w)
        self.write(gate, "f32", sg[None])

    def _plan(self, ids: int, entries: int, k: int, e: int, tile_m: int, bound: int, offsets: int, tiles: int,
              sorted_token: int, entry_row: int, shared_last: bool = False) -> None:
        flat = self.raw(ids, "i32", entries).copy()
        p = host_plan(flat.reshape(-1, k), e, tile_m)
        assert p.tiles.shape[0] == bound, (p.tiles.shape, bound)
        order = p.entry_row.copy()
        shuffled = list(zip(p.offsets[:-1], p.offsets[1:]))[: e - 1 if shared_last else e]
        for a, b in shuffled:  # the atomic order within an expert: any permutation
            seg = np.nonzero((order >= a) & (order < b))[0]
            order[seg] = a + self.rng.permutation(b - a)
        st = np.empty(entries, np.int32)
        st[order] = np.arange(entries) // k
        self.write(offsets, "i32", p.offsets[None])
        self.write(tiles, "i32", p.tiles)
        self.write(sorted_token, "i32", st[None])
        self.write(entry_row, "i32", order[None])

    def _gemm(self, name: str, grid: Any, y: int, y_ld: int, x: int, x_ld: int, row_src: int, w: int, n: int,
              k: int, tiles: int) -> None:
        t = name.rsplit("_", 1)[1]
        swiglu = "_swiglu_" in name
        bound = grid[1]
        table = self.read(tiles, "i32", (bound, 3))
        outs = n // 2 if swiglu else n
        for expert, first, rows in table:
            if rows <= 0:
                continue
            src = self.read(row_src, "i32", (1, first + rows))[0, first:] if row_src else np.arange(first,
                                                                                                 first + rows)
            xv = np.stack([self.read(x + int(s) * x_ld * ITEMSIZE[t], t, (1, k))[0] for s in src])
            wv = self.read(w + int(expert) * n * k * ITEMSIZE[t], t, (n, k))
            prod = (xv.astype(np.float64) @ wv.astype(np.float64).T).astype(np.float32)
            if swiglu:
                g, u = self._round(prod[:, :outs], t), self._round(prod[:, outs:], t)
                prod = g / (1 + np.exp(-g)) * u
            self.write(y + int(first) * y_ld * ITEMSIZE[t], t, prod, y_ld)

    def _combine(self, t: str, out: int, ys: int, entry_row: int, weights: int, k: int, gate: int, shared: int,
                 n: int, h: int) -> None:
        rows = self.read(entry_row, "i32", (n, k))
        w = self.read(weights, "f32", (n, k)).astype(np.float64)
        g = self.read(gate, "f32", (1, n))[0].astype(np.float64)
        sy = self.read(shared, t, (n, h)).astype(np.float64) if shared else np.zeros((n, h))
        total = rows.max() + 1
        yv = self.read(ys, t, (int(total), h)).astype(np.float64)
        w = np.where(rows >= 0, w, 0.0)  # an entry without a row (-1) adds nothing, as in the kernel
        self.write(out, t, (g[:, None] * sy + np.einsum("nk,nkh->nh", w, yv[np.maximum(rows, 0)])).astype(np.float32))

    # ---- fused decode (moe_decode.py) ---------------------------------------------------------------------
    def _decode_route(self, t: str, grid: Any, x: int, m: int, h: int, router: int, e: int, k: int, logits: int,
                      ld: int, ids: int, weights: int, gate: int) -> None:
        assert grid == -(-(e + 1) // ROUTE_WARPS), grid
        z = fused.router_logits(self.read(x, t, (m, h)), self.read(router, t, (e + 1, h)), t)
        self.write(logits, "f32", z, ld)
        routed = [fused.route_token(row, e, k) for row in z]
        self.write(ids, "i32", np.stack([r[0] for r in routed]))
        self.write(weights, "f32", np.stack([r[1] for r in routed]))
        self.write(gate, "f32", np.array([[r[2] for r in routed]], np.float32))

    def _decode_gate_up(self, t: str, grid: Any, x: int, h: int, ids: int, k: int, e: int, gu: int, inter: int,
                        act: int) -> None:
        m = grid[0] // (k + 1)
        assert grid == (m * (k + 1), -(-inter // GATE_UP_WARPS)), grid
        stacks = self.read(gu, t, ((e + 1) * 2 * inter, h)).reshape(e + 1, 2 * inter, h)
        self.write(act, t, fused.gate_up(self.read(x, t, (m, h)), self.read(ids, "i32", (m, k + 1)), stacks, t))

    def _decode_down(self, t: str, grid: Any, act: int, ids: int, weights: int, k: int, e: int, dn: int, inter: int,
                     h: int, y: int) -> None:
        m = grid[0]
        assert grid == (m, -(-h // DOWN_WARPS)), grid
        stacks = self.read(dn, t, ((e + 1) * h, inter)).reshape(e + 1, h, inter)
        self.write(y, t, fused.down(self.read(act, t, (m * (k + 1), inter)), self.read(ids, "i32", (m, k + 1)),
                                    self.read(weights, "f32", (m, k + 1)), stacks, t))

    @staticmethod
    def _round(v: np.ndarray, t: str) -> np.ndarray:
        return bf16_bits_to_f32(f32_to_bf16_bits(v)) if t == "bf16" else v

    def close(self) -> None:
        pass

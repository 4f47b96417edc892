"""GpuVisionTower's orchestration (buffers, strides, views, op order, geometry upload) checked without a GPU.

The device is emulated: memory is one numpy byte buffer addressed by integers, and each vision kernel / the
cuBLASLt linear is a few lines of numpy with the semantics documented in kernels/vision.cu, rope.cu and gemm.py
(bf16 storage is emulated by rounding every stored value). What this cannot see is the CUDA code itself — the
GPU check (tests/cuda_runner/check_vision.py) covers that — but every address the tower computes is exercised here, on
non-square grids and a two-frame-group item, against the numpy reference tower.
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from gpu_engine.cuda.arena import Arena
from gpu_engine.cuda.bf16 import round_to_bf16
from gpu_engine.cuda.context import GpuContext
from gpu_engine.cuda.vision import GpuVisionTower
from gpu_engine.reference.vision_tower import VisionTower
from tests.cuda_runner.check_vision import CONFIGS, random_vision_weights

BASE = 1 << 32


class FakeDevice:
    info = SimpleNamespace(sm_count=4)

    def __init__(self, nbytes: int) -> None:
        self.mem = np.zeros(nbytes, np.uint8)

    # -- memory ------------------------------------------------------------------------------------------------
    def _bytes(self, ptr: int, nbytes: int) -> np.ndarray:
        off = ptr - BASE
        assert 0 <= off and off + nbytes <= self.mem.size, "access outside the emulated device memory"
        return self.mem[off : off + nbytes]

    def upload(self, dst: int, host: np.ndarray) -> None:
        data = np.ascontiguousarray(host).view(np.uint8).reshape(-1)
        self._bytes(dst, data.size)[:] = data

    def download(self, host: np.ndarray, src: int) -> np.ndarray:
        host.view(np.uint8).reshape(-1)[:] = self._bytes(src, host.nbytes)
        return host

    def memset(self, dst: int, byte: int, nbytes: int) -> None:
        self._bytes(dst, nbytes)[:] = byte

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        self._bytes(dst, nbytes)[:] = self._bytes(src, nbytes).copy()

    def sync(self) -> None:
        pass

    def read(self, ptr: int, count: int, dtype: str) -> np.ndarray:
        if dtype == "bf16":
            bits = self._bytes(ptr, 2 * count).view(np.uint16)
            return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
        return self._bytes(ptr, 4 * count).view({"f32": np.float32, "i32": np.int32}[dtype]).astype(
            np.float64 if dtype == "f32" else np.int64)

    def write(self, ptr: int, values: np.ndarray, dtype: str) -> None:
        v = np.asarray(values, np.float32).reshape(-1)
        if dtype == "bf16":
            from gpu_engine.cuda.bf16 import f32_to_bf16_bits

            self._bytes(ptr, 2 * v.size)[:] = f32_to_bf16_bits(v).view(np.uint8)
        else:
            self._bytes(ptr, 4 * v.size)[:] = v.view(np.uint8)

    # -- kernels -----------------------------------------------------------------------------------------------
    def launch(self, family: str, name: str, grid, block, *args) -> None:
        kernel, t = name.rsplit("_", 1)
        a = [int(x) if isinstance(x, (int, np.integer)) else float(x) for x in args]
        getattr(self, "k_" + kernel)(t, *a)

    def k_layernorm(self, t, out, x, w, b, rows, dim, eps):
        xv = self.read(x, rows * dim, t).reshape(rows, dim)
        mean = xv.mean(1, keepdims=True)
        var = ((xv - mean) ** 2).mean(1, keepdims=True)
        self.write(out, (xv - mean) / np.sqrt(var + eps) * self.read(w, dim, t) + self.read(b, dim, t), t)

    k_layernorm_rows = k_layernorm  # the same function, one warp a row

    def k_bias_act(self, t, out, x, bias, rows, cols, act):
        from gpu_engine.reference.vision_tower import gelu_exact, gelu_tanh

        v = self.read(x, rows * cols, t).reshape(rows, cols) + self.read(bias, cols, t)
        v = {0: lambda z: z, 1: gelu_tanh, 2: gelu_exact}[act](v)
        self.write(out, v, t)

    def k_bias_residual(self, t, x, y, bias, rows, cols):
        v = self.read(x, rows * cols, t).reshape(rows, cols)
        self.write(x, v + self.read(y, rows * cols, t).reshape(rows, cols) + self.read(bias, cols, t), t)

    def k_patch_pos(self, t, x, bias, table, taps, weights, rows, cols):
        tp = self.read(taps, rows * 4, "i32").reshape(rows, 4)
        wt = self.read(weights, rows * 4, "f32").reshape(rows, 4)
        tab = self.read(table, (tp.max() + 1) * cols, t).reshape(-1, cols)
        pos = (wt[:, :, None] * tab[tp]).sum(1)
        self.write(x, self.read(x, rows * cols, t).reshape(rows, cols) + self.read(bias, cols, t) + pos, t)

    def k_rope(self, t, x, tok_stride, head_stride, pos, pos_row_stride, inv, axis, n, heads, rot):
        half = rot // 2
        inv_v = self.read(inv, half, "f32").astype(np.float32)
        ax = self.read(axis, half, "i32")
        pv = self.read(pos, int(ax.max() + 1) * pos_row_stride, "i32").reshape(-1, pos_row_stride)
        item = 2 if t == "bf16" else 4
        for tok in range(n):
            ang = (pv[ax, tok].astype(np.float32) * inv_v).astype(np.float64)
            for h in range(heads):
                ptr = x + (tok * tok_stride + h * head_stride) * item
                v = self.read(ptr, rot, t)
                x1, x2 = v[:half], v[half:]
                self.write(ptr, np.concatenate([x1 * np.cos(ang) - x2 * np.sin(ang),
                                                x2 * np.cos(ang) + x1 * np.sin(ang)]), t)

    def k_softmax_rows(self, t, out, scores, rows, cols, scale):
        z = self.read(scores, rows * cols, "f32").reshape(rows, cols) * scale
        e = np.exp(z - z.max(1, keepdims=True))
        self.write(out, e / e.sum(1, keepdims=True), t)

    def k_cast_from_f32(self, t, out, x, n):
        self.write(out, self.read(x, n, "f32"), t)

    k_softmax_rows_cached = k_softmax_rows  # same function; the GPU check compares the two kernels

    def k_vision_attention(self, t, out, qkv, n, heads, hd, seg, scale):
        W = heads * hd
        v = self.read(qkv, n * 3 * W, t).reshape(n, 3, heads, hd)
        res = np.empty((n, heads, hd))
        for s in range(0, n, seg):
            for h in range(heads):
                q, k, vv = v[s:s + seg, 0, h], v[s:s + seg, 1, h], v[s:s + seg, 2, h]
                sc = q @ k.T * scale
                p = np.exp(sc - sc.max(1, keepdims=True))
                res[s:s + seg, h] = (p / p.sum(1, keepdims=True)) @ vv
        self.write(out, res, t)


class FakeBlas:
    """gemm.CublasLt.linear in numpy, epilogue included: Y = act((Y if accumulate) + X W^T + bias), one rounding
    to the storage type at the store (as cuBLASLt's fused epilogue). epilogues=False emulates a cuBLASLt without
    an algorithm for any epilogue: such a request raises EpilogueUnsupported, as gemm.py does, before any write.
    `calls` records (m, n, k, accumulate, has bias, act) of each non-batched call."""

    def __init__(self, dev: FakeDevice, epilogues: bool = True) -> None:
        self.dev, self.epilogues = dev, epilogues
        self.calls: list[tuple[int, int, int, bool, bool, str]] = []

    def _rows(self, ptr, rows, cols, ld, dtype):
        flat = self.dev.read(ptr, (rows - 1) * ld + cols, dtype)
        return np.stack([flat[r * ld : r * ld + cols] for r in range(rows)])

    def linear(self, y, x, w, m, n, k, *, dtype="bf16", y_dtype=None, x_ld=None, y_ld=None, w_ld=None,
               w_layout="nk", accumulate=False, batch=1, strides=(0, 0, 0), bias=0, act="none"):
        from gpu_engine.cuda.gemm import EpilogueUnsupported, epilogue_name

        epilogue = epilogue_name(bias, act)  # the real argument check
        if epilogue != "none" and not self.epilogues:
            raise EpilogueUnsupported(f"emulated: no algorithm for epilogue {epilogue}")
        if batch > 1:
            assert epilogue == "none" and not accumulate  # batch i: every operand advanced by its stride (elements)
            isz, osz = (4 if dtype == "f32" else 2), (4 if (y_dtype or dtype) == "f32" else 2)
            for i in range(batch):
                self.linear(y + i * strides[2] * osz, x + i * strides[0] * isz, w + i * strides[1] * isz, m, n, k,
                            dtype=dtype, y_dtype=y_dtype, x_ld=x_ld, y_ld=y_ld, w_ld=w_ld, w_layout=w_layout)
            return
        xm = self._rows(x, m, k, x_ld or k, dtype)
        if w_layout == "nk":
            wt = self._rows(w, n, k, w_ld or k, dtype).T
        else:
            wt = self._rows(w, k, n, w_ld or n, dtype)
        result, y_dtype, y_ld = xm @ wt, y_dtype or dtype, y_ld or n
        size = 4 if y_dtype == "f32" else 2
        self.calls.append((m, n, k, accumulate, bias != 0, act))
        if accumulate:
            result = result + self._rows(y, m, n, y_ld, y_dtype)
        if bias:
            result = result + self.dev.read(bias, n, y_dtype)
        if act == "gelu_tanh":
            from gpu_engine.reference.vision_tower import gelu_tanh

            result = gelu_tanh(result)
        for r in range(m):
            self.dev.write(y + r * y_ld * size, result[r], y_dtype)


def fake_context(nbytes: int = 32 << 20, epilogues: bool = True) -> GpuContext:
    ctx = GpuContext.__new__(GpuContext)
    ctx.device = FakeDevice(nbytes)
    ctx.arena = Arena(BASE, nbytes)
    ctx.blas = FakeBlas(ctx.device, epilogues)
    return ctx


@pytest.mark.parametrize("epilogues", [True, False], ids=["epilogue", "no-epilogue"])
@pytest.mark.parametrize("gelu_epilogue", [False, True], ids=["gelu-kernel", "gelu-epilogue"])
@pytest.mark.parametrize("attention", ["kernel", "gemm"])
@pytest.mark.parametrize("dtype,tol", [("f32", 1e-5), ("bf16", 1e-2)])
def test_emulated_tower_matches_reference(dtype: str, tol: float, attention: str, gelu_epilogue: bool,
                                          epilogues: bool, monkeypatch) -> None:
    import gpu_engine.cuda.vision as vision

    monkeypatch.setattr(vision, "GELU_EPILOGUE_IS_TANH", gelu_epilogue)
    rng = np.random.default_rng()
    cfg = SimpleNamespace(**CONFIGS["tiny hd16 gelu-tanh"])
    weights = random_vision_weights(cfg, rng)
    ref_w = weights if dtype == "f32" else {k: round_to_bf16(v) for k, v in weights.items()}
    ref_tower = VisionTower(cfg, ref_w)
    ctx = fake_context(epilogues=epilogues)
    tower = GpuVisionTower(ctx, cfg, weights, dtype, attention=attention)
    for grid in [(1, 4, 6), (2, 6, 4)]:  # non-square; two frame groups = two attention segments
        t, h, w = grid
        pixels = rng.standard_normal((t * h * w, ref_tower.dims.patch_dim)).astype(np.float32)
        ref = ref_tower.encode(pixels if dtype == "f32" else round_to_bf16(pixels), grid)
        mark = ctx.arena.mark()
        out = ctx.empty(ref.shape, dtype, "out")
        ctx.poison(out)
        tower.encode(pixels, grid, out)
        got = ctx.to_host(out)
        err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
        assert np.all(np.isfinite(got)) and err <= tol, (grid, err)
        ctx.arena.release(mark)
        assert ctx.arena.mark() == mark  # encode released its scratch
    _check_block_calls(ctx.blas.calls, cfg, epilogues, gelu_epilogue)


def _check_block_calls(calls: list, cfg: SimpleNamespace, epilogues: bool, gelu_epilogue: bool) -> None:
    """The blocks' GEMMs carry their bias / residual / GELU exactly when the epilogue path is taken."""
    H, inter = cfg.hidden_size, cfg.intermediate_size
    qkv = [c for c in calls if c[1] == 3 * H]
    fc1 = [c for c in calls if c[1] == inter and c[2] == H]
    residual = [c for c in calls if c[1] == H and c[2] in (H, inter)]
    assert qkv and fc1 and residual
    assert all(c[3:] == (False, epilogues, "none") for c in qkv)
    fused_gelu = epilogues and gelu_epilogue
    assert all(c[3:] == (False, fused_gelu, "gelu_tanh" if fused_gelu else "none") for c in fc1)
    assert all(c[3:] == (epilogues, epilogues, "none") for c in residual)


def test_encode_refuses_bad_inputs() -> None:
    from gpu_engine.cuda.vision import VisionEncodeError

    rng = np.random.default_rng()
    cfg = SimpleNamespace(**CONFIGS["tiny hd16 gelu-tanh"])
    ctx = fake_context()
    tower = GpuVisionTower(ctx, cfg, random_vision_weights(cfg, rng), "f32")
    out = ctx.empty((6, cfg.out_hidden_size), "f32", "out")
    patch_dim = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size ** 2
    with pytest.raises(VisionEncodeError, match="multiples of spatial_merge_size"):
        tower.encode(np.zeros((15, patch_dim), np.float32), (1, 3, 5), out)
    with pytest.raises(VisionEncodeError, match="pixel_values must be"):
        tower.encode(np.zeros((24, patch_dim + 1), np.float32), (1, 4, 6), out)
    with pytest.raises(VisionEncodeError, match="output buffer"):
        tower.encode(np.zeros((48, patch_dim), np.float32), (2, 4, 6), out)


def test_emulated_gemm_attention_in_query_blocks(monkeypatch) -> None:
    """A score budget smaller than one segment: the GEMM attention walks blocks of query rows (5, 5, 5, 5, 4)."""
    import gpu_engine.cuda.vision as vision

    monkeypatch.setattr(vision, "SCORES_BYTES", 4 * 24 * 5 * 2)  # 2 heads
    rng = np.random.default_rng()
    cfg = SimpleNamespace(**CONFIGS["hd72 exact-gelu"])
    weights = random_vision_weights(cfg, rng)
    ctx = fake_context(64 << 20)
    tower = GpuVisionTower(ctx, cfg, weights, "f32", attention="gemm")
    pixels = rng.standard_normal((48, tower.dims.patch_dim)).astype(np.float32)
    ref = VisionTower(cfg, weights).encode(pixels, (2, 4, 6))
    out = ctx.empty(ref.shape, "f32", "out")
    ctx.poison(out)
    got = ctx.to_host(tower.encode(pixels, (2, 4, 6), out))
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) <= 1e-5


def test_pixels_given_as_row_blocks_encode_as_the_stacked_array() -> None:
    """encode_vision_batch hands the tower each item's pixels: uploaded into one buffer, the result is the stacked
    array's, bit for bit; blocks that do not add up to the grid are refused."""
    from gpu_engine.cuda.vision import VisionEncodeError

    rng = np.random.default_rng()
    cfg = SimpleNamespace(**CONFIGS["tiny hd16 gelu-tanh"])
    ctx = fake_context()
    tower = GpuVisionTower(ctx, cfg, random_vision_weights(cfg, rng), "f32")
    patch_dim = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size ** 2
    blocks = [rng.standard_normal((24, patch_dim)).astype(np.float32) for _ in range(3)]
    outs = []
    for pixels in (np.concatenate(blocks), blocks):
        out = ctx.empty((18, cfg.out_hidden_size), "f32", "out")
        tower.encode(pixels, (3, 4, 6), out)
        outs.append(ctx.to_host(out))
    assert np.array_equal(outs[0], outs[1])
    with pytest.raises(VisionEncodeError, match="pixel_values must be"):
        tower.encode(blocks[:2], (3, 4, 6), ctx.empty((18, cfg.out_hidden_size), "f32", "out"))

"""The CUDA runner's FP8 KV cache on the CPU (issue 15 item 5): the quantising store's rule against an independent
e4m3 encoder, the FP8 paged_attention_mma emulated lane by lane (paged_mma_fp8_emulation: its staging, the
e4m3 -> bf16 bit trick, its fragment layouts, the per-key scales) against float64
attention over the dequantised cache, the cache sizes and allocation, the kernels the attention layer launches, and
what is refused. The GPU check is tests/cuda_runner/check_fp8_kv.py."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from gpu_engine import runner_rules
from gpu_engine.cuda import flash_plan, ops
from gpu_engine.cuda.bf16 import round_to_bf16
from gpu_engine.cuda.errors import ShapeError
from gpu_engine.cuda.kv_fp8 import allocate_layer, layer_kv_bytes_per_token
from gpu_engine.cuda.kv_fp8 import kv_bytes_per_block as attention_kv_bytes_per_block
from gpu_engine.cuda.linear import DenseLinear
from gpu_engine.cuda.options import CudaOptions
from gpu_engine.cuda.step import StepTables, build_step
from gpu_engine.cuda.text_model import AttentionCache, CudaTextModel
from gpu_engine.cuda.weights import AttentionWeights
from gpu_engine.fp8 import e4m3_to_float32
from gpu_engine.reference.fp8_kv import dequantize_kv, quantize_kv
from gpu_engine.runner_api import StepBatch
from tests.cuda_runner import paged_mma_fp8_emulation as fp8_emu
from tests.cuda_runner.no_launch import arr, no_launch_ctx
from tests.cuda_runner.paged_mma_emulation import BN, PAD
from tests.cuda_runner.paged_mma_fp8_emulation import e4m3x4_to_bf16x2, prmt
from tests.cuda_runner.recording_context import RecordingContext
from tests.cuda_runner.test_decode_rows_apart import SPEC, LaunchLog, chunk, mixed_batch
from tests.cuda_runner.test_paged_mma_emulated import _reference


def e4m3_rne_satfinite(x: np.ndarray) -> np.ndarray:
    """cvt.rn.satfinite.e4m3x2.f32 written out: round to nearest even on e4m3's grid (quantum 2^(e-3), subnormals
    below 2^-6), magnitudes from 448 up saturate to 448 (0x7e). Independent of ml_dtypes."""
    x = np.asarray(x, np.float32).astype(np.float64)
    out = np.zeros(x.shape, np.uint8)
    for idx, v in np.ndenumerate(x):
        sign, a = (0x80 if np.signbit(v) else 0), abs(v)  # -0 keeps its sign, as IEEE conversions do
        if a >= 448.0:
            out[idx] = sign | 0x7E
            continue
        e = max(int(np.floor(np.log2(a))) if a > 0 else -6, -6)
        n = int(np.rint(a / 2.0 ** (e - 3)))  # exact: a power-of-two division; rint is half-to-even
        if n == 16:
            e, n = e + 1, 8
        out[idx] = sign | (n if n < 8 else ((e + 7) << 3) | (n - 8))
    return out


def kernel_store(row: np.ndarray, dtype: str) -> tuple[np.ndarray, np.float32]:
    """qk_norm_rope_store_fp8's steps on one (token, head) row: round to the compute dtype, amax, s = amax / 448
    (1 for zeros), bits = cvt(x / s)."""
    x = round_to_bf16(np.asarray(row, np.float32)) if dtype == "bf16" else np.asarray(row, np.float32)
    amax = np.float32(np.abs(x).max())
    s = np.float32(amax / np.float32(448.0)) if amax > 0 else np.float32(1.0)
    return e4m3_rne_satfinite((x / s).astype(np.float32)), s


@pytest.mark.parametrize("dtype", ["bf16", "f32"])
def test_the_store_rule_is_the_reference_quantisation_bit_for_bit(dtype):
    rng = np.random.default_rng(5)
    rows = [rng.standard_normal(256).astype(np.float32) * 10.0 ** rng.uniform(-6, 4) for _ in range(200)]
    rows += [np.zeros(256, np.float32),                                             # scale 1, all-zero bits
             np.array([448, 17, 19, -17, 2 ** -10, 3 * 2 ** -10, -2 ** -9, 0.0] * 32, np.float32),  # ties, subnormals
             np.array([1e30, -1e-30] * 128, np.float32), np.full(256, -3.0, np.float32)]
    for row in rows:
        x = round_to_bf16(row) if dtype == "bf16" else row
        bits, s = kernel_store(row, dtype)
        ref_bits, ref_s = quantize_kv(x)
        assert s == ref_s and np.array_equal(bits, ref_bits)
    # the tie rows: 17 -> 16, 19 -> 20, 2^-10 -> 0 (even), 3 * 2^-10 -> 2^-8 (scale 1)
    got = dequantize_kv(*quantize_kv(rows[-3][:8]))
    assert got.tolist() == [448, 16, 20, -16, 0, 2 ** -8, -2 ** -9, 0]


def _fp8_cache(rng, slots, kv_heads, hd):
    k = rng.standard_normal((slots, kv_heads, hd)).astype(np.float32) * rng.uniform(0.01, 30, (slots, kv_heads, 1))
    v = rng.standard_normal((slots, kv_heads, hd)).astype(np.float32)
    (kb, ks), (vb, vs) = quantize_kv(k), quantize_kv(v)
    return kb, vb, ks.astype(np.float32), vs.astype(np.float32)


def test_the_bit_trick_gives_every_finite_e4m3_value_exactly():
    # fp8_kv.cuh's e4m3x4_to_bf16x2 on all 254 finite bytes (0x7f / 0xff, NaN, are never stored), subnormals too
    finite = np.array([b for b in range(256) if b & 0x7F != 0x7F], np.uint8)
    want = e4m3_to_float32(finite)
    for i in range(0, len(finite) - 3, 4):
        w = int(finite[i:i + 4].view("<u4")[0])
        even, odd = e4m3x4_to_bf16x2(w)
        assert (even[0], odd[0], even[1], odd[1]) == tuple(want[i:i + 4].tolist())
    assert prmt(0x33221100, 0x77665544, 0x5410) == 0x55441100 and prmt(0x33221100, 0x77665544, 0x7632) == 0x77663322


def test_the_fp8_stage_holds_each_rows_bytes_and_scales_and_zeros_past_the_split():
    rng = np.random.default_rng(1)
    hd, kv_heads, block_size = 128, 2, 16
    kb, vb, ks, vs = _fp8_cache(rng, 8 * block_size, kv_heads, hd)
    table = rng.permutation(8)
    k0, hi = 37, 37 + 50  # a stage that starts mid-block and ends inside the tile
    raw_k, raw_v, sc = fp8_emu.stage(kb, vb, ks, vs, table, k0, hi, 1, block_size)
    stride = fp8_emu.ldb(hd)
    for r in range(BN):
        kp = k0 + r
        got_k, got_v = raw_k[r * stride:r * stride + hd], raw_v[r * stride:r * stride + hd]
        if kp >= hi:
            assert not got_k.any() and not got_v.any() and sc[0, r] == 0 and sc[1, r] == 0
            continue
        slot = table[kp // block_size] * block_size + kp % block_size
        assert np.array_equal(got_k, kb[slot, 1]) and np.array_equal(got_v, vb[slot, 1])
        assert sc[0, r] == ks[slot, 1] and sc[1, r] == vs[slot, 1]


def test_the_fp8_lanes_read_every_k_and_v_byte_once_without_bank_conflicts_at_128_and_256():
    for hd in (64, 128, 256):
        stride = fp8_emu.ldb(hd)
        k_seen = sorted((g, 16 * fp8_emu.k_chunk(hd, t, j) + b) for g in range(8) for t in range(4)
                        for j in range(hd // 64) for b in range(16))
        assert k_seen == sorted((g, d) for g in range(8) for d in range(hd))  # rows g (and g + 8) whole
        v_seen = sorted(fp8_emu.v_dim(hd, g, j) + b for g in range(8) for j in range(hd // 32) for b in range(4))
        assert v_seen == list(range(hd))  # each of the lane's 4 key rows, whole across the 8 groups
        if hd < 128:
            continue
        for j in range(hd // 64):  # 16-byte loads: a quarter warp (g in {2p, 2p+1}, tig 0..3) hits 8 bank groups
            for p in range(4):
                groups = {((g * stride + 16 * fp8_emu.k_chunk(hd, t, j)) // 16) % 8 for g in (2 * p, 2 * p + 1)
                          for t in range(4)}
                assert len(groups) == 8
        for h in range(hd // 128):
            for p in range(4):
                groups = {((t * stride + 16 * g + 128 * h) // 16) % 8 for g in (2 * p, 2 * p + 1) for t in range(4)}
                assert len(groups) == 8


@pytest.mark.parametrize("hd,heads,kv_heads,positions,splits", [
    (64, 8, 2, [0, 16, 70], 1),      # one key, a 16-key edge, two tiles
    (64, 4, 1, [5, 129], 3),         # an empty split
    (128, 6, 1, [300], 1),           # more tiles than stages
    (256, 4, 1, [80], 2),            # the 9B / 27B head size
])
def test_emulated_fp8_kernel_matches_float64_attention_over_the_dequantised_cache(hd, heads, kv_heads, positions,
                                                                                  splits):
    rng = np.random.default_rng(hd + len(positions))
    block_size, n = 16, len(positions)
    per_seq = max(positions) // block_size + 1
    kb, vb, ks, vs = _fp8_cache(rng, n * per_seq * block_size, kv_heads, hd)
    tables = rng.permutation(n * per_seq).reshape(n, per_seq)
    q = round_to_bf16(rng.standard_normal((n, heads * hd)).astype(np.float32))
    token_seq, token_pos, scale = np.arange(n), np.array(positions), hd ** -0.5
    got = fp8_emu.paged_attention_mma_fp8_emulated(q, kb, vb, ks, vs, tables, token_seq, token_pos, heads, kv_heads,
                                                   block_size, scale, splits)
    # K and V are exact e4m3 x scale (float64 here, the kernel's fp32 score); what is left is P' = bf16(p * scale)
    want = _reference(q, dequantize_kv(kb, ks), dequantize_kv(vb, vs), tables, token_seq, token_pos, heads,
                      kv_heads, block_size, scale)
    assert np.all(np.isfinite(got))
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 4e-3


def test_shared_memory_of_the_fp8_kernels_matches_their_layout_and_fits():
    for hd in ops.PAGED_MMA_HEAD_DIMS:
        tile, raw, scales = 2 * BN * (hd + PAD) * 2, 3 * 2 * BN * (hd + 16), 3 * 2 * BN * 4
        assert ops.paged_mma_shared_bytes(hd, fp8=True) == max(tile + raw + scales, 4 * 8 * (hd + 2) * 4) + 1024
        assert ops.paged_mma_shared_bytes(hd, fp8=True) <= 227 * 1024
    for hd in flash_plan.FLASH_HEAD_DIMS:
        keys = 32 if hd >= 256 else 64
        q_tile = 0 if hd <= 128 else flash_plan.FLASH_TILE * (hd + 8) * 2
        want = 2 * keys * (hd + 8) * 2 + q_tile + 4 * keys * (hd + 16) + 4 * keys * 4
        assert flash_plan.flash_shared_bytes(hd, fp8=True) == want
        assert 2 * flash_plan.flash_shared_bytes(hd, fp8=True) <= 227 * 1024  # two blocks an SM, as the bf16 kernel


def test_cache_bytes_per_token_halve_plus_the_scales():
    cfg = SimpleNamespace(num_key_value_heads=4, head_dim=256, full_attention_layers=[3, 7, 11])
    sizes = {kv: attention_kv_bytes_per_block(cfg, 16, 2, kv) for kv in ("auto", "fp8_e4m3")}  # type: ignore[arg-type]
    assert sizes["auto"] == 3 * 16 * 2 * 4 * 256 * 2 == runner_rules.kv_bytes_per_block(cfg, 16, 2)  # type: ignore
    assert sizes["fp8_e4m3"] == 3 * 16 * 2 * 4 * (256 + 4) == 3 * 16 * layer_kv_bytes_per_token("fp8_e4m3", 4, 256, 2)
    assert sizes["fp8_e4m3"] / sizes["auto"] == pytest.approx(260 / 512)


def test_an_fp8_layer_is_u8_bytes_and_f32_scales_per_token_and_head():
    ctx = RecordingContext()
    k, v, ks, vs = allocate_layer(ctx, "fp8_e4m3", (10, 16, 4, 256), "bf16", 3)  # type: ignore[arg-type]
    assert (k.dtype, v.dtype, k.shape) == ("u8", "u8", (10, 16, 4, 256))
    assert ks is not None and vs is not None and (ks.dtype, ks.shape, vs.shape) == ("f32", (10, 16, 4), (10, 16, 4))
    assert allocate_layer(ctx, "auto", (10, 16, 4, 256), "bf16", 3)[2:] == (None, None)  # type: ignore[arg-type]


def _fp8_launches(batch: StepBatch, dtype: str) -> tuple[list[tuple[str, tuple]], AttentionCache]:
    nh, kvh, hd = 8, 2, 256
    config = SimpleNamespace(num_attention_heads=nh, num_key_value_heads=kvh, head_dim=hd, rotary_dim=64,
                             rms_norm_eps=1e-6, rope_theta=1e7, mrope_section=[11, 11, 10], hidden_size=64)
    ctx = LaunchLog()
    model = CudaTextModel(ctx, config, weights=None, dtype=dtype)  # type: ignore[arg-type]  # weights unused here
    cfg = SimpleNamespace(vocab_size=50, hidden_size=6, full_attention_layers=[0])
    host = build_step(batch, SPEC, cfg, dtype)  # type: ignore[arg-type]  # cfg: the fields it reads
    m = StepTables(**{name: ctx.empty(a.shape if a.size else (1,), "i32", name) for name, a in host.tables.items()})
    width = (2 * nh + 2 * kvh) * hd
    w = AttentionWeights(qkv=DenseLinear(ctx.empty((width, 64), dtype, "wqkv")),
                         q_norm=ctx.empty((hd,), dtype, "qn"), k_norm=ctx.empty((hd,), dtype, "kn"),
                         o_proj=DenseLinear(ctx.empty((64, nh * hd), dtype, "wo")))
    a = SimpleNamespace(h=ctx.empty((host.n, 64), dtype, "h"), d=ctx.empty((host.n, 64), dtype, "d"))
    cache = AttentionCache(*allocate_layer(ctx, "fp8_e4m3", (64, 16, kvh, hd), dtype, 0))  # type: ignore[arg-type]
    ctx.calls.clear()
    model._attention(w, a, m, host.n, host.longest_chunk, cache, 16)  # type: ignore[arg-type]  # a: stand-in
    return ctx.calls, cache


def test_an_fp8_cache_sends_prompt_chunks_to_flash_prefill_fp8_with_the_scales_after_the_caches():
    calls, cache = _fp8_launches(mixed_batch(), "bf16")
    assert [c[0] for c in calls] == ["blas.linear", "qk_norm_rope_store_fp8_bf16", "flash_prefill_fp8_bf16_hd256",
                                     "blas.linear"]
    assert cache.k_scale is not None and cache.v_scale is not None
    store, flash = calls[1][1], calls[2][1]  # grid, block, then the kernel's arguments
    assert store[2 + 1:2 + 6] == (cache.k.ptr, cache.v.ptr, cache.k_scale.ptr, cache.v_scale.ptr, store[2 + 5])
    assert flash[2 + 6:2 + 10] == (cache.k.ptr, cache.v.ptr, cache.k_scale.ptr, cache.v_scale.ptr)


@pytest.mark.parametrize("dtype,kernel", [("bf16", "paged_attention_mma_fp8_bf16_hd256"),
                                          ("f32", "paged_attention_fp8_f32")])
def test_decode_steps_read_the_fp8_cache_with_the_mma_or_per_head_kernel(dtype, kernel):
    calls, cache = _fp8_launches(StepBatch([chunk(0, 40, 1), chunk(2, 90, 1)]), dtype)
    names = [c[0] for c in calls]
    assert names == ["blas.linear", f"qk_norm_rope_store_fp8_{dtype}", kernel, f"attention_combine_{dtype}",
                     "blas.linear"]
    assert cache.k_scale is not None and cache.v_scale is not None
    attn = calls[2][1]  # grid, block, part_acc, part_ml, q, q_stride, k, v, k_scale, v_scale, tables
    assert attn[2 + 4:2 + 8] == (cache.k.ptr, cache.v.ptr, cache.k_scale.ptr, cache.v_scale.ptr)


def test_what_the_fp8_cache_refuses():
    ctx = no_launch_ctx()
    q, gate = arr((1, 2048)), arr((1, 4096))
    k8, v8 = arr((4, 16, 2, 256), "u8"), arr((4, 16, 2, 256), "u8")
    ks, vs = arr((4, 16, 2), "f32"), arr((4, 16, 2), "f32")
    common = (ctx, arr((1, 2048)), q, 2048, gate, 4096, 512)
    tail = (arr((1, 4), "i32"), arr((1,), "i32"), arr((1,), "i32"), 8, 2, 256, 16, 0.0625)
    with pytest.raises(ShapeError, match="no FP8 KV form"):
        ops.paged_attention(*common, k8, v8, *tail, method="grouped", k_scale=ks, v_scale=vs)
    with pytest.raises(ShapeError, match="u8 k_cache and v_cache with k_scale and v_scale"):
        ops.paged_attention(*common, k8, v8, *tail)  # bytes without scales
    with pytest.raises(ShapeError, match="u8 k_cache and v_cache with k_scale and v_scale"):
        ops.paged_attention(*common, arr((4, 16, 2, 256)), arr((4, 16, 2, 256)), *tail, k_scale=ks, v_scale=vs)
    with pytest.raises(ShapeError, match="k_scale must be f32"):
        ops.paged_attention(*common, k8, v8, *tail, k_scale=arr((4, 16), "f32"), v_scale=vs)
    with pytest.raises(ShapeError, match="v_scale must be f32"):
        ops.paged_attention(*common, k8, v8, *tail, k_scale=ks, v_scale=arr((4, 16, 2)))
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        CudaOptions(kv_cache_dtype="fp8")
    assert CudaOptions().kv_cache_dtype == "auto"  # opt-in


def test_the_cuda_runner_sizes_its_cache_by_the_fp8_rule():
    from gpu_engine.cuda.runner import CudaRunner

    cfg = SimpleNamespace(num_key_value_heads=4, head_dim=256, full_attention_layers=[3, 7, 11])
    sizes = {}
    for kv in ("auto", "fp8_e4m3"):
        runner = object.__new__(CudaRunner)  # no GPU: only what kv_bytes_per_block reads
        runner.cfg, runner.dtype, runner.options, runner.spec = cfg, "bf16", CudaOptions(kv_cache_dtype=kv), None
        runner.mtp = None
        sizes[kv] = runner.kv_bytes_per_block(16)
    assert sizes == {"auto": 3 * 16 * 2 * 4 * 256 * 2, "fp8_e4m3": 3 * 16 * 2 * 4 * (256 + 4)}

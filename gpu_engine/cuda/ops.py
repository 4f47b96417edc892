"""Typed launchers for the kernels in kernels/*.cu (one function per kernel entry, checked arguments).

Every function enqueues on the context's stream and returns at once. Shapes are row-major; strides are in
elements. Scalars are passed with explicit C types (np.int32 / np.int64 / np.float32); addresses as ints.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .context import ITEMSIZE, DArray, GpuContext
from .errors import ShapeError
from .flash_plan import (
    FLASH_HEAD_DIMS,
    FLASH_MAX_TILES,
    FLASH_TILE_ROWS,
    FLASH_WS_ARCHS,
    FLASH_WS_HEAD_DIM,
    FLASH_WS_THREADS,
    FLASH_WS_VARIANTS,
    flash_shared_bytes,
    flash_variant,
)
from .kv_fp8 import kv_operands
from .norm_launch import norm_launch

i32, i64, f32 = np.int32, np.int64, np.float32
FLOAT_TYPES = ("bf16", "f32")


def _same_float(*arrays: DArray) -> str:
    dtypes = {a.dtype for a in arrays}
    if len(dtypes) != 1 or next(iter(dtypes)) not in FLOAT_TYPES:
        raise ShapeError(f"expected one float dtype (bf16 or f32) for all operands, got {sorted(dtypes)}")
    return dtypes.pop()


def _need(arr: DArray, dtype: str, what: str) -> None:
    if arr.dtype != dtype:
        raise ShapeError(f"{what} must be {dtype}, got {arr.dtype}")


def _threads(width: int) -> int:
    """Threads for a one-block-per-row kernel: ~2 elements a thread, a multiple of 32, at most 1024 (the norms keep
    this layout's sum order: norm_launch)."""
    return min(1024, max(32, ((width + 1) // 2 + 31) // 32 * 32))


# ---- norms ---------------------------------------------------------------------------------------------------
def rmsnorm(ctx: GpuContext, out: DArray, x: DArray, w: DArray, rows: int, dim: int, eps: float,
            zero_centred: bool, *, heads: int = 1, x_tok_stride: int | None = None, x_head_stride: int | None = None,
            out_tok_stride: int | None = None, out_head_stride: int | None = None) -> None:
    """out = x * rsqrt(mean(x^2) + eps) * (w + 1 if zero_centred else w), over `rows` rows of `dim`.

    Row r is head r % heads of token r // heads, found at token * tok_stride + head * head_stride (elements;
    defaults: packed [tokens, heads, dim]). out may alias x (in place).
    """
    t = _same_float(out, x, w)
    if w.size != dim or rows % heads:
        raise ShapeError(f"norm weight has {w.size} elements (dim {dim}); rows {rows} vs heads {heads}")
    x_head = dim if x_head_stride is None else x_head_stride
    o_head = dim if out_head_stride is None else out_head_stride
    lp = norm_launch(rows, dim, ITEMSIZE[t], _threads(dim))
    ctx.device.launch("norm", f"rmsnorm_{t}", lp.grid, lp.block, out.ptr, i64(out_tok_stride or heads * dim),
                      i32(o_head), x.ptr, i64(x_tok_stride or heads * dim), i32(x_head), i32(heads), w.ptr,
                      i32(rows), i32(dim), f32(eps), f32(1.0 if zero_centred else 0.0), *lp.args(), shmem=lp.shmem)


def add_rmsnorm(ctx: GpuContext, out: DArray, residual: DArray, x: DArray, w: DArray, eps: float,
                zero_centred: bool) -> None:
    """residual += x (in place, rounded to storage), out = rmsnorm(residual). residual/x/out: [rows, dim]."""
    t = _same_float(out, residual, x, w)
    rows, dim = residual.shape
    if x.shape != residual.shape or out.shape != residual.shape or w.size != dim:
        raise ShapeError(f"add_rmsnorm shapes: residual {residual.shape}, x {x.shape}, out {out.shape}, w {w.shape}")
    lp = norm_launch(rows, dim, ITEMSIZE[t], _threads(dim))
    ctx.device.launch("norm", f"add_rmsnorm_{t}", lp.grid, lp.block, out.ptr, residual.ptr, x.ptr, w.ptr,
                      i32(rows), i32(dim), f32(eps), f32(1.0 if zero_centred else 0.0), *lp.args(), shmem=lp.shmem)


def rmsnorm_gated(ctx: GpuContext, out: DArray, x: DArray, z: DArray, w: DArray, eps: float,
                  heads_per_z_row: int, z_stride: int) -> None:
    """out = w * rmsnorm(x) * silu(z), per head row. x/out: [rows, dim]; z row r // heads_per_z_row, head r % ..."""
    t = _same_float(out, x, z, w)
    rows, dim = x.shape
    if out.shape != x.shape or w.size != dim:
        raise ShapeError(f"rmsnorm_gated shapes: x {x.shape}, out {out.shape}, w {w.shape}")
    lp = norm_launch(rows, dim, ITEMSIZE[t], _threads(dim), staged=2)
    ctx.device.launch("norm", f"rmsnorm_gated_{t}", lp.grid, lp.block, out.ptr, x.ptr, z.ptr, i32(z_stride),
                      w.ptr, i32(rows), i32(dim), i32(heads_per_z_row), f32(eps), *lp.args(), shmem=lp.shmem)


# ---- element-wise --------------------------------------------------------------------------------------------
def _grid_1d(ctx: GpuContext, n: int, threads: int = 256) -> int:
    return max(1, min((n + threads - 1) // threads, ctx.device.info.sm_count * 16))


def _vector_elems(t: str) -> int:
    """Elements of dtype `t` in the 16-byte vectors the elementwise kernels load (elementwise.cu's VEC)."""
    return 8 if t == "bf16" else 4


def silu_mul(ctx: GpuContext, out: DArray, gate_up: DArray) -> None:
    """out[r, i] = silu(gate_up[r, i]) * gate_up[r, inter + i]; gate_up [rows, 2*inter], out [rows, inter]."""
    t = _same_float(out, gate_up)
    rows, inter = out.shape
    if gate_up.shape != (rows, 2 * inter):
        raise ShapeError(f"silu_mul: gate_up {gate_up.shape} does not match out {out.shape}")
    # one 16-byte vector per thread; grid (column block, row slice), no div/mod
    grid = (max(1, -(-inter // (256 * _vector_elems(t)))), max(1, min(rows, 65535)))
    ctx.device.launch("elementwise", f"silu_mul_{t}", grid, 256, out.ptr, gate_up.ptr, i32(rows), i32(inter))


def add(ctx: GpuContext, out: DArray, a: DArray, b: DArray) -> None:
    t = _same_float(out, a, b)
    if not out.size == a.size == b.size:
        raise ShapeError(f"add sizes differ: {out.shape} {a.shape} {b.shape}")
    vectors = -(-out.size // _vector_elems(t))  # one 16-byte vector per thread (scalar tail in-kernel)
    ctx.device.launch("elementwise", f"add_{t}", _grid_1d(ctx, vectors), 256, out.ptr, a.ptr, b.ptr, i64(out.size))


# ---- rotary --------------------------------------------------------------------------------------------------
def rope(ctx: GpuContext, x: DArray, n: int, heads: int, rot_dim: int, token_stride: int, head_stride: int,
         pos: DArray, inv_freq: DArray, axis: DArray) -> None:
    """In-place rotate-half rotary on the first rot_dim dims of each head.

    pos: i32 [P, n] (P = 3 for text M-RoPE, 2 for vision h/w); inv_freq: f32 [rot_dim/2]; axis: i32 [rot_dim/2]
    (which pos row drives each frequency; see mrope_axis / vision_axis in rotary.py).
    """
    t = _same_float(x)
    _need(pos, "i32", "pos")
    _need(inv_freq, "f32", "inv_freq")
    _need(axis, "i32", "axis")
    if rot_dim % 2 or inv_freq.size != rot_dim // 2 or axis.size != rot_dim // 2 or pos.shape[-1] != n:
        raise ShapeError(f"rope tables: rot_dim {rot_dim}, inv_freq {inv_freq.shape}, axis {axis.shape}, "
                         f"pos {pos.shape}")
    ctx.device.launch("rope", f"rope_{t}", n, 128, x.ptr, i64(token_stride), i32(head_stride), pos.ptr, i32(n),
                      inv_freq.ptr, axis.ptr, i32(n), i32(heads), i32(rot_dim))


# ---- embeddings ----------------------------------------------------------------------------------------------
def embed_gather(ctx: GpuContext, out: DArray, table: DArray, ids: DArray) -> None:
    """out[i] = table[ids[i]] (ids outside the table give zeros). table [vocab, hidden], out [n, hidden]."""
    t = _same_float(out, table)
    _need(ids, "i32", "ids")
    vocab, hidden = table.shape
    n = ids.size
    if out.shape != (n, hidden):
        raise ShapeError(f"embed_gather: out {out.shape}, expected {(n, hidden)}")
    ctx.device.launch("embed", f"embed_gather_{t}", n, _threads(hidden), out.ptr, table.ptr, ids.ptr, i32(n),
                      i32(hidden), i32(vocab))


def scatter_rows(ctx: GpuContext, out: DArray, src: DArray, dst_rows: DArray) -> None:
    """out[dst_rows[i]] = src[i] (vision embeddings into their placeholder rows)."""
    t = _same_float(out, src)
    _need(dst_rows, "i32", "dst_rows")
    n, hidden = src.shape
    if dst_rows.size != n or out.shape[1] != hidden:
        raise ShapeError(f"scatter_rows: src {src.shape}, dst_rows {dst_rows.shape}, out {out.shape}")
    ctx.device.launch("embed", f"scatter_rows_{t}", n, _threads(hidden), out.ptr, src.ptr, dst_rows.ptr, i32(n),
                      i32(hidden))


# ---- attention -----------------------------------------------------------------------------------------------
def kv_store(ctx: GpuContext, k_cache: DArray, v_cache: DArray, k: DArray, k_stride: int, v: DArray, v_stride: int,
             slots: DArray, kv_heads: int, head_dim: int) -> None:
    """Write K/V rows of this step into cache slots (slot = block * block_size + row)."""
    t = _same_float(k_cache, v_cache, k, v)
    _need(slots, "i32", "slots")
    ctx.device.launch("attention", f"kv_store_{t}", slots.size, _threads(kv_heads * head_dim), k_cache.ptr,
                      v_cache.ptr, k.ptr, i64(k_stride), v.ptr, i64(v_stride), slots.ptr, i32(slots.size),
                      i32(kv_heads), i32(head_dim))


def qk_norm_rope_store(ctx: GpuContext, q_out: DArray, k_cache: DArray, v_cache: DArray, proj: DArray,
                       proj_stride: int, q_norm: DArray, k_norm: DArray, pos: DArray, inv_freq: DArray, axis: DArray,
                       slots: DArray, heads: int, kv_heads: int, head_dim: int, rot_dim: int, eps: float,
                       zero_centred: bool = True, k_scale: DArray | None = None,
                       v_scale: DArray | None = None) -> None:
    """Per-head RMSNorm of q and k, rotary on both, q -> q_out [n, heads*head_dim], k/v -> cache slots; proj rows
    are [q_0 gate_0 ... q_{H-1} gate_{H-1} | k | v] as the fused q|k|v projection emits them. An FP8 cache (u8
    caches with k_scale / v_scale) gets k and v quantised with one scale per (token, kv head)."""
    f8, scales = kv_operands(k_cache, v_cache, k_scale, v_scale)
    t = _same_float(q_out, proj, q_norm, k_norm, *(() if f8 else (k_cache, v_cache)))
    for arr, name in ((pos, "pos"), (axis, "axis"), (slots, "slots")):
        _need(arr, "i32", name)
    _need(inv_freq, "f32", "inv_freq")
    n = slots.size
    if head_dim > 256 or rot_dim > head_dim or rot_dim % 2 or pos.shape[-1] != n:
        raise ShapeError(f"qk_norm_rope_store: head_dim {head_dim} (max 256), rot_dim {rot_dim}, pos {pos.shape}, "
                         f"n {n}")
    ctx.device.launch("attention", f"qk_norm_rope_store{f8}_{t}", (n, heads + kv_heads), 128, q_out.ptr,
                      k_cache.ptr, v_cache.ptr, *scales, proj.ptr, i64(proj_stride), q_norm.ptr, k_norm.ptr, pos.ptr,
                      i32(n), inv_freq.ptr, axis.ptr, slots.ptr, i32(n), i32(heads), i32(kv_heads), i32(head_dim),
                      i32(rot_dim), f32(eps), f32(1.0 if zero_centred else 0.0))


def flash_prefill(ctx: GpuContext, out: DArray, q: DArray, q_stride: int, gate: DArray, gate_stride: int,
                  gate_head_stride: int, k_cache: DArray, v_cache: DArray, block_tables: DArray, token_seq: DArray,
                  token_pos: DArray, tiles: DArray, heads: int, kv_heads: int, head_dim: int, block_size: int,
                  scale: float, k_scale: DArray | None = None, v_scale: DArray | None = None,
                  variant: str = "fa2") -> None:
    """Same function as paged_attention for bf16 prefill chunks, on the tensor cores (see flash_prefill.cu).
    tiles: i32 [T, 2] from flash_tiles() (at most FLASH_TILE_ROWS[variant] rows each); each tile's tokens belong to
    one sequence, in position order. q rows, k_cache and v_cache are copied in 16-byte pieces: their addresses must
    be 16-byte aligned and q_stride a multiple of 8 elements. An FP8 cache (u8 caches with k_scale / v_scale) is
    dequantised tile by tile in shared memory (flash_prefill_fp8_bf16_hd<D>). variant "ws": the warp-specialised
    wgmma kernel (flash_prefill_ws.cu; bf16 cache, head_dim 256, sm_90 only: flash_variant picks it)."""
    f8, scales = kv_operands(k_cache, v_cache, k_scale, v_scale)
    for arr in (out, q, gate, *(() if f8 else (k_cache, v_cache))):
        _need(arr, "bf16", "flash_prefill operand")
    for arr, name in ((block_tables, "block_tables"), (token_seq, "token_seq"), (token_pos, "token_pos"),
                      (tiles, "tiles")):
        _need(arr, "i32", name)
    if head_dim not in FLASH_HEAD_DIMS or heads % kv_heads or q_stride % 8:
        raise ShapeError(f"flash_prefill supports head_dim {FLASH_HEAD_DIMS} with heads % kv_heads == 0 and a q "
                         f"stride that is a multiple of 8 (got {head_dim}, {heads}/{kv_heads}, {q_stride})")
    if any(a.ptr % 16 for a in (q, k_cache, v_cache)):
        raise ShapeError("flash_prefill needs 16-byte aligned q, k_cache and v_cache")
    if len(tiles.shape) != 2 or tiles.shape[1] != 2 or not 0 < tiles.shape[0] <= FLASH_MAX_TILES:
        raise ShapeError(f"flash_prefill tiles must be [1..{FLASH_MAX_TILES}, 2], got {tiles.shape}")
    if variant not in FLASH_TILE_ROWS:
        raise ShapeError(f"flash_prefill variant must be one of {sorted(FLASH_TILE_ROWS)}, got {variant!r}")
    arch = getattr(ctx.device.info, "arch", None)
    if variant in FLASH_WS_VARIANTS and flash_variant(variant, head_dim, bool(f8), arch) != variant:
        raise ShapeError(f"flash_prefill variant {variant!r} needs a bf16 cache, head_dim {FLASH_WS_HEAD_DIM} and an "
                         f"{'/'.join(FLASH_WS_ARCHS)} device (got {'fp8' if f8 else 'bf16'}, {head_dim}, "
                         f"{arch})")
    ws = variant in FLASH_WS_VARIANTS
    ctx.device.launch("flash_prefill_ws" if ws else "flash_prefill",
                      f"flash_prefill_{variant}_bf16_hd{head_dim}" if ws else f"flash_prefill{f8}_bf16_hd{head_dim}",
                      (heads, tiles.shape[0]), FLASH_WS_THREADS if ws else 128, out.ptr, q.ptr, i64(q_stride),
                      gate.ptr, i64(gate_stride), i32(gate_head_stride), k_cache.ptr, v_cache.ptr, *scales,
                      block_tables.ptr, i32(block_tables.shape[1]), token_seq.ptr, token_pos.ptr, tiles.ptr,
                      i32(heads), i32(kv_heads), i32(block_size), f32(scale),
                      shmem=flash_shared_bytes(head_dim, bool(f8), ws))


def attention_splits(ctx: GpuContext, n_tokens: int, heads: int, waves: int = 2) -> int:
    """Key splits per (token, head): enough blocks to cover the GPU `waves` times when there are few queries."""
    blocks = n_tokens * heads
    return max(1, min(64, -(-waves * ctx.device.info.sm_count // blocks)))


GQA_GROUPS = (1, 2, 4, 6, 8)  # query heads per KV head with a paged_attention_gqa kernel
GQA_HEAD_DIMS = (8, 16, 32, 64, 128, 256)


def gqa_attention_fits(q: DArray, q_stride: int, k_cache: DArray, v_cache: DArray, heads: int, kv_heads: int,
                       head_dim: int) -> bool:
    """Whether paged_attention's grouped kernel applies: a compiled group size, a head size it tiles, and
    16-byte aligned rows (it reads 8 elements per load)."""
    return (heads % kv_heads == 0 and heads // kv_heads in GQA_GROUPS and head_dim in GQA_HEAD_DIMS
            and all(a.ptr % 16 == 0 for a in (q, k_cache, v_cache))
            and q_stride * ITEMSIZE[q.dtype] % 16 == 0)


PAGED_MMA_HEAD_DIMS = (64, 128, 256)  # paged_attention_mma_bf16_hd<D> in kernels/attention.cu
PAGED_MMA_MAX_GROUP = 8  # query heads per KV head: the n = 8 columns of the score mma


def paged_mma_shared_bytes(head_dim: int, fp8: bool = False) -> int:
    """Dynamic shared memory of paged_attention_mma_bf16_hd<head_dim> (PagedMmaShape<HD>::SMEM_BYTES, which traps
    if it gets less): 3 stages of 64 K and 64 V rows padded by 8 bf16 (the warps' merge reuses them), plus P^T
    [16 keys][8 heads] bf16 per warp. fp8 (paged_attention_mma_fp8_*): one bf16 K and V tile, 3 stages of raw e4m3
    rows padded by 16 bytes and their float32 scales."""
    tile = 2 * 64 * (head_dim + 8) * 2
    pipe = tile + 3 * 2 * 64 * (head_dim + 16) + 3 * 2 * 64 * 4 if fp8 else 3 * tile
    merge = 4 * 8 * (head_dim + 2) * 4
    return max(pipe, merge) + 4 * 16 * 8 * 2


def paged_mma_fits(q: DArray, q_stride: int, k_cache: DArray, v_cache: DArray, heads: int, kv_heads: int,
                   head_dim: int) -> bool:  # an FP8 cache (u8) fits as its bf16 form does
    """Whether paged_attention's tensor-core kernel applies: bf16, at most 8 query heads per KV head, a head size
    it is built for, 16-byte aligned rows (cp.async of 16 bytes, 4-byte Q fragment loads)."""
    return (q.dtype == "bf16" and heads % kv_heads == 0 and heads // kv_heads <= PAGED_MMA_MAX_GROUP
            and head_dim in PAGED_MMA_HEAD_DIMS and all(a.ptr % 16 == 0 for a in (q, k_cache, v_cache))
            and q_stride * ITEMSIZE[q.dtype] % 16 == 0)


def paged_attention(ctx: GpuContext, out: DArray, q: DArray, q_stride: int, gate: DArray, gate_stride: int,
                    gate_head_stride: int, k_cache: DArray, v_cache: DArray, block_tables: DArray, token_seq: DArray,
                    token_pos: DArray, heads: int, kv_heads: int, head_dim: int, block_size: int, scale: float,
                    splits: int | None = None, method: str = "auto", k_scale: DArray | None = None,
                    v_scale: DArray | None = None) -> None:
    """Causal paged attention with GQA and sigmoid output gate; out [n, heads*head_dim].

    Split-K over the keys (`splits`, default attention_splits()) into a float32 workspace taken from the arena for
    the two launches (stream order makes the early release safe), then one combine launch.
    method: "mma" (bf16 on the tensor cores: one block per KV head streams its keys through shared memory, the
    query heads sharing it are the columns of the score mma; see paged_mma_fits), "grouped" (one block per KV
    head computes all its query heads on the CUDA cores: each K/V row read once, with 16-byte loads; see
    gqa_attention_fits), "per_head" (one block per query head, any shape), or "auto" (the first that fits).
    An FP8 cache (u8 caches with k_scale / v_scale, kernels/fp8_kv.cuh) is read by the mma and per_head kernels
    (paged_attention_mma_fp8_*, paged_attention_fp8_*); "grouped" refuses it.
    """
    f8, scales = kv_operands(k_cache, v_cache, k_scale, v_scale)
    t = _same_float(out, q, gate, *(() if f8 else (k_cache, v_cache)))
    for arr, name in ((block_tables, "block_tables"), (token_seq, "token_seq"), (token_pos, "token_pos")):
        _need(arr, "i32", name)
    if head_dim > 256 or heads % kv_heads:
        raise ShapeError(f"paged_attention needs head_dim <= 256 and heads % kv_heads == 0 "
                         f"(got head_dim={head_dim}, heads={heads}, kv_heads={kv_heads})")
    if method not in ("auto", "mma", "grouped", "per_head"):
        raise ShapeError(f"method must be auto, mma, grouped or per_head, got {method!r}")
    fits = not f8 and gqa_attention_fits(q, q_stride, k_cache, v_cache, heads, kv_heads, head_dim)
    if method == "grouped" and f8:
        raise ShapeError("grouped paged_attention has no FP8 KV form: use method 'mma' or 'per_head'")
    mma_fits = paged_mma_fits(q, q_stride, k_cache, v_cache, heads, kv_heads, head_dim)
    if method == "grouped" and not fits:
        raise ShapeError(f"grouped paged_attention needs heads/kv_heads in {GQA_GROUPS}, head_dim in "
                         f"{GQA_HEAD_DIMS} and 16-byte aligned rows (heads={heads}, kv_heads={kv_heads}, "
                         f"head_dim={head_dim})")
    if method == "mma" and not mma_fits:
        raise ShapeError(f"mma paged_attention needs bf16, heads/kv_heads <= {PAGED_MMA_MAX_GROUP}, head_dim in "
                         f"{PAGED_MMA_HEAD_DIMS} and 16-byte aligned rows (dtype={q.dtype}, heads={heads}, "
                         f"kv_heads={kv_heads}, head_dim={head_dim})")
    if method == "auto":
        method = "mma" if mma_fits else "grouped" if fits else "per_head"
    n = token_seq.size
    # the grouped and mma kernels have G times fewer blocks per split: 8 waves of blocks keep loads in flight and
    # the tail short
    splits = splits or (attention_splits(ctx, n, heads) if method == "per_head"
                        else attention_splits(ctx, n, kv_heads, waves=8))
    mark = ctx.arena.mark()
    part_acc = ctx.empty((n, heads, splits, head_dim), "f32", "attn-partials")
    part_ml = ctx.empty((n, heads, splits, 2), "f32", "attn-max-sum")
    common = (q.ptr, i64(q_stride), k_cache.ptr, v_cache.ptr, *scales, block_tables.ptr, i32(block_tables.shape[1]),
              token_seq.ptr, token_pos.ptr, i32(n))
    if method == "mma":
        ctx.device.launch("attention", f"paged_attention_mma{f8}_bf16_hd{head_dim}", (n, kv_heads, splits), 128,
                          part_acc.ptr, part_ml.ptr, *common, i32(kv_heads), i32(heads // kv_heads),
                          i32(block_size), f32(scale), shmem=paged_mma_shared_bytes(head_dim, bool(f8)))
    elif method == "grouped":
        ctx.device.launch("attention", f"paged_attention_gqa{heads // kv_heads}_{t}", (n, kv_heads, splits), 128,
                          part_acc.ptr, part_ml.ptr, *common, i32(kv_heads), i32(head_dim), i32(block_size),
                          f32(scale))
    else:
        ctx.device.launch("attention", f"paged_attention{f8}_{t}", (n, heads, splits), 128, part_acc.ptr, part_ml.ptr,
                          *common, i32(heads), i32(kv_heads), i32(head_dim), i32(block_size), f32(scale))
    ctx.device.launch("attention", f"attention_combine_{t}", (n, heads), 128, out.ptr, part_acc.ptr, part_ml.ptr,
                      i32(splits), gate.ptr, i64(gate_stride), i32(gate_head_stride), i32(n), i32(heads),
                      i32(head_dim))
    ctx.arena.release(mark)


# ---- Gated DeltaNet ------------------------------------------------------------------------------------------
CONV_RUN_TOKENS = 16  # batch rows per thread of the token-parallel conv (the K-1 halo is re-read once per run)


@dataclass(frozen=True)
class ConvRunsLaunch:
    """Launch shape of conv1d_silu_runs: `vec` channels per thread (16-byte loads or 1), `run` rows per thread."""

    kernel: str
    vec: int
    run: int
    grid: tuple[int, int]
    block: int = 128


def conv_runs_launch(n: int, conv_dim: int, K: int, dtype: str, x_ptr: int, x_stride: int, out_ptr: int,
                     out_stride: int, run: int | None = None) -> ConvRunsLaunch:
    """Pick the token-parallel conv's variant and grid: 16-byte vectors when every row start of x and out is
    16-byte aligned and conv_dim is a multiple of the vector width, else one channel per thread; taps in 4 or 8
    register slots; runs of CONV_RUN_TOKENS rows (longer if the grid's y extent would pass 65535)."""
    itemsize = ITEMSIZE[dtype]
    vec = 16 // itemsize
    byte_offsets = (x_ptr, x_stride * itemsize, out_ptr, out_stride * itemsize)  # every row start is 16-aligned
    aligned = conv_dim % vec == 0 and all(b % 16 == 0 for b in byte_offsets)
    vec = vec if aligned else 1
    run = run or max(CONV_RUN_TOKENS, -(-n // 65535))
    if run < 1 or -(-n // run) > 65535:
        raise ShapeError(f"conv1d run of {run} rows gives more than 65535 runs for {n} tokens")
    name = f"conv1d_silu_runs_{dtype}_{'vec' if vec > 1 else 'v1'}_k{4 if K <= 4 else 8}"
    channel_threads = conv_dim // vec
    return ConvRunsLaunch(name, vec, run, ((channel_threads + 127) // 128, -(-n // run)))


def conv1d_silu(ctx: GpuContext, out: DArray, out_stride: int, x: DArray, x_stride: int, w: DArray,
                conv_state: DArray, cu_seqlens: DArray, state_slots: DArray, fresh: DArray,
                token_seq: DArray | None = None, method: str = "auto", run: int | None = None) -> None:
    """Causal depthwise conv (kernel K) + silu over a varlen batch, reading and updating per-slot conv state.

    w [conv_dim, K]; conv_state [slots, K-1, conv_dim]; cu_seqlens i32 [seqs+1]; state_slots, fresh i32 [seqs].
    method: "sequential" (one thread walks a channel of a sequence: decode), "tokens" (threads over channel
    vectors x runs of `run` rows, then a state update: prefill; needs token_seq i32 [tokens]), or "auto".
    """
    t = _same_float(out, x, w, conv_state)
    conv_dim, K = w.shape
    if K > 8 or conv_state.shape[1:] != (K - 1, conv_dim):
        raise ShapeError(f"conv1d: K={K} (max 8), conv_state {conv_state.shape}, expected [*, {K - 1}, {conv_dim}]")
    if method not in ("auto", "sequential", "tokens"):
        raise ShapeError(f"method must be auto, sequential or tokens, got {method!r}")
    n, seqs = out.shape[0], state_slots.size
    # "auto": the token-parallel form (two launches) pays off only when the sequences' chunks are long on average;
    # a decode step of any batch has one token per sequence (27B, 32 sequences: 49 -> 11 us per layer, H200)
    parallel = method == "tokens" or (method == "auto" and token_seq is not None
                                      and n >= GDN_TWO_PASS_MIN_TOKENS * seqs)
    blocks = (conv_dim + 127) // 128
    if not parallel:
        ctx.device.launch("deltanet", f"conv1d_silu_{t}", (blocks, seqs), 128, out.ptr, i64(out_stride), x.ptr,
                          i64(x_stride), w.ptr, conv_state.ptr, cu_seqlens.ptr, state_slots.ptr, fresh.ptr,
                          i32(conv_dim), i32(K))
        return
    if token_seq is None:
        raise ShapeError("conv1d method 'tokens' needs token_seq")
    _need(token_seq, "i32", "token_seq")
    lp = conv_runs_launch(n, conv_dim, K, t, x.ptr, x_stride, out.ptr, out_stride, run)
    ctx.device.launch("deltanet", lp.kernel, lp.grid, lp.block, out.ptr, i64(out_stride), x.ptr, i64(x_stride),
                      w.ptr, conv_state.ptr, cu_seqlens.ptr, token_seq.ptr, state_slots.ptr, fresh.ptr, i32(n),
                      i32(seqs), i32(conv_dim), i32(K), i32(lp.run))
    # separate launch: the runs above read the old state of sequences whose last run may be another thread's
    ctx.device.launch("deltanet", f"conv1d_state_update_{t}", (blocks, seqs), 128, x.ptr, i64(x_stride),
                      conv_state.ptr, cu_seqlens.ptr, state_slots.ptr, fresh.ptr, i32(conv_dim), i32(K))


GDN_TWO_PASS_MIN_TOKENS = 16  # below this (decode steps) one launch beats two


def gdn_recurrent_rows(ctx: GpuContext, seqs: int, v_heads: int, dv: int) -> int:
    """State rows per warp of gdn_recurrent: 4 (a decode step of many sequences: four rows' loads in flight per
    warp, 1.7x on 27B at b=32) when that still gives 4 blocks per SM, else 1 (a few long sequences: more blocks)."""
    blocks_with_4 = seqs * v_heads * -(-dv // 32)
    return 4 if blocks_with_4 >= 4 * ctx.device.info.sm_count else 1


GDN_DECODE_DK, GDN_DECODE_MAX_DV = 128, 128  # gdn_decode in kernels/deltanet.cu: 8 warps x 16 value columns


def gdn_decode_fits(state: DArray, dk: int, dv: int) -> bool:
    """Whether gated_delta_rule's decode kernel applies: dk 128 (a float4 per lane), dv <= 128, aligned state."""
    return dk == GDN_DECODE_DK and dv <= GDN_DECODE_MAX_DV and state.ptr % 16 == 0


def gated_delta_rule(ctx: GpuContext, out: DArray, q: DArray, k: DArray, v: DArray, qkv_stride: int, a: DArray,
                     b: DArray, ab_stride: int, A_log: DArray, dt_bias: DArray, state: DArray, cu_seqlens: DArray,
                     state_slots: DArray, fresh: DArray, k_heads: int, v_heads: int, dk: int, dv: int,
                     method: str = "auto", rows: int | None = None) -> None:
    """Gated delta rule over a varlen batch; state f32 [slots, v_heads, dv, dk]; out [tokens, v_heads*dv].

    method: "one_pass" (normalisation and gates inside the sequential kernel: one launch, for decode),
    "decode" (the same in one block per value head and sequence, 16-byte state loads: dk 128, dv <= 128; see
    gdn_decode_fits; correct on the H200 (check_kernels) but not yet timed there, so "auto" does not pick it),
    "two_pass" (a parallel gdn_prepare pass, then a barrier-free sequential pass: for prefill), or "auto".
    rows: state rows per warp of the two-pass recurrence, 1 or 4 (default gdn_recurrent_rows()).
    """
    t = _same_float(out, q, k, v, a, b)
    _need(state, "f32", "state")
    _need(A_log, "f32", "A_log")
    _need(dt_bias, "f32", "dt_bias")
    if dk > 256 or v_heads % k_heads:
        raise ShapeError(f"gated_delta_rule needs dk <= 256 and v_heads % k_heads == 0 "
                         f"(dk={dk}, k_heads={k_heads}, v_heads={v_heads})")
    if state.shape[1:] != (v_heads, dv, dk):
        raise ShapeError(f"state {state.shape}, expected [*, {v_heads}, {dv}, {dk}]")
    if method not in ("auto", "one_pass", "decode", "two_pass"):
        raise ShapeError(f"method must be auto, one_pass, decode or two_pass, got {method!r}")
    if method == "decode" and not gdn_decode_fits(state, dk, dv):
        raise ShapeError(f"gated_delta_rule decode needs dk == {GDN_DECODE_DK}, dv <= {GDN_DECODE_MAX_DV} and a "
                         f"16-byte aligned state (dk={dk}, dv={dv})")
    if rows not in (None, 1, 4):
        raise ShapeError(f"gdn_recurrent rows must be 1 or 4, got {rows}")
    seqs, n = state_slots.size, out.shape[0]
    if method == "decode":
        ctx.device.launch("deltanet", f"gdn_decode_{t}", (v_heads, seqs), 256, out.ptr, q.ptr, k.ptr, v.ptr,
                          i64(qkv_stride), a.ptr, b.ptr, i64(ab_stride), A_log.ptr, dt_bias.ptr, state.ptr,
                          cu_seqlens.ptr, state_slots.ptr, fresh.ptr, i32(k_heads), i32(v_heads), i32(dv))
        return
    grid = ((dv + 7) // 8, v_heads, seqs)
    if method == "one_pass" or (method == "auto" and n < GDN_TWO_PASS_MIN_TOKENS):
        ctx.device.launch("deltanet", f"gated_delta_rule_{t}", grid, 256, out.ptr, q.ptr, k.ptr, v.ptr, i64(qkv_stride),
                          a.ptr, b.ptr, i64(ab_stride), A_log.ptr, dt_bias.ptr, state.ptr, cu_seqlens.ptr,
                          state_slots.ptr, fresh.ptr, i32(k_heads), i32(v_heads), i32(dk), i32(dv))
        return
    mark = ctx.arena.mark()
    qn = ctx.empty((n, k_heads, dk), "f32", "gdn-qn")
    kn = ctx.empty((n, k_heads, dk), "f32", "gdn-kn")
    db = ctx.empty((n, v_heads, 2), "f32", "gdn-decay-beta")
    ctx.device.launch("deltanet", f"gdn_prepare_{t}", (n, k_heads), min(256, max(32, (dk + 31) // 32 * 32)), qn.ptr,
                      kn.ptr, db.ptr, q.ptr, k.ptr, i64(qkv_stride), a.ptr, b.ptr, i64(ab_stride), A_log.ptr,
                      dt_bias.ptr, i32(n), i32(k_heads), i32(v_heads), i32(dk))
    rows = rows or gdn_recurrent_rows(ctx, seqs, v_heads, dv)
    rows_grid = (-(-dv // (8 * rows)), v_heads, seqs)  # 8 warps of `rows` value columns per block
    recurrent = f"gdn_recurrent{'_dk128' if dk <= 128 else ''}{'_r4' if rows == 4 else ''}_{t}"
    ctx.device.launch("deltanet", recurrent, rows_grid, 256, out.ptr, qn.ptr, kn.ptr, v.ptr, i64(qkv_stride),
                      db.ptr, state.ptr, cu_seqlens.ptr, state_slots.ptr, fresh.ptr, i32(k_heads), i32(v_heads),
                      i32(dk), i32(dv))
    ctx.arena.release(mark)

"""Launcher for the chunked (WY-form) gated delta rule on the tensor cores (kernels/deltanet_chunked.cu): the bf16
prefill path of the Gated DeltaNet layers. Same inputs, outputs and state layout as ops.gated_delta_rule; the
intermediates come from the arena for the duration of the call.

Variants (VARIANTS; CudaOptions.deltanet_chunked, DOCPIPE_CUDA_DELTANET_CHUNKED): "current" is two launches (a
parallel pass over chunks, then a sequential pass over each sequence's chunks per dv slice that also computes the
output); "states" is three (the same parallel pass, a sequential pass carrying only the state, then the output over
chunks x heads in parallel; the .cu header says why). DEFAULT_VARIANT is "states" (bit-identical, faster on the H200).
"""
from __future__ import annotations

from collections.abc import Callable

from .context import DArray, GpuContext
from .errors import ShapeError
from .ops import _need, i32, i64

CHUNK = 64  # tokens per chunk (GC_C in the kernel)
DV_SLICE = 32  # value columns per sequential block (GC_SLICE)
NARROW_DV_SLICE = 16  # gdn_chunk_scan16: for grids of fewer 32-column blocks than SMs
THREADS = 128
HEAD_DIMS = ((128, 128), (128, 64), (64, 64), (64, 128))  # (dk, dv) instantiated in the .cu file
MIN_PREFILL_TOKENS = 64  # the runner takes this path for bf16 steps whose longest chunk has at least this many tokens
VARIANTS = ("current", "states")
DEFAULT_VARIANT = "states"


def supports(dk: int, dv: int) -> bool:
    return (dk, dv) in HEAD_DIMS


def scan_slice(dv: int, v_heads: int, seqs: int, sm_count: int) -> int:
    """Value columns per scan block: 32, or 16 when 32-column slices would give fewer blocks than SMs (each block
    walks its sequence's chunks one after another, so the block count is the scan's parallelism)."""
    return NARROW_DV_SLICE if (dv // DV_SLICE) * v_heads * seqs < sm_count else DV_SLICE


def check_variant(variant: str) -> str:
    if variant not in VARIANTS:
        raise ShapeError(f"DOCPIPE_CUDA_DELTANET_CHUNKED (the chunked gated delta rule variant) must be one of "
                         f"{', '.join(VARIANTS)}, got {variant!r}")
    return variant


def chunk_slots(tokens: int, seqs: int) -> int:
    """Chunk slots that cover a varlen batch: chunk c of sequence s sits in slot cu[s] // CHUNK + s + c."""
    return tokens // CHUNK + seqs


def workspace_bytes(tokens: int, seqs: int, v_heads: int, dk: int, dv: int, variant: str = DEFAULT_VARIANT) -> int:
    """Arena bytes one call takes (W, Qd, Kd^T, U, P in bf16 and the chunk decays in f32, per slot and head; the
    states variant adds each chunk's entry state Sc [dv, dk] and V'^T [dv, CHUNK] in bf16)."""
    per_head = 2 * CHUNK * (3 * dk + dv + CHUNK) + 4
    if check_variant(variant) == "states":
        per_head += 2 * dv * (dk + CHUNK)
    return chunk_slots(tokens, seqs) * v_heads * per_head


def states_shared_bytes(dk: int, dv_slice: int) -> int:
    """Dynamic shared memory of gdn_chunk_states (GsLayout in the kernel): two stages of W [C, dk], Kd^T [dk, C] and
    U's slice [C, slice], then the state's and V'^T's bf16 copies; rows padded by 8 bf16."""
    stage = CHUNK * (dk + 8) + dk * (CHUNK + 8) + CHUNK * (dv_slice + 8)
    return 2 * (2 * stage + dv_slice * (dk + 8) + dv_slice * (CHUNK + 8))


def output_shared_bytes(dk: int, dv: int) -> int:
    """Dynamic shared memory of gdn_chunk_output (GoLayout): Qd [C, dk], P [C, C], Sc^T [dv, dk], V'^T [dv, C]."""
    return 2 * (CHUNK * (dk + 8) + CHUNK * (CHUNK + 8) + dv * (dk + 8) + dv * (CHUNK + 8))


def chunked_gated_delta_rule(ctx: GpuContext, out: DArray, q: DArray, k: DArray, v: DArray, qkv_stride: int,
                             a: DArray, b: DArray, ab_stride: int, A_log: DArray, dt_bias: DArray, state: DArray,
                             cu_seqlens: DArray, state_slots: DArray, fresh: DArray, k_heads: int, v_heads: int,
                             dk: int, dv: int, dv_slice: int | None = None,
                             on_launch: Callable[[str], None] | None = None,
                             variant: str = DEFAULT_VARIANT) -> None:
    """Gated delta rule over a varlen batch, bf16 only; state f32 [slots, v_heads, dv, dk]; out [tokens, v_heads*dv].

    q/k/v are column views of one row-major buffer with row stride qkv_stride (q at key head kh * dk, k likewise,
    v at value head h * dv), a/b likewise with ab_stride: the layout ops.gated_delta_rule takes.
    dv_slice: value columns per scan block (32 or 16); None picks with scan_slice from the SM count.
    on_launch: called after each launch with its phase ("prep", then "scan", or "states" and "output" for the
    states variant); the bench records a CUDA event there.
    variant: VARIANTS (the module docstring).
    """
    check_variant(variant)
    for arr, name in ((out, "out"), (q, "q"), (k, "k"), (v, "v"), (a, "a"), (b, "b")):
        _need(arr, "bf16", f"chunked gated delta rule {name}")
    for arr, name in ((state, "state"), (A_log, "A_log"), (dt_bias, "dt_bias")):
        _need(arr, "f32", name)
    for arr, name in ((cu_seqlens, "cu_seqlens"), (state_slots, "state_slots"), (fresh, "fresh")):
        _need(arr, "i32", name)
    if not supports(dk, dv):
        raise ShapeError(f"chunked gated delta rule has (dk, dv) in {HEAD_DIMS}, got {(dk, dv)}")
    if v_heads % k_heads or v_heads > 65535:
        raise ShapeError(f"need v_heads % k_heads == 0 and v_heads <= 65535 (k_heads={k_heads}, v_heads={v_heads})")
    if qkv_stride % 2:
        raise ShapeError(f"qkv_stride must be even (bf16 pairs are read as 32-bit words), got {qkv_stride}")
    if state.shape[1:] != (v_heads, dv, dk):
        raise ShapeError(f"state {state.shape}, expected [*, {v_heads}, {dv}, {dk}]")
    seqs, n = state_slots.size, out.shape[0]
    if cu_seqlens.size != seqs + 1 or fresh.size != seqs or seqs > 65535:
        raise ShapeError(f"cu_seqlens {cu_seqlens.shape}, fresh {fresh.shape} for {seqs} sequences (at most 65535)")
    if out.size != n * v_heads * dv:
        raise ShapeError(f"out {out.shape}, expected [{n}, {v_heads * dv}]")
    width = scan_slice(dv, v_heads, seqs, ctx.device.info.sm_count) if dv_slice is None else dv_slice
    if width not in (DV_SLICE, NARROW_DV_SLICE):
        raise ShapeError(f"dv_slice must be {DV_SLICE} or {NARROW_DV_SLICE}, got {width}")
    slots = chunk_slots(n, seqs)
    mark = ctx.arena.mark()
    try:
        W = ctx.empty((slots, v_heads, CHUNK, dk), "bf16", "gdn-chunk-W")
        Qd = ctx.empty((slots, v_heads, CHUNK, dk), "bf16", "gdn-chunk-Qd")
        KdT = ctx.empty((slots, v_heads, dk, CHUNK), "bf16", "gdn-chunk-KdT")
        U = ctx.empty((slots, v_heads, CHUNK, dv), "bf16", "gdn-chunk-U")
        P = ctx.empty((slots, v_heads, CHUNK, CHUNK), "bf16", "gdn-chunk-P")
        gc = ctx.empty((slots, v_heads), "f32", "gdn-chunk-decay")
        suffix = f"dk{dk}_dv{dv}"
        ctx.device.launch("deltanet_chunked", f"gdn_chunk_prep_{suffix}", (slots, v_heads), THREADS, W.ptr, U.ptr,
                          Qd.ptr, KdT.ptr, P.ptr, gc.ptr, q.ptr, k.ptr, v.ptr, i64(qkv_stride), a.ptr, b.ptr,
                          i64(ab_stride), A_log.ptr, dt_bias.ptr, cu_seqlens.ptr, i32(seqs), i32(k_heads),
                          i32(v_heads))
        if on_launch is not None:
            on_launch("prep")
        narrow = "16" if width == NARROW_DV_SLICE else ""
        if variant == "current":
            ctx.device.launch("deltanet_chunked", f"gdn_chunk_scan{narrow}_{suffix}", (dv // width, v_heads, seqs),
                              THREADS, out.ptr, state.ptr, W.ptr, U.ptr, Qd.ptr, KdT.ptr, P.ptr, gc.ptr,
                              cu_seqlens.ptr, state_slots.ptr, fresh.ptr, i32(v_heads))
            if on_launch is not None:
                on_launch("scan")
            return
        Sc = ctx.empty((slots, v_heads, dv, dk), "bf16", "gdn-chunk-Sc")
        VpT = ctx.empty((slots, v_heads, dv, CHUNK), "bf16", "gdn-chunk-VpT")
        ctx.device.launch("deltanet_chunked", f"gdn_chunk_states{narrow}_{suffix}", (dv // width, v_heads, seqs),
                          THREADS, Sc.ptr, VpT.ptr, state.ptr, W.ptr, U.ptr, KdT.ptr, gc.ptr, cu_seqlens.ptr,
                          state_slots.ptr, fresh.ptr, i32(v_heads), shmem=states_shared_bytes(dk, width))
        if on_launch is not None:
            on_launch("states")
        ctx.device.launch("deltanet_chunked", f"gdn_chunk_output_{suffix}", (slots, v_heads), THREADS, out.ptr,
                          Qd.ptr, P.ptr, Sc.ptr, VpT.ptr, cu_seqlens.ptr, i32(seqs), i32(v_heads),
                          shmem=output_shared_bytes(dk, dv))
        if on_launch is not None:
            on_launch("output")
    finally:
        ctx.arena.release(mark)  # stream order keeps the release safe, as in ops.gated_delta_rule


__all__ = ["CHUNK", "DEFAULT_VARIANT", "DV_SLICE", "HEAD_DIMS", "MIN_PREFILL_TOKENS", "NARROW_DV_SLICE", "VARIANTS",
           "check_variant", "chunk_slots", "chunked_gated_delta_rule", "output_shared_bytes", "scan_slice",
           "states_shared_bytes", "supports", "workspace_bytes"]

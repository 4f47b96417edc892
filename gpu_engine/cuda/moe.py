"""A qwen3_5_moe layer's MLP on the GPU, the CUDA mirror of reference/moe.py: `MoeLayer(ctx, y, x, m)` computes
y = sum_k w_k SwiGLU_k(x) + sigmoid(x . w_shared_gate) SwiGLU_shared(x) for m token rows.

The steps (kernels/moe.cu; tables moe_plan.py), all enqueued on the context's stream without a host sync, so a
decode step with its routing is captured in a CUDA graph like any other:
1. router logits f32 [m, E + 1] in one GEMM (the router's rows and shared_expert_gate's row, uploaded as one matrix);
2. moe_route: softmax, top-k (ties toward the lower expert id), renormalised weights, sigmoid of the shared gate;
3. moe_plan (moe_plan_v2 at decode): per-expert counts and offsets, the tile table, token rows in expert order;
4. the grouped gate|up GEMM (one launch for all experts, rows gathered from x, silu(gate) * up in its epilogue) and
   the grouped down GEMM (one launch) into expert-sorted rows; each block streams its slice of one expert's weight
   once, so a decode step reads each chosen expert's weights once;
5. the shared expert: when its width equals the experts' (35B-A3B: 512 = 512) it is expert E of the stacks and every
   token's entry k (weight sigmoid(gate)), so the same two launches run it; otherwise the dense linear layers
   (linear.SwigluMlp: BF16 or block-FP8);
6. moe_combine: y = sum of the weighted expert rows (+ gate * shared output), per token.
With decode="fused" (CudaOptions.moe_decode) a call of at most moe_decode.MAX_ROWS rows takes moe_decode.py's three
fused launches instead (router GEMV + top-k, gate|up, down + combine); larger calls take the steps above.
Routed experts are bf16 / f32 stacks [E, 2I, H] and [E, H, I] (moe_weights.py); an FP8 expert stack would be
another `ExpertStack` format behind the same grouped-GEMM call.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .context import DArray, GpuContext
from .errors import ShapeError
from .linear import SwigluMlp
from .moe_decode import DECODE_PATHS, MAX_ROWS, FusedBuffers, fused_forward, fused_problem
from .moe_plan import (
    MAX_EXPERTS,
    MAX_TOP_K,
    PLAN_THREADS,
    SIMPLE_COLS,
    GemmTile,
    choose_tile,
    max_tiles,
    plan_shared_bytes,
    tensor_core_fits,
)

i32, i64 = np.int32, np.int64


@dataclass(frozen=True)
class MoeBuffers:
    """One call's routing scratch (arena, released by the caller): what the checks read back."""

    logits: DArray  # f32 [m, ld]: router logits, then the shared gate's in column E
    ids: DArray  # i32 [m, slots]: k routed (+ the stacked shared expert E)
    weights: DArray  # f32 [m, slots]
    shared_gate: DArray  # f32 [m]
    offsets: DArray  # i32 [E + 1]
    tiles: DArray  # i32 [max_tiles, 3]
    sorted_token: DArray  # i32 [m * slots]
    entry_row: DArray  # i32 [m * slots]
    act: DArray  # [m * slots, I] silu(gate) * up of the sorted rows
    expert_out: DArray  # [m * slots, H] each sorted row's expert output
    tile: GemmTile


@dataclass(frozen=True)
class MoeLayer:
    num_experts: int
    top_k: int
    router: DArray  # [E + 1, H]: the router's rows, then shared_expert_gate's
    gate_up: DArray  # [stacks, 2I, H] (gate rows, then up rows, per expert)
    down: DArray  # [stacks, H, I]
    shared: SwigluMlp | None  # the shared expert as linear layers; None: it is expert E of the stacks (stacks E + 1)
    # Calls of <= moe_decode.MAX_ROWS rows: "grouped" (the steps above) or "fused" (moe_decode.py), which must fit
    decode: str = "grouped"

    def __post_init__(self) -> None:
        stacks, two_i, h = self.gate_up.shape
        e = self.num_experts
        if (stacks != e + (self.shared is None) or two_i % 2 or self.down.shape != (stacks, h, two_i // 2)
                or self.router.shape != (e + 1, h)):
            raise ShapeError(f"MoE weights disagree: router {self.router.shape}, gate_up {self.gate_up.shape}, "
                             f"down {self.down.shape} for {self.num_experts} experts")
        if not 0 < self.top_k <= min(e, MAX_TOP_K) or e > MAX_EXPERTS:
            raise ShapeError(f"the CUDA MoE kernels take up to {MAX_EXPERTS} experts and top-k up to {MAX_TOP_K} "
                             f"(<= experts); got {e} experts, top-{self.top_k}")
        if self.decode not in DECODE_PATHS:
            raise ShapeError(f"MoE decode path must be one of {DECODE_PATHS}, got {self.decode!r}")
        problem = fused_problem(self) if self.decode == "fused" else None
        if problem is not None:
            raise ShapeError(f"moe_decode='fused' cannot run this layer: {problem}. Use moe_decode='grouped' "
                             "(DOCPIPE_CUDA_MOE_DECODE=grouped)")

    @property
    def hidden(self) -> int:
        return self.gate_up.shape[2]

    @property
    def inter(self) -> int:
        return self.down.shape[2]

    @property
    def slots(self) -> int:
        """Entries a token has in the plan: its k experts, and the shared expert when it is stacked."""
        return self.top_k + (self.shared is None)

    @property
    def nbytes(self) -> int:
        shared = 0 if self.shared is None else self.shared.gate_up.nbytes + self.shared.down.nbytes
        return self.router.nbytes + self.gate_up.nbytes + self.down.nbytes + shared

    def __call__(self, ctx: GpuContext, y: DArray, x: DArray, m: int) -> None:
        self.forward(ctx, y, x, m)

    def takes_fused(self, m: int, decode: str | None = None) -> bool:
        """Whether a call of m rows runs the fused decode path (decode: this call's path; None: the layer's)."""
        return (decode or self.decode) == "fused" and 0 < m <= MAX_ROWS

    def forward(self, ctx: GpuContext, y: DArray, x: DArray, m: int, decode: str | None = None
                ) -> MoeBuffers | FusedBuffers:
        """y [m, H] = the layer's MLP of x [m, H] (enqueue only; scratch from the arena, the caller releases it).
        decode: "grouped" | "fused" for this call (the checks and the bench); None: the layer's own."""
        if decode is not None and decode not in DECODE_PATHS:
            raise ShapeError(f"MoE decode path must be one of {DECODE_PATHS}, got {decode!r}")
        if self.takes_fused(m, decode):
            return fused_forward(ctx, self, y, x, m)
        return self.grouped_forward(ctx, y, x, m)

    def grouped_forward(self, ctx: GpuContext, y: DArray, x: DArray, m: int) -> MoeBuffers:
        """The steps of the module docstring, at any m."""
        dtype, e, slots, h, inter = x.dtype, self.num_experts, self.slots, self.hidden, self.inter
        stacks = self.gate_up.shape[0]
        if y.dtype != dtype or self.gate_up.dtype != dtype or x.shape[-1] != h:
            raise ShapeError(f"MoE layer: x {x.shape} {x.dtype}, y {y.dtype}, experts {self.gate_up.dtype} (H {h})")
        ld = -(-(e + 1) // 8) * 8
        logits = ctx.empty((m, ld), "f32", "moe.logits")
        ctx.blas.linear(logits.ptr, x.ptr, self.router.ptr, m, e + 1, h, dtype=dtype, y_dtype="f32", y_ld=ld)
        ids, weights, gate = (ctx.empty((m, slots), "i32", "moe.ids"),
                              ctx.empty((m, slots), "f32", "moe.weights"), ctx.empty((m,), "f32", "moe.shared_gate"))
        route(ctx, ids, weights, gate, logits, e, self.top_k)
        tile = choose_tile(m, slots, stacks)
        bufs = plan(ctx, ids, stacks, tile, shared_last=self.shared is None)
        act = ctx.empty((m * slots, inter), dtype, "moe.act")
        out = ctx.empty((m * slots, h), dtype, "moe.expert_out")
        grouped_gemm(ctx, act, x, h, bufs.sorted_token, self.gate_up, bufs.tiles, tile, swiglu=True)
        grouped_gemm(ctx, out, act, inter, None, self.down, bufs.tiles, tile, swiglu=False)
        shared_y = None
        if self.shared is not None:
            shared_y = ctx.empty((m, h), dtype, "moe.shared_out")
            self.shared(ctx, shared_y, x, m)
        combine(ctx, y, out, bufs.entry_row, weights, gate, shared_y, m, slots)
        return MoeBuffers(logits, ids, weights, gate, bufs.offsets, bufs.tiles, bufs.sorted_token, bufs.entry_row,
                          act, out, tile)


@dataclass(frozen=True)
class PlanBuffers:
    offsets: DArray
    tiles: DArray
    sorted_token: DArray
    entry_row: DArray


def route(ctx: GpuContext, ids: DArray, weights: DArray, shared_gate: DArray, logits: DArray, experts: int,
          top_k: int, kernel: str = "moe_route") -> None:
    """Top-k of softmax(logits[:, :E]) renormalised into ids / weights [m, top_k], and sigmoid(logits[:, E]) into
    shared_gate; ids / weights [m, top_k + 1] also get (E, sigmoid) as each token's last entry (the stacked shared
    expert). logits f32 [m, ld >= E + 1]. kernel: "moe_route", or "moe_route_v2" (on trial: the row in registers,
    the same values)."""
    m, stride = ids.shape
    ld, k = logits.shape[1], top_k
    if (logits.dtype != "f32" or ld < experts + 1 or logits.shape[0] < m or weights.shape != (m, stride)
            or stride not in (k, k + 1)):
        raise ShapeError(f"moe_route: logits {logits.shape} {logits.dtype}, ids {ids.shape}, weights {weights.shape}"
                         f" for top-{k}")
    if not 0 < k <= min(experts, MAX_TOP_K) or experts > MAX_EXPERTS:
        raise ShapeError(f"moe_route: top-{k} of {experts} experts (at most {MAX_EXPERTS}, k <= {MAX_TOP_K})")
    if kernel not in ("moe_route", "moe_route_v2"):
        raise ShapeError(f"unknown route kernel {kernel!r}")
    ctx.device.launch("moe", kernel, -(-m // 4), 128, logits.ptr, i32(ld), i32(m), i32(experts), i32(k),
                      i32(stride), ids.ptr, weights.ptr, shared_gate.ptr)


PLAN_KERNELS = ("moe_plan", "moe_plan_v2")


def plan_kernel(experts: int, tile: GemmTile) -> str:
    """moe_plan_v2 for the decode tiles (its scan over the experts: 3.6 us against moe_plan's 17.6 at 35B-A3B batch
    1), moe_plan for prefill (v2's __match_any_sync over 73,728 entries: 177 us against 131; cuda_notes 2026-12-02)
    and beyond one expert a thread."""
    return "moe_plan_v2" if tile.name == "decode" and experts <= PLAN_THREADS else "moe_plan"


def plan(ctx: GpuContext, ids: DArray, experts: int, tile: GemmTile, shared_last: bool = False,
         kernel: str | None = None) -> PlanBuffers:
    """The routing plan of ids [m, k] (moe_plan.py's docstring), built on the device in one block.

    shared_last: every token's entry k - 1 is the stacked shared expert (expert experts - 1), which moe_plan_v2
    places by token without an atomic. kernel: one of PLAN_KERNELS (the checks and the bench name it); None:
    plan_kernel's choice."""
    m, k = ids.shape
    entries = m * k
    kernel = kernel or plan_kernel(experts, tile)
    if kernel not in PLAN_KERNELS or (kernel == "moe_plan_v2" and experts > PLAN_THREADS):
        raise ShapeError(f"plan kernel {kernel!r} for {experts} experts (moe_plan_v2 scans one a thread, "
                         f"<= {PLAN_THREADS})")
    bound = max_tiles(entries, experts, tile.bm)
    bufs = PlanBuffers(ctx.empty((experts + 1,), "i32", "moe.offsets"), ctx.empty((bound, 3), "i32", "moe.tiles"),
                       ctx.empty((entries,), "i32", "moe.sorted_token"), ctx.empty((entries,), "i32", "moe.entry_row"))
    head = (ids.ptr, i32(entries), i32(k), i32(experts), i32(tile.bm), i32(bound))
    flag = (i32(shared_last),) if kernel == "moe_plan_v2" else ()
    ctx.device.launch("moe", kernel, 1, PLAN_THREADS, *head, *flag, bufs.offsets.ptr, bufs.tiles.ptr,
                      bufs.sorted_token.ptr, bufs.entry_row.ptr, shmem=plan_shared_bytes(experts))
    return bufs


def grouped_gemm(ctx: GpuContext, y: DArray, x: DArray, x_ld: int, row_src: DArray | None, w: DArray,
                 tiles: DArray, tile: GemmTile, swiglu: bool, path: str = "auto") -> str:
    """y[r] = x[row_src[r] or r] @ w[expert(r)]^T over the tile table (swiglu: silu(gate) * up of w's [2I] rows).
    w [E, N, K]; y [rows, N or N/2] packed. path "auto" | "mma" | "simple"; returns the path taken."""
    _, n, k = w.shape
    outs = n // 2 if swiglu else n
    if x.dtype != w.dtype or y.dtype != w.dtype or y.shape[-1] != outs or x_ld < k:
        raise ShapeError(f"grouped GEMM: x {x.dtype} (ld {x_ld}), w {w.shape} {w.dtype}, y {y.shape} {y.dtype}")
    if tiles.dtype != "i32" or tiles.shape[1:] != (3,):
        raise ShapeError(f"grouped GEMM tiles must be i32 [T, 3], got {tiles.shape} {tiles.dtype}")
    fits = tensor_core_fits(w.dtype, k, x_ld, x.ptr, w.ptr)
    if path == "auto":
        path = "mma" if fits else "simple"
    if path == "mma" and not fits:
        raise ShapeError(f"the tensor-core grouped GEMM needs bf16, K % 8 == 0 and 16-byte rows (K {k}, ld {x_ld})")
    kind = "swiglu" if swiglu else "plain"
    src = row_src.ptr if row_src is not None else 0
    args = (y.ptr, i64(outs), x.ptr, i64(x_ld), src, w.ptr, i32(n), i32(k), tiles.ptr)
    if path == "mma":
        cols = tile.bn // 2 if swiglu else tile.bn
        ctx.device.launch("moe", f"moe_gemm_{tile.name}_{kind}_bf16", (-(-outs // cols), tiles.shape[0]),
                          tile.threads, *args, shmem=tile.shared_bytes())
    elif path == "simple":
        ctx.device.launch("moe", f"moe_gemm_simple_{kind}_{w.dtype}", (-(-outs // SIMPLE_COLS), tiles.shape[0]), 256,
                          *args)
    else:
        raise ShapeError(f"unknown grouped GEMM path {path!r}")
    return path


COMBINE_V2_THREADS = 128


def combine(ctx: GpuContext, y: DArray, expert_out: DArray, entry_row: DArray, weights: DArray, shared_gate: DArray,
            shared_y: DArray | None, m: int, k: int, vectorised: bool = False) -> None:
    """y[t] = sum_j<k weights[t, j] expert_out[entry_row[t, j]] (+ shared_gate[t] shared_y[t]).
    vectorised: moe_combine_v2 (on trial: 16-byte loads, more blocks, the same sums; H a multiple of 16 bytes)."""
    h = y.shape[-1]
    dtypes = {y.dtype, expert_out.dtype} | ({shared_y.dtype} if shared_y is not None else set())
    if expert_out.shape[-1] != h or (shared_y is not None and shared_y.shape[-1] != h) or len(dtypes) != 1:
        raise ShapeError(f"moe_combine: y {y.shape}, expert_out {expert_out.shape}, shared "
                         f"{shared_y.shape if shared_y is not None else None}")
    args = (y.ptr, expert_out.ptr, entry_row.ptr, weights.ptr, i32(k), shared_gate.ptr,
            shared_y.ptr if shared_y is not None else 0, i32(m), i32(h))
    if not vectorised:
        ctx.device.launch("moe", f"moe_combine_{y.dtype}", m, 256, *args)
        return
    per = 16 // y.itemsize  # values a 16-byte load
    if h % per:
        raise ShapeError(f"moe_combine_v2 reads 16-byte pieces of a row: H {h} is not a multiple of {per}")
    ctx.device.launch("moe", f"moe_combine_v2_{y.dtype}", (m, -(-h // (per * COMBINE_V2_THREADS))),
                      COMBINE_V2_THREADS, *args)

"""The fused small-batch decode path of a qwen3_5_moe layer (CudaOptions.moe_decode = "fused"): for up to MAX_ROWS
token rows, three launches of kernels/moe.cu (its "fused small-batch decode" section says how each works) instead of
the grouped path's router GEMM, route, plan, two grouped GEMMs and combine:
1. moe_decode_route: router logits [m, E + 1] as GEMVs, then one block's softmax / top-k / renormalised weights
   (moe_route_v2's values on those logits) and sigmoid of the shared gate;
2. moe_decode_gate_up: silu(gate) * up of every (token, slot) entry, slot k the stacked shared expert;
3. moe_decode_down: each token's k + 1 down projections weighted and summed in a fixed order (the combine fused).
No plan and no host read: the grids depend on m alone, so the path sits inside a decode graph. It needs the shared
expert stacked as expert E (moe_weights.stacks_shared: its width equals the experts'), 16-byte rows and at most
1024 experts; `fused_problem` says what a layer lacks.

Why MAX_ROWS = 8: each (token, slot) entry streams its expert's rows, so tokens that chose the same expert read it
twice (side by side in the grid, mostly from L2); with 256 experts and top-8, 8 tokens hold 64 entries for ~57.4
distinct experts, 16 tokens 128 for ~99.6 (28% more weight reads), where the grouped path reads each expert once and
its fixed ~60 us of small-kernel latency no longer dominates. The bench (bench/moe_layer_bench.py) times both.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .context import DArray, GpuContext
from .errors import ShapeError

if TYPE_CHECKING:
    from .moe import MoeLayer

i32 = np.int32

DECODE_PATHS = ("grouped", "fused")
MAX_ROWS = 8  # token rows up to which MoeLayer takes the fused path when asked (docstring: why)
ROUTE_WARPS = 8  # router rows a route block (a warp a row)
GATE_UP_WARPS = 4  # features a gate_up block (kernels/moe.cu MOE_DECODE_GATE_UP_ENTRY)
DOWN_WARPS = 4  # output columns a down block (MOE_DECODE_DOWN_ENTRY)
ROUTE_EXPERTS = (256, 1024)  # route entries by experts a warp holds (8 or 32 a lane)
MAX_EXPERTS = 1024
MAX_SLOTS = 32  # k routed + the shared expert: one lane of the down kernel's warp each
MAX_SHARED_BYTES = 227 * 1024  # dynamic shared memory an sm_90 block may opt into
DTYPES = ("bf16", "f32")
ITEMSIZE = {"bf16": 2, "f32": 4}


@dataclass(frozen=True)
class FusedBuffers:
    """One fused call's scratch (arena, released by the caller): what the checks read back."""

    logits: DArray  # f32 [m, ld]: router logits, the shared gate's in column E
    ids: DArray  # i32 [m, k + 1]: the k routed experts by falling weight, then E (the stacked shared expert)
    weights: DArray  # f32 [m, k + 1]: renormalised routing weights, then sigmoid(shared gate)
    shared_gate: DArray  # f32 [m]
    act: DArray  # [m * (k + 1), I]: silu(gate) * up of entry (token, slot)


def route_kernel(dtype: str, experts: int) -> str:
    """The moe_decode_route entry for `experts` routed experts."""
    width = next((w for w in ROUTE_EXPERTS if experts <= w), None)
    if width is None or dtype not in DTYPES:
        raise ShapeError(f"moe_decode_route takes bf16 / f32 and <= {MAX_EXPERTS} experts, got {dtype}, {experts}")
    return f"moe_decode_route_{dtype}_e{width}"


def fused_problem(layer: MoeLayer, rows: int = MAX_ROWS) -> str | None:
    """Why the fused kernels cannot run `layer` for up to `rows` token rows, or None when they can."""
    dtype, e, k, h, inter = layer.gate_up.dtype, layer.num_experts, layer.top_k, layer.hidden, layer.inter
    per = 16 // ITEMSIZE.get(dtype, 16)
    if layer.shared is not None:
        return ("the shared expert is not stacked with the routed experts (its width differs from theirs, or it is "
                "FP8): the fused kernels run it as expert E of the stacks")
    if dtype not in DTYPES:
        return f"experts in {dtype} (the fused kernels read bf16 or f32)"
    if h % per or inter % per:
        return f"hidden {h} and moe_intermediate {inter} must be multiples of {per} (16-byte rows of {dtype})"
    if e > MAX_EXPERTS or k + 1 > MAX_SLOTS:
        return f"{e} experts, top-{k}: the fused kernels take <= {MAX_EXPERTS} experts and top-k <= {MAX_SLOTS - 1}"
    need = max(rows * h, (k + 1) * inter) * ITEMSIZE[dtype]
    if need > MAX_SHARED_BYTES:
        return f"{need} bytes of staged activations a block exceed {MAX_SHARED_BYTES}"
    return None


def fused_forward(ctx: GpuContext, layer: MoeLayer, y: DArray, x: DArray, m: int) -> FusedBuffers:
    """y [m, H] = the layer's MLP of x [m, H] (packed rows) by the three fused launches (enqueue only)."""
    problem = fused_problem(layer, m)
    if problem is not None or not 0 < m <= MAX_ROWS:
        raise ShapeError(f"fused MoE decode: {problem or f'{m} rows (it takes 1..{MAX_ROWS})'}")
    dtype, e, k, h, inter = x.dtype, layer.num_experts, layer.top_k, layer.hidden, layer.inter
    slots = k + 1
    if y.dtype != dtype or layer.gate_up.dtype != dtype or x.shape[-1] != h or y.shape[-1] != h:
        raise ShapeError(f"fused MoE decode: x {x.shape} {x.dtype}, y {y.shape} {y.dtype}, experts "
                         f"{layer.gate_up.dtype} (H {h})")
    ld = -(-(e + 1) // 8) * 8
    bufs = FusedBuffers(ctx.empty((m, ld), "f32", "moe.logits"), ctx.empty((m, slots), "i32", "moe.ids"),
                        ctx.empty((m, slots), "f32", "moe.weights"), ctx.empty((m,), "f32", "moe.shared_gate"),
                        ctx.empty((m * slots, inter), dtype, "moe.act"))
    launch_route(ctx, layer, x, m, bufs)
    launch_gate_up(ctx, layer, x, m, bufs)
    launch_down(ctx, layer, y, m, bufs)
    return bufs


# The three launches alone (fused_forward checks the shapes; the bench times each step on its own).
def launch_route(ctx: GpuContext, layer: MoeLayer, x: DArray, m: int, bufs: FusedBuffers) -> None:
    e, h = layer.num_experts, layer.hidden
    ctx.device.launch("moe", route_kernel(x.dtype, e), -(-(e + 1) // ROUTE_WARPS), 32 * ROUTE_WARPS, x.ptr, i32(m),
                      i32(h), layer.router.ptr, i32(e), i32(layer.top_k), bufs.logits.ptr, i32(bufs.logits.shape[1]),
                      bufs.ids.ptr, bufs.weights.ptr, bufs.shared_gate.ptr, shmem=m * h * ITEMSIZE[x.dtype])


def launch_gate_up(ctx: GpuContext, layer: MoeLayer, x: DArray, m: int, bufs: FusedBuffers) -> None:
    e, k, h, inter = layer.num_experts, layer.top_k, layer.hidden, layer.inter
    ctx.device.launch("moe", f"moe_decode_gate_up_{x.dtype}", (m * (k + 1), -(-inter // GATE_UP_WARPS)),
                      32 * GATE_UP_WARPS, x.ptr, i32(h), bufs.ids.ptr, i32(k), i32(e), layer.gate_up.ptr, i32(inter),
                      bufs.act.ptr, shmem=h * ITEMSIZE[x.dtype])


def launch_down(ctx: GpuContext, layer: MoeLayer, y: DArray, m: int, bufs: FusedBuffers) -> None:
    e, k, h, inter = layer.num_experts, layer.top_k, layer.hidden, layer.inter
    ctx.device.launch("moe", f"moe_decode_down_{y.dtype}", (m, -(-h // DOWN_WARPS)), 32 * DOWN_WARPS, bufs.act.ptr,
                      bufs.ids.ptr, bufs.weights.ptr, i32(k), i32(e), layer.down.ptr, i32(inter), i32(h), y.ptr,
                      shmem=(k + 1) * inter * ITEMSIZE[y.dtype])

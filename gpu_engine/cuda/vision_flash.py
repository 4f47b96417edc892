"""Launcher of kernels/vision_flash.cu: the vision tower's fused segment attention on the tensor cores (bf16).

Same function as vision_ops.vision_attention (bidirectional attention inside consecutive segments of seg_len rows,
q, k, v read in place from the fused qkv projection), without materialising scores: one block per (query tile of a
segment, head), keys streamed in steps with an online softmax.

Variants (VARIANTS: name -> m-tiles per warp, keys per step): "m1" is the first kernel (64 query rows a block, 64 keys
a step); "m2n32" / "m2n64" give each warp two m-tiles (128 rows a block), so every K / V fragment read from shared
memory feeds two mma and each key tile fetched from L2 serves twice the rows; "m2n32" streams 32 keys a step (nvcc
13.0 -Xptxas -v: 214 / 228 registers at head_dim 72 / 80, no spills; "m2n64" takes 254 / 255 and spills at 80).
On the H200 (16 heads x 72; session 6 in git history of bench/results/cuda/vision_flash_bench.json) m2n32 ran 208 /
225 / 258 TFLOP/s at 4096 / 8580 / 47376 rows, m2n64 205-242, m1 143-170: m2n32 was the default until session 10.
Head dims without an m2 instantiation (128) run "m1".

"wg64" (kernels/vision_flash_wg.cu) is the same schedule on Hopper's warpgroup MMA (wgmma, compiled for sm_90a):
two warpgroups of 64 query rows (128 a block, 256 threads), 64 keys a step, head_dim 72 only; elsewhere (another
head dim, a device that is not sm_90) it runs m2n32 instead (resolve_variant). On the H200 it passes every check
(check_vision_flash, check_vision with it as default) but ran no faster than m2n32 at 4,096 rows (219 vs 218 TFLOP/s,
bench/results/cuda_notes.md, session 7): each warpgroup still waits on its own Q K^T, softmax and P V in turn, so
it stays an option until the softmax overlaps the other warpgroup's MMAs. "wg64s" is the same kernel with one
barrier a step and the next tile's copies issued after it (so the step's fence.proxy.async has no copies in flight
behind it). Session 9 (vision_flash_bench.json): both pass check_vision_flash; wg64 244 / 226 / 281 and wg64s
233 / 235 / 274 TFLOP/s against m2n32's 220 / 224 / 259 at those rows: not yet the default.
"wg64p" (same file, vw_attention_pipelined) overlaps each warpgroup's softmax with its own tensor-core work as
FlashAttention-3 does: step j issues S_j = Q K_j^T and O += P_{j-1} V_{j-1} together, waits for S_j alone, runs its
softmax while the P V is in flight, then waits for that and rescales O. Q sits in shared memory (an SS-form operand:
the registers it frees keep the kernel at 122, two blocks an SM, NVRTC 13.5 ptxas, no spills) and K | V stream through
four stages copied two tiles ahead (98,304 bytes of shared memory a block). "wg64pr" is the same schedule with Q in
registers (RS form, wg64's checked building block, in case the SS-form Q operand is wrong): 126 registers and 40
bytes of spills at two blocks an SM, 77,824 bytes of shared memory. Session 10 on an H200: both pass
check_vision_flash; wg64p 243 / 242 / 282 TFLOP/s against m2n32's 223 / 227 / 258 (vision_flash_bench.json), and
check_vision passes with it: DEFAULT_VARIANT is wg64p (m2n32 on other devices and head dims, resolve_variant).
"ws2n128" / "ws2n64" / "ws3n64" (kernels/vision_flash_ws.cu, session 11) are wg64pr's step with warp specialisation
(FlashAttention-3's structure): one producer warpgroup copies key tiles through an mbarrier-handed ring and 2 or 3
consumer warpgroups of 64 rows compute, no block-wide barrier in the key loop, setmaxnreg moving registers to the
consumers, one block an SM (ptxas, NVRTC 13: 168 / 168 / 128 registers at launch). The "q" forms keep Q in shared
memory (wg64p's SS operand), which leaves room for 128 keys a step at 3 consumers, or 4 consumers.
Session 11 on an H200: ws2n128 / ws2n64 / ws3n64 pass check_vision_flash (ws3n64q / ws3n128q pass
vision_flash_bench's checks; ws4n64q not yet run); a 4,096-row layer in 0.240 ms with ws3n64 (322 TFLOP/s) against
wg64p's 0.319 (242); check_vision passes with ws3n64 as the tower's kernel, and the 9B document run's vision GPU time
fell from 11.4 to 10.2 s: DEFAULT_VARIANT is ws3n64 since (bench/results/cuda_notes.md, session 11).
"""
from __future__ import annotations

import numpy as np

from .context import DArray, GpuContext
from .errors import ShapeError
from .ops import _need

HEAD_DIMS = (64, 72, 80, 128)  # instantiated in kernels/vision_flash.cu
TILE_ROWS = 64  # query rows per block of the m1 variant (VF_ROWS in the kernel: 4 warps x 16)
KEYS_PER_STEP = 64  # keys per step of the m1 variant (VF_BN in the kernel)
# name -> (query rows per block / 64, keys per step): m-tiles per warp for the mma.sync variants; wg64's two
# warpgroups of 64 rows make 128 rows a block like m2's 4 warps x 2 m-tiles
VARIANTS = {"m1": (1, 64), "m2n64": (2, 64), "m2n32": (2, 32), "wg64": (2, 64), "wg64s": (2, 64), "wg64p": (2, 64),
            "wg64pr": (2, 64), "ws2n128": (2, 128), "ws2n64": (2, 64), "ws3n64": (3, 64), "ws3n128q": (3, 128),
            "ws3n64q": (3, 64), "ws4n64q": (4, 64)}
M2_HEAD_DIMS = (64, 72, 80)  # the m2 variants' instantiations (DEFINE2 in the kernel)
# kernels/vision_flash_wg.cu (wgmma, sm_90a): name -> kernel name suffix. wg64s: the next tile's copies issued after
# the step's barrier, one barrier a step; wg64p: the pipelined kernel (softmax overlapping P V), wg64pr: the same with
# Q in registers as wg64 (both not yet run on a GPU)
WG_VARIANTS = {"wg64": "", "wg64s": "_sb", "wg64p": "_p", "wg64pr": "_pr"}
# name -> (K | V stages in shared memory, Q rows staged there too: 0 = Q in registers)
WG_STAGING = {"wg64": (2, 0), "wg64s": (2, 0), "wg64p": (4, 128), "wg64pr": (4, 0)}
# kernels/vision_flash_ws.cu (warp-specialised wgmma, sm_90a): name -> (consumer warpgroups, keys per step, stages,
# Q in shared memory)
WS_VARIANTS = {"ws2n128": (2, 128, 3, False), "ws2n64": (2, 64, 4, False), "ws3n64": (3, 64, 4, False),
               "ws3n128q": (3, 128, 3, True), "ws3n64q": (3, 64, 4, True), "ws4n64q": (4, 64, 4, True)}
HOPPER_VARIANTS = (*WG_VARIANTS, *WS_VARIANTS)  # need WG_ARCHS and a WG_HEAD_DIMS head dim
WG_HEAD_DIMS = (72,)
WG_ARCHS = ("sm_90",)  # devices whose arch-specific target has wgmma (gpu_engine.cuda.device.compile_arch)
WG_THREADS = 256
DEFAULT_VARIANT = "ws3n64"  # resolve_variant: m2n32 where wgmma or head_dim 72 is not there
_PAD = 8  # bf16 elements of padding per shared-memory row (VF_PAD)
_MAX_GRID_X = 2**31 - 1
_MAX_HEADS = 65535  # heads are gridDim.y


def padded_head_dim(head_dim: int) -> int:
    """Width of the Q K^T product: head_dim rounded up to the mma's k of 16 (72 -> 80)."""
    return -(-head_dim // 16) * 16


def shared_bytes(head_dim: int, keys: int = KEYS_PER_STEP) -> int:
    """Dynamic shared memory of a vision_flash kernel (VisionFlashShape<HD, BN>::SMEM_BYTES, which the kernel
    checks): two K and two V buffers of `keys` rows, each row padded_head_dim + 8 bf16."""
    return 2 * 4 * keys * (padded_head_dim(head_dim) + _PAD)


def wg_shared_bytes(head_dim: int, keys: int = 64, stages: int = 2, q_rows: int = 0) -> int:
    """Dynamic shared memory of a wgmma kernel (VwShape::SMEM_BYTES for wg64 / wg64s, vw_attention_pipelined's SMEM
    for wg64p): `stages` stages of a K tile (padded_head_dim columns) and a V tile (head_dim columns), `keys` rows
    each, unpadded rows (core-matrix layout), after `q_rows` rows of Q (padded_head_dim columns) when Q is staged."""
    hdp = padded_head_dim(head_dim)
    return (stages * keys * (hdp + head_dim) + q_rows * hdp) * 2


def resolve_variant(head_dim: int, variant: str | None = None, arch: str | None = None) -> str:
    """The variant that runs for this head dim on a device of `arch`: `variant` (DEFAULT_VARIANT when None); a wgmma
    variant only on WG_ARCHS at WG_HEAD_DIMS, else m2n32; "m1" where no m2 kernel exists for head_dim."""
    name = DEFAULT_VARIANT if variant is None else variant
    if name not in VARIANTS:
        raise ShapeError(f"vision_flash variant must be one of {sorted(VARIANTS)}, got {name!r}")
    if name in HOPPER_VARIANTS and (head_dim not in WG_HEAD_DIMS or arch not in WG_ARCHS):
        name = "m2n32"
    return name if name == "m1" or head_dim in M2_HEAD_DIMS else "m1"


def kernel_name(head_dim: int, variant: str) -> str:
    m, keys = VARIANTS[variant]
    if variant in WS_VARIANTS:
        return f"vision_flash_ws_bf16_hd{head_dim}_c{m}_n{keys}{'_q' if WS_VARIANTS[variant][3] else ''}"
    if variant in WG_VARIANTS:
        return f"vision_flash_wg_bf16_hd{head_dim}_n{keys}{WG_VARIANTS[variant]}"
    return f"vision_flash_bf16_hd{head_dim}" if m == 1 else f"vision_flash_bf16_hd{head_dim}_m{m}_n{keys}"


def launch_shape(head_dim: int, variant: str) -> tuple[str, int, int]:
    """(kernel family, threads per block, dynamic shared bytes) of a resolved variant."""
    keys = VARIANTS[variant][1]
    if variant in WS_VARIANTS:
        consumers, keys, stages, q_smem = WS_VARIANTS[variant]
        q_rows = 64 * consumers if q_smem else 0
        return "vision_flash_ws", 128 * (1 + consumers), wg_shared_bytes(head_dim, keys, stages, q_rows)
    if variant in WG_VARIANTS:
        stages, q_rows = WG_STAGING[variant]
        return "vision_flash_wg", WG_THREADS, wg_shared_bytes(head_dim, keys, stages, q_rows)
    return "vision_flash", 128, shared_bytes(head_dim, keys)


def tile_rows(variant: str) -> int:
    return TILE_ROWS * VARIANTS[variant][0]


def supported(dtype: str, head_dim: int) -> bool:
    """Whether the fused kernel covers this tower (bf16 storage, an instantiated head dim)."""
    return dtype == "bf16" and head_dim in HEAD_DIMS


def tiles_per_segment(seg_len: int, rows: int = TILE_ROWS) -> int:
    return -(-seg_len // rows)


def vision_flash_attention(ctx: GpuContext, out: DArray, qkv: DArray, heads: int, head_dim: int, seg_len: int,
                           scale: float, variant: str | None = None) -> None:
    """out [n, heads*head_dim] = softmax(scale * q k^T) v inside each segment of seg_len rows; qkv [n, 3*heads*
    head_dim] bf16 (q | k | v per row). Rows are copied in 16-byte pieces: qkv must be 16-byte aligned (head_dim is
    a multiple of 8, so every head's columns are too) and out 4-byte aligned. scale > 0 (the kernel's running max
    starts at -inf and is scaled by it). `variant`: a VARIANTS name (None: DEFAULT_VARIANT; resolve_variant says
    what runs on this device)."""
    for arr, what in ((out, "out"), (qkv, "qkv")):
        _need(arr, "bf16", f"vision_flash_attention {what}")
    n = qkv.shape[0]
    width = heads * head_dim
    if head_dim not in HEAD_DIMS:
        raise ShapeError(f"vision_flash_attention supports head_dim {HEAD_DIMS}, got {head_dim}")
    if (len(qkv.shape) != 2 or qkv.shape != (n, 3 * width) or out.shape != (n, width) or seg_len < 1 or n < 1
            or n % seg_len or not 0 < heads <= _MAX_HEADS or not scale > 0):
        raise ShapeError(f"vision_flash_attention: qkv {qkv.shape}, out {out.shape}, heads {heads}, head_dim "
                         f"{head_dim}, seg_len {seg_len} must divide n >= 1, scale {scale} must be > 0")
    if qkv.ptr % 16 or out.ptr % 4:
        raise ShapeError("vision_flash_attention needs a 16-byte aligned qkv and a 4-byte aligned out")
    name = resolve_variant(head_dim, variant, getattr(ctx.device.info, "arch", None))
    tiles = tiles_per_segment(seg_len, tile_rows(name))
    blocks = n // seg_len * tiles
    if blocks > _MAX_GRID_X:
        raise ShapeError(f"vision_flash_attention: {blocks} query tiles exceed the grid")
    family, threads, shmem = launch_shape(head_dim, name)
    ctx.device.launch(family, kernel_name(head_dim, name), (blocks, heads), threads, out.ptr, qkv.ptr,
                      np.int32(heads), np.int32(seg_len), np.int32(tiles), np.float32(scale), shmem=shmem)

"""GPU vision tower check: GpuVisionTower vs the numpy reference tower (gpu_engine/reference/vision_tower.py).

    python3 -m tests.cuda_runner.check_vision [--json out.json] [--seed N]

Fresh random weights (natural scales: matrices / sqrt(fan_in), norm weights 1 + 0.2 N, biases 0.1 N, position
table N(0, 1)) and pixels N(0, 1) every run; non-square grids, a two-frame-group item (attention segments), and a
Qwen3.5-shaped head (head_dim 72, exact-GELU MLP). Every attention path is checked on every grid: the kernel,
the cuBLASLt GEMM path (column-slice operands, so unaligned addresses too) and, in bf16 with head_dim 72 or 64, the
fused flash kernel (kernels/vision_flash.cu); one 3072-patch grid, where "auto" picks the GEMM path in fp32 and
the flash kernel in bf16 (the GEMM path also run with query blocks smaller than the segment). The output buffer
is poisoned (NaN) before each encode.
Pass: rel-L2 <= 1e-4 in fp32; <= 1e-2 in bf16 against the reference run on the same bf16-rounded weights and pixels.
Then through CudaRunner (tiny checkpoint, fp32): encode_vision returns DeviceEmbeddings equal to the reference,
encode_vision_batch three of them from one tower call, and a prefill chunk that scatters a slice of them on the
device gives the same logits as the same slice passed as a host array. Skips (exit 0) without a GPU.
"""
from __future__ import annotations

import os
import sys
import tempfile
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np

from tests.cuda_runner.harness import check_main, fresh_seed, rel_err

TOL = {"f32": 1e-4, "bf16": 1e-2}
CONFIGS = {
    "tiny hd16 gelu-tanh": dict(depth=2, hidden_size=32, num_heads=2, intermediate_size=64, patch_size=4,
                                temporal_patch_size=2, spatial_merge_size=2, in_channels=3, out_hidden_size=48,
                                num_position_embeddings=36, hidden_act="gelu_pytorch_tanh", rope_theta=10000.0),
    "hd72 exact-gelu": dict(depth=2, hidden_size=144, num_heads=2, intermediate_size=256, patch_size=8,
                            temporal_patch_size=2, spatial_merge_size=2, in_channels=3, out_hidden_size=96,
                            num_position_embeddings=64, hidden_act="gelu", rope_theta=10000.0),
    "hd64 x4 heads": dict(depth=3, hidden_size=256, num_heads=4, intermediate_size=512, patch_size=4,
                          temporal_patch_size=2, spatial_merge_size=2, in_channels=3, out_hidden_size=128,
                          num_position_embeddings=100, hidden_act="gelu_pytorch_tanh", rope_theta=10000.0),
}
GRIDS = [(1, 4, 6), (1, 10, 6), (2, 6, 8), (1, 16, 24)]
BIG_GRID = (1, 48, 64)  # checked on the Qwen3.5-shaped head only (the numpy reference is slow there)


@dataclass
class VisionResult:
    config: str
    dtype: str
    grid: tuple[int, int, int]
    rel_err: float
    ok: bool


def random_vision_weights(cfg: SimpleNamespace, rng: np.random.Generator) -> dict[str, np.ndarray]:
    from gpu_engine.reference.vision_tower import vision_weight_shapes

    out = {}
    for name, shape in vision_weight_shapes(cfg).items():
        if name.startswith("pos_embed"):
            w = rng.standard_normal(shape)
        elif "norm" in name and name.endswith("weight"):
            w = 1.0 + 0.2 * rng.standard_normal(shape)
        elif name.endswith("bias"):
            w = 0.1 * rng.standard_normal(shape)
        else:
            w = rng.standard_normal(shape) / np.sqrt(np.prod(shape[1:]))
        out[name] = w.astype(np.float32)
    return out


def check_towers(rng: np.random.Generator) -> list[VisionResult]:
    from gpu_engine.cuda import vision, vision_flash
    from gpu_engine.cuda.bf16 import round_to_bf16
    from gpu_engine.cuda.context import GpuContext
    from gpu_engine.cuda.vision import GpuVisionTower
    from gpu_engine.reference.vision_tower import VisionTower

    results = []
    ctx = GpuContext(1 << 30)
    try:
        for name, fields in CONFIGS.items():
            cfg = SimpleNamespace(**fields)
            weights = random_vision_weights(cfg, rng)
            for dtype in ("f32", "bf16"):
                ref_w = weights if dtype == "f32" else {k: round_to_bf16(v) for k, v in weights.items()}
                ref_tower = VisionTower(cfg, ref_w)
                mark = ctx.arena.mark()
                flash = vision_flash.supported(dtype, ref_tower.dims.head_dim)
                towers = {mode: GpuVisionTower(ctx, cfg, weights, dtype, attention=mode)
                          for mode in ("kernel", "gemm", "auto") + (("flash",) if flash else ())}
                grids = GRIDS + ([BIG_GRID] if name.startswith("hd72") else [])
                for grid in grids:
                    t, h, w = grid
                    pixels = rng.standard_normal((t * h * w, ref_tower.dims.patch_dim)).astype(np.float32)
                    ref = ref_tower.encode(pixels if dtype == "f32" else round_to_bf16(pixels), grid)
                    small_modes = ("kernel", "gemm") + (("flash",) if flash else ())
                    for mode in ("auto", "gemm/blocks") if grid == BIG_GRID else small_modes:
                        out = ctx.empty(ref.shape, dtype, "check-out")
                        ctx.poison(out)
                        if mode == "gemm/blocks":  # a score budget of 1000 query rows: blocks 1000, 1000, 1000, 72
                            saved = vision.SCORES_BYTES
                            vision.SCORES_BYTES = 4 * h * w * cfg.num_heads * 1000
                            try:
                                towers["gemm"].encode(pixels, grid, out)
                            finally:
                                vision.SCORES_BYTES = saved
                        else:
                            towers[mode].encode(pixels, grid, out)
                        err = rel_err(ctx.to_host(out), ref)
                        label = f"{name} [{mode}]"
                        results.append(VisionResult(label, dtype, grid, err, bool(err <= TOL[dtype])))
                        print(f"{label:<30} {dtype:<5} grid {grid}: rel. err {err:.2e}", flush=True)
                ctx.device.sync()
                ctx.arena.release(mark)
    finally:
        ctx.close()
    return results


def check_softmax(rng: np.random.Generator) -> list[VisionResult]:
    """Both softmax kernels of the GEMM attention vs numpy float64, rows shorter and longer than one pass."""
    from gpu_engine.cuda import vision_ops
    from gpu_engine.cuda.context import GpuContext

    results = []
    ctx = GpuContext(1 << 30)
    try:
        for rows, cols in ((37, 24), (64, 4096), (5, 8192), (3, 9000)):
            s = (3.0 * rng.standard_normal((rows, cols))).astype(np.float32)
            z = s.astype(np.float64) * 0.3
            ref = np.exp(z - z.max(1, keepdims=True))
            ref /= ref.sum(1, keepdims=True)
            scores = ctx.to_device(s, "f32", "scores")
            for dtype in ("f32", "bf16"):
                for method in ("cached", "loop") if cols <= vision_ops.SOFTMAX_CACHED_MAX else ("loop",):
                    out = ctx.empty((rows, cols), dtype, "probs")
                    ctx.poison(out)
                    vision_ops.softmax_rows(ctx, out, scores, 0.3, method)
                    err = rel_err(ctx.to_host(out), ref)
                    results.append(VisionResult(f"softmax_rows {method} {rows}x{cols}", dtype, (0, rows, cols), err,
                                                bool(err <= TOL[dtype])))
    finally:
        ctx.close()
    for r in results:
        print(f"{r.config:<32} {r.dtype:<5} rel. err {r.rel_err:.2e}  {'PASS' if r.ok else 'FAIL'}", flush=True)
    return results


def check_runner_path(rng: np.random.Generator) -> list[VisionResult]:
    """CudaRunner.encode_vision -> DeviceEmbeddings; device scatter == host scatter in a prefill step."""
    from gpu_engine.config import ModelConfig
    from gpu_engine.cuda.embeddings import DeviceEmbeddings
    from gpu_engine.cuda.options import CudaOptions
    from gpu_engine.cuda.runner import CudaRunner
    from gpu_engine.inputs import VisionItem
    from gpu_engine.loader import load_weights
    from gpu_engine.reference.vision_tower import VisionTower
    from gpu_engine.runner_api import CacheSpec, SeqChunk, StepBatch, VisionSlice
    from gpu_engine.tiny import make_tiny_checkpoint

    with tempfile.TemporaryDirectory() as folder:
        make_tiny_checkpoint(folder, seed=int(rng.integers(1000)))
        config = ModelConfig.from_pretrained(folder)
        weights, _ = load_weights(folder, config)
    v = config.vision
    grid = (1, 2 * v.spatial_merge_size, 3 * v.spatial_merge_size)
    n = grid[1] * grid[2]
    pixels = rng.standard_normal((n, v.in_channels * v.temporal_patch_size * v.patch_size ** 2)).astype(np.float32)
    tokens = n // v.spatial_merge_size ** 2
    item = VisionItem("image", pixels, grid, token_start=3, num_tokens=tokens, content_hash="check")
    ref = VisionTower(v, weights.vision).encode(pixels, grid)
    runner = CudaRunner(config, weights, CudaOptions(dtype="f32", memory_budget=1 << 30, encoder_memory=1 << 20))
    results = []
    try:
        emb = runner.encode_vision(item)
        assert isinstance(emb, DeviceEmbeddings), type(emb)
        err = rel_err(np.asarray(emb), ref)
        results.append(VisionResult("runner encode_vision", "f32", grid, err, bool(err <= TOL["f32"])))
        runner.allocate_cache(CacheSpec(num_kv_blocks=8, block_size=16, num_state_slots=2))
        ids = rng.integers(0, config.text.vocab_size, 12)
        pos = np.broadcast_to(np.arange(12), (3, 12)).astype(np.int64)
        logits = []
        for emb_piece in (emb[1:tokens], np.asarray(emb)[1:tokens]):
            chunk = SeqChunk(0, ids, pos, 0, np.arange(1, dtype=np.int32), 0,
                             vision=[VisionSlice(2, emb_piece)], logits="all")
            logits.append(runner.forward(StepBatch([chunk])).logits)
        err = rel_err(logits[0], logits[1])
        results.append(VisionResult("runner device vs host scatter", "f32", grid, err, bool(err <= 1e-6)))
        # encode_vision_batch: three items of one grid in one tower call, each its own DeviceEmbeddings
        more = [rng.standard_normal(pixels.shape).astype(np.float32) for _ in range(3)]
        items = [VisionItem("image", p, grid, token_start=3, num_tokens=tokens, content_hash=f"b{i}")
                 for i, p in enumerate(more)]
        batch = runner.encode_vision_batch(items)
        err = max(rel_err(np.asarray(e), VisionTower(v, weights.vision).encode(p, grid)) for e, p in zip(batch, more))
        ok = err <= TOL["f32"] and all(isinstance(e, DeviceEmbeddings) for e in batch)
        results.append(VisionResult("runner encode_vision_batch x3", "f32", grid, err, bool(ok)))
        del batch
        free_before = runner._encoded.free_bytes
        del emb, emb_piece
        import gc

        gc.collect()
        freed = runner._encoded.free_bytes > free_before
        results.append(VisionResult("runner pool block freed", "f32", grid, 0.0 if freed else 1.0, freed))
    finally:
        runner.close()
    for r in results:
        print(f"{r.config:<32} rel. err {r.rel_err:.2e}  {'PASS' if r.ok else 'FAIL'}", flush=True)
    return results


def run_all(seed: int | None = None) -> tuple[list[VisionResult], dict]:
    from gpu_engine.cuda.device import require_gpu

    require_gpu()
    seed = fresh_seed(seed)
    rng = np.random.default_rng(seed)
    results = []
    for part in (check_softmax, check_towers, check_runner_path):  # one part raising still lets the other run
        try:
            results += part(rng)
        except Exception:  # noqa: BLE001 - reported as a failed result with its traceback
            import traceback

            traceback.print_exc()
            results.append(VisionResult(part.__name__ + " raised", "-", (0, 0, 0), float("nan"), False))
    return results, {"seed": seed}


def format_table(results: list[VisionResult]) -> str:
    lines = [f"{'config':<32} {'dtype':<5} {'grid':<12} {'rel.err':>9}  ok", "-" * 66]
    for r in results:
        lines.append(f"{r.config:<32} {r.dtype:<5} {str(r.grid):<12} {r.rel_err:>9.2e}  {'PASS' if r.ok else 'FAIL'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    variant = os.environ.get("DOCPIPE_CUDA_VISION_FLASH")
    if variant:  # check the flash variant the runner would take from the same setting (towers built here use it)
        from gpu_engine.cuda import vision_flash

        if variant not in vision_flash.VARIANTS:
            raise SystemExit(f"DOCPIPE_CUDA_VISION_FLASH={variant!r} is not one of {sorted(vision_flash.VARIANTS)}")
        vision_flash.DEFAULT_VARIANT = variant
        print(f"flash variant (DOCPIPE_CUDA_VISION_FLASH): {variant}")
    return check_main(__doc__.splitlines()[0], run_all, format_table, argv)


if __name__ == "__main__":
    sys.exit(main())

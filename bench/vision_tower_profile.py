"""The 9B-class vision tower at the document run's input sizes: time per item by kind, split by op, against its limit.

    python3 bench/vision_tower_profile.py [--json out.json] [--variants m2n32,wg64] [--reps 3]
                                          [--mix 168,12,12] [--photo-caps 3145728,2359296] [--arena-gib 6]

Kinds, sized by the processor's own rule (gpu_engine.preprocessing, Qwen3-VL's pixel budgets as bench/doc_models
writes them) from the sizes bench/doc_workload makes: an A4 PDF page at 150 dpi (1240 x 1755), a phone photo
(4032 x 3024 at full size, as the processor would take it, and at each --photo-caps pixel cap, by default the
product's MediaLimits.max_photo_pixels, applied as vision/raster applies it)
and a video (16 frames of 960 x 540, 8 frame groups of temporal 2). For each (kind, attention variant):
- `encode_ms`: wall time of GpuVisionTower.encode and a stream sync after it (encode itself returns once it has
  enqueued everything: `enqueue_ms`, the host's share), median of --reps after a warm-up;
- `ops`: device time by op from one more encode with CUDA events around every launch (attention, the GEMMs by
  weight, LayerNorm, rotary, bias/activation, patch position taps, the pixel cast), each with its FLOPs and TFLOP/s;
  `host_ms` = encode_ms - the device time of all ops (uploads, host geometry, launch gaps);
- `limit_ms`: the item's FLOPs (GpuVisionTower.flops: GEMMs + 4 n^2 d attention per block, no padding) over the bf16
  GEMM rate measured in this run (8192^3, cuda_bench.bench_gemm), the run's limit model's vision term.
`run_mix` multiplies by the document run's units per kind (--mix, default bench/doc_throughput's 192 units: 168
pages, 12 photos, 12 videos) to compare with its `time_split.vision_encode_s`. Attention alone is also timed per
variant at each kind's segment length (CUDA events, median of 10).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PAGE_PX = (1240, 1755)  # A4 at 150 dpi (width, height), as vision/pdf renders it
PHOTO_PX = (4032, 3024)
VIDEO_PX, VIDEO_FRAMES = (960, 540), 16  # 8 s at the pipeline's 2 fps


def kind_grids(photo_caps: list[int]) -> dict[str, tuple[int, int, int]]:
    """(t, h, w) patch grids the processor makes for each kind (image rule for pages / photos, video rule)."""
    from doc_models import QWEN_IMAGE_MAX_PIXELS, QWEN_IMAGE_MIN_PIXELS, QWEN_VIDEO_MAX_PIXELS, QWEN_VIDEO_MIN_PIXELS

    from gpu_engine.preprocessing import smart_resize_image, smart_resize_video

    patch, merge, temporal = 16, 2, 2
    factor = patch * merge

    def image(w: int, h: int) -> tuple[int, int, int]:
        hh, ww = smart_resize_image(h, w, factor=factor, min_pixels=QWEN_IMAGE_MIN_PIXELS,
                                    max_pixels=QWEN_IMAGE_MAX_PIXELS)
        return 1, hh // patch, ww // patch

    grids = {"page": image(*PAGE_PX), "photo": image(*PHOTO_PX)}
    for cap in photo_caps:
        w, h = capped(PHOTO_PX, cap)
        grids[f"photo_cap{cap}"] = image(w, h)
    vh, vw = smart_resize_video(VIDEO_FRAMES, VIDEO_PX[1], VIDEO_PX[0], temporal_factor=temporal, factor=factor,
                                min_pixels=QWEN_VIDEO_MIN_PIXELS, max_pixels=QWEN_VIDEO_MAX_PIXELS)
    grids["video"] = (VIDEO_FRAMES // temporal, vh // patch, vw // patch)
    return grids


def photo_caps(arg: str | None) -> list[int]:
    """--photo-caps as integers; None: the product default (vision.MediaLimits().max_photo_pixels)."""
    if arg is None:
        from vision.limits import MediaLimits

        return [MediaLimits().max_photo_pixels]
    return [int(c) for c in arg.split(",") if c]


def capped(size: tuple[int, int], max_pixels: int) -> tuple[int, int]:
    """The size vision/raster gives an image above max_pixels (aspect kept, floor), else the size."""
    w, h = size
    if w * h <= max_pixels:
        return size
    s = (max_pixels / (w * h)) ** 0.5
    return max(1, int(w * s)), max(1, int(h * s))


class OpTimer:
    """CUDA events around every launch the tower makes, summed by op label after a sync."""

    def __init__(self, ctx: Any) -> None:
        self.ctx = ctx
        self.marks: list[tuple[str, float, Any, Any]] = []

    def wrap(self, label: Callable[..., str], flops: Callable[..., float], fn: Callable[..., Any]) -> Callable:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start, stop = self.ctx.device.event(), self.ctx.device.event()
            self.ctx.device.stream.record(start)
            out = fn(*args, **kwargs)
            self.ctx.device.stream.record(stop)
            self.marks.append((label(*args, **kwargs), flops(*args, **kwargs), start, stop))
            return out
        return timed

    def table(self) -> dict[str, dict[str, float]]:
        self.ctx.device.sync()
        acc: dict[str, dict[str, float]] = defaultdict(lambda: {"ms": 0.0, "flops": 0.0, "launches": 0})
        for label, flops, start, stop in self.marks:
            acc[label]["ms"] += stop - start
            acc[label]["flops"] += flops
            acc[label]["launches"] += 1
        self.marks.clear()
        for row in acc.values():
            row["tflops"] = row["flops"] / row["ms"] / 1e9 if row["ms"] > 0 and row["flops"] else 0.0
        return dict(acc)


def instrument(ctx: Any, tower: Any, timer: OpTimer) -> Callable[[], None]:
    """Route the tower's launches through `timer`; returns the function that undoes it."""
    from gpu_engine.cuda import ops, vision_flash, vision_ops

    d = tower.dims
    names = {(3 * d.hidden_size, d.hidden_size): "gemm qkv", (d.hidden_size, d.hidden_size): "gemm proj",
             (d.intermediate_size, d.hidden_size): "gemm fc1", (d.hidden_size, d.intermediate_size): "gemm fc2",
             (d.hidden_size, d.patch_dim): "gemm patch"}
    saved: list[tuple[Any, str, Any]] = []

    def patch(owner: Any, attr: str, label: Callable[..., str], flops: Callable[..., float]) -> None:
        saved.append((owner, attr, getattr(owner, attr)))
        setattr(owner, attr, timer.wrap(label, flops, getattr(owner, attr)))

    patch(ctx.blas, "linear", lambda y, x, w, m, n, k, **kw: names.get((n, k), "gemm merger"),
          lambda y, x, w, m, n, k, **kw: 2.0 * m * n * k * kw.get("batch", 1))
    patch(vision_flash, "vision_flash_attention", lambda *a, **kw: "attention",
          lambda ctx_, out, qkv, heads, hd, seg, *a, **kw: 4.0 * qkv.shape[0] * seg * heads * hd)
    for name in ("layernorm", "bias_act", "bias_residual", "patch_pos", "cast_from_f32", "vision_attention",
                 "softmax_rows"):
        patch(vision_ops, name, lambda *a, _n=name, **kw: _n, lambda *a, **kw: 0.0)
    patch(ops, "rope", lambda *a, **kw: "rope", lambda *a, **kw: 0.0)

    def undo() -> None:
        for owner, attr, fn in reversed(saved):
            setattr(owner, attr, fn)
    return undo


def build_tower(ctx: Any, rng: np.random.Generator) -> Any:
    from qwen35_shapes import model_shape

    from gpu_engine.cuda.bf16 import f32_to_bf16_bits
    from gpu_engine.cuda.vision import GpuVisionTower
    from gpu_engine.reference.vision_tower import vision_weight_shapes

    _, vision_cfg, _ = model_shape("9b")
    cfg = SimpleNamespace(**vision_cfg)
    block = f32_to_bf16_bits(rng.standard_normal(1_000_003).astype(np.float32) * 0.02)
    return GpuVisionTower(ctx, cfg, {k: np.resize(block, s) for k, s in vision_weight_shapes(cfg).items()}, "bf16")


def profile_kind(ctx: Any, tower: Any, rng: np.random.Generator, grid: tuple[int, int, int], reps: int,
                 gemm_rate: float) -> dict[str, Any]:
    n = grid[0] * grid[1] * grid[2]
    pixels = rng.standard_normal((n, tower.dims.patch_dim)).astype(np.float32)
    mark = ctx.arena.mark()
    try:
        out = ctx.empty((tower.num_tokens(grid), tower.dims.out_hidden_size), "bf16", "profile.out")
        tower.encode(pixels, grid, out)  # warm-up: compiles, cuBLASLt plans
        times, enqueue = [], []
        for _ in range(reps):
            t0 = time.perf_counter()
            tower.encode(pixels, grid, out)  # returns once enqueued (staged uploads, no sync)
            enqueue.append(1e3 * (time.perf_counter() - t0))
            ctx.device.sync()
            times.append(1e3 * (time.perf_counter() - t0))
        timer = OpTimer(ctx)
        undo = instrument(ctx, tower, timer)
        try:
            tower.encode(pixels, grid, out)
        finally:
            undo()
        ops_ = timer.table()
    finally:
        ctx.arena.release(mark)
    encode_ms = float(np.median(times))
    flops = tower.flops(grid)
    device_ms = sum(r["ms"] for r in ops_.values())
    return {"grid": list(grid), "patches": n, "tokens": tower.num_tokens(grid), "encode_ms": encode_ms,
            "encode_ms_all": times, "enqueue_ms": float(np.median(enqueue)), "flops": flops,
            "tflops": flops / encode_ms / 1e9,
            "limit_ms": 1e3 * flops / gemm_rate, "fraction_of_limit": 1e3 * flops / gemm_rate / encode_ms,
            "device_ms": device_ms, "host_ms": encode_ms - device_ms, "ops": ops_}


def attention_rates(ctx: Any, rng: np.random.Generator, segs: dict[str, tuple[int, int]], variants: list[str]
                    ) -> list[dict[str, Any]]:
    from cuda_bench import time_ms

    from gpu_engine.cuda.vision_flash import vision_flash_attention

    heads, hd, rows = 16, 72, []
    for kind, (seg, count) in segs.items():
        n = seg * count
        mark = ctx.arena.mark()
        qkv = ctx.to_device(rng.standard_normal((n, 3 * heads * hd), dtype=np.float32), "bf16", "att.qkv")
        out = ctx.empty((n, heads * hd), "bf16", "att.out")
        for v in variants:
            def launch(v: str = v) -> None:
                vision_flash_attention(ctx, out, qkv, heads, hd, seg, hd ** -0.5, v)
            ms = time_ms(ctx, launch, reps=10)
            tf = 4.0 * n * seg * hd * heads / ms / 1e9
            rows.append({"kind": kind, "variant": v, "seg_len": seg, "segments": count, "ms": ms, "tflops": tf})
            print(f"attention {v:<8} {kind:<18} seg {seg:>6} x {count}: {ms:8.3f} ms {tf:6.1f} TFLOP/s", flush=True)
        ctx.arena.release(mark)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json")
    parser.add_argument("--variants", default="m2n32")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--mix", default="168,12,12", help="pages, photos, videos of the document run")
    parser.add_argument("--photo-caps", default=None,
                        help="comma-separated photo pixel caps to profile too (default: the product's, "
                             "vision.MediaLimits().max_photo_pixels)")
    parser.add_argument("--kinds", default="", help="only these kinds (default all)")
    parser.add_argument("--arena-gib", type=float, default=6.0,
                        help="device memory taken (a full-size photo's encode needs ~3 GiB with the weights)")
    args = parser.parse_args(argv)
    from cuda_bench import bench_gemm

    from gpu_engine.cuda import vision_flash
    from gpu_engine.cuda.context import GpuContext
    from gpu_engine.cuda.device import require_gpu

    require_gpu()
    caps = photo_caps(args.photo_caps)
    grids = kind_grids(caps)
    if args.kinds:
        grids = {k: g for k, g in grids.items() if k in args.kinds.split(",")}
    variants = args.variants.split(",")
    seed = int(np.random.SeedSequence().generate_state(1)[0])
    rng = np.random.default_rng(seed)
    ctx = GpuContext(int(args.arena_gib * (1 << 30)))
    result: dict[str, Any] = {"bench": "bench/vision_tower_profile.py", "seed": seed,
                              "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "grids": grids}
    try:
        result["device"] = ctx.device.info.name
        gemm = bench_gemm(ctx, rng, 8192, 8192, 8192)
        rate = gemm["TFLOPs"] * 1e12
        result["gemm_ceiling"] = gemm
        print(f"bf16 GEMM 8192^3: {gemm['TFLOPs']:.1f} TFLOP/s", flush=True)
        segs = {k: (g[1] * g[2], g[0]) for k, g in grids.items()}
        result["attention"] = attention_rates(ctx, rng, segs, variants)
        tower = build_tower(ctx, rng)
        rows = []
        default = vision_flash.DEFAULT_VARIANT
        try:
            for v in variants:
                vision_flash.DEFAULT_VARIANT = v  # the tower's attention reads the module default
                for kind, grid in grids.items():
                    row = {"variant": v, "kind": kind, **profile_kind(ctx, tower, rng, grid, args.reps, rate)}
                    rows.append(row)
                    att = row["ops"].get("attention", {"ms": 0.0, "tflops": 0.0})
                    gemm_ms = sum(r["ms"] for k, r in row["ops"].items() if k.startswith("gemm"))
                    print(f"tower {v:<8} {kind:<18} {tuple(grid)}: {row['encode_ms']:8.1f} ms (limit "
                          f"{row['limit_ms']:6.1f}, {row['fraction_of_limit']:.2f}) attention {att['ms']:7.1f} ms "
                          f"{att['tflops']:5.0f} TF/s, GEMMs {gemm_ms:6.1f} ms, other "
                          f"{row['device_ms'] - att['ms'] - gemm_ms:5.1f} ms, host {row['host_ms']:5.1f} ms",
                          flush=True)
        finally:
            vision_flash.DEFAULT_VARIANT = default
        result["tower"] = rows
        result["run_mix"] = run_mix(rows, [int(c) for c in args.mix.split(",")])
        for line in result["run_mix"]:
            print(f"mix {line['variant']:<8} photos as {line['photo_kind']:<18}: {line['vision_s']:6.2f} s "
                  f"(limit {line['limit_s']:5.2f} s) pages {line['by_kind_s']['page']:.2f} photos "
                  f"{line['by_kind_s']['photo']:.2f} videos {line['by_kind_s']['video']:.2f}", flush=True)
    finally:
        ctx.close()
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


def run_mix(rows: list[dict[str, Any]], mix: list[int]) -> list[dict[str, Any]]:
    """Seconds of vision encode for the document run's units per kind (pages, photos, videos), per variant and per
    photo size profiled."""
    out = []
    by = {(r["variant"], r["kind"]): r for r in rows}
    for v in sorted({r["variant"] for r in rows}):
        if (v, "page") not in by or (v, "video") not in by:
            continue
        for photo in [k for (vv, k) in by if vv == v and k.startswith("photo")]:
            kinds = {"page": by[v, "page"], "photo": by[v, photo], "video": by[v, "video"]}
            secs = {k: count * kinds[k]["encode_ms"] / 1e3 for k, count in zip(kinds, mix)}
            limit = sum(count * kinds[k]["limit_ms"] / 1e3 for k, count in zip(kinds, mix))
            out.append({"variant": v, "photo_kind": photo, "mix": mix, "vision_s": sum(secs.values()),
                        "limit_s": limit, "by_kind_s": secs})
    return out


if __name__ == "__main__":
    sys.exit(main())

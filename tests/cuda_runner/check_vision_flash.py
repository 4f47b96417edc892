"""GPU check of the vision tower's fused flash attention (kernels/vision_flash.cu) against float64 attention.

    python3 -m tests.cuda_runner.check_vision_flash [--json out.json] [--seed N]

Fresh random bf16 q | k | v rows every run (q, k with std 1.5 so the softmax is peaky enough that a wrong max, mask
or padding shows; v std 1), in the fused [n, 3 * heads * head_dim] layout, output poisoned (NaN) first. Cases:
head_dim 72 (padded to 80 inside) and 64, also 80 and 128; 16 and 4 heads; segments of 1, 17, 64, 100, 129, 257,
333, 1024, 4096 and 8580 rows, n = several segments. Each case runs every kernel this device has for its head dim:
the default variant and the wgmma ones (vision_flash.HOPPER_VARIANTS, Hopper only; elsewhere they resolve to m2n32).
Pass: rel-L2 <= 1e-2 against float64 segment attention on the same bf16 inputs, and no row left unwritten. Info (not
a pass criterion): device time of one 4096-row, 16-head, head_dim 72 launch (the 1024^2 image's per-layer attention)
and its TFLOP/s, per variant. The tower itself (auto -> flash in bf16) is covered by check_vision. Skips (exit 0)
without a GPU.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

import numpy as np

from tests.cuda_runner.harness import check_main, fresh_seed, rel_err
from tests.cuda_runner.vision_flash_emulation import segment_attention_f64

TOL = 1e-2
# (head_dim, heads, seg_len, segments)
CASES = [
    (72, 16, 1, 7), (72, 16, 17, 5), (72, 16, 64, 3), (72, 16, 100, 3), (72, 16, 1024, 2), (72, 16, 4096, 2),
    (72, 4, 1, 3), (72, 4, 17, 3), (72, 4, 64, 2), (72, 4, 100, 4), (72, 4, 1024, 3), (72, 4, 4096, 2),
    (64, 16, 1, 5), (64, 16, 17, 4), (64, 16, 64, 2), (64, 16, 100, 3), (64, 16, 1024, 2), (64, 16, 4096, 1),
    (64, 4, 1, 3), (64, 4, 17, 3), (64, 4, 64, 3), (64, 4, 100, 2), (64, 4, 1024, 2), (64, 4, 4096, 2),
    (80, 4, 100, 3), (80, 4, 1024, 1), (128, 4, 100, 3), (128, 4, 1024, 2),
    (72, 16, 129, 3), (72, 2, 8580, 1),  # one row past a 128-row tile; an A4 page's segment
    # more key tiles than wg64p's four stages, with odd tails (13 keys / rows; 1 key, 1 row) and several segments
    (72, 16, 333, 3), (72, 4, 257, 4),
]


@dataclass
class FlashResult:
    case: str
    rel_err: float
    ok: bool


def reference_f64(qkv: np.ndarray, heads: int, head_dim: int, seg_len: int, scale: float) -> np.ndarray:
    """Float64 attention one head at a time (a 4096^2 score block of all heads would take 2 GB)."""
    n, width = qkv.shape[0], heads * head_dim
    out = np.empty((n, width))
    for h in range(heads):
        cols = np.concatenate([np.arange(h * head_dim, (h + 1) * head_dim) + part * width for part in range(3)])
        out[:, h * head_dim : (h + 1) * head_dim] = segment_attention_f64(qkv[:, cols], 1, head_dim, seg_len, scale)
    return out


def checked_variants(head_dim: int, arch: str) -> list[str]:
    """The kernels this device runs for head_dim: the default variant's and every wgmma variant's (each once)."""
    from gpu_engine.cuda import vision_flash

    names = [vision_flash.resolve_variant(head_dim, v, arch) for v in (None, *vision_flash.HOPPER_VARIANTS)]
    return list(dict.fromkeys(names))


@dataclass
class Case:
    head_dim: int
    heads: int
    seg: int
    segments: int
    qkv: np.ndarray  # bf16 values as float32
    ref: np.ndarray  # float64 attention of qkv


def make_cases(rng: np.random.Generator) -> list[Case]:
    from gpu_engine.cuda.bf16 import round_to_bf16

    cases = []
    for hd, heads, seg, segments in CASES:
        n, width = seg * segments, heads * hd
        qkv = np.concatenate([1.5 * rng.standard_normal((n, 2 * width)), rng.standard_normal((n, width))], axis=1)
        qkv = round_to_bf16(qkv.astype(np.float32))
        cases.append(Case(hd, heads, seg, segments, qkv, reference_f64(qkv, heads, hd, seg, hd ** -0.5)))
    return cases


def check_cases(ctx, cases: list[Case], variant: str | None) -> list[FlashResult]:
    """Every case on the kernel `variant` resolves to for its head dim (None: the default variant); a wgmma variant
    only where it runs itself (the cases it would hand to m2n32 are the default's)."""
    from gpu_engine.cuda.vision_flash import resolve_variant, vision_flash_attention

    results = []
    arch = ctx.device.info.arch
    for c in cases:
        name = resolve_variant(c.head_dim, variant, arch)
        if variant is not None and name != variant:
            continue
        n, width = c.qkv.shape[0], c.heads * c.head_dim
        mark = ctx.arena.mark()
        d_qkv = ctx.to_device(c.qkv, "bf16", "check.qkv")
        out = ctx.empty((n, width), "bf16", "check.out")
        ctx.poison(out)
        vision_flash_attention(ctx, out, d_qkv, c.heads, c.head_dim, c.seg, c.head_dim ** -0.5, name)
        got = ctx.to_host(out)
        ctx.device.sync()
        ctx.arena.release(mark)
        err = rel_err(got, c.ref)
        label = f"{name} hd{c.head_dim} x{c.heads} heads, seg {c.seg} x {c.segments}"
        results.append(FlashResult(label, err, bool(err <= TOL)))
        print(f"{label:<40} rel. err {err:.2e}  {'PASS' if err <= TOL else 'FAIL'}", flush=True)
    return results


def time_layer(ctx, rng: np.random.Generator, variant: str | None = None) -> dict:
    """Median device ms of the 1024^2 image's attention (4096 rows, 16 heads, head_dim 72), by CUDA events."""
    from gpu_engine.cuda.vision_flash import vision_flash_attention

    n, heads, hd = 4096, 16, 72
    mark = ctx.arena.mark()
    qkv = ctx.to_device(rng.standard_normal((n, 3 * heads * hd), dtype=np.float32), "bf16", "time.qkv")
    out = ctx.empty((n, heads * hd), "bf16", "time.out")
    launch = lambda: vision_flash_attention(ctx, out, qkv, heads, hd, n, hd ** -0.5, variant)
    for _ in range(3):
        launch()
    ctx.device.sync()
    samples = []
    for _ in range(20):
        start, stop = ctx.device.event(), ctx.device.event()
        ctx.device.stream.record(start)
        launch()
        ctx.device.stream.record(stop)
        stop.sync()
        samples.append(stop - start)
    ctx.arena.release(mark)
    ms = float(np.median(samples))
    flops = 4.0 * n * n * hd * heads
    return {"layer_attention_ms": ms, "layer_attention_tflops": flops / ms / 1e9}


def run_all(seed: int | None = None) -> tuple[list[FlashResult], dict]:
    """The default variant's cases and timing first, then each wgmma variant's: a new kernel that faults (a sticky
    CUDA error) cannot take the default's results with it."""
    import traceback

    from gpu_engine.cuda import vision_flash
    from gpu_engine.cuda.context import GpuContext
    from gpu_engine.cuda.device import require_gpu

    require_gpu()
    seed = fresh_seed(seed)
    rng = np.random.default_rng(seed)
    info: dict = {"seed": seed}
    ctx = GpuContext(1 << 30)
    results: list[FlashResult] = []
    try:
        cases = make_cases(rng)
        for variant in (None, *vision_flash.HOPPER_VARIANTS):
            name = variant or "default"
            try:
                got = check_cases(ctx, cases, variant)
            except Exception:  # noqa: BLE001 - a compile or launch failure is a failed result with its traceback
                traceback.print_exc()
                got = [FlashResult(f"{name} check_cases raised", float("nan"), False)]
            results += got
            if got and all(r.ok for r in got):
                info[name] = time_layer(ctx, rng, variant)
    finally:
        ctx.close()
    return results, info


def format_table(results: list[FlashResult]) -> str:
    lines = [f"{'case':<40} {'rel.err':>9}  ok", "-" * 56]
    lines += [f"{r.case:<40} {r.rel_err:>9.2e}  {'PASS' if r.ok else 'FAIL'}" for r in results]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return check_main(__doc__.splitlines()[0], run_all, format_table, argv)


if __name__ == "__main__":
    sys.exit(main())

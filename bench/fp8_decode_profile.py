"""Where one FP8 decode step's device time goes: bench/cuda_decode_profile.py's per-op event timing on the model of
bench/fp8_model_bench.py (random e4m3 Linears, 128x128 block scales), the FP8 ops traced too.

    python3 bench/fp8_decode_profile.py [--shape 27b] [--batches 1,8] [--context 1024] [--steps 5]
        [--gemv-variants stream,splitk] [--json out.json]

Traced besides cuda_decode_profile's ops (norms, attention, DeltaNet, BF16 GEMMs by shape: lm_head and DeltaNet's
in_proj b|a are BF16): each FP8 GEMM (`fp8_gemm NxK`, the streaming kernel or cuBLASLt, by shape), the quantisation
launches of their own (`fp8_quant`: o_proj / out_proj inputs; `fp8_swiglu_quant`: the MLP's down input) and the
norms that write the next linear's quantised input (`fp8_norm_quant`). One pass per entry of --gemv-variants
(fp8_ops.GEMV_VARIANTS; the first pass is fp8_ops.GEMV_VARIANT, named "current"), the same runner and cache for all.
Each op's bytes and rate are cuda_decode_profile's where it knows them; the FP8 GEMMs' are weight + scales
(activations and output are < 0.1 %). `step_ms` is the span of the traced ops (eager, queued ahead: device time);
a graph replay of the same step is fp8_model_bench's decode_graph_replay_ms.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import cuda_decode_profile as profile_mod  # noqa: E402
from cuda_bench import SHAPES, bench_copy  # noqa: E402
from fp8_model_bench import gemv_variants_arg, random_fp8_weights  # noqa: E402

from gpu_engine.cuda import fp8_ops, linear  # noqa: E402
from gpu_engine.cuda.context import GpuContext  # noqa: E402
from gpu_engine.cuda.errors import CudaUnavailable  # noqa: E402

PASS_PREFIX = "fp8:"  # a pass named fp8:<variant> runs the streaming GEMMs with that variant


def install_fp8_tracing(passes: dict[str, str]) -> None:
    """Wrap cuda_decode_profile.install so that, with its timer, the FP8 entry points are traced too, and each
    FP8 GEMM runs with the GEMV variant of the pass being timed (passes: pass name -> variant)."""
    plain = profile_mod.install

    def install(timer, variant: dict[str, str]) -> None:  # type: ignore[no-untyped-def]  # timer: OpTimer
        plain(timer, variant)
        matmul = timer.wrap(lambda ctx, y, xa, w, *a, **k: f"fp8_gemm {w.shape[0]}x{w.shape[1]}", linear.fp8_matmul)

        def fp8_matmul(*args, **kwargs):  # type: ignore[no-untyped-def]  # fp8_ops.fp8_matmul's signature
            fp8_ops.GEMV_VARIANT = passes[variant["name"]]
            return matmul(*args, **kwargs)

        linear.fp8_matmul = fp8_matmul
        linear.quantize_activations = timer.wrap(
            lambda *a, swiglu=False, **k: "fp8_swiglu_quant" if swiglu else "fp8_quant", linear.quantize_activations)
        fp8_ops.norm_quant = timer.wrap(lambda *a, **k: "fp8_norm_quant", fp8_ops.norm_quant)

    profile_mod.install = install


def fp8_rates(result: dict, copy_gbps: float) -> None:
    """Bytes and GB/s of the fp8_gemm rows (weight + scales), and the share of each op in the step."""
    for entry in result["per_batch"].values():
        for name, row in entry["ops"].items():
            if name.startswith("fp8_gemm "):
                n, k = (int(v) for v in name.removeprefix("fp8_gemm ").split("x"))
                nbytes = n * k + -(-n // 128) * -(-k // 512) * 16  # e4m3 bytes + the f32 scale grid (4-padded)
                row["bytes"] = nbytes * row["calls"]
                row["GBps"] = row["bytes"] / row["ms"] / 1e6
                row["fraction_of_copy_rate"] = row["GBps"] / copy_gbps
            row["share_of_step"] = row["ms"] / entry["step_ms"]
        gemm = [r for n, r in entry["ops"].items() if n.startswith("fp8_gemm ")]
        entry["fp8_gemm_ms"] = sum(r["ms"] for r in gemm)
        entry["fp8_gemm_roofline_ms"] = sum(r["bytes"] for r in gemm) / copy_gbps / 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="27b", choices=sorted(SHAPES))
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--gemv-variants", default="", help="comma list of fp8_ops.GEMV_VARIANTS, after 'current'")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    extra = gemv_variants_arg(parser, args.gemv_variants)
    try:
        ctx = GpuContext(budget_bytes=4 << 30)
    except CudaUnavailable as exc:
        print(f"SKIP: {exc}")
        return 0
    rng = np.random.default_rng(0)
    copy = bench_copy(ctx, rng, 1 << 30)
    ctx.close()
    copy_gbps = max(copy["copy_kernel_GBps"], copy["memcpy_GBps"])
    passes = {"current": fp8_ops.GEMV_VARIANT} | {PASS_PREFIX + v: v for v in extra}
    for name in passes:
        profile_mod.VARIANTS.setdefault(name, {})  # no kernel-choice overrides of cuda_decode_profile's own
    install_fp8_tracing(passes)
    profile_mod.random_bf16_weights = random_fp8_weights  # profile() builds its weights through this name
    batches = [int(b) for b in args.batches.split(",")]
    out = profile_mod.profile(args.shape, batches, [args.context], args.steps, copy_gbps, rng, list(passes),
                              fill="random")
    fp8_rates(out, copy_gbps)
    out.update({"command": " ".join(["python3", "bench/fp8_decode_profile.py", *(argv or sys.argv[1:])]),
                "date_utc": dt.datetime.now(dt.timezone.utc).isoformat(), "copy": copy, "copy_GBps": copy_gbps,
                "passes": passes})
    for key, entry in out["per_batch"].items():
        print(f"== {key}: step {entry['step_ms']:.2f} ms, FP8 GEMMs {entry['fp8_gemm_ms']:.2f} ms "
              f"(at the copy rate {entry['fp8_gemm_roofline_ms']:.2f})")
        for name, row in entry["ops"].items():
            rate = f"{row['GBps']:7.0f} GB/s" if row.get("GBps") else " " * 12
            print(f"  {name:<28} {row['ms']:7.3f} ms {row['calls']:4d} calls {rate} {row['share_of_step']:6.1%}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

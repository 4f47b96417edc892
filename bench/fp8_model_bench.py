"""The whole decoder with block-FP8 weights on the CUDA runner: bench/cuda_bench.py's model benchmark (prefill 1024
and 8192 tokens, batch-1 decode eager / graphs / replay, batched decode 8 and 32) with random FP8 Linears.

    python3 bench/fp8_model_bench.py [--shape 27b] [--json out.json] [--with-bf16] [--gemv-variants a,b]

The weights are cuda_bench's random bf16 tensors, except that every Linear quantize="fp8" would convert
(fp8_checkpoint.QUANTIZE_SKIP honoured: lm_head, embeddings, conv1d, in_proj_a / in_proj_b stay bf16) is random
e4m3 bytes (no NaN patterns) with random 128x128 block scales. decode_bytes / roofline_ms count the FP8 bytes.
--with-bf16 runs cuda_bench's BF16 model of the same shape first, in the same process (the peer measured in the
same run), and reports the FP8/BF16 ratios and the fraction of each roofline. --gemv-variants (names of
fp8_ops.GEMV_VARIANTS) runs the FP8 model again per variant with that streaming kernel for the decode batches
(prefill 1024 only, batches 1 and 8), after the main run with fp8_ops.GEMV_VARIANT: `by_variant` in the JSON.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import cuda_bench  # noqa: E402

from gpu_engine.cuda import fp8_ops  # noqa: E402
from gpu_engine.cuda.context import GpuContext  # noqa: E402
from gpu_engine.cuda.errors import CudaUnavailable  # noqa: E402
from gpu_engine.fp8_checkpoint import QUANTIZE_SKIP, is_linear_weight, module_name, skipped  # noqa: E402
from gpu_engine.tensors import Fp8Tensor  # noqa: E402


@dataclass(frozen=True)
class SizedFp8(Fp8Tensor):
    """An Fp8Tensor that answers cuda_bench's size questions (nbytes, size, ndim) like the array it replaces."""

    @property
    def nbytes(self) -> int:
        return int(self.bits.nbytes + self.scale_inv.nbytes)

    @property
    def size(self) -> int:
        return int(self.bits.size)

    @property
    def ndim(self) -> int:
        return 2


def random_fp8_weights(config, rng: np.random.Generator):
    from gpu_engine.cuda.bf16 import f32_to_bf16_bits
    from gpu_engine.loader import ModelWeights, expected_shapes

    block = f32_to_bf16_bits(rng.standard_normal(1_000_003).astype(np.float32) * 0.02)
    byte_block = rng.integers(0, 256, 1_000_003, dtype=np.uint8)
    byte_block[(byte_block & 0x7F) == 0x7F] ^= 1  # no e4m3 NaN
    shapes = {k.split("/", 1)[1]: v for k, v in expected_shapes(config).items() if k.startswith(("text/", "lm_head/"))}

    def make(item: tuple[str, tuple[int, ...]]):
        name, shape = item
        if name.endswith("A_log"):
            return np.log(np.random.default_rng().uniform(1.0, 16.0, shape)).astype(np.float32)
        if name.endswith("dt_bias"):
            return np.ones(shape, np.float32)
        if name != "weight" and is_linear_weight(name, shape) and not skipped(module_name(name), QUANTIZE_SKIP):
            grid = np.random.default_rng().uniform(0.5, 1.5, (-(-shape[0] // 128), -(-shape[1] // 128)))
            return SizedFp8(np.resize(byte_block, shape), (grid * 1e-4).astype(np.float32), (128, 128), "F32")
        return np.resize(block, shape)

    with ThreadPoolExecutor(max_workers=os.cpu_count()) as pool:
        made = dict(zip(shapes, pool.map(make, shapes.items())))
    lm_head = made.pop("weight", None)
    return ModelWeights(text=made, vision={}, lm_head=made["embed_tokens.weight"] if lm_head is None else lm_head)


def ratios(fp8: dict, bf16: dict) -> dict:
    """FP8 over BF16 tokens/s per workload, and each run's decode time over its own roofline."""
    out = {}
    for key in ("prefill_1024_tok_s", "prefill_8192_tok_s", "decode_b1_tok_s", "decode_b8_tok_s", "decode_b32_tok_s"):
        if key in fp8 and key in bf16:
            out[key.removesuffix("_tok_s") + "_speedup"] = fp8[key] / bf16[key]
    for name, run in (("fp8", fp8), ("bf16", bf16)):
        if "roofline_ms" in run:
            out[f"{name}_b1_replay_fraction_of_roofline"] = run["roofline_ms"] / run["decode_graph_replay_ms"]
            out[f"{name}_b1_forward_fraction_of_roofline"] = run["roofline_ms"] / run["decode_b1_forward_ms"]
    return out


def decode_by_variant(shape: str, variants: list[str], copy_gbps: float) -> dict:
    """The FP8 model's decode rows with each streaming variant as fp8_ops.GEMV_VARIANT (restored after)."""
    keep = ("decode_graph_replay_ms", "decode_graph_replay_pdl_ms", "decode_b1_forward_ms", "decode_b1_tok_s",
            "decode_b8_forward_ms", "decode_b8_tok_s", "roofline_ms")
    default, out = fp8_ops.GEMV_VARIANT, {}
    try:
        for variant in variants:
            fp8_ops.GEMV_VARIANT = variant
            run = cuda_bench.bench_model(shape, np.random.default_rng(0), (1024,), 20, copy_gbps, (1, 8))
            out[variant] = {k: run[k] for k in keep if k in run}
            out[variant]["b1_replay_fraction_of_roofline"] = run["roofline_ms"] / run["decode_graph_replay_ms"]
            print(variant, json.dumps(out[variant]), flush=True)
    finally:
        fp8_ops.GEMV_VARIANT = default
    return out


def gemv_variants_arg(parser: argparse.ArgumentParser, text: str) -> list[str]:
    """--gemv-variants' comma list, each a name of fp8_ops.GEMV_VARIANTS (else the parser's usage error)."""
    variants = [v for v in text.split(",") if v]
    if set(variants) - set(fp8_ops.GEMV_VARIANTS):
        parser.error(f"--gemv-variants takes {', '.join(fp8_ops.GEMV_VARIANTS)}")
    return variants


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="27b")
    parser.add_argument("--json")
    parser.add_argument("--with-bf16", action="store_true", help="the BF16 model first, same process")
    parser.add_argument("--gemv-variants", default="", help="comma list of fp8_ops.GEMV_VARIANTS to run again")
    args = parser.parse_args(argv)
    variants = gemv_variants_arg(parser, args.gemv_variants)
    try:
        ctx = GpuContext(budget_bytes=4 << 30)
    except CudaUnavailable as exc:
        print(f"SKIP: {exc}")
        return 0
    copy = cuda_bench.bench_copy(ctx, np.random.default_rng(0), 1 << 30)
    version, device = ctx.blas.version, ctx.device.info.name
    ctx.close()
    def run() -> dict:
        return cuda_bench.bench_model(args.shape, np.random.default_rng(0), (1024, 8192), 20, copy["memcpy_GBps"],
                                      (1, 8, 32))

    bf16 = run() if args.with_bf16 else None
    cuda_bench.random_bf16_weights = random_fp8_weights  # bench_model builds its weights through this name
    out = run()
    out.update({"weights": "fp8 (random e4m3, 128x128 block scales)", "copy": copy, "cublaslt_version": version,
                "device": device, "date_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                "gemv_variant": fp8_ops.GEMV_VARIANT})
    if variants:
        out["by_variant"] = decode_by_variant(args.shape, variants, copy["memcpy_GBps"])
    if bf16 is not None:
        out["bf16"] = bf16
        out["vs_bf16"] = ratios(out, bf16)
        print(json.dumps(out["vs_bf16"], indent=1))
    print(json.dumps(out, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

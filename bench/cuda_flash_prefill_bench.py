"""Prefill attention at the model shapes: flash_prefill's "fa2" kernel (flash_prefill.cu) against "ws" (the
warp-specialised wgmma kernel, flash_prefill_ws.cu, sm_90 only), bf16 paged KV cache, head_dim 256.

    python3 bench/cuda_flash_prefill_bench.py [--json out.json] [--reps 10] [--ws-variants ws,ws2]

Shapes: 9B (16 q / 4 kv heads) and 27B (24 / 4). Workloads: one fresh 8192-token chunk, and the document step's
attention (4 chunks of 2048 tokens, each continuing from 2048 cached ones). Block size 16 (the engine's), each
sequence's blocks a random permutation; random bf16 inputs. Timing: CUDA events around one launch, median of
`reps` after 3 warm-ups; each variant gets its own tiles (flash_plan.FLASH_TILE_ROWS). TFLOP/s counts the causal FLOPs,
4 * head_dim * q_heads * (keys each row sees). "agree": ||ws - fa2|| / ||fa2|| over the whole output (both bf16,
both round P to bf16: ~1e-3 is expected, > 1e-2 means one of them is wrong; check_flash judges each against
float64). Prints a table; writes JSON with device, date, commit and every number. Skips (exit 0) without a GPU.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_commit import git_commit  # noqa: E402  # after the path insert

from gpu_engine.cuda import flash_plan  # noqa: E402

SHAPES = {"9b": (16, 4), "27b": (24, 4)}  # q heads, kv heads
HEAD_DIM, BLOCK_SIZE = 256, 16
WORKLOADS = {"fresh 8192": [(0, 8192)], "doc 4 x (2048+2048)": [(2048, 2048)] * 4}  # (cached, new) per sequence


def causal_flops(seqs: list[tuple[int, int]], heads: int) -> float:
    keys = sum(sum(range(s + 1, s + n + 1)) for s, n in seqs)  # row at position p sees p + 1 keys
    return 4.0 * HEAD_DIM * heads * keys


def bench_case(ctx, rng: np.random.Generator, shape: str, workload: str, variants: list[str], reps: int) -> list[dict]:
    from cuda_bench import time_ms  # (CUDA events, warm-up, median)

    from gpu_engine.cuda import ops

    heads, kvh = SHAPES[shape]
    seqs = WORKLOADS[workload]
    hd, bs = HEAD_DIM, BLOCK_SIZE
    n = sum(m for _, m in seqs)
    need = [-(-(s + m) // bs) for s, m in seqs]
    perm = rng.permutation(sum(need)).astype(np.int32)
    tables = np.zeros((len(seqs), max(need)), np.int32)
    for i, nb in enumerate(need):
        tables[i, :nb] = perm[sum(need[:i]) : sum(need[:i]) + nb]
    token_seq = np.concatenate([np.full(m, i, np.int32) for i, (_, m) in enumerate(seqs)])
    token_pos = np.concatenate([np.arange(s, s + m, dtype=np.int32) for s, m in seqs])

    mark = ctx.arena.mark()
    try:
        def rand(dims: tuple[int, ...], what: str):
            return ctx.to_device(rng.standard_normal(dims, dtype=np.float32), "bf16", what)

        kc, vc = rand((sum(need), bs, kvh, hd), "k"), rand((sum(need), bs, kvh, hd), "v")
        q, gate = rand((n, heads * hd), "q"), rand((n, heads * hd), "gate")
        dev_tables = ctx.to_device(tables, "i32", "tables")
        dev_seq, dev_pos = ctx.to_device(token_seq, "i32", "seq"), ctx.to_device(token_pos, "i32", "pos")
        flops = causal_flops(seqs, heads)
        rows, outs = [], {}
        for v in variants:
            tile_rows = flash_plan.FLASH_TILE_ROWS[v]
            tiles = ctx.to_device(flash_plan.flash_tiles([m for _, m in seqs], tile_rows), "i32", f"tiles-{v}")
            out = ctx.empty((n, heads * hd), "bf16", f"out-{v}")
            ctx.poison(out)

            def launch(out=out, tiles=tiles, v=v) -> None:
                ops.flash_prefill(ctx, out, q, heads * hd, gate, heads * hd, hd, kc, vc, dev_tables, dev_seq,
                                  dev_pos, tiles, heads, kvh, hd, bs, hd ** -0.5, variant=v)

            ms = time_ms(ctx, launch, warmup=3, reps=reps)
            outs[v] = ctx.to_host(out).astype(np.float64)
            rows.append({"shape": shape, "workload": workload, "variant": v, "tokens": n, "ms": ms,
                         "tflops": flops / ms / 1e9, "finite": bool(np.all(np.isfinite(outs[v])))})
        if len(outs) > 1:
            ref = outs["fa2"]
            for r in rows:
                r["speedup_vs_fa2"] = rows[0]["ms"] / r["ms"]
                if r["variant"] != "fa2":
                    r["agree_vs_fa2"] = float(np.linalg.norm(outs[r["variant"]] - ref) / np.linalg.norm(ref))
        return rows
    finally:
        ctx.arena.release(mark)


def row_line(r: dict) -> str:
    agree = f"{r['agree_vs_fa2']:.2e}" if "agree_vs_fa2" in r else ""
    return (f"{r['shape']:<5} {r['workload']:<20} {r['variant']:<7} {r['ms']:>8.3f} {r['tflops']:>8.1f} "
            f"{r.get('speedup_vs_fa2', 1.0):>6.2f} {agree:>9}" + ("" if r["finite"] else "  NON-FINITE"))


def table(rows: list[dict]) -> str:
    head = f"{'shape':<5} {'workload':<20} {'variant':<7} {'ms':>8} {'TFLOP/s':>8} {'x fa2':>6} {'agree':>9}"
    return "\n".join([head, "-" * len(head), *map(row_line, rows)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--ws-variants", default="ws", help="ws kernels timed beside fa2 on sm_90, e.g. ws,ws2")
    args = parser.parse_args(argv)
    from gpu_engine.cuda.errors import CudaUnavailable

    try:
        from gpu_engine.cuda.context import GpuContext
        from gpu_engine.cuda.device import require_gpu

        require_gpu()
    except CudaUnavailable as exc:
        print(f"SKIP: {exc}")
        return 0
    seed = int(np.random.SeedSequence().entropy % 2**32)
    rng = np.random.default_rng(seed)
    ctx = GpuContext(8 << 30)
    arch = ctx.device.info.arch
    variants = ["fa2"] + [v for v in args.ws_variants.split(",")
                          if flash_plan.flash_variant(v, HEAD_DIM, False, arch) == v]
    result: dict = {"device": ctx.device.info.name, "arch": arch, "commit": git_commit(), "seed": seed,
                    "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "block_size": BLOCK_SIZE,
                    "variants": variants, "rows": []}
    try:
        for shape in SHAPES:
            for workload in WORKLOADS:
                for row in bench_case(ctx, rng, shape, workload, variants, args.reps):
                    result["rows"].append(row)
                    print(row_line(row), flush=True)
    finally:
        ctx.close()
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}))
    print(table(result["rows"]))
    bad = [r for r in result["rows"] if not r["finite"] or r.get("agree_vs_fa2", 0.0) > 1e-2]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

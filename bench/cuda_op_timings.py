"""Each op of a 2B-class decode token and prefill chunk timed alone (bench/cuda_bench.py runs these into its table):
decode ops inside a CUDA graph of repeated copies, prefill ops with CUDA events. Microseconds / milliseconds."""
from __future__ import annotations

from typing import Callable

import numpy as np
from cuda_bench import TEXT_2B, random_bf16, time_ms

from gpu_engine.cuda import flash_plan, ops
from gpu_engine.cuda.context import GpuContext


def graph_time_us(ctx: GpuContext, fn: Callable[[], None], copies: int = 20) -> float:
    """Device time of one fn() inside a CUDA graph of `copies` back-to-back launches (no host launch cost,
    as in the runner's decode graph)."""
    fn()  # warm: module load, GEMM plan
    ctx.device.sync()
    graph = ctx.device.capture(lambda: [fn() for _ in range(copies)])
    return 1e3 * time_ms(ctx, lambda: ctx.device.launch_graph(graph), warmup=2, reps=10) / copies


def bench_decode_ops(ctx: GpuContext, rng: np.random.Generator, context: int) -> dict:
    """Each op of one 2B-class decode token, timed inside a CUDA graph (see graph_time_us); microseconds.
    The sum over one token's ops is the prediction for the decode graph replay."""
    cfg = TEXT_2B
    H, FF, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    nh, kvh, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    kh, vh, dk, dv = (cfg["linear_num_key_heads"], cfg["linear_num_value_heads"], cfg["linear_key_head_dim"],
                      cfg["linear_value_head_dim"])
    conv_dim, vdim = 2 * kh * dk + vh * dv, vh * dv
    out: dict[str, float] = {}
    mark = ctx.arena.mark()
    x = random_bf16(ctx, (1, max(FF, 2 * H)), "x", rng)
    gemms = {"in_proj": conv_dim + vdim + 2 * vh, "qkv": (2 * nh + 2 * kvh) * hd, "gate_up": 2 * FF}
    for name, n in gemms.items():
        w = random_bf16(ctx, (n, H), name, rng, 0.02)
        y = ctx.empty((1, n), "bf16", "y")
        out[f"gemm {name} {n}x{H}"] = graph_time_us(ctx, lambda: ctx.blas.linear(y.ptr, x.ptr, w.ptr, 1, n, H))
    for name, k in (("out_proj", vdim), ("o_proj", nh * hd), ("down", FF)):
        w = random_bf16(ctx, (H, k), name, rng, 0.02)
        y = ctx.empty((1, H), "bf16", "y")
        out[f"gemm {name} {H}x{k}"] = graph_time_us(ctx, lambda: ctx.blas.linear(y.ptr, x.ptr, w.ptr, 1, H, k))
    w = random_bf16(ctx, (V, H), "lm_head", rng, 0.02)
    y = ctx.empty((1, V), "f32", "logits")
    out[f"gemm lm_head {V}x{H}"] = graph_time_us(
        ctx, lambda: ctx.blas.linear(y.ptr, x.ptr, w.ptr, 1, V, H, y_dtype="f32"))
    i32 = lambda a: ctx.to_device(np.asarray(a, np.int32), "i32", "meta")  # noqa: E731 - one-line local helper
    h, r, nw = random_bf16(ctx, (1, H), "h", rng), random_bf16(ctx, (1, H), "r", rng), random_bf16(ctx, (H,), "w", rng)
    out["add_rmsnorm"] = graph_time_us(ctx, lambda: ops.add_rmsnorm(ctx, h, r, h, nw, 1e-6, True))
    gu, act = random_bf16(ctx, (1, 2 * FF), "gu", rng), ctx.empty((1, FF), "bf16", "act")
    out["silu_mul"] = graph_time_us(ctx, lambda: ops.silu_mul(ctx, act, gu))
    bs = 16
    blocks = context // bs + 1
    kc, vc = random_bf16(ctx, (blocks, bs, kvh, hd), "k", rng), random_bf16(ctx, (blocks, bs, kvh, hd), "v", rng)
    q, att = random_bf16(ctx, (1, 2 * nh * hd), "q", rng), ctx.empty((1, nh * hd), "bf16", "att")
    table, seq, pos = i32([np.arange(blocks)]), i32([0]), i32([context - 1])
    for splits in (1, None):
        out[f"paged_attention ctx={context} splits={splits or 'auto'}"] = graph_time_us(
            ctx, lambda: ops.paged_attention(
            ctx, att, q, 2 * nh * hd, q.at(hd), 2 * nh * hd, 2 * hd, kc, vc, table, seq, pos, nh, kvh, hd, bs,
            hd ** -0.5, splits=splits))
    proj = random_bf16(ctx, (1, conv_dim + vdim + 2 * vh), "proj", rng)
    conv_w, conv_state = random_bf16(ctx, (conv_dim, 4), "cw", rng), random_bf16(ctx, (2, 3, conv_dim), "cs", rng)
    conv_out, core = random_bf16(ctx, (1, conv_dim), "co", rng), ctx.empty((1, vdim), "bf16", "core")
    cu, slots, fresh = i32([0, 1]), i32([0]), i32([0])
    out["conv1d_silu"] = graph_time_us(ctx, lambda: ops.conv1d_silu(ctx, conv_out, conv_dim, proj, proj.size, conv_w,
                                                              conv_state, cu, slots, fresh))
    a_log = ctx.to_device(np.zeros(vh, np.float32), "f32", "alog")
    state = ctx.to_device((rng.standard_normal((2, vh, dv, dk)) * 0.1).astype(np.float32), "f32", "state")
    out["gated_delta_rule"] = graph_time_us(ctx, lambda: ops.gated_delta_rule(
        ctx, core, conv_out, conv_out.at(kh * dk), conv_out.at(2 * kh * dk), conv_dim, proj.at(conv_dim + vdim),
        proj.at(conv_dim + vdim + vh), proj.size, a_log, a_log, state, cu, slots, fresh, kh, vh, dk, dv))
    normed, gnw = ctx.empty((vh, dv), "bf16", "gn"), random_bf16(ctx, (dv,), "gnw", rng)
    out["rmsnorm_gated"] = graph_time_us(ctx, lambda: ops.rmsnorm_gated(ctx, normed, core.view((vh, dv)),
                                                                  proj.at(conv_dim), gnw, 1e-6, vh, proj.size))
    ctx.arena.release(mark)
    return out


def bench_prefill_ops(ctx: GpuContext, rng: np.random.Generator, n: int) -> dict:
    """The sequence-mixing ops of one 2B-class layer over an n-token prefill chunk (ms, events, median)."""
    cfg = TEXT_2B
    nh, kvh, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    kh, vh, dk, dv = (cfg["linear_num_key_heads"], cfg["linear_num_value_heads"], cfg["linear_key_head_dim"],
                      cfg["linear_value_head_dim"])
    conv_dim, vdim = 2 * kh * dk + vh * dv, vh * dv
    i32 = lambda a: ctx.to_device(np.asarray(a, np.int32), "i32", "meta")  # noqa: E731 - one-line local helper
    out: dict[str, float] = {}
    mark = ctx.arena.mark()
    bs = 16
    blocks = n // bs + 1
    kc, vc = random_bf16(ctx, (blocks, bs, kvh, hd), "k", rng), random_bf16(ctx, (blocks, bs, kvh, hd), "v", rng)
    q, att = random_bf16(ctx, (n, 2 * nh * hd), "q", rng), ctx.empty((n, nh * hd), "bf16", "att")
    table, seq, pos = i32([np.arange(blocks)]), i32(np.zeros(n)), i32(np.arange(n))
    out[f"paged_attention n={n}"] = time_ms(ctx, lambda: ops.paged_attention(
        ctx, att, q, 2 * nh * hd, q.at(hd), 2 * nh * hd, 2 * hd, kc, vc, table, seq, pos, nh, kvh, hd, bs,
        hd ** -0.5), warmup=1, reps=3)
    tiles = ctx.to_device(flash_plan.flash_tiles([n]), "i32", "tiles")
    out[f"flash_prefill n={n}"] = time_ms(ctx, lambda: ops.flash_prefill(
        ctx, att, q, 2 * nh * hd, q.at(hd), 2 * nh * hd, 2 * hd, kc, vc, table, seq, pos, tiles, nh, kvh, hd, bs,
        hd ** -0.5), warmup=1, reps=3)
    proj = random_bf16(ctx, (n, conv_dim + vdim + 2 * vh), "proj", rng)
    conv_w, conv_state = random_bf16(ctx, (conv_dim, 4), "cw", rng), random_bf16(ctx, (2, 3, conv_dim), "cs", rng)
    conv_out, core = random_bf16(ctx, (n, conv_dim), "co", rng), ctx.empty((n, vdim), "bf16", "core")
    cu, slots, fresh = i32([0, n]), i32([0]), i32([1])
    for method in ("sequential", "tokens"):
        out[f"conv1d_silu {method} n={n}"] = time_ms(ctx, lambda: ops.conv1d_silu(
            ctx, conv_out, conv_dim, proj, proj.shape[1], conv_w, conv_state, cu, slots, fresh, token_seq=seq,
            method=method), warmup=1, reps=3)
    a_log = ctx.to_device(np.zeros(vh, np.float32), "f32", "alog")
    state = ctx.to_device(np.zeros((2, vh, dv, dk), np.float32), "f32", "state")
    for method in ("one_pass", "two_pass"):
        out[f"gated_delta_rule {method} n={n}"] = time_ms(ctx, lambda: ops.gated_delta_rule(
            ctx, core, conv_out, conv_out.at(kh * dk), conv_out.at(2 * kh * dk), conv_dim, proj.at(conv_dim + vdim),
            proj.at(conv_dim + vdim + vh), proj.shape[1], a_log, a_log, state, cu, slots, fresh, kh, vh, dk, dv,
            method=method), warmup=1, reps=3)
    ctx.arena.release(mark)
    return out

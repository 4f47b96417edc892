"""One Qwen3.5-35B-A3B MoE layer on the GPU (cuda/moe.py MoeLayer, random bf16 weights at moe_model_shape("35b-a3b")),
timed as issue 17 sets its targets:
- prefill 8192 tokens: the layer's time against the dense bf16 GEMM rate measured here (cuBLASLt, a 65536 x 1024 x
  2048 product: the gate|up work of 8192 tokens x 8 experts as one GEMM), by the layer's active FLOPs (router +
  8 routed experts + shared expert);
- decode batch 1 and 32: CUDA-graph replays of the layer, 8 calls a graph on 8 different inputs (so each call routes
  to other experts and L2 holds little of them), against the roofline of the bytes a call must read (the distinct
  chosen experts' weights + router + shared expert + activations) at the device-to-device copy bandwidth measured
  here; also whether every chosen expert sits in one tile (its weights streamed once a step), and each step of the
  layer (router GEMM, route, plan, the two grouped GEMMs, combine) timed alone in a graph of its own;
- both plan kernels (moe_plan, moe_plan_v2) at every size, and the kernels on trial (moe_route_v2, moe_combine_v2,
  the tile shapes of moe_plan.TRIAL_TILES) beside the chosen ones on the same tables;
- the fused decode path (moe_decode.py, CudaOptions.moe_decode="fused") against the grouped one at batch 1, 2, 4 and
  8, each with and without PDL, graphs as above, against the same bytes roofline; its three launches each alone in
  a graph, and its output's distance to the grouped path's.
    python3 bench/moe_layer_bench.py [--json out.json] [--reps N]
Weights are random bf16 (a 32 MiB random block copied across the expert stacks: uploading 1.5 GiB of fresh random
numbers would take the lease's time); the router is fully random, so routing is spread like a trained router's.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from qwen35_shapes import moe_model_shape  # noqa: E402


def _time_ms(ctx: Any, fn: Any, reps: int) -> float:
    """Median over reps of fn() between device events (fn enqueues only)."""
    dev, times = ctx.device, []
    for _ in range(reps):
        start, stop = dev.event(), dev.event()
        dev.stream.record(start)
        fn()
        dev.stream.record(stop)
        stop.sync()
        times.append(float(stop - start))
    return statistics.median(times)


def _fill(ctx: Any, arr: Any, block: Any) -> None:
    """arr <- the random block repeated (device-to-device copies)."""
    done = 0
    while done < arr.nbytes:
        n = min(block.nbytes, arr.nbytes - done)
        ctx.device.copy(arr.ptr + done, block.ptr, n)
        done += n


def run(reps: int, ctx: Any = None, text: dict[str, Any] | None = None, tokens: int = 8192,
        gemm_shape: tuple[int, int, int] | None = None, copy_elems: int = 1 << 30, block_elems: int = 16 << 20
        ) -> dict[str, Any]:
    """The measurements as a dict. ctx / text / sizes: a CPU test runs it small on an emulated device."""
    from gpu_engine.cuda.bf16 import f32_to_bf16_bits
    from gpu_engine.cuda.context import GpuContext
    from gpu_engine.cuda.linear import DenseLinear, SwigluMlp
    from gpu_engine.cuda.moe import MoeLayer, grouped_gemm, plan
    from gpu_engine.cuda.moe_plan import TILES

    text = text or moe_model_shape("35b-a3b")[0]
    e, k, h = text["num_experts"], text["num_experts_per_tok"], text["hidden_size"]
    inter, s = text["moe_intermediate_size"], text["shared_expert_intermediate_size"]
    rng = np.random.default_rng(0)
    ctx = ctx or GpuContext(budget_bytes=40 << 30)
    out: dict[str, Any] = {"device": ctx.device.info.name, "shape": "35b-a3b", "experts": e, "top_k": k, "hidden": h,
                           "moe_intermediate": inter, "shared": s}
    try:
        block = ctx.empty((block_elems,), "bf16", "random-block")
        ctx.device.upload(block.ptr, f32_to_bf16_bits((rng.standard_normal(block_elems) * 0.03).astype(np.float32)))

        def rand(shape: tuple[int, ...], name: str, scale: float = 0.03) -> Any:
            if int(np.prod(shape)) > block_elems // 4:
                arr = ctx.empty(shape, "bf16", name)
                _fill(ctx, arr, block)
                return arr
            return ctx.to_device((rng.standard_normal(shape) * scale).astype(np.float32), "bf16", name)

        stacked = s == inter  # as moe_weights uploads 35B-A3B: the shared expert is expert E of the stacks
        stacks = e + stacked
        shared = None if stacked else SwigluMlp(DenseLinear(rand((2 * s, h), "sgu")), DenseLinear(rand((h, s), "sd")))
        layer = MoeLayer(e, k, rand((e + 1, h), "router", 0.05), rand((stacks, 2 * inter, h), "gu"),
                         rand((stacks, h, inter), "down"), shared)
        out["shared_stacked"] = stacked
        # ceilings: copy bandwidth (read + write) and the dense GEMM rate
        big = ctx.empty((copy_elems,), "bf16", "copy")
        _fill(ctx, big, block)
        half = big.nbytes // 2
        copy_ms = _time_ms(ctx, lambda: ctx.device.copy(big.ptr + half, big.ptr, half), reps)
        bw = 2 * half / (copy_ms * 1e-3)
        m_g, n_g, k_g = gemm_shape or (65536, 2 * inter, h)
        gx, gy = rand((m_g, k_g), "gemm.x"), ctx.empty((m_g, n_g), "bf16", "gemm.y")
        gw = rand((n_g, k_g), "gemm.w")
        ctx.blas.linear(gy.ptr, gx.ptr, gw.ptr, m_g, n_g, k_g)
        gemm_ms = _time_ms(ctx, lambda: ctx.blas.linear(gy.ptr, gx.ptr, gw.ptr, m_g, n_g, k_g), reps)
        rate = 2 * m_g * n_g * k_g / (gemm_ms * 1e-3)
        out.update(copy_GBps=bw / 1e9, gemm_TFLOPs=rate / 1e12)
        flops_per_token = 2 * h * (e + 1) + k * 6 * h * inter + 6 * h * s

        # prefill
        m = tokens
        x = rand((m, h), "x", 1.0)
        y = ctx.empty((m, h), "bf16", "y")

        def layer_once(xx: Any, yy: Any, rows: int) -> Any:
            mark = ctx.arena.mark()
            bufs = layer.grouped_forward(ctx, yy, xx, rows)
            ctx.arena.release(mark)  # host bookkeeping only: stream order keeps the scratch valid for this call
            return bufs

        layer_once(x, y, m)
        ctx.device.sync()
        pre_ms = _time_ms(ctx, lambda: layer_once(x, y, m), reps)
        out["prefill"] = {"tokens": m, "ms": pre_ms, "active_GFLOP": m * flops_per_token / 1e9,
                          "TFLOPs": m * flops_per_token / (pre_ms * 1e-3) / 1e12,
                          "vs_gemm_rate": m * flops_per_token / (pre_ms * 1e-3) / rate}
        mark = ctx.arena.mark()  # the two grouped GEMMs alone, on one forward's tables
        bufs = layer.grouped_forward(ctx, y, x, m)
        rows = m * layer.slots
        for name, fn, flop in (
                ("gate_up", lambda: grouped_gemm(ctx, bufs.act, x, h, bufs.sorted_token, layer.gate_up, bufs.tiles,
                                                 bufs.tile, swiglu=True), 2 * rows * 2 * inter * h),
                ("down", lambda: grouped_gemm(ctx, bufs.expert_out, bufs.act, inter, None, layer.down, bufs.tiles,
                                              bufs.tile, swiglu=False), 2 * rows * inter * h)):
            t = _time_ms(ctx, fn, reps)
            out["prefill"][name] = {"ms": t, "TFLOPs": flop / (t * 1e-3) / 1e12,
                                    "vs_gemm_rate": flop / (t * 1e-3) / rate}
        out["prefill"]["trials"] = _trials(ctx, layer, x, bufs, rate, reps)
        for kernel in ("moe_plan", "moe_plan_v2"):  # the routing plan of 8192 tokens alone
            def plan_once(kernel: str = kernel) -> None:
                inner = ctx.arena.mark()
                plan(ctx, bufs.ids, layer.gate_up.shape[0], bufs.tile, shared_last=stacked, kernel=kernel)
                ctx.arena.release(inner)
            out["prefill"][f"{kernel}_ms"] = _time_ms(ctx, plan_once, reps)
        small = TILES["decode"]  # the same gate|up work on the decode tiles (32 rows): data for the tile choice
        pb = plan(ctx, bufs.ids, layer.gate_up.shape[0], small)
        t = _time_ms(ctx, lambda: grouped_gemm(ctx, bufs.act, x, h, pb.sorted_token, layer.gate_up, pb.tiles, small,
                                               swiglu=True), reps)
        out["prefill"]["gate_up_decode_tiles"] = {"ms": t, "TFLOPs": 4 * rows * inter * h / (t * 1e-3) / 1e12}
        ctx.device.sync()
        ctx.arena.release(mark)

        # decode
        out["decode"] = []
        expert_bytes = 3 * h * inter * 2
        for batch in (1, 32):
            xs = [ctx.to_device(rng.standard_normal((batch, h)).astype(np.float32), "bf16", f"x{i}")
                  for i in range(8)]
            ys = [ctx.empty((batch, h), "bf16", f"y{i}") for i in range(8)]
            unique, tiles_max = [], 0
            for xi, yi in zip(xs, ys):  # eager: plans, modules; the routing of each input
                mark = ctx.arena.mark()
                bufs = layer.grouped_forward(ctx, yi, xi, batch)
                ids = ctx.to_host(bufs.ids)[:, :k]  # routed experts (the stacked shared one is counted apart)
                tiles = ctx.to_host(bufs.tiles)
                used = tiles[tiles[:, 2] > 0, 0]
                tiles_max = max(tiles_max, int(np.bincount(used).max()))
                unique.append(len(np.unique(ids)))
                ctx.arena.release(mark)
            nbytes = (statistics.mean(unique) * expert_bytes + (e + 1) * h * 2 + 3 * h * s * 2
                      + batch * h * 2 * 2 + batch * k * (inter + h) * 2 * 2)
            for pdl in (False, True):  # programmatic dependent launch between the graph's kernels (CudaOptions.use_pdl)
                ctx.device.pdl = pdl
                mark = ctx.arena.mark()
                graph = ctx.device.capture(lambda: [layer.grouped_forward(ctx, yi, xi, batch)
                                                    for xi, yi in zip(xs, ys)])
                ctx.device.launch_graph(graph)
                ms = _time_ms(ctx, lambda: ctx.device.launch_graph(graph), reps) / len(xs)
                ctx.device.sync()
                ctx.arena.release(mark)
                out["decode"].append({"batch": batch, "pdl": pdl, "us": ms * 1e3,
                                      "distinct_experts": statistics.mean(unique), "bytes_MB": nbytes / 1e6,
                                      "roofline_us": nbytes / bw * 1e6, "vs_roofline": nbytes / bw / (ms * 1e-3),
                                      "max_tiles_per_expert": tiles_max})
            ctx.device.pdl = False
            out["decode"][-1]["stages_us"] = _decode_stages(ctx, layer, xs, ys, batch, reps)
            mark = ctx.arena.mark()
            first = layer.grouped_forward(ctx, ys[0], xs[0], batch)
            out["decode"][-1]["trials"] = _trials(ctx, layer, xs[0], first, rate, reps,
                                                  timed=False)  # timed among the steps, in graphs
            ctx.device.sync()
            ctx.arena.release(mark)
        if stacked:  # the fused kernels run the shared expert as expert E of the stacks
            out["decode_fused"] = _fused_decode(ctx, layer, rng, bw, reps)
    finally:
        ctx.close()
    return out


def _fused_decode(ctx: Any, layer: Any, rng: Any, bw: float, reps: int, batches: tuple[int, ...] = (1, 2, 4, 8)
                  ) -> list[dict[str, Any]]:
    """Fused vs grouped decode at small batches: per batch, 8 inputs a graph (as the decode rows above), each path
    with PDL off and on, us a call and the fraction of the roofline of the bytes a call reads (distinct chosen experts
    + router + shared expert + activations); the fused launches alone (us a call, 8 a graph); rel. err of the fused
    output against the grouped one (bf16 roundings and the rare near-tie routing flip apart, ~1e-3)."""
    from gpu_engine.cuda import moe_decode

    e, k, h, inter = layer.num_experts, layer.top_k, layer.hidden, layer.inter
    expert_bytes = 3 * h * inter * 2
    rows = []
    for batch in batches:
        xs = [ctx.to_device(rng.standard_normal((batch, h)).astype(np.float32), "bf16", f"fx{i}") for i in range(8)]
        ys = [ctx.empty((batch, h), "bf16", f"fy{i}") for i in range(8)]
        unique, outs = [], {}
        for decode in ("grouped", "fused"):  # eager: modules; the routing of each input; input 0's output
            for i, (xi, yi) in enumerate(zip(xs, ys)):
                mark = ctx.arena.mark()
                bufs = layer.forward(ctx, yi, xi, batch, decode=decode)
                if decode == "fused":
                    unique.append(len(np.unique(ctx.to_host(bufs.ids)[:, :k])))
                if i == 0:
                    outs[decode] = ctx.to_host(yi).astype(np.float64)
                ctx.arena.release(mark)
        nbytes = (statistics.mean(unique) * expert_bytes + (e + 1) * h * 2 + expert_bytes
                  + batch * h * 2 * 2 + batch * (k + 1) * inter * 2 * 2)
        diff = float(np.linalg.norm(outs["fused"] - outs["grouped"]) / max(np.linalg.norm(outs["grouped"]), 1e-30))
        row: dict[str, Any] = {"batch": batch, "distinct_experts": statistics.mean(unique), "bytes_MB": nbytes / 1e6,
                               "roofline_us": nbytes / bw * 1e6, "fused_vs_grouped_rel_err": diff}
        for decode in ("grouped", "fused"):
            for pdl in (False, True):
                ctx.device.pdl = pdl
                mark = ctx.arena.mark()
                graph = ctx.device.capture(lambda d=decode: [layer.forward(ctx, yi, xi, batch, decode=d)
                                                             for xi, yi in zip(xs, ys)])
                ctx.device.launch_graph(graph)
                ms = _time_ms(ctx, lambda: ctx.device.launch_graph(graph), reps) / len(xs)
                ctx.device.sync()
                ctx.arena.release(mark)
                key = decode + ("_pdl" if pdl else "")
                row[f"{key}_us"] = ms * 1e3
                row[f"{key}_vs_roofline"] = nbytes / bw / (ms * 1e-3)
        ctx.device.pdl = False
        mark = ctx.arena.mark()
        bufs = [moe_decode.fused_forward(ctx, layer, yi, xi, batch) for xi, yi in zip(xs, ys)]  # their tables
        steps = {"route": lambda x, y, b: moe_decode.launch_route(ctx, layer, x, batch, b),
                 "gate_up": lambda x, y, b: moe_decode.launch_gate_up(ctx, layer, x, batch, b),
                 "down": lambda x, y, b: moe_decode.launch_down(ctx, layer, y, batch, b)}
        stages = {}
        for name, step in steps.items():
            graph = ctx.device.capture(lambda step=step: [step(x, y, b) for x, y, b in zip(xs, ys, bufs)])
            ctx.device.launch_graph(graph)
            stages[name] = _time_ms(ctx, lambda graph=graph: ctx.device.launch_graph(graph), reps) / len(xs) * 1e3
        ctx.device.sync()
        ctx.arena.release(mark)
        row["fused_stages_us"] = stages
        rows.append(row)
    return rows


def _trials(ctx: Any, layer: Any, x: Any, bufs: Any, rate: float, reps: int, timed: bool = True
            ) -> dict[str, dict[str, float]]:
    """The trial tile shapes (moe_plan.TRIAL_TILES) with the bm of the call's own tile, on its tables: each GEMM's
    output's rel. err. against the chosen tile's (same inputs; only the blocking differs, so a right kernel agrees to
    fp32 summation order, ~1e-3 after the bf16 store) and, timed, its ms and TFLOP/s against the dense rate (eager
    launches: for prefill; decode's are timed in graphs by _decode_stages)."""
    from gpu_engine.cuda.moe import grouped_gemm
    from gpu_engine.cuda.moe_plan import TRIAL_TILES

    h, inter, rows = layer.hidden, layer.inter, bufs.act.shape[0]
    runs = {"gate_up": (lambda y, xx, t: grouped_gemm(ctx, y, xx, h, bufs.sorted_token, layer.gate_up, bufs.tiles, t,
                                                       swiglu=True), x, bufs.act, 4 * rows * inter * h),
            "down": (lambda y, xx, t: grouped_gemm(ctx, y, xx, inter, None, layer.down, bufs.tiles, t, swiglu=False),
                     bufs.act, bufs.expert_out, 2 * rows * inter * h)}
    out: dict[str, dict[str, float]] = {}
    for name, (run, src, ref, flop) in runs.items():
        run(ref, src, bufs.tile)
        want = ctx.to_host(ref)
        for tile in (t for t in TRIAL_TILES.values() if t.bm == bufs.tile.bm):
            mark = ctx.arena.mark()
            got = ctx.empty(ref.shape, ref.dtype, "trial.out")
            run(got, src, tile)
            err = float(np.linalg.norm(ctx.to_host(got) - want) / max(float(np.linalg.norm(want)), 1e-30))
            row = out[f"{name}[{tile.name}]"] = {"rel_err_vs_chosen": err}
            if timed:
                ms = _time_ms(ctx, lambda: run(got, src, tile), reps)
                row.update(ms=ms, TFLOPs=flop / (ms * 1e-3) / 1e12, vs_gemm_rate=flop / (ms * 1e-3) / rate)
            ctx.arena.release(mark)
    return out


def _decode_stages(ctx: Any, layer: Any, xs: list[Any], ys: list[Any], batch: int, reps: int) -> dict[str, float]:
    """Microseconds a call of each step of MoeLayer.forward takes at this batch: each step's 8 calls (one per input,
    on that input's own forward tables) in a graph of their own, replayed (so launch gaps are the graph's, as in the
    decode graph; a step shorter than a graph's kernel-to-kernel gap reads as that gap)."""
    from gpu_engine.cuda import moe

    e, k, h, inter, slots = layer.num_experts, layer.top_k, layer.hidden, layer.inter, layer.slots
    ld = -(-(e + 1) // 8) * 8
    mark = ctx.arena.mark()
    bufs = [layer.grouped_forward(ctx, yi, xi, batch) for xi, yi in zip(xs, ys)]  # kept: each step reads its own
    shared_y = None
    if layer.shared is not None:
        shared_y = ctx.empty((batch, h), xs[0].dtype, "shared_y")
    steps = {
        "router_gemm": lambda x, y, b: ctx.blas.linear(b.logits.ptr, x.ptr, layer.router.ptr, batch, e + 1, h,
                                                       dtype=x.dtype, y_dtype="f32", y_ld=ld),
        "route": lambda x, y, b: moe.route(ctx, b.ids, b.weights, b.shared_gate, b.logits, e, k),
        "route_v2": lambda x, y, b: moe.route(ctx, b.ids, b.weights, b.shared_gate, b.logits, e, k,
                                              kernel="moe_route_v2"),
        "moe_plan": lambda x, y, b: moe.plan(ctx, b.ids, layer.gate_up.shape[0], b.tile,
                                             shared_last=layer.shared is None, kernel="moe_plan"),
        "moe_plan_v2": lambda x, y, b: moe.plan(ctx, b.ids, layer.gate_up.shape[0], b.tile,
                                                shared_last=layer.shared is None, kernel="moe_plan_v2"),
        "gate_up": lambda x, y, b: moe.grouped_gemm(ctx, b.act, x, h, b.sorted_token, layer.gate_up, b.tiles, b.tile,
                                                    swiglu=True),
        "down": lambda x, y, b: moe.grouped_gemm(ctx, b.expert_out, b.act, inter, None, layer.down, b.tiles, b.tile,
                                                 swiglu=False),
        "combine": lambda x, y, b: moe.combine(ctx, y, b.expert_out, b.entry_row, b.weights, b.shared_gate,
                                               shared_y, batch, slots),
        "combine_v2": lambda x, y, b: moe.combine(ctx, y, b.expert_out, b.entry_row, b.weights, b.shared_gate,
                                                  shared_y, batch, slots, vectorised=True),
    }
    if layer.shared is not None:
        steps["shared_expert"] = lambda x, y, b: layer.shared(ctx, shared_y, x, batch)
    from gpu_engine.cuda.moe_plan import TRIAL_TILES

    for tile in (t for t in TRIAL_TILES.values() if t.bm == bufs[0].tile.bm):
        steps[f"gate_up[{tile.name}]"] = lambda x, y, b, t=tile: moe.grouped_gemm(
            ctx, b.act, x, h, b.sorted_token, layer.gate_up, b.tiles, t, swiglu=True)
        steps[f"down[{tile.name}]"] = lambda x, y, b, t=tile: moe.grouped_gemm(
            ctx, b.expert_out, b.act, inter, None, layer.down, b.tiles, t, swiglu=False)
    out: dict[str, float] = {}
    try:
        for name, step in steps.items():
            inner = ctx.arena.mark()
            graph = ctx.device.capture(lambda step=step: [step(x, y, b) for x, y, b in zip(xs, ys, bufs)])
            ctx.device.launch_graph(graph)
            out[name] = _time_ms(ctx, lambda graph=graph: ctx.device.launch_graph(graph), reps) / len(xs) * 1e3
            ctx.device.sync()
            ctx.arena.release(inner)
    finally:
        ctx.device.sync()
        ctx.arena.release(mark)
    return out


def table(r: dict[str, Any]) -> str:
    p = r["prefill"]
    lines = [f"ceilings: copy {r['copy_GBps']:.0f} GB/s, dense bf16 GEMM {r['gemm_TFLOPs']:.0f} TFLOP/s "
             f"({r['device']})",
             f"prefill {p['tokens']} tokens: {p['ms']:.3f} ms, {p['active_GFLOP']:.0f} GFLOP active, "
             f"{p['TFLOPs']:.0f} TFLOP/s = {p['vs_gemm_rate']:.2f} of the GEMM rate (target >= 0.5)"]
    for name in ("gate_up", "down"):
        g = p[name]
        lines.append(f"  grouped {name}: {g['ms']:.3f} ms, {g['TFLOPs']:.0f} TFLOP/s = {g['vs_gemm_rate']:.2f}")
    lines.append(f"  routing plan: moe_plan {p['moe_plan_ms'] * 1e3:.1f} us, "
                 f"moe_plan_v2 {p['moe_plan_v2_ms'] * 1e3:.1f} us")
    for name, t in p.get("trials", {}).items():
        lines.append(f"  trial {name}: {t['ms']:.3f} ms, {t['TFLOPs']:.0f} TFLOP/s = {t['vs_gemm_rate']:.2f} "
                     f"(err vs chosen {t['rel_err_vs_chosen']:.1e})")
    g = p["gate_up_decode_tiles"]
    lines.append(f"  grouped gate_up on 32-row tiles: {g['ms']:.3f} ms, {g['TFLOPs']:.0f} TFLOP/s")
    for d in r["decode"]:
        lines.append(f"decode batch {d['batch']}{' pdl' if d['pdl'] else ''}: {d['us']:.1f} us, "
                     f"{d['distinct_experts']:.1f} experts, "
                     f"{d['bytes_MB']:.1f} MB -> roofline {d['roofline_us']:.1f} us = {d['vs_roofline']:.2f} "
                     f"(target >= 0.7), tiles per expert <= {d['max_tiles_per_expert']}")
        for name, t in d.get("trials", {}).items():
            lines.append(f"  trial {name}: err vs chosen {t['rel_err_vs_chosen']:.1e}")
        if "stages_us" in d:
            lines.append("  steps alone (us a call): " + ", ".join(f"{n} {t:.1f}" for n, t in d["stages_us"].items()))
    for d in r.get("decode_fused", []):
        paths = ", ".join(f"{key} {d[key + '_us']:.1f} us = {d[key + '_vs_roofline']:.2f}"
                          for key in ("grouped", "grouped_pdl", "fused", "fused_pdl"))
        lines.append(f"decode batch {d['batch']} fused vs grouped: {paths} of roofline {d['roofline_us']:.1f} us "
                     f"({d['distinct_experts']:.1f} experts, {d['bytes_MB']:.1f} MB; fused vs grouped rel. err "
                     f"{d['fused_vs_grouped_rel_err']:.1e})")
        lines.append("  fused steps alone (us a call): "
                     + ", ".join(f"{n} {t:.1f}" for n, t in d["fused_stages_us"].items()))
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    r = run(args.reps)
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=1))
    print(table(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())

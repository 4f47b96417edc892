"""Check the CUDA MoE path on the GPU: each kernel of kernels/moe.cu against float64 numpy, the whole MoeLayer, then
the tiny qwen3_5_moe models (both expert layouts) CudaRunner vs the reference runner.

    python3 -m tests.cuda_runner.check_moe [--json out.json] [--seed N] [--part kernels|model|fused|all]

Kernels (fresh random inputs, outputs poisoned with 0xFF first, metric ||out - ref|| / ||ref||):
- moe_route on random f32 logits with exact ties planted among each row's largest: the chosen ids equal the
  reference rule (largest probability first, ties toward the lower id) exactly; weights and the shared gate's
  sigmoid within 1e-5;
  moe_route_v2 (on trial) the same on every case;
- moe_combine_v2 (on trial): within the dtype's tolerance of the float64 sum and bit for bit moe_combine's;
- moe_plan: offsets and the tile table equal moe_plan.host_plan exactly, each expert's rows hold the same tokens
  (their order within an expert is atomic), sorted_token[entry_row[i]] == i // k; the same for moe_plan_v2 (the
  decode tiles' plan), whose stacked shared expert's rows must come in token order;
- the grouped GEMMs (tensor-core decode / prefill tiles, the plain kernel for f32 and odd K; gate|up with
  silu * up, and down) against moe_plan.emulate_grouped_gemm over the device's own tables: bf16 1e-2, f32 1e-4;
- MoeLayer.forward (router GEMM .. combine) against the float64 formula of reference/moe.py on the same rounded
  weights and inputs, with the routing the device chose (its agreement with the float64 routing is required to be
  total in f32 and reported in bf16, where rounding may flip a near tie).
Fused decode (moe_decode.py, CudaOptions.moe_decode="fused"; --part fused runs these alone): each of its three
kernels against moe_decode_emulation's mirror of its arithmetic order on the device's own inputs to it (router
logits f32 1e-6; ids equal on the device's logits, weights 1e-6; act and y bf16 1e-3 / f32 1e-6, the bit-exact share
reported), bit-reproducible (two eager calls, PDL on, two graph replays: the same bits), and MoeLayer.forward with
decode="fused" against the float64 formula like the grouped rows; the stacked-shared tiny model with "fused" too.
Model: make_tiny_moe_checkpoint (6 experts top-2, odd widths: the plain kernel for down; an aligned config that
takes the tensor-core kernels for both GEMMs; one with the shared expert stacked), check_runner's scenario (chunked
prefill, vision slice, batched decode, graph replay; CudaOptions.from_env, so DOCPIPE_CUDA_GRAPHS=0 runs the decode
steps eagerly), the device's routing recorded per MoE call (moe_routing.py): f32 logits rel. err <= 1e-4, identical
greedy tokens and no routing flip; bf16 on the reference's forced tokens with the reference routed as the device
routed, within check_runner's BF16_SANITY (the dense models' bound), every flip consistent with the device's own
router-logit error (a near tie crossed) and the flipped share reported, as is the distance to the unforced
reference (a flip moves a token's whole MLP output: tiny MoE models move by 0.02-0.3 from flips alone, cuda_notes).
Skips (exit 0) without a GPU.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Callable

import numpy as np

from tests.cuda_runner.harness import Result, check_main, fresh_seed, rel_err, result_table, run_guarded

TOL = {"bf16": 1e-2, "f32": 1e-4}
ROUTE_CASES = ((1, 256, 8, False), (33, 6, 2, False), (1000, 256, 8, True), (7, 5, 3, True), (64, 512, 10, False),
               (5, 1024, 10, True))
# moe_combine_v2 (on trial): (tokens, entries a token, hidden, dtype, with a separate shared expert output)
COMBINE_CASES = ((1, 9, 2048, "bf16", False), (32, 9, 2048, "bf16", False), (7, 4, 256, "bf16", True),
                 (300, 3, 96, "f32", True), (5, 2, 64, "f32", False), (3, 2, 1032, "bf16", True))
# moe_plan_v2: (tokens, experts, entries a token, tile, the last entry is the stacked shared expert)
PLAN_V2_CASES = ((1, 257, 9, "decode", True), (32, 257, 9, "decode", True), (8192, 257, 9, "prefill", True),
                 (300, 5, 3, "prefill", False), (77, 6, 2, "decode", False), (1000, 1024, 8, "prefill", False),
                 (40, 1024, 11, "decode", True))
# (name, tokens, experts, top-k, hidden, intermediate, dtype, tile, path)
GEMM_CASES = (
    ("decode b1 35b-like", 1, 12, 8, 2048, 512, "bf16", "decode", "mma"),
    ("decode b32 35b-like", 32, 16, 8, 2048, 512, "bf16", "decode", "mma"),
    ("decode tile, 2 tiles an expert", 100, 4, 2, 256, 192, "bf16", "decode", "mma"),
    ("prefill ragged K", 600, 8, 2, 512, 392, "bf16", "prefill", "mma"),
    ("plain bf16 odd K", 40, 6, 2, 64, 21, "bf16", "decode", "simple"),
    ("plain f32", 50, 6, 3, 96, 40, "f32", "decode", "simple"),
)
# (tokens, experts, top-k, hidden, intermediate, shared, dtype): shared == intermediate stacks the shared expert
LAYER_CASES = ((1, 16, 4, 256, 96, 80, "bf16"), (7, 16, 4, 256, 96, 80, "f32"), (300, 16, 4, 256, 96, 80, "bf16"),
               (1, 12, 8, 2048, 512, 512, "bf16"), (32, 16, 8, 2048, 512, 512, "bf16"), (20, 6, 2, 64, 21, 37, "f32"),
               (9, 6, 2, 64, 24, 24, "f32"), (700, 8, 2, 256, 128, 128, "bf16"))
# fused decode: (tokens, experts, top-k, hidden, intermediate, dtype); the shared expert stacked (width = I)
# (35B-A3B's H, I and top-8 over 32 experts: the numpy mirror gathers every entry's expert in float32; 256 experts
# at a small width)
FUSED_CASES = ((1, 32, 8, 2048, 512, "bf16"), (8, 32, 8, 2048, 512, "bf16"), (8, 256, 8, 64, 16, "bf16"),
               (3, 6, 2, 96, 40, "bf16"),
               (5, 6, 2, 96, 40, "f32"), (2, 300, 10, 520, 72, "bf16"), (4, 40, 4, 4096, 64, "bf16"),
               (8, 64, 8, 1032, 1040, "f32"), (1, 64, 31, 64, 16, "f32"))
FUSED_LAYER_CASES = ((1, 12, 8, 2048, 512, 512, "bf16"), (8, 16, 4, 256, 96, 96, "bf16"),
                     (8, 16, 4, 256, 96, 96, "f32"), (5, 6, 2, 64, 24, 24, "f32"))
# name -> (text_config over TINY_MOE_TEXT, layouts); the layouts upload the same stacks (test_moe_upload), so the
# larger configs run one
MODEL_CONFIGS = {
    "tiny moe (E6 top-2, I21)": ({}, ("fused", "per_expert")),
    "aligned moe (E8 top-3, I64)": ({"hidden_size": 128, "num_experts": 8, "num_experts_per_tok": 3,
                                     "moe_intermediate_size": 64, "shared_expert_intermediate_size": 96}, ("fused",)),
    "stacked shared (E7 top-2, I=S=32)": ({"hidden_size": 64, "num_experts": 7, "num_experts_per_tok": 2,
                                           "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32},
                                          ("per_expert",)),
}
FUSED_MODELS = ("stacked shared (E7 top-2, I=S=32)",)  # the configs the fused decode kernels take (stacked shared)


def _bf16(x: np.ndarray) -> np.ndarray:
    from gpu_engine.cuda.bf16 import round_to_bf16

    return round_to_bf16(np.asarray(x, np.float32))


def route_reference(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids, weights) by reference/moe.py's rule in float64: stable sort of -p (ties toward the lower id)."""
    z = logits.astype(np.float64)
    p = np.exp(z - z.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    ids = np.argsort(-p, axis=-1, kind="stable")[:, :k]
    top = np.take_along_axis(p, ids, axis=-1)
    return ids, top / top.sum(axis=-1, keepdims=True)


class Checker:
    def __init__(self, ctx, rng: np.random.Generator) -> None:
        self.ctx, self.rng = ctx, rng
        self.results: list[Result] = []

    def record(self, name: str, dtype: str, err: float, tol: float, note: str = "") -> None:
        self.results.append(Result(name, dtype, err, tol, bool(np.isfinite(err) and err <= tol), note))
        print(f"row: {name} {dtype} {err:.2e} (tol {tol:.0e}) {note}", flush=True)  # a cut-off run keeps its rows

    def run(self, name: str, dtype: str, fn: Callable[[], None]) -> None:
        run_guarded(self.ctx, self.results, name, dtype, TOL[dtype], fn)

    def normal(self, shape: tuple[int, ...], scale: float = 1.0) -> np.ndarray:
        """float32 normals (drawn in float32: the 35B-like stacks hold ~10^8 values)."""
        out = self.rng.standard_normal(shape, dtype=np.float32)
        if scale != 1.0:
            out *= np.float32(scale)
        return out

    def ids(self, n: int, e: int, k: int) -> np.ndarray:
        return np.stack([self.rng.choice(e, k, replace=False) for _ in range(n)]).astype(np.int32)

    # ---- kernels ---------------------------------------------------------------------------------------------
    def route(self, n: int, e: int, k: int, stacked: bool = False, kernel: str = "moe_route") -> None:
        from gpu_engine.cuda import moe

        ctx, ld = self.ctx, -(-(e + 1) // 8) * 8
        logits = (self.rng.standard_normal((n, ld)) * 2).astype(np.float32)
        for r in range(0, n, 2):  # ties: the row's largest value copied to a lower and a higher expert id
            top = int(np.argmax(logits[r, :e]))
            for other in self.rng.choice(e, 2, replace=False):
                logits[r, other] = logits[r, top]
        d_logits = ctx.to_device(logits, "f32", "logits")
        slots = k + stacked
        ids, w, g = ctx.empty((n, slots), "i32", "ids"), ctx.empty((n, slots), "f32", "w"), ctx.empty((n,), "f32", "g")
        for arr in (ids, w, g):
            ctx.poison(arr)
        moe.route(ctx, ids, w, g, d_logits, e, k, kernel=kernel)
        want_ids, want_w = route_reference(logits[:, :e], k)
        gate = 1 / (1 + np.exp(-logits[:, e].astype(np.float64)))
        if stacked:  # the shared expert as every token's entry k
            want_ids = np.concatenate([want_ids, np.full((n, 1), e)], axis=1)
            want_w = np.concatenate([want_w, gate[:, None]], axis=1)
        got_ids = ctx.to_host(ids)
        same = float(np.mean(np.all(got_ids == want_ids, axis=-1)))
        err = max(rel_err(ctx.to_host(w), want_w), rel_err(ctx.to_host(g), gate))
        self.record(f"{kernel} n{n} E{e} top-{k}{' +shared' if stacked else ''} (ties)", "f32",
                    err if same == 1.0 else float("nan"), 1e-5, f"ids equal the reference rule in {same:.4f} of rows")

    def combine(self, n: int, k: int, h: int, dtype: str, shared: bool) -> None:
        """moe_combine_v2 (on trial) against the float64 sum, and bit for bit against moe_combine (the same sums in
        the same order); one entry of the first token is -1 (no row), which both skip."""
        from gpu_engine.cuda import moe

        ctx, rows = self.ctx, n * k
        rnd = _bf16 if dtype == "bf16" else (lambda a: np.asarray(a, np.float32))
        ys = rnd(self.normal((rows, h)))
        entry_row = self.rng.permutation(rows).astype(np.int32).reshape(n, k)
        entry_row[0, -1] = -1
        weights = self.rng.random((n, k)).astype(np.float32)
        gate = self.rng.random(n).astype(np.float32)
        shared_y = rnd(self.normal((n, h))) if shared else None
        put = ctx.to_device
        args = (put(ys, dtype, "ys"), put(entry_row, "i32", "rows"), put(weights, "f32", "w"), put(gate, "f32", "g"),
                put(shared_y, dtype, "sy") if shared_y is not None else None)
        outs = []
        for vectorised in (False, True):
            y = ctx.empty((n, h), dtype, "y")
            ctx.poison(y)
            moe.combine(ctx, y, *args, n, k, vectorised=vectorised)
            outs.append(ctx.to_host(y))
        want = np.zeros((n, h)) if shared_y is None else gate[:, None].astype(np.float64) * shared_y
        for t in range(n):
            for j in range(k):
                if entry_row[t, j] >= 0:
                    want[t] += float(weights[t, j]) * ys[entry_row[t, j]].astype(np.float64)
        same = bool(np.array_equal(outs[0], outs[1]))
        self.record(f"moe_combine_v2 n{n} k{k} H{h}{' +shared' if shared else ''}", dtype,
                    rel_err(outs[1], want) if same else float("nan"), TOL[dtype],
                    "bit-identical to moe_combine" if same else "differs from moe_combine")

    def plan(self, n: int, e: int, k: int, tile_name: str, kernel: str = "moe_plan", shared_last: bool = False
             ) -> None:
        """One plan kernel (moe.PLAN_KERNELS); shared_last: every token's last entry is expert e - 1, the stacked
        shared expert, whose rows must then come in token order."""
        from gpu_engine.cuda import moe
        from gpu_engine.cuda.moe_plan import TILES, host_plan

        ctx, tile = self.ctx, TILES[tile_name]
        if shared_last:
            ids = np.concatenate([self.ids(n, e - 1, k - 1), np.full((n, 1), e - 1, np.int32)], axis=1)
        else:
            ids = self.ids(n, e, k)
        bufs = moe.plan(ctx, ctx.to_device(ids, "i32", "ids"), e, tile, shared_last=shared_last, kernel=kernel)
        want = host_plan(ids, e, tile.bm)
        offsets, tiles = ctx.to_host(bufs.offsets), ctx.to_host(bufs.tiles)
        sorted_token, entry_row = ctx.to_host(bufs.sorted_token), ctx.to_host(bufs.entry_row)
        ok = np.array_equal(offsets, want.offsets) and np.array_equal(tiles, want.tiles)
        ok = ok and all(sorted(sorted_token[a:b]) == sorted(want.sorted_token[a:b])
                        for a, b in zip(want.offsets[:-1], want.offsets[1:]))
        ok = ok and np.array_equal(sorted_token[entry_row], np.arange(n * k) // k)
        if shared_last:
            ok = ok and np.array_equal(sorted_token[want.offsets[e - 1]:want.offsets[e]], np.arange(n))
        name = f"{kernel} n{n} E{e} top-{k}{' +shared last' if shared_last else ''} {tile_name}"
        self.record(name, "i32", 0.0 if ok else float("nan"), 0.0,
                    f"{int(np.count_nonzero(tiles[:, 2]))} tiles of {tiles.shape[0]}")

    def gemm(self, name: str, n: int, e: int, k: int, h: int, inter: int, dtype: str, tile_name: str,
             path: str) -> None:
        from gpu_engine.cuda import moe
        from gpu_engine.cuda.moe_plan import TILES, emulate_grouped_gemm

        ctx, tile, rows = self.ctx, TILES[tile_name], n * k
        ids = self.ids(n, e, k)
        bufs = moe.plan(ctx, ctx.to_device(ids, "i32", "ids"), e, tile)
        rnd = _bf16 if dtype == "bf16" else (lambda a: np.asarray(a, np.float32))
        normal = self.normal
        x = rnd(normal((n, h)))
        w_gu = rnd(normal((e, 2 * inter, h), h ** -0.5))
        w_down = rnd(normal((e, h, inter), inter ** -0.5))
        act = ctx.empty((rows, inter), dtype, "act")
        out = ctx.empty((rows, h), dtype, "out")
        ctx.poison(act)
        ctx.poison(out)
        d_gu, d_down = ctx.to_device(w_gu, dtype, "gu"), ctx.to_device(w_down, dtype, "down")
        took = moe.grouped_gemm(ctx, act, ctx.to_device(x, dtype, "x"), h, bufs.sorted_token, d_gu, bufs.tiles,
                                tile, swiglu=True, path=path)
        took2 = moe.grouped_gemm(ctx, out, act, inter, None, d_down, bufs.tiles, tile, swiglu=False, path=path)
        tiles, sorted_token = ctx.to_host(bufs.tiles), ctx.to_host(bufs.sorted_token)
        act_host = ctx.to_host(act)
        want_act = emulate_grouped_gemm(x, sorted_token, w_gu, tiles, rows, swiglu=True)
        self.record(f"gemm gate_up+silu {name}", dtype, rel_err(act_host, want_act), TOL[dtype],
                    f"{took} {tile_name} n{n} E{e} k{k} H{h} I{inter}")
        want_out = emulate_grouped_gemm(act_host, None, w_down, tiles, rows, swiglu=False)  # on the device's act
        self.record(f"gemm down {name}", dtype, rel_err(ctx.to_host(out), want_out), TOL[dtype], took2)

    def layer(self, n: int, e: int, k: int, h: int, inter: int, s: int, dtype: str, decode: str = "grouped"
              ) -> None:
        from gpu_engine.cuda.linear import DenseLinear, SwigluMlp
        from gpu_engine.cuda.moe import MoeBuffers, MoeLayer

        ctx = self.ctx
        rnd = _bf16 if dtype == "bf16" else (lambda a: np.asarray(a, np.float32))

        def w(*shape: int) -> np.ndarray:
            return rnd(self.normal(shape, shape[-1] ** -0.5))

        host = {"gate.weight": w(e, h) * 4, "experts.gate_up_proj": w(e, 2 * inter, h),
                "experts.down_proj": w(e, h, inter), "shared_expert.gate_proj.weight": w(s, h),
                "shared_expert.up_proj.weight": w(s, h), "shared_expert.down_proj.weight": w(h, s),
                "shared_expert_gate.weight": w(1, h)}
        x = rnd(self.normal((n, h)))
        put = ctx.to_device
        sgu = np.concatenate([host["shared_expert.gate_proj.weight"], host["shared_expert.up_proj.weight"]])
        stacked = s == inter  # as moe_weights uploads it: the shared expert is expert E of the stacks
        gu_stack, dn_stack = host["experts.gate_up_proj"], host["experts.down_proj"]
        if stacked:
            gu_stack = np.concatenate([gu_stack, sgu[None]])
            dn_stack = np.concatenate([dn_stack, host["shared_expert.down_proj.weight"][None]])
        shared = None if stacked else SwigluMlp(DenseLinear(put(sgu, dtype, "sgu")),
                                                DenseLinear(put(host["shared_expert.down_proj.weight"], dtype, "sd")))
        layer = MoeLayer(e, k, put(np.concatenate([host["gate.weight"], host["shared_expert_gate.weight"]]), dtype,
                                   "router"), put(gu_stack, dtype, "gu"), put(dn_stack, dtype, "dn"), shared)
        y = ctx.empty((n, h), dtype, "y")
        ctx.poison(y)
        bufs = layer.forward(ctx, y, put(x, dtype, "x"), n, decode=decode)
        path = bufs.tile.name + " tiles" if isinstance(bufs, MoeBuffers) else "fused"
        ids, weights = ctx.to_host(bufs.ids), ctx.to_host(bufs.weights).astype(np.float64)
        gate64 = 1 / (1 + np.exp(-(x.astype(np.float64) @ host["shared_expert_gate.weight"].astype(np.float64).T)))
        if stacked:  # every token's last entry: (E, sigmoid(gate)); the rest is the routing
            ok = bool(np.all(ids[:, k] == e)) and rel_err(weights[:, k], gate64[:, 0]) <= 1e-4
            self.record(f"MoeLayer n{n} E{e} shared entries", "f32", 0.0 if ok else float("nan"), 0.0)
            ids, weights = ids[:, :k], weights[:, :k]
        x64 = x.astype(np.float64)
        logits = x64 @ host["gate.weight"].astype(np.float64).T
        want_ids, want_w = route_reference(logits, k)
        agree = np.all(ids == want_ids, axis=-1)
        w_err = rel_err(weights[agree], want_w[agree]) if agree.any() else 0.0

        def swiglu(v: np.ndarray, g: np.ndarray, u: np.ndarray, d: np.ndarray) -> np.ndarray:
            a, b = v @ g.astype(np.float64).T, v @ u.astype(np.float64).T
            return (a / (1 + np.exp(-a)) * b) @ d.astype(np.float64).T

        gu, dn = host["experts.gate_up_proj"], host["experts.down_proj"]
        want = swiglu(x64, host["shared_expert.gate_proj.weight"], host["shared_expert.up_proj.weight"],
                      host["shared_expert.down_proj.weight"])
        want = want * gate64
        for ex in np.unique(ids):  # the device's routing (its weights checked apart above)
            rows = np.nonzero(np.any(ids == ex, axis=-1))[0]
            scale = np.sum(weights[rows] * (ids[rows] == ex), axis=-1)
            want[rows] += scale[:, None] * swiglu(x64[rows], gu[ex, :inter], gu[ex, inter:], dn[ex])
        need_all = dtype == "f32"
        err = rel_err(ctx.to_host(y), want)
        routing_ok = bool(agree.all()) or not need_all
        self.record(f"MoeLayer{' fused' if decode == 'fused' else ''} n{n} E{e} top-{k} H{h} I{inter} S{s}", dtype,
                    err if routing_ok and w_err <= 1e-4 else float("nan"), TOL[dtype],
                    f"{path}{', shared stacked' if stacked else ''}; routing agrees in "
                    f"{agree.mean():.3f} of tokens, weights err {w_err:.1e}")

    def fused(self, n: int, e: int, k: int, h: int, inter: int, dtype: str) -> None:
        """The fused decode kernels against their arithmetic-order emulation, each on the device's own inputs to
        it, and the same bits from two eager calls, a PDL call and two graph replays."""
        from gpu_engine.cuda.moe import MoeLayer
        from tests.cuda_runner import moe_decode_emulation as emul

        ctx, tag = self.ctx, f"n{n} E{e} top-{k} H{h} I{inter}"
        rnd = _bf16 if dtype == "bf16" else (lambda a: np.asarray(a, np.float32))
        router = rnd(self.normal((e + 1, h), 4 * h ** -0.5))
        gu = rnd(self.normal((e + 1, 2 * inter, h), h ** -0.5))
        dn = rnd(self.normal((e + 1, h, inter), inter ** -0.5))
        x = rnd(self.normal((n, h)))
        put = ctx.to_device
        layer = MoeLayer(e, k, put(router, dtype, "router"), put(gu, dtype, "gu"), put(dn, dtype, "dn"), None,
                         decode="fused")
        dx = put(x, dtype, "x")

        def call() -> tuple[np.ndarray, object]:
            y = ctx.empty((n, h), dtype, "y")
            ctx.poison(y)
            bufs = layer.forward(ctx, y, dx, n)
            return ctx.to_host(y), bufs

        got, bufs = call()
        logits = ctx.to_host(bufs.logits)[:, :e + 1]
        ids, weights = ctx.to_host(bufs.ids), ctx.to_host(bufs.weights)
        act = ctx.to_host(bufs.act)
        self.record(f"moe_decode_route logits {tag}", "f32", rel_err(logits, emul.router_logits(x, router, dtype)),
                    1e-6)
        routed = [emul.route_token(z, e, k) for z in logits]
        want_ids = np.stack([r[0] for r in routed])
        same_ids = bool(np.array_equal(ids, want_ids))
        err = max(rel_err(weights, np.stack([r[1] for r in routed])),
                  rel_err(ctx.to_host(bufs.shared_gate), np.array([r[2] for r in routed])))
        self.record(f"moe_decode_route top-k {tag}", "f32", err if same_ids else float("nan"), 1e-6,
                    "ids equal the emulation's on the device's logits" if same_ids else f"ids {ids} vs {want_ids}")
        tol = 1e-3 if dtype == "bf16" else 1e-6
        want_act = emul.gate_up(x, ids, gu, dtype)
        self.record(f"moe_decode_gate_up {tag}", dtype, rel_err(act, want_act), tol,
                    f"bit-exact share {np.mean(act == want_act):.4f}")
        want_y = emul.down(act, ids, weights, dn, dtype)
        self.record(f"moe_decode_down {tag}", dtype, rel_err(got, want_y), tol,
                    f"bit-exact share {np.mean(got == want_y):.4f}")
        again = [call()[0]]
        pdl = ctx.device.pdl
        ctx.device.pdl = True
        try:
            again.append(call()[0])
        finally:
            ctx.device.pdl = pdl
        y = ctx.empty((n, h), dtype, "y.graph")
        graph = ctx.device.capture(lambda: layer.forward(ctx, y, dx, n))
        for _ in range(2):
            ctx.poison(y)
            ctx.device.launch_graph(graph)
            again.append(ctx.to_host(y))
        same = [bool(np.array_equal(a.view(np.uint32) if a.dtype == np.float32 else a, got.view(np.uint32)
                                    if got.dtype == np.float32 else got)) for a in again]
        self.record(f"moe_decode reproducible {tag}", dtype, 0.0 if all(same) else float("nan"), 0.0,
                    f"eager, PDL, 2 graph replays: {same}")


def run_fused(c: Checker) -> None:
    for case in FUSED_CASES:
        c.run(f"moe_decode {case}", case[-1], lambda case=case: c.fused(*case))
    for case in FUSED_LAYER_CASES:
        c.run(f"MoeLayer fused {case}", case[-1], lambda case=case: c.layer(*case, decode="fused"))


def run_kernels(seed: int, fused_only: bool = False) -> tuple[list[Result], dict]:
    from gpu_engine.cuda.context import GpuContext

    ctx = GpuContext(budget_bytes=6 << 30)
    info = {"seed": seed, "device": ctx.device.info.name, "arch": ctx.device.info.arch}
    try:
        c = Checker(ctx, np.random.default_rng(seed))
        if fused_only:
            run_fused(c)
            return c.results, info
        for n, e, k, stacked in ROUTE_CASES:
            c.run(f"route n{n} E{e}", "f32", lambda n=n, e=e, k=k, st=stacked: c.route(n, e, k, st))
        for n, e, k, tile in ((1, 256, 8, "decode"), (32, 256, 8, "decode"), (8192, 256, 8, "prefill"),
                              (300, 5, 3, "prefill"), (77, 6, 2, "decode")):
            c.run(f"plan n{n} E{e}", "f32", lambda n=n, e=e, k=k, tile=tile: c.plan(n, e, k, tile))
        for n, e, k, stacked in ROUTE_CASES:
            c.run(f"moe_route_v2 n{n} E{e}", "f32",
                  lambda n=n, e=e, k=k, st=stacked: c.route(n, e, k, st, kernel="moe_route_v2"))
        for case in COMBINE_CASES:
            c.run(f"moe_combine_v2 {case}", case[3], lambda case=case: c.combine(*case))
        for n, e, k, tile, shared in PLAN_V2_CASES:
            c.run(f"plan_v2 n{n} E{e}", "f32",
                  lambda n=n, e=e, k=k, tile=tile, sh=shared: c.plan(n, e, k, tile, "moe_plan_v2", sh))
        for case in GEMM_CASES:
            c.run(f"gemm {case[0]}", case[6], lambda case=case: c.gemm(*case))
        for case in LAYER_CASES:
            c.run(f"MoeLayer {case}", case[-1], lambda case=case: c.layer(*case))
        run_fused(c)
        return c.results, info
    finally:
        ctx.close()


def run_model(seed: int, fused_only: bool = False) -> list[Result]:
    from gpu_engine.config import ModelConfig
    from gpu_engine.cuda.moe_weights import set_moe_decode
    from gpu_engine.cuda.options import CudaOptions
    from gpu_engine.cuda.runner import CudaRunner
    from gpu_engine.loader import load_weights
    from gpu_engine.reference.runner import ReferenceRunner
    from gpu_engine.tiny_moe import make_tiny_moe_checkpoint
    from tests.cuda_runner.check_runner import BF16_SANITY, _drive, _rounded
    from tests.cuda_runner.moe_routing import CudaRoutingTrace, forced_routing

    results = []
    runs = [(name, layout, decode) for name, (_, layouts) in MODEL_CONFIGS.items() for layout in layouts
            for decode in (("grouped", "fused") if name in FUSED_MODELS else ("grouped",))
            if decode == "fused" or not fused_only]
    for name, layout, decode in runs:
        text_cfg = MODEL_CONFIGS[name][0]
        with tempfile.TemporaryDirectory() as folder:
            make_tiny_moe_checkpoint(folder, seed=seed % 1000, layout=layout, text_config=text_cfg)
            config = ModelConfig.from_pretrained(folder)
            weights, _ = load_weights(folder, config)
        for dtype in ("f32", "bf16"):
            ref_weights = weights if dtype == "f32" else _rounded(weights)
            ref_steps, ref_greedy = _drive(ReferenceRunner(config, ref_weights), config, seed)
            runner = CudaRunner(config, weights, CudaOptions.from_env(dtype=dtype, memory_budget=1 << 30))
            set_moe_decode(runner.model.w.layers, decode)  # (the runner does not pass CudaOptions.moe_decode yet)
            trace = CudaRoutingTrace(runner)
            try:
                steps, greedy = _drive(runner, config, seed, forced=ref_greedy if dtype == "bf16" else None)
                c = runner.decode_counts  # graph replays seen by the taps (a failed capture would run eager)
                counts = f"steps graphed {c.graphed}, eager-graphable {c.eager_graphable}, other {c.other}"
            finally:
                runner.close()
            reference = ReferenceRunner(config, ref_weights)
            with forced_routing(reference, trace.calls) as routing:
                routed_steps, _ = _drive(reference, config, seed, forced=ref_greedy if dtype == "bf16" else None)
            unforced = float(max(rel_err(a, b) for a, b in zip(steps, ref_steps)))
            routed = float(max(rel_err(a, b) for a, b in zip(steps, routed_steps)))
            agree = float(np.mean(np.concatenate([a.argmax(-1) == b.argmax(-1) for a, b in zip(steps, ref_steps)])))
            same = greedy == ref_greedy
            note = f"top-1 {agree:.3f}, greedy {'same' if same else 'DIFF'}; {counts}; {routing.note()}"
            if dtype == "f32":  # no flip may happen at f32 noise: the unforced run is the verdict
                worst, tol = unforced, 1e-4
                ok = unforced <= tol and same and routing.flips == 0 and routing.consistent
            else:
                worst, tol = routed, BF16_SANITY
                ok, note = routed <= tol and routing.consistent, note + f"; unforced {unforced:.3f}"
            label = f"model {name} {layout}{' fused' if decode == 'fused' else ''}"
            results.append(Result(label, dtype, worst, tol, bool(ok), note))
            print(f"row: {results[-1]}", flush=True)
    return results


def run_all(seed: int | None = None, part: str = "all") -> tuple[list[Result], dict]:
    from gpu_engine.cuda.device import require_gpu

    require_gpu()
    seed = fresh_seed(seed)
    results, info = (run_kernels(seed, part == "fused") if part in ("all", "kernels", "fused")
                     else ([], {"seed": seed}))
    mark = len(results)
    if part in ("all", "model", "fused"):
        try:
            results += run_model(seed, part == "fused")
        except Exception as exc:  # noqa: BLE001 - the kernel rows above still print
            import traceback

            traceback.print_exc()
            results.append(Result("model", "-", float("nan"), 0.0, False, f"{type(exc).__name__}: {exc}"[:200]))
    info["model_rows"] = len(results) - mark
    return results, info


def format_table(results: list[Result]) -> str:
    return result_table(results, width=52)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--part", choices=("all", "kernels", "model", "fused"), default="all")
    known, rest = parser.parse_known_args(argv)
    return check_main(__doc__.splitlines()[0], lambda seed: run_all(seed, known.part), format_table, rest)


if __name__ == "__main__":
    sys.exit(main())

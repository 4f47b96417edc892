"""check_moe's kernel checks and MoeLayer.forward on the CPU, over moe_emulation's numpy device: the host code, the
launch arguments and the checks themselves work end to end (the GPU run then only answers for the kernels). A
broken emulation of one step must fail its check (the checks can fail)."""
from __future__ import annotations

import numpy as np
import pytest

from tests.cuda_runner.check_moe import Checker
from tests.cuda_runner.moe_emulation import EmulatedContext


def _checker(seed: int | None = None) -> Checker:
    seed = int(np.random.default_rng().integers(1 << 30)) if seed is None else seed
    return Checker(EmulatedContext(seed=seed), np.random.default_rng(seed))


def _assert_all_pass(c: Checker) -> None:
    bad = [(r.name, r.rel_err, r.note) for r in c.results if not r.ok]
    assert c.results and not bad, bad


def test_route_and_plan_checks_pass_on_the_emulation() -> None:
    c = _checker()
    for n, e, k, stacked in ((1, 256, 8, False), (33, 6, 2, True), (7, 5, 3, False)):
        c.run("route", "f32", lambda n=n, e=e, k=k, st=stacked: c.route(n, e, k, st))
    for n, e, k, tile in ((1, 256, 8, "decode"), (300, 5, 3, "prefill"), (77, 6, 2, "decode")):
        c.run("plan", "f32", lambda n=n, e=e, k=k, tile=tile: c.plan(n, e, k, tile))
    for n, e, k, stacked in ((1, 256, 8, False), (7, 5, 3, True)):
        c.run("route_v2", "f32", lambda n=n, e=e, k=k, st=stacked: c.route(n, e, k, st, kernel="moe_route_v2"))
    for case in ((1, 9, 64, "bf16", False), (7, 4, 32, "bf16", True), (6, 3, 24, "f32", True)):
        c.run("combine_v2", case[3], lambda case=case: c.combine(*case))
    for n, e, k, tile, shared in ((1, 257, 9, "decode", True), (300, 5, 3, "prefill", False),
                                  (40, 9, 4, "decode", True)):
        c.run("plan_v2", "f32", lambda n=n, e=e, k=k, tile=tile, sh=shared: c.plan(n, e, k, tile, "moe_plan_v2", sh))
    _assert_all_pass(c)


@pytest.mark.parametrize("case", [("b1", 1, 8, 4, 64, 32, "bf16", "decode", "mma"),
                                  ("two tiles", 40, 3, 2, 32, 24, "bf16", "decode", "mma"),
                                  ("odd", 9, 6, 2, 16, 21, "bf16", "decode", "simple"),
                                  ("f32", 12, 6, 3, 24, 8, "f32", "prefill", "simple")])
def test_gemm_checks_pass_on_the_emulation(case) -> None:
    c = _checker()
    c.run("gemm", case[6], lambda: c.gemm(*case))
    _assert_all_pass(c)


@pytest.mark.parametrize("case", [(1, 16, 4, 64, 24, 16, "bf16"), (7, 6, 2, 32, 21, 37, "f32"),
                                  (40, 8, 3, 32, 16, 8, "bf16"), (9, 6, 2, 32, 24, 24, "f32"),
                                  (30, 8, 2, 32, 16, 16, "bf16")])
def test_layer_check_passes_on_the_emulation(case) -> None:
    c = _checker()
    c.run("layer", case[-1], lambda: c.layer(*case))
    _assert_all_pass(c)


def test_the_checks_fail_a_wrong_kernel() -> None:
    c = _checker()
    ctx = c.ctx
    real_route, real_combine = ctx._route, ctx._combine

    def lowest_ids_first(logits, ld, n, e, k, stride, ids, weights, gate):  # ties broken the wrong way
        real_route(logits, ld, n, e, k, stride, ids, weights, gate)
        z = ctx.read(logits, "f32", (n, e + 1), ld)[:, :e]
        chosen = np.argsort(-z[:, ::-1], axis=-1, kind="stable")[:, :k]
        ctx.write(ids, "i32", e - 1 - chosen)

    ctx._route = lowest_ids_first
    c.run("route", "f32", lambda: c.route(16, 8, 2))
    ctx._route = real_route
    ctx._combine = lambda t, out, *a: real_combine(t, out, *a[:-2], a[-2] - 1, a[-1])  # forgets the last token
    c.run("layer", "f32", lambda: c.layer(5, 6, 2, 32, 16, 8, "f32"))
    assert [r.ok for r in c.results] == [False, False]
    ctx._combine = real_combine
    real_routed = ctx._route

    def shared_weight_one(logits, ld, n, e, k, stride, ids, weights, gate):  # the stacked shared expert ungated
        real_routed(logits, ld, n, e, k, stride, ids, weights, gate)
        w = ctx.read(weights, "f32", (n, stride))
        w[:, k:] = 1.0
        ctx.write(weights, "f32", w)

    ctx._route = shared_weight_one
    c.run("layer", "f32", lambda: c.layer(5, 6, 2, 32, 16, 16, "f32"))
    assert not any(r.ok for r in c.results[2:])


@pytest.mark.parametrize("widths", [{}, {"moe_intermediate_size": 24, "shared_expert_intermediate_size": 24}])
@pytest.mark.parametrize("layout", ["fused", "per_expert"])
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_uploaded_layers_compute_the_reference_mlp(tmp_path, layout: str, dtype: str, widths: dict) -> None:
    """A tiny checkpoint through upload_text_weights into the emulated device: every layer's MoeLayer gives
    reference/moe.py's MoeMlp output (the router | shared-gate rows and the gate-then-up stacks wired right; with
    equal widths the shared expert rides in the stacks)."""
    from gpu_engine.config import ModelConfig
    from gpu_engine.cuda.bf16 import round_to_bf16
    from gpu_engine.cuda.weights import upload_text_weights
    from gpu_engine.loader import load_weights
    from gpu_engine.reference.moe import MoeMlp
    from gpu_engine.tiny_moe import make_tiny_moe_checkpoint
    from tests.cuda_runner.harness import rel_err

    seed = int(np.random.default_rng().integers(1000))
    folder = make_tiny_moe_checkpoint(tmp_path, seed=seed, layout=layout, text_config=widths)
    config = ModelConfig.from_pretrained(folder)
    weights, _ = load_weights(folder, config)
    ctx = EmulatedContext(seed=seed)
    tw = upload_text_weights(ctx, config.text, weights, dtype)
    rng = np.random.default_rng(seed)
    h, n = config.text.hidden_size, 9
    rnd = round_to_bf16 if dtype == "bf16" else (lambda a: a)
    for i, layer in enumerate(tw.layers):
        p = f"layers.{i}.mlp."
        mlp_w = {name[len(p):]: rnd(np.asarray(weights.text[name], np.float32)) for name in weights.text
                 if name.startswith(p)}
        x = rnd(rng.standard_normal((n, h)).astype(np.float32))
        y = ctx.empty((n, h), dtype, "y")
        ctx.poison(y)
        assert (layer.mlp.shared is None) == bool(widths)
        layer.mlp(ctx, y, ctx.to_device(x, dtype, "x"), n)
        assert rel_err(ctx.to_host(y), MoeMlp(config.text.moe, mlp_w)(x)) <= (1e-5 if dtype == "f32" else 1e-2)


def test_the_layer_bench_runs_end_to_end_on_the_emulation() -> None:
    """bench/moe_layer_bench.py's whole flow (ceilings, prefill with the grouped-GEMM breakdown, decode graphs with
    and without PDL) at a small shape: the one device call must not stop on a host-side error."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    import moe_layer_bench

    text = {"num_experts": 12, "num_experts_per_tok": 3, "hidden_size": 32, "moe_intermediate_size": 16,
            "shared_expert_intermediate_size": 16}
    r = moe_layer_bench.run(2, ctx=EmulatedContext(), text=text, tokens=40, gemm_shape=(64, 32, 32),
                            copy_elems=1 << 12, block_elems=1 << 12)
    assert r["prefill"]["gate_up"]["ms"] >= 0 and len(r["decode"]) == 4
    assert all(d["max_tiles_per_expert"] == 1 for d in r["decode"])
    assert "decode batch 32 pdl" in moe_layer_bench.table(r)
    assert [d["batch"] for d in r["decode_fused"]] == [1, 2, 4, 8]  # fused vs grouped (the shared expert stacked)
    assert set(r["decode_fused"][0]["fused_stages_us"]) == {"route", "gate_up", "down"}
    assert "decode batch 8 fused vs grouped" in moe_layer_bench.table(r)
    assert {"router_gemm", "route", "route_v2", "moe_plan", "moe_plan_v2", "gate_up", "down", "combine", "combine_v2",
            "gate_up[decode_bn32]"} <= set(r["decode"][-1]["stages_us"])

"""The fused small-batch MoE decode path (gpu_engine/cuda/moe_decode.py, kernels/moe.cu's moe_decode_* entries) on
the CPU: its option, the launches MoeLayer makes (names, grids, blocks, shared memory, the switch at MAX_ROWS), the
refusals, the numpy mirror of the kernels' arithmetic order against reference/moe.py and the grouped path, and
check_moe's fused rows on the emulated device (passing, and failing a broken kernel)."""
from __future__ import annotations

import re
from types import SimpleNamespace

import numpy as np
import pytest

from gpu_engine.config import MoeConfig
from gpu_engine.cuda.arena import Arena
from gpu_engine.cuda.bf16 import round_to_bf16
from gpu_engine.cuda.context import DArray
from gpu_engine.cuda.device import KERNEL_DIR
from gpu_engine.cuda.errors import ShapeError
from gpu_engine.cuda.linear import DenseLinear, SwigluMlp
from gpu_engine.cuda.moe import MoeLayer
from gpu_engine.cuda.moe_decode import MAX_ROWS, fused_forward, route_kernel
from gpu_engine.cuda.moe_weights import set_moe_decode
from gpu_engine.cuda.options import CudaOptions
from gpu_engine.reference.moe import MoeMlp
from tests.cuda_runner import moe_decode_emulation as emul
from tests.cuda_runner.check_moe import Checker
from tests.cuda_runner.harness import rel_err
from tests.cuda_runner.moe_emulation import EmulatedContext


class LaunchLog:
    """Distinct pointers from an arena; launches and cuBLASLt calls recorded."""

    def __init__(self) -> None:
        self.arena = Arena(base=1 << 30, capacity=64 << 30)
        self.calls: list[tuple] = []
        self.device = SimpleNamespace(launch=self._launch, info=SimpleNamespace(sm_count=132))
        self.blas = SimpleNamespace(linear=lambda *a, **k: self.calls.append(("blas.linear",)))

    def _launch(self, family: str, name: str, grid, block, *args, shmem: int = 0) -> None:
        self.calls.append((name, grid, block, shmem, args))

    def empty(self, shape: tuple[int, ...], dtype: str, name: str) -> DArray:
        arr = DArray(0, tuple(shape), dtype)
        return DArray(self.arena.alloc(arr.nbytes, name), arr.shape, dtype)


def _layer(ctx, e: int, k: int, h: int, inter: int, dtype: str = "bf16", decode: str = "fused",
           shared_width: int | None = None) -> MoeLayer:
    """shared_width None: the shared expert stacked as expert E; else apart, as linear layers of that width."""
    stacks = e + (shared_width is None)
    shared = None if shared_width is None else SwigluMlp(DenseLinear(ctx.empty((2 * shared_width, h), dtype, "sgu")),
                                                         DenseLinear(ctx.empty((h, shared_width), dtype, "sd")))
    return MoeLayer(e, k, ctx.empty((e + 1, h), dtype, "router"), ctx.empty((stacks, 2 * inter, h), dtype, "gu"),
                    ctx.empty((stacks, h, inter), dtype, "dn"), shared, decode=decode)


def test_the_option_is_typed_read_from_the_environment_and_validated() -> None:
    assert CudaOptions().moe_decode == "grouped"
    assert CudaOptions.from_env({"DOCPIPE_CUDA_MOE_DECODE": "fused"}).moe_decode == "fused"
    with pytest.raises(ShapeError, match="DOCPIPE_CUDA_MOE_DECODE must be one of"):
        CudaOptions(moe_decode="fast")


@pytest.mark.parametrize("m", [1, 2, 8])
def test_fused_calls_are_three_launches_sized_from_the_row_count(m: int) -> None:
    ctx = LaunchLog()
    e, k, h, inter = 256, 8, 2048, 512  # 35B-A3B
    layer = _layer(ctx, e, k, h, inter)
    x, y = ctx.empty((m, h), "bf16", "x"), ctx.empty((m, h), "bf16", "y")
    bufs = layer.forward(ctx, y, x, m)
    (route, r_grid, r_block, r_sh, r_args), (gu, g_grid, g_block, g_sh, g_args), (dn, d_grid, d_block, d_sh, d_args) = (
        ctx.calls)
    assert (route, gu, dn) == ("moe_decode_route_bf16_e256", "moe_decode_gate_up_bf16", "moe_decode_down_bf16")
    assert (r_grid, r_block, r_sh) == (33, 256, m * h * 2)  # 257 router rows, a warp each
    assert (g_grid, g_block, g_sh) == ((m * 9, 128), 128, h * 2)  # (entry, 4 features)
    assert (d_grid, d_block, d_sh) == ((m, 512), 128, 9 * inter * 2)  # (token, 4 columns)
    assert r_args[0] == x.ptr and int(r_args[1]) == m and r_args[3] == layer.router.ptr
    assert r_args[6] == bufs.logits.ptr and int(r_args[7]) == 264 and r_args[8] == bufs.ids.ptr
    assert g_args[2] == bufs.ids.ptr and g_args[5] == layer.gate_up.ptr and g_args[7] == bufs.act.ptr
    assert d_args[0] == bufs.act.ptr and d_args[5] == layer.down.ptr and d_args[-1] == y.ptr
    assert bufs.ids.shape == (m, 9) and bufs.act.shape == (m * 9, inter)


def test_above_the_row_limit_and_by_default_the_grouped_path_runs() -> None:
    ctx = LaunchLog()
    fused = _layer(ctx, 16, 4, 256, 96)
    x, y = ctx.empty((MAX_ROWS + 1, 256), "bf16", "x"), ctx.empty((MAX_ROWS + 1, 256), "bf16", "y")
    fused.forward(ctx, y, x, MAX_ROWS + 1)
    assert "moe_route" in [c[0] for c in ctx.calls] and not any("moe_decode" in c[0] for c in ctx.calls)
    ctx.calls.clear()
    _layer(ctx, 16, 4, 256, 96, decode="grouped").forward(ctx, y, x, 1)
    assert not any("moe_decode" in c[0] for c in ctx.calls)
    ctx.calls.clear()
    fused.forward(ctx, y, x, 1, decode="grouped")  # a call may name its path (the checks and the bench)
    assert not any("moe_decode" in c[0] for c in ctx.calls)
    assert route_kernel("f32", 300) == "moe_decode_route_f32_e1024"


def test_layers_the_fused_kernels_cannot_take_are_refused_by_name() -> None:
    ctx = LaunchLog()
    with pytest.raises(ShapeError, match="not stacked"):
        _layer(ctx, 6, 2, 64, 24, shared_width=40)
    with pytest.raises(ShapeError, match="multiples of 8"):
        _layer(ctx, 6, 2, 64, 21)
    with pytest.raises(ShapeError, match="top-k <= 31"):
        _layer(ctx, 64, 32, 64, 16)
    with pytest.raises(ShapeError, match="must be one of"):
        _layer(ctx, 6, 2, 64, 24, decode="fast")
    layer = _layer(ctx, 6, 2, 64, 24)
    x = ctx.empty((MAX_ROWS + 1, 64), "bf16", "x")
    with pytest.raises(ShapeError, match="rows"):
        fused_forward(ctx, layer, x, x, MAX_ROWS + 1)
    with pytest.raises(ShapeError, match="must be one of"):
        layer.forward(ctx, x, x, 1, decode="fast")
    _layer(ctx, 6, 2, 64, 24, shared_width=40, decode="grouped")  # grouped takes it


def test_set_moe_decode_gives_the_path_to_every_moe_layer_in_place() -> None:
    ctx = LaunchLog()
    layers = [SimpleNamespace(mlp=object()), _dataclass_layer(_layer(ctx, 6, 2, 64, 24, decode="grouped"))]
    set_moe_decode(layers, "fused")
    assert layers[1].mlp.decode == "fused" and not hasattr(layers[0].mlp, "decode")
    apart = [_dataclass_layer(_layer(ctx, 6, 2, 64, 24, decode="grouped", shared_width=40))]
    with pytest.raises(ShapeError, match="moe_decode='fused' cannot run this layer"):
        set_moe_decode(apart, "fused")


def _dataclass_layer(mlp: MoeLayer):
    from dataclasses import make_dataclass

    return make_dataclass("Layer", [("mlp", object)], frozen=True)(mlp)


def test_every_entry_the_host_names_is_in_moe_cu() -> None:
    names = set(re.findall(r"MOE_DECODE_\w+_ENTRY\((moe_decode_\w+)", (KERNEL_DIR / "moe.cu").read_text()))
    want = {route_kernel(t, e) for t in ("bf16", "f32") for e in (6, 1024)}
    want |= {f"moe_decode_{s}_{t}" for s in ("gate_up", "down") for t in ("bf16", "f32")}
    assert names == want


def _odd_layer(rng: np.random.Generator, e: int, k: int, h: int, inter: int, dtype: str) -> dict[str, np.ndarray]:
    rnd = round_to_bf16 if dtype == "bf16" else (lambda a: np.asarray(a, np.float32))

    def w(*shape: int, scale: float = 1.0) -> np.ndarray:
        return rnd(rng.standard_normal(shape).astype(np.float32) * scale * shape[-1] ** -0.5)

    return {"gate.weight": w(e, h, scale=4.0), "experts.gate_up_proj": w(e, 2 * inter, h),
            "experts.down_proj": w(e, h, inter), "shared_expert.gate_proj.weight": w(inter, h),
            "shared_expert.up_proj.weight": w(inter, h), "shared_expert.down_proj.weight": w(h, inter),
            "shared_expert_gate.weight": w(1, h)}


def _stacks(w: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    router = np.concatenate([w["gate.weight"], w["shared_expert_gate.weight"]])
    shared_gu = np.concatenate([w["shared_expert.gate_proj.weight"], w["shared_expert.up_proj.weight"]])
    return (router, np.concatenate([w["experts.gate_up_proj"], shared_gu[None]]),
            np.concatenate([w["experts.down_proj"], w["shared_expert.down_proj.weight"][None]]))


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("shape", [(6, 2, 96, 40), (9, 3, 136, 24), (40, 8, 520, 72)])
@pytest.mark.parametrize("m", [1, 3, 8])
def test_the_kernels_arithmetic_computes_the_reference_layer(m: int, shape: tuple[int, ...], dtype: str) -> None:
    """moe_decode_emulation (the kernels' order) against reference/moe.py's MoeMlp on the same rounded weights."""
    e, k, h, inter = shape
    rng = np.random.default_rng(m * 1000 + e)
    w = _odd_layer(rng, e, k, h, inter, dtype)
    x = (round_to_bf16 if dtype == "bf16" else np.asarray)(rng.standard_normal((m, h)).astype(np.float32))
    mlp = MoeMlp(MoeConfig(e, k, inter, inter), w)
    got = emul.fused_layer(x, *_stacks(w), k, dtype)
    ids, weights = mlp.route(x)
    assert np.array_equal(got.ids[:, :k], ids) and np.allclose(got.weights[:, :k], weights, rtol=1e-5)
    assert rel_err(got.y, mlp(x)) <= (1e-5 if dtype == "f32" else 1e-2)


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_fused_and_grouped_paths_agree_on_the_emulated_device(dtype: str) -> None:
    e, k, h, inter, m = 6, 2, 96, 40, 5
    rng = np.random.default_rng(7)
    ctx = EmulatedContext(seed=7)
    router, gu, dn = _stacks(_odd_layer(rng, e, k, h, inter, dtype))
    layer = MoeLayer(e, k, ctx.to_device(router, dtype, "r"), ctx.to_device(gu, dtype, "gu"),
                     ctx.to_device(dn, dtype, "dn"), None, decode="fused")
    x = ctx.to_device(rng.standard_normal((m, h)).astype(np.float32), dtype, "x")
    out = {}
    for decode in ("grouped", "fused"):
        y = ctx.empty((m, h), dtype, "y")
        ctx.poison(y)
        bufs = layer.forward(ctx, y, x, m, decode=decode)
        out[decode] = (ctx.to_host(y), ctx.to_host(bufs.ids))
    assert np.array_equal(out["grouped"][1], out["fused"][1])
    assert rel_err(out["fused"][0], out["grouped"][0]) <= (1e-5 if dtype == "f32" else 1e-2)
    assert ctx.launches[-3:] == [f"moe_decode_route_{dtype}_e256", f"moe_decode_gate_up_{dtype}",
                                 f"moe_decode_down_{dtype}"]


def test_check_moe_fused_rows_pass_on_the_emulation_and_fail_a_broken_kernel() -> None:
    c = Checker(EmulatedContext(seed=3), np.random.default_rng(3))
    c.run("fused", "bf16", lambda: c.fused(3, 6, 2, 96, 40, "bf16"))
    c.run("fused", "f32", lambda: c.fused(2, 9, 3, 64, 24, "f32"))
    c.run("layer", "f32", lambda: c.layer(4, 6, 2, 64, 24, 24, "f32", decode="fused"))
    bad = [(r.name, r.note) for r in c.results if not r.ok]
    assert c.results and not bad, bad
    ctx = c.ctx
    real_down = ctx._decode_down

    def down_without_shared(t, grid, act, ids, weights, k, *rest):  # forgets the shared expert's slot
        real_down(t, grid, act, ids, weights, k, *rest)
        m, h, y = grid[0], rest[-2], rest[-1]
        a = ctx.read(act, t, (m * (k + 1), rest[2]))
        w = ctx.read(weights, "f32", (m, k + 1))
        w[:, k] = 0.0
        ids_h = ctx.read(ids, "i32", (m, k + 1))
        stacks = ctx.read(rest[1], t, ((rest[0] + 1) * h, rest[2])).reshape(rest[0] + 1, h, rest[2])
        ctx.write(y, t, emul.down(a, ids_h, w, stacks, t))

    ctx._decode_down = down_without_shared
    c.results.clear()
    c.run("fused", "f32", lambda: c.fused(2, 9, 3, 64, 24, "f32"))
    c.run("layer", "f32", lambda: c.layer(4, 6, 2, 64, 24, 24, "f32", decode="fused"))
    failed = {r.name.split(" n")[0] for r in c.results if not r.ok}
    assert failed == {"moe_decode_down", "MoeLayer fused"}, failed

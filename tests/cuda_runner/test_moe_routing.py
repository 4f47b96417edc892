"""check_moe's routing-aware bf16 rule on the CPU (moe_routing.py): the reference forced to its own routing is the
reference, a forced flip moves the logits and is reported with its gap, a flip no router-logit error explains and
a trace that does not cover the run are caught; the device taps record the real rows of eager steps and of
captured-step replays over moe_emulation's numpy device."""
from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import pytest

from gpu_engine.config import ModelConfig
from gpu_engine.loader import load_weights
from gpu_engine.reference.runner import ReferenceRunner
from gpu_engine.tiny_moe import make_tiny_moe_checkpoint
from tests.cuda_runner.check_runner import _drive, _rounded
from tests.cuda_runner.moe_routing import CallTrace, CudaRoutingTrace, forced_routing

SEED = 11


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = make_tiny_moe_checkpoint(tmp_path_factory.mktemp("moe"), seed=SEED)
    config = ModelConfig.from_pretrained(folder)
    weights, _ = load_weights(folder, config)
    return config, _rounded(weights)


def _own_routing(config, weights) -> tuple[list[np.ndarray], list[list[CallTrace]]]:
    """The plain reference's logits per step and its own routing, recorded call by call like a device trace."""
    runner = ReferenceRunner(config, weights)
    mlps = runner.text.mlps
    calls: list[list[CallTrace]] = [[] for _ in mlps]
    for i, mlp in enumerate(mlps):
        def route(x, i=i, mlp=mlp, original=mlp.route):
            ids, w = original(x)
            z = (x.astype(np.float64) @ mlp.router.astype(np.float64).T).astype(np.float32)
            calls[i].append(CallTrace(ids.copy(), z))
            return ids, w
        mlp.route = route
    steps, _ = _drive(runner, config, SEED)
    return steps, calls


def test_forced_to_its_own_routing_the_reference_is_unchanged(model) -> None:
    config, weights = model
    steps, calls = _own_routing(config, weights)
    runner = ReferenceRunner(config, weights)
    with forced_routing(runner, calls) as report:
        forced, _ = _drive(runner, config, SEED)
    assert report.flips == 0 and report.choices > 100 and report.left_over == 0 and report.consistent
    assert report.logits_rel_err < 1e-5
    assert max(float(np.max(np.abs(a - b))) for a, b in zip(forced, steps)) < 1e-4
    assert all("route" not in vars(mlp) for mlp in runner.text.mlps)  # the class's route again


def _flip_nearest_tie(calls: list[list[CallTrace]], honest: bool) -> None:
    """Swap, in the first call of layer 0, the token with the smallest k-th / (k+1)-th logit gap onto its
    (k+1)-th expert; honest: the device's logits have those two nudged across each other (as bf16 noise would)."""
    c = calls[0][0]
    order = np.argsort(-c.logits, axis=-1, kind="stable")
    k = c.ids.shape[1]
    gaps = np.take_along_axis(c.logits, order[:, k - 1:k], -1) - np.take_along_axis(c.logits, order[:, k:k + 1], -1)
    r = int(np.argmin(gaps[:, 0]))
    a, b = int(order[r, k - 1]), int(order[r, k])
    c.ids[r][c.ids[r] == a] = b
    if honest:
        mid = (c.logits[r, a] + c.logits[r, b]) / 2
        c.logits[r, a], c.logits[r, b] = mid - 1e-3, mid + 1e-3


def test_a_forced_flip_moves_the_logits_and_is_reported(model) -> None:
    config, weights = model
    steps, calls = _own_routing(config, weights)
    _flip_nearest_tie(calls, honest=True)
    runner = ReferenceRunner(config, weights)
    with forced_routing(runner, calls) as report:
        forced, _ = _drive(runner, config, SEED)
    # the flipped token's later layers see another hidden state: their recorded choices may differ from the
    # reference's now, each explained by the (recorded vs now) logit difference
    assert report.per_layer_flips[0] == 1 and report.consistent
    assert 0 < report.worst_gap_ratio <= 2
    assert max(float(np.max(np.abs(a - b))) for a, b in zip(forced, steps)) > 1e-3  # the routing was taken


def test_a_flip_no_logit_error_explains_fails(model) -> None:
    config, weights = model
    _, calls = _own_routing(config, weights)
    _flip_nearest_tie(calls, honest=False)  # the device's logits rank a above b, yet it took b
    runner = ReferenceRunner(config, weights)
    with forced_routing(runner, calls) as report:
        _drive(runner, config, SEED)
    assert report.per_layer_flips[0] >= 1 and report.worst_gap_ratio > 100 and not report.consistent


def test_a_trace_that_does_not_cover_the_run_is_caught(model) -> None:
    config, weights = model
    _, calls = _own_routing(config, weights)
    short = [layer[:-1] for layer in calls]
    runner = ReferenceRunner(config, weights)
    with pytest.raises(ValueError, match="ran out"), forced_routing(runner, short):
        _drive(runner, config, SEED)
    longer = [layer + layer[-1:] for layer in calls]
    runner = ReferenceRunner(config, weights)
    with forced_routing(runner, longer) as report:
        _drive(runner, config, SEED)
    assert report.left_over == sum(layer[-1].ids.shape[0] for layer in calls) and not report.consistent


@dataclass
class _Chunk:
    num_tokens: int


class _FakeRunner:
    """The CudaRunner surface the trace wraps, over the emulated device: each step runs every layer's MLP on its
    rows plus `pad` padding rows (as a padded decode graph does)."""

    def __init__(self, ctx, tw, pad: int) -> None:
        self.ctx, self.model, self.pad = ctx, SimpleNamespace(w=tw), pad
        self.rng = np.random.default_rng(0)
        self.inputs: list[np.ndarray] = []

    def allocate_cache(self, spec) -> None:
        pass

    def _run(self, batch) -> None:
        m = sum(c.num_tokens for c in batch.chunks) + self.pad
        h = self.model.w.layers[0].mlp.layer.hidden
        x = self.rng.standard_normal((m, h)).astype(np.float32)
        self.inputs.append(x)
        for layer in self.model.w.layers:
            layer.mlp(self.ctx, self.ctx.empty((m, h), "f32", "y"), self.ctx.to_device(x, "f32", "x"), m)

    def forward(self, batch):
        self._run(batch)

    def capture_step(self, batch, table_width: int):
        runner = self
        step = SimpleNamespace(batch=batch)
        step.update = lambda b: setattr(step, "batch", b)
        step.replay = lambda: runner._run(step.batch)
        return step


def test_the_taps_record_the_real_rows_of_eager_and_replayed_steps(tmp_path) -> None:
    from gpu_engine.cuda.weights import upload_text_weights
    from gpu_engine.reference.moe import MoeMlp
    from tests.cuda_runner.moe_emulation import EmulatedContext

    folder = make_tiny_moe_checkpoint(tmp_path, seed=SEED)
    config = ModelConfig.from_pretrained(folder)
    weights, _ = load_weights(folder, config)
    ctx = EmulatedContext(seed=SEED)
    runner = _FakeRunner(ctx, upload_text_weights(ctx, config.text, weights, "f32"), pad=3)
    trace = CudaRoutingTrace(runner)
    runner.allocate_cache(None)
    runner.forward(SimpleNamespace(chunks=[_Chunk(5), _Chunk(2)]))
    step = runner.capture_step(SimpleNamespace(chunks=[_Chunk(1), _Chunk(1)]), 8)
    step.replay()
    step.update(SimpleNamespace(chunks=[_Chunk(1)]))
    step.replay()
    assert [len(c) for c in trace.calls] == [3] * len(config.text.layer_types)
    assert [c.ids.shape[0] for c in trace.calls[0]] == [7, 2, 1]
    for i, calls in enumerate(trace.calls):
        p = f"layers.{i}.mlp."
        mlp = MoeMlp(config.text.moe, {n[len(p):]: np.asarray(w, np.float32) for n, w in weights.text.items()
                                       if n.startswith(p)})
        for call, x in zip(calls, runner.inputs):
            want, _ = mlp.route(x[:call.ids.shape[0]])
            assert np.array_equal(np.sort(call.ids, -1), np.sort(want, -1))
            assert np.allclose(call.logits, x[:call.ids.shape[0]] @ mlp.router.T, atol=1e-4)

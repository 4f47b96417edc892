"""check_moe's routing-aware bf16 model rows: compare the CUDA runner's arithmetic with the reference on one routing.

A mixture of experts is discontinuous in its input: when a token's k-th and (k+1)-th router logits are closer than
the bf16 noise of the hidden state, the bf16 CUDA runner may pick the other expert, and that token's whole MLP output
moves (tiny random MoE models: 0.02-0.3 logits rel. err. from such flips alone, bench/results/cuda_notes.md #17).
So the bf16 rows are judged in two parts:
- `CudaRoutingTrace` records, per MoE layer and call, the expert ids and f32 router logits the device used: a tap in
  place of each layer's MoeLayer copies them into buffers of its own in stream order, so decode steps replayed from
  CUDA graphs (the runner's own and capture_step's) record too;
- `forced_routing` makes a ReferenceRunner take those ids (its weights are still its own renormalised
  probabilities), so the logits differ by rounding only and meet the dense models' bf16 bound; each choice the
  reference would have made differently is a flip, reported with the reference's logit gap across it, which a
  faithful device can only have crossed by its own router-logit error: gap <= 2 x that row's largest logit error.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from gpu_engine.reference.ops import linear, softmax

TRACE_ROWS = 512  # rows one MoE call may have in the check's scenario (padded decode graphs included)


@dataclass(frozen=True)
class CallTrace:
    ids: np.ndarray  # int [n, k]: the routed experts (the stacked shared entry dropped)
    logits: np.ndarray  # f32 [n, E]: the router logits they were chosen from


class _Tap:
    """layer.mlp of a traced runner: the MoeLayer, then its ids and logits rows copied into the trace buffers."""

    def __init__(self, layer: Any) -> None:
        self.layer = layer
        self.ids: Any = None
        self.logits: Any = None

    def allocate(self, ctx: Any) -> None:
        e = self.layer.num_experts
        self.ids = ctx.empty((TRACE_ROWS, self.layer.slots), "i32", "trace.ids")
        self.logits = ctx.empty((TRACE_ROWS, -(-(e + 1) // 8) * 8), "f32", "trace.logits")

    def __call__(self, ctx: Any, y: Any, x: Any, m: int) -> None:
        if self.ids is None or m > TRACE_ROWS:
            raise ValueError(f"routing trace: {m} rows (buffers of {TRACE_ROWS}; allocate_cache allocates them)")
        bufs = self.layer.forward(ctx, y, x, m)
        ctx.device.copy(self.ids.ptr, bufs.ids.ptr, bufs.ids.nbytes)
        ctx.device.copy(self.logits.ptr, bufs.logits.ptr, bufs.logits.nbytes)

    def read(self, ctx: Any, n: int) -> CallTrace:
        """The first n rows of the last call (a padded step's real rows come first)."""
        e, k = self.layer.num_experts, self.layer.top_k
        ids = ctx.to_host(self.ids.view((n, self.ids.shape[1])))[:, :k]
        return CallTrace(ids.astype(np.int64), ctx.to_host(self.logits.view((n, self.logits.shape[1])))[:, :e])


class CudaRoutingTrace:
    """Installs taps on a CudaRunner's MoE layers; `calls[l]` lists layer l's CallTraces, one per step run.

    The runner's allocate_cache, forward and capture_step are wrapped on the instance: the trace buffers are taken
    right after the cache (allocate_cache releases everything above the weights), and every forward or replay of
    a captured step appends the step's real rows."""

    def __init__(self, runner: Any) -> None:
        from gpu_engine.cuda.moe import MoeLayer

        self.runner, layers = runner, runner.model.w.layers
        self.taps: list[_Tap] = []
        for i, layer in enumerate(layers):
            if isinstance(layer.mlp, MoeLayer):
                tap = _Tap(layer.mlp)
                layers[i] = replace(layer, mlp=tap)
                self.taps.append(tap)
        self.calls: list[list[CallTrace]] = [[] for _ in self.taps]
        allocate, forward, capture = runner.allocate_cache, runner.forward, runner.capture_step

        def allocate_cache(spec: Any) -> None:
            allocate(spec)
            for tap in self.taps:
                tap.allocate(runner.ctx)

        def traced_forward(batch: Any) -> Any:
            out = forward(batch)
            self._record(batch)
            return out

        def capture_step(batch: Any, table_width: int) -> Any:
            step = capture(batch, table_width)
            update, replay = step.update, step.replay
            current = [batch]

            def traced_update(next_batch: Any) -> None:
                update(next_batch)
                current[0] = next_batch

            def traced_replay() -> None:
                replay()
                self._record(current[0])

            step.update, step.replay = traced_update, traced_replay
            return step

        runner.allocate_cache, runner.forward, runner.capture_step = allocate_cache, traced_forward, capture_step

    def _record(self, batch: Any) -> None:
        n = sum(c.num_tokens for c in batch.chunks)
        self.runner.ctx.device.sync()
        for calls, tap in zip(self.calls, self.taps):
            calls.append(tap.read(self.runner.ctx, n))


@dataclass
class RoutingReport:
    """What forced_routing saw: token choices made, how many the reference would have made otherwise, the largest
    reference logit gap across a flip in units of that row's device logit error (<= 2 for a faithful device), the
    router logits' rel. err., and the rows left unconsumed (0 when both runners ran the same rows)."""

    choices: int = 0
    flips: int = 0
    worst_gap_ratio: float = 0.0
    left_over: int = 0
    _err2: float = 0.0
    _ref2: float = 0.0
    per_layer_flips: list[int] = field(default_factory=list)

    @property
    def logits_rel_err(self) -> float:
        return float(np.sqrt(self._err2 / self._ref2)) if self._ref2 else 0.0

    @property
    def flip_share(self) -> float:
        return self.flips / self.choices if self.choices else 0.0

    @property
    def consistent(self) -> bool:
        return self.left_over == 0 and self.worst_gap_ratio <= 2.0 + 1e-3

    def note(self) -> str:
        return (f"routing forced to the device's: {self.flips}/{self.choices} token choices flipped "
                f"({self.flip_share:.3f}), worst gap {self.worst_gap_ratio:.2f} x the row's router-logit error, "
                f"router logits rel. err. {self.logits_rel_err:.1e}" + (f", {self.left_over} rows left over"
                                                                       if self.left_over else ""))


def _gap_ratio(z: np.ndarray, z_dev: np.ndarray, own: np.ndarray, forced: np.ndarray) -> float:
    """max over (a the reference chose, b the device chose instead) of z[a] - z[b], over the row's largest
    |z_dev - z|: the device ranked b above a, so a faithful one has z[a] - z[b] <= |dz_a| + |dz_b|."""
    a, b = np.setdiff1d(own, forced), np.setdiff1d(forced, own)
    gap = float(z[a].max() - z[b].min())
    noise = float(np.max(np.abs(z_dev.astype(np.float64) - z)))
    return gap / noise if noise > 0 else float("inf")


@contextmanager
def forced_routing(runner: Any, calls: list[list[CallTrace]]) -> Iterator[RoutingReport]:
    """A ReferenceRunner whose MoE layers route each token as the traced device did (rows consumed in order: the
    reference runs a step's chunks one after the other, the device all their rows at once, in the same order)."""
    mlps = [m for m in runner.text.mlps if hasattr(m, "route")]
    if len(mlps) != len(calls):
        raise ValueError(f"{len(calls)} traced MoE layers for a reference with {len(mlps)}")
    report = RoutingReport(per_layer_flips=[0] * len(mlps))
    queues = [(np.concatenate([c.ids for c in layer]), np.concatenate([c.logits for c in layer])) if layer else
              (np.zeros((0, 1), np.int64), np.zeros((0, 1), np.float32)) for layer in calls]
    used = [0] * len(mlps)

    def forced(index: int, mlp: Any) -> Any:
        def route(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            n, start = x.shape[0], used[index]
            ids, z_dev = queues[index][0][start:start + n], queues[index][1][start:start + n]
            if ids.shape[0] != n:
                raise ValueError(f"MoE layer {index}: the device trace ran out at row {start} ({n} wanted)")
            used[index] += n
            z = linear(x, mlp.router).astype(np.float64)
            probs = softmax(z, axis=-1)
            own = np.argsort(-probs, axis=-1, kind="stable")[:, : mlp.top_k]
            report.choices += n
            report._err2 += float(np.sum((z_dev - z) ** 2))
            report._ref2 += float(np.sum(z ** 2))
            for r in range(n):
                if set(own[r].tolist()) != set(ids[r].tolist()):
                    report.flips += 1
                    report.per_layer_flips[index] += 1
                    report.worst_gap_ratio = max(report.worst_gap_ratio, _gap_ratio(z[r], z_dev[r], own[r], ids[r]))
            top = np.take_along_axis(probs, ids, axis=-1)
            return ids, (top / top.sum(axis=-1, keepdims=True)).astype(np.float32)

        return route

    try:
        for i, mlp in enumerate(mlps):
            mlp.route = forced(i, mlp)
        yield report
    finally:
        for mlp in mlps:
            del mlp.route  # the class's method again
        report.left_over = sum(q[0].shape[0] - u for q, u in zip(queues, used))

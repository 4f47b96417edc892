"""CudaRunner's launched steps: runner_api's `launch` / `finish` (gpu_engine/lookahead.py says why the engine wants
them). A launched step's logits stay on the GPU; it is sampled when the engine has its SamplingRequest, which is
when the next step is launched:

    launch(N+1, previous=request of N, feed):  build N+1's tables (host; the GPU still computes N)
                                                sample N (upload its masks, one sampler launch, tokens back)
                                                put N's tokens into N+1's fed rows, enqueue N+1's forward
    finish(request of N):                       sample N, nothing left launched

So the GPU waits only for the sampler's few uploads and downloads between two forwards, and the host's work on
N's tokens runs while N+1's layers do. The sampler's buffers (bitmasks, parameter table, results) are the
runner's own, next to the cache (allocate_cache): a launched step's logits may sit in arena memory that the next
step's buffers reuse, and nothing may be written there before the sampler has read them. For the same reason a
launched eager step keeps its arena until it is sampled, and a decode graph for a new shape is captured only then
(its buffers would cover the logits). Graphs replayed by launch() compute no sampler (GraphKey.sampling False).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import numpy as np

from ..errors import RunnerInputError
from ..runner_api import MAX_SAMPLED_TOP_LOGPROBS, CacheSpec, SamplingRequest, StepBatch
from ..runner_rules import allocated
from ..sampling import SampleResult
from .captured_step import first_rows, graphable
from .context import DArray, GpuContext
from .decode_graphs import TOKEN_BUCKETS, GraphKey, graph_shape, table_width_bucket
from .sampler import PARAMS_PER_ROW, SamplerBuffers, pack_params
from .step import HostStep, upload_tables

if TYPE_CHECKING:
    from .runner import CudaRunner
    from .verify import StepPlan


@dataclass
class LaunchSampler:
    """The sampler's own buffers for launched steps: `rows` rows (one per state slot: no step has more)."""

    bufs: SamplerBuffers
    params: DArray  # f32 [rows, PARAMS_PER_ROW]
    rows: int

    @classmethod
    def allocate(cls, ctx: GpuContext, rows: int, words: int) -> LaunchSampler:
        k = MAX_SAMPLED_TOP_LOGPROBS
        bufs = SamplerBuffers(masks=ctx.empty((rows, words), "u32", "launch-masks"),
                              tokens=ctx.empty((rows,), "i32", "launch-tokens"),
                              logprobs=ctx.empty((rows,), "f32", "launch-logprobs"),
                              top_ids=ctx.empty((rows, k), "i32", "launch-top-ids"),
                              top_logprobs=ctx.empty((rows, k), "f32", "launch-top-logprobs"))
        return cls(bufs, ctx.empty((rows, PARAMS_PER_ROW), "f32", "launch-params"), rows)

    @staticmethod
    def nbytes(rows: int, words: int) -> int:
        return rows * (words * 4 + 4 + 4 + MAX_SAMPLED_TOP_LOGPROBS * 8 + PARAMS_PER_ROW * 4)


@dataclass
class Launched:
    """The step launched last: its logits rows on the device, and what waits for its sampling."""

    logits: DArray  # f32 [rows, vocab]
    rows: int
    mark: int | None = None  # arena mark of an eager step's buffers, released once sampled
    capture: tuple[HostStep, StepBatch, int, GraphKey] | None = None  # a graph to capture once sampled


def as_runner(mixin: LaunchSteps) -> CudaRunner:
    """LaunchSteps is only ever mixed into CudaRunner: its methods use the runner's parts."""
    return cast("CudaRunner", mixin)


class LaunchSteps:
    """Mixed into CudaRunner: launch() and finish() (runner_api: supports_lookahead)."""

    supports_lookahead = True
    _launched: Launched | None = None
    launch_sampler: LaunchSampler | None = None  # allocate_cache

    def launch(self, batch: StepBatch, previous: SamplingRequest | None,
               feed: np.ndarray | None) -> SampleResult | None:
        r = as_runner(self)
        if (previous is None) != (r._launched is None):
            raise RunnerInputError("launch: `previous` is the request of the launched step, and only then given")
        if feed is not None and (previous is None or len(feed) != len(batch.chunks)):
            raise RunnerInputError("launch: feed needs a previous step and one entry per chunk")
        if any(c.verify or c.keep_hidden or c.logits == "all" for c in batch.chunks):
            raise RunnerInputError("launch: verify windows, kept hidden rows and all-row logits are not launched")
        plan = r._book().plan(batch) if batch.chunks else None
        run = plan.batch if plan is not None else batch
        host, key = r._launch_tables(run, plan)  # the GPU is still on the step before
        sampled = r.finish(previous) if previous is not None else None
        if feed is not None and sampled is not None:
            fed = np.nonzero(np.asarray(feed) >= 0)[0]
            last_token = host.tables.cu[fed + 1] - 1  # a fed chunk's token is its last (re-fed tokens go first)
            host.tables.ids[last_token] = sampled.token_ids[np.asarray(feed)[fed]].astype(np.int32)
        r._copy_states(plan)
        r._launched = r._enqueue(run, host, key)
        if plan is not None:
            r._book().commit(plan)
        return sampled

    def finish(self, request: SamplingRequest) -> SampleResult:
        r = as_runner(self)
        launched, r._launched = r._launched, None
        if launched is None:
            raise RunnerInputError("finish: no launched step")
        try:
            sampled = r._sample_launched(launched, request)
        finally:
            if launched.mark is not None:
                r.ctx.device.sync()
                r.ctx.arena.release(launched.mark)
        if launched.capture is not None:  # the logits are read: the new graph's buffers may cover them now
            host, batch, width, key = launched.capture
            step = r._capture(host, batch, width, key)
            if step is not None:
                r._graphs[key] = step
                r.decode_counts.captures += 1
        return sampled

    # ---- the parts --------------------------------------------------------------------------------------------
    def _launch_sampler_bytes(self, spec: CacheSpec) -> int:
        r = as_runner(self)
        return LaunchSampler.nbytes(spec.num_state_slots + 1, r.sampler.words)

    def _allocate_launch_sampler(self, spec: CacheSpec) -> None:
        """allocate_cache: the launch sampler next to the cache (a step has at most one row per state slot)."""
        r = as_runner(self)
        r.launch_sampler = LaunchSampler.allocate(r.ctx, spec.num_state_slots + 1, r.sampler.words)
        r._launched = None

    def _launch_tables(self, run: StepBatch, plan: StepPlan | None) -> tuple[HostStep, GraphKey | None]:
        """The step's host tables, padded to a graph's shape when it can replay one (key), else eager (None)."""
        r = as_runner(self)
        if r.use_graphs and graphable(run):
            lens = [c.num_tokens for c in run.chunks]
            shape: tuple[int, int] | None = (len(lens), sum(lens))  # without scratch rows: exact shapes
            if r.scratch is not None:
                shape = graph_shape(lens, r.buckets, allocated(r.spec).block_size, TOKEN_BUCKETS)
            if shape is not None:
                rows, tokens = shape
                width = table_width_bucket(max(len(c.block_table) for c in run.chunks))
                return r._graph_host(run, width, rows, tokens, plan), GraphKey(rows, tokens, width, False)
        return r._prepare(run, None, plan), None

    def _enqueue(self, run: StepBatch, host: HostStep, key: GraphKey | None) -> Launched:
        r = as_runner(self)
        counts = r.decode_counts
        step = r._graphs.get(key) if key is not None else None
        if step is not None:
            step.load(host, run)
            step.replay()
            counts.graphed += 1
            counts.padded += host.padding > 0
            counts.with_runs += max(c.num_tokens for c in run.chunks) > 1
            return Launched(first_rows(step.bufs.logits, host.batch_logit_rows), host.batch_logit_rows)
        if key is not None:
            counts.eager_graphable += 1
        else:
            counts.other += 1
        ctx = r.ctx
        mark = ctx.arena.mark()
        try:
            bufs = r._step_buffers(host)
            r._run(host, upload_tables(ctx, host.tables), bufs)
        except Exception:
            ctx.device.sync()
            ctx.arena.release(mark)
            raise
        from . import runner as runner_module  # its MAX_GRAPHS (tests lower it there)

        capture = None
        if key is not None and key not in r._no_graph and len(r._graphs) < runner_module.MAX_GRAPHS:
            capture = (host, run, key.width, key)
        return Launched(first_rows(bufs.logits, host.batch_logit_rows), host.batch_logit_rows, mark, capture)

    def _sample_launched(self, launched: Launched, request: SamplingRequest) -> SampleResult:
        r = as_runner(self)
        rows = request.num_rows
        if rows != launched.rows:
            raise RunnerInputError(f"finish: the request has {rows} rows, the launched step {launched.rows}")
        if problem := request.problem(rows, r.cfg.vocab_size):
            raise RunnerInputError(problem)
        ls = r.launch_sampler
        if ls is None or rows > ls.rows:
            raise RunnerInputError(f"finish: {rows} rows, the launch sampler holds {ls.rows if ls else 0}")
        if rows == 0:
            return SampleResult(np.zeros(0, np.int64), np.zeros(0, np.float32), [])
        dev = r.ctx.device
        dev.upload(ls.params.ptr, pack_params(request))
        r.sampler.upload_masks(ls.bufs, request)
        r.sampler.enqueue(ls.bufs, launched.logits, ls.params, rows)
        return r.sampler.results(ls.bufs, request)


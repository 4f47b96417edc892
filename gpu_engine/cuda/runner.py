"""CudaRunner: the runner contract (gpu_engine/runner_api.py) for the Qwen3.5 text decoder on one NVIDIA GPU.
The decoder itself is text_model.py; this file owns memory, the cache, step buffers, graphs and sampling.

Memory: one cuMemAlloc of `options.memory_budget` bytes at start-up; weights first, then the cache
(allocate_cache, cache_layers.py), and per-step activations from what is left (released at the end of every step).
Step: all sequences of the batch run together (varlen): the host-side tables (step.py) are packed into one int32
array and uploaded once; logits come back as float32 for the requested rows only. Decode steps, short forced runs
and verify windows replay CUDA graphs (captured_step.py) per (batch-size bucket, token bucket, table width bucket)
unless options.use_graphs is off: padding rows write only the runner's scratch block and slot; graphs own no
memory (decode_graphs.py says why that is safe).
Vision: encode_vision (encode_vision_batch: same-grid items in one call, vision_batch.py) runs the tower (vision.py)
into the encoder-cache region (options.encoder_memory bytes): DeviceEmbeddings, or host float32 when it is full.
Sampling: a step whose batch carries a SamplingRequest is sampled on the GPU after the LM head (sampler.py); only
token ids and logprobs come back; its parameter table travels in the packed tables, so graphs replay it too.
Launched steps (launch / finish, launch.py) keep their logits on the GPU until the engine's request comes.
Speculative decoding: verify windows (SeqChunk.verify) run on the decode kernels with logits at every token;
rollback_state returns a slot's DeltaNet state to the last accepted token (verify.py: the book, verify_ops.py: the
copies). MTP head (a complete BF16/F32 `mtp.*`, mtp.py): forward keeps the rows of keep_hidden chunks, mtp_draft
chains greedy drafts on the GPU; `auto` uses it only with CudaOptions.mtp_in_auto (opt-in until checked on a GPU).
"""
from __future__ import annotations

import numpy as np

from ..config import ModelConfig
from ..errors import RunnerInputError
from ..inputs import VisionItem
from ..loader import ModelWeights
from ..runner_api import CacheSpec, MtpDraftRequest, StepBatch, StepOutput
from ..runner_rules import allocated, check_cache_spec, check_state_slots, row_offsets, state_bytes_per_slot
from . import flash_plan, ops
from .cache_layers import allocate_layers, copy_slot_states
from .captured_step import CapturedStep, StepBuffers, first_rows, graphable
from .context import ITEMSIZE, DArray, GpuContext
from .decode_graphs import (
    GRAPH_MAX_CHUNK,
    TOKEN_BUCKETS,
    VERIFY_TOKEN_BUCKETS,
    DecodeCounts,
    GraphKey,
    ScratchRows,
    bucket_sizes,
    graph_shape,
    table_width_bucket,
)
from .embeddings import BlockPool, DeviceEmbeddings
from .kv_fp8 import kv_bytes_per_block as attention_kv_bytes_per_block
from .launch import LaunchSteps
from .memory_plan import (
    CacheBudget,
    default_cache_budget,
    default_memory_budget,
    step_reserve_bytes,
    vision_reserve_bytes,
)
from .mtp import (
    CudaMtpHead,
    KeptRows,
    MtpCache,
    allocate_mtp_cache,
    build_mtp_head,
    draft_in_rounds,
    mtp_cache_bytes,
    mtp_kv_bytes_per_block,
)
from .options import CudaOptions, encoder_region_bytes
from .sampler import DeviceSampler
from .step import HostStep, StepTables, build_step, fill_logit_rows, pad_step, upload_tables
from .text_model import Activations, CudaTextModel, DeviceCache
from .verify import StepPlan, Strategy, VerifyBook
from .verify_ops import VerifyRows, allocate_verify_rows, copy_segments, copy_table
from .vision import GpuVisionTower
from .vision_batch import VisionBatch
from .weights import upload_text_weights

MAX_GRAPHS = 128  # captured decode graphs kept (each holds a driver-side executable); past it new keys run eagerly
# Verify windows a step can roll back by default: the cost rule (128 step tokens, k = 3) lets <= 42 `auto` sequences
# draft; 27B-class recompute rows are 151 MB each (7.2 GB for 48).
DEFAULT_VERIFY_ROWS = 48


class CudaRunner(LaunchSteps, VisionBatch):
    name = "cuda"
    samples_on_device = True  # runner_api.SamplingRequest is honoured (sampler.py)
    # Longer jump-forward runs are spread over steps (gpu_engine/forced_runs.py), so that no forced run sends a
    # decode step onto the prefill kernels (GRAPH_MAX_CHUNK < text_model.FLASH_MIN_CHUNK). A run's last piece can
    # replay a graph; the pieces before it want no logits, so _graphable leaves those steps eager.
    max_decode_chunk_tokens = GRAPH_MAX_CHUNK
    # Speculative decoding (runner_api: SeqChunk.verify, rollback_state; cuda/verify.py; CudaOptions.rollback).
    # verify_rows: windows a step may hold rollback state for (None: DEFAULT_VERIFY_ROWS, at most the state slots),
    # kept out of the default cache budget, cut by allocate_cache to verify_memory_fraction of what the cache leaves.
    supports_verify = True
    spec_max_step_tokens = 32  # auto's cost rule (27B, H200: a k=3 verify step 1.19x decode at b8, 3.03x at b32)
    book: VerifyBook | None = None  # the verify windows' book (allocate_cache)
    verify_rows: int | None = None
    verify_memory_fraction = 0.5
    mtp: CudaMtpHead | None = None  # the checkpoint's MTP head (runner_api: mtp_head, mtp_draft; mtp.py)
    mtp_head = False
    mtp_in_auto = False  # CudaOptions.mtp_in_auto: `auto` requests draft with the head too
    flash_tile_rows = flash_plan.FLASH_TILE  # the steps' flash-prefill tiles: CudaTextModel.flash_tile_rows
    deltanet_split = False  # the steps carry the DeltaNet split tables (CudaOptions.deltanet_rows_apart)
    _keeping: StepBatch | None = None  # the step whose keep_hidden rows are being kept

    def __init__(self, model_config: ModelConfig, weights: ModelWeights, options: CudaOptions | None = None) -> None:
        o = self.options = options or CudaOptions()
        self.config = model_config
        self.cfg = model_config.text
        self.dtype = o.dtype
        budget = o.memory_budget or default_memory_budget(o.device_id, o.memory_fraction)
        self.ctx = GpuContext(budget, o.device_id, o.module_cache)
        # Programmatic dependent launch between our kernels needs sm_90 or newer.
        self.ctx.device.pdl = o.use_pdl and int(self.ctx.device.info.arch.removeprefix("sm_")) >= 90
        self.model = CudaTextModel(self.ctx, self.cfg, upload_text_weights(self.ctx, self.cfg, weights, o.dtype),
                                   o.dtype)
        self.model.use_options(o, self.ctx.device.info.arch)
        self.flash_tile_rows = self.model.flash_tile_rows
        self.deltanet_split = self.model.deltanet_rows_apart
        # The MTP head, if the checkpoint has one this runner computes (else mtp_problem: why); KV: allocate_cache
        self.mtp, self.mtp_problem = build_mtp_head(self.ctx, self.cfg, weights, self.model, o.dtype)
        self.mtp_head = self.mtp is not None
        self.mtp_in_auto = self.mtp_head and o.mtp_in_auto
        self.mtp_cache: MtpCache | None = None
        self.kept = KeptRows()
        cfg = self.cfg
        # The vision tower and its encoder-cache region come before the cache mark: they outlive cache changes.
        # A checkpoint whose tower cannot feed its decoder still runs text; encode_vision then says why.
        self.vision: GpuVisionTower | None = None
        self._encoded: BlockPool | None = None
        self._no_vision = "this runner was built without vision weights, so it cannot encode images"
        if weights.vision and model_config.vision.out_hidden_size != cfg.hidden_size:
            self._no_vision = (f"the vision tower's out_hidden_size {model_config.vision.out_hidden_size} differs from "
                               f"the text hidden_size {cfg.hidden_size}: this checkpoint cannot encode images")
        elif weights.vision:
            self.vision = GpuVisionTower(self.ctx, model_config.vision, weights.vision, o.dtype,
                                         flash_variant=o.vision_flash)
            region = encoder_region_bytes(o.encoder_memory, budget)
            self._encoded = BlockPool(self.ctx.arena.alloc(region, "encoder-cache"), region)
        self._after_weights = self.ctx.arena.mark()
        self._free_after_weights = self.ctx.arena.free_bytes
        self.spec: CacheSpec | None = None
        self.cache = DeviceCache(0)
        # Decode steps run from CUDA graphs, one per GraphKey (batch-size and token buckets, block-table width
        # bucket, sampling), captured after the first step of a key, which runs eagerly at the padded size (it
        # loads modules and picks the GEMM algorithms of that size).
        self.use_graphs = o.use_graphs
        self._graphs: dict[GraphKey, CapturedStep] = {}
        self._no_graph: dict[GraphKey, str] = {}  # keys whose capture failed or was too large, and why
        # A graph whose buffers (at the arena's top while it runs) would take more than this runs eagerly.
        self.graph_memory_cap = o.graph_memory
        self._graph_bytes = 0  # the largest graph's buffers and scratch (shared: graphs own no arena memory)
        self.scratch: ScratchRows | None = None  # the padding rows' KV block and state slot (allocate_cache)
        self.buckets: tuple[int, ...] = ()
        self.decode_counts = DecodeCounts()
        self.sampler = DeviceSampler(self.ctx, cfg.vocab_size)
        self.rollback: Strategy = "window" if o.rollback == "window" else "recompute"
        self.verify_window_tokens = o.verify_window_tokens
        self._verify_layers: list[VerifyRows] = []

    # ---- sizes -----------------------------------------------------------------------------------------------
    def kv_bytes_per_block(self, block_size: int | None = None) -> int:
        size = block_size if block_size is not None else allocated(self.spec).block_size
        mtp = mtp_kv_bytes_per_block(self.cfg, size, ITEMSIZE[self.dtype]) if self.mtp is not None else 0
        return self._trunk_kv_bytes_per_block(size) + mtp  # the MTP head's layer stays in the compute dtype

    def _trunk_kv_bytes_per_block(self, size: int) -> int:
        return attention_kv_bytes_per_block(self.cfg, size, ITEMSIZE[self.dtype], self.options.kv_cache_dtype)

    def state_bytes_per_slot(self) -> int:
        return state_bytes_per_slot(self.cfg, ITEMSIZE[self.dtype], ITEMSIZE["f32"])  # the recurrent state is f32

    def embedding_nbytes(self, item: VisionItem) -> int:
        return item.num_tokens * self.cfg.hidden_size * ITEMSIZE[self.dtype]

    @property
    def encoder_region_bytes(self) -> int:
        """The on-device encoder-cache region (0 without a tower): the engine's default encoder-cache budget, so
        that cached embeddings stay on the device."""
        return self._encoded.capacity if self._encoded is not None else 0

    def cache_budget(self, max_num_seqs: int, max_batched_tokens: int) -> CacheBudget:
        """What the engine's cache may take when it is given no kv_cache_bytes (memory_plan.py): the arena left
        after the weights, less graphs, one step's activations (with the verify windows' rollback rows) and one
        vision encode."""
        item = ITEMSIZE[self.dtype]
        per_row = self.state_bytes_per_slot() * (self.verify_window_tokens if self.rollback == "window" else 1)
        verify = self._verify_rows(max_num_seqs) * per_row
        return default_cache_budget(
            self.ctx.arena.capacity, self._free_after_weights, self.graph_memory_cap,
            step_reserve_bytes(self.cfg, max_batched_tokens, max_num_seqs, item) + verify,
            vision_reserve_bytes(self.vision.dims if self.vision is not None else None, item))

    def _verify_rows(self, slots: int) -> int:
        return min(slots, DEFAULT_VERIFY_ROWS if self.verify_rows is None else self.verify_rows)

    # ---- cache -----------------------------------------------------------------------------------------------
    def allocate_cache(self, spec: CacheSpec) -> None:
        check_cache_spec(spec)
        cfg, ctx = self.cfg, self.ctx
        need = (spec.num_kv_blocks * self.kv_bytes_per_block(spec.block_size)
                + spec.num_state_slots * self.state_bytes_per_slot() + self._launch_sampler_bytes(spec))
        if self.mtp is not None:  # the head's scratch blocks for chained drafts
            need += mtp_cache_bytes(cfg, spec, ITEMSIZE[self.dtype])
        if need > self._free_after_weights:
            raise RunnerInputError(
                f"the cache ({spec.num_kv_blocks} KV blocks + {spec.num_state_slots} state slots = {need} bytes) does "
                f"not fit the {self._free_after_weights} bytes of the GPU memory budget left after the weights "
                f"(arena {ctx.arena.capacity} bytes): lower kv_cache_bytes / max_num_seqs, or raise "
                "DOCPIPE_CUDA_MEMORY_FRACTION / CudaOptions.memory_budget")
        ctx.device.sync()
        ctx.arena.release(self._after_weights)  # a new spec replaces the old cache (and the graphs that used it)
        self.cache, self._graphs, self._graph_bytes = DeviceCache(spec.block_size), {}, 0
        self._no_graph, self.decode_counts = {}, DecodeCounts()
        # One KV block and one state slot more than the spec, for decode graphs' padding rows, when they fit;
        # without them decode graphs are captured per exact batch size.
        pad = need + self.kv_bytes_per_block(spec.block_size) + self.state_bytes_per_slot() <= self._free_after_weights
        self.scratch = ScratchRows(spec.num_kv_blocks, spec.num_state_slots) if pad else None
        self.buckets = bucket_sizes(max(spec.num_state_slots, 1)) if pad else ()
        allocate_layers(ctx, cfg, self.cache, spec.num_kv_blocks + pad, spec.num_state_slots + pad, self.dtype,
                        self.options.kv_cache_dtype)
        self.book, self._verify_layers = allocate_verify_rows(
            self.ctx, self.cache, self.dtype, self.rollback, self._verify_rows(spec.num_state_slots),
            self.verify_window_tokens, self.verify_memory_fraction)
        self.mtp_cache = allocate_mtp_cache(ctx, cfg, spec, self.dtype) if self.mtp is not None else None
        self._allocate_launch_sampler(spec)
        self.kept.clear()
        self.spec = spec

    def rollback_state(self, state_slot: int, keep_tokens: int) -> None:
        """The slot's state becomes the one after the first `keep_tokens` tokens of its last verify window (the
        copy or the re-fed tokens come with the slot's next forward)."""
        check_state_slots(allocated(self.spec), state_slot)
        self._book().rollback(state_slot, keep_tokens)

    @property
    def max_verify_drafts(self) -> int | None:  # the window strategy keeps verify_window_tokens states a window
        return self.verify_window_tokens if self.rollback == "window" else None

    def verify_room(self) -> int:  # windows the next step can hold rollback state for (no more get drafts)
        return self._book().room()

    def mtp_draft(self, requests: list[MtpDraftRequest]) -> list[list[int]]:
        """The MTP head for the sequences of the last forward (runner_api.MtpDraftRequest): its KV for their final
        positions, then their greedy drafts; drafting requests past the head's scratch run in further rounds."""
        if self.mtp is None:
            raise RunnerInputError(self.mtp_problem or "this runner has no MTP head")
        spec, cache = allocated(self.spec), self.mtp_cache
        if cache is None:
            raise RuntimeError("allocate_cache() must be called before running the model")
        rows = [self.kept.take(r) for r in requests]
        return draft_in_rounds(self.mtp, requests, rows, spec, cache, self.cfg, self.dtype)

    def _book(self) -> VerifyBook:
        if self.book is None:
            raise RuntimeError("allocate_cache() must be called before running the model")
        return self.book

    def _copy_states(self, plan: StepPlan | None) -> None:
        if plan is not None and plan.copies:
            mark = self.ctx.arena.mark()
            try:
                copy_segments(self.ctx, copy_table(plan.copies, self._verify_layers))
            finally:
                self.ctx.arena.release(mark)  # the launch is ordered before anything that reuses the memory

    def copy_state_slot(self, src: int, dst: int) -> None:
        check_state_slots(allocated(self.spec), src, dst)
        book = self._book()
        if book.owes(src):
            raise RunnerInputError(f"state slot {src} was rolled back and its next forward has not run yet: its "
                                   "state cannot be copied now")
        book.forget(dst)
        copy_slot_states(self.ctx, self.cache, src, dst)

    # ---- vision ----------------------------------------------------------------------------------------------
    def encode_vision(self, item: VisionItem) -> DeviceEmbeddings | np.ndarray:
        """The item's embeddings [num_tokens, hidden], encoded on the GPU. DeviceEmbeddings in the encoder-cache
        region; a host float32 array when that region has no room left (the caller's cache then holds it)."""
        vision, pool = self._vision_for([item])
        shape = (item.num_tokens, self.cfg.hidden_size)
        emb = DeviceEmbeddings.allocate(pool, shape, self.dtype, ITEMSIZE[self.dtype], self._download)
        if emb is not None:
            vision.encode(item.pixel_values, item.grid_thw, DArray(emb.ptr, shape, self.dtype))
            return emb
        mark = self.ctx.arena.mark()
        try:
            out = self.ctx.empty(shape, self.dtype, "vision-out")
            return self.ctx.to_host(vision.encode(item.pixel_values, item.grid_thw, out))
        finally:
            self.ctx.arena.release(mark)

    def _download(self, emb: DeviceEmbeddings) -> np.ndarray:
        self.ctx.device.sync()
        return self.ctx.to_host(DArray(emb.ptr, emb.shape, emb.dtype)).astype(np.float32, copy=False)

    # ---- the step --------------------------------------------------------------------------------------------
    def forward(self, batch: StepBatch) -> StepOutput:
        """The step as asked; verify windows and rolled-back slots first go through the book (cuda/verify.py):
        the kernels may run re-fed tokens in front of a chunk, whose rows get no logits."""
        plan = self._book().plan(batch) if batch.chunks else None
        run = plan.batch if plan is not None else batch
        offsets = row_offsets(batch.chunks)
        self._copy_states(plan)
        if self.mtp is not None:
            self.kept.begin_step()  # kept rows live until the next forward (runner_api.MtpDraftRequest)
            self._keeping = batch if any(c.keep_hidden for c in batch.chunks) else None
        try:
            if self.use_graphs and graphable(run):
                out = self._forward_graphed(run, offsets, plan)
            else:
                if graphable(run):
                    self.decode_counts.eager_graphable += 1
                else:
                    self.decode_counts.other += 1
                out = self._forward_eager(run, offsets, plan)
        finally:
            self._keeping = None
        if plan is not None:
            self._book().commit(plan)
        return out

    def _forward_graphed(self, batch: StepBatch, offsets: list[int], plan: StepPlan | None) -> StepOutput:
        lens = [c.num_tokens for c in batch.chunks]
        counts = self.decode_counts
        verify = any(c.verify for c in batch.chunks)
        if self.scratch is None:
            shape: tuple[int, int] | None = (len(lens), sum(lens))  # no padding rows: one graph per exact shape
        else:
            shape = graph_shape(lens, self.buckets, allocated(self.spec).block_size,
                                VERIFY_TOKEN_BUCKETS if verify else TOKEN_BUCKETS)
        if shape is None:  # too many sequences or forced tokens for any bucket
            counts.eager_graphable += 1
            return self._forward_eager(batch, offsets, plan)
        rows, tokens = shape
        width = table_width_bucket(max(len(c.block_table) for c in batch.chunks))
        key = GraphKey(rows, tokens, width, batch.sampling is not None, verify)
        host = self._graph_host(batch, width, rows, tokens, plan)
        step = self._graphs.get(key)
        if step is None:
            counts.eager_graphable += 1
            out = self._run_eager(host, batch, offsets)  # loads the modules and GEMM plans a capture needs
            if key not in self._no_graph and len(self._graphs) < MAX_GRAPHS:
                step = self._capture(host, batch, width, key)  # replayed from the key's next step on
                if step is not None:
                    self._graphs[key] = step
                    counts.captures += 1
            return out
        step.load(host, batch)
        step.replay()
        if self._keeping is not None:
            self.kept.keep_step(self.ctx, self._keeping, host.tables.cu, step.bufs.act.h, self.cfg.hidden_size,
                                self.dtype, self._download)
        counts.graphed += 1
        counts.padded += host.padding > 0
        counts.with_runs += max(lens) > 1
        hidden = step.hidden()
        if batch.sampling is not None and step.bufs.sampler is not None:
            sampled = self.sampler.results(step.bufs.sampler, batch.sampling)
            return StepOutput(logits=self._no_logits(), row_offsets=offsets, hidden=hidden, sampled=sampled)
        return StepOutput(logits=step.logits(), row_offsets=offsets, hidden=hidden)

    def _graph_host(self, batch: StepBatch, width: int, rows: int, tokens: int, plan: StepPlan | None = None
                    ) -> HostStep:
        """The step's tables, padded to `rows` sequences and `tokens` tokens with scratch rows (pad_step); a step
        with verify windows gets logits rows for `tokens` rows (its graph computes them all)."""
        host = self._prepare(batch, width, plan)
        verify = any(c.verify for c in batch.chunks)
        if self.scratch is None or (rows, tokens) == (len(batch.chunks), host.n):
            return fill_logit_rows(host, tokens) if verify else host
        return pad_step(host, rows, tokens, self.scratch.block, allocated(self.spec).block_size, self.scratch.slot,
                        all_rows=verify)

    def _forward_eager(self, batch: StepBatch, offsets: list[int], plan: StepPlan | None) -> StepOutput:
        return self._run_eager(self._prepare(batch, None, plan), batch, offsets)

    def _run_eager(self, host: HostStep, batch: StepBatch, offsets: list[int]) -> StepOutput:
        """One step from its tables (padded or not: the logits rows past host.batch_logit_rows are dropped)."""
        ctx, logit_rows = self.ctx, host.batch_logit_rows
        mark = ctx.arena.mark()
        sampled = None
        try:
            bufs = self._step_buffers(host)
            tables = upload_tables(ctx, host.tables)
            if batch.sampling is not None and bufs.sampler is not None and host.logit_rows:
                self.sampler.upload_masks(bufs.sampler, batch.sampling)
            self._run(host, tables, bufs)
            if self._keeping is not None:
                self.kept.keep_step(ctx, self._keeping, host.tables.cu, bufs.act.h, self.cfg.hidden_size,
                                    self.dtype, self._download)
            if batch.sampling is not None and bufs.sampler is not None:
                sampled = self.sampler.results(bufs.sampler, batch.sampling)  # zero rows when no logits rows
                out_logits = self._no_logits()
            else:
                out_logits = ctx.to_host(first_rows(bufs.logits, logit_rows)) if logit_rows else self._no_logits()
            if logit_rows:
                out_hidden = ctx.to_host(first_rows(bufs.rows, logit_rows)).astype(np.float32, copy=False)
            else:
                out_hidden = np.zeros((0, self.cfg.hidden_size), np.float32)
        finally:
            ctx.device.sync()
            ctx.arena.release(mark)
        return StepOutput(logits=out_logits, row_offsets=offsets, hidden=out_hidden, sampled=sampled)

    def capture_step(self, batch: StepBatch, table_width: int) -> CapturedStep:
        """Record this step's device work (decoder + LM head) in a CUDA graph, for decode loops.

        The graph keeps the addresses of this step's buffers: `CapturedStep.update(next_batch)` uploads the next
        step's tables there (same sequences and tokens, tables padded to `table_width`), `replay()` launches it,
        `logits()` reads the result. Run one eager step of the same shape first (modules, GEMM plans). close()
        releases its memory and all allocated after it. It owns its buffers; forward()'s own graphs own none.
        """
        if any(c.vision for c in batch.chunks):
            raise RunnerInputError("steps with vision embeddings are not captured")
        host = self._prepare(batch, table_width)
        return self._record(host, batch, table_width, owns=True)

    def _capture(self, host: HostStep, batch: StepBatch, width: int, key: GraphKey) -> CapturedStep | None:
        """forward()'s graph for `key`, captured at the arena's top and owning nothing; None (and the key runs
        eagerly from now on) when it is larger than graph_memory_cap or the capture fails."""
        arena = self.ctx.arena
        peak, before = arena.peak, arena.used
        arena.peak = before
        try:
            step = self._record(host, batch, width, owns=False)
        except Exception as exc:  # noqa: BLE001 - a failed capture costs this key its graph, never the step
            self._no_graph[key] = f"capture failed: {type(exc).__name__}: {exc}"
            return None
        finally:
            footprint = arena.peak - before
            arena.peak = max(peak, arena.peak)
        if footprint > self.graph_memory_cap:
            self._no_graph[key] = f"{footprint} bytes of buffers > graph_memory_cap {self.graph_memory_cap}"
            return None
        self._graph_bytes = max(self._graph_bytes, footprint)
        return step

    def _record(self, host: HostStep, batch: StepBatch, width: int, owns: bool) -> CapturedStep:
        ctx = self.ctx
        mark = ctx.arena.mark()
        try:
            bufs = self._step_buffers(host)
            tables = upload_tables(ctx, host.tables)
            if batch.sampling is not None and bufs.sampler is not None:
                self.sampler.upload_masks(bufs.sampler, batch.sampling)
            # An owning graph keeps every layer's scratch apart (nothing else may reuse it while the graph
            # lives); a shared one reuses scratch layer after layer, as an eager step does.
            graph = ctx.device.capture(lambda: self._run(host, tables, bufs, keep_scratch=owns))
        finally:
            if not owns:
                ctx.arena.release(mark)
        return CapturedStep(self, graph, host, tables, bufs, mark if owns else None, width)

    def _prepare(self, batch: StepBatch, table_width: int | None = None, plan: StepPlan | None = None) -> HostStep:
        host = build_step(batch, allocated(self.spec), self.cfg, self.dtype, table_width,
                          plan.logit_skip if plan is not None else None, tile_rows=self.flash_tile_rows,
                          deltanet_split=self.deltanet_split)
        if plan is not None and plan.win is not None and any(c.verify for c in batch.chunks):
            host.tables.win = plan.win  # the window strategy's kernels keep every window token's state
        return host

    def _no_logits(self) -> np.ndarray:
        return np.zeros((0, self.cfg.vocab_size), np.float32)

    def _step_buffers(self, host: HostStep) -> StepBuffers:
        """Activation buffers of one step, allocated before the tables so that equal-shaped steps get equal
        addresses."""
        ctx, cfg, t, n = self.ctx, self.cfg, self.dtype, host.n
        H, R = cfg.hidden_size, max(host.logit_rows, 1)
        bufs = StepBuffers(
            act=Activations(x=ctx.empty((n, H), t, "x"), h=ctx.empty((n, H), t, "h"), d=ctx.empty((n, H), t, "delta")),
            rows=ctx.empty((R, H), t, "hidden_rows"),
            logits=ctx.empty((R, cfg.vocab_size), "f32", "logits"),
        )
        if host.tables.sample_params is not None:
            bufs.sampler = self.sampler.buffers(R)
        if host.vision_embeds is not None:
            bufs.vision = ctx.to_device(host.vision_embeds, t, "vision")
        return bufs

    def _run(self, host: HostStep, m: StepTables[DArray], bufs: StepBuffers, keep_scratch: bool = False) -> None:
        """Embeddings (vision rows put in), the decoder, then the LM head and the sampler on the requested rows
        (enqueue only)."""
        ctx, x = self.ctx, bufs.act.x
        self.model.embed_tokens(x, m.ids)
        if bufs.vision is not None:
            ops.scatter_rows(ctx, x, bufs.vision, m.vis_rows)
        row_bytes = self.cfg.hidden_size * ITEMSIZE[self.dtype]
        for piece in host.device_vision:
            ctx.device.copy(x.ptr + piece.row * row_bytes, piece.src, piece.rows * row_bytes)
        self.model.forward(bufs.act, m, host.n, host.longest_chunk, self.cache, keep_scratch)
        if host.logit_rows:
            self.model.logits(bufs.logits, bufs.rows, bufs.act.h, m.logit_rows, host.logit_rows)
            if m.sample_params is not None and bufs.sampler is not None:
                self.sampler.enqueue(bufs.sampler, bufs.logits, m.sample_params, host.logit_rows)

    def close(self) -> None:
        self.ctx.close()

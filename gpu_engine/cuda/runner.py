"""CudaRunner: the runner contract (gpu_engine/runner_api.py) for the Qwen3.5 text decoder on one NVIDIA GPU.

Memory: one cuMemAlloc of `memory_budget` bytes at start-up; weights first, then the cache (allocate_cache), and
per-step activations from what is left (released at the end of every step).
Step: all sequences of the batch run together (varlen): host-side metadata is packed into one int32 array and
uploaded once; every layer is a fixed sequence of cuBLASLt GEMMs and kernels on one stream; logits come back
as float32 for the requested rows only. Decode steps (one token per sequence) replay CUDA graphs captured per
(batch size, block-table width bucket); DOCPIPE_CUDA_GRAPHS=0 or use_graphs=False turns that off.
Vision: encode_vision runs the tower on the GPU (vision.py) into a block of the encoder-cache region (a fixed
part of the arena, DOCPIPE_CUDA_ENCODER_MEMORY bytes, default 256 MiB) and returns DeviceEmbeddings; the prefill
steps copy their rows into the residual stream on the device. When that region is full the embeddings come back
as a host float32 array instead (uploaded by the step that uses them, like any host embeddings).
Sampling: a step whose batch carries a SamplingRequest (runner_api) is sampled on the GPU after the LM head
(sampler.py, kernels/sampling.cu); only token ids and logprobs come back, not the logits. Its parameter table
travels in the packed metadata (so decode graphs, captured per sampling on/off, replay it like the rest).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..config import ModelConfig
from ..inputs import VisionItem
from ..loader import ModelWeights
from ..runner_api import CacheSpec, StepBatch, StepOutput, chunk_problem
from . import deltanet_chunked, ops, rotary
from .context import ITEMSIZE, DArray, GpuContext
from .embeddings import BlockPool, DeviceEmbeddings
from .errors import CudaBackendError, ShapeError
from .sampler import DeviceSampler, SamplerBuffers, pack_params
from .vision import GpuVisionTower
from .weights import AttentionWeights, DeltaNetWeights, upload_text_weights

_ALIGN_I32 = 64  # pack offsets in elements (256 bytes)
FLASH_MIN_CHUNK = 32  # steps whose longest chunk has this many tokens use the tensor-core prefill attention


class RunnerInputError(CudaBackendError, ValueError):
    """A step batch that breaks the runner contract."""


@dataclass
class _LayerCache:
    k: DArray | None = None
    v: DArray | None = None
    conv: DArray | None = None  # [slots, K-1, conv_dim]
    state: DArray | None = None  # f32 [slots, Hv, dv, dk]


@dataclass
class _StepMeta:
    """Host-side description of one step (everything the kernels index with)."""

    n: int
    longest_chunk: int
    arrays: dict[str, np.ndarray]  # int32 arrays, packed and uploaded together
    logit_rows: int
    vision_rows: np.ndarray
    vision_embeds: np.ndarray | None
    # (first row in the step, source address, rows, the embeddings object: kept alive until the step is done)
    device_vision: list[tuple[int, int, int, DeviceEmbeddings]]


class CudaRunner:
    name = "cuda"
    samples_on_device = True  # runner_api.SamplingRequest is honoured (sampler.py)

    def __init__(self, model_config: ModelConfig, weights: ModelWeights, *, dtype: str = "bf16",
                 memory_budget: int | None = None, device_id: int = 0, use_graphs: bool | None = None,
                 use_pdl: bool | None = None, encoder_memory: int | None = None) -> None:
        if dtype not in ("bf16", "f32"):
            raise ShapeError(f"dtype must be 'bf16' or 'f32', got {dtype!r}")
        self.config = model_config
        self.cfg = model_config.text
        self.dtype = dtype
        budget = memory_budget or _default_budget(device_id)
        self.ctx = GpuContext(budget, device_id)
        # Programmatic dependent launch between our kernels (DOCPIPE_CUDA_PDL=1); needs sm_90 or newer.
        pdl = os.environ.get("DOCPIPE_CUDA_PDL", "0") == "1" if use_pdl is None else use_pdl
        self.ctx.device.pdl = pdl and int(self.ctx.device.info.arch.removeprefix("sm_")) >= 90
        self.w = upload_text_weights(self.ctx, self.cfg, weights, dtype)
        cfg = self.cfg
        self._rope_inv = self.ctx.to_device(rotary.inv_freq(cfg.rope_theta, cfg.rotary_dim), "f32", "rope.inv_freq")
        self._rope_axis = self.ctx.to_device(rotary.mrope_axis(cfg.rotary_dim, cfg.mrope_section), "i32", "rope.axis")
        # The vision tower and its encoder-cache region come before the cache mark: they outlive cache changes.
        # A checkpoint whose tower cannot feed its decoder still runs text; encode_vision then says why.
        self.vision: GpuVisionTower | None = None
        self._encoded: BlockPool | None = None
        self._no_vision = "this runner was built without vision weights, so it cannot encode images"
        if weights.vision and model_config.vision.out_hidden_size != cfg.hidden_size:
            self._no_vision = (f"the vision tower's out_hidden_size {model_config.vision.out_hidden_size} differs from "
                               f"the text hidden_size {cfg.hidden_size}: this checkpoint cannot encode images")
        elif weights.vision:
            self.vision = GpuVisionTower(self.ctx, model_config.vision, weights.vision, dtype)
            pool = encoder_memory if encoder_memory is not None else int(
                os.environ.get("DOCPIPE_CUDA_ENCODER_MEMORY", str(256 << 20)))
            self._encoded = BlockPool(self.ctx.arena.alloc(pool, "encoder-cache"), pool)
        self._after_weights = self.ctx.arena.mark()
        self.spec: CacheSpec | None = None
        self.cache: dict[int, _LayerCache] = {}
        self._longest = 0  # longest chunk of the step being enqueued (picks the attention kernel)
        # Decode steps run from CUDA graphs, one per (batch size, block-table width bucket), captured the second
        # time a shape is seen (the first, eager, run loads modules and picks GEMM algorithms).
        self.use_graphs = os.environ.get("DOCPIPE_CUDA_GRAPHS", "1") != "0" if use_graphs is None else use_graphs
        self._graphs: dict[tuple[int, int], CapturedStep] = {}
        self._warm: set[tuple[int, int]] = set()
        # Each graph owns its activations for as long as the cache lives; past this many bytes new decode shapes
        # run eagerly instead (DOCPIPE_CUDA_GRAPH_MEMORY, bytes).
        self.graph_memory_cap = int(os.environ.get("DOCPIPE_CUDA_GRAPH_MEMORY", str(2 << 30)))
        self._graph_bytes = 0
        self.sampler = DeviceSampler(self.ctx, cfg.vocab_size)

    # ---- sizes -----------------------------------------------------------------------------------------------
    def kv_bytes_per_block(self, block_size: int | None = None) -> int:
        cfg = self.cfg
        size = block_size if block_size is not None else self._spec().block_size
        return len(cfg.full_attention_layers) * 2 * size * cfg.num_key_value_heads * cfg.head_dim * ITEMSIZE[self.dtype]

    def state_bytes_per_slot(self) -> int:
        cfg = self.cfg
        conv = cfg.linear_conv_dim * (cfg.linear_conv_kernel_dim - 1) * ITEMSIZE[self.dtype]
        state = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
        return len(cfg.linear_attention_layers) * (conv + state)

    def embedding_nbytes(self, item: VisionItem) -> int:
        return item.num_tokens * self.cfg.hidden_size * ITEMSIZE[self.dtype]

    # ---- cache -----------------------------------------------------------------------------------------------
    def allocate_cache(self, spec: CacheSpec) -> None:
        if spec.num_kv_blocks < 1 or spec.block_size < 1 or spec.num_state_slots < 1:
            raise RunnerInputError(f"cache spec needs positive sizes, got {spec}")
        cfg, ctx = self.cfg, self.ctx
        ctx.device.sync()
        ctx.arena.release(self._after_weights)  # a new spec replaces the old cache (and the graphs that used it)
        self.cache, self._graphs, self._warm, self._graph_bytes = {}, {}, set(), 0
        for i, kind in enumerate(cfg.layer_types):
            if kind == "full_attention":
                shape = (spec.num_kv_blocks, spec.block_size, cfg.num_key_value_heads, cfg.head_dim)
                self.cache[i] = _LayerCache(k=ctx.empty(shape, self.dtype, f"k{i}"), v=ctx.empty(shape, self.dtype, f"v{i}"))
            else:
                conv = ctx.empty((spec.num_state_slots, cfg.linear_conv_kernel_dim - 1, cfg.linear_conv_dim),
                                 self.dtype, f"conv{i}")
                state = ctx.empty((spec.num_state_slots, cfg.linear_num_value_heads, cfg.linear_value_head_dim,
                                   cfg.linear_key_head_dim), "f32", f"state{i}")
                self.cache[i] = _LayerCache(conv=conv, state=state)
        for c in self.cache.values():  # deterministic contents (fresh sequences never read them anyway)
            for arr in (c.k, c.v, c.conv, c.state):
                if arr is not None:
                    ctx.device.memset(arr.ptr, 0, arr.nbytes)
        self.spec = spec

    def copy_state_slot(self, src: int, dst: int) -> None:
        spec = self._spec()
        for slot in (src, dst):
            if not 0 <= slot < spec.num_state_slots:
                raise RunnerInputError(f"state slot {slot} out of range [0, {spec.num_state_slots})")
        for c in self.cache.values():
            for arr in (c.conv, c.state):
                if arr is not None:
                    row = arr.nbytes // arr.shape[0]
                    self.ctx.device.copy(arr.ptr + dst * row, arr.ptr + src * row, row)
        self.ctx.device.sync()

    def _spec(self) -> CacheSpec:
        if self.spec is None:
            raise RuntimeError("allocate_cache() must be called before running the model")
        return self.spec

    # ---- vision ----------------------------------------------------------------------------------------------
    def encode_vision(self, item: VisionItem) -> DeviceEmbeddings | np.ndarray:
        """The item's embeddings [num_tokens, hidden], encoded on the GPU. DeviceEmbeddings in the encoder-cache
        region; a host float32 array when that region has no room left (the caller's cache then holds it)."""
        if self.vision is None or self._encoded is None:
            raise RunnerInputError(self._no_vision)
        if self.vision.num_tokens(item.grid_thw) != item.num_tokens:
            raise RunnerInputError(f"item with grid {item.grid_thw} has {item.num_tokens} placeholders, the tower "
                                   f"makes {self.vision.num_tokens(item.grid_thw)}")
        shape = (item.num_tokens, self.cfg.hidden_size)
        emb = DeviceEmbeddings.allocate(self._encoded, shape, self.dtype, ITEMSIZE[self.dtype], self._download)
        if emb is not None:
            self.vision.encode(item.pixel_values, item.grid_thw, DArray(emb.ptr, shape, self.dtype))
            return emb
        mark = self.ctx.arena.mark()
        try:
            out = self.ctx.empty(shape, self.dtype, "vision-out")
            return self.ctx.to_host(self.vision.encode(item.pixel_values, item.grid_thw, out))
        finally:
            self.ctx.arena.release(mark)

    def _download(self, emb: DeviceEmbeddings) -> np.ndarray:
        self.ctx.device.sync()
        return self.ctx.to_host(DArray(emb.ptr, emb.shape, emb.dtype)).astype(np.float32, copy=False)

    # ---- the step --------------------------------------------------------------------------------------------
    def forward(self, batch: StepBatch) -> StepOutput:
        if self.use_graphs and _is_decode(batch):
            return self._forward_graphed(batch)
        return self._forward_eager(batch)

    def _forward_graphed(self, batch: StepBatch) -> StepOutput:
        width = 1 << (max(len(c.block_table) for c in batch.chunks) - 1).bit_length()
        key = (len(batch.chunks), width, batch.sampling is not None)
        step = self._graphs.get(key)
        if step is None:
            if key not in self._warm or self._graph_bytes >= self.graph_memory_cap:
                self._warm.add(key)
                return self._forward_eager(batch)
            before = self.ctx.arena.used
            step = self._graphs[key] = self.capture_step(batch, width)  # owns its memory until allocate_cache
            self._graph_bytes += self.ctx.arena.used - before
        else:
            step.update(batch)
        step.replay()
        hidden = self.ctx.to_host(step.bufs["rows"])[: step.meta.logit_rows].astype(np.float32, copy=False)
        if batch.sampling is not None:
            sampled = self.sampler.results(_sampler_buffers(step.bufs), batch.sampling)
            return StepOutput(logits=np.zeros((0, self.cfg.vocab_size), np.float32), row_offsets=_row_offsets(batch),
                              hidden=hidden, sampled=sampled)
        return StepOutput(logits=step.logits(), row_offsets=_row_offsets(batch), hidden=hidden)

    def _forward_eager(self, batch: StepBatch) -> StepOutput:
        meta = self._prepare(batch)
        ctx = self.ctx
        mark = ctx.arena.mark()
        sampled = None
        try:
            bufs = self._step_buffers(meta)
            packed = self._upload_meta(meta)
            if batch.sampling is not None and meta.logit_rows:
                self.sampler.upload_masks(_sampler_buffers(bufs), batch.sampling)
            self._run(meta, packed, bufs)
            if meta.logit_rows:
                if batch.sampling is not None:
                    sampled = self.sampler.results(_sampler_buffers(bufs), batch.sampling)
                    out_logits = np.zeros((0, self.cfg.vocab_size), np.float32)
                else:
                    out_logits = ctx.to_host(bufs["logits"])
                out_hidden = ctx.to_host(bufs["rows"]).astype(np.float32, copy=False)
            else:
                out_logits = np.zeros((0, self.cfg.vocab_size), np.float32)
                out_hidden = np.zeros((0, self.cfg.hidden_size), np.float32)
                if batch.sampling is not None:
                    sampled = self.sampler.results(_sampler_buffers(bufs), batch.sampling)  # zero rows
        finally:
            ctx.device.sync()
            ctx.arena.release(mark)
        return StepOutput(logits=out_logits, row_offsets=_row_offsets(batch), hidden=out_hidden, sampled=sampled)

    def capture_step(self, batch: StepBatch, table_width: int) -> CapturedStep:
        """Record this step's device work (decoder + LM head) in a CUDA graph, for decode loops.

        The graph keeps the addresses of this step's buffers: `CapturedStep.update(next_batch)` uploads the next
        step's metadata into the same place (same number of sequences and tokens, block tables padded to
        `table_width`), `replay()` launches the graph (capture itself runs nothing), `logits()` reads the result.
        Run one eager step of the same shape first (it loads the modules and builds the GEMM plans). close()
        releases the graph's memory and everything allocated after it (the arena is a stack).
        Memory note: the graph keeps its buffers and per-layer scratch; short-lived op workspaces (attention
        partials, DeltaNet prepare) are released during capture, so later allocations may overlap them. That is
        safe because replays run one at a time on one stream and every step rewrites all it reads before reading
        (update() re-uploads the metadata, the decoder rewrites the activations, logits are read right away).
        """
        if any(c.vision for c in batch.chunks):
            raise RunnerInputError("steps with vision embeddings are not captured")
        meta = self._prepare(batch, table_width)
        ctx = self.ctx
        mark = ctx.arena.mark()
        bufs = self._step_buffers(meta)
        packed = self._upload_meta(meta)
        if batch.sampling is not None:
            self.sampler.upload_masks(_sampler_buffers(bufs), batch.sampling)
        graph = ctx.device.capture(lambda: self._run(meta, packed, bufs, keep_scratch=True))
        return CapturedStep(self, graph, meta, packed, bufs, mark, table_width)

    def _add_sampling(self, batch: StepBatch, meta: _StepMeta) -> None:
        """A SamplingRequest's parameter table joins the packed int32 metadata (float32 bits)."""
        if batch.sampling is None:
            return
        problem = batch.sampling.problem(meta.logit_rows, self.cfg.vocab_size)
        if problem:
            raise RunnerInputError(problem)
        if batch.sampling.bitmask is not None and batch.sampling.bitmask.shape[0] > max(meta.logit_rows, 1):
            raise RunnerInputError("sampling request: more bitmask rows than logits rows")
        meta.arrays["sample_params"] = pack_params(batch.sampling).view(np.int32)

    def _prepare(self, batch: StepBatch, table_width: int | None = None) -> _StepMeta:
        spec, cfg = self._spec(), self.cfg
        if not batch.chunks:
            raise RunnerInputError("empty step batch")
        ids, pos, cu, slots, fresh, tok_seq, tok_pos, kv_slots, logit_rows, vis_rows, vis = ([] for _ in range(11))
        device_vision: list[tuple[int, int, int, DeviceEmbeddings]] = []
        tables = []
        base = 0
        for s, chunk in enumerate(batch.chunks):
            problem = chunk_problem(chunk, spec, vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                                    paged_kv=bool(cfg.full_attention_layers))
            if problem:
                raise RunnerInputError(problem)
            n = chunk.num_tokens
            where = f"sequence {chunk.seq_id}"
            p = np.arange(chunk.start, chunk.start + n)
            table = np.asarray(chunk.block_table, np.int64)
            if cfg.full_attention_layers:
                kv_slots.append(table[p // spec.block_size] * spec.block_size + p % spec.block_size)
            tables.append(table)
            ids.append(chunk.token_ids)
            pos.append(chunk.positions)
            cu.append(base)
            slots.append(chunk.state_slot)
            fresh.append(int(chunk.start == 0))
            tok_seq.append(np.full(n, s))
            tok_pos.append(p)
            if chunk.logits == "all":
                logit_rows.append(base + np.arange(n))
            elif chunk.logits == "last":
                logit_rows.append(np.array([base + n - 1]))
            for piece in chunk.vision:
                if isinstance(piece.embeddings, DeviceEmbeddings):
                    dev = piece.embeddings
                    rows = dev.shape[0]
                    if dev.dtype != self.dtype:  # shape and rows: chunk_problem
                        raise RunnerInputError(f"{where}: device vision embeddings are {dev.dtype}, the runner "
                                               f"computes in {self.dtype}")
                    device_vision.append((base + piece.chunk_offset, dev.ptr, rows, dev))
                    continue
                emb = np.asarray(piece.embeddings, np.float32)
                vis_rows.append(base + piece.chunk_offset + np.arange(emb.shape[0]))
                vis.append(emb)
            base += n
        cu.append(base)
        width = table_width or max(1, max(t.shape[0] for t in tables))
        if any(t.shape[0] > width for t in tables):
            raise RunnerInputError(f"block table longer than the captured width {width}")
        block_tables = np.zeros((len(tables), width), np.int64)
        for s, t in enumerate(tables):
            block_tables[s, : t.shape[0]] = np.maximum(t, 0)
        cat = lambda xs: np.concatenate(xs) if xs else np.zeros(0, np.int64)  # noqa: E731
        arrays = {
            "ids": cat(ids), "pos": np.concatenate(pos, axis=1), "cu": np.array(cu), "slots": np.array(slots),
            "fresh": np.array(fresh), "tok_seq": cat(tok_seq), "tok_pos": cat(tok_pos), "kv_slots": cat(kv_slots),
            "tables": block_tables, "logit_rows": cat(logit_rows), "vis_rows": cat(vis_rows),
            "tiles": ops.flash_tiles([c.num_tokens for c in batch.chunks]),
        }
        longest = max(c.num_tokens for c in batch.chunks)
        meta = _StepMeta(n=base, longest_chunk=longest, arrays={k: v.astype(np.int32) for k, v in arrays.items()},
                         logit_rows=int(arrays["logit_rows"].size), vision_rows=arrays["vis_rows"].astype(np.int32),
                         vision_embeds=np.concatenate(vis) if vis else None, device_vision=device_vision)
        self._add_sampling(batch, meta)
        return meta

    @staticmethod
    def _pack_meta(meta: _StepMeta) -> tuple[np.ndarray, dict[str, int]]:
        """All int32 metadata in one host array (each piece 256-byte aligned) and the element offsets."""
        offsets, total = {}, 0
        for name, arr in meta.arrays.items():
            offsets[name] = total
            total += -(-max(arr.size, 1) // _ALIGN_I32) * _ALIGN_I32
        host = np.zeros(total, np.int32)
        for name, arr in meta.arrays.items():
            host[offsets[name] : offsets[name] + arr.size] = arr.reshape(-1)
        return host, offsets

    def _upload_meta(self, meta: _StepMeta) -> dict[str, DArray]:
        """One upload for all int32 metadata; returns typed views into it."""
        host, offsets = self._pack_meta(meta)
        dev = self.ctx.to_device(host, "i32", "step-meta")
        return {name: dev.view(arr.shape if arr.size else (1,), offsets[name]) for name, arr in meta.arrays.items()}

    def _step_buffers(self, meta: _StepMeta) -> dict[str, DArray]:
        """Activation buffers of one step (sizes depend on the token count only), allocated before the metadata
        so that equal-shaped steps get equal addresses."""
        ctx, cfg, t, n = self.ctx, self.cfg, self.dtype, meta.n
        H, R = cfg.hidden_size, max(meta.logit_rows, 1)
        bufs = {
            "x": ctx.empty((n, H), t, "x"),  # residual stream
            "h": ctx.empty((n, H), t, "h"),  # normed input of the next block
            "d": ctx.empty((n, H), t, "delta"),  # output of the last block, added to x by the next fused norm
            "rows": ctx.empty((R, H), t, "hidden_rows"),
            "logits": ctx.empty((R, cfg.vocab_size), "f32", "logits"),
        }
        if "sample_params" in meta.arrays:
            sb = self.sampler.buffers(R)
            bufs.update({"s_masks": sb.masks, "s_tokens": sb.tokens, "s_logprobs": sb.logprobs,
                         "s_top_ids": sb.top_ids, "s_top_logprobs": sb.top_logprobs})
        if meta.vision_embeds is not None:
            bufs["vision"] = ctx.to_device(meta.vision_embeds, t, "vision")
        return bufs

    def _run(self, meta: _StepMeta, m: dict[str, DArray], bufs: dict[str, DArray], keep_scratch: bool = False) -> None:
        """Decoder over all tokens of the step, then the LM head on the requested rows (enqueue only).

        Per-layer scratch is reused layer after layer (stream order makes that safe); keep_scratch=True gives
        every layer its own, so that a captured graph owns all the memory it touches.
        """
        ctx, cfg, t, n = self.ctx, self.cfg, self.dtype, meta.n
        H = cfg.hidden_size
        self._longest = meta.longest_chunk
        x, h, d = bufs["x"], bufs["h"], bufs["d"]
        ops.embed_gather(ctx, x, self.w.embed, m["ids"])
        if "vision" in bufs:
            ops.scatter_rows(ctx, x, bufs["vision"], m["vis_rows"])
        row_bytes = H * ITEMSIZE[t]
        for row, src, rows, _ in meta.device_vision:  # placeholder rows of one item are consecutive
            ctx.device.copy(x.ptr + row * row_bytes, src, rows * row_bytes)
        first = True
        for i, layer in enumerate(self.w.layers):
            if first:
                ops.rmsnorm(ctx, h, x, layer.input_norm, n, H, cfg.rms_norm_eps, True)
                first = False
            else:
                ops.add_rmsnorm(ctx, h, x, d, layer.input_norm, cfg.rms_norm_eps, True)
            scratch = ctx.arena.mark()
            if isinstance(layer.mixer, AttentionWeights):
                self._attention(i, layer.mixer, h, d, m, n)
            else:
                self._deltanet(i, layer.mixer, h, d, m, n)
            ops.add_rmsnorm(ctx, h, x, d, layer.post_norm, cfg.rms_norm_eps, True)
            inter = cfg.intermediate_size
            gu = ctx.empty((n, 2 * inter), t, "gate_up")
            ctx.blas.linear(gu.ptr, h.ptr, layer.gate_up.ptr, n, 2 * inter, H, dtype=t)
            act = ctx.empty((n, inter), t, "act")
            ops.silu_mul(ctx, act, gu)
            ctx.blas.linear(d.ptr, act.ptr, layer.down.ptr, n, H, inter, dtype=t)
            if not keep_scratch:
                ctx.arena.release(scratch)
        ops.add_rmsnorm(ctx, h, x, d, self.w.final_norm, cfg.rms_norm_eps, True)
        if meta.logit_rows:
            rows, logits = bufs["rows"], bufs["logits"]
            ops.embed_gather(ctx, rows, h, m["logit_rows"])  # row gather: the "table" is h, the ids are row numbers
            ctx.blas.linear(logits.ptr, rows.ptr, self.w.lm_head.ptr, meta.logit_rows, cfg.vocab_size, H, dtype=t,
                            y_dtype="f32")
            if "sample_params" in m:
                self.sampler.enqueue(_sampler_buffers(bufs), logits, m["sample_params"], meta.logit_rows)

    def _attention(self, i: int, w: AttentionWeights, h: DArray, d: DArray, m: dict[str, DArray], n: int) -> None:
        ctx, cfg, t = self.ctx, self.cfg, self.dtype
        nh, kvh, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        width = (2 * nh + 2 * kvh) * hd
        proj = ctx.empty((n, width), t, "qkv")
        ctx.blas.linear(proj.ptr, h.ptr, w.qkv.ptr, n, width, cfg.hidden_size, dtype=t)
        q = ctx.empty((n, nh * hd), t, "q")
        cache = self.cache[i]
        ops.qk_norm_rope_store(ctx, q, cache.k, cache.v, proj, width, w.q_norm, w.k_norm, m["pos"], self._rope_inv,
                               self._rope_axis, m["kv_slots"], nh, kvh, hd, cfg.rotary_dim, cfg.rms_norm_eps)
        out = ctx.empty((n, nh * hd), t, "attn")
        args = (out, q, nh * hd, proj.at(hd), width, 2 * hd, cache.k, cache.v, m["tables"], m["tok_seq"], m["tok_pos"])
        if t == "bf16" and hd in ops.FLASH_HEAD_DIMS and self._longest >= FLASH_MIN_CHUNK:
            ops.flash_prefill(ctx, *args, m["tiles"], nh, kvh, hd, self._spec().block_size, hd ** -0.5)
        else:  # decode steps, short chunks, fp32 runs
            ops.paged_attention(ctx, *args, nh, kvh, hd, self._spec().block_size, hd ** -0.5)
        ctx.blas.linear(d.ptr, out.ptr, w.o_proj.ptr, n, cfg.hidden_size, nh * hd, dtype=t)

    def _deltanet(self, i: int, w: DeltaNetWeights, h: DArray, d: DArray, m: dict[str, DArray], n: int) -> None:
        ctx, cfg, t = self.ctx, self.cfg, self.dtype
        kh, vh = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        conv_dim, vdim = cfg.linear_conv_dim, cfg.linear_value_dim
        width = conv_dim + vdim + 2 * vh
        proj = ctx.empty((n, width), t, "in_proj")
        ctx.blas.linear(proj.ptr, h.ptr, w.in_proj.ptr, n, width, cfg.hidden_size, dtype=t)
        cache = self.cache[i]
        conv_out = ctx.empty((n, conv_dim), t, "conv_out")
        ops.conv1d_silu(ctx, conv_out, conv_dim, proj, width, w.conv, cache.conv, m["cu"], m["slots"], m["fresh"],
                        token_seq=m["tok_seq"])
        core = ctx.empty((n, vdim), t, "core")
        gdn_args = (ctx, core, conv_out, conv_out.at(kh * dk), conv_out.at(2 * kh * dk), conv_dim,
                    proj.at(conv_dim + vdim + vh), proj.at(conv_dim + vdim), width, w.A_log, w.dt_bias,
                    cache.state, m["cu"], m["slots"], m["fresh"], kh, vh, dk, dv)
        if (t == "bf16" and self._longest >= deltanet_chunked.MIN_PREFILL_TOKENS
                and deltanet_chunked.supports(dk, dv)):  # prefill: chunked WY form on the tensor cores
            deltanet_chunked.chunked_gated_delta_rule(*gdn_args)
        else:  # decode steps, short chunks, fp32 runs: the exact token-by-token kernels
            ops.gated_delta_rule(*gdn_args)
        normed = ctx.empty((n * vh, dv), t, "gated_norm")
        ops.rmsnorm_gated(ctx, normed, core.view((n * vh, dv)), proj.at(conv_dim), w.norm, cfg.rms_norm_eps, vh, width)
        ctx.blas.linear(d.ptr, normed.ptr, w.out_proj.ptr, n, cfg.hidden_size, vdim, dtype=t)

    def close(self) -> None:
        self.ctx.close()


class CapturedStep:
    """A recorded step (see CudaRunner.capture_step)."""

    def __init__(self, runner: CudaRunner, graph: Any, meta: _StepMeta, packed: dict[str, DArray],
                 bufs: dict[str, DArray], mark: int, table_width: int) -> None:
        self.runner, self.graph, self.meta, self.packed, self.bufs = runner, graph, meta, packed, bufs
        self._mark, self._width = mark, table_width
        self._base = min(a.ptr for a in packed.values())

    def update(self, batch: StepBatch) -> None:
        """Upload the metadata of the next step of the same shape into the captured buffers."""
        meta = self.runner._prepare(batch, self._width)
        shapes = {k: v.shape for k, v in meta.arrays.items()}
        if meta.n != self.meta.n or shapes != {k: v.shape for k, v in self.meta.arrays.items()}:
            raise RunnerInputError("captured step replayed with a batch of another shape")
        self.meta = meta
        host, _ = self.runner._pack_meta(meta)
        self.runner.ctx.device.upload(self._base, host)
        if batch.sampling is not None:
            self.runner.sampler.upload_masks(_sampler_buffers(self.bufs), batch.sampling)

    def replay(self) -> None:
        self.runner.ctx.device.launch_graph(self.graph)

    def logits(self) -> np.ndarray:
        return self.runner.ctx.to_host(self.bufs["logits"])[: self.meta.logit_rows]

    def close(self) -> None:
        self.runner.ctx.device.sync()
        self.runner.ctx.arena.release(self._mark)


def _is_decode(batch: StepBatch) -> bool:
    """One new token per sequence, last-row logits, no vision: the shape decode graphs are captured for."""
    return bool(batch.chunks) and all(c.num_tokens == 1 and c.logits == "last" and not c.vision for c in batch.chunks)


def _sampler_buffers(bufs: dict[str, DArray]) -> SamplerBuffers:
    return SamplerBuffers(masks=bufs["s_masks"], tokens=bufs["s_tokens"], logprobs=bufs["s_logprobs"],
                          top_ids=bufs["s_top_ids"], top_logprobs=bufs["s_top_logprobs"])


def _row_offsets(batch: StepBatch) -> list[int]:
    offsets = [0]
    for chunk in batch.chunks:
        offsets.append(offsets[-1] + {"none": 0, "last": 1, "all": chunk.num_tokens}[chunk.logits])
    return offsets


def _default_budget(device_id: int) -> int:
    """DOCPIPE_CUDA_MEMORY_FRACTION (default 0.85) of the device's free memory, taken once."""
    from .device import CudaDevice

    fraction = float(os.environ.get("DOCPIPE_CUDA_MEMORY_FRACTION", "0.85"))
    if not 0.05 <= fraction <= 0.98:
        raise ShapeError(f"DOCPIPE_CUDA_MEMORY_FRACTION must be in [0.05, 0.98], got {fraction}")
    free, _ = CudaDevice(device_id).mem_info()
    return int(free * fraction) // (1 << 20) * (1 << 20)

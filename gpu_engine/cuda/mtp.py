"""The checkpoint's multi-token-prediction head (Qwen3.5 `mtp.*`) on the CUDA runner: the math of
reference/mtp.py (the oracle) on the trunk's own kernels, for runner_api.MtpDraftRequest.

    x = fc(concat(rms_norm(embed(x_{p+1}), pre_fc_norm_embedding), rms_norm(h_p, pre_fc_norm_hidden)))
    x = one full-attention decoder layer (CudaTextModel.decoder_layer, the head's own paged KV);  out = mtp.norm(x)
    draft = argmax(lm_head(out))  (the sampler's greedy rows: lowest index on ties, as numpy's argmax)

Host side: KeptRows keeps the trunk's final-norm hidden rows of keep_hidden chunks from a forward to the next
mtp_draft (and each state slot's last row, which the slot's next prompt chunk completes); plan_drafts lays the
requests out as steps (StepTables): one fill step (the head's KV for the positions now final, and the first draft
of each drafting request), then one step per chained draft, one row per drafting request. The drafts never leave
the device between chained steps: the sampler's token buffer is the next step's embedding ids.

KV: one more full-attention layer's cache, indexed by the trunk's block ids, plus scratch blocks per drafting
request for chained positions past the sequence's blocks. Chained positions that fall inside a sequence's last
block are written there: the head's fill of those positions rewrites them before anything reads them (like the
trunk's rejected positions), so the drafts equal the reference's, which chains over a scratch copy.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ..config import TextConfig
from ..errors import RunnerInputError
from ..loader import ModelWeights
from ..runner_api import CacheSpec, MtpDraftRequest, SamplingRequest, SeqChunk, StepBatch, VisionSlice
from . import ops
from .context import DArray, GpuContext
from .embeddings import DeviceEmbeddings
from .sampler import DeviceSampler, SamplerBuffers
from .step import HostStep, StepTables, build_step, upload_tables
from .text_model import Activations, AttentionCache, CudaTextModel
from .weights import MtpWeights, mtp_head_problem, upload_mtp_weights

MAX_CHAINED = 7  # chained drafts after the first: speculative.config.MAX_DRAFTS - 1


def scratch_blocks_per_request(block_size: int) -> int:
    """Blocks a drafting request's chained positions can need past its own blocks (they start on a block edge)."""
    return max(1, -(-MAX_CHAINED // block_size))


def mtp_kv_bytes_per_block(cfg: TextConfig, block_size: int, itemsize: int) -> int:
    """The head's keys and values of one block (one full-attention layer)."""
    return 2 * block_size * cfg.num_key_value_heads * cfg.head_dim * itemsize


@dataclass
class MtpCache:
    """The head's paged KV: blocks [0, num_kv_blocks) are the trunk's block ids, then scratch blocks for chains."""

    kv: AttentionCache  # [num_kv_blocks + scratch, block_size, kv_heads, head_dim]
    num_kv_blocks: int
    per_request: int  # scratch blocks a drafting request gets
    requests: int  # drafting requests one chain can hold

    @property
    def total_blocks(self) -> int:
        return self.num_kv_blocks + self.per_request * self.requests


def mtp_cache_bytes(cfg: TextConfig, spec: CacheSpec, itemsize: int) -> int:
    """The scratch part of the head's cache (its per-block part is in the runner's kv_bytes_per_block)."""
    scratch = max(spec.num_state_slots, 1) * scratch_blocks_per_request(spec.block_size)
    return scratch * mtp_kv_bytes_per_block(cfg, spec.block_size, itemsize)


def allocate_mtp_cache(ctx: GpuContext, cfg: TextConfig, spec: CacheSpec, dtype: str) -> MtpCache:
    per, requests = scratch_blocks_per_request(spec.block_size), max(spec.num_state_slots, 1)
    shape = (spec.num_kv_blocks + per * requests, spec.block_size, cfg.num_key_value_heads, cfg.head_dim)
    kv = AttentionCache(ctx.empty(shape, dtype, "mtp.k"), ctx.empty(shape, dtype, "mtp.v"))
    for arr in (kv.k, kv.v):
        ctx.device.memset(arr.ptr, 0, arr.nbytes)
    return MtpCache(kv, spec.num_kv_blocks, per, requests)


# ---- host side -------------------------------------------------------------------------------------------------
@dataclass
class Kept:
    """Rows of one sequence's last forward that the head may read: positions [start, start + n)."""

    start: int
    hidden: np.ndarray  # [n, hidden] final-norm hidden states, raw device storage (uint16 bf16 bits or float32)
    tokens: np.ndarray  # int64 [n]: the tokens that ran there
    vision: list[tuple[int, np.ndarray]] = field(default_factory=list)  # (first row, float32 rows) of vision rows


@dataclass
class HeadRows:
    """What one request feeds the head: the hidden rows of its positions and the next tokens' vision rows."""

    hidden: np.ndarray  # [n, hidden] raw
    vision: list[VisionSlice]  # next-token rows embedded as the trunk ran them (vision placeholders)


class KeptRows:
    """The book of kept hidden rows (reference/runner.py keeps the same, in float32)."""

    def __init__(self) -> None:
        self.by_seq: dict[int, Kept] = {}  # the last forward's keep_hidden chunks, until the next forward
        self.last_row: dict[int, Kept] = {}  # state slot -> its last keep_hidden row (the next chunk completes it)

    def clear(self) -> None:
        self.by_seq.clear()
        self.last_row.clear()

    def begin_step(self) -> None:
        self.by_seq.clear()

    def keep(self, chunk: SeqChunk, hidden: np.ndarray, vision: list[tuple[int, np.ndarray]]) -> None:
        """A keep_hidden chunk's rows after its forward; `vision`: (chunk row, float32 rows) of its vision pieces."""
        tokens = np.array(chunk.token_ids, np.int64)  # a copy: the engine's view is rewritten by accepted tokens
        start, prev = chunk.start, self.last_row.get(chunk.state_slot)
        if prev is not None and prev.start == start - 1 and start > 0:
            start -= 1
            hidden, tokens = np.concatenate([prev.hidden, hidden]), np.concatenate([prev.tokens, tokens])
            vision = prev.vision + [(row + 1, rows) for row, rows in vision]
        n = hidden.shape[0]
        self.by_seq[chunk.seq_id] = Kept(start, hidden, tokens, vision)
        tail = [(0, rows[-1:]) for row, rows in vision if row + rows.shape[0] == n]
        self.last_row[chunk.state_slot] = Kept(start + n - 1, hidden[-1:], tokens[-1:], tail)

    def keep_step(self, ctx: GpuContext, batch: StepBatch, cu: np.ndarray, hidden: DArray, hidden_size: int,
                  dtype: str, download: Callable[[DeviceEmbeddings], np.ndarray]) -> None:
        """The final-norm rows of the keep_hidden chunks of `batch` (as the engine sent it), from `hidden` (the
        step's a.h, all its rows; `cu` the step's cumulative run-chunk ends), into the book; a chunk's rows are
        the last ones of its run chunk (re-fed tokens run in front of it)."""
        ends = cu[1:len(batch.chunks) + 1].astype(np.int64)
        keep = [i for i, c in enumerate(batch.chunks) if c.keep_hidden]
        raw = np.empty((int(ends[keep].max()), hidden_size), np.uint16 if dtype == "bf16" else np.float32)
        ctx.device.download(raw, hidden.ptr)  # in stream order, after the step's kernels
        for i in keep:
            chunk = batch.chunks[i]
            vision = [(piece.chunk_offset, download(piece.embeddings) if isinstance(
                piece.embeddings, DeviceEmbeddings) else np.asarray(piece.embeddings, np.float32))
                for piece in chunk.vision]
            self.keep(chunk, raw[int(ends[i]) - chunk.num_tokens:int(ends[i])].copy(), vision)

    def take(self, r: MtpDraftRequest) -> HeadRows:
        """The rows request `r` reads (each sequence's rows serve one request per forward)."""
        kept = self.by_seq.pop(r.seq_id, None)
        n = int(r.next_tokens.shape[0])
        if kept is None or not kept.start <= r.start or r.start + n > kept.start + kept.hidden.shape[0] or n < 1:
            raise RunnerInputError(f"sequence {r.seq_id}: mtp_draft needs the hidden states of positions "
                                   f"[{r.start}, {r.start + n}) from its last forward (keep_hidden)")
        first = r.start - kept.start
        tokens = np.asarray(r.next_tokens, np.int64)
        # next token j ran at kept row first + 1 + j: a vision row there that ran this very token is embedded as
        # it ran (elsewhere the token table's row is what the trunk embedded too)
        same = np.zeros(n, bool)
        inside = min(n, kept.tokens.shape[0] - first - 1)
        if inside > 0:
            same[:inside] = kept.tokens[first + 1:first + 1 + inside] == tokens[:inside]
        slices = []
        for row, rows in kept.vision:
            lo, hi = max(row - first - 1, 0), min(row + rows.shape[0] - first - 1, n)
            j = lo
            while j < hi:  # runs of matching rows
                if not same[j]:
                    j += 1
                    continue
                end = j
                while end < hi and same[end]:
                    end += 1
                src = j + first + 1 - row
                slices.append(VisionSlice(j, rows[src:src + end - j]))
                j = end
        return HeadRows(kept.hidden[first:first + n], slices)


def greedy_request(rows: int) -> SamplingRequest:
    return SamplingRequest(temperature=np.zeros(rows, np.float32), top_k=np.zeros(rows, np.int64),
                           top_p=np.ones(rows, np.float32), min_p=np.zeros(rows, np.float32),
                           uniform=np.zeros(rows), num_logprobs=np.full(rows, -1, np.int64))


@dataclass
class DraftPlan:
    """mtp_draft's requests as head steps: `fill` over every request's rows, then `chain[j]` (one row per drafting
    request, ids from the device) for draft j + 2."""

    fill: HostStep
    hidden: np.ndarray  # [fill.n, hidden] raw: the fill step's hidden input rows
    chain: list[HostStep]
    drafting: list[int]  # requests with drafts, in the order of the logits rows
    num_drafts: list[int]  # per request


def _chain_position(positions: np.ndarray, col: int) -> np.ndarray:
    """Column `col` of M-RoPE positions, extended past the given ones as text runs (every axis + 1)."""
    last = positions.shape[1] - 1
    return positions[:, min(col, last)] + max(0, col - last)


def plan_drafts(requests: list[MtpDraftRequest], rows: list[HeadRows], spec: CacheSpec, cache: MtpCache,
                cfg: TextConfig, dtype: str) -> DraftPlan:
    """The head steps of `requests` (at most cache.requests of them drafting). The chained rows' block tables are
    the sequence's blocks covering its filled positions, then its scratch blocks."""
    bs = spec.block_size
    head_spec = CacheSpec(num_kv_blocks=cache.total_blocks, block_size=bs, num_state_slots=1)
    drafting = [i for i, r in enumerate(requests) if r.num_drafts > 0]
    if len(drafting) > cache.requests:
        raise RunnerInputError(f"{len(drafting)} drafting requests, the head's scratch holds {cache.requests}")
    if any(r.num_drafts - 1 > MAX_CHAINED for r in requests):
        raise RunnerInputError(f"the MTP head chains at most {MAX_CHAINED + 1} drafts a request")
    chunks = []
    for r, head in zip(requests, rows):
        n = int(r.next_tokens.shape[0])
        chunks.append(SeqChunk(seq_id=r.seq_id, token_ids=np.asarray(r.next_tokens, np.int64),
                               positions=np.asarray(r.positions[:, :n], np.int64), start=r.start,
                               block_table=np.asarray(r.block_table, np.int32), state_slot=0, vision=head.vision,
                               logits="last" if r.num_drafts > 0 else "none"))
    p = len(drafting)
    fill = build_step(StepBatch(chunks, sampling=greedy_request(p) if p else None), head_spec, cfg, dtype)
    chain = []
    for j in range(1, max((r.num_drafts for r in requests), default=0)):
        links = []
        for slot, i in enumerate(drafting):
            r = requests[i]
            n = int(r.next_tokens.shape[0])
            own = np.asarray(r.block_table, np.int32)[:-(-(r.start + n) // bs)]
            scratch = cache.num_kv_blocks + slot * cache.per_request + np.arange(cache.per_request, dtype=np.int32)
            links.append(SeqChunk(seq_id=r.seq_id, token_ids=np.zeros(1, np.int64),
                                  positions=_chain_position(np.asarray(r.positions, np.int64), n + j - 1)[:, None],
                                  start=r.start + n + j - 1, block_table=np.concatenate([own, scratch]),
                                  state_slot=0))
        chain.append(build_step(StepBatch(links, sampling=greedy_request(p)), head_spec, cfg, dtype))
    hidden = np.concatenate([h.hidden for h in rows]) if rows else np.zeros((0, cfg.hidden_size), np.float32)
    return DraftPlan(fill, np.ascontiguousarray(hidden), chain, drafting, [r.num_drafts for r in requests])


def draft_in_rounds(head: CudaMtpHead, requests: list[MtpDraftRequest], rows: list[HeadRows], spec: CacheSpec,
                    cache: MtpCache, cfg: TextConfig, dtype: str) -> list[list[int]]:
    """Each request's drafts (none for num_drafts 0), the head run over as many requests at once as its scratch
    holds drafting ones (requests that only fill their KV ride along)."""
    out: list[list[int]] = [[] for _ in requests]
    group: list[int] = []
    for i in range(len(requests) + 1):
        full = sum(requests[j].num_drafts > 0 for j in group) == cache.requests
        if group and (i == len(requests) or (full and requests[i].num_drafts > 0)):
            plan = plan_drafts([requests[j] for j in group], [rows[j] for j in group], spec, cache, cfg, dtype)
            drafts = head.run(plan, cache.kv, spec.block_size)
            for p, g in enumerate(plan.drafting):
                out[group[g]] = drafts[:plan.num_drafts[g], p].tolist()
            group = []
        if i < len(requests):
            group.append(i)
    return out


# ---- device side ----------------------------------------------------------------------------------------------
class CudaMtpHead:
    """Runs a DraftPlan on the device (everything on the context's stream; one download at the end)."""

    def __init__(self, ctx: GpuContext, cfg: TextConfig, weights: MtpWeights, model: CudaTextModel,
                 dtype: str) -> None:
        self.ctx, self.cfg, self.w, self.model, self.dtype = ctx, cfg, weights, model, dtype
        self.sampler = DeviceSampler(ctx, cfg.vocab_size)

    def run(self, plan: DraftPlan, cache: AttentionCache, block_size: int) -> np.ndarray:
        """int64 [max drafts, drafting requests]: draft j of the p-th drafting request at [j, p]."""
        ctx, t, hidden_size = self.ctx, self.dtype, self.cfg.hidden_size
        p, depth = len(plan.drafting), 1 + len(plan.chain)
        mark = ctx.arena.mark()
        try:
            fill = plan.fill
            tables = upload_tables(ctx, fill.tables)
            embeds = ctx.empty((fill.n, hidden_size), t, "mtp.embeds")
            self.model.embed_tokens(embeds, tables.ids)
            if fill.vision_embeds is not None:
                ops.scatter_rows(ctx, embeds, ctx.to_device(fill.vision_embeds, t, "mtp.vision"), tables.vis_rows)
            hidden = ctx.empty((fill.n, hidden_size), t, "mtp.hidden")
            ctx.device.upload(hidden.ptr, plan.hidden)
            if p == 0:
                self._step(fill, tables, embeds, hidden, cache, block_size)
                return np.zeros((0, 0), np.int64)
            sampled = self.sampler.buffers(p)
            logits = ctx.empty((p, self.cfg.vocab_size), "f32", "mtp.logits")
            outs = [ctx.empty((p, hidden_size), t, f"mtp.out{i}") for i in range(2)]
            drafts = ctx.empty((depth, p), "i32", "mtp.drafts")
            self._step(fill, tables, embeds, hidden, cache, block_size, (logits, outs[0], sampled))
            ctx.device.copy(drafts.ptr, sampled.tokens.ptr, p * 4)
            for j, step in enumerate(plan.chain, 1):
                inner = ctx.arena.mark()
                link = upload_tables(ctx, step.tables)
                embeds = ctx.empty((p, hidden_size), t, "mtp.chain-embeds")
                self.model.embed_tokens(embeds, sampled.tokens)  # the previous drafts, still on the device
                self._step(step, link, embeds, outs[(j - 1) % 2], cache, block_size, (logits, outs[j % 2], sampled))
                ctx.device.copy(drafts.ptr + j * p * 4, sampled.tokens.ptr, p * 4)
                ctx.arena.release(inner)
            return ctx.to_host(drafts).astype(np.int64)
        finally:
            ctx.device.sync()
            ctx.arena.release(mark)

    def _step(self, host: HostStep, m: StepTables[DArray], embeds: DArray, hidden: DArray, cache: AttentionCache,
              block_size: int, head: tuple[DArray, DArray, SamplerBuffers] | None = None) -> None:
        """One head step over host.n rows; with `head` (logits, out rows, sampler buffers) also the greedy drafts
        of its logits rows (enqueue only; the step's scratch is released in stream order)."""
        ctx, cfg, t, w = self.ctx, self.cfg, self.dtype, self.w
        n, hs, eps = host.n, cfg.hidden_size, cfg.rms_norm_eps
        mark = ctx.arena.mark()
        joined = ctx.empty((n, 2 * hs), t, "mtp.fc-in")  # [norm(embedding) | norm(hidden)], as fc reads them
        ops.rmsnorm(ctx, joined, embeds, w.pre_fc_norm_embedding, n, hs, eps, True, out_tok_stride=2 * hs)
        ops.rmsnorm(ctx, joined.at(hs), hidden, w.pre_fc_norm_hidden, n, hs, eps, True, out_tok_stride=2 * hs)
        a = Activations(x=ctx.empty((n, hs), t, "mtp.x"), h=ctx.empty((n, hs), t, "mtp.h"),
                        d=ctx.empty((n, hs), t, "mtp.d"))
        w.fc(ctx, a.x, joined, n)
        self.model.decoder_layer(w.layer, a, m, n, host.longest_chunk, cache, block_size, add=False)
        ops.add_rmsnorm(ctx, a.h, a.x, a.d, w.norm, eps, True)  # x += MLP output; h = mtp.norm(x)
        if head is not None and m.sample_params is not None:
            logits, out, sampled = head
            self.model.logits(logits, out, a.h, m.logit_rows, host.logit_rows)
            self.sampler.enqueue(sampled, logits, m.sample_params, host.logit_rows)
        ctx.arena.release(mark)


def build_mtp_head(ctx: GpuContext, cfg: TextConfig, weights: ModelWeights, model: CudaTextModel, dtype: str
                   ) -> tuple[CudaMtpHead | None, str | None]:
    """(the head, None) when the checkpoint has a complete MTP head this runner computes, else (None, why not);
    its weights are uploaded beside the trunk's."""
    problem = mtp_head_problem(cfg, weights)
    if problem is not None:
        return None, problem
    return CudaMtpHead(ctx, cfg, upload_mtp_weights(ctx, cfg, weights, dtype), model, dtype), None

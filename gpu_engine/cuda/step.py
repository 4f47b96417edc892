"""One step of the CUDA runner as the kernels see it: the int32 tables they index with (StepTables), built on the
host from a runner_api.StepBatch (build_step), packed into one array and uploaded once (upload_tables).

Every table is int32. The sampling parameter table (float32) travels in the same upload as its bit pattern, so
that a captured decode graph reads all of a step's metadata from one fixed place.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Generic, TypeVar

import numpy as np

from ..config import TextConfig
from ..errors import RunnerInputError
from ..runner_api import CacheSpec, StepBatch
from ..runner_rules import chunk_problem
from . import deltanet_chunked, flash_plan
from .context import DArray, GpuContext
from .embeddings import DeviceEmbeddings
from .sampler import pack_params

ALIGN_I32 = 64  # pack offsets in elements (256 bytes)
# The sampling parameters of a graph's padding row (pad_step), in sampler.pack_params' order:
# greedy (temperature 0, no top-k / top-p / min-p), no logprobs, no grammar mask.
PAD_SAMPLE_PARAMS = np.array([0.0, 0.0, 1.0, 0.0, 0.5, 0.0, -1.0, -1.0], np.float32)

T = TypeVar("T", np.ndarray, DArray)
SPLIT_MIN_CHUNK = 32  # = text_model.FLASH_MIN_CHUNK: from this chunk length on a step's attention is flash_prefill


@dataclass(frozen=True)
class DeltaNetSplit:
    """Where a mixed step's gated delta rule runs (StepTables.gdn_*): rows [chunk_row, chunk_row + chunk_rows) on
    the chunked kernel, rows [token_row, token_row + token_rows) (one-token sequences only) on the token kernel.
    The two blocks are contiguous, disjoint and cover the step; each kernel reads its block as a step of its own
    (row pointers moved to the block's first row, its tables start at 0). Host facts: not uploaded."""

    chunk_row: int
    chunk_rows: int
    token_row: int
    token_rows: int


@dataclass
class StepTables(Generic[T]):
    """The step's index tables: host int32 arrays (StepTables[np.ndarray]), then device views of their one
    upload (StepTables[DArray]). Rows are the step's tokens, sequence after sequence (n in all)."""

    ids: T  # [n] token ids
    pos: T  # [3, n] M-RoPE positions
    cu: T  # [seqs + 1] first row of each sequence, then n
    slots: T  # [seqs] linear-attention state slot of each sequence
    fresh: T  # [seqs] 1 where the sequence starts in this step (start == 0: its state is zeroed first)
    tok_seq: T  # [n] sequence of each row
    tok_pos: T  # [n] position of each row in its sequence
    kv_slots: T  # [n] cache slot (block * block_size + offset) the row's k/v go to; empty without attention
    tables: T  # [seqs, width] block tables, padded with block 0
    logit_rows: T  # [rows] step rows that get logits, in StepOutput row order
    vis_rows: T  # [v] step rows replaced by host vision embeddings
    tiles: T  # [tiles, 2] flash-prefill query tiles (flash_plan.flash_tiles)
    sample_params: T | None = None  # float32 bits [rows, 8] of the SamplingRequest (sampler.pack_params)
    win: T | None = None  # [seqs] first verify-window row of each sequence, -1 = none (verify.py, window strategy)
    # Steps that carry a prompt chunk of SPLIT_MIN_CHUNK+ tokens beside one-token chunks (decode rows): those rows,
    # their sequences and positions, and the flash-prefill tiles of the other chunks, so that the attention can
    # give the decode rows to the decode kernel (text_model.CudaTextModel.decode_rows_apart). None otherwise.
    dec_rows: T | None = None  # [d] step rows of the one-token chunks
    dec_seq: T | None = None  # [d] their sequences (tok_seq of those rows)
    dec_pos: T | None = None  # [d] their positions (tok_pos of those rows)
    tiles_apart: T | None = None  # [tiles, 2] flash_tiles of the step without the one-token chunks
    # bf16 steps with a chunk of deltanet_chunked.MIN_PREFILL_TOKENS+ tokens and a leading or trailing run of
    # one-token chunks (decode rows): the varlen tables of the two blocks of gdn_split, so that the DeltaNet layer
    # gives the run to the token kernel and the rest to the chunked one (CudaTextModel.deltanet_rows_apart).
    gdn_cu: T | None = None  # [c + 1] cu of the chunk block's c sequences, from its first row (0)
    gdn_slots: T | None = None  # [c] their state slots
    gdn_fresh: T | None = None  # [c] their fresh flags
    gdn_tok_cu: T | None = None  # [d + 1] 0..d: the token block's d one-token sequences
    gdn_tok_slots: T | None = None  # [d]
    gdn_tok_fresh: T | None = None  # [d]
    gdn_split: DeltaNetSplit | None = None  # the blocks' rows (host ints, not a table)

    def items(self) -> list[tuple[str, T]]:
        """(name, table) in field order: the packing order."""
        return [(f.name, getattr(self, f.name)) for f in fields(self)
                if f.name not in HOST_FIELDS and getattr(self, f.name) is not None]


HOST_FIELDS = ("gdn_split",)  # StepTables fields that are not tables: kept by upload_tables, never packed


@dataclass(frozen=True)
class DeviceVisionRows:
    """Rows of a step taken from embeddings already on the device (one item's placeholders are consecutive)."""

    row: int  # first row in the step
    src: int  # device address of the first embedding row
    rows: int
    owner: DeviceEmbeddings  # kept alive until the step is done


@dataclass
class HostStep:
    """Host-side description of one step: its tables plus what does not travel in them."""

    n: int  # tokens of the step
    longest_chunk: int  # picks the prefill kernels (flash attention, chunked delta rule)
    tables: StepTables[np.ndarray]
    logit_rows: int
    vision_embeds: np.ndarray | None  # float32 rows for tables.vis_rows, uploaded with the step's buffers
    device_vision: list[DeviceVisionRows]
    padding: int = 0  # trailing sequences (and logits rows) that pad a step to its graph's shape (pad_step)
    tile_rows: int = flash_plan.FLASH_TILE  # query rows per flash-prefill tile (FLASH_TILE_ROWS of the runner's kernel)

    @property
    def batch_logit_rows(self) -> int:
        """Logits rows of the batch itself (ahead of the padding rows)."""
        return self.logit_rows - self.padding

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every table's shape, and the DeltaNet split's rows (a captured step launches with them)."""
        shapes = {name: arr.shape for name, arr in self.tables.items()}
        split = self.tables.gdn_split
        if split is not None:
            shapes["gdn_split"] = (split.chunk_row, split.chunk_rows, split.token_row, split.token_rows)
        return shapes


def build_step(batch: StepBatch, spec: CacheSpec, cfg: TextConfig, dtype: str,
               table_width: int | None = None, logit_skip: Sequence[int] | None = None,
               tile_rows: int = flash_plan.FLASH_TILE, deltanet_split: bool = False) -> HostStep:
    """Validate `batch` and lay it out; block tables are padded to `table_width` (a captured graph's width).
    `logit_skip[s]`: leading rows of chunk s that get no logits even when it asks for all (tokens the runner
    re-feeds in front of a rolled-back verify window, cuda/verify.py). `tile_rows`: the flash-prefill tiles' rows
    (flash_plan.FLASH_TILE_ROWS of the kernel the model runs, CudaTextModel.flash_tile_rows). `deltanet_split`:
    build the gdn_* tables of a mixed step (only a model that runs them: CudaTextModel.deltanet_rows_apart).

    The per-token tables are built with whole-step numpy operations, not per chunk: a step of 256 decode rows
    is 256 chunks, and per-chunk array work cost ~50 us each on the host while the GPU waited."""
    chunks = batch.chunks
    if not chunks:
        raise RunnerInputError("empty step batch")
    paged = bool(cfg.full_attention_layers)  # a property that builds a tuple: once per step, not per chunk
    for chunk in chunks:
        problem = chunk_problem(chunk, spec, vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, paged_kv=paged)
        if problem:
            raise RunnerInputError(problem)
    seqs = len(chunks)
    lens = np.fromiter((c.token_ids.shape[0] for c in chunks), np.int64, seqs)
    starts = np.fromiter((c.start for c in chunks), np.int64, seqs)
    cu = np.zeros(seqs + 1, np.int64)
    np.cumsum(lens, out=cu[1:])
    n = int(cu[-1])
    tok_seq = np.repeat(np.arange(seqs), lens)
    tok_pos = np.arange(n) + np.repeat(starts - cu[:-1], lens)
    tables = [c.block_table for c in chunks]
    table_lens = [len(t) for t in tables]
    width = table_width or max(1, max(table_lens))
    if max(table_lens) > width:
        raise RunnerInputError(f"block table longer than the captured width {width}")
    block_tables = np.zeros((seqs, width), np.int64)
    for s, t in enumerate(tables):
        block_tables[s, : table_lens[s]] = t
    np.maximum(block_tables, 0, out=block_tables)
    bs = spec.block_size
    # chunk_problem checked that each table covers its chunk with valid ids, so the padded table reads the same.
    kv_slots = block_tables[tok_seq, tok_pos // bs] * bs + tok_pos % bs if paged else np.zeros(0, np.int64)
    logits = [c.logits for c in chunks]
    skip = logit_skip or [0] * seqs
    if all(kind == "last" for kind in logits):
        logit_rows = cu[1:] - 1
    else:
        logit_rows = _cat([cu[s] + np.arange(skip[s], lens[s]) if kind == "all" else cu[s + 1 : s + 2] - 1
                           for s, kind in enumerate(logits) if kind != "none"])
    vis_rows: list[np.ndarray] = []
    vis: list[np.ndarray] = []
    device_vision: list[DeviceVisionRows] = []
    for s, chunk in enumerate(chunks):
        base = int(cu[s])
        for piece in chunk.vision:
            if isinstance(piece.embeddings, DeviceEmbeddings):
                dev = piece.embeddings
                if dev.dtype != dtype:  # shape and rows: chunk_problem
                    raise RunnerInputError(f"sequence {chunk.seq_id}: device vision embeddings are {dev.dtype}, the "
                                           f"runner computes in {dtype}")
                device_vision.append(DeviceVisionRows(base + piece.chunk_offset, dev.ptr, dev.shape[0], dev))
                continue
            emb = np.asarray(piece.embeddings, np.float32)
            vis_rows.append(base + piece.chunk_offset + np.arange(emb.shape[0]))
            vis.append(emb)
    i32 = np.int32
    step_tables: StepTables[np.ndarray] = StepTables(
        ids=np.concatenate([c.token_ids for c in chunks]).astype(i32),
        pos=np.concatenate([c.positions for c in chunks], axis=1).astype(i32), cu=cu.astype(i32),
        slots=np.fromiter((c.state_slot for c in chunks), i32, seqs), fresh=(starts == 0).astype(i32),
        tok_seq=tok_seq.astype(i32), tok_pos=tok_pos.astype(i32), kv_slots=kv_slots.astype(i32),
        tables=block_tables.astype(i32), logit_rows=logit_rows.astype(i32), vis_rows=_cat(vis_rows),
        tiles=flash_plan.flash_tiles(lens.tolist(), tile_rows).astype(i32),
    )
    single = np.flatnonzero(lens == 1)
    if single.size and int(lens.max()) >= SPLIT_MIN_CHUNK:
        rows = cu[single]
        step_tables.dec_rows, step_tables.dec_seq = rows.astype(i32), single.astype(i32)
        step_tables.dec_pos = tok_pos[rows].astype(i32)
        tiles = step_tables.tiles
        step_tables.tiles_apart = tiles[~np.isin(tiles[:, 0], rows)]  # a one-token chunk is one tile, at its row
    if deltanet_split and dtype == "bf16" and single.size and int(lens.max()) >= deltanet_chunked.MIN_PREFILL_TOKENS:
        _split_deltanet(step_tables, lens)
    # Re-fed tokens do not pick the kernels: a decode-phase chunk with a refeed in front (at most 31 + k tokens)
    # stays on the decode kernels, which take chunks of any length, instead of sending the step to flash prefill.
    step = HostStep(n=n, longest_chunk=int((lens - np.asarray(skip, np.int64)).max()), tables=step_tables,
                    logit_rows=int(step_tables.logit_rows.size),
                    vision_embeds=np.concatenate(vis) if vis else None, device_vision=device_vision,
                    tile_rows=tile_rows)
    _add_sampling(batch, step, cfg.vocab_size)
    return step


def _split_deltanet(t: StepTables[np.ndarray], lens: np.ndarray) -> None:
    """The gdn_* tables of a step with a prompt chunk and one-token chunks: the longer of its leading and trailing
    runs of one-token chunks is the token block, the rest (one-token chunks between prompt chunks included) the
    chunk block. Neither kernel takes a row table, so each block must be contiguous; no run: no split."""
    single = lens == 1
    seqs = lens.size
    lead, trail = int(np.argmin(single)), int(np.argmin(single[::-1]))  # there is a chunk of 2+ tokens
    if not lead and not trail:
        return
    tok, chunk = (slice(0, lead), slice(lead, seqs)) if lead >= trail else \
        (slice(seqs - trail, seqs), slice(0, seqs - trail))
    cu = t.cu
    first = int(cu[chunk.start])
    d = tok.stop - tok.start
    t.gdn_cu = cu[chunk.start : chunk.stop + 1] - np.int32(first)
    t.gdn_slots, t.gdn_fresh = t.slots[chunk].copy(), t.fresh[chunk].copy()
    t.gdn_tok_cu = np.arange(d + 1, dtype=np.int32)
    t.gdn_tok_slots, t.gdn_tok_fresh = t.slots[tok].copy(), t.fresh[tok].copy()
    t.gdn_split = DeltaNetSplit(chunk_row=first, chunk_rows=int(cu[chunk.stop]) - first, token_row=int(cu[tok.start]),
                                token_rows=d)


def pad_step(host: HostStep, rows: int, tokens: int, scratch_block: int, block_size: int, scratch_slot: int,
             all_rows: bool = False) -> HostStep:
    """A step of short chunks with last-row logits each (decode tokens, jump-forward runs) grown to `rows`
    sequences and `tokens` tokens, so that it fits a graph captured for that shape (decode_graphs.graph_shape).

    Each padding sequence is a fresh chunk of 1..block_size tokens at position 0 of state slot `scratch_slot`
    (fresh: its state is never read, only written) with its block table and KV slots in `scratch_block` (the
    first ones take the tokens beyond one each). Those two belong to the runner, not to any sequence, so padding
    rows write only there and read only what they wrote; their logits rows come last and are dropped by the
    caller (greedy parameters, no mask, no logprobs when sampled).
    all_rows (steps with verify windows, whose chunks want logits at every token): the logits-row table is grown
    to `tokens` entries instead, padding rows' last rows first, then copies of the step's last row (dropped too)."""
    t = host.tables
    seqs, n = t.slots.size, host.n
    pad_seqs, pad_tokens = rows - seqs, tokens - n
    if host.vision_embeds is not None or host.device_vision or host.padding or (
            t.logit_rows.size != seqs if not all_rows else t.logit_rows.size > n):
        raise RunnerInputError("only steps of chunks with one logits row each (or verify windows) and no vision "
                               "are padded")
    if pad_seqs < 0 or not pad_seqs <= pad_tokens <= pad_seqs * block_size:
        raise RunnerInputError(f"a step of {seqs} sequences and {n} tokens does not pad to {rows} and {tokens} "
                               f"(1..{block_size} tokens a padding sequence)")
    if pad_seqs == 0:
        return fill_logit_rows(host, tokens) if all_rows else host
    i32 = np.int32
    lens = np.ones(pad_seqs, np.int64)  # the tokens past one each, block_size - 1 at a time from the first
    full, rest = divmod(pad_tokens - pad_seqs, max(block_size - 1, 1))
    lens[:full] = block_size
    if full < pad_seqs:
        lens[full] += rest
    pad_cu = n + np.cumsum(lens)
    pos = (np.arange(pad_tokens) - np.repeat(pad_cu - lens - n, lens)).astype(i32)
    tables = StepTables(
        ids=np.concatenate([t.ids, np.zeros(pad_tokens, i32)]),
        pos=np.concatenate([t.pos, np.broadcast_to(pos, (3, pad_tokens))], axis=1),
        cu=np.concatenate([t.cu, pad_cu.astype(i32)]),
        slots=np.concatenate([t.slots, np.full(pad_seqs, scratch_slot, i32)]),
        fresh=np.concatenate([t.fresh, np.ones(pad_seqs, i32)]),
        tok_seq=np.concatenate([t.tok_seq, np.repeat(np.arange(seqs, rows), lens).astype(i32)]),
        tok_pos=np.concatenate([t.tok_pos, pos]),
        kv_slots=np.concatenate([t.kv_slots, scratch_block * block_size + pos]) if t.kv_slots.size else t.kv_slots,
        tables=np.concatenate([t.tables, np.full((pad_seqs, t.tables.shape[1]), scratch_block, i32)]),
        logit_rows=np.concatenate([t.logit_rows, (pad_cu - 1).astype(i32)]),
        vis_rows=t.vis_rows,
        tiles=flash_plan.flash_tiles(np.diff(np.concatenate([t.cu, pad_cu])).tolist(), host.tile_rows).astype(i32),
        sample_params=(None if t.sample_params is None
                       else np.concatenate([t.sample_params, np.tile(PAD_SAMPLE_PARAMS.view(i32), (pad_seqs, 1))])),
        win=None if t.win is None else np.concatenate([t.win, np.full(pad_seqs, -1, i32)]),
    )
    padded = HostStep(n=tokens, longest_chunk=max(host.longest_chunk, int(lens.max())), tables=tables,
                      logit_rows=t.logit_rows.size + pad_seqs, vision_embeds=None, device_vision=[], padding=pad_seqs,
                      tile_rows=host.tile_rows)
    return fill_logit_rows(padded, tokens) if all_rows else padded


def fill_logit_rows(host: HostStep, count: int) -> HostStep:
    """A verify step's logits-row table grown to `count` entries (its graph's token count) with copies of the
    last row, counted as padding (their logits are computed and dropped)."""
    t = host.tables
    extra = count - t.logit_rows.size
    if extra < 0:
        raise RunnerInputError(f"{t.logit_rows.size} logits rows do not fit a graph of {count}")
    if extra == 0:
        return host
    if t.sample_params is not None:
        raise RunnerInputError("verify steps are not sampled on the runner")
    fill = np.full(extra, host.n - 1, np.int32)
    t.logit_rows = np.concatenate([t.logit_rows, fill])
    return HostStep(n=host.n, longest_chunk=host.longest_chunk, tables=t, logit_rows=count,
                    vision_embeds=host.vision_embeds, device_vision=host.device_vision,
                    padding=host.padding + extra, tile_rows=host.tile_rows)


def _add_sampling(batch: StepBatch, step: HostStep, vocab_size: int) -> None:
    """A SamplingRequest's parameter table joins the packed int32 metadata (float32 bits)."""
    if batch.sampling is None:
        return
    problem = batch.sampling.problem(step.logit_rows, vocab_size)
    if problem:
        raise RunnerInputError(problem)
    if batch.sampling.bitmask is not None and batch.sampling.bitmask.shape[0] > max(step.logit_rows, 1):
        raise RunnerInputError("sampling request: more bitmask rows than logits rows")
    step.tables.sample_params = pack_params(batch.sampling).view(np.int32)


def pack_tables(tables: StepTables[np.ndarray]) -> tuple[np.ndarray, dict[str, int]]:
    """All tables in one host int32 array (each piece 256-byte aligned) and their element offsets."""
    offsets, total = {}, 0
    for name, arr in tables.items():
        offsets[name] = total
        total += -(-max(arr.size, 1) // ALIGN_I32) * ALIGN_I32
    host = np.zeros(total, np.int32)
    for name, arr in tables.items():
        host[offsets[name] : offsets[name] + arr.size] = arr.reshape(-1)
    return host, offsets


def upload_tables(ctx: GpuContext, tables: StepTables[np.ndarray]) -> StepTables[DArray]:
    """One upload for all tables; returns typed views into it (an empty table gets a 1-element view)."""
    host, offsets = pack_tables(tables)
    dev = ctx.to_device(host, "i32", "step-meta")
    return StepTables(**{name: dev.view(arr.shape if arr.size else (1,), offsets[name])
                         for name, arr in tables.items()}, gdn_split=tables.gdn_split)


def _cat(xs: list[np.ndarray]) -> np.ndarray:
    return (np.concatenate(xs) if xs else np.zeros(0, np.int64)).astype(np.int32)

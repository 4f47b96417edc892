"""One step of the CUDA runner as the kernels see it: the int32 tables they index with (StepTables), built on the
host from a runner_api.StepBatch (build_step), packed into one array and uploaded once (upload_tables).

Every table is int32. The sampling parameter table (float32) travels in the same upload as its bit pattern, so
that a captured decode graph reads all of a step's metadata from one fixed place.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Generic, TypeVar

import numpy as np

from ..config import TextConfig
from ..errors import RunnerInputError
from ..runner_api import CacheSpec, StepBatch
from ..runner_rules import check_chunk
from . import ops
from .context import DArray, GpuContext
from .embeddings import DeviceEmbeddings
from .sampler import pack_params

ALIGN_I32 = 64  # pack offsets in elements (256 bytes)

T = TypeVar("T", np.ndarray, DArray)


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
    tiles: T  # [tiles, 2] flash-prefill query tiles (ops.flash_tiles)
    sample_params: T | None = None  # float32 bits [rows, 8] of the SamplingRequest (sampler.pack_params)

    def items(self) -> list[tuple[str, T]]:
        """(name, table) in field order: the packing order."""
        return [(f.name, getattr(self, f.name)) for f in fields(self) if getattr(self, f.name) is not None]


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

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: arr.shape for name, arr in self.tables.items()}


def build_step(batch: StepBatch, spec: CacheSpec, cfg: TextConfig, dtype: str,
               table_width: int | None = None) -> HostStep:
    """Validate `batch` and lay it out; block tables are padded to `table_width` (a captured graph's width)."""
    if not batch.chunks:
        raise RunnerInputError("empty step batch")
    ids, pos, cu, slots, fresh = [], [], [], [], []
    tok_seq, tok_pos, kv_slots, logit_rows, vis_rows = [], [], [], [], []
    vis: list[np.ndarray] = []
    device_vision: list[DeviceVisionRows] = []
    tables = []
    base = 0
    for s, chunk in enumerate(batch.chunks):
        check_chunk(chunk, spec, cfg)
        n = chunk.num_tokens
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
                if dev.dtype != dtype:  # shape and rows: chunk_problem
                    raise RunnerInputError(f"sequence {chunk.seq_id}: device vision embeddings are {dev.dtype}, the "
                                           f"runner computes in {dtype}")
                device_vision.append(DeviceVisionRows(base + piece.chunk_offset, dev.ptr, dev.shape[0], dev))
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
    i32 = np.int32
    step_tables: StepTables[np.ndarray] = StepTables(
        ids=_cat(ids), pos=np.concatenate(pos, axis=1).astype(i32), cu=np.array(cu, i32),
        slots=np.array(slots, i32), fresh=np.array(fresh, i32), tok_seq=_cat(tok_seq), tok_pos=_cat(tok_pos),
        kv_slots=_cat(kv_slots), tables=block_tables.astype(i32), logit_rows=_cat(logit_rows),
        vis_rows=_cat(vis_rows), tiles=ops.flash_tiles([c.num_tokens for c in batch.chunks]).astype(i32),
    )
    step = HostStep(n=base, longest_chunk=max(c.num_tokens for c in batch.chunks), tables=step_tables,
                    logit_rows=int(step_tables.logit_rows.size),
                    vision_embeds=np.concatenate(vis) if vis else None, device_vision=device_vision)
    _add_sampling(batch, step, cfg.vocab_size)
    return step


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
                         for name, arr in tables.items()})


def _cat(xs: list[np.ndarray]) -> np.ndarray:
    return (np.concatenate(xs) if xs else np.zeros(0, np.int64)).astype(np.int32)

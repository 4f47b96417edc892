"""Test doubles for the engine-core tests (no tests in this file).

FakeRunner implements the runner contract with exact integer bookkeeping instead of a model: every token writes a
value into its KV slot (token id, or a digest of the vision embedding row that replaced it), the state slot keeps a
running hash, and the logits of a row are pseudo-random numbers seeded by (every value read back through the block
table, the state). So any mistake in block tables, prefix reuse, state restore or vision scatter changes the
output, while a correct engine reproduces one-request-at-a-time results exactly.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from gpu_engine.inputs import ProcessedPrompt, VisionItem
from gpu_engine.runner_api import CacheSpec, StepBatch, StepOutput

_MOD = (1 << 61) - 1


class FakeRunner:
    name = "fake"

    def __init__(self, vocab_size: int = 2074, hidden: int = 4, linear_state: bool = True) -> None:
        self.vocab_size = vocab_size
        self.hidden = hidden
        self.linear_state = linear_state
        self.spec: CacheSpec | None = None
        self.batches: list[list[tuple[int, int, int]]] = []  # per forward: (seq_id, start, num_tokens)
        self.encoded: list[str] = []  # content hashes, in encode order
        self.fail_encode: set[str] = set()  # content hashes whose encoding raises

    def kv_bytes_per_block(self, block_size: int | None = None) -> int:
        return 8 * (block_size or self.spec.block_size)

    def state_bytes_per_slot(self) -> int:
        return 16 if self.linear_state else 0

    def embedding_nbytes(self, item: VisionItem) -> int:
        return item.num_tokens * self.hidden * 4

    def allocate_cache(self, spec: CacheSpec) -> None:
        self.spec = spec
        self.kv = np.full((spec.num_kv_blocks, spec.block_size), -1, dtype=np.int64)
        self.state = np.zeros(spec.num_state_slots, dtype=np.int64)

    def copy_state_slot(self, src: int, dst: int) -> None:
        self.state[dst] = self.state[src]

    def encode_vision(self, item: VisionItem) -> np.ndarray:
        if item.content_hash in self.fail_encode:
            raise ValueError("corrupt image")
        self.encoded.append(item.content_hash)
        rng = np.random.default_rng(int(item.content_hash[:12], 16))
        return rng.standard_normal((item.num_tokens, self.hidden)).astype(np.float32)

    def forward(self, batch: StepBatch) -> StepOutput:
        assert self.spec is not None
        bs = self.spec.block_size
        rows, offsets = [], [0]
        self.batches.append([(c.seq_id, c.start, c.num_tokens) for c in batch.chunks])
        for c in batch.chunks:
            values = c.token_ids.astype(np.int64).copy()
            for v in c.vision:
                emb = np.asarray(v.embeddings)
                digest = np.round(emb.sum(axis=1) * 1000).astype(np.int64) + 10**9
                values[v.chunk_offset : v.chunk_offset + emb.shape[0]] = digest
            if c.start == 0:
                self.state[c.state_slot] = 0
            for i, value in enumerate(values):
                pos = c.start + i
                self.kv[c.block_table[pos // bs], pos % bs] = value * 7 + int(c.positions[0, i])
                if self.linear_state:
                    self.state[c.state_slot] = (int(self.state[c.state_slot]) * 1000003 + int(value)) % _MOD
            if c.logits == "none":
                offsets.append(offsets[-1])
                continue
            last = c.start + c.num_tokens
            history = [self.kv[c.block_table[p // bs], p % bs] for p in range(last)]
            key = hashlib.sha256(np.array(history + [self.state[c.state_slot]], dtype=np.int64).tobytes()).digest()
            rng = np.random.default_rng(int.from_bytes(key[:8], "little"))
            rows.append(rng.standard_normal(self.vocab_size).astype(np.float32) * 3)
            offsets.append(offsets[-1] + 1)
        logits = np.stack(rows) if rows else np.zeros((0, self.vocab_size), np.float32)
        return StepOutput(logits=logits, row_offsets=offsets)


def text_prompt(ids) -> ProcessedPrompt:
    ids = np.asarray(ids, dtype=np.int64)
    return ProcessedPrompt(ids, np.broadcast_to(np.arange(ids.size), (3, ids.size)).copy(), 0, [])


def vision_prompt(rng: np.random.Generator, segments: list, image_token: int = 2060) -> ProcessedPrompt:
    """segments: ints (that many random text tokens) or ("image", n_tokens, content_tag) items."""
    ids: list[int] = []
    items: list[VisionItem] = []
    for seg in segments:
        if isinstance(seg, int):
            ids.extend(rng.integers(0, 2000, size=seg).tolist())
        else:
            _, n, tag = seg
            items.append(VisionItem(
                kind="image", pixel_values=np.zeros((4 * n, 8), np.float32), grid_thw=(1, 2, 2 * n),
                token_start=len(ids), num_tokens=n, content_hash=hashlib.sha256(str(tag).encode()).hexdigest(),
            ))
            ids.extend([image_token] * n)
    arr = np.asarray(ids, dtype=np.int64)
    return ProcessedPrompt(arr, np.broadcast_to(np.arange(arr.size), (3, arr.size)).copy(), 0, items)


def tiny_tokenizer(folder: Path):
    from gpu_engine.tiny_assets import write_tokenizer_files
    from gpu_engine.tokenizer import Tokenizer

    write_tokenizer_files(folder)
    return Tokenizer.from_pretrained(folder)

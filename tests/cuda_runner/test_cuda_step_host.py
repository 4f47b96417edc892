"""gpu_engine.cuda.step on the CPU: the tables a CUDA step is laid out in, their one packed upload, and the
refusals (the runner's own words, shared with the reference runner)."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from gpu_engine.cuda.step import ALIGN_I32, StepTables, build_step, pack_tables
from gpu_engine.errors import RunnerInputError
from gpu_engine.runner_api import (
    CacheSpec,
    SamplingRequest,
    SeqChunk,
    StepBatch,
    VisionSlice,
)

SPEC = CacheSpec(num_kv_blocks=8, block_size=4, num_state_slots=3)
CFG = SimpleNamespace(vocab_size=50, hidden_size=6, full_attention_layers=[1])


def chunk(seq: int, start: int, n: int, table: list[int], slot: int, logits: str = "last", **kw) -> SeqChunk:
    pos = np.tile(np.arange(start, start + n), (3, 1))
    return SeqChunk(seq_id=seq, token_ids=np.arange(n) + seq, positions=pos, start=start,
                    block_table=np.array(table, np.int32), state_slot=slot, logits=logits, **kw)  # type: ignore[arg-type]  # logits: str here


def test_a_prefill_chunk_and_a_decode_token_are_laid_out_row_after_row():
    emb = np.ones((2, 6), np.float32)
    batch = StepBatch([chunk(0, 0, 5, [3, 1], 2, "all", vision=[VisionSlice(1, emb)]), chunk(1, 6, 1, [4, 5], 0)])
    step = build_step(batch, SPEC, CFG, "bf16")
    t = step.tables
    assert step.n == 6 and step.longest_chunk == 5 and step.logit_rows == 6
    assert t.cu.tolist() == [0, 5, 6] and t.slots.tolist() == [2, 0] and t.fresh.tolist() == [1, 0]
    assert t.tok_seq.tolist() == [0] * 5 + [1] and t.tok_pos.tolist() == [0, 1, 2, 3, 4, 6]
    # position p of a sequence goes to block table[p // 4], offset p % 4
    assert t.kv_slots.tolist() == [12, 13, 14, 15, 4, 5 * 4 + 2]
    assert t.tables.tolist() == [[3, 1], [4, 5]] and t.logit_rows.tolist() == [0, 1, 2, 3, 4, 5]
    assert t.vis_rows.tolist() == [1, 2] and step.vision_embeds is not None and step.vision_embeds.shape == (2, 6)
    assert t.pos.shape == (3, 6) and t.sample_params is None
    assert all(arr.dtype == np.int32 for _, arr in t.items())


def test_tables_pack_into_one_aligned_array_in_field_order():
    step = build_step(StepBatch([chunk(0, 0, 3, [0], 0)]), SPEC, CFG, "f32")
    host, offsets = pack_tables(step.tables)
    names = [name for name, _ in step.tables.items()]
    assert list(offsets) == names and all(o % ALIGN_I32 == 0 for o in offsets.values())
    for name, arr in step.tables.items():
        assert host[offsets[name]: offsets[name] + arr.size].tolist() == arr.reshape(-1).tolist()


def test_sampling_parameters_travel_with_the_tables():
    r = 1
    request = SamplingRequest(temperature=np.zeros(r, np.float32), top_k=np.zeros(r, np.int64),
                              top_p=np.ones(r, np.float32), min_p=np.zeros(r, np.float32),
                              uniform=np.full(r, 0.5), num_logprobs=np.full(r, -1, np.int64))
    step = build_step(StepBatch([chunk(0, 0, 2, [0], 0)], sampling=request), SPEC, CFG, "bf16")
    assert step.tables.sample_params is not None and step.tables.sample_params.shape == (1, 8)
    assert step.tables.items()[-1][0] == "sample_params"
    with pytest.raises(RunnerInputError, match="sampling request has 1 rows, the step has 2"):
        build_step(StepBatch([chunk(0, 0, 2, [0], 0, "all")], sampling=request), SPEC, CFG, "bf16")


def test_graph_width_padding_and_refusals():
    step = build_step(StepBatch([chunk(0, 4, 1, [2, 7], 1)]), SPEC, CFG, "bf16", table_width=4)
    assert step.tables.tables.tolist() == [[2, 7, 0, 0]]
    with pytest.raises(RunnerInputError, match="captured width 1"):
        build_step(StepBatch([chunk(0, 4, 1, [2, 7], 1)]), SPEC, CFG, "bf16", table_width=1)
    with pytest.raises(RunnerInputError, match="empty step batch"):
        build_step(StepBatch([]), SPEC, CFG, "bf16")
    with pytest.raises(RunnerInputError, match="state slot 3 out of range"):
        build_step(StepBatch([chunk(0, 0, 1, [0], 3)]), SPEC, CFG, "bf16")


def test_step_tables_is_one_definition_for_host_and_device():
    assert StepTables.__dataclass_fields__.keys() >= {"ids", "pos", "kv_slots", "tiles", "sample_params"}


def layout_chunk_by_chunk(batch: StepBatch, spec: CacheSpec, width: int) -> dict[str, list]:
    """The tables as the step's rules define them, one chunk at a time (the pre-vectorised build_step's loop)."""
    out: dict[str, list] = {k: [] for k in ("ids", "tok_seq", "tok_pos", "kv_slots", "logit_rows", "vis_rows")}
    cu, base, tables = [], 0, []
    for s, c in enumerate(batch.chunks):
        n, p = c.num_tokens, np.arange(c.start, c.start + c.num_tokens)
        table = np.asarray(c.block_table, np.int64)
        out["kv_slots"] += (table[p // spec.block_size] * spec.block_size + p % spec.block_size).tolist()
        out["ids"] += c.token_ids.tolist()
        out["tok_seq"] += [s] * n
        out["tok_pos"] += p.tolist()
        if c.logits == "all":
            out["logit_rows"] += list(range(base, base + n))
        elif c.logits == "last":
            out["logit_rows"].append(base + n - 1)
        for piece in c.vision:
            out["vis_rows"] += list(range(base + piece.chunk_offset, base + piece.chunk_offset + len(piece.embeddings)))
        cu.append(base)
        tables.append(np.maximum(table, 0).tolist() + [0] * (width - len(table)))
        base += n
    out["cu"] = cu + [base]
    out["tables"] = tables
    out["slots"] = [c.state_slot for c in batch.chunks]
    out["fresh"] = [int(c.start == 0) for c in batch.chunks]
    return out


@pytest.mark.parametrize("seed", range(6))
def test_whole_step_layout_equals_the_chunk_by_chunk_rules(seed):
    """Random steps of decode rows, prompt chunks (some fresh, some continuing, with vision rows) and every logits
    kind (even seeds: decode rows only, every chunk "last"): build_step's whole-step arrays equal the
    chunk-by-chunk layout."""
    rng = np.random.default_rng(seed)
    spec = CacheSpec(num_kv_blocks=64, block_size=4, num_state_slots=40)
    chunks = []
    for s in range(int(rng.integers(1, 30))):
        decode = seed % 2 == 0 or rng.random() < 0.6
        start = int(rng.integers(0, 40)) if decode or rng.random() < 0.5 else 0
        n = 1 if decode else int(rng.integers(1, 70))
        blocks = -(-(start + n) // 4) + int(rng.integers(0, 2))
        table = rng.choice(64, size=blocks, replace=False).astype(np.int32)
        if blocks > -(-(start + n) // 4):
            table[-1] = -1  # an unused trailing entry: padded with block 0
        vision = [VisionSlice(int(off), np.ones((int(rows), 6), np.float32))
                  for off, rows in ([(rng.integers(0, n // 2), rng.integers(1, n // 2 + 1))] if n > 3 else [])]
        kind = "last" if decode else str(rng.choice(["last", "all", "none"]))
        c = chunk(s, start, n, table.tolist(), s, kind, vision=vision)
        c.token_ids = rng.integers(0, 50, n)
        chunks.append(c)
    batch = StepBatch(chunks)
    width = max(len(c.block_table) for c in chunks) + int(rng.integers(0, 3))
    step = build_step(batch, spec, CFG, "bf16", table_width=width)
    want = layout_chunk_by_chunk(batch, spec, width)
    t = step.tables
    for name, expected in want.items():
        assert getattr(t, name).tolist() == expected, name
    assert t.pos.tolist() == np.concatenate([c.positions for c in chunks], axis=1).tolist()
    assert step.n == want["cu"][-1] and step.longest_chunk == max(c.num_tokens for c in chunks)
    assert step.logit_rows == len(want["logit_rows"])
    assert all(arr.dtype == np.int32 for _, arr in t.items())

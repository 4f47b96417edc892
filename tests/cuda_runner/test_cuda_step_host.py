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

"""A mixed step's decode rows apart from its prompt chunk (step.StepTables.dec_rows, CudaTextModel.decode_rows_apart)
on the CPU: the host tables, and the launches of the attention layer with and without it. The numbers are the
GPU's (check_runner with the option on: not yet run)."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from gpu_engine.cuda import ops
from gpu_engine.cuda.context import DArray
from gpu_engine.cuda.linear import DenseLinear
from gpu_engine.cuda.step import SPLIT_MIN_CHUNK, StepTables, build_step
from gpu_engine.cuda.text_model import FLASH_MIN_CHUNK, AttentionCache, CudaTextModel
from gpu_engine.cuda.weights import AttentionWeights
from gpu_engine.runner_api import CacheSpec, SeqChunk, StepBatch

SPEC = CacheSpec(num_kv_blocks=64, block_size=16, num_state_slots=6)
CFG = SimpleNamespace(vocab_size=50, hidden_size=6, full_attention_layers=[0])


def chunk(seq: int, start: int, n: int) -> SeqChunk:
    table = np.arange(seq * 8, seq * 8 + 8, dtype=np.int32)
    return SeqChunk(seq_id=seq, token_ids=np.arange(n) % 50, positions=np.tile(np.arange(start, start + n), (3, 1)),
                    start=start, block_table=table, state_slot=seq)


def mixed_batch() -> StepBatch:
    # decode rows around a 70-token prompt chunk (two flash tiles) and a 2-token jump-forward run
    return StepBatch([chunk(0, 40, 1), chunk(1, 0, 70), chunk(2, 90, 1), chunk(3, 5, 2), chunk(4, 17, 1)])


def test_the_thresholds_agree():
    assert SPLIT_MIN_CHUNK == FLASH_MIN_CHUNK


def test_a_mixed_step_lists_its_one_token_rows_and_the_other_chunks_tiles():
    t = build_step(mixed_batch(), SPEC, CFG, "bf16").tables
    assert t.dec_rows is not None and t.dec_seq is not None and t.dec_pos is not None and t.tiles_apart is not None
    assert t.dec_rows.tolist() == [0, 71, 74] and t.dec_seq.tolist() == [0, 2, 4] and t.dec_pos.tolist() == [40, 90, 17]
    assert t.tiles.tolist() == [[0, 1], [1, 64], [65, 6], [71, 1], [72, 2], [74, 1]]
    assert t.tiles_apart.tolist() == [[1, 64], [65, 6], [72, 2]]
    assert all(arr.dtype == np.int32 for _, arr in t.items())


def test_decode_only_and_short_chunk_steps_carry_no_split():
    for batch in (StepBatch([chunk(0, 40, 1), chunk(2, 90, 1)]),
                  StepBatch([chunk(0, 40, 1), chunk(1, 0, SPLIT_MIN_CHUNK - 1)]),
                  StepBatch([chunk(1, 0, 70), chunk(3, 5, 2)])):
        t = build_step(batch, SPEC, CFG, "bf16").tables
        assert t.dec_rows is None and t.dec_seq is None and t.dec_pos is None and t.tiles_apart is None


class LaunchLog:
    """empty() hands out distinct pointers; launches and cuBLASLt calls are recorded; the arena is a counter."""

    def __init__(self) -> None:
        self._next = 1 << 20
        self.calls: list[tuple[str, tuple]] = []
        self.arena = SimpleNamespace(mark=lambda: 0, release=lambda mark: None)
        self.device = SimpleNamespace(launch=lambda module, kernel, grid, block, *args, shmem=0:
                                      self.calls.append((kernel, (grid, block, *args))),
                                      info=SimpleNamespace(sm_count=132))
        self.blas = SimpleNamespace(linear=lambda *a, **k: self.calls.append(("blas.linear", a)))

    def empty(self, shape: tuple[int, ...], dtype: str, name: str) -> DArray:
        ptr, self._next = self._next, self._next + (1 << 24)
        return DArray(ptr, tuple(shape), dtype)

    def to_device(self, host: np.ndarray, dtype: str, name: str) -> DArray:
        return self.empty(host.shape, dtype, name)


def _attention_launches(apart: bool) -> tuple[list[tuple[str, tuple]], StepTables[DArray], LaunchLog]:
    nh, kvh, hd = 8, 2, 256
    config = SimpleNamespace(num_attention_heads=nh, num_key_value_heads=kvh, head_dim=hd, rotary_dim=64,
                             rms_norm_eps=1e-6, rope_theta=1e7, mrope_section=[11, 11, 10], hidden_size=64)
    ctx = LaunchLog()
    model = CudaTextModel(ctx, config, weights=None, dtype="bf16")  # type: ignore[arg-type]  # weights unused here
    model.decode_rows_apart = apart
    host = build_step(mixed_batch(), SPEC, CFG, "bf16")  # type: ignore[arg-type]  # CFG: the fields it reads
    m = StepTables(**{name: ctx.empty(arr.shape if arr.size else (1,), "i32", name)
                      for name, arr in host.tables.items()})
    width = (2 * nh + 2 * kvh) * hd
    w = AttentionWeights(qkv=DenseLinear(ctx.empty((width, 64), "bf16", "wqkv")),
                         q_norm=ctx.empty((hd,), "bf16", "qn"), k_norm=ctx.empty((hd,), "bf16", "kn"),
                         o_proj=DenseLinear(ctx.empty((64, nh * hd), "bf16", "wo")))
    a = SimpleNamespace(h=ctx.empty((host.n, 64), "bf16", "h"), d=ctx.empty((host.n, 64), "bf16", "d"))
    cache = AttentionCache(ctx.empty((64, 16, kvh, hd), "bf16", "k"), ctx.empty((64, 16, kvh, hd), "bf16", "v"))
    ctx.calls.clear()
    model._attention(w, a, m, host.n, host.longest_chunk, cache, 16)  # type: ignore[arg-type]  # a: stand-in
    return ctx.calls, m, ctx


def test_without_the_option_every_row_goes_to_flash_prefill():
    calls, m, _ = _attention_launches(apart=False)
    names = [c[0] for c in calls]
    assert names == ["blas.linear", "qk_norm_rope_store_bf16", "flash_prefill_bf16_hd256", "blas.linear"]
    # grid, block, then out, q, q_stride, gate, gate_stride, gate_hs, k, v, tables, width, tok_seq, tok_pos, tiles
    assert calls[2][1][2 + 12] == m.tiles.ptr


def test_with_the_option_the_decode_rows_take_the_decode_kernel_and_come_back_to_their_rows():
    calls, m, ctx = _attention_launches(apart=True)
    names = [c[0] for c in calls]
    assert names == ["blas.linear", "qk_norm_rope_store_bf16", "flash_prefill_bf16_hd256", "embed_gather_bf16",
                     "embed_gather_bf16", "paged_attention_mma_bf16_hd256", "attention_combine_bf16",
                     "scatter_rows_bf16", "blas.linear"]
    assert m.tiles_apart is not None and m.dec_rows is not None and m.dec_seq is not None and m.dec_pos is not None
    flash = calls[2][1]
    assert flash[0] == (8, m.tiles_apart.shape[0]) and flash[2 + 12] == m.tiles_apart.ptr  # 3 tiles, not 6
    attn_out = flash[2]
    gather_q, gather_proj, mma, _, scatter = calls[3][1], calls[4][1], calls[5][1], calls[6][1], calls[7][1]
    assert gather_q[0] == 3 and gather_q[4] == m.dec_rows.ptr and gather_proj[4] == m.dec_rows.ptr
    grid = mma[0]
    assert grid[:2] == (3, 2)  # the 3 decode rows x 2 KV heads
    # part_acc, part_ml, q, q_stride, k, v, tables, width, token_seq, token_pos
    assert mma[2 + 8] == m.dec_seq.ptr and mma[2 + 9] == m.dec_pos.ptr
    assert scatter[2] == attn_out and scatter[4] == m.dec_rows.ptr  # out[dec_rows[i]] = decode output row i
    assert ops.attention_splits(ctx, 3, 2, waves=8) == grid[2]


def test_the_option_is_on_by_default_and_read_from_the_environment():
    from gpu_engine.cuda.options import CudaOptions

    assert CudaOptions().decode_rows_apart is True
    assert CudaOptions.from_env({"DOCPIPE_CUDA_DECODE_ROWS_APART": "1"}).decode_rows_apart is True
    assert CudaOptions.from_env({"DOCPIPE_CUDA_DECODE_ROWS_APART": "0"}).decode_rows_apart is False

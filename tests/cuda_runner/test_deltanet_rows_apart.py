"""A mixed step's one-token rows apart from its prompt chunks in the DeltaNet layer (step.DeltaNetSplit,
CudaTextModel.deltanet_rows_apart) on the CPU: the host tables, the launches with and without the option, and a
numpy model of the two launches against the whole step's token-by-token reference. The GPU check is
check_decode_rows_apart (its "deltanet" rows)."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from gpu_engine.cuda import deltanet_chunked, ops
from gpu_engine.cuda.context import DArray
from gpu_engine.cuda.linear import DenseLinear
from gpu_engine.cuda.options import CudaOptions
from gpu_engine.cuda.step import DeltaNetSplit, StepTables, build_step, pad_step, upload_tables
from gpu_engine.cuda.text_model import CudaTextModel, DeltaNetCache
from gpu_engine.cuda.weights import DeltaNetWeights
from gpu_engine.runner_api import CacheSpec, SeqChunk, StepBatch
from tests.cuda_runner import chunked_delta_emulation as emu
from tests.cuda_runner.test_decode_rows_apart import LaunchLog

SPEC = CacheSpec(num_kv_blocks=64, block_size=16, num_state_slots=12)
CFG = SimpleNamespace(vocab_size=50, hidden_size=6, full_attention_layers=[])
MIN = deltanet_chunked.MIN_PREFILL_TOKENS


def chunk(seq: int, start: int, n: int) -> SeqChunk:
    table = np.arange(seq * 4, seq * 4 + 4, dtype=np.int32)
    return SeqChunk(seq_id=seq, token_ids=np.arange(n) % 50, positions=np.tile(np.arange(start, start + n), (3, 1)),
                    start=start, block_table=table, state_slot=seq)


def steps(lens: list[int], fresh_every: int = 3) -> StepBatch:
    """Chunks of `lens` tokens; every `fresh_every`-th one starts its sequence (fresh), the others continue."""
    return StepBatch([chunk(s, 0 if s % fresh_every == 0 else 5 + s, n) for s, n in enumerate(lens)])


def tables(lens: list[int], dtype: str = "bf16") -> StepTables[np.ndarray]:
    return build_step(steps(lens), SPEC, CFG, dtype,  # type: ignore[arg-type]  # CFG: the fields it reads
                      deltanet_split=True).tables


def test_leading_decode_rows_are_the_token_block():
    t = tables([1, 1, 70, 100])
    assert t.gdn_split == DeltaNetSplit(chunk_row=2, chunk_rows=170, token_row=0, token_rows=2)
    assert t.gdn_cu is not None and t.gdn_cu.tolist() == [0, 70, 170]
    assert t.gdn_slots is not None and t.gdn_slots.tolist() == [2, 3]
    assert t.gdn_fresh is not None and t.gdn_fresh.tolist() == [0, 1]
    assert t.gdn_tok_cu is not None and t.gdn_tok_cu.tolist() == [0, 1, 2]
    assert t.gdn_tok_slots is not None and t.gdn_tok_slots.tolist() == [0, 1]
    assert t.gdn_tok_fresh is not None and t.gdn_tok_fresh.tolist() == [1, 0]
    assert all(arr.dtype == np.int32 for _, arr in t.items())
    assert "gdn_split" not in dict(t.items())  # host ints: not packed


def test_trailing_decode_rows_are_the_token_block():
    t = tables([MIN, 2, 1, 1, 1])
    assert t.gdn_split == DeltaNetSplit(chunk_row=0, chunk_rows=MIN + 2, token_row=MIN + 2, token_rows=3)
    assert t.gdn_cu is not None and t.gdn_cu.tolist() == [0, MIN, MIN + 2]
    assert t.gdn_tok_slots is not None and t.gdn_tok_slots.tolist() == [2, 3, 4]


def test_the_longer_run_is_apart_and_the_chunk_block_keeps_the_other_rows():
    t = tables([1, 70, 1, 5, 1, 1])  # leading run 1, trailing run 2; the 1 between chunks stays with them
    assert t.gdn_split == DeltaNetSplit(chunk_row=0, chunk_rows=77, token_row=77, token_rows=2)
    assert t.gdn_cu is not None and t.gdn_cu.tolist() == [0, 1, 71, 72, 77]


@pytest.mark.parametrize("lens, dtype", [([70, 1, 80], "bf16"),  # one-token rows only between chunks
                                         ([1, 1, 70], "f32"),  # no chunked kernel in fp32 runs
                                         ([1, 1, 1], "bf16"),  # decode step
                                         ([70, 100], "bf16"),  # prefill step
                                         ([1, MIN - 1, 1], "bf16")])  # chunks too short for the chunked kernel
def test_steps_without_a_split(lens, dtype):
    t = tables(lens, dtype)
    assert t.gdn_split is None and t.gdn_cu is None and t.gdn_tok_cu is None and t.gdn_tok_slots is None


def test_the_split_travels_with_the_upload_and_the_shapes_and_padding_drops_it():
    host = build_step(steps([1, 1, 70]), SPEC, CFG, "bf16", deltanet_split=True)  # type: ignore[arg-type]
    assert host.shapes()["gdn_split"] == (2, 70, 0, 2)
    dev = upload_tables(LaunchLog(), host.tables)  # type: ignore[arg-type]  # to_device: a pointer, no copy
    assert dev.gdn_split == host.tables.gdn_split and dev.gdn_tok_cu is not None and dev.gdn_tok_cu.shape == (3,)
    padded = pad_step(host, rows=4, tokens=74, scratch_block=63, block_size=16, scratch_slot=11)
    assert padded.tables.gdn_split is None and padded.tables.gdn_cu is None and "gdn_split" not in padded.shapes()


# ---- the launches ---------------------------------------------------------------------------------------------
KH, VH, DK, DV, KW, HIDDEN = 2, 4, 128, 128, 4, 64
CONV_DIM, VDIM = 2 * KH * DK + VH * DV, VH * DV
WIDTH = CONV_DIM + VDIM + 2 * VH


def layer_launches(lens: list[int], apart: bool) -> tuple[list[tuple[str, tuple]], StepTables[DArray]]:
    config = SimpleNamespace(linear_num_key_heads=KH, linear_num_value_heads=VH, linear_key_head_dim=DK,
                             linear_value_head_dim=DV, linear_conv_dim=CONV_DIM, linear_value_dim=VDIM,
                             rms_norm_eps=1e-6, hidden_size=HIDDEN, rope_theta=1e7, rotary_dim=64,
                             mrope_section=[11, 11, 10])
    ctx = LaunchLog()
    ctx.device.info.sm_count = 1  # 32-column scan slices whatever the grid (the kernel names say which)
    model = CudaTextModel(ctx, config, weights=None, dtype="bf16")  # type: ignore[arg-type]  # weights unused here
    model.deltanet_rows_apart = apart
    host = build_step(steps(lens), SPEC, CFG, "bf16", deltanet_split=True)  # type: ignore[arg-type]
    m = StepTables(**{name: ctx.empty(arr.shape if arr.size else (1,), "i32", name)
                      for name, arr in host.tables.items()}, gdn_split=host.tables.gdn_split)
    w = DeltaNetWeights(in_proj=DenseLinear(ctx.empty((WIDTH, HIDDEN), "bf16", "win")),
                        conv=ctx.empty((CONV_DIM, KW), "bf16", "conv"), A_log=ctx.empty((VH,), "f32", "A"),
                        dt_bias=ctx.empty((VH,), "f32", "dt"), norm=ctx.empty((DV,), "bf16", "norm"),
                        out_proj=DenseLinear(ctx.empty((HIDDEN, VDIM), "bf16", "wout")))
    a = SimpleNamespace(h=ctx.empty((host.n, HIDDEN), "bf16", "h"), d=ctx.empty((host.n, HIDDEN), "bf16", "d"))
    cache = DeltaNetCache(conv=ctx.empty((12, KW - 1, CONV_DIM), "bf16", "cc"),
                          state=ctx.empty((12, VH, DV, DK), "f32", "st"))
    ctx.calls.clear()
    model._deltanet(w, a, m, host.n, host.longest_chunk, cache)  # type: ignore[arg-type]  # a: stand-in
    return ctx.calls, m


def kernels(calls: list[tuple[str, tuple]]) -> list[str]:
    return [name for name, _ in calls if name.startswith(("gdn_", "gated_delta_rule"))]


def test_a_mixed_step_without_the_option_runs_every_row_chunked():
    calls, m = layer_launches([1] * 5 + [70, 90], apart=False)
    assert kernels(calls) == ["gdn_chunk_prep_dk128_dv128", "gdn_chunk_states_dk128_dv128",
                              "gdn_chunk_output_dk128_dv128"]
    prep = dict(calls)["gdn_chunk_prep_dk128_dv128"]
    assert prep[0] == (deltanet_chunked.chunk_slots(165, 7), VH) and prep[2 + 15] == m.cu.ptr


@pytest.mark.parametrize("lens, token_row, chunk_row", [([1] * 5 + [70, 90], 0, 5), ([70, 90] + [1] * 5, 160, 0)])
def test_a_mixed_step_gives_its_chunks_to_the_chunked_kernel_and_its_decode_rows_to_the_token_kernel(
        lens, token_row, chunk_row):
    whole, _ = layer_launches(lens, apart=False)
    calls, m = layer_launches(lens, apart=True)
    assert kernels(calls) == ["gdn_chunk_prep_dk128_dv128", "gdn_chunk_states_dk128_dv128",
                              "gdn_chunk_output_dk128_dv128", "gated_delta_rule_bf16"]
    assert m.gdn_cu is not None and m.gdn_slots is not None and m.gdn_fresh is not None
    assert m.gdn_tok_cu is not None and m.gdn_tok_slots is not None and m.gdn_tok_fresh is not None
    base, by = dict(whole), dict(calls)
    # prep: grid, block, W, U, Qd, KdT, P, gc, q, k, v, qkv_stride, a, b, ab_stride, A_log, dt_bias, cu, seqs
    prep, prep0 = by["gdn_chunk_prep_dk128_dv128"], base["gdn_chunk_prep_dk128_dv128"]
    assert prep[0] == (deltanet_chunked.chunk_slots(160, 2), VH) and prep[2 + 15] == m.gdn_cu.ptr
    assert int(prep[2 + 16]) == 2
    for i, row_width in ((6, CONV_DIM), (7, CONV_DIM), (8, CONV_DIM), (10, WIDTH), (11, WIDTH)):  # q k v a b
        assert prep[2 + i] == prep0[2 + i] + 2 * chunk_row * row_width
    # states: ..., cu, state_slots, fresh, v_heads (the chunk block's 2 sequences)
    states = by["gdn_chunk_states_dk128_dv128"]
    assert states[0][2] == 2 and states[-4:-1] == (m.gdn_cu.ptr, m.gdn_slots.ptr, m.gdn_fresh.ptr)
    out, out0 = by["gdn_chunk_output_dk128_dv128"], base["gdn_chunk_output_dk128_dv128"]
    assert out[2] == out0[2] + 2 * chunk_row * VDIM  # the chunk block's rows of `core`
    # token kernel: out, q, k, v, qkv_stride, a, b, ab_stride, A_log, dt_bias, state, cu, slots, fresh, ...
    tok = by["gated_delta_rule_bf16"]
    assert tok[0] == ((DV + 7) // 8, VH, 5)  # one block column per decode row's sequence
    assert tok[2] == out0[2] + 2 * token_row * VDIM
    conv_ptr, proj_ptr = prep0[2 + 6], prep0[2 + 11] - 2 * (CONV_DIM + VDIM)  # the whole step's row 0
    for i, col in ((1, 0), (2, KH * DK), (3, 2 * KH * DK)):  # q k v: the decode rows' conv output
        assert tok[2 + i] == conv_ptr + 2 * (token_row * CONV_DIM + col)
    for i, col in ((5, CONV_DIM + VDIM + VH), (6, CONV_DIM + VDIM)):  # a b: their in_proj columns
        assert tok[2 + i] == proj_ptr + 2 * (token_row * WIDTH + col)
    assert tok[2 + 11:2 + 14] == (m.gdn_tok_cu.ptr, m.gdn_tok_slots.ptr, m.gdn_tok_fresh.ptr)


@pytest.mark.parametrize("lens, expect", [([1] * 6, ["gated_delta_rule_bf16"]),
                                          ([70, 90], ["gdn_chunk_prep_dk128_dv128", "gdn_chunk_states_dk128_dv128",
                                                      "gdn_chunk_output_dk128_dv128"])])
def test_decode_and_prefill_steps_are_unchanged_by_the_option(lens, expect):
    off, m_off = layer_launches(lens, apart=False)
    on, m_on = layer_launches(lens, apart=True)
    assert kernels(on) == kernels(off) == expect
    assert on == off and m_on.gdn_split is None  # same launches, same arguments (the whole step's tables)
    assert m_on.cu.ptr in [arg for _, call in on for arg in call]


def test_the_option_is_off_by_default_and_read_from_the_environment():
    assert CudaOptions().deltanet_rows_apart is False  # opt-in until its GPU check has run
    assert CudaOptions.from_env({}).deltanet_rows_apart is False
    assert CudaOptions.from_env({"DOCPIPE_CUDA_DELTANET_ROWS_APART": "1"}).deltanet_rows_apart is True
    assert CudaOptions.from_env({"DOCPIPE_CUDA_DELTANET_ROWS_APART": "0"}).deltanet_rows_apart is False


# ---- the math of the two launches -----------------------------------------------------------------------------
def _layout(rng: np.random.Generator, trailing: bool) -> list[int]:
    decode = [1] * int(rng.integers(1, 7))
    body = [int(x) for x in rng.integers(2, 150, int(rng.integers(1, 4)))] + [int(rng.integers(MIN, 200))]
    body = list(rng.permutation(body)) + ([1] if rng.random() < 0.5 else [])  # sometimes a 1 inside the block
    body = [int(x) for x in body]
    if rng.random() < 0.5:
        body.insert(int(rng.integers(1, len(body) + 1)), 1)
    return body + decode if trailing else decode + body


@pytest.mark.parametrize("seed", range(6))
def test_the_two_launches_equal_the_whole_step_token_reference(seed):
    """Per block as its kernel sees it (inputs sliced at the block's first row, its own tables): the chunked
    emulation (float64 algebra) on the chunk block, the token rule on the decode rows; out and state equal the
    token-by-token rule over the whole step."""
    rng = np.random.default_rng(seed)
    lens = _layout(rng, trailing=bool(seed % 2))
    t = tables(lens)
    split = t.gdn_split
    assert split is not None and t.gdn_cu is not None and t.gdn_tok_cu is not None
    assert t.gdn_tok_slots is not None and t.gdn_tok_fresh is not None
    assert t.gdn_slots is not None and t.gdn_fresh is not None
    n, kh, vh, dk, dv = int(t.cu[-1]), 1, 2, 16, 8
    rows = sorted([(split.chunk_row, split.chunk_rows), (split.token_row, split.token_rows)])
    assert rows[0][0] == 0 and rows[0][0] + rows[0][1] == rows[1][0] and rows[1][0] + rows[1][1] == n
    q, k = rng.standard_normal((n, kh, dk)), rng.standard_normal((n, kh, dk))
    v = rng.standard_normal((n, vh, dv))
    a, b = rng.standard_normal((n, vh)), rng.standard_normal((n, vh))
    A_log, dt_bias = rng.standard_normal(vh) * 0.3, rng.standard_normal(vh) * 0.3
    state = rng.standard_normal((SPEC.num_state_slots, vh, dv, dk))
    want_out, want_state = emu.token_reference_fast(q, k, v, a, b, A_log, dt_bias, state, t.cu, t.slots, t.fresh)

    def block(row: int, count: int) -> tuple[np.ndarray, ...]:
        r = slice(row, row + count)
        return q[r], k[r], v[r], a[r], b[r], A_log, dt_bias

    out = np.full((n, vh * dv), np.nan)
    c0, c = split.chunk_row, split.chunk_rows
    out[c0:c0 + c], state1 = emu.chunked_gated_delta_rule(*block(c0, c), state, t.gdn_cu, t.gdn_slots, t.gdn_fresh,
                                                           variant="states")
    t0, d = split.token_row, split.token_rows
    assert (np.diff(t.cu)[t.tok_seq[t0:t0 + d]] == 1).all()  # the token block holds one-token chunks only
    out[t0:t0 + d], state2 = emu.token_reference_fast(*block(t0, d), state1, t.gdn_tok_cu, t.gdn_tok_slots,
                                                      t.gdn_tok_fresh)
    assert not set(t.gdn_slots.tolist()) & set(t.gdn_tok_slots.tolist())  # disjoint state slots
    np.testing.assert_allclose(out, want_out, rtol=0, atol=1e-9)
    np.testing.assert_allclose(state2, want_state, rtol=0, atol=1e-9)

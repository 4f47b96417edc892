"""CPU checks of the chunked (WY-form) gated delta rule that kernels/deltanet_chunked.cu implements, through its
float64 numpy emulation (tests/cuda_runner/chunked_delta_emulation.py): exact algebra against the token-by-token
reference and transformers, the chunk-slot numbering, and the bf16 rounding budget the GPU check's tolerance relies
on."""
from __future__ import annotations

import numpy as np
import pytest
from ci_rule import require_module

from tests.cuda_runner import chunked_delta_emulation as emu


def _batch(rng: np.random.Generator, lens: list[int], kh: int, vh: int, dk: int, dv: int, num_slots: int,
           a_shift: float = 0.0) -> dict:
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    n = int(cu[-1])
    return {
        "q": rng.standard_normal((n, kh, dk)), "k": rng.standard_normal((n, kh, dk)),
        "v": rng.standard_normal((n, vh, dv)),
        "a": rng.standard_normal((n, vh)) + a_shift, "b": rng.standard_normal((n, vh)),
        "A_log": np.log(rng.uniform(0.5, 8.0, vh)), "dt_bias": rng.standard_normal(vh) * 0.5,
        "state": rng.standard_normal((num_slots, vh, dv, dk)) * 0.3, "cu_seqlens": cu,
        "state_slots": rng.choice(num_slots, len(lens), replace=False).astype(np.int32),
        "fresh": rng.integers(0, 2, len(lens)).astype(np.int32),
    }


def _max_rel(x: np.ndarray, y: np.ndarray) -> float:
    return float(np.abs(x - y).max() / max(np.abs(y).max(), 1e-300))


@pytest.mark.parametrize("lens, kh, vh, dk, dv", [
    ([1, 63, 64, 65, 130, 0, 200], 2, 6, 16, 40),   # GQA 3:1, dv not a multiple of the slice, empty sequence
    ([129], 1, 1, 32, 32),
    ([5, 300], 2, 2, 24, 64),
])
def test_chunked_algebra_equals_token_by_token(lens, kh, vh, dk, dv) -> None:
    rng = np.random.default_rng()
    batch = _batch(rng, lens, kh, vh, dk, dv, num_slots=len(lens) + 2)
    batch["fresh"][0], batch["fresh"][-1] = 1, 0  # both kinds always present
    out, state = emu.chunked_gated_delta_rule(**batch)
    ref_out, ref_state = emu.token_reference_batch(**batch)
    assert _max_rel(out, ref_out) < 1e-10
    assert _max_rel(state, ref_state) < 1e-10
    untouched = np.setdiff1d(np.arange(batch["state"].shape[0]), batch["state_slots"])
    assert np.array_equal(state[untouched], batch["state"][untouched])


def test_slow_decay_long_sequence_stays_exact() -> None:
    """Decay close to 1 (a far negative): the state carries across many chunks; still exact algebra."""
    rng = np.random.default_rng()
    batch = _batch(rng, [700], 1, 2, 32, 32, num_slots=1, a_shift=-8.0)
    out, state = emu.chunked_gated_delta_rule(**batch)
    ref_out, ref_state = emu.token_reference_batch(**batch)
    assert _max_rel(out, ref_out) < 1e-10
    assert _max_rel(state, ref_state) < 1e-10


def test_strong_decay_has_no_overflow() -> None:
    """g down to about -1e3 per token: exponents are differences G_i - G_j (i >= j), nothing overflows."""
    rng = np.random.default_rng()
    batch = _batch(rng, [150], 1, 1, 16, 16, num_slots=1, a_shift=40.0)
    batch["A_log"][:] = np.log(30.0)
    with np.errstate(over="raise", invalid="raise"):
        out, state = emu.chunked_gated_delta_rule(**batch)
    ref_out, ref_state = emu.token_reference_batch(**batch)
    assert np.all(np.isfinite(out)) and np.all(np.isfinite(state))
    assert _max_rel(out, ref_out) < 1e-10


def test_matches_transformers_chunk_and_recurrent() -> None:
    torch = require_module("torch")
    mod = require_module("transformers.models.qwen3_next.modeling_qwen3_next")
    rng = np.random.default_rng()
    kh, vh, dk, dv, n = 2, 4, 32, 32, 150
    batch = _batch(rng, [n], kh, vh, dk, dv, num_slots=1)
    batch["fresh"][:] = 0
    out, state = emu.chunked_gated_delta_rule(**batch)
    rep = vh // kh
    t = lambda x: torch.tensor(x, dtype=torch.float32)[None]
    q = t(np.repeat(batch["q"], rep, axis=1))
    k = t(np.repeat(batch["k"], rep, axis=1))
    g = -np.exp(batch["A_log"]) * np.log1p(np.exp(batch["a"] + batch["dt_bias"]))
    beta = 1.0 / (1.0 + np.exp(-batch["b"]))
    init = t(batch["state"][0].transpose(0, 2, 1))  # ours [VH, dv, dk] -> theirs [VH, dk, dv]
    for fn in (mod.torch_chunk_gated_delta_rule, mod.torch_recurrent_gated_delta_rule):
        o, s = fn(q, k, t(batch["v"]), t(g), t(beta), initial_state=init, output_final_state=True,
                  use_qk_l2norm_in_kernel=True)
        assert _max_rel(out, o[0].double().numpy().reshape(n, vh * dv)) < 1e-4, fn.__name__
        assert _max_rel(state[0], s[0].double().numpy().transpose(0, 2, 1)) < 1e-4, fn.__name__


def test_chunk_slots_are_disjoint_and_bounded() -> None:
    rng = np.random.default_rng()
    for _ in range(200):
        lens = rng.integers(0, 300, rng.integers(1, 12))
        cu = np.concatenate([[0], np.cumsum(lens)])
        seqs, n = len(lens), int(cu[-1])
        used: set[int] = set()
        for s in range(seqs):
            base = emu.chunk_slot_base(cu, s)
            mine = set(range(base, base + -(-int(lens[s]) // emu.CHUNK)))
            assert not used & mine
            used |= mine
        assert max(used, default=-1) < emu.num_chunk_slots(n, seqs)


def test_forward_substitution_inverse() -> None:
    rng = np.random.default_rng()
    A = np.tril(rng.standard_normal((3, 64, 64)) * 0.1, -1)
    T = emu.forward_substitution_inverse(A)
    assert np.allclose(T @ (np.eye(64) + A), np.eye(64), atol=1e-12)


def test_bf16_rounding_budget() -> None:
    """The bf16 rounding points of the kernel (emulated) stay well inside the GPU check's 1e-2 tolerance at the
    real head size, with a decay slow enough to carry the state across the chunks."""
    rng = np.random.default_rng()
    batch = _batch(rng, [40, 400], 1, 2, 128, 128, num_slots=2, a_shift=-4.0)
    exact_out, exact_state = emu.chunked_gated_delta_rule(**batch)
    out, state = emu.chunked_gated_delta_rule(**batch, bf16=True)
    rel = lambda x, y: np.linalg.norm(x - y) / np.linalg.norm(y)
    assert 1e-4 < rel(out, exact_out) < 5e-3  # it does round (the flag works) but not by much
    assert rel(state, exact_state) < 5e-3


def test_fast_token_reference_matches_the_plain_one() -> None:
    rng = np.random.default_rng()
    batch = _batch(rng, [3, 0, 70, 41], 2, 4, 16, 8, num_slots=5)
    out, state = emu.token_reference_fast(**batch)
    ref_out, ref_state = emu.token_reference_batch(**batch)
    assert _max_rel(out, ref_out) < 1e-12
    assert _max_rel(state, ref_state) < 1e-12


@pytest.mark.parametrize("dv_slice", [16, 32])
def test_slice_width_does_not_change_the_result(dv_slice) -> None:
    """The scan's 16- and 32-column slices (gdn_chunk_scan16 / gdn_chunk_scan) split only the value columns."""
    rng = np.random.default_rng()
    batch = _batch(rng, [70, 1, 140], 1, 2, 32, 64, num_slots=5)
    batch["fresh"][0], batch["fresh"][-1] = 1, 0
    out, state = emu.chunked_gated_delta_rule(**batch, dv_slice=dv_slice)
    ref_out, ref_state = emu.token_reference_batch(**batch)
    assert _max_rel(out, ref_out) < 1e-10
    assert _max_rel(state, ref_state) < 1e-10


@pytest.mark.parametrize("lens, kh, vh, dk, dv, dv_slice", [
    ([1, 63, 64, 65, 130, 0, 200], 2, 6, 16, 40, 32),  # partial last chunks, an empty sequence, dv not a slice multiple
    ([129, 5, 300], 1, 2, 32, 64, 16),
])
def test_states_variant_equals_token_by_token(lens, kh, vh, dk, dv, dv_slice) -> None:
    """The states variant (state-only scan storing Sc and V', then O = Qd Sc + P V' per chunk) is the same exact
    algebra: float64 against the token-by-token rule, fresh and continued sequences of different lengths."""
    rng = np.random.default_rng()
    batch = _batch(rng, lens, kh, vh, dk, dv, num_slots=len(lens) + 2, a_shift=-2.0)
    batch["fresh"][0], batch["fresh"][-1] = 1, 0
    out, state = emu.chunked_gated_delta_rule(**batch, dv_slice=dv_slice, variant="states")
    ref_out, ref_state = emu.token_reference_batch(**batch)
    assert _max_rel(out, ref_out) < 1e-10
    assert _max_rel(state, ref_state) < 1e-10
    untouched = np.setdiff1d(np.arange(batch["state"].shape[0]), batch["state_slots"])
    assert np.array_equal(state[untouched], batch["state"][untouched])


@pytest.mark.parametrize("dv_slice", [16, 32])
def test_states_variant_rounds_where_current_does(dv_slice) -> None:
    """With the kernels' bf16 rounding points emulated, the states variant gives the current variant's numbers (to
    float64 summation order: the two store and reuse the same rounded Sc and V'), which is why the GPU check can hold
    it to the same tolerance; and both round (they differ from the exact algebra by the usual bf16 budget)."""
    rng = np.random.default_rng()
    batch = _batch(rng, [40, 200, 1], 1, 2, 128, 64, num_slots=4, a_shift=-4.0)
    batch["fresh"][:] = 0
    cur_out, cur_state = emu.chunked_gated_delta_rule(**batch, bf16=True, dv_slice=dv_slice)
    out, state = emu.chunked_gated_delta_rule(**batch, bf16=True, dv_slice=dv_slice, variant="states")
    assert _max_rel(out, cur_out) < 1e-12
    assert _max_rel(state, cur_state) < 1e-12
    exact_out, _ = emu.chunked_gated_delta_rule(**batch, variant="states")
    assert 1e-4 < np.linalg.norm(out - exact_out) / np.linalg.norm(exact_out) < 5e-3


def test_unknown_variant_is_refused() -> None:
    rng = np.random.default_rng()
    with pytest.raises(ValueError, match="variant"):
        emu.chunked_gated_delta_rule(**_batch(rng, [3], 1, 1, 16, 16, num_slots=1), variant="fast")

"""Sampler vs independent per-row numpy computations (fresh random logits every run).

Tolerances: masks are compared exactly (random float logits have no ties); log-probabilities to 1e-5 absolute
(float32 log-softmax); empirical token frequencies to 4 standard errors.
"""
from __future__ import annotations

import llguidance.numpy as llnp
import numpy as np
import pytest

from gpu_engine.params import SamplingParams
from gpu_engine.sampling import (
    SamplingRows,
    apply_penalties,
    bitmask_to_bool,
    filter_logits,
    log_softmax,
    sample,
)

V = 97


def fresh_logits(rows: int) -> np.ndarray:
    return np.random.default_rng().standard_normal((rows, V)).astype(np.float32) * 2


def ref_softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def ref_keep(row: np.ndarray, k: int, p: float, min_p: float) -> np.ndarray:
    """Which tokens survive top-k, then top-p over the renormalised top-k set, then min-p — one row, by sorting."""
    keep = np.ones(V, bool)
    order = np.argsort(-row)
    if k > 0:
        keep[:] = False
        keep[order[:k]] = True
    if p < 1.0:
        probs = ref_softmax(np.where(keep, row, -np.inf))
        mass, chosen = 0.0, np.zeros(V, bool)
        for t in order:
            if not keep[t]:
                continue
            chosen[t] = True
            mass += probs[t]
            if mass >= p:
                break
        keep &= chosen
    if min_p > 0:
        probs = ref_softmax(np.where(keep, row, -np.inf))
        keep &= probs >= min_p * probs.max()
    return keep


@pytest.mark.parametrize("k,p,min_p", [(5, 1.0, 0.0), (0, 0.7, 0.0), (0, 1.0, 0.2), (10, 0.5, 0.05), (1, 0.9, 0.0),
                                       (0, 0.01, 0.0), (V, 1.0, 0.0)])
def test_filter_masks_match_reference(k, p, min_p):
    x = fresh_logits(6)
    n = x.shape[0]
    out = filter_logits(x, np.full(n, k), np.full(n, p, np.float32), np.full(n, min_p, np.float32))
    for i in range(n):
        assert np.array_equal(np.isfinite(out[i]), ref_keep(x[i].astype(np.float64), k, p, min_p)), i
        assert np.array_equal(out[i][np.isfinite(out[i])], x[i][np.isfinite(out[i])])


def test_filter_mixed_rows_are_independent():
    x = fresh_logits(4)
    ks = np.array([0, 3, 0, 7])
    ps, mps = np.array([1.0, 1.0, 0.6, 0.8], np.float32), np.array([0, 0, 0, 0.1], np.float32)
    out = filter_logits(x, ks, ps, mps)
    for i in range(4):
        assert np.array_equal(np.isfinite(out[i]), ref_keep(x[i].astype(np.float64), ks[i], ps[i], mps[i]))


def test_penalties_match_reference():
    x = fresh_logits(3)
    prompt_out = [np.array([1, 5, 5, 9, 40]), np.array([2, 3]), np.array([7, 8, 7])]
    output = [np.array([9, 40, 40]), np.array([], np.int64), np.array([7])]
    params = [SamplingParams(repetition_penalty=1.3, presence_penalty=0.5), SamplingParams(presence_penalty=2.0),
              SamplingParams(repetition_penalty=0.8)]
    got = x.copy()
    apply_penalties(got, SamplingRows.from_params(params), prompt_out, output)
    want = x.copy()
    for i, sp in enumerate(params):
        for t in set(prompt_out[i].tolist()):
            v = want[i, t]
            want[i, t] = v / sp.repetition_penalty if v > 0 else v * sp.repetition_penalty
        for t in set(output[i].tolist()):
            want[i, t] -= sp.presence_penalty
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_bitmask_unpack_matches_llguidance_kernel():
    rng = np.random.default_rng()
    vocab = 1000
    mask = llnp.allocate_token_bitmask(3, vocab)
    mask[:] = rng.integers(-(2**31), 2**31 - 1, size=mask.shape, dtype=np.int64).astype(np.int32)
    logits = np.zeros((3, vocab), np.float32)
    llnp.apply_token_bitmask_inplace(logits, mask)
    assert np.array_equal(bitmask_to_bool(mask, vocab), np.isfinite(logits))


def test_greedy_and_logprobs():
    x = fresh_logits(5)
    params = [SamplingParams(logprobs=True, top_logprobs=3)] * 4 + [SamplingParams()]
    res = sample(x.copy(), SamplingRows.from_params(params), [np.random.default_rng(0)] * 5)
    assert np.array_equal(res.token_ids, np.argmax(x, axis=1))
    for i in range(4):
        ref = x[i].astype(np.float64) - np.log(np.sum(np.exp(x[i].astype(np.float64))))
        assert abs(res.logprobs[i] - ref[res.token_ids[i]]) < 1e-5
        top = np.argsort(-ref)[:3]
        assert [t for t, _ in res.top[i]] == top.tolist()
        np.testing.assert_allclose([lp for _, lp in res.top[i]], ref[top], atol=1e-5)
    assert np.isnan(res.logprobs[4]) and res.top[4] == []


def test_seeded_sampling_is_reproducible_and_batch_independent():
    x = fresh_logits(3)
    sp = SamplingParams(temperature=0.9, top_k=20, top_p=0.95, seed=123)
    rows = SamplingRows.from_params([sp])

    def run(seed, batch_with_others):
        rng = np.random.default_rng(seed)
        toks = []
        for step in range(30):
            logits = x[[0]] + step * 0.01
            if batch_with_others:  # other requests in the batch draw from their own generators
                logits = np.concatenate([x[1:2], logits, x[2:3]])
                r = SamplingRows.from_params([SamplingParams(temperature=1.0), sp, SamplingParams(temperature=2.0)])
                res = sample(logits.copy(), r, [np.random.default_rng(), rng, np.random.default_rng()])
                toks.append(int(res.token_ids[1]))
            else:
                toks.append(int(sample(logits.copy(), rows, [rng]).token_ids[0]))
        return toks

    a, b, c = run(123, False), run(123, True), run(124, False)
    assert a == b
    assert a != c


def test_temperature_sampling_follows_the_distribution():
    row = fresh_logits(1)
    params = SamplingParams(temperature=0.7, top_k=8)
    rows = SamplingRows.from_params([params] * 1)
    rng = np.random.default_rng()
    draws = 4000
    counts = np.zeros(V)
    for _ in range(draws):
        counts[sample(row.copy(), rows, [rng]).token_ids[0]] += 1
    keep = ref_keep(row[0].astype(np.float64) / 0.7, 8, 1.0, 0.0)
    p = ref_softmax(np.where(keep, row[0].astype(np.float64) / 0.7, -np.inf))
    assert counts[~keep].sum() == 0
    se = np.sqrt(p * (1 - p) / draws)
    assert np.all(np.abs(counts / draws - p) <= 4 * se + 1e-9)


def test_log_softmax_handles_masked_rows():
    x = np.array([[0.0, -np.inf, 1.0]], np.float32)
    lp = log_softmax(x)
    assert lp[0, 1] == -np.inf
    np.testing.assert_allclose(np.exp(lp[0, [0, 2]]).sum(), 1.0, rtol=1e-6)


def test_bitmask_allows_any_reads_the_words_like_the_unpacked_mask() -> None:
    from gpu_engine.sampling import bitmask_allows_any

    rng = np.random.default_rng(3)
    for vocab in (32, 33, 100, 248320 + 7):
        words = -(-vocab // 32)
        mask = np.zeros((6, words), np.int32)
        mask[1, rng.integers(words)] = np.int32(1 << int(rng.integers(31)))  # one allowed token somewhere
        mask[2] = rng.integers(-2**31, 2**31 - 1, words, dtype=np.int64).astype(np.int32)
        mask[3, -1] = np.int32(-2**31)  # the top bit of the last word: a token only when vocab % 32 == 0
        mask[4, 0] = 1  # token 0
        if vocab % 32:
            mask[5, -1] = np.int32(1 << (vocab % 32 - 1))  # the last real token
        assert np.array_equal(bitmask_allows_any(mask, vocab), bitmask_to_bool(mask, vocab).any(axis=1)), vocab

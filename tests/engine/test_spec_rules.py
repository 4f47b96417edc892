"""Speculative decoding, unit level: prompt lookup finds the continuation it should, and the rejection rule leaves
the target distribution unchanged (chi-square on a tiny vocabulary, with a point-mass drafter and a drafter that
has a distribution of its own)."""
from __future__ import annotations

import numpy as np
import pytest

from gpu_engine.sampling import SamplingRows
from gpu_engine.speculative.config import SpeculativeConfig, SpeculativeConfigError
from gpu_engine.speculative.ngram import find_continuation
from gpu_engine.speculative.rejection import choose, logprob_entries, target_probs


def ids(*xs: int) -> np.ndarray:
    return np.array(xs, dtype=np.int64)


def test_lookup_takes_the_latest_earlier_match_of_the_longest_tail() -> None:
    tokens = ids(1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3)
    # tail (1, 2, 3) occurs at 0 and 5; the latest is followed by 7, 8, 5
    assert find_continuation(tokens, None, 3, 2, 3) == [7, 8, 5]
    assert find_continuation(tokens, None, 1, 2, 3) == [7]


def test_lookup_falls_back_to_shorter_tails_then_the_lookup_text() -> None:
    tokens = ids(4, 2, 3, 6, 1, 2, 3)  # (1, 2, 3) is new, (2, 3) was followed by 6
    assert find_continuation(tokens, None, 2, 2, 3) == [6, 1]
    tokens = ids(10, 11, 12)
    page = ids(5, 10, 11, 12, 13, 14, 15, 16)
    assert find_continuation(tokens, page, 3, 2, 3) == [13, 14, 15]
    assert find_continuation(tokens, None, 3, 2, 3) == []
    assert find_continuation(ids(10, 11, 12), ids(10, 11, 12), 3, 2, 3) == []  # a match with nothing after it
    assert find_continuation(tokens, page, 0, 2, 3) == []


def test_config_is_checked() -> None:
    with pytest.raises(SpeculativeConfigError, match="num_tokens"):
        SpeculativeConfig(num_tokens=-1)
    with pytest.raises(SpeculativeConfigError, match="ngram_min"):
        SpeculativeConfig(ngram_min=3, ngram_max=2)
    assert not SpeculativeConfig(num_tokens=0).enabled


def rows(temperature: float, top_k: int = 0, top_p: float = 1.0) -> SamplingRows:
    return SamplingRows.from_rows([(temperature, top_k, top_p, 0.0, 1.0, 0.0, -1)])


LOGITS = np.log(np.array([0.30, 0.25, 0.15, 0.12, 0.08, 0.05, 0.03, 0.02], np.float32))


# chi-square 0.999 quantiles for 1 ... 8 degrees of freedom (a false alarm once in a thousand seeds)
_CHI2_999 = [10.83, 13.82, 16.27, 18.47, 20.52, 22.46, 24.32, 26.12]


def fits(counts: np.ndarray, probs: np.ndarray) -> bool:
    """Chi-square goodness of fit of `counts` to `probs` at the 0.001 level."""
    keep = probs > 0
    assert counts[~keep].sum() == 0  # never a token the target cannot produce
    expected = probs[keep] / probs[keep].sum() * counts.sum()
    stat = float(((counts[keep] - expected) ** 2 / expected).sum())
    return stat < _CHI2_999[int(keep.sum()) - 2]


def draw(n: int, draft: int, table: SamplingRows, q: np.ndarray | None, seed: int) -> tuple[np.ndarray, float]:
    rng = np.random.default_rng(seed)
    counts = np.zeros(LOGITS.shape[0], np.int64)
    accepted = 0
    for _ in range(n):
        t = choose(LOGITS, table, draft, rng, q)
        counts[t] += 1
        accepted += t == draft
    return counts, accepted / n


@pytest.mark.parametrize("draft", [0, 3, 7])
def test_point_mass_drafts_leave_the_distribution_unchanged(draft: int) -> None:
    table = rows(1.0)
    p = target_probs(LOGITS, table)
    counts, acc = draw(20000, draft, table, None, seed=draft)
    assert fits(counts, p)
    assert acc == pytest.approx(p[draft], abs=0.015)  # accepted exactly as often as the target picks it


def test_drafts_with_their_own_distribution_and_filtered_targets() -> None:
    table = rows(0.7, top_k=5)
    p = target_probs(LOGITS, table)
    assert np.count_nonzero(p) == 5
    q = np.full(8, 1 / 8)  # a uniform drafter: over-proposes the tail, under-proposes the head
    counts = np.zeros(8, np.int64)
    rng = np.random.default_rng(7)
    for _ in range(20000):
        d = int(rng.choice(8, p=q))
        counts[choose(LOGITS, table, d, rng, q)] += 1
    assert fits(counts, p)


def test_a_draft_outside_the_top_k_is_always_rejected_and_greedy_is_argmax() -> None:
    counts, acc = draw(2000, 7, rows(1.0, top_k=2), None, seed=1)
    assert acc == 0 and counts[2:].sum() == 0
    rng = np.random.default_rng(0)
    assert all(choose(LOGITS, rows(0.0), d, rng) == 0 for d in range(8))


def test_logprob_entries_match_the_sampler() -> None:
    lp, top = logprob_entries(LOGITS, 2, 3)
    assert lp == pytest.approx(np.log(0.15), abs=1e-6)
    assert [t for t, _ in top] == [0, 1, 2]
    assert logprob_entries(LOGITS, 2, -1)[1] == []


def test_the_fit_test_has_power() -> None:
    """Accepting every draft (no rejection rule) must fail the same test: the draft's share is far above p."""
    p = target_probs(LOGITS, rows(1.0))
    rng = np.random.default_rng(3)
    counts = np.bincount(rng.choice(8, size=20000, p=p / p.sum()), minlength=8)
    assert fits(counts, p)
    counts[3] += 2000  # 10 % more of one token
    assert not fits(counts, p)

"""The mixed request stream and its statistics (bench/stream_requests.py)."""
from __future__ import annotations

import math

import numpy as np
import pytest
from stream_requests import RequestTiming, check_timings, make_stream, percentiles, summarize


def _linear_percentile(values: list[float], q: float) -> float:
    """Independent reference: linear interpolation between order statistics at rank q/100 * (n - 1)."""
    s = sorted(values)
    rank = q / 100 * (len(s) - 1)
    lo, hi = math.floor(rank), math.ceil(rank)
    return s[lo] + (s[hi] - s[lo]) * (rank - lo)


def test_stream_is_seeded_and_half_images() -> None:
    a = make_stream(9, seed=3, min_side=64, max_side=160)
    b = make_stream(9, seed=3, min_side=64, max_side=160)
    c = make_stream(9, seed=4, min_side=64, max_side=160)
    assert [r.arrival_s for r in a] == [r.arrival_s for r in b]
    assert [r.kind for r in a] == [r.kind for r in b]
    assert sum(r.kind == "image" for r in a) == 4 and len(a) == 9
    for ra, rb in zip(a, b):
        if ra.kind == "image":
            pa, pb = (np.asarray(r.messages[0]["content"][0]["image"]) for r in (ra, rb))
            assert np.array_equal(pa, pb) and pa.shape == (ra.image_size[1], ra.image_size[0], 3)
            assert all(64 <= s <= 160 and s % 32 == 0 for s in ra.image_size)
        else:
            assert ra.messages == rb.messages and isinstance(ra.messages[0]["content"], str)
    assert [r.arrival_s for r in a] != [r.arrival_s for r in c]
    arrivals = [r.arrival_s for r in a]
    assert arrivals[0] == 0.0 and arrivals == sorted(arrivals)


def test_stream_mean_gap_matches_its_parameter() -> None:
    reqs = make_stream(600, seed=1, mean_gap_s=0.02, min_side=32, max_side=32)
    gaps = np.diff([r.arrival_s for r in reqs])
    # exponential gaps: the mean of 599 has a standard error of 0.02 / sqrt(599) ~ 8e-4; 5 sigma bound
    assert abs(gaps.mean() - 0.02) < 5 * 0.02 / math.sqrt(gaps.size)


def test_stream_text_length_range() -> None:
    reqs = make_stream(20, seed=2, text_words=(30, 40), min_side=32, max_side=32)
    for r in reqs:
        if r.kind == "text":
            words = r.messages[0]["content"].split(": ", 1)[1].split()
            assert 30 <= len(words) <= 40


@pytest.mark.parametrize("kwargs", [{"n": 0}, {"n": 4, "mean_gap_s": -1.0}, {"n": 4, "text_words": (5, 2)},
                                    {"n": 4, "min_side": 100, "max_side": 50},
                                    {"n": 4, "min_side": 33, "max_side": 40}])
def test_stream_rejects_bad_parameters(kwargs: dict) -> None:
    n = kwargs.pop("n")
    with pytest.raises(ValueError):
        make_stream(n, seed=0, **kwargs)


def _timing(i: int, kind: str, ttft: float, latency: float, tokens: int = 8, reason: str = "length") -> RequestTiming:
    return RequestTiming(i, kind, submitted=100.0, first_token=100.0 + ttft, finished=100.0 + latency,
                         prompt_tokens=50, completion_tokens=tokens, finish_reason=reason)


def test_summarize_percentiles_and_rates() -> None:
    rng = np.random.default_rng()
    ttft = rng.uniform(0.01, 0.5, 21).tolist()
    extra = rng.uniform(0.1, 1.0, 21).tolist()
    timings = [_timing(i, "image" if i % 3 == 0 else "text", t, t + e) for i, (t, e) in enumerate(zip(ttft, extra))]
    timings.append(RequestTiming(99, "text", submitted=0.0, finish_reason="error", error="boom"))
    s = summarize(timings, wall_s=4.0)
    lat = [t + e for t, e in zip(ttft, extra)]
    assert s["completed"] == 21 and s["requests"] == 22
    for q in (50, 95):
        assert s["all"][f"ttft_p{q}_s"] == pytest.approx(_linear_percentile(ttft, q), rel=1e-12)
        assert s["all"][f"latency_p{q}_s"] == pytest.approx(_linear_percentile(lat, q), rel=1e-12)
    images = [t for i, t in enumerate(ttft) if i % 3 == 0]
    assert s["image"]["count"] == 7 and s["image"]["ttft_p50_s"] == pytest.approx(_linear_percentile(images, 50))
    assert s["tokens_per_s"] == pytest.approx(21 * 8 / 4.0) and s["images_per_s"] == pytest.approx(7 / 4.0)
    assert s["prompt_tokens_per_s"] == pytest.approx(21 * 50 / 4.0)


def test_summarize_empty_group_and_bad_wall() -> None:
    s = summarize([_timing(0, "text", 0.1, 0.2)], wall_s=1.0)
    assert s["image"] == {"count": 0, "ttft_p50_s": None, "ttft_p95_s": None, "latency_p50_s": None,
                          "latency_p95_s": None}
    assert percentiles([]) == {"p50": None, "p95": None}
    with pytest.raises(ValueError):
        summarize([], wall_s=0.0)


def test_check_timings_flags_every_kind_of_wrong_output() -> None:
    good = _timing(0, "text", 0.1, 0.2, tokens=8)
    good.logprobs = [-1.0] * 8
    short = _timing(1, "image", 0.1, 0.2, tokens=7)
    stopped = _timing(2, "text", 0.1, 0.2, tokens=8, reason="stop")
    nan = _timing(3, "text", 0.1, 0.2, tokens=8)
    nan.logprobs = [-1.0] * 7 + [float("nan")]
    failed = RequestTiming(4, "image", submitted=0.0, finish_reason="error", error="runner failed")
    problems = check_timings([good, short, stopped, nan, failed], max_tokens=8)
    assert len(problems) == 4
    assert [p.split()[1] for p in problems] == ["1", "2", "3", "4"]
    assert check_timings([good], max_tokens=8) == []

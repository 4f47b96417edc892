"""Choosing the token at a verified position: greedy argmax, or the standard speculative rejection rule, which
leaves the output distribution exactly the target's (Leviathan et al. 2023; Chen et al. 2023).

For a draft d proposed from a distribution q (None: a deterministic drafter, q = a point mass at d) and the
target distribution p of the row (the processed logits through temperature / top-k / top-p / min-p, exactly as
gpu_engine.sampling.sample draws): accept d with probability min(1, p(d) / q(d)); on rejection draw from the
residual max(p - q, 0), normalised. Then P(token = x) = min(p, q)(x) + (1 - sum min(p, q)) * residual(x) = p(x).
Positions without a draft (the bonus token after a fully accepted window) are ordinary samples.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..sampling import SamplingRows, filter_logits, log_softmax, sample


def target_probs(processed: np.ndarray, rows: SamplingRows) -> np.ndarray:
    """float64 [V]: the distribution sample() draws row 0 of `rows` from (temperature > 0)."""
    x = processed[None].astype(np.float32) / rows.temperature[:1, None]
    x = filter_logits(x, rows.top_k[:1], rows.top_p[:1], rows.min_p[:1])
    return np.exp(log_softmax(x)[0].astype(np.float64))


def choose(processed: np.ndarray, rows: SamplingRows, draft: int | None, rng: Any,
           q: np.ndarray | None = None) -> int:
    """The token at one verified position. `processed`: the row's processed logits [V] (penalties and grammar mask
    applied); `rows`: its one-row SamplingRows; `rng`: the request's Generator."""
    if rows.temperature[0] == 0.0 or draft is None:
        return int(sample(processed[None], rows, [rng]).token_ids[0])  # greedy, or an ordinary draw
    p = target_probs(processed, rows)
    qd = 1.0 if q is None else float(q[draft])
    if rng.random() * qd < p[draft]:  # u < p(d) / q(d)
        return draft
    if q is None:
        residual = p.copy()
        residual[draft] = 0.0
    else:
        residual = np.maximum(p - q, 0.0)
    total = residual.sum()
    if total <= 0.0:  # p <= q everywhere but at d: only reachable through rounding; d is then the only mass left
        return draft
    cdf = np.cumsum(residual) / total
    return int(min(np.searchsorted(cdf, rng.random(), side="right"), p.shape[0] - 1))


def logprob_entries(processed: np.ndarray, token: int, num_logprobs: int) -> tuple[float, list[tuple[int, float]]]:
    """The chosen token's logprob and the top-n list, as sample() reports them (nan / [] when not asked)."""
    if num_logprobs < 0:
        return float("nan"), []
    lp = log_softmax(processed[None].astype(np.float32))[0]
    top: list[tuple[int, float]] = []
    if num_logprobs > 0:
        k = min(num_logprobs, lp.shape[0])
        cand = np.argpartition(-lp, k - 1)[:k]
        cand = cand[np.argsort(-lp[cand], kind="stable")]
        top = [(int(t), float(lp[t])) for t in cand]
    return float(lp[token]), top

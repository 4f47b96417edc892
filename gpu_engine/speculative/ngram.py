"""Prompt lookup: draft the continuation of the latest earlier occurrence of the sequence's tail n-gram.

Extraction copies names, numbers and addresses from the page: the tail of the output often already appears in the
prompt (or the page's text layer), and what followed it there is a good guess for what comes next."""
from __future__ import annotations

import numpy as np


def find_continuation(tokens: np.ndarray, lookup: np.ndarray | None, k: int, n_min: int, n_max: int) -> list[int]:
    """Up to `k` draft tokens: for n from n_max down to n_min, the tokens after the latest earlier match of the
    last n tokens in `tokens` (prompt + output), else after the first match in `lookup` (extra text)."""
    if k <= 0:
        return []
    total = tokens.shape[0]
    for n in range(min(n_max, total - 1), n_min - 1, -1):
        tail = tokens[total - n:]
        for source, latest in ((tokens[:total - 1], True), (lookup, False)):
            if source is None or source.shape[0] < n + 1:
                continue
            starts = _matches(source, tail)
            if latest:
                starts = starts[starts + n < total]  # a continuation exists inside `tokens`
            if starts.size:
                i = int(starts[-1] if latest else starts[0]) + n
                return (tokens if latest else source)[i:i + k].tolist()
    return []


def _matches(source: np.ndarray, pattern: np.ndarray) -> np.ndarray:
    """Start indices i (with a token after the match) where source[i:i+n] == pattern."""
    n = pattern.shape[0]
    windows = np.lib.stride_tricks.sliding_window_view(source[:source.shape[0] - 1], n)
    return np.nonzero((windows == pattern).all(axis=1))[0]

"""Token sampling for a whole batch at once (numpy, vectorised over rows).

Order of operations per row (the same as HF / vLLM):
  raw logits -> repetition penalty (prompt + output tokens) -> presence penalty (output tokens)
  -> grammar mask (disallowed -> -inf)                      ==> "processed" logits; logprobs are reported from these
  -> greedy argmax (temperature == 0), or:
     / temperature -> top-k -> top-p (on the top-k distribution) -> min-p -> draw from the row's own RNG.
Ties at a top-k / top-p cut-off value are kept (the kept set may be larger than k; it is never smaller).
Each request owns a numpy Generator seeded from its seed and draws exactly one uniform per sampled token, so the
output of a seeded request does not depend on what else is in the batch.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from .params import SamplingParams


def sampling_row(p: SamplingParams) -> tuple[float, ...]:
    """One row of SamplingRows' table: temperature, top_k, top_p, min_p, repetition and presence penalty,
    num_logprobs."""
    return (p.temperature, p.top_k, p.top_p, p.min_p, p.repetition_penalty, p.presence_penalty,
            p.top_logprobs if p.logprobs else -1)


@dataclass
class SamplingRows:
    """Per-row sampling parameters of one step, as arrays."""

    temperature: np.ndarray  # float32 [R]
    top_k: np.ndarray  # int64 [R], 0 = off
    top_p: np.ndarray  # float32 [R]
    min_p: np.ndarray  # float32 [R]
    repetition_penalty: np.ndarray  # float32 [R]
    presence_penalty: np.ndarray  # float32 [R]
    num_logprobs: np.ndarray  # int64 [R], -1 = no logprobs, 0 = chosen token only, n = chosen + top-n

    @classmethod
    def from_params(cls, params: list[SamplingParams]) -> SamplingRows:
        return cls.from_rows([sampling_row(p) for p in params])

    @classmethod
    def from_rows(cls, rows: list[tuple[float, ...]]) -> SamplingRows:
        """From sampling_row() tuples (the engine keeps one per sequence instead of rebuilding it every step)."""
        table = np.array(rows, dtype=np.float64).reshape(len(rows), 7)
        return cls(
            temperature=table[:, 0].astype(np.float32),
            top_k=table[:, 1].astype(np.int64),
            top_p=table[:, 2].astype(np.float32),
            min_p=table[:, 3].astype(np.float32),
            repetition_penalty=table[:, 4].astype(np.float32),
            presence_penalty=table[:, 5].astype(np.float32),
            num_logprobs=table[:, 6].astype(np.int64),
        )

    @property
    def has_penalties(self) -> bool:
        return bool(np.any(self.repetition_penalty != 1.0) or np.any(self.presence_penalty != 0.0))


class UniformSource(Protocol):
    """What sample() needs of a row's generator: its next uniform draw (np.random.Generator, or Drawn)."""

    def random(self) -> float: ...


class Drawn:
    """Stands in for a row's Generator whose next random() was drawn earlier (sample() calls only random())."""

    def __init__(self, u: float) -> None:
        self.u = u

    def random(self) -> float:
        return self.u


@dataclass
class SampleResult:
    token_ids: np.ndarray  # int64 [R]
    logprobs: np.ndarray  # float32 [R] logprob of the chosen token (nan where not requested)
    top: list[list[tuple[int, float]]]  # per row, best first (empty where not requested)


def _unique_pairs(rows: list[int], ids: list[np.ndarray], vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """Distinct (row, token id) pairs of the given token histories."""
    if not rows:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    flat = np.concatenate([r * vocab + np.asarray(t, dtype=np.int64) for r, t in zip(rows, ids)])
    flat = np.unique(flat)
    return flat // vocab, flat % vocab


def apply_penalties(
    logits: np.ndarray,
    rows: SamplingRows,
    prompt_and_output: list[np.ndarray],
    output: list[np.ndarray],
) -> None:
    """In place. Repetition penalty over tokens seen in prompt + output: positive logits are divided by it,
    negative ones multiplied. Presence penalty: subtracted once from every token seen in the output."""
    vocab = logits.shape[1]
    rep_rows = [int(i) for i in np.nonzero(rows.repetition_penalty != 1.0)[0]]
    if rep_rows:
        r, t = _unique_pairs(rep_rows, [prompt_and_output[i] for i in rep_rows], vocab)
        vals = logits[r, t]
        pen = rows.repetition_penalty[r]
        logits[r, t] = np.where(vals > 0, vals / pen, vals * pen)
    pres_rows = [int(i) for i in np.nonzero(rows.presence_penalty != 0.0)[0] if len(output[i])]
    if pres_rows:
        r, t = _unique_pairs(pres_rows, [output[i] for i in pres_rows], vocab)
        logits[r, t] -= rows.presence_penalty[r]


def bitmask_to_bool(bitmask: np.ndarray, vocab: int) -> np.ndarray:
    """llguidance's int32 bitmask [R, ceil(V/32)] (bit j of word w = token 32w + j) -> bool [R, V]."""
    bits = np.unpackbits(np.ascontiguousarray(bitmask).view(np.uint8), axis=1, bitorder="little")
    return bits[:, :vocab].astype(bool)


def bitmask_allows_any(bitmask: np.ndarray, vocab: int) -> np.ndarray:
    """bool [R]: does row r of llguidance's int32 bitmask allow any token below `vocab`? Equal to
    bitmask_to_bool(bitmask, vocab).any(axis=1), read off the words: no [R, vocab] bool array on every
    constrained step (bench/results/doc_throughput.md has the cost at a real vocabulary)."""
    words = np.ascontiguousarray(bitmask).view(np.uint32)
    full, rest = divmod(vocab, 32)
    out = words[:, :full].max(axis=1, initial=0) != 0  # max: a vectorised reduction, no [R, words] bool array
    if rest:
        out |= (words[:, full] & np.uint32((1 << rest) - 1)) != 0
    return out


def apply_allowed_mask(logits: np.ndarray, allowed: np.ndarray) -> None:
    """In place: disallowed tokens -> -inf."""
    np.putmask(logits, ~allowed, -np.inf)


def apply_bitmask_rows(logits: np.ndarray, rows: list[int] | np.ndarray, bitmask: np.ndarray) -> np.ndarray:
    """In place: row rows[j] of `logits` keeps only the tokens bitmask[j] allows (the others -> -inf). Returns the
    allowed tokens, bool [len(rows), V] (a row with none allowed is a grammar dead end)."""
    allowed = bitmask_to_bool(bitmask, logits.shape[1])
    sub = logits[rows]
    apply_allowed_mask(sub, allowed)
    logits[rows] = sub
    return allowed


def log_softmax(x: np.ndarray) -> np.ndarray:
    m = np.max(x, axis=1, keepdims=True)
    z = x - m
    with np.errstate(invalid="ignore"):
        lse = np.log(np.sum(np.exp(z), axis=1, keepdims=True))
    return z - lse


def filter_logits(x: np.ndarray, top_k: np.ndarray, top_p: np.ndarray, min_p: np.ndarray) -> np.ndarray:
    """Temperature-scaled logits -> the same with tokens outside top-k / top-p / min-p set to -inf (a new array)."""
    x = x.copy()
    vocab = x.shape[1]
    sort_rows = np.nonzero((top_k > 0) | (top_p < 1.0))[0]
    if len(sort_rows):
        xs = x[sort_rows]
        s = -np.sort(-xs, axis=1)  # descending
        idx = np.arange(len(sort_rows))
        k = top_k[sort_rows]
        kth = s[idx, np.clip(np.where(k > 0, k, vocab), 1, vocab) - 1]
        thresh = np.where(k > 0, kth, -np.inf)
        p = top_p[sort_rows]
        if np.any(p < 1.0):
            s = np.where(s >= thresh[:, None], s, -np.inf)
            probs = np.exp(log_softmax(s))
            mass_before = np.cumsum(probs, axis=1) - probs
            keep = (mass_before < p[:, None]) & np.isfinite(s)
            last = np.maximum(keep.sum(axis=1) - 1, 0)  # the smallest prefix whose mass reaches top_p
            thresh = np.where(p < 1.0, np.maximum(thresh, s[idx, last]), thresh)
        x[sort_rows] = np.where(xs >= thresh[:, None], xs, -np.inf)
    minp_rows = np.nonzero(min_p > 0.0)[0]
    if len(minp_rows):
        xm = x[minp_rows]
        # p_i >= min_p * p_max  <=>  x_i >= x_max + log(min_p)
        cut = np.max(xm, axis=1) + np.log(min_p[minp_rows])
        x[minp_rows] = np.where(xm >= cut[:, None], xm, -np.inf)
    return x


def sample(
    logits: np.ndarray,
    rows: SamplingRows,
    rngs: Sequence[UniformSource],
) -> SampleResult:
    """`logits` are the processed logits [R, V] (penalties and grammar mask already applied)."""
    n = logits.shape[0]
    tokens = np.argmax(logits, axis=1).astype(np.int64)  # greedy for every row; random rows overwrite below
    rand_rows = np.nonzero(rows.temperature > 0.0)[0]
    if len(rand_rows):
        x = logits[rand_rows] / rows.temperature[rand_rows, None]
        x = filter_logits(x, rows.top_k[rand_rows], rows.top_p[rand_rows], rows.min_p[rand_rows])
        probs = np.exp(log_softmax(x))
        cdf = np.cumsum(probs, axis=1)
        u = np.array([rngs[i].random() for i in rand_rows.tolist()]) * cdf[:, -1]
        u = np.maximum(u, np.finfo(np.float32).tiny)  # u == 0 could pick a zero-probability first token
        choice = np.minimum((cdf < u[:, None]).sum(axis=1), logits.shape[1] - 1)
        tokens[rand_rows] = choice

    chosen_lp = np.full(n, np.nan, dtype=np.float32)
    top: list[list[tuple[int, float]]] = [[] for _ in range(n)]
    lp_rows = np.nonzero(rows.num_logprobs >= 0)[0]
    if len(lp_rows):
        lp = log_softmax(logits[lp_rows].astype(np.float32))
        chosen_lp[lp_rows] = lp[np.arange(len(lp_rows)), tokens[lp_rows]]
        for j, i in enumerate(lp_rows):
            k = int(rows.num_logprobs[i])
            if k > 0:
                k = min(k, lp.shape[1])
                cand = np.argpartition(-lp[j], k - 1)[:k]
                cand = cand[np.argsort(-lp[j, cand], kind="stable")]
                top[i] = [(int(t), float(lp[j, t])) for t in cand]
    return SampleResult(tokens, chosen_lp, top)

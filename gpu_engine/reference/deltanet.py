"""Gated DeltaNet (Qwen3.5's linear-attention layer) in numpy float32.

Per value head, with a state S [k_dim, v_dim] carried across tokens (and across prefill chunks / decode steps):

    S_t   = exp(g_t) * S_{t-1}                                  decay (g_t <= 0)
    S_t  += k_t (beta_t * (v_t - S_t^T k_t))^T                   delta rule: write only what S does not predict
    out_t = S_t^T q_t

`recurrent_gated_delta` runs this literally (decode, and the oracle); `chunked_gated_delta` computes the same
thing a block of tokens at a time with matrix products (prefill). They agree to float32 rounding.
"""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from ..config import TextConfig
from .ops import gated_rms_norm, l2norm, linear, sigmoid, silu, softplus

CHUNK = 64  # tokens per block of the chunked form (any value gives the same result)


def recurrent_gated_delta(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray, state: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """q, k [n, H, dk] (normalised, q scaled), v [n, H, dv], g, beta [n, H], state [H, dk, dv]
    -> out [n, H, dv], state."""
    s = state.astype(np.float32, copy=True)
    out = np.empty(v.shape, dtype=np.float32)
    for t in range(q.shape[0]):
        s *= np.exp(g[t])[:, None, None]
        predicted = np.einsum("hkv,hk->hv", s, k[t])
        delta = (v[t] - predicted) * beta[t][:, None]
        s += k[t][:, :, None] * delta[:, None, :]
        out[t] = np.einsum("hkv,hk->hv", s, q[t])
    return out, s


def chunked_gated_delta(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    g: np.ndarray,
    beta: np.ndarray,
    state: np.ndarray,
    chunk: int = CHUNK,
) -> tuple[np.ndarray, np.ndarray]:
    """Same contract as `recurrent_gated_delta`, a block of `chunk` tokens at a time.

    Inside a block (positions i, j; cum = cumulative sum of g from the block start, D_ij = exp(cum_i - cum_j) for
    j <= i, else 0), unrolling the recurrence gives a unit lower-triangular system for the corrected values:
        (I + strict_lower(diag(beta) K K^T * D)) U = diag(beta) (V - diag(exp(cum)) K S0)
    then  out = diag(exp(cum)) Q S0 + (Q K^T * D) U  and  S1 = exp(cum_L) S0 + (K * exp(cum_L - cum))^T U.
    """
    n, heads, dk = q.shape
    s = state.astype(np.float32, copy=True)
    out = np.empty(v.shape, dtype=np.float32)
    # head-major copies: [H, n, d]
    qh, kh, vh = (np.ascontiguousarray(x.transpose(1, 0, 2), dtype=np.float32) for x in (q, k, v))
    gh, bh = (np.ascontiguousarray(x.T, dtype=np.float32) for x in (g, beta))
    for begin in range(0, n, chunk):
        end = min(begin + chunk, n)
        size = end - begin
        qc, kc, vc = qh[:, begin:end], kh[:, begin:end], vh[:, begin:end]
        bc = bh[:, begin:end]
        cum = np.cumsum(gh[:, begin:end], axis=1)  # [H, L]
        lower = np.tril(np.ones((size, size), dtype=bool))
        diff = np.where(lower, cum[:, :, None] - cum[:, None, :], -np.inf)  # mask before exp: no overflow
        decay = np.exp(diff).astype(np.float32)  # [H, L, L], D_ij
        kbeta = kc * bc[:, :, None]
        system = np.einsum("hik,hjk->hij", kbeta, kc) * decay
        system = np.tril(system, -1) + np.eye(size, dtype=np.float32)
        rhs = vc * bc[:, :, None] - np.einsum("hik,hkv->hiv", kbeta * np.exp(cum)[:, :, None], s)
        corrected = np.linalg.solve(system, rhs).astype(np.float32)  # U [H, L, dv]
        attn = np.einsum("hik,hjk->hij", qc, kc) * decay
        o = np.einsum("hik,hkv->hiv", qc * np.exp(cum)[:, :, None], s) + attn @ corrected
        out[begin:end] = o.transpose(1, 0, 2)
        last = cum[:, -1]
        s = np.exp(last)[:, None, None] * s + np.einsum(
            "hik,hiv->hkv", kc * np.exp(last[:, None] - cum)[:, :, None], corrected
        )
    return out, s


def causal_conv(x: np.ndarray, state: np.ndarray, weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Depthwise causal conv1d + SiLU. x [n, C], state [C, K-1] = the previous K-1 inputs, weight [C, K].

    A fresh sequence has a zero state, which is exactly the zero left-padding of a whole-sequence conv.
    Returns (out [n, C], new state [C, K-1]).
    """
    kernel = weight.shape[1]
    extended = np.concatenate([state, x.T], axis=1)  # [C, K-1+n]
    n = x.shape[0]
    out = np.zeros((n, x.shape[1]), dtype=np.float32)
    for tap in range(kernel):
        out += (extended[:, tap:tap + n] * weight[:, tap:tap + 1]).T
    return silu(out), extended[:, extended.shape[1] - (kernel - 1):].copy()


def deltanet_forward(
    x: np.ndarray,
    w: Mapping[str, np.ndarray],
    cfg: TextConfig,
    conv_state: np.ndarray,
    recurrent_state: np.ndarray,
    *,
    recurrent: bool | None = None,
) -> np.ndarray:
    """One Gated DeltaNet layer on x [n, hidden]; updates conv_state [C, K-1] and recurrent_state [Hv, dk, dv] in place.

    `recurrent=None` picks the recurrent form for one token and the chunked form otherwise.
    """
    n = x.shape[0]
    nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    mixed, new_conv = causal_conv(linear(x, w["in_proj_qkv.weight"]), conv_state, w["conv1d.weight"][:, 0, :])
    conv_state[...] = new_conv
    key_dim = nk * dk
    q = mixed[:, :key_dim].reshape(n, nk, dk)
    k = mixed[:, key_dim:2 * key_dim].reshape(n, nk, dk)
    v = mixed[:, 2 * key_dim:].reshape(n, nv, dv)
    z = linear(x, w["in_proj_z.weight"]).reshape(n, nv, dv)
    beta = sigmoid(linear(x, w["in_proj_b.weight"]))
    g = -np.exp(w["A_log"]) * softplus(linear(x, w["in_proj_a.weight"]) + w["dt_bias"])  # log-decay, <= 0
    # q/k heads are shared by groups of value heads (value head j reads key head j // (nv // nk))
    q = np.repeat(l2norm(q), nv // nk, axis=1) * np.float32(dk**-0.5)
    k = np.repeat(l2norm(k), nv // nk, axis=1)
    use_recurrent = (n == 1) if recurrent is None else recurrent
    rule = recurrent_gated_delta if use_recurrent else chunked_gated_delta
    core, new_state = rule(q, k, v, g.astype(np.float32), beta, recurrent_state)
    recurrent_state[...] = new_state
    normed = gated_rms_norm(core, z, w["norm.weight"], cfg.rms_norm_eps)
    return linear(normed.reshape(n, nv * dv), w["out_proj.weight"])

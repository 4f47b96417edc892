"""float64 numpy references for the CUDA kernels: plain loops and formulas, written from the model's math
(transformers' Qwen3.5 modules), independent of the kernels. CPU tests check these against transformers too."""
from __future__ import annotations

import numpy as np


def rmsnorm(x: np.ndarray, w: np.ndarray, eps: float, zero_centred: bool) -> np.ndarray:
    x = x.astype(np.float64)
    scale = (1.0 + w.astype(np.float64)) if zero_centred else w.astype(np.float64)
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * scale


def silu(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    return x / (1.0 + np.exp(-x))


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x.astype(np.float64)))


def softplus(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    return np.where(x > 20, x, np.log1p(np.exp(np.minimum(x, 20))))


def rmsnorm_gated(x: np.ndarray, z: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return w.astype(np.float64) * rmsnorm(x, np.ones_like(w), eps, zero_centred=False) * silu(z)


def rope(x: np.ndarray, pos: np.ndarray, inv_freq: np.ndarray, axis: np.ndarray, rot_dim: int) -> np.ndarray:
    """x [n, heads, head_dim]; pos [P, n] ints; angle = fp32(pos) * fp32 inv_freq in fp32 (as transformers), then
    cos/sin in float64; rotate-half on the first rot_dim dims."""
    n = x.shape[0]
    half = rot_dim // 2
    angle = (pos[axis, :].T.astype(np.float32) * inv_freq[None, :].astype(np.float32)).astype(np.float64)  # [n, half]
    cos, sin = np.cos(angle)[:, None, :], np.sin(angle)[:, None, :]
    out = x.astype(np.float64).copy()
    x1, x2 = out[..., :half].copy(), out[..., half:rot_dim].copy()
    out[..., :half] = x1 * cos - x2 * sin
    out[..., half:rot_dim] = x2 * cos + x1 * sin
    assert out.shape[0] == n
    return out


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, gate: np.ndarray, positions: np.ndarray,
              scale: float) -> np.ndarray:
    """One sequence. q/gate [n, H, D] at absolute positions `positions`; k/v [L, KV, D] (whole sequence so far).
    Causal: query at position p sees keys 0..p. Output [n, H*D] times sigmoid(gate)."""
    n, H, D = q.shape
    KV = k.shape[1]
    out = np.zeros((n, H, D))
    for i in range(n):
        p = positions[i]
        for h in range(H):
            kh = h // (H // KV)
            s = (k[: p + 1, kh].astype(np.float64) @ q[i, h].astype(np.float64)) * scale
            w = np.exp(s - s.max())
            w /= w.sum()
            out[i, h] = w @ v[: p + 1, kh].astype(np.float64)
    return (out * sigmoid(gate)).reshape(n, H * D)


def causal_conv1d_silu(x: np.ndarray, w: np.ndarray, state: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One sequence. x [n, C]; w [C, K]; state [K-1, C] = the previous K-1 inputs (oldest first).
    Returns silu(conv) [n, C] and the new state."""
    K = w.shape[1]
    full = np.concatenate([state.astype(np.float64), x.astype(np.float64)], axis=0)  # [K-1+n, C]
    n = x.shape[0]
    out = np.zeros((n, x.shape[1]))
    for t in range(n):
        out[t] = (full[t : t + K] * w.T.astype(np.float64)).sum(0)
    return silu(out), full[n:]  # last K-1 rows


def gated_delta_rule(q: np.ndarray, k: np.ndarray, v: np.ndarray, a: np.ndarray, b: np.ndarray, A_log: np.ndarray,
                     dt_bias: np.ndarray, S: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One sequence. q/k [n, KH, dk]; v [n, VH, dv]; a/b [n, VH]; S [VH, dk, dv] initial state.
    Returns o [n, VH*dv] and the final state [VH, dk, dv]."""
    n, KH, dk = q.shape
    VH, dv = v.shape[1], v.shape[2]
    S = S.astype(np.float64).copy()
    out = np.zeros((n, VH, dv))
    for t in range(n):
        for h in range(VH):
            kh = h // (VH // KH)
            qt = q[t, kh].astype(np.float64)
            kt = k[t, kh].astype(np.float64)
            qt = qt / np.sqrt((qt * qt).sum() + 1e-6) / np.sqrt(dk)
            kt = kt / np.sqrt((kt * kt).sum() + 1e-6)
            g = -np.exp(np.float64(A_log[h])) * softplus(np.float64(a[t, h]) + np.float64(dt_bias[h]))
            beta = sigmoid(np.float64(b[t, h]))
            S[h] *= np.exp(g)
            delta = (v[t, h].astype(np.float64) - S[h].T @ kt) * beta
            S[h] += np.outer(kt, delta)
            out[t, h] = S[h].T @ qt
    return out.reshape(n, VH * dv), S


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))

"""Gated full attention of Qwen3.5 over a paged KV cache, numpy float32.

q_proj yields, per head, a query and an output gate; q and k get a per-head zero-centred RMSNorm, then partial
M-RoPE; keys/values are written into the sequence's cache blocks and every query attends causally over the cache;
the attention output is multiplied by sigmoid(gate) before o_proj. Key/value heads are shared by groups of query
heads (GQA).
"""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from ..config import TextConfig
from .fp8_kv import KvArray
from .ops import apply_rope, linear, rms_norm, sigmoid, softmax

_QUERY_BLOCK = 512  # queries per score block (any value gives the same result)


def attention_forward(
    x: np.ndarray,
    w: Mapping[str, np.ndarray],
    cfg: TextConfig,
    cos: np.ndarray,
    sin: np.ndarray,
    k_cache: KvArray,
    v_cache: KvArray,
    block_table: np.ndarray,
    start: int,
) -> np.ndarray:
    """x [n, hidden] at sequence positions start..start+n-1; caches [num_blocks, block_size, kv_heads, head_dim]
    (float32, or e4m3 behind reference/fp8_kv.Fp8KvArray, which quantises on write and dequantises on read)."""
    n = x.shape[0]
    nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    qg = linear(x, w["q_proj.weight"], w.get("q_proj.bias")).reshape(n, nh, 2 * hd)
    query, gate = qg[..., :hd], qg[..., hd:].reshape(n, nh * hd)
    q = apply_rope(rms_norm(query, w["q_norm.weight"], cfg.rms_norm_eps), cos, sin)
    k = linear(x, w["k_proj.weight"], w.get("k_proj.bias")).reshape(n, nkv, hd)
    k = apply_rope(rms_norm(k, w["k_norm.weight"], cfg.rms_norm_eps), cos, sin)
    v = linear(x, w["v_proj.weight"], w.get("v_proj.bias")).reshape(n, nkv, hd)

    block_size = k_cache.shape[1]
    new_pos = np.arange(start, start + n)
    k_cache[block_table[new_pos // block_size], new_pos % block_size] = k
    v_cache[block_table[new_pos // block_size], new_pos % block_size] = v
    all_pos = np.arange(start + n)
    keys = k_cache[block_table[all_pos // block_size], all_pos % block_size]  # [T, kv_heads, hd]
    values = v_cache[block_table[all_pos // block_size], all_pos % block_size]

    group = nh // nkv
    keys = np.repeat(keys, group, axis=1)  # query head h reads kv head h // group
    values = np.repeat(values, group, axis=1)
    out = np.empty((n, nh, hd), dtype=np.float32)
    for begin in range(0, n, _QUERY_BLOCK):  # bounds the score matrix to [heads, block, T] for long prompts
        end = min(begin + _QUERY_BLOCK, n)
        scores = np.einsum("qhd,khd->hqk", q[begin:end], keys) * np.float32(hd**-0.5)
        future = all_pos[None, :] > new_pos[begin:end, None]
        scores = np.where(future[None], -np.inf, scores)
        out[begin:end] = np.einsum("hqk,khd->qhd", softmax(scores, axis=-1), values)
    out = out.reshape(n, nh * hd) * sigmoid(gate)
    return linear(out, w["o_proj.weight"], w.get("o_proj.bias"))

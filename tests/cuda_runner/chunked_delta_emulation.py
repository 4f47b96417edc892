"""A numpy emulation of the chunked (WY-form) gated delta rule in kernels/deltanet_chunked.cu, step by step.

Same varlen conventions as the CUDA kernels (cu_seqlens, state_slots, fresh; state [slots, v_heads, dv, dk] with S
transposed), same chunk-slot numbering, same two passes:
- prep, per chunk slot and value head (fully parallel): g/beta, cumulative log-decay G within the chunk, L2-normalised
  q (times 1/sqrt(dk)) and k, A = strictly-lower(beta_i exp(G_i - G_j) k_i.k_j), T = (I + A)^-1 by forward
  substitution, W = T diag(beta e^G) K, U = T diag(beta) V, Qd = diag(e^G) Q, KdT = (diag(e^(G_last - G)) K)^T,
  P = lower-incl(Q K^T * e^(G_i - G_j)), gc = e^(G_last);
- scan, per sequence, value head and dv slice of 32 or 16 columns (sequential over the chunks): V' = U - W S,
  O = Qd S + P V', S = gc S + Kd^T V'.
Every exponent is G_i - G_j with i >= j (or G itself), so nothing grows.

variant="states" (gdn_chunk_states + gdn_chunk_output) splits the scan: per sequence and dv slice, sequential,
Sc = bf16(S) and V' = bf16(U - W Sc) are stored per chunk slot and S = gc S + Kd^T V'; then per chunk slot
(independent of the others) O = Qd Sc + P V'. Same values at the same rounding points as "current", so the two
variants agree exactly here (and should on the GPU).

With `bf16=True` values are rounded to bf16 exactly where the kernel stores or feeds bf16 into the tensor cores
(everything else, like the fp32 accumulators, stays float64 here), so the emulation also predicts the kernel's
rounding error; with `bf16=False` it is exact float64 algebra and must equal the token-by-token rule to ~1e-12.
"""
from __future__ import annotations

import numpy as np

from tests.cuda_runner import references as ref

CHUNK = 64
DV_SLICE = 32
VARIANTS = ("current", "states")


def _round(x: np.ndarray, on: bool) -> np.ndarray:
    if not on:
        return x
    from gpu_engine.cuda.bf16 import round_to_bf16

    return round_to_bf16(np.asarray(x, np.float32)).astype(np.float64)


def chunk_slot_base(cu_seqlens: np.ndarray, s: int) -> int:
    """First chunk slot of sequence s: floor(cu[s] / CHUNK) + s (strictly increasing in s, and slot ranges of
    consecutive sequences never overlap, so no host-side table is needed)."""
    return int(cu_seqlens[s]) // CHUNK + s


def num_chunk_slots(tokens: int, seqs: int) -> int:
    """Slots that cover every sequence's chunks: floor(tokens / CHUNK) + seqs (some may stay unused)."""
    return tokens // CHUNK + seqs


def forward_substitution_inverse(A: np.ndarray) -> np.ndarray:
    """(I + A)^-1 for a strictly lower triangular A [..., C, C], row by row: T_i = e_i - A[i, :i] T[:i]."""
    C = A.shape[-1]
    T = np.zeros_like(A)
    for i in range(C):
        T[..., i, i] = 1.0
        if i:
            T[..., i, :] -= np.einsum("...m,...mj->...j", A[..., i, :i], T[..., :i, :])
    return T


def prep_chunk(q: np.ndarray, k: np.ndarray, v: np.ndarray, a: np.ndarray, b: np.ndarray, A_log: np.ndarray,
               dt_bias: np.ndarray, bf16: bool) -> dict[str, np.ndarray]:
    """One chunk of L <= CHUNK tokens, all value heads. q/k [L, KH, dk], v [L, VH, dv], a/b [L, VH]; rows past L are
    zero padding (g = 0, beta = 0), as in the kernel."""
    L, KH, dk = q.shape
    VH, dv = v.shape[1], v.shape[2]
    rep = VH // KH
    g = np.zeros((VH, CHUNK))
    beta = np.zeros((VH, CHUNK))
    g[:, :L] = (-np.exp(A_log.astype(np.float64))[:, None]
                * ref.softplus(a.T.astype(np.float64) + dt_bias.astype(np.float64)[:, None]))
    beta[:, :L] = 1.0 / (1.0 + np.exp(-b.T.astype(np.float64)))
    G = np.cumsum(g, axis=1)  # [VH, C]; pads add 0, so G[:, -1] is G at the last real token
    qf, kf = q.astype(np.float64), k.astype(np.float64)
    qn = np.zeros((KH, CHUNK, dk))
    kn = np.zeros((KH, CHUNK, dk))
    qn[:, :L] = (qf / np.sqrt((qf * qf).sum(-1, keepdims=True) + 1e-6) / np.sqrt(dk)).transpose(1, 0, 2)
    kn[:, :L] = (kf / np.sqrt((kf * kf).sum(-1, keepdims=True) + 1e-6)).transpose(1, 0, 2)
    qn, kn = _round(qn, bf16), _round(kn, bf16)  # the kernel holds normalised q and k in bf16 (shared memory)
    Q = np.repeat(qn, rep, axis=0)  # [VH, C, dk]: value head h reads key head h // rep
    K = np.repeat(kn, rep, axis=0)
    V = np.zeros((VH, CHUNK, dv))
    V[:, :L] = v.transpose(1, 0, 2).astype(np.float64)
    diff = G[:, :, None] - G[:, None, :]  # G_i - G_j
    lower = np.tril(np.ones((CHUNK, CHUNK), bool), -1)
    lower_incl = np.tril(np.ones((CHUNK, CHUNK), bool))
    decay = np.exp(np.where(lower_incl, diff, 0.0))  # only i >= j is ever exponentiated
    KK = K @ K.transpose(0, 2, 1)
    QK = Q @ K.transpose(0, 2, 1)
    A = np.where(lower, beta[:, :, None] * decay * KK, 0.0)
    P = np.where(lower_incl, decay * QK, 0.0)
    T = forward_substitution_inverse(A)  # fp32 in the kernel
    W = _round(T * (beta * np.exp(G))[:, None, :], bf16) @ K
    U = _round(T * beta[:, None, :], bf16) @ V
    return {
        "W": _round(W, bf16), "U": _round(U, bf16), "P": _round(P, bf16),
        "Qd": _round(Q * np.exp(G)[:, :, None], bf16),
        "Kd": _round(K * np.exp(G[:, -1:] - G)[:, :, None], bf16),
        "gc": np.exp(G[:, -1]),
    }


def scan_chunk(S: np.ndarray, c: dict[str, np.ndarray], cols: slice, bf16: bool) -> tuple[np.ndarray, np.ndarray]:
    """One chunk of the sequential pass for the dv columns `cols`. S [VH, dk, slice] (float64, fp32 in the kernel).
    Returns (O [VH, C, slice], new S)."""
    Sb = _round(S, bf16)  # the kernel's B operand copy of the state
    Vp = c["U"][:, :, cols] - c["W"] @ Sb
    Vp = _round(Vp, bf16)
    O = c["Qd"] @ Sb + c["P"] @ Vp
    S = c["gc"][:, None, None] * S + c["Kd"].transpose(0, 2, 1) @ Vp
    return O, S


def states_chunk(S: np.ndarray, c: dict[str, np.ndarray], cols: slice,
                 bf16: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One chunk of gdn_chunk_states for the dv columns `cols`. S [VH, dk, slice] (float64, fp32 in the kernel).
    Returns (Sc: the chunk's entry state as stored, bf16; V' [VH, C, slice] as stored, bf16; the new S)."""
    Sc = _round(S, bf16)  # the kernel's Sb, also what it stores to Sg
    Vp = _round(c["U"][:, :, cols] - c["W"] @ Sc, bf16)
    S = c["gc"][:, None, None] * S + c["Kd"].transpose(0, 2, 1) @ Vp
    return Sc, Vp, S


def output_chunk(c: dict[str, np.ndarray], Sc: np.ndarray, Vp: np.ndarray) -> np.ndarray:
    """gdn_chunk_output for one chunk slot, all value heads and columns: O = Qd Sc + P V' [VH, C, dv]."""
    return c["Qd"] @ Sc + c["P"] @ Vp


def chunked_gated_delta_rule(q: np.ndarray, k: np.ndarray, v: np.ndarray, a: np.ndarray, b: np.ndarray,
                             A_log: np.ndarray, dt_bias: np.ndarray, state: np.ndarray, cu_seqlens: np.ndarray,
                             state_slots: np.ndarray, fresh: np.ndarray, bf16: bool = False,
                             dv_slice: int = DV_SLICE, variant: str = "current") -> tuple[np.ndarray, np.ndarray]:
    """The whole varlen batch. q/k [n, KH, dk]; v [n, VH, dv]; a/b [n, VH]; state [slots, VH, dv, dk] (not
    modified). Returns out [n, VH*dv] and the new state array (a copy, float64)."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    n, KH, dk = q.shape
    VH, dv = v.shape[1], v.shape[2]
    seqs = len(state_slots)
    out = np.zeros((n, VH, dv))
    new_state = state.astype(np.float64).copy()
    prepped: dict[int, dict[str, np.ndarray]] = {}
    rows: dict[int, tuple[int, int]] = {}  # chunk slot -> (first token, tokens)
    # pass 1: every chunk slot that belongs to a sequence (independent of the state)
    for s in range(seqs):
        t0, t1 = int(cu_seqlens[s]), int(cu_seqlens[s + 1])
        base = chunk_slot_base(cu_seqlens, s)
        for ch, start in enumerate(range(t0, t1, CHUNK)):
            r = slice(start, min(start + CHUNK, t1))
            assert base + ch not in prepped and base + ch < num_chunk_slots(n, seqs)
            prepped[base + ch] = prep_chunk(q[r], k[r], v[r], a[r], b[r], A_log, dt_bias, bf16)
            rows[base + ch] = (start, r.stop - start)
    # "states": the entry state and V' of every chunk slot, [VH, dk, dv] and [VH, C, dv]
    entry = {cs: np.zeros((VH, dk, dv)) for cs in prepped} if variant == "states" else {}
    vprime = {cs: np.zeros((VH, CHUNK, dv)) for cs in prepped} if variant == "states" else {}
    # pass 2: per sequence and dv slice, sequential over its chunks
    for s in range(seqs):
        t0, t1 = int(cu_seqlens[s]), int(cu_seqlens[s + 1])
        base = chunk_slot_base(cu_seqlens, s)
        slot = int(state_slots[s])
        for c0 in range(0, dv, dv_slice):
            cols = slice(c0, min(c0 + dv_slice, dv))
            S = (np.zeros((VH, dk, cols.stop - cols.start)) if fresh[s]
                 else state[slot][:, cols, :].astype(np.float64).transpose(0, 2, 1))
            for ch, start in enumerate(range(t0, t1, CHUNK)):
                if variant == "states":
                    entry[base + ch][:, :, cols], vprime[base + ch][:, :, cols], S = states_chunk(
                        S, prepped[base + ch], cols, bf16)
                    continue
                L = min(CHUNK, t1 - start)
                O, S = scan_chunk(S, prepped[base + ch], cols, bf16)
                out[start:start + L, :, cols] = O[:, :L].transpose(1, 0, 2)
            new_state[slot][:, cols, :] = S.transpose(0, 2, 1)
    # pass 3 ("states"): every chunk slot's output on its own
    if variant == "states":
        for cs, (start, L) in rows.items():
            out[start:start + L] = output_chunk(prepped[cs], entry[cs], vprime[cs])[:, :L].transpose(1, 0, 2)
    return out.reshape(n, VH * dv), new_state


def token_reference_batch(q: np.ndarray, k: np.ndarray, v: np.ndarray, a: np.ndarray, b: np.ndarray,
                          A_log: np.ndarray, dt_bias: np.ndarray, state: np.ndarray, cu_seqlens: np.ndarray,
                          state_slots: np.ndarray, fresh: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The varlen batch through references.gated_delta_rule (token by token, float64): the independent oracle."""
    n, VH, dv = v.shape
    dk = q.shape[2]
    out = np.zeros((n, VH * dv))
    new_state = state.astype(np.float64).copy()
    for s in range(len(state_slots)):
        r = slice(int(cu_seqlens[s]), int(cu_seqlens[s + 1]))
        slot = int(state_slots[s])
        S0 = np.zeros((VH, dk, dv)) if fresh[s] else state[slot].transpose(0, 2, 1)
        o, S = ref.gated_delta_rule(q[r], k[r], v[r], a[r], b[r], A_log, dt_bias, S0)
        out[r] = o
        new_state[slot] = S.transpose(0, 2, 1)
    return out, new_state


def token_reference_fast(q: np.ndarray, k: np.ndarray, v: np.ndarray, a: np.ndarray, b: np.ndarray,
                         A_log: np.ndarray, dt_bias: np.ndarray, state: np.ndarray, cu_seqlens: np.ndarray,
                         state_slots: np.ndarray, fresh: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """token_reference_batch vectorised over the heads (same float64 token-by-token rule, written again from the
    header's formulas): fast enough for 8192 tokens x 48 heads. CPU-tested against token_reference_batch."""
    n, VH, dv = v.shape
    KH, dk = q.shape[1], q.shape[2]
    rep = VH // KH
    qf, kf = q.astype(np.float64), k.astype(np.float64)
    qn = qf / np.sqrt((qf * qf).sum(-1, keepdims=True) + 1e-6) / np.sqrt(dk)
    kn = kf / np.sqrt((kf * kf).sum(-1, keepdims=True) + 1e-6)
    qn, kn = np.repeat(qn, rep, axis=1), np.repeat(kn, rep, axis=1)  # [n, VH, dk]
    decay = np.exp(-np.exp(A_log.astype(np.float64)) * ref.softplus(a.astype(np.float64) + dt_bias.astype(np.float64)))
    beta = 1.0 / (1.0 + np.exp(-b.astype(np.float64)))
    out = np.zeros((n, VH, dv))
    new_state = state.astype(np.float64).copy()
    for s in range(len(state_slots)):
        slot = int(state_slots[s])
        St = np.zeros((VH, dv, dk)) if fresh[s] else state[slot].astype(np.float64).copy()  # S transposed
        for t in range(int(cu_seqlens[s]), int(cu_seqlens[s + 1])):
            St *= decay[t][:, None, None]
            delta = (v[t].astype(np.float64) - np.einsum("hjd,hd->hj", St, kn[t])) * beta[t][:, None]
            St += delta[:, :, None] * kn[t][:, None, :]
            out[t] = np.einsum("hjd,hd->hj", St, qn[t])
        new_state[slot] = St
    return out.reshape(n, VH * dv), new_state

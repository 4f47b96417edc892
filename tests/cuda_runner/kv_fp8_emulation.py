"""moe_emulation's numpy device with the attention launches of an FP8 KV cache emulated (kernels/attention.cu,
flash_prefill.cu), so that check_fp8_kv's store and attention parts run end to end on the CPU
(tests/cuda_runner/test_check_fp8_kv_driver.py).

The emulations follow the kernels' contracts as their launchers pass the arguments (ops.py order): the store
writes q and the K / V rows rounded to the compute dtype, or their quantize_kv bytes and scales; the paged kernels
write each split's partial (acc, max, sum) over its key range, reading e4m3 x scale (exact in every paged kernel:
the mma kernel applies the scales per key, paged_mma_fp8.cuh); combine merges the splits and gates; flash prefill
writes the gated output over bf16(e4m3 x scale), the bf16 tile it dequantises into. `drop_v_scale` makes the
FP8 readers ignore the V scales: the mutation the driver test shows the check catching.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from gpu_engine.cuda.bf16 import round_to_bf16
from gpu_engine.reference.fp8_kv import dequantize_kv, quantize_kv
from tests.cuda_runner import references as ref
from tests.cuda_runner.moe_emulation import EmulatedContext


class Fp8KvContext(EmulatedContext):
    def __init__(self, nbytes: int = 512 << 20, seed: int = 0, drop_v_scale: bool = False) -> None:
        super().__init__(nbytes, seed)
        self.drop_v_scale = drop_v_scale

    def _launch(self, family: str, name: str, grid: Any, block: Any, *args: Any, shmem: int = 0) -> None:
        a = [float(v) if isinstance(v, (float, np.floating)) else int(v) for v in args]  # f32(scale) stays a float
        t = "bf16" if "bf16" in name else "f32"
        fp8 = "_fp8" in name
        if name.startswith("qk_norm_rope_store"):
            self.launches.append(name)
            self._store(t, fp8, *a)
        elif name.startswith("paged_attention"):
            self.launches.append(name)
            per_head = not name.startswith("paged_attention_mma")
            self._paged(t, fp8, per_head, grid, *a)
        elif name.startswith("attention_combine"):
            self.launches.append(name)
            self._combine_attn(t, *a)
        elif name.startswith("flash_prefill"):
            self.launches.append(name)
            self._flash(fp8, grid[1], *a)
        else:
            super()._launch(family, name, grid, block, *args, shmem=shmem)

    # ---- the K / V rows of a cache slot ---------------------------------------------------------------------
    def _rows(self, t: str, fp8: bool, cache: int, scales: int, slots: np.ndarray, kvh: int, hd: int,
              is_v: bool, bf16_tile: bool) -> np.ndarray:
        """[len(slots), kvh, hd] float32 as the reading kernel sees them (bf16_tile: rounded to bf16)."""
        count = int(slots.max()) + 1
        if not fp8:
            return self.read(cache, t, (count * kvh, hd)).reshape(count, kvh, hd)[slots]
        bits = self.raw(cache, "u8", count * kvh * hd).reshape(count, kvh, hd)[slots]
        s = self.raw(scales, "f32", count * kvh).reshape(count, kvh)[slots]
        if is_v and self.drop_v_scale:
            s = np.ones_like(s)
        values = dequantize_kv(bits, s)
        return round_to_bf16(values) if bf16_tile else values

    # ---- kernels --------------------------------------------------------------------------------------------
    def _store(self, t: str, fp8: bool, q_out: int, k_cache: int, v_cache: int, *rest: Any) -> None:
        k_scale, v_scale = (rest[0], rest[1]) if fp8 else (0, 0)
        (proj, stride, wq, wk, pos, pos_stride, inv, axis, slots_p, n, heads, kvh, hd, rot, eps, offset) = \
            rest[2:] if fp8 else rest
        proj_v = self.read(proj, t, (n, (2 * heads + 2 * kvh) * hd), stride)
        wqv, wkv = self.read(wq, t, (1, hd))[0], self.read(wk, t, (1, hd))[0]
        posv = self.raw(pos, "i32", 3 * pos_stride).reshape(3, pos_stride)[:, :n]
        invv, axisv = self.raw(inv, "f32", rot // 2), self.raw(axis, "i32", rot // 2)
        slots = self.raw(slots_p, "i32", n).copy()
        zc = offset == 1.0
        qn = ref.rmsnorm(proj_v[:, : 2 * heads * hd].reshape(n, heads, 2, hd)[:, :, 0], wqv, eps, zc)
        kn = ref.rmsnorm(proj_v[:, 2 * heads * hd: (2 * heads + kvh) * hd].reshape(n, kvh, hd), wkv, eps, zc)
        q = ref.rope(qn, posv, invv, axisv, rot).astype(np.float32)
        k = ref.rope(kn, posv, invv, axisv, rot).astype(np.float32)
        v = proj_v[:, (2 * heads + kvh) * hd:].reshape(n, kvh, hd)
        self.write(q_out, t, q.reshape(n, heads * hd))
        k, v = (round_to_bf16(k), round_to_bf16(v)) if t == "bf16" else (k, v)
        for slot, kr, vr in zip(slots, k, v):
            if fp8:
                for cache, scales, row in ((k_cache, k_scale, kr), (v_cache, v_scale, vr)):
                    bits, s = quantize_kv(row)
                    self.raw(cache + int(slot) * kvh * hd, "u8", kvh * hd)[:] = bits.reshape(-1)
                    self.raw(scales + int(slot) * kvh * 4, "f32", kvh)[:] = s
            else:
                self.write(k_cache + int(slot) * kvh * hd * (2 if t == "bf16" else 4), t, kr.reshape(1, -1))
                self.write(v_cache + int(slot) * kvh * hd * (2 if t == "bf16" else 4), t, vr.reshape(1, -1))

    def _paged(self, t: str, fp8: bool, per_head: bool, grid: Any, part_acc: int, part_ml: int, q: int,
               q_stride: int, k_cache: int, v_cache: int, *rest: Any) -> None:
        ks, vs = (rest[0], rest[1]) if fp8 else (0, 0)
        rest = rest[2:] if fp8 else rest
        if per_head:
            tables, width, tok_seq, tok_pos, n, heads, kvh, hd, bs, scale = rest
        else:
            tables, width, tok_seq, tok_pos, n, kvh, group, bs, scale = rest
            heads = kvh * group
            hd = q_stride // heads  # the checks pass de-interleaved q rows: stride = heads * head_dim
        splits = grid[2]
        seqs, poss = self.raw(tok_seq, "i32", n), self.raw(tok_pos, "i32", n)
        qv = self.read(q, t, (n, heads * hd), q_stride).reshape(n, heads, hd).astype(np.float64)
        acc = np.zeros((n, heads, splits, hd), np.float32)
        ml = np.zeros((n, heads, splits, 2), np.float32)
        table_all = self.raw(tables, "i32", (int(seqs.max()) + 1) * width).reshape(-1, width)
        for i in range(n):
            last = int(poss[i])
            table = table_all[seqs[i]]
            slots = np.array([table[p // bs] * bs + p % bs for p in range(last + 1)])
            k = self._rows(t, fp8, k_cache, ks, slots, kvh, hd, False, False)
            v = self._rows(t, fp8, v_cache, vs, slots, kvh, hd, True, False)
            per_split = (last + splits) // splits
            for h in range(heads):
                kh = h // (heads // kvh)
                s = k[:, kh].astype(np.float64) @ qv[i, h] * scale
                for sp in range(splits):
                    lo, hi = sp * per_split, min(last + 1, sp * per_split + per_split)
                    if hi <= lo:
                        ml[i, h, sp] = (-np.inf, 0.0)
                        continue
                    m = s[lo:hi].max()
                    p = np.exp(s[lo:hi] - m)
                    acc[i, h, sp] = p @ v[lo:hi, kh]
                    ml[i, h, sp] = (m, p.sum())
        self.write(part_acc, "f32", acc.reshape(-1, hd))
        self.write(part_ml, "f32", ml.reshape(-1, 2))

    def _combine_attn(self, t: str, out: int, part_acc: int, part_ml: int, splits: int, gate: int, gate_stride: int,
                      gate_hs: int, n: int, heads: int, hd: int) -> None:
        acc = self.raw(part_acc, "f32", n * heads * splits * hd).reshape(n, heads, splits, hd).astype(np.float64)
        ml = self.raw(part_ml, "f32", n * heads * splits * 2).reshape(n, heads, splits, 2).astype(np.float64)
        m_all = ml[..., 0].max(-1, keepdims=True)
        w = np.where(np.isneginf(ml[..., 0]), 0.0, np.exp(ml[..., 0] - m_all))
        o = (acc * w[..., None]).sum(2) / (ml[..., 1] * w).sum(-1)[..., None]
        g = np.stack([self.read(gate + h * gate_hs * (2 if t == "bf16" else 4), t, (n, hd), gate_stride)
                      for h in range(heads)], axis=1)
        self.write(out, t, (o * ref.sigmoid(g)).reshape(n, heads * hd).astype(np.float32))

    def _flash(self, fp8: bool, num_tiles: int, out: int, q: int, q_stride: int, gate: int, gate_stride: int,
               gate_hs: int, k_cache: int, v_cache: int, *rest: Any) -> None:
        ks, vs = (rest[0], rest[1]) if fp8 else (0, 0)
        tables, width, tok_seq, tok_pos, tiles_p, heads, kvh, bs, scale = rest[2:] if fp8 else rest
        hd = gate_hs // 2
        tiles = self.raw(tiles_p, "i32", 2 * num_tiles).reshape(num_tiles, 2)
        n = int(tiles[:, 0].max() + tiles[tiles[:, 0].argmax(), 1])  # rows up to the end of the last tile
        seqs, poss = self.raw(tok_seq, "i32", n), self.raw(tok_pos, "i32", n)
        qv = self.read(q, "bf16", (n, heads * hd), q_stride).reshape(n, heads, hd)
        g = np.stack([self.read(gate + h * gate_hs * 2, "bf16", (n, hd), gate_stride) for h in range(heads)], 1)
        table_all = self.raw(tables, "i32", (int(seqs.max()) + 1) * width).reshape(-1, width)
        result = np.zeros((n, heads * hd), np.float32)
        for first, count in tiles.tolist():
            table, last = table_all[seqs[first]], int(poss[first + count - 1])
            slots = np.array([table[p // bs] * bs + p % bs for p in range(last + 1)])
            k = self._rows("bf16", fp8, k_cache, ks, slots, kvh, hd, False, True)
            v = self._rows("bf16", fp8, v_cache, vs, slots, kvh, hd, True, True)
            part = ref.attention(qv[first:first + count], k, v, g[first:first + count], poss[first:first + count],
                                 scale)
            result[first:first + count] = part
        self.write(out, "bf16", result)

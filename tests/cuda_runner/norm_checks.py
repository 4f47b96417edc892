"""check_kernels' RMSNorm checks (kernels/norm.cu through ops.rmsnorm / add_rmsnorm / rmsnorm_gated).

Shapes cover both launch forms (norm_launch: a row per block for wide rows, 32 rows a block up to dim 256),
the 9B widths (hidden 4096, DeltaNet value heads 32 x 128 with z inside the 12,352-wide in_proj row, q/k heads of
256), partial last blocks and widths that are not 16-byte multiples. Each wide case is also run on a copy one
element off 16-byte alignment: that takes the kernels' element-by-element path, whose every output bit must equal
the 16-byte path's (same sum order, same arithmetic: the check is exact); the short-row form is compared, bit
for bit, with the same kernel launched as the scalar kernel was (a row per block of vt threads: block_sum's own
order). check_fp8's norm+quant cases compare the wide-row form with fp8.cu's norm_quant, bit for bit, too.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from gpu_engine.cuda.context import ITEMSIZE
from gpu_engine.cuda.norm_launch import norm_launch
from tests.cuda_runner import references as ref
from tests.cuda_runner.harness import rel_err

EPS = 1e-6


def differing(a: np.ndarray, b: np.ndarray) -> float:
    """Elements whose bits differ (bf16 outputs come back as exact float32)."""
    a32, b32 = np.ascontiguousarray(a, np.float32).ravel(), np.ascontiguousarray(b, np.float32).ravel()
    if a32.shape != b32.shape:
        raise AssertionError(f"shape {a32.shape} != {b32.shape}")
    return float(np.sum(a32.view(np.uint32) != b32.view(np.uint32)))


class NormChecks:
    """Mixed into check_kernels.Checker, whose rand / up / out / get / record / ops / ctx / _round it uses."""

    ctx: Any
    ops: Any

    def same_bits(self, name: str, t: str, a: np.ndarray, b: np.ndarray) -> None:
        self.record(name, "exact", differing(a, b), note=f"{t}, elements differing from the 16-byte path")

    def off_by_one(self, host: np.ndarray, t: str) -> Any:
        """`host` on the device one element past a 16-byte boundary, as a view of its shape."""
        buf = self.up(np.concatenate([np.zeros(1, np.float32), host.ravel()]), t)
        return buf.view(host.shape, 1)

    def rmsnorm(self, t: str) -> None:
        rows, dim = 37, 1000
        xs = self.rand((rows, 2 * dim), t)  # read with a row stride: q out of a fused q|gate projection
        w = self.rand((dim,), t, 0.1)
        for zc in (True, False):
            x, wd = self.up(xs, t), self.up(w, t)
            out = self.out((rows, dim), t)
            self.ops.rmsnorm(self.ctx, out, x, wd, rows, dim, EPS, zc, x_tok_stride=2 * dim)
            self.record(f"rmsnorm{'(zero-centred)' if zc else ''}", t,
                        rel_err(self.get(out), ref.rmsnorm(xs[:, :dim], w, EPS, zc)))
        # 4096: the 9B hidden (vt 1024 on 256 threads); 1001: not 16-byte rows (vt 512); 40, 128, 256: 32 rows a
        # block (partial last blocks). Each sum order must be the scalar layout's: same bits
        for rows, dim in ((64, 4096), (5, 1001), (9, 40), (21, 128), (21, 256)):
            xs, w = self.rand((rows, dim), t), self.rand((dim,), t, 0.1)
            xd, wd = self.up(xs, t), self.up(w, t)
            out = self.out((rows, dim), t)
            self.ops.rmsnorm(self.ctx, out, xd, wd, rows, dim, EPS, True)
            got = self.get(out)
            self.record(f"rmsnorm {rows}x{dim}", t, rel_err(got, ref.rmsnorm(xs, w, EPS, True)))
            if dim % 8 == 0:
                out_e = self.out((rows, dim), t)
                self.ops.rmsnorm(self.ctx, out_e, self.off_by_one(xs, t), wd, rows, dim, EPS, True)
                self.same_bits(f"rmsnorm {rows}x{dim} element path", t, self.get(out_e), got)
            lp, vt = norm_launch(rows, dim, ITEMSIZE[t], self.ops._threads(dim)), self.ops._threads(dim)
            if lp.block_rows > 1 or lp.block != vt:  # not the scalar kernel's launch: it must give its bits
                out_b = self.out((rows, dim), t)
                self.rmsnorm_scalar_layout(t, out_b, xd, wd, rows, dim)
                self.record(f"rmsnorm {rows}x{dim} vs the scalar kernel's launch", "exact",
                            differing(got, self.get(out_b)), note=f"{t}, elements differing")
        # per-head q/k norm straight out of a fused projection row [q0 g0 q1 g1 ... | k0 k1 | v0 v1]: 128 and the
        # 9B's 256 (short rows), 100 (bf16: the element path)
        for n, heads, kvh, hd in ((11, 4, 2, 128), (13, 16, 4, 256), (7, 3, 1, 100)):
            self.head_norm(t, n, heads, kvh, hd)

    def rmsnorm_scalar_layout(self, t: str, out: Any, x: Any, w: Any, rows: int, dim: int) -> None:
        """ops.rmsnorm's kernel (zero-centred, packed rows) launched as the scalar kernel was: a row per block of
        vt threads, each summing its own elements (block_sum's order by construction)."""
        vt = self.ops._threads(dim)
        lp = norm_launch(rows, dim, ITEMSIZE[t], vt, threads=vt)
        self.ctx.device.launch("norm", f"rmsnorm_{t}", lp.grid, lp.block, out.ptr, np.int64(dim), np.int32(dim),
                               x.ptr, np.int64(dim), np.int32(dim), np.int32(1), w.ptr, np.int32(rows),
                               np.int32(dim), np.float32(EPS), np.float32(1.0), *lp.args(), shmem=lp.shmem)

    def head_norm(self, t: str, n: int, heads: int, kvh: int, hd: int) -> None:
        width = (2 * heads + 2 * kvh) * hd
        rows_h = self.rand((n, width), t)
        wq, wk = self.rand((hd,), t, 0.1), self.rand((hd,), t, 0.1)
        proj = self.up(rows_h, t)
        q = self.out((n, heads * hd), t)
        self.ops.rmsnorm(self.ctx, q, proj, self.up(wq, t), n * heads, hd, EPS, True, heads=heads,
                         x_tok_stride=width, x_head_stride=2 * hd)
        k_at = proj.at(2 * heads * hd)
        self.ops.rmsnorm(self.ctx, k_at, k_at, self.up(wk, t), n * kvh, hd, EPS, True, heads=kvh,
                         x_tok_stride=width, out_tok_stride=width)  # in place
        q_ref = ref.rmsnorm(rows_h[:, : 2 * heads * hd].reshape(n, heads, 2, hd)[:, :, 0], wq, EPS, True)
        self.record(f"rmsnorm(per-head q, strided, hd {hd})", t, rel_err(self.get(q), q_ref.reshape(n, -1)))
        expect = rows_h.astype(np.float64).copy()
        k_cols = slice(2 * heads * hd, (2 * heads + kvh) * hd)
        expect[:, k_cols] = ref.rmsnorm(rows_h[:, k_cols].reshape(n, kvh, hd), wk, EPS, True).reshape(n, -1)
        self.record(f"rmsnorm(per-head k, in place, hd {hd})", t, rel_err(self.get(proj), expect))

    def add_rmsnorm(self, t: str) -> None:
        # 2048 and 5120 (27B hidden), 5121 leaves the last threads partly idle and is not 16-byte rows, 16384 is
        # past one 16-byte chunk per thread, 4096 the 9B hidden, 200 a row per warp with a partial last block
        for rows, dim in ((19, 2048), (3, 5120), (2, 5121), (2, 16384), (64, 4096), (33, 200)):
            r0, x, w = self.rand((rows, dim), t), self.rand((rows, dim), t), self.rand((dim,), t, 0.1)
            rd, xd, wd = self.up(r0, t), self.up(x, t), self.up(w, t)
            out = self.out((rows, dim), t)
            self.ops.add_rmsnorm(self.ctx, out, rd, xd, wd, EPS, True)
            s = r0.astype(np.float64) + x
            stored = self._round(s.astype(np.float32)) if t == "bf16" else s
            got, got_r = self.get(out), self.get(rd)
            self.record(f"add_rmsnorm dim {dim} (out)", t, rel_err(got, ref.rmsnorm(stored, w, EPS, True)))
            self.record(f"add_rmsnorm dim {dim} (residual)", t, rel_err(got_r, s))
            if dim % 8 == 0:
                re_, out_e = self.off_by_one(r0, t), self.out((rows, dim), t)
                self.ops.add_rmsnorm(self.ctx, out_e, re_, self.off_by_one(x, t), wd, EPS, True)
                self.same_bits(f"add_rmsnorm dim {dim} element path (out)", t, self.get(out_e), got)
                self.same_bits(f"add_rmsnorm dim {dim} element path (residual)", t, self.get(re_), got_r)

    def rmsnorm_gated(self, t: str) -> None:
        # (tokens, heads, dv, lead, tail): z sits in a wider fused-projection row after `lead` and before `tail`
        # columns. 32 x 128 at 8192 of a 12,352-wide row is the 9B in_proj; 512 a row per block; a row one wider
        # takes the element path and must give the 16-byte path's bits
        for tokens, heads, dv, lead, tail in ((9, 6, 128, 0, 40), (40, 32, 128, 8192, 64), (3, 2, 512, 0, 24)):
            x = self.rand((tokens * heads, dv), t)
            w = (1.0 + self.rand((dv,), "f32", 0.1)).astype(np.float32)
            w = self._round(w) if t == "bf16" else w
            z = self.rand((tokens * heads, dv), t)
            outs = []
            for zw in (lead + heads * dv + tail, lead + heads * dv + tail + 1):
                zwide = np.zeros((tokens, zw), np.float32)
                zwide[:, lead : lead + heads * dv] = z.reshape(tokens, heads * dv)
                out = self.out((tokens * heads, dv), t)
                self.ops.rmsnorm_gated(self.ctx, out, self.up(x, t), self.up(zwide, t).at(lead), self.up(w, t), EPS,
                                       heads, zw)
                outs.append(self.get(out))
            label = f"rmsnorm_gated {tokens}x{heads}x{dv}"
            self.record(label, t, rel_err(outs[0], ref.rmsnorm_gated(x, z, w, EPS)))
            self.same_bits(f"{label} element path", t, outs[1], outs[0])

"""Check the block-FP8 CUDA path on the GPU: each kernel against float64 numpy, then the tiny FP8 model against the
reference runner's FP8 emulation.

    python3 -m tests.cuda_runner.check_fp8 [--json out.json] [--seed N]

Kernels (fresh random inputs, every output poisoned first, metric ||out - ref|| / ||ref||):
- fp8_quant_act_bf16 against gpu_engine/fp8.py's recipe on the same bf16 values: scales and e4m3 bytes must be
  identical (tolerance 0 on the dequantised values);
- the norms with their output quantised (fp8_ops.norm_quant: rmsnorm and add_rmsnorm -> bf16 + e4m3 + scales)
  against ops.rmsnorm / ops.add_rmsnorm then fp8_quant_act_bf16: every output bit-identical (tolerance 0);
- the FP8 GEMMs (every streaming variant of fp8_ops.GEMV_VARIANTS for decode batches, 32 tokens a launch;
  cuBLASLt's block-scaled matmul) on host-quantised operands, written into a column slice of a wider
  output whose other columns must stay poisoned: bf16 output, tolerance 1e-2 (bf16 paths' rule; the error is the
  output rounding, ~1e-3);
- Fp8Linear / ConcatLinear (quantisation + GEMM, mixed FP8 and BF16 parts) on bf16 inputs against
  fake_quantize_activations(x) @ dequant(W)^T.
When cuBLASLt's block-scaled GEMM misses with the layouts of fp8_ops.py, the other scale layouts are tried and
reported (rows marked "layout probe"), so one run says which layout it reads.
Model: make_tiny_fp8_checkpoint (two configs: split and fused FP8 projections), CudaRunner (bf16) against the
reference runner on the same FP8 weights, check_runner's scenario (chunked prefill, vision slice, batched decode,
graph replay) with the emulation's greedy tokens forced. The float32 truth is the reference with exact activations
(FP8 weights dequantised, no activation quantisation); the FP8 emulation (fp8_activations=True) is what the kernels
compute in float32. Pass (the rule of the BF16 checks against transformers: no farther from the truth than the
reference's own FP8 run): max logits rel. err of CUDA vs truth <= TRUTH_RATIO x that of the emulation vs truth.
Tiny random models amplify the FP8 activation noise (the emulation itself moves the tiny model's logits by ~0.4),
so CUDA vs emulation (bf16 activations flip some e4m3 roundings) is reported, not bounded.
Skips (exit 0) without a GPU.
"""
from __future__ import annotations

import sys
import tempfile
import time
from collections.abc import Callable

import numpy as np

from tests.cuda_runner.harness import Result, check_main, fresh_seed, rel_err, result_table, run_guarded

GEMM_TOL = 1e-2
TRUTH_RATIO = 1.25  # CUDA FP8 vs the float32 truth, at most this times the reference FP8 emulation's distance
GEMV_CASES = ((1, 256, 64), (5, 200, 336), (8, 1024, 5120), (16, 640, 2048), (32, 384, 1152), (3, 5120, 17408),
              (1, 5120, 6144))
GEMV_PATHS = ("gemv", "gemv_stream", "gemv_splitk")
CUBLAS_CASES = ((8, 1024, 5120), (33, 256, 1152), (300, 512, 1024), (64, 384, 336), (1024, 2048, 5120))


def host_quantize_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """fp8.py's dynamic recipe, returning (e4m3 bytes [m, k], scales [groups, m]) rather than the fake-quantised
    values (what the kernel writes)."""
    from gpu_engine import fp8

    m, k = x.shape
    g = -(-k // 128)
    padded = np.zeros((m, g * 128), np.float32)
    padded[:, :k] = x
    tiles = padded.reshape(m, g, 128)
    amax = np.maximum(np.abs(tiles).max(axis=-1), np.float32(1e-10))
    s = (amax / np.float32(fp8.E4M3_MAX)).astype(np.float32)
    q = fp8.float32_to_e4m3(tiles / s[:, :, None]).reshape(m, g * 128)[:, :k]
    return np.ascontiguousarray(q), np.ascontiguousarray(s.T)


class Checker:
    def __init__(self, ctx, rng: np.random.Generator) -> None:
        from gpu_engine.cuda.bf16 import round_to_bf16

        self.ctx, self.rng, self._round = ctx, rng, round_to_bf16
        self.results: list[Result] = []
        self._weights: dict[tuple[int, int], tuple] = {}  # (n, k) -> (Fp8Tensor, float64 dequantised): one draw

    def record(self, name: str, err: float, tol: float, note: str = "", dtype: str = "fp8") -> None:
        self.results.append(Result(name, dtype, err, tol, bool(np.isfinite(err) and err <= tol), note))

    def run(self, name: str, tol: float, fn: Callable[[], None]) -> None:
        run_guarded(self.ctx, self.results, name, "fp8", tol, fn)

    def bf16_rows(self, m: int, k: int) -> np.ndarray:
        """bf16-valued rows with row scales over six decades and one all-zero 128-group (the floor)."""
        x = self.rng.standard_normal((m, k)).astype(np.float32) * 10.0 ** self.rng.uniform(-3, 3, (m, 1))
        x[0, : min(k, 128)] = 0.0
        return self._round(x.astype(np.float32))

    def weight(self, n: int, k: int):
        from gpu_engine import fp8
        from gpu_engine.tensors import Fp8Tensor

        w = self.rng.standard_normal((n, k)).astype(np.float32) * 10.0 ** self.rng.uniform(-3, 0, (n, 1))
        bits, scale_inv = fp8.quantize(w.astype(np.float32))
        return Fp8Tensor(bits, scale_inv, (128, 128), "F32")

    # ---- kernels ---------------------------------------------------------------------------------------------
    def quant(self, m: int, k: int) -> None:
        from gpu_engine import fp8
        from gpu_engine.cuda.fp8_ops import act_buffers, quantize_activations

        ctx = self.ctx
        x = self.bf16_rows(m, k)
        wide = np.zeros((m, k + 32), np.float32)
        wide[:, :k] = x
        xd = ctx.to_device(wide, "bf16", "x")
        xa = act_buffers(ctx, m, k)
        ctx.poison(xa.q)  # 0xFF: an e4m3 NaN
        ctx.poison(xa.scales)
        quantize_activations(ctx, xd, m, k, x_ld=k + 32, out=xa)
        q_ref, s_ref = host_quantize_rows(x)
        q = ctx.to_host(xa.q)
        s = ctx.to_host(xa.scales)[:, :m]
        same_q = float(np.mean(q == q_ref))
        same_s = bool(np.array_equal(s, s_ref))
        deq = fp8.e4m3_to_float32(q) * np.repeat(s.T, 128, axis=1)[:, :k]
        self.record(f"quant_act m{m} k{k}", rel_err(deq, fp8.fake_quantize_activations(x)), 0.0,
                    f"bytes equal {same_q:.6f}, scales equal {same_s}")

    def swiglu_quant(self, m: int, inter: int) -> None:
        """The MLP activation quantised in one kernel vs silu_mul then quantisation (bit for bit), and vs numpy."""
        from gpu_engine import fp8
        from gpu_engine.cuda import ops
        from gpu_engine.cuda.fp8_ops import act_buffers, quantize_activations

        ctx = self.ctx
        gu = self._round((self.rng.standard_normal((m, 2 * inter)) * 3.0).astype(np.float32))
        gud = ctx.to_device(gu, "bf16", "gu")
        fused, plain = act_buffers(ctx, m, inter), act_buffers(ctx, m, inter)
        for buf in (fused.q, fused.scales, plain.q, plain.scales):
            ctx.poison(buf)
        quantize_activations(ctx, gud, m, inter, out=fused, swiglu=True)
        act = ctx.empty((m, inter), "bf16", "act")
        ops.silu_mul(ctx, act, gud)
        quantize_activations(ctx, act, m, inter, out=plain)
        qf, qp = ctx.to_host(fused.q), ctx.to_host(plain.q)
        sf, sp = ctx.to_host(fused.scales)[:, :m], ctx.to_host(plain.scales)[:, :m]
        deq = fp8.e4m3_to_float32(qf) * np.repeat(sf.T, 128, axis=1)[:, :inter]
        same = bool(np.array_equal(qf, qp) and np.array_equal(sf, sp))
        g, u = gu[:, :inter].astype(np.float64), gu[:, inter:].astype(np.float64)
        act_ref = self._round((g / (1.0 + np.exp(-g)) * u).astype(np.float32))
        self.record(f"silu_mul+quant m{m} I{inter}", rel_err(deq, fp8.fake_quantize_activations(act_ref)), GEMM_TOL,
                    f"identical to silu_mul then quant: {same}")
        if not same:
            self.record(f"silu_mul+quant m{m} I{inter} == unfused", float("nan"), 0.0, "bytes or scales differ")

    def cublas_rows(self, m: int, n: int = 256, k: int = 1152) -> None:
        """Which row counts cuBLASLt's block-scaled matmul takes (a probe row each, never a verdict)."""
        from gpu_engine.cuda.fp8_ops import upload_fp8_weight

        ctx = self.ctx
        wt = self.weight(n, k)
        w = upload_fp8_weight(ctx, "w", [wt])
        xa, xdeq, _ = self._acts(m, k)
        y = ctx.empty((m, n), "bf16", "y")
        ctx.poison(y)
        try:
            ctx.blas.linear_fp8(y.ptr, xa.q.ptr, xa.scales.ptr, w.bits.ptr, w.scales.ptr, m, n, k)
            err, note = rel_err(ctx.to_host(y), xdeq @ wt.dequantize().astype(np.float64).T), "rows probe: ran"
        except Exception as exc:  # noqa: BLE001 - a probe row
            err, note = float("nan"), f"rows probe: {type(exc).__name__}: {exc}"[-150:]
        self.results.append(Result(f"probe cuBLASLt m{m}", "fp8", err, GEMM_TOL, False, note, skipped=True))

    def _acts(self, m: int, k: int):
        """Host-quantised activations uploaded in fp8_ops' layout, and their float64 dequantised values."""
        from gpu_engine import fp8
        from gpu_engine.cuda.fp8_ops import Fp8Activations

        ctx = self.ctx
        x = self.bf16_rows(m, k)
        q, s = host_quantize_rows(x)
        ld = -(-m // 4) * 4
        grid = np.ones((s.shape[0], ld), np.float32)
        grid[:, :m] = s
        qd = ctx.empty((m, k), "u8", "xq")
        ctx.device.upload(qd.ptr, q)
        sd = ctx.to_device(grid, "f32", "xs")
        deq = fp8.e4m3_to_float32(q).astype(np.float64) * np.repeat(s.T, 128, axis=1)[:, :k]
        return Fp8Activations(qd, sd, ld, 1), deq, (q, s)

    def norm_quant(self, m: int, dim: int, add: bool) -> None:
        """fp8_ops.norm_quant vs the norm kernel then the quantisation kernel: out, residual, bytes, scales."""
        from gpu_engine.cuda import ops
        from gpu_engine.cuda.fp8_ops import act_buffers, norm_quant, quantize_activations

        ctx = self.ctx
        x = self._round((self.rng.standard_normal((m, dim)) * 10.0 ** self.rng.uniform(-2, 2, (m, 1)))
                        .astype(np.float32))
        resid = self._round((self.rng.standard_normal((m, dim)) * 3.0).astype(np.float32))
        w = self._round((0.3 * self.rng.standard_normal(dim)).astype(np.float32))
        wd, xd = ctx.to_device(w, "bf16", "w"), ctx.to_device(x, "bf16", "x")
        rf, rp = ctx.to_device(resid, "bf16", "rf"), ctx.to_device(resid, "bf16", "rp")
        of, op = ctx.empty((m, dim), "bf16", "of"), ctx.empty((m, dim), "bf16", "op")
        ctx.poison(of)
        ctx.poison(op)
        fused = norm_quant(ctx, of, xd, wd, m, 1e-6, True, residual=rf if add else None)
        if add:
            ops.add_rmsnorm(ctx, op, rp, xd, wd, 1e-6, True)
        else:
            ops.rmsnorm(ctx, op, xd, wd, m, dim, 1e-6, True)
        plain = act_buffers(ctx, m, dim)
        quantize_activations(ctx, op, m, dim, out=plain)
        pairs = {"out": (of, op), "q": (fused.q, plain.q)} | ({"residual": (rf, rp)} if add else {})
        same = {name: bool(np.array_equal(ctx.to_host(a), ctx.to_host(b))) for name, (a, b) in pairs.items()}
        same["scales"] = bool(np.array_equal(ctx.to_host(fused.scales)[:, :m], ctx.to_host(plain.scales)[:, :m]))
        err = rel_err(ctx.to_host(of).astype(np.float64), ctx.to_host(op).astype(np.float64))
        self.record(f"{'add_' if add else ''}rmsnorm+quant m{m} d{dim}", err if all(same.values()) else float("nan"),
                    0.0, "identical to norm then quant: " + ", ".join(f"{k} {v}" for k, v in same.items()))

    def device_weight(self, n: int, k: int):
        """A random FP8 weight of [n, k] (drawn once per shape: the variants share it), its float64 dequantised
        values and a fresh upload of it (each case's buffers are released after it)."""
        from gpu_engine.cuda.fp8_ops import upload_fp8_weight

        if (n, k) not in self._weights:
            wt = self.weight(n, k)
            self._weights[(n, k)] = (wt, wt.dequantize().astype(np.float64))
        wt, deq = self._weights[(n, k)]
        return deq, upload_fp8_weight(self.ctx, "w", [wt])

    def gemm(self, path: str, m: int, n: int, k: int) -> None:
        from gpu_engine.cuda.fp8_ops import fp8_matmul

        ctx = self.ctx
        wdeq, w = self.device_weight(n, k)
        xa, xdeq, _ = self._acts(m, k)
        pad, off = 24, 8
        y = ctx.empty((m, n + pad), "bf16", "y")
        ctx.poison(y)
        took = fp8_matmul(ctx, y.view((m, n + pad - off), off), xa, w, y_ld=n + pad, path=path)
        out = ctx.to_host(y)
        expect = xdeq @ wdeq.T
        err = rel_err(out[:, off: off + n], expect)
        outside = np.concatenate([out[:, :off], out[:, off + n:]], axis=1)
        untouched = bool(np.all(np.isnan(outside)))
        self.record(f"gemm[{path}] m{m} n{n} k{k}", err if untouched else float("nan"), GEMM_TOL,
                    f"ran {took}; columns outside the slice {'untouched' if untouched else 'WRITTEN'}")
        if path == "cublaslt" and not (np.isfinite(err) and err <= GEMM_TOL):
            self.probe_layouts(m, n, k)

    def probe_layouts(self, m: int, n: int, k: int) -> None:
        """cuBLASLt with the scale tensors in each of the four (weight, activation) layouts: which one it reads."""
        from gpu_engine.cuda.fp8_ops import weight_scale_grid

        ctx = self.ctx
        wt = self.weight(n, k)
        wb = ctx.empty((n, k), "u8", "wb")
        ctx.device.upload(wb.ptr, np.ascontiguousarray(wt.bits))
        _, xdeq, (q, s) = self._acts(m, k)
        qd = ctx.empty((m, k), "u8", "xq")
        ctx.device.upload(qd.ptr, q)
        expect = xdeq @ wt.dequantize().astype(np.float64).T
        grid = np.asarray(wt.scale_inv, np.float32)
        w_layouts = {"w[nb,kb4]": weight_scale_grid(grid), "w[kb,nb4]": weight_scale_grid(grid.T)}
        mp = -(-m // 4) * 4
        x_g = np.ones((s.shape[0], mp), np.float32)
        x_g[:, :m] = s
        x_m = np.ones((m, -(-s.shape[0] // 4) * 4), np.float32)
        x_m[:, : s.shape[0]] = s.T
        for wname, wgrid in w_layouts.items():
            for xname, xgrid in (("x[g,m4]", x_g), ("x[m,g4]", x_m)):
                wsd, xsd = ctx.to_device(wgrid, "f32", "ws"), ctx.to_device(xgrid, "f32", "xs")
                y = ctx.empty((m, n), "bf16", "y")
                ctx.poison(y)
                try:
                    ctx.blas.linear_fp8(y.ptr, qd.ptr, xsd.ptr, wb.ptr, wsd.ptr, m, n, k)
                    err = rel_err(ctx.to_host(y), expect)
                    note = "layout probe"
                except Exception as exc:  # noqa: BLE001 - a probe row, not a verdict on the kernels
                    err, note = float("nan"), f"layout probe: {type(exc).__name__}: {exc}"[:160]
                self.results.append(Result(f"probe {wname} {xname} m{m}", "fp8", err, GEMM_TOL, False, note,
                                           skipped=True))

    def linear_chain(self, m: int) -> None:
        """Fp8Linear (plain and with the SwiGLU input) and a ConcatLinear of [FP8 128 rows | FP8 72 rows | BF16 40
        rows] on bf16 input; m = 37 runs cuBLASLt on 32 rows and the streaming kernel on 5."""
        from gpu_engine import fp8
        from gpu_engine.cuda.fp8_ops import upload_fp8_weight
        from gpu_engine.cuda.linear import ConcatLinear, DenseLinear, Fp8Linear

        ctx, k = self.ctx, 640
        x = self.bf16_rows(m, k)
        xd = ctx.to_device(x, "bf16", "x")
        xq = fp8.fake_quantize_activations(x).astype(np.float64)
        parts = [self.weight(128, k), self.weight(72, k)]
        dense = self._round(self.rng.standard_normal((40, k)).astype(np.float32) * 0.05)
        fp8_parts = [Fp8Linear(upload_fp8_weight(ctx, f"w{i}", [p])) for i, p in enumerate(parts)]
        layer = ConcatLinear((*fp8_parts, DenseLinear(ctx.to_device(dense, "bf16", "wd"))))
        y = ctx.empty((m, 240), "bf16", "y")
        ctx.poison(y)
        layer(ctx, y, xd, m)
        expect = np.concatenate([xq @ p.dequantize().astype(np.float64).T for p in parts]
                                + [x.astype(np.float64) @ dense.astype(np.float64).T], axis=1)
        self.record(f"ConcatLinear fp8|fp8|bf16 m{m}", rel_err(ctx.to_host(y), expect), GEMM_TOL)
        y1 = ctx.empty((m, 128), "bf16", "y1")
        ctx.poison(y1)
        fp8_parts[0](ctx, y1, xd, m)
        self.record(f"Fp8Linear m{m}", rel_err(ctx.to_host(y1), xq @ parts[0].dequantize().astype(np.float64).T),
                    GEMM_TOL)
        gu = self._round((self.rng.standard_normal((m, 2 * k)) * 2.0).astype(np.float32))
        y2 = ctx.empty((m, 128), "bf16", "y2")
        ctx.poison(y2)
        fp8_parts[0].swiglu(ctx, y2, ctx.to_device(gu, "bf16", "gu"), m)
        g, u = gu[:, :k].astype(np.float64), gu[:, k:].astype(np.float64)
        act = fp8.fake_quantize_activations(self._round((g / (1.0 + np.exp(-g)) * u).astype(np.float32)))
        self.record(f"Fp8Linear.swiglu m{m}", rel_err(ctx.to_host(y2), act.astype(np.float64)
                                                      @ parts[0].dequantize().astype(np.float64).T), GEMM_TOL)


def run_kernels(seed: int) -> tuple[list[Result], dict]:
    from gpu_engine.cuda.context import GpuContext

    ctx = GpuContext(budget_bytes=2 << 30)
    info = {"seed": seed, "device": ctx.device.info.name, "arch": ctx.device.info.arch,
            "cublaslt_version": ctx.blas.version}
    try:
        c = Checker(ctx, np.random.default_rng(seed))
        t0 = time.perf_counter()
        for m, k in ((3, 64), (37, 640), (5, 5120), (2, 17408), (300, 1152)):
            c.run(f"quant_act m{m} k{k}", 0.0, lambda m=m, k=k: c.quant(m, k))
        for m, dim in ((1, 5120), (5, 336), (8, 2048), (37, 640)):
            for add in (False, True):
                name = f"{'add_' if add else ''}rmsnorm+quant m{m} d{dim}"
                c.run(name, 0.0, lambda m=m, d=dim, a=add: c.norm_quant(m, d, a))
        for path in GEMV_PATHS:
            for m, n, k in GEMV_CASES:
                c.run(f"gemm[{path}] m{m} n{n} k{k}", GEMM_TOL, lambda m=m, n=n, k=k, p=path: c.gemm(p, m, n, k))
        for m, n, k in CUBLAS_CASES:
            c.run(f"gemm[cublaslt] m{m} n{n} k{k}", GEMM_TOL, lambda m=m, n=n, k=k: c.gemm("cublaslt", m, n, k))
        for m, inter in ((3, 128), (37, 17408), (300, 1152)):
            c.run(f"silu_mul+quant m{m}", GEMM_TOL, lambda m=m, i=inter: c.swiglu_quant(m, i))
        for m in (4, 37, 300):
            c.run(f"linear chain m{m}", GEMM_TOL, lambda m=m: c.linear_chain(m))
        for m in (33, 34, 36, 40, 44, 48):
            c.run(f"probe cuBLASLt m{m}", GEMM_TOL, lambda m=m: c.cublas_rows(m))
        info["kernel_seconds"] = round(time.perf_counter() - t0, 2)
        return c.results, info
    finally:
        ctx.close()


def run_model(seed: int) -> list[Result]:
    from gpu_engine.config import ModelConfig
    from gpu_engine.cuda.options import CudaOptions
    from gpu_engine.cuda.runner import CudaRunner
    from gpu_engine.loader import load_weights
    from gpu_engine.reference.runner import ReferenceRunner
    from gpu_engine.tiny_fp8 import make_tiny_fp8_checkpoint
    from tests.cuda_runner.check_runner import CONFIGS, _drive

    results = []
    for name, text_cfg in CONFIGS.items():
        with tempfile.TemporaryDirectory() as folder:
            make_tiny_fp8_checkpoint(folder, seed=seed % 1000, text_config=text_cfg)
            config = ModelConfig.from_pretrained(folder)
            weights, _ = load_weights(folder, config)
        emulated, ref_greedy = _drive(ReferenceRunner(config, weights, fp8_activations=True), config, seed)
        plain, _ = _drive(ReferenceRunner(config, weights), config, seed, forced=ref_greedy)
        runner = CudaRunner(config, weights, CudaOptions(dtype="bf16", memory_budget=1 << 30))
        try:
            steps, _ = _drive(runner, config, seed, forced=ref_greedy)
        finally:
            runner.close()
        errs = [rel_err(a, b) for a, b in zip(steps, emulated)]
        agree = float(np.mean(np.concatenate([a.argmax(-1) == b.argmax(-1) for a, b in zip(steps, emulated)])))
        vs_truth = max(rel_err(a, b) for a, b in zip(steps, plain))
        emu_vs_truth = max(rel_err(a, b) for a, b in zip(emulated, plain))
        print(f"model {name}: per-step logits rel. err vs emulation " + " ".join(f"{e:.1e}" for e in errs))
        ratio = vs_truth / emu_vs_truth
        results.append(Result(f"model {name} (vs truth / emulation's)", "fp8", ratio, TRUTH_RATIO,
                              bool(np.isfinite(ratio) and ratio <= TRUTH_RATIO),
                              f"vs truth {vs_truth:.2e}, emulation vs truth {emu_vs_truth:.2e}; vs emulation "
                              f"{max(errs):.2e}, top-1 {agree:.3f}"))
    return results


def run_all(seed: int | None = None) -> tuple[list[Result], dict]:
    from gpu_engine.cuda.device import require_gpu

    require_gpu()
    seed = fresh_seed(seed)
    results, info = run_kernels(seed)
    mark = len(results)
    try:
        results += run_model(seed)
    except Exception as exc:  # noqa: BLE001 - the kernel rows above still print
        import traceback

        traceback.print_exc()
        results.append(Result("model", "fp8", float("nan"), TRUTH_RATIO, False, f"{type(exc).__name__}: {exc}"[:200]))
    info["model_rows"] = len(results) - mark
    return results, info


def format_table(results: list[Result]) -> str:
    return result_table(results, width=44)


def main(argv: list[str] | None = None) -> int:
    return check_main(__doc__.splitlines()[0], run_all, format_table, argv)


if __name__ == "__main__":
    sys.exit(main())

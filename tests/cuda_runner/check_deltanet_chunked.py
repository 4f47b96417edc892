"""Check the chunked (WY-form, tensor-core) gated delta rule against the float64 token-by-token reference.

Run on a GPU machine:   python3 -m tests.cuda_runner.check_deltanet_chunked [--json out.json] [--seed N]
Without a GPU or cuda-python it prints why and exits 0 (skip). Exit 1 if any check fails.

Same rules as check_kernels: fresh random inputs each run (seed printed), bf16 inputs rounded before upload and the
reference sees the rounded values, outputs poisoned before the launch, metric ||out - ref|| / ||ref|| (NaN fails).
Each case is one varlen batch (random lengths 1..300, a 0-token sequence, chunk-boundary lengths, fresh and
continued states, state slots in shuffled order, q|k|v and a|b read from wider rows as the runner lays them out);
outputs and the whole state array (untouched slots must come back bit-identical) are compared. Every variant of
the launcher (deltanet_chunked.VARIANTS: "current", "states") runs at both scan slice widths on the same inputs and
is held to the same reference and tolerance; a states row's note also counts the output / state elements that
differ from the current variant's (the two are meant to be bit-identical; the count is reported, not a failure).
The 8192-token case at the 27B head shape also runs the sequential kernel (ops.gated_delta_rule two_pass) on the
same inputs and reports its error against the same reference. Tolerance: bf16 1e-2.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass

import numpy as np

from tests.cuda_runner import chunked_delta_emulation as emu
from tests.cuda_runner.harness import Result, check_main, rel_err, result_table, run_checks, run_guarded

TOL = 1e-2


@dataclass(frozen=True)
class Case:
    name: str
    k_heads: int
    v_heads: int
    dk: int
    dv: int
    lens: tuple[int, ...]  # fixed lengths; random ones are added per run when `random_lens`
    random_lens: int = 0
    a_shift: float = 0.0  # negative: slower decay, the state carries across more chunks
    with_sequential: bool = False


CASES = (
    Case("tiny (2/4 heads, dk 128, dv 64)", 2, 4, 128, 64, (1, 0, 63, 64, 65, 300), random_lens=3),
    Case("tiny (1/2 heads, dk 64, dv 64, slow decay)", 1, 2, 64, 64, (130, 7), random_lens=2, a_shift=-4.0),
    Case("9B heads (16/32, dk 128, dv 128)", 16, 32, 128, 128, (64, 129), random_lens=2),
    Case("27B heads (16/48, dk 128, dv 128)", 16, 48, 128, 128, (1, 128, 200), random_lens=4),
    Case("27B heads, 8192 tokens, continued", 16, 48, 128, 128, (8192,), a_shift=-2.0, with_sequential=True),
    Case("2B heads (16/16, dk 128, dv 128), 8192 tokens, continued", 16, 16, 128, 128, (8192,), a_shift=-2.0),
)


class Checker:
    def __init__(self, ctx, rng: np.random.Generator) -> None:
        from gpu_engine.cuda.bf16 import round_to_bf16

        self.ctx, self.rng, self._round = ctx, rng, round_to_bf16
        self.results: list[Result] = []

    def rand(self, shape, scale: float = 1.0, bf16: bool = True) -> np.ndarray:
        x = (self.rng.standard_normal(shape) * scale).astype(np.float32)
        return self._round(x) if bf16 else x

    def record(self, name: str, err: float, note: str = "") -> None:
        self.results.append(Result(name, "bf16", err, TOL, bool(np.isfinite(err) and err <= TOL), note))

    def run(self, case: Case) -> None:
        run_guarded(self.ctx, self.results, case.name, "bf16", TOL, lambda: self._case(case))

    def _case(self, case: Case) -> None:
        from gpu_engine.cuda import deltanet_chunked, ops

        ctx, rng = self.ctx, self.rng
        kh, vh, dk, dv = case.k_heads, case.v_heads, case.dk, case.dv
        lens = list(case.lens) + [int(x) for x in rng.integers(1, 301, case.random_lens)]
        lens = [lens[i] for i in rng.permutation(len(lens))]
        seqs, n = len(lens), sum(lens)
        cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        num_slots = seqs + 2
        slots = rng.permutation(num_slots)[:seqs].astype(np.int32)
        fresh = rng.integers(0, 2, seqs).astype(np.int32)
        if seqs > 1:
            fresh[0], fresh[1] = 1, 0  # both kinds in every multi-sequence batch
        else:
            fresh[0] = 0  # a lone sequence continues from its state (the harder case)
        key_w, conv_dim = kh * dk, 2 * kh * dk + vh * dv
        qkv_w, ab_w = conv_dim + 32, 2 * vh + 8  # wider rows, as the runner's conv_out / in_proj
        qkv = self.rand((n, qkv_w))
        ab = self.rand((n, ab_w))
        ab[:, :vh] += case.a_shift
        ab = self._round(ab.astype(np.float32))
        A_log = np.log(rng.uniform(0.5, 8.0, vh)).astype(np.float32)
        dt_bias = self.rand((vh,), 0.5, bf16=False)
        state = self.rand((num_slots, vh, dv, dk), 0.3, bf16=False)
        q = qkv[:, :key_w].reshape(n, kh, dk)
        k = qkv[:, key_w:2 * key_w].reshape(n, kh, dk)
        v = qkv[:, 2 * key_w:2 * key_w + vh * dv].reshape(n, vh, dv)
        a, b = ab[:, :vh], ab[:, vh:2 * vh]
        t0 = time.perf_counter()
        reference = emu.token_reference_fast if n > 2000 else emu.token_reference_batch
        exp_out, exp_state = reference(q, k, v, a, b, A_log, dt_bias, state, cu, slots, fresh)
        ref_s = time.perf_counter() - t0

        up = ctx.to_device
        qkvd, abd = up(qkv, "bf16", "qkv"), up(ab, "bf16", "ab")
        A_d, dt_d = up(A_log, "f32", "A_log"), up(dt_bias, "f32", "dt_bias")
        cu_d, slots_d, fresh_d = up(cu, "i32", "cu"), up(slots, "i32", "slots"), up(fresh, "i32", "fresh")
        untouched = np.setdiff1d(np.arange(num_slots), slots)
        label = f"{case.name}, lens {lens}" if len(lens) <= 8 else case.name
        # the chunked scan in the launcher's own choice of slice width, then in the other width (both paths at
        # every shape: 16-column slices are picked for low head x sequence counts, 32 for the rest)
        auto = deltanet_chunked.scan_slice(dv, vh, seqs, ctx.device.info.sm_count)
        other = deltanet_chunked.DV_SLICE + deltanet_chunked.NARROW_DV_SLICE - auto
        methods = [f"{variant}/{width}" for variant in deltanet_chunked.VARIANTS
                   for width in (f"{auto} (auto)", str(other))] + (["sequential"] if case.with_sequential else [])
        first: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # variant -> (out, state) of its auto-width run
        for method in methods:
            state_d = up(state, "f32", "state")
            out = ctx.empty((n, vh * dv), "bf16", "out")
            ctx.poison(out)
            args = (ctx, out, qkvd, qkvd.at(key_w), qkvd.at(2 * key_w), qkv_w, abd, abd.at(vh), ab_w, A_d, dt_d,
                    state_d, cu_d, slots_d, fresh_d, kh, vh, dk, dv)
            variant = method.split("/")[0]
            if variant in deltanet_chunked.VARIANTS:
                width = None if method.endswith("(auto)") else other
                deltanet_chunked.chunked_gated_delta_rule(*args, dv_slice=width, variant=variant)
            else:
                ops.gated_delta_rule(*args, method="two_pass")
            ctx.device.sync()
            got_out, got_state = ctx.to_host(out), ctx.to_host(state_d)
            note = f"{n} tokens, reference {ref_s:.1f} s"
            first.setdefault(variant, (got_out, got_state))
            if variant != "current" and variant in deltanet_chunked.VARIANTS and "current" in first:
                cur_out, cur_state = first["current"]
                note += (f", differs from current: {int(np.sum(got_out != cur_out))} out / "
                         f"{int(np.sum(got_state[slots] != cur_state[slots]))} state elements")
            self.record(f"{method}: {label} (out)", rel_err(got_out, exp_out), note)
            self.record(f"{method}: {case.name} (state)", rel_err(got_state[slots], exp_state[slots]), note)
            changed = int(np.sum(got_state[untouched] != state[untouched]))
            self.results.append(Result(f"{method}: {case.name} (untouched slots)", "exact", float(changed), 0.0,
                                       changed == 0, "changed elements"))


def run_all(seed: int | None = None) -> tuple[list[Result], dict]:
    """Run every case; raises CudaUnavailable when there is no GPU / cuda-python."""
    return run_checks(seed, 6 << 30, Checker, CASES, Checker.run)


def format_table(results: list[Result]) -> str:
    width = max(40, *(len(r.name) for r in results)) if results else 40
    return result_table(results, width=width)


def main(argv: list[str] | None = None) -> int:
    return check_main(__doc__.splitlines()[0], run_all, format_table, argv)


if __name__ == "__main__":
    sys.exit(main())

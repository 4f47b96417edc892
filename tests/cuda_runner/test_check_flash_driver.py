"""check_flash and bench/cuda_flash_prefill_bench.py on the CPU over a numpy device whose flash kernels keep their
tile contract (fa2 computes at most 64 rows of a tile, ws at most 128; rows beyond stay poisoned): the scripts'
plumbing (tiles of the right size for each variant, the ws rows on sm_90 only, arguments through ops' launcher)
holds, and tiles built for the wrong kernel fail the check. The kernels themselves run in the scripts on a GPU."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np

from gpu_engine.cuda import context, flash_plan, ops
from tests.cuda_runner import check_flash
from tests.cuda_runner import references as ref
from tests.cuda_runner.harness import passed
from tests.cuda_runner.kv_fp8_emulation import Fp8KvContext

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))


class FlashContext(Fp8KvContext):
    """Flash launches emulated per tile (float64 attention), at most the kernel's rows of each tile written."""

    def __init__(self, arch: str = "sm_90", tile_rows: dict[str, int] | None = None) -> None:
        super().__init__(512 << 20)
        self.device.info.arch = arch
        self.tile_rows = tile_rows or {"flash_prefill_ws_bf16_hd256": 128}

    def poison(self, arr: Any) -> None:
        self.raw(arr.ptr, "u8", arr.nbytes)[:] = 0xFF

    def to_host(self, arr: Any) -> np.ndarray:
        return self.read(arr.ptr, arr.dtype, (arr.shape[0], int(np.prod(arr.shape[1:]))))

    def _flash(self, fp8: bool, num_tiles: int, out: int, q: int, q_stride: int, gate: int, gate_stride: int,
               gate_hs: int, k_cache: int, v_cache: int, *rest: Any) -> None:
        tables, width, tok_seq, tok_pos, tiles_p, heads, kvh, bs, scale = rest
        name = self.launches[-1]
        limit, hd = self.tile_rows.get(name, 64), int(name.rsplit("_hd", 1)[1])
        tiles = self.raw(tiles_p, "i32", 2 * num_tiles).reshape(num_tiles, 2)
        n = int(tiles[:, 0].max() + tiles[tiles[:, 0].argmax(), 1])
        seqs, poss = self.raw(tok_seq, "i32", n), self.raw(tok_pos, "i32", n)
        qv = self.read(q, "bf16", (n, heads * hd), q_stride).reshape(n, heads, hd)
        g = np.stack([self.read(gate + h * gate_hs * 2, "bf16", (n, hd), gate_stride) for h in range(heads)], 1)
        table_all = self.raw(tables, "i32", (int(seqs.max()) + 1) * width).reshape(-1, width)
        for first, count in tiles.tolist():
            count = min(count, limit)  # the kernel's rows of a tile; the rest is never written
            table, last = table_all[seqs[first]], int(poss[first + count - 1])
            slots = np.array([table[p // bs] * bs + p % bs for p in range(last + 1)])
            k = self._rows("bf16", False, k_cache, 0, slots, kvh, hd, False, True)
            v = self._rows("bf16", False, v_cache, 0, slots, kvh, hd, True, True)
            part = ref.attention(qv[first:first + count], k, v, g[first:first + count], poss[first:first + count],
                                 scale)
            self.write(out + first * heads * hd * 2, "bf16", part.reshape(count, heads * hd))


SMALL = [("hd256 4:1 chunk 200", 4, 1, 256, 16, [(0, 200)]),
         ("hd128 2:1 chunk 70", 2, 1, 128, 16, [(0, 70)])]
SMALL_WS = [("hd256 4:1 bs 24 varlen", 4, 1, 256, 24, [(100, 150), (0, 33), (5, 1)])]


def _run(monkeypatch, **kwargs):
    made = []

    def fake(budget_bytes: int, *args, **kw):
        made.append(FlashContext(**kwargs))
        return made[-1]

    monkeypatch.setattr(context, "GpuContext", fake)
    monkeypatch.setattr(check_flash, "CASES", SMALL)
    monkeypatch.setattr(check_flash, "WS_CASES", SMALL_WS)
    results, _ = check_flash.run_all(3)
    return results, made[0]


def test_the_check_runs_both_kernels_on_sm_90_and_passes_kernels_that_keep_the_contract(monkeypatch):
    results, ctx = _run(monkeypatch)
    assert passed(results), [r for r in results if not r.ok]
    assert [r.name.endswith("[ws]") for r in results] == [False, True, False, False, True]
    assert ctx.launches.count("flash_prefill_ws_bf16_hd256") == 2


def test_elsewhere_only_fa2_runs(monkeypatch):
    results, ctx = _run(monkeypatch, arch="sm_80")
    assert passed(results) and not any("[ws]" in r.name for r in results)
    assert "flash_prefill_ws_bf16_hd256" not in ctx.launches


def test_tiles_built_for_the_wrong_kernel_fail_the_check(monkeypatch):
    # a ws kernel that only computes 64 rows a tile, as fa2 does: the 128-row tiles' second halves stay NaN
    results, _ = _run(monkeypatch, tile_rows={"flash_prefill_ws_bf16_hd256": 64})
    bad = [r for r in results if not r.ok]
    assert bad and all(r.name.endswith("[ws]") for r in bad)


def test_the_bench_times_both_kernels_and_reports_agreement(monkeypatch):
    import cuda_flash_prefill_bench as bench

    monkeypatch.setattr(bench, "WORKLOADS", {"fresh 150": [(0, 150)], "doc 2 x (40+60)": [(40, 60)] * 2})
    ctx = FlashContext()
    rng = np.random.default_rng(1)
    for workload in bench.WORKLOADS:
        rows = bench.bench_case(ctx, rng, "9b", workload, ["fa2", "ws"], reps=1)
        assert [r["variant"] for r in rows] == ["fa2", "ws"] and all(r["finite"] for r in rows)
        assert rows[1]["agree_vs_fa2"] < 1e-2 and rows[0]["tflops"] > 0
    assert bench.causal_flops([(2, 3)], 16) == 4 * 256 * 16 * (3 + 4 + 5)
    assert flash_plan.FLASH_TILE_ROWS == {"fa2": 64, "ws": 128, "ws2": 128}

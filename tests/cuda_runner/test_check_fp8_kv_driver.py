"""check_fp8_kv's store and attention parts on the CPU over kv_fp8_emulation's numpy device: the check's inputs,
references and argument plumbing (through ops' launchers) hold, and a reader that drops the V scales fails it.
The kernels themselves are checked on the GPU by the script."""
from __future__ import annotations

import pytest

from gpu_engine.cuda import context
from tests.cuda_runner import check_fp8_kv
from tests.cuda_runner.harness import passed
from tests.cuda_runner.kv_fp8_emulation import Fp8KvContext


def _run(monkeypatch, parts, **kwargs):
    made = []

    def fake(budget_bytes: int, *args, **kw):
        made.append(Fp8KvContext(**kwargs))
        return made[-1]

    monkeypatch.setattr(context, "GpuContext", fake)
    results, info = check_fp8_kv.run_all(7, parts)
    return results, made[0]


@pytest.mark.slow
def test_the_check_passes_over_kernels_that_keep_the_contract(monkeypatch):
    results, ctx = _run(monkeypatch, ("store", "attention"))
    assert passed(results), [r for r in results if not r.ok]
    names = set(ctx.launches)
    assert {"qk_norm_rope_store_fp8_bf16", "qk_norm_rope_store_fp8_f32", "paged_attention_fp8_f32",
            "paged_attention_fp8_bf16", "paged_attention_mma_fp8_bf16_hd256", "paged_attention_mma_fp8_bf16_hd64",
            "flash_prefill_fp8_bf16_hd128"} <= names
    assert len([r for r in results if "flash_prefill" in r.name]) == 5  # every bf16 shape


def test_a_reader_that_drops_the_v_scales_fails_the_check(monkeypatch):
    results, _ = _run(monkeypatch, ("attention",), drop_v_scale=True)
    bad = [r for r in results if not r.ok]
    assert bad and all("fp8" in r.name for r in bad) and not passed(results)


def test_the_timing_part_covers_the_issue_shapes_bf16_against_fp8():
    assert set(check_fp8_kv.TIMING_CASES) == {(1, 131072), (32, 32768), (192, 8192)}
    assert check_fp8_kv.SPEEDUP_GOAL == 1.3 and "timing" in check_fp8_kv.PARTS

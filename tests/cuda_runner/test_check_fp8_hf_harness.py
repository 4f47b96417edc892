"""check_fp8_hf's host side on the CPU: how it hands transformers a local copy of the fine-grained FP8 kernel (the GPU
machine is offline), the README table it prints, and one config through its CPU harness (the reference runner
with the FP8 emulation as "ours", torch on the CPU dequantising the files), so the one device call cannot stop on
a host-side error."""
from __future__ import annotations

import sys

import numpy as np
import pytest
from ci_rule import require_module

require_module("torch")
require_module("transformers")
require_module("accelerate", "needed by transformers' FP8 integration (the [test] extra)")

from tests.cuda_runner import check_fp8_hf  # noqa: E402

FAKE_MATMUL = '''
class Config:
    def __init__(self, warps, stages):
        self.num_warps, self.num_stages = warps, stages


class Tuner:
    configs = [Config(w, s) for w in (2, 4, 8) for s in (2, 3, 4)]


w8a8_block_dynamic_fp8_matmul_kernel = Tuner()
'''


@pytest.fixture
def fake_kernel(tmp_path, monkeypatch):
    """A stand-in for the kernel package (its import layout only) and transformers' state restored afterwards."""
    import transformers.integrations.finegrained_fp8 as hf_fp8
    from transformers.integrations import hub_kernels

    package = tmp_path / "k" / check_fp8_hf.KERNEL_PACKAGE
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("from . import _ops, matmul\n")
    (package / "matmul.py").write_text(FAKE_MATMUL)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(hf_fp8, "is_kernels_available", hf_fp8.is_kernels_available)
    monkeypatch.setitem(hub_kernels._KERNEL_MODULE_MAPPING, check_fp8_hf.KERNEL_NAME, None)
    yield tmp_path / "k", hf_fp8, hub_kernels
    for name in [m for m in sys.modules if m.split(".")[0] == check_fp8_hf.KERNEL_PACKAGE]:
        del sys.modules[name]


def test_the_local_kernel_is_what_transformers_loads(fake_kernel):
    folder, hf_fp8, hub_kernels = fake_kernel
    staged = check_fp8_hf.use_local_kernel(str(folder))
    module = hub_kernels._KERNEL_MODULE_MAPPING[check_fp8_hf.KERNEL_NAME]
    assert module.__file__.startswith(staged)  # a copy: the carried folder may be read-only
    assert hf_fp8.is_kernels_available()
    assert hub_kernels.lazy_load_kernel(check_fp8_hf.KERNEL_NAME) is module
    tuned = module.matmul.w8a8_block_dynamic_fp8_matmul_kernel.configs
    assert [(c.num_warps, c.num_stages) for c in tuned] == [(4, 3)]  # one config: no autotune search
    ops = module._ops
    assert ops.add_op_namespace_prefix("matmul") == f"{ops.NAMESPACE}::matmul"


def test_the_readme_table_has_a_row_per_engine_and_config():
    row = {"top1_fp8_vs_own_bf16": 0.8, "rel_l2_fp8_vs_own_bf16": 0.1, "top1_fp8_vs_f32_bf16": 0.81,
           "rel_l2_fp8_vs_f32_bf16": 0.099}
    table = check_fp8_hf.markdown_table({"small": {"ours": row, "hf": row}, "medium": {"ours": row, "hf": row}})
    lines = table.splitlines()
    assert len(lines) == 6 and lines[2].startswith("| small | docpipe CUDA | 0.800 | 0.1 |")
    assert lines[5].startswith("| medium | transformers 5.17 |")


def test_one_config_through_the_cpu_harness(monkeypatch):
    monkeypatch.setitem(check_fp8_hf._MODE, "device", "cpu")
    monkeypatch.setitem(check_fp8_hf._MODE, "reference", True)
    monkeypatch.setattr(check_fp8_hf, "PREFILL", 12)
    monkeypatch.setattr(check_fp8_hf, "DECODE", 4)
    results, info = check_fp8_hf.check_config("tiny", {}, 3, np.random.default_rng(3))
    assert [r.metric for r in results] == ["ours vs f32 truth / transformers'"] * 2 + [
        "transformers ran FP8Linear (e4m3)"]
    assert all(np.isfinite(r.value) for r in results)
    assert info["positions"] == 16
    assert info["ours"]["rel_l2_bf16_vs_f32_bf16"] == 0.0  # the harness's "ours" on BF16 is the truth itself
    assert 0.0 < info["truth"]["rel_l2_fp8_vs_bf16"] < 1.0
    assert 0.0 <= info["hf"]["top1_fp8_vs_own_bf16"] <= 1.0

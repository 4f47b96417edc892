"""The GPU check scripts under pytest: skipped (with the reason) where there is no GPU or no cuda-python."""
from __future__ import annotations

import importlib

import pytest

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("script, what", [
    ("check_kernels", "every CUDA kernel vs its float64 numpy reference"),
    ("check_runner", "CudaRunner vs the numpy ReferenceRunner"),
    ("check_vision", "the GPU vision tower vs the numpy reference tower"),
    ("check_flash", "the tiled prefill attention vs float64 attention"),
    ("check_deltanet_chunked", "the chunked gated delta rule vs the token-by-token float64 reference"),
    ("check_sampling", "the GPU sampler vs the numpy sampler"),
    ("check_vision_flash", "the vision tower's flash attention vs float64 attention"),
])
def test_gpu_check_passes(script: str, what: str) -> None:
    from gpu_engine.cuda.errors import CudaUnavailable

    check = importlib.import_module(f"tests.cuda_runner.{script}")
    try:
        results, _ = check.run_all()
    except CudaUnavailable as exc:
        pytest.skip(f"no GPU for {script} ({what}): {exc}")
    ran = [r for r in results if not getattr(r, "skipped", False)]  # a skipped row is not a pass
    assert ran, f"{script}: no checks ran"
    assert all(r.ok for r in ran), "\n" + check.format_table(results)

"""GPU kernel checks under pytest: skipped (with the reason) where there is no GPU or no cuda-python."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu


def test_every_kernel_matches_numpy_reference() -> None:
    from gpu_engine.cuda.errors import CudaUnavailable
    from tests.gpu.check_kernels import format_table, run_all

    try:
        results, _ = run_all()
    except CudaUnavailable as exc:
        pytest.skip(f"no GPU for the CUDA kernel checks: {exc}")
    assert results, "no checks ran"
    assert all(r.ok for r in results), "\n" + format_table(results)


def test_cuda_runner_matches_reference_runner() -> None:
    from gpu_engine.cuda.errors import CudaUnavailable
    from tests.gpu.check_runner import format_table, run_all

    try:
        results, _ = run_all()
    except CudaUnavailable as exc:
        pytest.skip(f"no GPU for the CUDA runner check: {exc}")
    assert all(r.ok for r in results), "\n" + format_table(results)


def test_gpu_vision_tower_matches_reference_tower() -> None:
    from gpu_engine.cuda.errors import CudaUnavailable
    from tests.gpu.check_vision import format_table, run_all

    try:
        results, _ = run_all()
    except CudaUnavailable as exc:
        pytest.skip(f"no GPU for the vision tower check: {exc}")
    assert results and all(r.ok for r in results), "\n" + format_table(results)

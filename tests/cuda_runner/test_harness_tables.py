"""The kernel-level checks' shared table (harness.result_table): the layouts check_kernels, check_flash and
check_deltanet_chunked print on the GPU machine, pinned character for character (logs are compared across runs)."""
from __future__ import annotations

import math

import pytest

from tests.cuda_runner import check_deltanet_chunked, check_flash, check_kernels
from tests.cuda_runner.harness import Result, check_main, passed, result_table

ROWS = [Result("short", "bf16", 1.23e-3, 1e-2, True), Result("broken", "f32", math.nan, 1e-4, False, "boom")]


def test_table_with_the_dtype_column() -> None:
    assert check_kernels.format_table(ROWS) == "\n".join([
        f"{'check':<40} dtype     rel.err      tol  ok", "-" * 72,
        f"{'short':<40} bf16     1.23e-03    1e-02  PASS",
        f"{'broken':<40} f32           nan    1e-04  FAIL  boom",
        "1/2 passed"])


def test_table_without_the_dtype_column() -> None:
    assert check_flash.format_table(ROWS) == "\n".join([
        f"{'case':<52}    rel.err      tol  ok", "-" * 78,
        f"{'short':<52}   1.23e-03    1e-02  PASS",
        f"{'broken':<52}        nan    1e-04  FAIL  boom",
        "1/2 passed"])


def test_name_column_grows_with_the_longest_name() -> None:
    long = Result("x" * 50, "bf16", 0.0, 1e-2, True)
    lines = check_deltanet_chunked.format_table([long]).splitlines()
    assert lines[0].startswith("check" + " " * 46 + "dtype") and lines[1] == "-" * 82
    assert result_table([]) == f"{'check':<40} dtype     rel.err      tol  ok\n{'-' * 72}\n0/0 passed"


def test_a_skipped_row_is_reported_as_skipped_not_passed() -> None:
    skipped = check_kernels.no_algorithm("gemm 37x1000x512 +bias", "bf16")
    assert skipped.skipped and not skipped.ok and skipped.tol == check_kernels.TOL["bf16"]
    assert check_kernels.format_table([ROWS[0], skipped]).splitlines()[3:] == [
        f"{'gemm 37x1000x512 +bias':<40} bf16          nan    1e-02  SKIP  "
        "cuBLASLt: no algorithm (callers use the separate kernels)",
        "1/1 passed, 1 skipped"]
    with pytest.raises(AssertionError, match="cannot also have passed"):
        Result("both", "f32", 0.0, 1e-4, True, skipped=True)


@pytest.mark.parametrize("rows, code", [
    ([ROWS[0]], 0),  # ran and passed
    ([ROWS[0], check_kernels.no_algorithm("g", "bf16")], 0),  # a skip neither fails nor counts
    ([check_kernels.no_algorithm("g", "bf16")], 1),  # nothing ran: not a pass
    ([], 1),
    (ROWS, 1),  # one failure
])
def test_check_main_exit_code_counts_only_rows_that_ran(rows: list[Result], code: int,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    assert passed(rows) is (code == 0)
    assert check_main("test", lambda seed: (rows, {"seed": seed}), check_kernels.format_table, argv=[]) == code

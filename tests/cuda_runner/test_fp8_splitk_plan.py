"""split_k_plan: every group in exactly one split, none empty, warps balanced, the grid filled."""
import pytest

from gpu_engine.cuda.fp8_ops import GEMV_BLOCKS_PER_SM, GEMV_WARPS, SPLITK_WAVES, groups, split_k_plan

H200_SMS = 132


@pytest.mark.parametrize("n,k", [(5120, 17408), (5120, 6144), (34816, 5120), (5120, 5120), (4096, 12288),
                                 (16, 32), (17, 144), (1024, 4096 + 16)])
def test_split_k_plan_covers_k(n: int, k: int) -> None:
    splits, gps = split_k_plan(n, k, H200_SMS)
    g = groups(k)
    assert gps % GEMV_WARPS == 0
    covered = [grp for s in range(splits) for grp in range(s * gps, min(g, (s + 1) * gps))]
    assert covered == list(range(g))  # each split's range as the kernel computes it: g_lo = s * gps
    assert (splits - 1) * gps < g  # the last split is not empty
    tiles = -(-n // 16)
    resident = GEMV_BLOCKS_PER_SM * H200_SMS
    assert splits == 1 or tiles * (splits - 1) < SPLITK_WAVES * resident  # no more splits than needed

"""Which new cuBLASLt plans time their heuristic candidates (gemm.tune_candidates): small-m shapes, except when the
weight is so big that timing costs more than a better algorithm could win (the LM head)."""
from gpu_engine.cuda.gemm import TUNE_CANDIDATES, TUNE_MAX_M, tune_candidates


def test_small_m_decoder_projections_are_timed() -> None:
    for n, k in ((12352, 4096), (24576, 4096), (4096, 12288), (34816, 5120)):  # 9B / 27B projections, bf16
        assert tune_candidates(1, n, k, 2, True) == TUNE_CANDIDATES
        assert tune_candidates(TUNE_MAX_M, n, k, 2, True) == TUNE_CANDIDATES


def test_prefill_shapes_accumulating_calls_and_the_lm_head_take_the_heuristics_first_choice() -> None:
    assert tune_candidates(TUNE_MAX_M + 1, 12352, 4096, 2, True) == 1
    assert tune_candidates(8, 12352, 4096, 2, False) == 1  # the caller accumulates into Y: never timed
    assert tune_candidates(8, 248320, 4096, 2, True) == 1  # 9B LM head: 2 GB of bf16
    assert tune_candidates(8, 248320, 2048, 2, True) == 1  # 2B: 1.0 GB
    assert tune_candidates(8, 248320, 2048, 1, True) == TUNE_CANDIDATES  # the same shape in FP8 bytes: 0.5 GB

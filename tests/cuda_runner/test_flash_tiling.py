"""The flash_prefill tiling (emulated in numpy, tests/cuda_runner/flash_emulation.py) against the float64 attention
reference, the host tiles, and the launcher's argument checks. Runs without a GPU; check_flash runs the kernel
itself."""
from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from gpu_engine.cuda import flash_plan, ops
from gpu_engine.cuda.errors import ShapeError
from tests.cuda_runner import references as ref
from tests.cuda_runner.check_flash import CASES, attention_f64, expected, make_case
from tests.cuda_runner.flash_emulation import Trace, flash_prefill_emulated, keys_per_step
from tests.cuda_runner.harness import rel_err
from tests.cuda_runner.no_launch import arr, no_launch_ctx

KERNEL = Path(ops.__file__).parent / "kernels" / "flash_prefill.cu"


@pytest.fixture()
def rng() -> np.random.Generator:
    return np.random.default_rng()


def emulate(case, **kwargs) -> np.ndarray:
    tiles = flash_plan.flash_tiles([n for _, n in case.seqs])
    return flash_prefill_emulated(case.q, case.gate, case.cache_k, case.cache_v, case.tables, case.token_seq,
                                  case.token_pos, tiles, case.heads, case.kv_heads, case.scale, **kwargs)


def test_matrix_reference_equals_the_loop_reference(rng) -> None:
    case = make_case(rng, 6, 2, 64, 16, [(13, 20)])
    k, v = case.keys(0)
    fast = attention_f64(case.q, k, v, case.gate, np.arange(13, 33), case.scale)
    slow = ref.attention(case.q, k, v, case.gate, np.arange(13, 33), case.scale)
    assert rel_err(fast, slow) < 1e-12


# the GPU check's cases that stay quick in numpy (the 1000-token ones get their own smaller-head test)
QUICK = [c for c in CASES if max(n for _, n in c[5]) < 1000 and sum(n for _, n in c[5]) <= 400]


@pytest.mark.parametrize("name,heads,kv_heads,hd,bs,seqs", QUICK, ids=[c[0] for c in QUICK])
def test_emulated_tiling_matches_reference(rng, name, heads, kv_heads, hd, bs, seqs) -> None:
    case = make_case(rng, min(heads, 2 * (heads // kv_heads)), min(kv_heads, 2), hd, bs, seqs)
    err = rel_err(emulate(case), expected(case))
    assert err <= 1e-2, f"{name}: {err:.2e}"


@pytest.mark.parametrize("hd,bs", [(128, 16), (256, 64)])
def test_emulated_tiling_long_chunk_and_continued(rng, hd, bs) -> None:
    """1000 new tokens (16 tiles, up to 32 key steps), then a 130-token chunk continuing after them."""
    case = make_case(rng, 2, 1, hd, bs, [(0, 1000)])
    assert rel_err(emulate(case), expected(case)) <= 1e-2
    case = make_case(rng, 3, 1, hd, bs, [(1000, 130)])
    assert rel_err(emulate(case), expected(case)) <= 1e-2


def test_every_row_is_written_and_rows_past_count_do_not_leak(rng) -> None:
    case = make_case(rng, 4, 2, 128, 16, [(0, 65), (3, 1), (0, 127)])  # tiles of 64+1, 1, 64+63 rows
    out = emulate(case)
    assert np.all(np.isfinite(out))


def test_causal_skip_reads_no_key_past_the_tile(rng) -> None:
    case = make_case(rng, 2, 1, 256, 16, [(40, 150), (0, 64)])
    tiles = flash_plan.flash_tiles([n for _, n in case.seqs])
    trace = Trace()
    flash_prefill_emulated(case.q, case.gate, case.cache_k, case.cache_v, case.tables, case.token_seq,
                           case.token_pos, tiles, case.heads, case.kv_heads, case.scale, trace=trace)
    bn = keys_per_step(256)
    for t, (first, count) in enumerate(tiles):
        p_last = case.token_pos[first + count - 1]
        assert trace.max_key_loaded[t] == p_last
        assert trace.key_tiles[(t, 0)] == p_last // bn + 1
    # only tiles reaching past the first query are masked: per (tile, head) at most ceil(count / bn) + 1
    bound = sum((-(-int(c) // bn) + 1) * case.heads for _, c in tiles)
    assert 0 < trace.masked_tiles <= bound


def test_without_the_mask_the_emulation_is_wrong(rng) -> None:
    """The check has teeth: dropping the causal mask (future keys visible) fails the tolerance by far."""
    case = make_case(rng, 2, 1, 128, 16, [(0, 100)])
    assert rel_err(emulate(case, apply_mask=False), expected(case)) > 0.1


def test_tiles_cover_each_token_once_and_never_cross_chunks() -> None:
    lengths = [1, 15, 64, 65, 200, 1000, 3]
    tiles = flash_plan.flash_tiles(lengths)
    assert tiles.dtype == np.int32 and tiles.shape[1] == 2
    assert np.all((tiles[:, 1] >= 1) & (tiles[:, 1] <= flash_plan.FLASH_TILE))
    starts = np.concatenate([[0], np.cumsum(lengths)])
    covered = np.concatenate([np.arange(f, f + c) for f, c in tiles])
    assert np.array_equal(covered, np.arange(starts[-1]))
    for f, c in tiles:
        chunk = np.searchsorted(starts, f, side="right") - 1
        assert f + c <= starts[chunk + 1]


def test_host_constants_match_the_kernel_source() -> None:
    src = KERNEL.read_text()
    assert int(re.search(r"#define FP_ROWS (\d+)", src).group(1)) == flash_plan.FLASH_TILE
    pad = int(re.search(r"#define FP_PAD (\d+)", src).group(1))
    assert "BN = HD >= 256 ? 32 : 64" in src and "Q_IN_REGS = HD <= 128" in src
    for hd in flash_plan.FLASH_HEAD_DIMS:
        bn, row = keys_per_step(hd), hd + pad
        q_rows = 0 if hd <= 128 else flash_plan.FLASH_TILE
        assert flash_plan.flash_shared_bytes(hd) == 2 * (4 * bn * row + q_rows * row)
        assert 2 * flash_plan.flash_shared_bytes(hd) <= 227 * 1024  # two blocks fit an H100/H200 SM


class RecordingDevice:
    info = SimpleNamespace(sm_count=132)

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def launch(self, family, name, grid, block, *args, shmem=0, stream=None):
        self.calls.append((family, name, grid, block, shmem))


def flash_args(heads=8, kvh=2, hd=256, q_stride=None, tiles_shape=(3, 2), q_ptr=1 << 20):
    q = arr((100, heads * hd))
    q = type(q)(q_ptr, q.shape, q.dtype)
    return (arr((100, heads * hd)), q, heads * hd if q_stride is None else q_stride, arr((100, 2 * heads * hd)),
            2 * heads * hd, 2 * hd, arr((10, 16, kvh, hd)), arr((10, 16, kvh, hd)), arr((2, 10), "i32"),
            arr((100,), "i32"), arr((100,), "i32"), arr(tiles_shape, "i32"), heads, kvh, hd, 16, hd ** -0.5)


def test_launch_grid_and_shared_memory() -> None:
    ctx = SimpleNamespace(device=RecordingDevice())
    ops.flash_prefill(ctx, *flash_args())
    assert ctx.device.calls == [("flash_prefill", "flash_prefill_bf16_hd256", (8, 3), 128,
                                 flash_plan.flash_shared_bytes(256))]


@pytest.mark.parametrize("bad,match", [
    (dict(q_stride=8 * 256 + 4), "multiple of 8"),
    (dict(hd=96), "head_dim"),
    (dict(heads=6, kvh=4), "heads % kv_heads"),
    (dict(q_ptr=(1 << 20) + 4), "16-byte aligned"),
    (dict(tiles_shape=(3, 3)), "tiles must be"),
    (dict(tiles_shape=(70000, 2)), "tiles must be"),
])
def test_bad_flash_arguments_are_refused(bad, match) -> None:
    with pytest.raises(ShapeError, match=match):
        ops.flash_prefill(no_launch_ctx(), *flash_args(**bad))

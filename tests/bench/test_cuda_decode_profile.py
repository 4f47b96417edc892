"""bench/cuda_decode_profile.py's host parts: the random cache fill covers every cache byte from a source of the
array's dtype, and the session variants name kernel methods the ops accept."""
from __future__ import annotations

from types import SimpleNamespace

import cuda_decode_profile as cdp
import cuda_paged_decode_bench as pdb
import numpy as np
import pytest

from gpu_engine.cuda.context import DArray


class FakeCtx:
    """Arena-like allocation from a counter; device copies recorded as (dst, src, nbytes)."""

    def __init__(self) -> None:
        self.next, self.copies, self.uploads = 1 << 40, [], {}
        self.arena = SimpleNamespace(mark=lambda: 0, release=lambda mark: None)
        self.device = SimpleNamespace(copy=lambda dst, src, n: self.copies.append((dst, src, n)), sync=lambda: None)

    def to_device(self, host: np.ndarray, dtype: str, name: str) -> DArray:
        arr = DArray(self.next, host.shape, dtype)
        self.next += arr.nbytes + 256
        self.uploads[arr.ptr] = (dtype, host)
        return arr


def test_fill_random_writes_every_byte_of_every_cache_array_from_its_dtype():
    ctx = FakeCtx()
    base = 1 << 30
    k, v = DArray(base, (3000, 16, 4, 256), "bf16"), DArray(base + (1 << 29), (3000, 16, 4, 256), "bf16")
    conv, state = DArray(base + (1 << 31), (7, 3, 8192), "bf16"), DArray(base + (3 << 30), (7, 32, 128, 128), "f32")
    runner = SimpleNamespace(ctx=ctx, cache=SimpleNamespace(attention={3: SimpleNamespace(k=k, v=v)},
                                                            deltanet={0: SimpleNamespace(conv=conv, state=state)}))
    cdp.fill_random(runner, np.random.default_rng(0))
    for arr in (k, v, conv, state):
        pieces = sorted((d, s, n) for d, s, n in ctx.copies if arr.ptr <= d < arr.ptr + arr.nbytes)
        covered = arr.ptr
        for dst, src, n in pieces:
            assert dst == covered and ctx.uploads[src][0] == arr.dtype
            assert np.std(ctx.uploads[src][1]) > 0  # random, never zeros
            covered += n
        assert covered == arr.ptr + arr.nbytes


def test_variants_use_methods_the_ops_know():
    for name in ("s6", "s7", "grouped", "mma"):
        for op, kwargs in cdp.VARIANTS[name].items():
            assert op in cdp.TRACED_OPS and isinstance(kwargs, dict)
    assert cdp.VARIANTS["s7"]["paged_attention"] == {"method": "mma"}


def test_paged_decode_bench_variants_and_bytes():
    assert pdb.parse_variant("mma:s4") == ("mma", 4) and pdb.parse_variant("grouped") == ("grouped", None)
    with pytest.raises(ValueError, match="s<N>"):
        pdb.parse_variant("mma:4")
    assert pdb.kv_bytes(192, 8192, 4, 256) == 192 * 8193 * 4 * 256 * 4

"""Same-grid vision items in one tower call (gpu_engine/vision_batch.py, EncoderCache.prefetch, the reference
runner's encode_vision_batch): grouping, the batched embeddings against one call per item, the cache's fallback,
and an engine whose images and video frame groups are batched giving the unbatched engine's tokens.

Tolerance: batched vs one call per item is the same arithmetic up to BLAS summation order: relative L2 error
<= 1e-6 (float32), as tests/engine/test_engine_vision_tower.py holds packed vs item-at-a-time.
Fresh random pixels each run."""
from __future__ import annotations

import hashlib

import numpy as np
import pytest
from PIL import Image

from gpu_engine.encoder_cache import EncoderCache
from gpu_engine.engine import Engine
from gpu_engine.engine_config import EngineConfig
from gpu_engine.inputs import VisionItem
from gpu_engine.params import SamplingParams
from gpu_engine.tiny import make_tiny_checkpoint
from gpu_engine.vision_batch import row_ranges, same_grid_groups, stacked

SAME_COMPUTATION_RTOL = 1e-6


def item(grid: tuple[int, int, int], rng: np.random.Generator, patch_dim: int = 8, merge: int = 2) -> VisionItem:
    t, h, w = grid
    pixels = rng.standard_normal((t * h * w, patch_dim)).astype(np.float32)
    return VisionItem("image", pixels, grid, 0, t * h * w // merge**2, hashlib.sha256(pixels.tobytes()).hexdigest())


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=47)


def test_groups_hold_one_grid_in_first_seen_order_within_the_cap():
    rng = np.random.default_rng()
    a1, b1, a2, v, a3 = (item(g, rng) for g in [(1, 4, 4), (1, 2, 4), (1, 4, 4), (2, 4, 4), (1, 4, 4)])
    groups = same_grid_groups([a1, b1, a2, v, a3], max_patches=32)
    assert groups == [[a1, a2], [b1], [v], [a3]]  # 16 patches each: two a-items fill the cap; t=2 stays alone
    assert same_grid_groups([a1, a2, a3]) == [[a1, a2, a3]]
    pixels, grid = stacked([a1, a2])
    assert grid == (2, 4, 4) and np.array_equal(pixels, np.concatenate([a1.pixel_values, a2.pixel_values]))
    assert row_ranges([a1, b1]) == [(0, 4), (4, 6)]
    with pytest.raises(ValueError, match="one grid"):
        stacked([a1, b1])


def test_a_batch_is_each_items_own_encode(ckpt):
    eng = Engine.from_pretrained(ckpt, config=EngineConfig(max_num_seqs=2, block_size=8))
    runner = eng.runner
    vc = runner.config.vision
    patch_dim = vc.in_channels * vc.temporal_patch_size * vc.patch_size**2
    rng = np.random.default_rng()
    items = [item((1, 4, 6), rng, patch_dim, vc.spatial_merge_size) for _ in range(3)]
    batched = runner.encode_vision_batch(items)
    for it, got in zip(items, batched):
        want = runner.encode_vision(it)
        assert got.shape == want.shape
        rel = np.linalg.norm(got - want) / np.linalg.norm(want)
        assert rel <= SAME_COMPUTATION_RTOL, rel


class Recorder:
    """encode / encode_batch stand-ins: rows of the item's first pixel, every call recorded."""

    def __init__(self, fail_batches: bool = False) -> None:
        self.singles: list[str] = []
        self.batches: list[list[str]] = []
        self.fail = fail_batches

    def encode(self, it: VisionItem) -> np.ndarray:
        self.singles.append(it.content_hash)
        return np.full((it.num_tokens, 3), it.pixel_values[0, 0], np.float32)

    def encode_batch(self, items: list[VisionItem]) -> list[np.ndarray]:
        self.batches.append([i.content_hash for i in items])
        if self.fail:
            raise RuntimeError("tower failed")
        return [np.full((i.num_tokens, 3), i.pixel_values[0, 0], np.float32) for i in items]


def test_prefetch_batches_uncached_items_and_get_finds_them():
    rng = np.random.default_rng()
    items = [item((1, 4, 4), rng) for _ in range(3)] + [item((1, 2, 4), rng)]
    rec = Recorder()
    cache = EncoderCache(10_000, rec.encode, lambda i: i.num_tokens * 12, rec.encode_batch)
    assert cache.reserve(items) == 4
    cache.get(items[0])  # cached already: not encoded again
    cache.prefetch(items + [items[1]])
    assert rec.batches == [[items[1].content_hash, items[2].content_hash]]  # the lone 2x4 item waits for get()
    for it in items:
        np.testing.assert_array_equal(cache.get(it), np.full((it.num_tokens, 3), it.pixel_values[0, 0]))
    assert rec.singles == [items[0].content_hash, items[3].content_hash]
    stats = cache.stats()
    assert stats["encoder_batched_encodes"] == 1 and stats["encoder_encodes"] == 4 and stats["encoder_hits"] == 3


def test_a_failing_or_oversized_batch_leaves_its_items_to_get():
    rng = np.random.default_rng()
    items = [item((1, 4, 4), rng) for _ in range(2)]
    rec = Recorder(fail_batches=True)
    cache = EncoderCache(10_000, rec.encode, lambda i: i.num_tokens * 12, rec.encode_batch)
    cache.reserve(items)
    cache.prefetch(items)
    assert cache.stats()["encoder_batch_failures"] == 1 and cache.bytes_cached == 0
    cache.get(items[0]), cache.get(items[1])
    assert len(rec.singles) == 2
    small = Recorder()
    cache = EncoderCache(48, small.encode, lambda i: i.num_tokens * 12, small.encode_batch)  # one item fits
    cache.prefetch(items)
    assert small.batches == [] and cache.bytes_cached == 0


def test_an_engine_that_batches_gives_the_tokens_of_one_that_does_not(ckpt):
    rng = np.random.default_rng()
    pages = [Image.fromarray(rng.integers(0, 255, (64, 96, 3), dtype=np.uint8)) for _ in range(3)]
    messages = [{"role": "user", "content": [*({"type": "image", "image": p} for p in pages),
                                             {"type": "text", "text": "Read them"}]}]
    params = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=True)
    outs = []
    for batch in (True, False):
        eng = Engine.from_pretrained(ckpt, config=EngineConfig(max_num_seqs=2, block_size=8,
                                                              max_batched_tokens=512))
        if not batch:
            eng.encoder._encode_batch = None
        outs.append(eng.generate([messages], params)[0])
        assert eng.stats()["encoder_batched_encodes"] == (1 if batch else 0)
    batched, single = outs
    assert batched.token_ids == single.token_ids
    np.testing.assert_allclose([lp.logprob for lp in batched.logprobs], [lp.logprob for lp in single.logprobs],
                               rtol=1e-5, atol=1e-6)


def test_the_cuda_runner_batches_only_when_asked():
    from gpu_engine.cuda.options import CudaOptions

    assert CudaOptions().vision_batch is False
    assert CudaOptions.from_env({"DOCPIPE_CUDA_VISION_BATCH": "1"}).vision_batch is True
    assert CudaOptions.from_env({"DOCPIPE_CUDA_VISION_BATCH": "0"}).vision_batch is False

"""CudaRunner.encode_vision_batch: several vision items of one grid in one tower call (gpu_engine/vision_batch.py
says why that is exact). The tower writes the batch into arena scratch; each item's rows are then copied into its
own block of the encoder-cache region, so the engine's cache can keep and evict the items one by one as before.
Where the region has no room for every item, the items are encoded one at a time (encode_vision: host arrays for
the ones that do not fit)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

from ..errors import RunnerInputError
from ..inputs import VisionItem
from ..vision_batch import row_ranges
from .context import ITEMSIZE
from .embeddings import BlockPool, DeviceEmbeddings

if TYPE_CHECKING:
    from .runner import CudaRunner
    from .vision import GpuVisionTower


class VisionBatch:
    """Mixed into CudaRunner."""

    @property
    def batches_vision(self) -> bool:
        """Whether the engine should batch (CudaOptions.vision_batch: opt-in, no gain measured yet)."""
        return cast("CudaRunner", self).options.vision_batch

    def _vision_for(self, items: list[VisionItem]) -> tuple[GpuVisionTower, BlockPool]:
        """The tower and the encoder-cache region, once the items are known to fit the tower (encode_vision and
        encode_vision_batch alike)."""
        r = cast("CudaRunner", self)
        if r.vision is None or r._encoded is None:
            raise RunnerInputError(r._no_vision)
        for item in items:
            if r.vision.num_tokens(item.grid_thw) != item.num_tokens:
                raise RunnerInputError(f"item with grid {item.grid_thw} has {item.num_tokens} placeholders, the "
                                       f"tower makes {r.vision.num_tokens(item.grid_thw)}")
        return r.vision, r._encoded

    def encode_vision_batch(self, items: list[VisionItem]) -> list[Any]:
        r = cast("CudaRunner", self)
        vision, pool = self._vision_for(items)
        hidden, dtype = r.cfg.hidden_size, r.dtype
        embs = [DeviceEmbeddings.allocate(pool, (item.num_tokens, hidden), dtype, ITEMSIZE[dtype], r._download)
                for item in items]
        if any(e is None for e in embs):
            del embs  # their blocks go back to the region
            return [r.encode_vision(item) for item in items]
        _, h, w = items[0].grid_thw
        if any(i.grid_thw != (1, h, w) for i in items):
            raise RunnerInputError(f"a vision batch needs one grid with t == 1, got {[i.grid_thw for i in items]}")
        ctx = r.ctx
        row_bytes = hidden * ITEMSIZE[dtype]
        mark = ctx.arena.mark()
        try:
            out = ctx.empty((sum(i.num_tokens for i in items), hidden), dtype, "vision-batch-out")
            vision.encode([i.pixel_values for i in items], (len(items), h, w), out)
            for emb, (a, b) in zip(embs, row_ranges(items)):
                assert emb is not None
                ctx.device.copy(emb.ptr, out.ptr + a * row_bytes, (b - a) * row_bytes)
        finally:
            ctx.arena.release(mark)  # the copies are ordered before anything that reuses the scratch
        return embs


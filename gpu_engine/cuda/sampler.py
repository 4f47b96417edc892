"""Sampling on the GPU: the host side of kernels/sampling.cu `sample_rows_f32` (one block of 1024 threads per row).

A runner_api.SamplingRequest becomes a float32 parameter table [rows, 8] (uploaded with the step's packed metadata,
so captured decode graphs read it from a fixed address) plus the grammar bitmasks of the constrained rows (their
own upload, only when some row is constrained). After the LM head the kernel writes the token, the chosen
token's logprob and the top-n logprobs of every row; only those (a few bytes per row) come back to the host.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..runner_api import MAX_SAMPLED_TOP_LOGPROBS, SamplingRequest
from ..sampling import SampleResult
from .context import DArray, GpuContext
from .errors import ShapeError

PARAMS_PER_ROW = 8  # temperature, top_k, top_p, min_p, u_hi, u_lo, num_logprobs, mask_row (see sampling.cu)
THREADS = 1024
_MAX_EXACT_INT = 1 << 24  # integers stored in float32 params stay exact below this


def pack_params(request: SamplingRequest) -> np.ndarray:
    """float32 [rows, 8] as sample_rows_f32 reads it. The uniform is split into hi + lo float32 halves so that
    the kernel rebuilds it to ~48 bits (u * total is then as exact as numpy's float64 product)."""
    r = request.num_rows
    u = np.asarray(request.uniform, np.float64)
    u_hi = u.astype(np.float32)
    u_lo = (u - u_hi.astype(np.float64)).astype(np.float32)
    mask_row = request.mask_index if request.mask_index is not None else np.full(r, -1, np.int64)
    table = np.empty((r, PARAMS_PER_ROW), np.float32)
    table[:, 0] = request.temperature
    table[:, 1] = np.minimum(request.top_k, _MAX_EXACT_INT)  # >= vocab means "off" to the kernel anyway
    table[:, 2] = request.top_p
    table[:, 3] = request.min_p
    table[:, 4] = u_hi
    table[:, 5] = u_lo
    table[:, 6] = request.num_logprobs
    table[:, 7] = mask_row
    return table


@dataclass
class SamplerBuffers:
    masks: DArray  # u32 [rows, words]: bitmask rows of the constrained rows, packed from row 0
    tokens: DArray  # i32 [rows]
    logprobs: DArray  # f32 [rows]
    top_ids: DArray  # i32 [rows, 20]
    top_logprobs: DArray  # f32 [rows, 20]


class DeviceSampler:
    def __init__(self, ctx: GpuContext, vocab: int) -> None:
        self.ctx, self.vocab = ctx, vocab
        self.words = -(-vocab // 32)

    def buffers(self, rows: int) -> SamplerBuffers:
        ctx, k = self.ctx, MAX_SAMPLED_TOP_LOGPROBS
        return SamplerBuffers(
            masks=ctx.empty((rows, self.words), "u32", "sample-masks"),
            tokens=ctx.empty((rows,), "i32", "sample-tokens"),
            logprobs=ctx.empty((rows,), "f32", "sample-logprobs"),
            top_ids=ctx.empty((rows, k), "i32", "sample-top-ids"),
            top_logprobs=ctx.empty((rows, k), "f32", "sample-top-logprobs"),
        )

    def upload_masks(self, bufs: SamplerBuffers, request: SamplingRequest) -> None:
        """The request's bitmasks into bufs.masks (nothing to do for an unconstrained step)."""
        if request.bitmask is None:
            return
        masks = np.ascontiguousarray(request.bitmask).view(np.uint32)
        if masks.shape[0] > bufs.masks.shape[0] or masks.shape[1] != self.words:
            raise ShapeError(f"bitmask {masks.shape} does not fit the step's mask buffer {bufs.masks.shape}")
        self.ctx.device.upload(bufs.masks.ptr, masks)

    def enqueue(self, bufs: SamplerBuffers, logits: DArray, params: DArray, rows: int) -> None:
        """Launch the sampler on `rows` float32 logits rows (enqueue only; graph-capturable)."""
        if logits.dtype != "f32" or logits.shape[-1] != self.vocab or params.size < rows * PARAMS_PER_ROW:
            raise ShapeError(f"sampler needs f32 logits [rows, {self.vocab}] and {rows}x{PARAMS_PER_ROW} params, "
                             f"got {logits.shape} {logits.dtype} and {params.shape}")
        i32 = np.int32
        self.ctx.device.launch("sampling", "sample_rows_f32", rows, THREADS, bufs.tokens.ptr, bufs.logprobs.ptr,
                               bufs.top_ids.ptr, bufs.top_logprobs.ptr, logits.ptr, bufs.masks.ptr, params.ptr,
                               i32(rows), i32(self.vocab), i32(self.words))

    def results(self, bufs: SamplerBuffers, request: SamplingRequest) -> SampleResult:
        """Download what the host needs: tokens, chosen logprobs, and the top-n lists only when asked for."""
        rows = request.num_rows
        ctx = self.ctx
        tokens = ctx.to_host(bufs.tokens)[:rows].astype(np.int64)
        lp = ctx.to_host(bufs.logprobs)[:rows].astype(np.float32)
        n = np.asarray(request.num_logprobs)
        lp[n < 0] = np.nan
        top: list[list[tuple[int, float]]] = [[] for _ in range(rows)]
        if np.any(n > 0):
            ids = ctx.to_host(bufs.top_ids)
            vals = ctx.to_host(bufs.top_logprobs)
            for r in np.nonzero(n > 0)[0]:
                k = min(int(n[r]), self.vocab)
                top[r] = [(int(t), float(v)) for t, v in zip(ids[r, :k], vals[r, :k])]
        return SampleResult(tokens, lp, top)

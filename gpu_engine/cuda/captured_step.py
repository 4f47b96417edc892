"""A step recorded in a CUDA graph (CudaRunner.capture_step, and the decode graphs forward() replays), the step's
device buffers, and which steps a graph can take."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import RunnerInputError
from ..runner_api import StepBatch
from .context import DArray
from .decode_graphs import GRAPH_MAX_CHUNK
from .sampler import SamplerBuffers
from .step import HostStep, StepTables, pack_tables
from .text_model import Activations

if TYPE_CHECKING:
    from .runner import CudaRunner


@dataclass
class StepBuffers:
    """Device buffers of one step (sizes depend on the token and logits-row counts only)."""

    act: Activations  # [n, hidden] each
    rows: DArray  # [R, hidden] final hidden states of the logits rows
    logits: DArray  # f32 [R, vocab]
    sampler: SamplerBuffers | None = None  # when the step samples on the device
    vision: DArray | None = None  # host vision embeddings of this step, uploaded

class CapturedStep:
    """A recorded step (see CudaRunner.capture_step); its last tables may carry padding rows (HostStep.padding)."""

    def __init__(self, runner: CudaRunner, graph: Any, host: HostStep, tables: StepTables[DArray],
                 bufs: StepBuffers, mark: int | None, table_width: int) -> None:
        self.runner, self.graph, self.host, self.tables, self.bufs = runner, graph, host, tables, bufs
        self._mark, self._width = mark, table_width
        self._base = min(a.ptr for _, a in tables.items())

    @property
    def size(self) -> int:
        """Sequences the graph was captured for."""
        return int(self.host.tables.slots.size)

    def update(self, batch: StepBatch) -> None:
        """Upload the tables of the next step of the same shape (or, with the runner's scratch rows, of one that
        pads to it) into the captured buffers."""
        self.load(self.runner._graph_host(batch, self._width, self.size, self.host.n), batch)

    def load(self, host: HostStep, batch: StepBatch) -> None:
        if host.n != self.host.n or host.shapes() != self.host.shapes():
            raise RunnerInputError("captured step replayed with a batch of another shape")
        self.host = host
        packed, _ = pack_tables(host.tables)
        self.runner.ctx.device.upload(self._base, packed)
        if batch.sampling is not None and self.bufs.sampler is not None:
            self.runner.sampler.upload_masks(self.bufs.sampler, batch.sampling)

    def replay(self) -> None:
        self.runner.ctx.device.launch_graph(self.graph)

    def logits(self) -> np.ndarray:
        return self.runner.ctx.to_host(first_rows(self.bufs.logits, self.host.batch_logit_rows))

    def hidden(self) -> np.ndarray:
        """Final hidden states of the batch's rows, float32."""
        rows = first_rows(self.bufs.rows, self.host.batch_logit_rows)
        return self.runner.ctx.to_host(rows).astype(np.float32, copy=False)

    def close(self) -> None:
        self.runner.ctx.device.sync()
        if self._mark is not None:
            self.runner.ctx.arena.release(self._mark)


def graphable(batch: StepBatch) -> bool:
    """Short chunks (decode tokens, jump-forward runs) with last-row logits, or verify windows with logits at
    every token, and no vision: the steps graphs are captured for (decode_graphs.graph_shape decides the rest)."""
    return bool(batch.chunks) and all(
        c.num_tokens <= GRAPH_MAX_CHUNK and not c.vision and (c.logits == "last" or (c.verify and c.logits == "all"))
        for c in batch.chunks)


def first_rows(arr: DArray, rows: int) -> DArray:
    """The leading `rows` rows of a row-major [R, ...] device array (the batch's rows ahead of padding)."""
    return arr.view((rows, *arr.shape[1:]))

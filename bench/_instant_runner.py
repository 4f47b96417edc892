"""A runner with no compute, for benchmarks of the engine's host work (bench/engine_*_overhead.py).

It implements the runner contract (gpu_engine/runner_api.py) with no cache and no model: `forward` hands back
rows of a preallocated logits pool at once, so every microsecond a benchmark measures is engine host work.
SamplingInstantRunner is driven as the CUDA runner is: it samples on the device and launches steps (lookahead).
Also what those benchmarks share around it: `tiny_tokenizer()` (the bundled test tokenizer they drive the engine
with), `parse_args` (their command line) and `write_result` (their JSON, with the command, date and
machine).
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from gpu_engine.runner_api import CacheSpec, SamplingRequest, StepBatch, StepOutput
from gpu_engine.runner_rules import row_offsets
from gpu_engine.sampling import SampleResult
from gpu_engine.tiny_assets import write_tokenizer_files
from gpu_engine.tokenizer import Tokenizer


class InstantRunner:
    """Logit rows come from `pool` [rows, vocab]: its first rows every step, or, given `rng`, a random window of
    it each step (so sampling sees varied distributions). The pool needs at least as many rows as a step asks."""

    name = "instant"

    def __init__(self, pool: np.ndarray, rng: np.random.Generator | None = None) -> None:
        self.pool = pool
        self._rng = rng

    def kv_bytes_per_block(self, block_size: int | None = None) -> int:
        return 1

    def state_bytes_per_slot(self) -> int:
        return 1

    def embedding_nbytes(self, item) -> int:
        return 0

    def allocate_cache(self, spec: CacheSpec) -> None:
        pass

    def copy_state_slot(self, src: int, dst: int) -> None:
        pass

    def encode_vision(self, item):
        raise NotImplementedError("the instant runner has no vision tower: benchmark text requests only")

    def forward(self, batch: StepBatch) -> StepOutput:
        offsets = [0]
        for c in batch.chunks:
            offsets.append(offsets[-1] + (c.logits != "none"))
        rows = offsets[-1]
        start = 0 if self._rng is None else int(self._rng.integers(0, self.pool.shape[0] - rows + 1))
        return StepOutput(logits=self.pool[start : start + rows], row_offsets=offsets)


def tiny_tokenizer() -> Tokenizer:
    """The bundled tiny BPE tokenizer (gpu_engine.tiny_assets), loaded as the engine loads a checkpoint's."""
    with tempfile.TemporaryDirectory() as tmp:
        write_tokenizer_files(tmp)
        return Tokenizer.from_pretrained(tmp)


def parse_args(benchmark: str, steps: int) -> argparse.Namespace:
    """--steps (measured engine steps per row, default `steps`) and --out (default bench/results/<benchmark>.json)."""
    parser = argparse.ArgumentParser(description=f"bench/{benchmark}.py")
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / f"{benchmark}.json"))
    return parser.parse_args()


def write_result(path: str, benchmark: str, fields: dict[str, Any]) -> None:
    """`fields` as bench JSON at `path`, after what every run records: name, command, date, machine."""
    result = {
        "benchmark": benchmark,
        "command": " ".join([Path(sys.executable).name] + sys.argv),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"python": platform.python_version(), "numpy": np.__version__,
                    "cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                    "load_average_1m_at_end": os.getloadavg()[0]},
        **fields,
    }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")


class SamplingInstantRunner:
    """The instant runner as the CUDA runner is driven: it samples on the device (samples_on_device: tokens and
    logprobs come back, never logits) and launches steps (supports_lookahead: runner_api's launch / finish), so the
    engine takes its runner-sampled, lookahead path. A row's token is the allowed token (grammar bitmask, over the
    first `text_vocab` ids only: the tiny tokenizer has no others) with the highest score in a random window of
    `scores` [rows, text_vocab]; its logprob is a constant, its top-n list n made-up entries. `busy_s` is the
    process CPU time spent in here (the "GPU" part a benchmark subtracts)."""

    name = "instant-sampling"
    samples_on_device = True
    supports_lookahead = True

    def __init__(self, scores: np.ndarray, seed: int = 0) -> None:
        self.scores = scores
        self.text_vocab = scores.shape[1]
        self._rng = np.random.default_rng(seed)
        self._launched: StepBatch | None = None
        self.busy_s = 0.0

    kv_bytes_per_block = InstantRunner.kv_bytes_per_block
    state_bytes_per_slot = InstantRunner.state_bytes_per_slot
    embedding_nbytes = InstantRunner.embedding_nbytes
    allocate_cache = InstantRunner.allocate_cache
    copy_state_slot = InstantRunner.copy_state_slot
    encode_vision = InstantRunner.encode_vision

    def forward(self, batch: StepBatch) -> StepOutput:
        t0 = time.process_time()
        offsets = row_offsets(batch.chunks)
        sampled = self._sample(batch.sampling, offsets[-1]) if batch.sampling is not None else None
        out = StepOutput(logits=np.zeros((0, 1), np.float32), row_offsets=offsets, sampled=sampled)
        self.busy_s += time.process_time() - t0
        return out

    def launch(self, batch: StepBatch, previous: SamplingRequest | None,
               feed: np.ndarray | None) -> SampleResult | None:
        t0 = time.process_time()
        sampled = self._sample(previous, previous.num_rows) if previous is not None else None
        self._launched = batch
        self.busy_s += time.process_time() - t0
        return sampled

    def finish(self, request: SamplingRequest) -> SampleResult:
        t0 = time.process_time()
        self._launched = None
        sampled = self._sample(request, request.num_rows)
        self.busy_s += time.process_time() - t0
        return sampled

    def _sample(self, request: SamplingRequest, rows: int) -> SampleResult:
        if rows == 0:
            return SampleResult(np.zeros(0, np.int64), np.zeros(0, np.float32), [])
        start = int(self._rng.integers(0, self.scores.shape[0] - rows + 1))
        scores = self.scores[start : start + rows].copy()
        if request.bitmask is not None and request.mask_index is not None:
            masked = np.nonzero(request.mask_index >= 0)[0]
            words = -(-self.text_vocab // 32)
            bits = request.bitmask[request.mask_index[masked], :words]
            allowed = np.unpackbits(np.ascontiguousarray(bits).view(np.uint8), axis=1, bitorder="little")
            scores[masked] = np.where(allowed[:, : self.text_vocab].astype(bool), scores[masked], -np.inf)
        tokens = np.argmax(scores, axis=1).astype(np.int64)
        n = np.asarray(request.num_logprobs)
        logprobs = np.where(n >= 0, -0.25, np.nan).astype(np.float32)
        top = [[(int(tokens[r]) + j, -0.25 - j) for j in range(int(k))] if k > 0 else [] for r, k in enumerate(n)]
        return SampleResult(tokens, logprobs, top)

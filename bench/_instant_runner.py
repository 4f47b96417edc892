"""A runner with no compute, for benchmarks of the engine's host work (bench/engine_*_overhead.py).

It implements the runner contract (gpu_engine/runner_api.py) with no cache and no model: `forward` hands back
rows of a preallocated logits pool at once, so every microsecond a benchmark measures is engine host work.
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
from pathlib import Path
from typing import Any

import numpy as np

from gpu_engine.runner_api import CacheSpec, StepBatch, StepOutput
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

"""Reference (numpy) runner throughput on the bundled tiny model: prefill and decode tokens/s, for the record.

    python3 bench/engine_reference_tokens.py [--model FOLDER] [--json OUT] [--threads N]

Prefill: one fresh sequence of random token ids, whole prompt in one chunk and in 64-token chunks.
Decode: one-token steps after a 64-token prompt, for batches of 1 and 4 sequences (one runner step per token).
Timing: wall clock (time.perf_counter), one warm-up run, median of repeats. Prints a table; writes JSON.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import sys
import time
from pathlib import Path

_argv = " ".join(sys.argv[1:]).replace("--threads ", "--threads=").split()
_threads = next((a.split("=", 1)[1] for a in _argv if a.startswith("--threads=")), None)
if _threads:  # must be set before numpy loads its BLAS
    os.environ["OMP_NUM_THREADS"] = os.environ["OPENBLAS_NUM_THREADS"] = _threads

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_engine.bundled import bundled_model_dir
from gpu_engine.config import ModelConfig
from gpu_engine.loader import load_weights
from gpu_engine.reference.runner import ReferenceRunner
from gpu_engine.runner_api import CacheSpec, SeqChunk, StepBatch

BLOCK = 16


def chunk(seq: int, ids: np.ndarray, start: int, logits: str = "last") -> SeqChunk:
    n = ids.shape[0]
    positions = np.broadcast_to(np.arange(start, start + n), (3, n)).copy()
    table = np.arange(seq * 64, seq * 64 + 64, dtype=np.int32)  # 64 blocks = 1024 tokens per sequence
    return SeqChunk(seq, ids, positions, start, table, seq, logits=logits)  # type: ignore[arg-type]  # "last"/"all"


def median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return float(np.median(samples))


def bench_prefill(runner: ReferenceRunner, vocab: int, length: int, chunk_size: int, repeats: int) -> float:
    ids = np.random.default_rng(length).integers(0, vocab, size=length)

    def run() -> None:
        for begin in range(0, length, chunk_size):
            part = ids[begin:begin + chunk_size]
            runner.forward(StepBatch([chunk(0, part, begin)]))

    return length / median_seconds(run, repeats)


def bench_decode(runner: ReferenceRunner, vocab: int, batch: int, steps: int, repeats: int) -> float:
    rng = np.random.default_rng(batch)
    prompts = [rng.integers(0, vocab, size=64) for _ in range(batch)]
    samples = []
    for _ in range(repeats + 1):  # the first round is the warm-up
        for seq, ids in enumerate(prompts):  # untimed 64-token prefill
            runner.forward(StepBatch([chunk(seq, ids, 0, "none")]))
        tokens = rng.integers(0, vocab, size=(steps, batch))
        t0 = time.perf_counter()
        for step in range(steps):
            runner.forward(StepBatch([chunk(seq, tokens[step, seq:seq + 1], 64 + step) for seq in range(batch)]))
        samples.append(time.perf_counter() - t0)
    return batch * steps / float(np.median(samples[1:]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, help="checkpoint folder (default: the bundled tiny model)")
    parser.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "engine_reference_tokens.json")
    parser.add_argument("--threads", help="BLAS threads (OMP_NUM_THREADS)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    folder = args.model or bundled_model_dir()
    config = ModelConfig.from_pretrained(folder)
    weights, fingerprint = load_weights(folder, config)
    runner = ReferenceRunner(config, weights)
    runner.allocate_cache(CacheSpec(num_kv_blocks=64 * 4, block_size=BLOCK, num_state_slots=4))
    vocab = config.text.vocab_size

    rows = []
    for length, size in ((128, 128), (512, 512), (512, 64)):
        rows.append({"phase": "prefill", "tokens": length, "chunk": size, "batch": 1,
                     "tokens_per_s": bench_prefill(runner, vocab, length, size, args.repeats)})
    for batch in (1, 4):
        rows.append({"phase": "decode", "tokens": 32, "chunk": 1, "batch": batch,
                     "tokens_per_s": bench_decode(runner, vocab, batch, 32, args.repeats)})

    print(f"reference runner, model {folder} (fingerprint {fingerprint[:12]})")
    print(f"{'phase':<8} {'tokens':>7} {'chunk':>6} {'batch':>6} {'tokens/s':>10}")
    for r in rows:
        print(f"{r['phase']:<8} {r['tokens']:>7} {r['chunk']:>6} {r['batch']:>6} {r['tokens_per_s']:>10.1f}")
    result = {
        "benchmark": "engine_reference_tokens",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "model": str(folder),
        "fingerprint": fingerprint,
        "machine": {"python": platform.python_version(), "numpy": np.__version__, "cpu": platform.processor(),
                    "cpus": os.cpu_count(), "omp_threads": os.environ.get("OMP_NUM_THREADS")},
        "rows": rows,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()

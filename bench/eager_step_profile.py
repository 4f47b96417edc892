"""Where one CUDA step of the document run's decode phase spends its time: host work vs waiting for the GPU, eager
vs graphed (issue 14).

    python3 bench/eager_step_profile.py [--shape 9b] [--rows 64,190] [--forced 10] [--context 2048] [--json out.json]

Why: at max_num_seqs 256 the 9B document run's decode phase took ~110 ms a step at ~190 rows (results/
doc_throughput.md, session 6) where the HBM time of such a step is ~11 ms; ~10 grammar-forced runs in every step
make each one eager (no decode graph). For each row count this times, over --steps steps after two warm-ups:

  graphed  plain decode rows (one token, last-row logits): CudaRunner.forward replays its decode graph;
  eager    the same rows with the runner's graphs off;
  forced   eager, the rows plus --forced jump-forward chunks of --forced-len tokens (the run's steps);

each as the host wall time of forward() split into the time blocked in CudaDevice.sync (every download waits
there too: the GPU still working after the host is done) and the rest (host work: table build, launches, GEMM
calls; the GPU may idle in it). A cProfile of one "forced" step gives the top host functions by own time.
Greedy sampling on the runner (a SamplingRequest, as the engine sends), no grammar masks. Random bf16 weights
(bench/cuda_bench.py); the contexts are prefilled with random tokens first. Written in session 6 and not yet run
on a GPU.
"""
from __future__ import annotations

import argparse
import cProfile
import datetime as dt
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def greedy(rows: int) -> Any:
    from gpu_engine.runner_api import SamplingRequest

    return SamplingRequest(temperature=np.zeros(rows, np.float32), top_k=np.zeros(rows, np.int64),
                           top_p=np.ones(rows, np.float32), min_p=np.zeros(rows, np.float32),
                           uniform=np.full(rows, 0.5), num_logprobs=np.full(rows, -1, np.int64))


class SyncTimer:
    """Seconds spent inside the runner's CudaDevice.sync (wrapped in place; `restore()` undoes it)."""

    def __init__(self, device: Any) -> None:
        self.device, self.original, self.seconds = device, device.sync, 0.0

        def sync(stream: Any = None) -> None:
            t0 = time.perf_counter()
            self.original(stream)
            self.seconds += time.perf_counter() - t0

        device.sync = sync

    def restore(self) -> None:
        self.device.sync = self.original


def timed(runner: Any, make: Callable[[], Any], steps: int, sync: SyncTimer) -> dict[str, float]:
    """Median host wall of forward() and its part blocked on the GPU, over `steps` steps after two warm-ups (the
    graphed kind captures its graph in those)."""
    for _ in range(2):
        runner.forward(make())
    walls, waits = [], []
    for _ in range(steps):
        batch = make()
        runner.ctx.device.sync()
        sync.seconds = 0.0
        t0 = time.perf_counter()
        runner.forward(batch)
        runner.ctx.device.sync()
        walls.append(time.perf_counter() - t0)
        waits.append(sync.seconds)
    wall, wait = statistics.median(walls), statistics.median(waits)
    return {"wall_ms": 1e3 * wall, "gpu_wait_ms": 1e3 * wait, "host_ms": 1e3 * (wall - wait)}


def profile(shape_name: str, rows_list: list[int], forced: int, forced_len: int, context: int, steps: int,
            rng: np.random.Generator) -> dict[str, Any]:
    from cuda_bench import SHAPES, prefill_sequences, random_bf16_weights

    from gpu_engine.config import ModelConfig
    from gpu_engine.cuda.options import CudaOptions
    from gpu_engine.cuda.runner import CudaRunner
    from gpu_engine.runner_api import CacheSpec, SeqChunk, StepBatch

    text_cfg, tied = SHAPES[shape_name]
    config = ModelConfig.from_dict({"model_type": "qwen3_5", "text_config": text_cfg, "vision_config": {},
                                    "tie_word_embeddings": tied})
    weights = random_bf16_weights(config, rng)
    weight_bytes = sum(a.nbytes for a in weights.text.values()) + (0 if tied else weights.lm_head.nbytes)
    runner = CudaRunner(config, weights, CudaOptions(dtype="bf16", memory_budget=weight_bytes + (64 << 30)))
    del weights
    vocab = config.text.vocab_size
    seqs = max(rows_list) + forced
    bs = 16
    per_seq = (context + steps * (forced_len + 1) + 64) // bs + 2
    runner.allocate_cache(CacheSpec(num_kv_blocks=per_seq * seqs, block_size=bs, num_state_slots=seqs))
    tables = [np.arange(s * per_seq, (s + 1) * per_seq, dtype=np.int32) for s in range(seqs)]
    prefill_sequences(runner, rng, list(range(seqs)), tables, context)
    sync = SyncTimer(runner.ctx.device)
    out: dict[str, Any] = {"shape": shape_name, "context": context, "forced": forced, "forced_len": forced_len,
                           "steps": steps, "rows": {}}
    try:
        for rows in rows_list:
            start = [context] * seqs  # every step restarts from the prefilled context: the same shapes each time

            def batch(extra: int, rows: int = rows) -> Any:
                chunks = [SeqChunk(s, rng.integers(0, vocab, 1), np.full((3, 1), start[s]), start[s], tables[s], s)
                          for s in range(rows)]
                chunks += [SeqChunk(s, rng.integers(0, vocab, forced_len),
                                    np.tile(np.arange(start[s], start[s] + forced_len), (3, 1)), start[s], tables[s], s)
                           for s in range(rows, rows + extra)]
                return StepBatch(chunks, sampling=greedy(len(chunks)))

            result: dict[str, Any] = {}
            runner.use_graphs = True
            result["graphed"] = timed(runner, lambda: batch(0), steps, sync)
            runner.use_graphs = False
            result["eager"] = timed(runner, lambda: batch(0), steps, sync)
            result["forced"] = timed(runner, lambda: batch(forced), steps, sync)
            prof = cProfile.Profile()
            b = batch(forced)
            prof.enable()
            runner.forward(b)
            runner.ctx.device.sync()
            prof.disable()
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(15)
            result["forced_cprofile_top15"] = text.getvalue().splitlines()
            out["rows"][rows] = result
    finally:
        sync.restore()
        runner.close()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="9b")
    parser.add_argument("--rows", default="64,190", help="comma-separated decode row counts")
    parser.add_argument("--forced", type=int, default=10, help="jump-forward chunks in the 'forced' steps")
    parser.add_argument("--forced-len", type=int, default=5, help="tokens of each (the 9B run's mean: 4.6 + 1)")
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    from gpu_engine.cuda.device import require_gpu

    require_gpu()
    rows_list = [int(r) for r in args.rows.split(",") if r]
    result = {"command": "python3 " + " ".join(sys.argv), "date_utc": dt.datetime.now(dt.timezone.utc).isoformat()}
    result.update(profile(args.shape, rows_list, args.forced, args.forced_len, args.context, args.steps,
                          np.random.default_rng()))
    print(f"{'shape':>5} {'rows':>5} {'kind':<8} {'wall ms':>8} {'GPU wait':>8} {'host ms':>8}")
    for rows, res in result["rows"].items():
        for kind in ("graphed", "eager", "forced"):
            r = res[kind]
            print(f"{args.shape:>5} {rows:5d} {kind:<8} {r['wall_ms']:8.1f} {r['gpu_wait_ms']:8.1f} "
                  f"{r['host_ms']:8.1f}")
    for rows, res in result["rows"].items():
        print(f"\ncProfile, {rows} rows + {args.forced} forced runs:")
        print("\n".join(res["forced_cprofile_top15"][:30]))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

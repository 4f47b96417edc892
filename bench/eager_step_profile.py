"""Where one CUDA step of the document run's decode phase spends its time: host work vs waiting for the GPU, eager
vs graphed (issue 14).

    python3 bench/eager_step_profile.py [--shape 9b] [--rows 64,190] [--forced 10] [--context 2048] [--json out.json]

Why: at max_num_seqs 256 the 9B document run's decode phase took ~110 ms a step at ~190 rows (results/
doc_throughput.md, session 6) where the HBM time of such a step is ~11 ms; ~10 grammar-forced runs in every step
make each one eager (no decode graph). For each row count this times, over --steps steps after two warm-ups:

  graphed       plain decode rows (one token, last-row logits): CudaRunner.forward replays its decode graph
                (padded to the row count's bucket, decode_graphs.py);
  graphed_all   graphed, rows + --forced rows: the step --no-jump-forward runs instead of "forced";
  forced_graphed  the "forced" step below with graphs on: the runner's graph for steps with jump-forward runs
                (decode_graphs.graph_shape: tokens past one per sequence rounded up to a token bucket);
  eager         the same rows as "graphed" with the runner's graphs off;
  forced        eager, the rows plus --forced jump-forward chunks of --forced-len tokens (the run's steps), the
                same token count every step (GEMM plans cached);
  forced_new_m  as "forced" but every step with another token count (the first chunk 1 token longer each
                step), as in a real run: the cost of new cuBLASLt plans (heuristic queries, and timing of the
                candidates for m <= 64) shows here;
  forced_32     as "forced" with one chunk of 40 tokens: a chunk >= 32 tokens sends the whole step's attention
                through flash_prefill (every decode row its own 64-row query tile);
  forced_64     as "forced" with one chunk of 70 tokens: >= 64 also sends the DeltaNet layers through the chunked
                prefill kernels;

each as the host wall time of forward() split into the time blocked in CudaDevice.sync (every download waits
there too: the GPU still working after the host is done) and the rest (host work: table build, launches, GEMM
calls; the GPU may idle in it), with the kernel launches, GEMM calls and new GEMM plans per step. A cProfile of
one "forced_new_m" step gives the top host functions by own time. Greedy sampling on the runner (a
SamplingRequest, as the engine sends), no grammar masks. Random bf16 weights (bench/cuda_bench.py); the contexts
are prefilled with random tokens first. bench/step_host_cost.py measures the host part on a machine without a GPU.
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

KINDS = ("graphed", "graphed_all", "forced_graphed", "eager", "forced", "forced_new_m", "forced_32", "forced_64")
LONG_CHUNKS = (40, 70)  # one jump-forward chunk past FLASH_MIN_CHUNK (32), and past the chunked DeltaNet's 64


def greedy(rows: int) -> Any:
    from gpu_engine.runner_api import SamplingRequest

    return SamplingRequest(temperature=np.zeros(rows, np.float32), top_k=np.zeros(rows, np.int64),
                           top_p=np.ones(rows, np.float32), min_p=np.zeros(rows, np.float32),
                           uniform=np.full(rows, 0.5), num_logprobs=np.full(rows, -1, np.int64))


class SyncTimer:
    """Seconds the host spends blocked on the GPU: inside the runner's CudaDevice.sync and CudaDevice.download
    (a device-to-host copy into pageable memory blocks inside cuMemcpyDtoHAsync until the stream gets there, so
    the wait of a step's result download is in the copy call, not in the sync after it). Both wrapped in place;
    `restore()` undoes it."""

    def __init__(self, device: Any) -> None:
        self.device, self.original, self.seconds = device, device.sync, 0.0
        self.original_download = getattr(device, "download", None)
        self._inside = False

        def sync(stream: Any = None) -> None:
            t0 = time.perf_counter()
            self.original(stream)
            if not self._inside:
                self.seconds += time.perf_counter() - t0

        def download(*args: Any, **kw: Any) -> Any:
            t0, self._inside = time.perf_counter(), True
            try:
                return self.original_download(*args, **kw)  # type: ignore[misc]
            finally:
                self._inside = False
                self.seconds += time.perf_counter() - t0

        device.sync = sync
        if self.original_download is not None:
            device.download = download

    def restore(self) -> None:
        self.device.sync = self.original
        if self.original_download is not None:
            self.device.download = self.original_download


class CallCounter:
    """Kernel launches and GEMM calls of the runner's context (wrapped in place; `restore()` undoes it)."""

    def __init__(self, ctx: Any) -> None:
        self.ctx, self.launches, self.gemms = ctx, 0, 0
        self._launch, self._linear = ctx.device.launch, ctx.blas.linear

        def launch(*args: Any, **kw: Any) -> None:
            self.launches += 1
            self._launch(*args, **kw)

        def linear(*args: Any, **kw: Any) -> None:
            self.gemms += 1
            self._linear(*args, **kw)

        ctx.device.launch, ctx.blas.linear = launch, linear

    @property
    def plans(self) -> int:
        return len(getattr(self.ctx.blas, "_plans", {}))

    def restore(self) -> None:
        self.ctx.device.launch, self.ctx.blas.linear = self._launch, self._linear


def timed(runner: Any, make: Callable[[int], Any], steps: int, sync: SyncTimer,
          calls: CallCounter | None = None) -> dict[str, float]:
    """Median host wall of forward() and its part blocked on the GPU, over `steps` steps after three warm-ups
    (the graphed kinds warm up, capture and replay their graph in those); make(i) builds step i (warm-ups -3..-1).
    With `calls`: launches, GEMM calls and new GEMM plans per timed step (means)."""
    for i in range(-3, 0):
        runner.forward(make(i))
    walls, waits = [], []
    launches, gemms, plans = (calls.launches, calls.gemms, calls.plans) if calls else (0, 0, 0)
    for i in range(steps):
        batch = make(i)
        runner.ctx.device.sync()
        sync.seconds = 0.0
        t0 = time.perf_counter()
        runner.forward(batch)
        runner.ctx.device.sync()
        walls.append(time.perf_counter() - t0)
        waits.append(sync.seconds)
    wall, wait = statistics.median(walls), statistics.median(waits)
    out = {"wall_ms": 1e3 * wall, "gpu_wait_ms": 1e3 * wait, "host_ms": 1e3 * (wall - wait),
           "wall_ms_max": 1e3 * max(walls)}
    if calls:
        out.update(launches=(calls.launches - launches) / steps, gemm_calls=(calls.gemms - gemms) / steps,
                   new_gemm_plans=(calls.plans - plans) / steps)
    return out


def wait_for(path: str | None, limit_s: float = 180.0) -> float:
    """Seconds waited until `path` exists (at most limit_s): lets one device call build and prefill the model
    while other work still holds the GPU, and time the steps only once that work is done."""
    t0 = time.perf_counter()
    while path and not Path(path).exists() and time.perf_counter() - t0 < limit_s:
        time.sleep(0.5)
    return time.perf_counter() - t0


def profile(shape_name: str, rows_list: list[int], forced: int, forced_len: int, context: int, steps: int,
            rng: np.random.Generator, start_after: str | None = None) -> dict[str, Any]:
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
    per_seq = (context + 2 * LONG_CHUNKS[-1] + steps + 64) // bs + 2
    runner.allocate_cache(CacheSpec(num_kv_blocks=per_seq * seqs, block_size=bs, num_state_slots=seqs))
    tables = [np.arange(s * per_seq, (s + 1) * per_seq, dtype=np.int32) for s in range(seqs)]
    prefill_sequences(runner, rng, list(range(seqs)), tables, context)
    sync = SyncTimer(runner.ctx.device)
    calls = CallCounter(runner.ctx)
    out: dict[str, Any] = {"shape": shape_name, "context": context, "forced": forced, "forced_len": forced_len,
                           "steps": steps, "rows": {}, "waited_s": wait_for(start_after)}
    try:
        for rows in rows_list:
            start = context  # every step restarts from the prefilled context: the same shapes each time

            def batch(plain: int, lens: list[int]) -> Any:
                """`plain` one-token rows, then one chunk of each length in `lens` (jump-forward runs)."""
                chunks = [SeqChunk(s, rng.integers(0, vocab, 1), np.full((3, 1), start), start, tables[s], s)
                          for s in range(plain)]
                chunks += [SeqChunk(s, rng.integers(0, vocab, n), np.tile(np.arange(start, start + n), (3, 1)),
                                    start, tables[s], s) for s, n in zip(range(plain, plain + len(lens)), lens)]
                return StepBatch(chunks, sampling=greedy(len(chunks)))

            runs = [forced_len] * forced
            kinds: dict[str, tuple[bool, Callable[[int], Any]]] = {
                "graphed": (True, lambda i: batch(rows, [])),
                "graphed_all": (True, lambda i: batch(rows + forced, [])),
                "forced_graphed": (True, lambda i: batch(rows, runs)),
                "eager": (False, lambda i: batch(rows, [])),
                "forced": (False, lambda i: batch(rows, runs)),
                # a token count not met before in every step (warm-ups included): 2 + 3 + i tokens more
                "forced_new_m": (False, lambda i: batch(rows, [forced_len + 5 + i, *runs[1:]])),
                "forced_32": (False, lambda i: batch(rows, [LONG_CHUNKS[0], *runs[1:]])),
                "forced_64": (False, lambda i: batch(rows, [LONG_CHUNKS[1], *runs[1:]])),
            }
            result: dict[str, Any] = {}
            for kind, (graphs, make) in kinds.items():
                runner.use_graphs = graphs
                result[kind] = timed(runner, make, steps, sync, calls)
                print(f"{shape_name} rows {rows} {kind}: {result[kind]}", flush=True)
            runner.use_graphs = False
            prof = cProfile.Profile()
            b = batch(rows, [forced_len + 20, *runs[1:]])  # a token count not met before: new plans
            prof.enable()
            runner.forward(b)
            runner.ctx.device.sync()
            prof.disable()
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(15)
            result["forced_new_m_cprofile_top15"] = text.getvalue().splitlines()
            out["rows"][rows] = result
        out["decode_counts"] = vars(runner.decode_counts)
        out["graphs"] = {str(k): "captured" for k in runner._graphs} | {str(k): v for k, v in runner._no_graph.items()}
    finally:
        calls.restore()
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
    parser.add_argument("--start-after", help="time the steps only once this file exists (max 180 s)")
    args = parser.parse_args(argv)
    from gpu_engine.cuda.device import require_gpu

    require_gpu()
    rows_list = [int(r) for r in args.rows.split(",") if r]
    result: dict[str, Any] = {"command": "python3 " + " ".join(sys.argv),
                              "date_utc": dt.datetime.now(dt.timezone.utc).isoformat()}
    result.update(profile(args.shape, rows_list, args.forced, args.forced_len, args.context, args.steps,
                          np.random.default_rng(), args.start_after))
    if args.json:  # first: a cut-short call keeps the numbers
        Path(args.json).write_text(json.dumps(result, indent=1, default=str))
    for rows, res in result["rows"].items():
        print(f"\ncProfile, {rows} rows + {args.forced} forced runs, a new token count:")
        print("\n".join(res["forced_new_m_cprofile_top15"][:30]))
    print(f"\n{'shape':>5} {'rows':>5} {'kind':<13} {'wall ms':>8} {'max':>7} {'GPU wait':>8} {'host ms':>8} "
          f"{'launches':>8} {'gemms':>6} {'plans':>6}")
    for rows, res in result["rows"].items():
        for kind in KINDS:
            r = res[kind]
            print(f"{args.shape:>5} {rows:5d} {kind:<13} {r['wall_ms']:8.1f} {r['wall_ms_max']:7.1f} "
                  f"{r['gpu_wait_ms']:8.1f} {r['host_ms']:8.1f} {r['launches']:8.0f} {r['gemm_calls']:6.0f} "
                  f"{r['new_gemm_plans']:6.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

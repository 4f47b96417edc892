"""The host side of one CUDA runner step, on a machine without a GPU: CudaRunner.forward() with the device stubbed
out (launches, copies and cuBLASLt calls counted, not run), so what is timed is our own Python per step — table
build, op launchers' checks, arena, GEMM plan lookups — and the number of launches a step makes (issue 14).

    python3 bench/step_host_cost.py [--rows 190] [--forced 10] [--forced-len 5] [--layers 32] [--json out.json]

Kinds, as in bench/eager_step_profile.py (which times the same steps on a GPU): "graphed" (plain decode rows,
the runner's decode graph: tables, padding, upload, results), "eager" (the same rows with graphs off), "forced"
(eager, plus --forced jump-forward chunks of --forced-len tokens). Small layer widths (the host work does not
depend on them), the 9B layer pattern (--layers, a full-attention layer every 4th). What the real driver calls
cost (cuda.core's launch, cuBLASLt's matmul and heuristic) is not in these numbers: a GPU run of
eager_step_profile.py has them. Greedy device sampling, as the engine sends.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

TEXT = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 128, "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "vocab_size": 4096, "full_attention_interval": 4}


class StubDevice:
    """CudaDevice's surface as the runner uses it; every device call is counted and does nothing."""

    def __init__(self) -> None:
        self.info = SimpleNamespace(name="stub", arch="sm_90", sm_count=132, l2_bytes=50 << 20, total_mem=1 << 40)
        self.pdl = False
        self.counts: dict[str, int] = {}

    def _count(self, what: str) -> None:
        self.counts[what] = self.counts.get(what, 0) + 1

    def launch(self, family: str, name: str, grid: Any, block: Any, *args: Any, shmem: int = 0,
               stream: Any = None) -> None:
        self._count("launch")

    def upload(self, dst: int, host: np.ndarray, stream: Any = None) -> None:
        np.ascontiguousarray(host)
        self._count("upload")

    def download(self, host: np.ndarray, src: int, stream: Any = None) -> np.ndarray:
        host.fill(0)
        self._count("download")
        return host

    def memset(self, *args: Any, **kw: Any) -> None:
        self._count("memset")

    def copy(self, *args: Any, **kw: Any) -> None:
        self._count("copy")

    def sync(self, stream: Any = None) -> None:
        self._count("sync")

    def capture(self, enqueue: Any) -> Any:
        enqueue()
        return object()

    def launch_graph(self, graph: Any, stream: Any = None) -> None:
        self._count("graph")

    def stream_handle(self, stream: Any = None) -> int:
        return 0

    def free_all(self) -> None:
        pass


def stub_context(budget: int, *args: Any) -> Any:
    """A GpuContext over StubDevice and a CublasLt whose plans and matmuls are stubs (its key checks are real)."""
    from gpu_engine.cuda.arena import Arena
    from gpu_engine.cuda.context import WORKSPACE_BYTES, GpuContext
    from gpu_engine.cuda.gemm import CublasLt

    ctx: Any = GpuContext.__new__(GpuContext)
    ctx.device = StubDevice()
    ctx.arena = Arena(base=1 << 40, capacity=budget)
    blas: Any = CublasLt.__new__(CublasLt)
    blas.device, blas.handle, blas.workspace_bytes = ctx.device, 0, WORKSPACE_BYTES
    blas.workspace_ptr = ctx.arena.alloc(WORKSPACE_BYTES, "cublaslt-workspace")
    blas._plans, blas._unsupported = {}, set()
    blas._one, blas._zero = np.ones(1, np.float32), np.zeros(1, np.float32)

    def make_plan(key: Any, *a: Any, **kw: Any) -> Any:
        plan = SimpleNamespace(algo_ptr=0, block_scaled=False, epilogue=key.epilogue)
        blas._plans[key] = plan
        ctx.device._count("gemm_plan")
        return plan

    blas._make_plan = make_plan
    blas._matmul = lambda *a, **kw: ctx.device._count("gemm")
    blas.close = lambda: None
    ctx.blas = blas
    return ctx


def build_runner(layers: int, rows: int, forced: int, forced_len: int, context: int) -> tuple[Any, list]:
    from cuda_bench import random_bf16_weights

    from gpu_engine.config import ModelConfig
    from gpu_engine.cuda import runner as runner_mod
    from gpu_engine.cuda.options import CudaOptions
    from gpu_engine.runner_api import CacheSpec

    config = ModelConfig.from_dict({"model_type": "qwen3_5", "text_config": {**TEXT, "num_hidden_layers": layers},
                                    "vision_config": {}, "tie_word_embeddings": False})
    weights = random_bf16_weights(config, np.random.default_rng(0))
    original = runner_mod.GpuContext
    runner_mod.GpuContext = stub_context  # type: ignore[assignment,misc]
    try:
        runner = runner_mod.CudaRunner(config, weights, CudaOptions(memory_budget=1 << 42))
    finally:
        runner_mod.GpuContext = original  # type: ignore[misc]
    seqs, bs = rows + forced, 16
    per_seq = (context + 64 + forced_len) // bs + 1
    runner.allocate_cache(CacheSpec(num_kv_blocks=per_seq * seqs, block_size=bs, num_state_slots=seqs))
    tables = [np.arange(s * per_seq, (s + 1) * per_seq, dtype=np.int32) for s in range(seqs)]
    return runner, tables


def measure(layers: int, rows: int, forced: int, forced_len: int, context: int, steps: int) -> dict[str, Any]:
    from eager_step_profile import greedy

    from gpu_engine.runner_api import SeqChunk, StepBatch

    runner, tables = build_runner(layers, rows, forced, forced_len, context)
    vocab = runner.cfg.vocab_size
    rng = np.random.default_rng(1)

    def batch(extra: int) -> Any:
        chunks = [SeqChunk(s, rng.integers(0, vocab, 1), np.full((3, 1), context), context, tables[s], s)
                  for s in range(rows)]
        chunks += [SeqChunk(s, rng.integers(0, vocab, forced_len),
                            np.tile(np.arange(context, context + forced_len), (3, 1)), context, tables[s], s)
                   for s in range(rows, rows + extra)]
        return StepBatch(chunks, sampling=greedy(len(chunks)))

    out: dict[str, Any] = {"layers": layers, "rows": rows, "forced": forced, "forced_len": forced_len,
                           "context": context, "steps": steps, "kinds": {}}
    device = runner.ctx.device
    for kind, graphs, extra in (("graphed", True, 0), ("eager", False, 0), ("forced", False, forced)):
        runner.use_graphs = graphs
        for _ in range(3):  # graphed: warm-up, capture, one replay
            runner.forward(batch(extra))
        device.counts.clear()
        times = []
        for _ in range(steps):
            b = batch(extra)
            t0 = time.perf_counter()
            runner.forward(b)
            times.append(time.perf_counter() - t0)
        per_step = {k: v / steps for k, v in sorted(device.counts.items())}
        prof = cProfile.Profile()
        b = batch(extra)
        prof.enable()
        runner.forward(b)
        prof.disable()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(12)
        out["kinds"][kind] = {"host_ms": 1e3 * statistics.median(times), "device_calls_per_step": per_step,
                              "cprofile_top12": text.getvalue().splitlines()}
    out["decode_counts"] = vars(runner.decode_counts)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=190)
    parser.add_argument("--forced", type=int, default=10)
    parser.add_argument("--forced-len", type=int, default=5)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    result = measure(args.layers, args.rows, args.forced, args.forced_len, args.context, args.steps)
    result["command"] = "python3 " + " ".join(sys.argv)
    print(f"{'kind':<8} {'host ms':>8}  device calls per step")
    for kind, r in result["kinds"].items():
        calls = ", ".join(f"{k} {v:g}" for k, v in r["device_calls_per_step"].items())
        print(f"{kind:<8} {r['host_ms']:8.2f}  {calls}")
    print("\ncProfile of one 'forced' step (own time):")
    print("\n".join(result["kinds"]["forced"]["cprofile_top12"][:40]))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

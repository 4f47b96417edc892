"""Host overhead of one engine step (scheduler + batch building + sampling + bookkeeping + detokenising) for
1 / 32 / 128 sequences in steady decode, with a runner that returns at once.

The runner hands back a preallocated logits array, so every microsecond measured is engine host work — the part
that must stay small next to a GPU decode step. Two vocabulary sizes: the tiny test model's (2074) and Qwen3.5's
(248320), because numpy sampling over the vocabulary is the one cost that scales with it (a GPU runner would do
that reduction on the device).

    python bench/engine_host_overhead.py [--steps 200] [--out bench/results/engine_host_overhead.json]
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _instant_runner import InstantRunner, parse_args, tiny_tokenizer, write_result

from gpu_engine.engine import Engine
from gpu_engine.engine_config import EngineConfig
from gpu_engine.params import SamplingParams
from gpu_engine.tokenizer import IncrementalDetokenizer, Tokenizer


def fixed_logits(vocab_size: int, max_rows: int, text_vocab: int) -> np.ndarray:
    """Fixed rows, distinct per row so argmax is not trivially 0; only real text tokens get mass, so the
    detokeniser sees ordinary tokens."""
    rng = np.random.default_rng(0)
    logits = np.full((max_rows, vocab_size), -10.0, np.float32)
    logits[:, :text_vocab] = rng.standard_normal((max_rows, text_vocab)).astype(np.float32)
    return logits


def measure(tokenizer: Tokenizer, vocab: int, num_seqs: int, steps: int, params: SamplingParams) -> dict:
    runner = InstantRunner(fixed_logits(vocab, num_seqs, 2000))
    cfg = EngineConfig(max_num_seqs=num_seqs, max_batched_tokens=max(2048, num_seqs), num_kv_blocks=num_seqs * 64 + 64,
                       block_size=16)
    eng = Engine(runner, tokenizer, vocab_size=vocab, config=cfg)
    rng = np.random.default_rng(1)
    for _ in range(num_seqs):
        eng.add_request(rng.integers(0, 2000, size=16).tolist(), params)
    for _ in range(3):  # prefill + warm-up: afterwards every sequence decodes one token per step
        eng.step()
    before = eng.stats()
    times, cpu = [], []
    for _ in range(steps):
        c0, t0 = time.process_time(), time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    after = eng.stats()
    assert after["running"] == num_seqs and after["decode_tokens"] - before["decode_tokens"] == steps * num_seqs
    us = np.array(times) * 1e6
    sample_us = (after["sample_time_s"] - before["sample_time_s"]) / steps * 1e6
    return {
        "vocab": vocab, "num_seqs": num_seqs, "steps": steps,
        "step_us_mean": float(us.mean()), "step_us_p50": float(np.percentile(us, 50)),
        "cpu_us_p50": float(np.percentile(np.array(cpu) * 1e6, 50)),
        "step_us_p95": float(np.percentile(us, 95)),
        "sampling_us_mean": float(sample_us),
        "host_us_without_sampling": float(us.mean() - sample_us),
        "us_per_sequence": float(us.mean() / num_seqs),
    }


def main() -> None:
    args = parse_args("engine_host_overhead", steps=200)
    tokenizer = tiny_tokenizer()
    rows = []
    params = SamplingParams(max_tokens=900, ignore_eos=True)
    for vocab in (2074, 248320):
        for n in (1, 32, 128):
            rows.append(measure(tokenizer, vocab, n, args.steps if vocab < 10000 else max(20, args.steps // 5), params))
            rows[-1]["detokenizer"] = True
    # The same at the small vocabulary with the incremental detokeniser stubbed out, to show its share.
    real_push = IncrementalDetokenizer.push
    IncrementalDetokenizer.push = lambda self, token_id: ""  # type: ignore[method-assign]  # stubbed on purpose
    try:
        for n in (1, 32, 128):
            rows.append(measure(tokenizer, 2074, n, args.steps, params))
            rows[-1]["detokenizer"] = False
    finally:
        IncrementalDetokenizer.push = real_push  # type: ignore[method-assign]  # restores the stub above
    print(f"{'vocab':>7} {'seqs':>5} {'detok':>6} {'cpu µs p50':>11} {'wall µs p50':>12} {'mean':>8} {'p95':>8} "
          f"{'sampling µs':>12} {'host w/o sampling µs':>21} {'µs/seq (p50)':>13}")
    for r in rows:
        print(f"{r['vocab']:>7} {r['num_seqs']:>5} {str(r['detokenizer']):>6} {r['cpu_us_p50']:>11.0f} "
              f"{r['step_us_p50']:>12.0f} {r['step_us_mean']:>8.0f} {r['step_us_p95']:>8.0f} "
              f"{r['sampling_us_mean']:>12.0f} {r['host_us_without_sampling']:>21.0f} "
              f"{r['cpu_us_p50'] / r['num_seqs']:>13.1f}")
    write_result(args.out, "engine_host_overhead", {
        "note": "cpu_us_p50 (process CPU time per step, median) is the figure to read: this machine is shared, so "
                "wall-clock mean / p95 include waiting for the CPU behind other processes",
        "sampling": "greedy, no penalties, no logprobs",
        "goal": "<= 1000 µs per step at 128 sequences",
        "rows": rows,
    })


if __name__ == "__main__":
    main()

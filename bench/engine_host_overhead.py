"""Host overhead of one engine step (scheduler + batch building + sampling + bookkeeping + detokenising), with a
runner that returns at once, in two workloads.

`document`: the document run's decode (bench/doc_throughput.py fixed1024) on the CPU. 32 / 128 / 192 sequences
with the pipeline's SamplingParams (pipeline.extraction.sampling_params: greedy, logprobs, the page_text JSON schema
of fixed1024, max_tokens 1,024, ignore_eos), Qwen3.5's vocabulary width (248,320: the grammar bitmasks' size),
sampled on the runner with lookahead as the CUDA runner does it (_instant_runner.SamplingInstantRunner). Host work
per step = the step's process CPU time less the runner's own, reported at output positions ~100 and ~900, with a
cProfile of the 192-sequence run near position 900.

`greedy`: the older rows, 1 / 32 / 128 sequences sampled on the host (greedy, no logprobs) at the tiny model's
vocabulary (2074) and Qwen3.5's (numpy sampling over the vocabulary is the cost that scales with it there).

    python bench/engine_host_overhead.py [--steps 200] [--workloads document,greedy] [--seqs 32,128,192]
        [--out bench/results/engine_host_overhead.json]
"""
from __future__ import annotations

import argparse
import cProfile
import dataclasses
import pstats
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _instant_runner import InstantRunner, SamplingInstantRunner, tiny_tokenizer, write_result

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


DOC_VOCAB = 248320  # Qwen3.5's logit width: every grammar bitmask row is ceil(248320 / 32) words
DOC_TOKENS = 1024  # fixed1024's output length
POSITIONS = (100, 900)  # output positions reported (a window of +-WINDOW steps around each)
WINDOW = 20
PROFILE_STEPS = 60  # profiled steps of the largest run, right after its last window


def document_params() -> SamplingParams:
    """What bench/doc_throughput.py's fixed1024 mode sends: the pipeline's params, page_text schema."""
    from doc_schemas import page_text_spec

    from pipeline.extraction import sampling_params
    from pipeline.settings import Settings

    spec = page_text_spec(min_tokens=DOC_TOKENS)
    return dataclasses.replace(sampling_params(spec.json_schema, Settings()), max_tokens=DOC_TOKENS, ignore_eos=True)


def document_engine(tokenizer: Tokenizer, num_seqs: int, params: SamplingParams) -> tuple[Engine, Any]:
    runner = SamplingInstantRunner(np.random.default_rng(0).standard_normal((num_seqs * 2, 2000)).astype(np.float32))
    # room for every sequence, plus what lookahead_step.next_step wants free before it looks ahead
    blocks = num_seqs * (-(-(64 + DOC_TOKENS) // 16) + 1) + 8192 // 16 + 256
    cfg = EngineConfig(max_num_seqs=256, max_batched_tokens=8192, num_kv_blocks=blocks, block_size=16)
    eng = Engine(runner, tokenizer, vocab_size=DOC_VOCAB, config=cfg)
    rng = np.random.default_rng(1)
    for _ in range(num_seqs):
        eng.add_request(rng.integers(0, 2000, size=64).tolist(), params)
    return eng, runner


def measure_document(tokenizer: Tokenizer, num_seqs: int, params: SamplingParams, profile: bool) -> dict:
    """Runs `num_seqs` requests to their end; the steps near each of POSITIONS are timed (process CPU less the
    runner's); with `profile`, PROFILE_STEPS steps after the last window run under cProfile."""
    eng, runner = document_engine(tokenizer, num_seqs, params)
    seqs = list(eng._live.values())
    host: dict[int, list[float]] = {p: [] for p in POSITIONS}
    wall: dict[int, list[float]] = {p: [] for p in POSITIONS}
    prof, profiled, errors = cProfile.Profile(), 0, 0
    t_run = time.perf_counter()
    steps = 0
    while eng.has_unfinished():
        position = min(s.num_output_tokens for s in seqs)
        near = [p for p in POSITIONS if abs(position - p) <= WINDOW and len(eng._live) == num_seqs]
        profiling = profile and profiled < PROFILE_STEPS and position > POSITIONS[-1] + WINDOW
        if profiling:
            prof.enable()
        busy, c0, t0 = runner.busy_s, time.process_time(), time.perf_counter()
        outs = eng.step()
        cpu, w = time.process_time() - c0 - (runner.busy_s - busy), time.perf_counter() - t0
        if profiling:
            prof.disable()
            profiled += 1
        errors += sum(o.finish_reason == "error" for o in outs)
        steps += 1
        for p in near:
            host[p].append(cpu)
            wall[p].append(w)
    stats = eng.stats()
    assert errors == 0 and all(s.num_output_tokens == DOC_TOKENS for s in seqs), "every request runs to 1,024 tokens"
    assert stats["lookahead_steps"] > 0.9 * steps, "the decode steps are lookahead steps, as on the CUDA runner"
    row: dict[str, Any] = {
        "num_seqs": num_seqs, "steps": steps, "run_s": round(time.perf_counter() - t_run, 2),
        "lookahead_steps": stats.get("lookahead_steps", 0), "forced_tokens": stats.get("forced_tokens", 0),
    }
    for p in POSITIONS:
        us = np.array(host[p]) * 1e6
        row[f"host_us_p50_at_{p}"] = float(np.percentile(us, 50))
        row[f"host_us_mean_at_{p}"] = float(us.mean())  # with the garbage collector's rarer full collections
        row[f"wall_us_p50_at_{p}"] = float(np.percentile(np.array(wall[p]) * 1e6, 50))
        row[f"us_per_seq_at_{p}"] = float(np.percentile(us, 50) / num_seqs)
        row[f"timed_steps_at_{p}"] = len(us)
    if profile:
        row["profile_steps"] = profiled
        row["profile_top20"] = profile_top(prof, 20)
    return row


def profile_top(prof: cProfile.Profile, n: int) -> list[dict]:
    st = pstats.Stats(prof)
    rows = []
    for (file, line, fn), (_, calls, tt, ct, _) in st.stats.items():  # type: ignore[attr-defined]  # pstats' table
        where = f"{Path(file).parent.name}/{Path(file).name}:{line}" if line else file
        rows.append({"function": f"{where}({fn})", "calls": calls, "tottime_s": round(tt, 4),
                     "cumtime_s": round(ct, 4)})
    return sorted(rows, key=lambda r: -r["tottime_s"])[:n]


def print_document(rows: list[dict]) -> None:
    print(f"document decode (host CPU us per step, p50; runner time excluded): {DOC_TOKENS} tokens, "
          f"vocab {DOC_VOCAB}, page_text grammar, logprobs, runner sampling + lookahead")
    head = "".join(f"{f'host us @{p}':>14}{f'mean @{p}':>11}{f'us/seq @{p}':>13}{f'wall us @{p}':>14}"
                   for p in POSITIONS)
    print(f"{'seqs':>5}{head}{'steps':>7}{'run s':>8}")
    for r in rows:
        cells = "".join(f"{r[f'host_us_p50_at_{p}']:>14.0f}{r[f'host_us_mean_at_{p}']:>11.0f}"
                        f"{r[f'us_per_seq_at_{p}']:>13.1f}"
                        f"{r[f'wall_us_p50_at_{p}']:>14.0f}" for p in POSITIONS)
        print(f"{r['num_seqs']:>5}{cells}{r['steps']:>7}{r['run_s']:>8.1f}")
    for r in rows:
        if "profile_top20" in r:
            print(f"cProfile, {r['num_seqs']} sequences, {r['profile_steps']} steps after position "
                  f"{POSITIONS[-1] + WINDOW} (top 20 by tottime):")
            print(f"{'tottime s':>10} {'cumtime s':>10} {'calls':>9}  function")
            for f in r["profile_top20"]:
                print(f"{f['tottime_s']:>10.3f} {f['cumtime_s']:>10.3f} {f['calls']:>9}  {f['function']}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="bench/engine_host_overhead.py")
    parser.add_argument("--steps", type=int, default=200, help="measured steps of each greedy row")
    parser.add_argument("--workloads", default="document,greedy")
    parser.add_argument("--seqs", default="32,128,192", help="sequence counts of the document workload")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "engine_host_overhead.json"))
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    workloads = args.workloads.split(",")
    tokenizer = tiny_tokenizer()
    fields: dict[str, Any] = {
        "note": "cpu_us_p50 / host_us_p50 (process CPU time per step, median) is the figure to read: this machine is "
                "shared, so wall-clock figures include waiting for the CPU behind other processes",
    }
    if "document" in workloads:
        params = document_params()
        counts = [int(n) for n in args.seqs.split(",")]
        doc = [measure_document(tokenizer, n, params, profile=n == max(counts)) for n in counts]
        print_document(doc)
        fields["document"] = {
            "workload": f"bench/doc_throughput.py fixed1024: pipeline sampling_params (greedy, logprobs, "
                        f"top_logprobs {params.top_logprobs}), page_text schema, max_tokens {DOC_TOKENS}, vocab "
                        f"{DOC_VOCAB}, runner sampling with lookahead (SamplingInstantRunner), tiny tokenizer",
            "goal": "host work of a decode step at 192 sequences well under 10 ms (~5 ms)",
            "rows": doc,
        }
    if "greedy" in workloads:
        fields["greedy"] = {"sampling": "greedy, no penalties, no logprobs, on the host",
                            "goal": "<= 1000 µs per step at 128 sequences", "rows": greedy_rows(tokenizer, args.steps)}
    write_result(args.out, "engine_host_overhead", fields)


def greedy_rows(tokenizer: Tokenizer, steps: int) -> list[dict]:
    rows = []
    params = SamplingParams(max_tokens=900, ignore_eos=True)
    for vocab in (2074, 248320):
        for n in (1, 32, 128):
            rows.append(measure(tokenizer, vocab, n, steps if vocab < 10000 else max(20, steps // 5), params))
            rows[-1]["detokenizer"] = True
    # The same at the small vocabulary with the incremental detokeniser stubbed out, to show its share.
    real_push = IncrementalDetokenizer.push
    IncrementalDetokenizer.push = lambda self, token_id: ""  # type: ignore[method-assign]  # stubbed on purpose
    try:
        for n in (1, 32, 128):
            rows.append(measure(tokenizer, 2074, n, steps, params))
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
    return rows


if __name__ == "__main__":
    main()

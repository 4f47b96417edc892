"""Grammar-mask overhead per engine step for 1 / 8 / 32 / 128 JSON-schema-constrained sequences.

A runner that returns at once hands back random logits; every request is constrained by an invoice-like JSON
schema and sampled at temperature 1, so the grammars walk through varied states. Finished requests are replaced
at once, so the batch stays full. Reported per step: the mask time (llguidance computing the bitmask for the
batch + unpacking + applying it, the engine's own `mask_time_s` counter), the whole step, and how many tokens
jump-forward appended without sampling.

    python bench/engine_mask_overhead.py [--steps 100] [--out bench/results/engine_mask_overhead.json]
"""
from __future__ import annotations

import json
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
from gpu_engine.tokenizer import Tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "vendor": {"type": "string", "maxLength": 24},
        "invoice_number": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{4,8}$"},
        "issued": {"type": "string", "format": "date"},
        "currency": {"enum": ["EUR", "USD", "GBP", "CHF"]},
        "lines": {"type": "array", "maxItems": 4, "items": {
            "type": "object",
            "properties": {"description": {"type": "string", "maxLength": 16},
                           "qty": {"type": "integer", "minimum": 1, "maximum": 999},
                           "price": {"type": "number", "minimum": 0, "maximum": 100000, "multipleOf": 0.01}},
            "required": ["description", "qty", "price"], "additionalProperties": False}},
        "total": {"type": "number", "minimum": 0, "maximum": 1000000, "multipleOf": 0.01},
    },
    "required": ["vendor", "invoice_number", "issued", "currency", "lines", "total"],
    "additionalProperties": False,
}


def measure(tokenizer: Tokenizer, num_seqs: int, steps: int) -> dict:
    vocab = tokenizer.vocab_size
    rng = np.random.default_rng(0)
    runner = InstantRunner(rng.standard_normal((num_seqs * 8, vocab)).astype(np.float32), rng)  # random windows
    eng = Engine(runner, tokenizer, vocab_size=vocab,
                 config=EngineConfig(max_num_seqs=num_seqs, max_batched_tokens=4096, num_kv_blocks=num_seqs * 64))
    rng = np.random.default_rng(1)

    def add() -> None:
        eng.add_request(rng.integers(0, 2000, size=16).tolist(),
                        SamplingParams(max_tokens=400, temperature=1.0, json_schema=SCHEMA,
                                       seed=int(rng.integers(1 << 30))))

    for _ in range(num_seqs):
        add()
    eng.step()  # prefill
    before = eng.stats()
    times, cpu, masks, finished, valid = [], [], [], 0, 0
    for _ in range(steps):
        m0 = eng.stats()["mask_time_s"]
        c0, t0 = time.process_time(), time.perf_counter()
        outs = eng.step()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        masks.append(eng.stats()["mask_time_s"] - m0)
        for out in outs:
            if out.finished:
                finished += 1
                try:
                    json.loads(out.text)
                    valid += out.finish_reason == "stop"
                except json.JSONDecodeError:
                    pass
                add()
    after = eng.stats()
    us = np.array(times) * 1e6
    mask_us = np.array(masks) * 1e6
    return {
        "num_seqs": num_seqs, "steps": steps, "vocab": vocab,
        "mask_us_p50": float(np.percentile(mask_us, 50)), "mask_us_mean": float(mask_us.mean()),
        "mask_us_p50_per_sequence": float(np.percentile(mask_us, 50) / num_seqs),
        "step_us_p50": float(np.percentile(us, 50)), "step_us_mean": float(us.mean()),
        "step_cpu_us_p50": float(np.percentile(np.array(cpu) * 1e6, 50)),
        "sampled_tokens": after["sampled_tokens"] - before["sampled_tokens"],
        "forced_tokens": after["forced_tokens"] - before["forced_tokens"],
        "finished": finished, "finished_valid_json": valid,
    }


def main() -> None:
    args = parse_args("engine_mask_overhead", steps=100)
    tokenizer = tiny_tokenizer()
    rows = [measure(tokenizer, n, args.steps) for n in (1, 8, 32, 128)]
    print(f"{'seqs':>5} {'mask µs p50':>12} {'mean':>8} {'µs/seq':>8} {'step µs p50':>12} {'step cpu µs p50':>16} "
          f"{'sampled':>8} {'forced':>7} {'finished':>9} {'valid':>6}")
    for r in rows:
        print(f"{r['num_seqs']:>5} {r['mask_us_p50']:>12.0f} {r['mask_us_mean']:>8.0f} "
              f"{r['mask_us_p50_per_sequence']:>8.1f} {r['step_us_p50']:>12.0f} {r['step_cpu_us_p50']:>16.0f} "
              f"{r['sampled_tokens']:>8} {r['forced_tokens']:>7} {r['finished']:>9} {r['finished_valid_json']:>6}")
    write_result(args.out, "engine_mask_overhead", {
        "tokenizer": f"tiny test BPE, vocab {rows[0]['vocab']} (no real Qwen tokenizer offline; llguidance mask "
                     "cost grows with the vocabulary)",
        "llguidance_threads": 1,
        "note": "mask times are wall-clock (llguidance works on its own thread); the machine is shared, read p50",
        "schema": SCHEMA,
        "rows": rows,
    })


if __name__ == "__main__":
    main()

"""The grammar part of a runner-sampled step at a real vocabulary width: llguidance filling the bitmask, and the
"does any row allow nothing" check before and after reading it off the words (gpu_engine.sampling).

    python3 bench/engine_mask_plan.py [--json bench/results/engine_mask_plan.json] [--reps 30]

Rows are matchers of the pipeline's invoice schema (pipeline.builtin_schemas, as pipeline.extraction sends it),
each advanced by a few random allowed tokens so the rows sit in different grammar states; the logit width is
Qwen3.5's 248,320 (the bundled tokenizer's ids, padded, as bench/random_model_dir.py models are). Times are the
median over --reps of each part on this machine's CPU (wall clock).
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_engine.bundled import bundled_model_dir
from gpu_engine.sampling import bitmask_allows_any, bitmask_to_bool
from gpu_engine.structured import StructuredOutput
from gpu_engine.tokenizer import Tokenizer
from pipeline.builtin_schemas import BUILTIN_SCHEMAS
from pipeline.extraction import sampling_params
from pipeline.settings import Settings

VOCAB = 248320


def median_ms(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(times))


def measure(structured: StructuredOutput, params, rows: int, reps: int, rng: np.random.Generator) -> dict:
    matchers = []
    for _ in range(rows):
        m = structured.new_matcher(params)
        for _ in range(int(rng.integers(0, 12))):  # a few steps in: rows in different states
            allowed = np.nonzero(bitmask_to_bool(structured.bitmask([(m, 0)], 1), VOCAB)[0])[0]
            if allowed.size == 0 or not m.consume_token(int(rng.choice(allowed))) or m.is_stopped():
                break
        matchers.append(m)
    pairs = [(m, j) for j, m in enumerate(matchers)]
    mask = structured.bitmask(pairs, rows)
    assert np.array_equal(bitmask_allows_any(mask, VOCAB), bitmask_to_bool(mask, VOCAB).any(axis=1))
    return {"rows": rows,
            "fill_ms": median_ms(lambda: structured.bitmask(pairs, rows), reps),
            "check_unpacked_ms": median_ms(lambda: bitmask_to_bool(mask, VOCAB).any(axis=1), reps),
            "check_words_ms": median_ms(lambda: bitmask_allows_any(mask, VOCAB), reps)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json")
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args(argv)
    tok = Tokenizer.from_pretrained(bundled_model_dir())
    structured = StructuredOutput(tok.backend.to_str(), VOCAB, sorted(tok.eos_token_ids))
    params = sampling_params(BUILTIN_SCHEMAS["invoice"].json_schema, Settings(model_dir=Path(bundled_model_dir())))
    rng = np.random.default_rng(0)
    rows = [measure(structured, params, n, args.reps, rng) for n in (8, 64, 128)]
    print(f"{'rows':>5} {'llguidance fill ms':>19} {'check, unpacked ms':>19} {'check, words ms':>16}")
    for r in rows:
        print(f"{r['rows']:>5} {r['fill_ms']:>19.2f} {r['check_unpacked_ms']:>19.2f} {r['check_words_ms']:>16.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "benchmark": "engine_mask_plan",
            "date_utc": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "command": " ".join(["python3", *sys.argv]), "machine": f"{platform.machine()}, shared CPU",
            "vocab": VOCAB, "schema": "invoice", "reps": args.reps, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

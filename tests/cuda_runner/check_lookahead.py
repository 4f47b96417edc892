"""GPU check: lookahead decoding (gpu_engine/lookahead.py, cuda/launch.py) against the same CUDA runner without it.

    python3 -m tests.cuda_runner.check_lookahead [--json out.json] [--seed N]

Per tiny random Qwen3.5 checkpoint (check_runner's two configs) and dtype (f32, bf16), two engines on the CUDA
runner with EngineConfig.lookahead off and on run the same requests, more than max_num_seqs so that admissions
happen mid-run: "free" — greedy and seeded rows, EOS allowed on some, top-2 logprobs; "json" — JSON-schema rows
(grammar-forced runs: the lookahead path's discarded rows); "prefill" — prompts sharing a long prefix, a small
token budget (PREFILL_BUDGET), so that prompts take several chunks and lookahead steps carry prompt chunks,
admissions and prefix-cache hits whose linear-attention snapshots were taken behind a launched chunk
(lookahead_step.py). Pass: token for token the plain output, a divergence
tolerated only at a near tie of the plain run (its top-2 logprob gap < NEAR_TIE: the lookahead run's steps may
hold other rows — a slot frees one step later after an EOS, a forced run is its own chunk — so the GEMMs see
other shapes), every "json" answer the grammar ended valid JSON, no lookahead failure, and lookahead steps did
run, replaying decode graphs ("prefill": also lookahead steps with prompt chunks, and prefix hits).
Skips (exit 0) without a GPU.
"""
from __future__ import annotations

import json
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gpu_engine.params import RequestOutput, SamplingParams
from tests.cuda_runner.check_runner import CONFIGS
from tests.cuda_runner.check_speculative import compare, run
from tests.cuda_runner.harness import check_main, fresh_seed

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "n": {"type": "integer"}, "ok": {"type": "boolean"}},
          "required": ["name", "n", "ok"], "additionalProperties": False}
REQUESTS, MAX_NUM_SEQS = 12, 8
PREFILL_BUDGET, PREFIX_LEN = 32, 70  # "prefill": tokens a step, shared prompt prefix
CASES = ("free", "json", "prefill")


@dataclass
class LookaheadResult:
    config: str
    dtype: str
    case: str
    identical: int  # requests token for token the plain run's
    requests: int
    near_tie: bool  # every divergence at a near tie of the plain run
    valid_json: bool
    lookahead_steps: int
    discarded_rows: int
    graphed_steps: int
    ok: bool
    note: str = ""
    prefill_steps: int = 0  # lookahead steps holding prompt chunks
    prefix_hits: int = 0  # requests admitted with a prefix-cache hit


def case_params(case: str, rng: np.random.Generator) -> list[SamplingParams]:
    out = []
    for i in range(REQUESTS):
        greedy = i % 2 == 0
        out.append(SamplingParams(
            max_tokens=120 if case == "json" else int(rng.integers(8, 40)), ignore_eos=case != "json" and i % 3 != 0,
            temperature=0.0 if greedy else 0.8, seed=int(rng.integers(1 << 30)), logprobs=True, top_logprobs=2,
            speculative="off", json_schema=SCHEMA if case == "json" else None))
    return out


def case_prompts(case: str, rng: np.random.Generator) -> list[list[int]]:
    if case != "prefill":
        return [rng.integers(3, 1500, int(n)).tolist() for n in rng.integers(4, 30, REQUESTS)]
    prefix = rng.integers(3, 1500, PREFIX_LEN).tolist()
    return [prefix + rng.integers(3, 1500, int(n)).tolist() for n in rng.integers(3, 40, REQUESTS)]


def cuda_engine(folder: Path, dtype: str, lookahead: bool, case: str = "free") -> Any:
    from gpu_engine.cuda.options import CudaOptions
    from gpu_engine.engine import Engine
    from gpu_engine.engine_config import EngineConfig

    budget = {"max_batched_tokens": PREFILL_BUDGET} if case == "prefill" else {}
    config = EngineConfig(max_num_seqs=MAX_NUM_SEQS, block_size=4, lookahead=lookahead, **budget)
    return Engine.from_pretrained(folder, runner="cuda", config=config,
                                  cuda_options=CudaOptions(dtype=dtype, memory_budget=1 << 30))


def valid_json(outs: dict[str, RequestOutput]) -> bool:
    """Every answer the grammar ended ("stop") is the schema's object (a random model may run out of max_tokens
    inside a long number: "length", not a lookahead matter)."""
    try:
        return all(set(json.loads(o.text)) == {"name", "n", "ok"} for o in outs.values() if o.finish_reason == "stop")
    except json.JSONDecodeError:
        return False


def run_all(seed: int | None = None) -> tuple[list[LookaheadResult], dict]:
    from gpu_engine.cuda.device import require_gpu
    from gpu_engine.tiny import make_tiny_checkpoint

    require_gpu()
    seed = fresh_seed(seed)
    results: list[LookaheadResult] = []
    for cname, text_cfg in CONFIGS.items():
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp) / "m"
            make_tiny_checkpoint(folder, seed=seed % 1000, text_config=text_cfg)
            for dtype in ("f32", "bf16"):
                for case in CASES:
                    rng = np.random.default_rng(seed)
                    params = case_params(case, rng)
                    prompt_ids = case_prompts(case, rng)
                    try:
                        plain_engine = cuda_engine(folder, dtype, False, case)
                        plain = run(plain_engine, prompt_ids, params)
                        plain_engine.runner.close()
                        eng = cuda_engine(folder, dtype, True, case)
                        got = run(eng, prompt_ids, params)
                        stats, graphed = eng.stats(), eng.runner.decode_counts.graphed
                        eng.runner.close()
                    except Exception as exc:  # noqa: BLE001 - one failing case must not hide the others
                        results.append(LookaheadResult(cname, dtype, case, 0, REQUESTS, False, False, 0, 0, 0,
                                                       False, f"{type(exc).__name__}: {exc}"[:300]))
                        continue
                    same, tie, note = compare(plain, got)
                    identical = sum(plain[r].token_ids == got[r].token_ids for r in plain)
                    json_ok = case != "json" or (valid_json(plain) and valid_json(got))
                    steps, discarded = int(stats["lookahead_steps"]), int(stats["lookahead_discarded_rows"])
                    prefill, hits = int(stats["lookahead_prefill_steps"]), int(stats["prefix_hit_requests"])
                    failed = int(stats["lookahead_failures"])  # the recovery path would hide a runner exception
                    ok = (same or tie) and json_ok and steps > 0 and graphed > 0 and failed == 0
                    if case == "prefill":
                        ok = ok and prefill > 0 and hits > 0
                    if failed:
                        note = f"lookahead failed: {eng.lookahead.off_reason}; {note}"
                    results.append(LookaheadResult(cname, dtype, case, identical, REQUESTS, tie, json_ok, steps,
                                                   discarded, graphed, ok, note, prefill, hits))
                    print(format_table(results[-1:]).splitlines()[-1], flush=True)  # progress, if cut short
    return results, {"seed": seed, "requests": REQUESTS, "max_num_seqs": MAX_NUM_SEQS,
                     "prefill_budget": PREFILL_BUDGET, "prefix_len": PREFIX_LEN}


def format_table(results: list[LookaheadResult]) -> str:
    lines = [f"{'config':<40} {'dtype':<5} {'case':<7} {'same':>5} {'json':>5} {'la steps':>8} {'prefill':>7} "
             f"{'hits':>4} {'discard':>7} {'graphed':>7}  ok", "-" * 114]
    for r in results:
        lines.append(f"{r.config:<40} {r.dtype:<5} {r.case:<7} {r.identical:>2}/{r.requests:<2} "
                     f"{'ok' if r.valid_json else 'BAD':>5} {r.lookahead_steps:>8} {r.prefill_steps:>7} "
                     f"{r.prefix_hits:>4} {r.discarded_rows:>7} "
                     f"{r.graphed_steps:>7}  {'PASS' if r.ok else 'FAIL'}" + (f"  {r.note}" if r.note else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return check_main(__doc__.splitlines()[0], run_all, format_table, argv)


if __name__ == "__main__":
    sys.exit(main())

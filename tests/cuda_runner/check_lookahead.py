"""GPU check: lookahead decoding (gpu_engine/lookahead.py, cuda/launch.py) against the same CUDA runner without it.

    python3 -m tests.cuda_runner.check_lookahead [--json out.json] [--seed N]

Per tiny random Qwen3.5 checkpoint (check_runner's two configs) and dtype (f32, bf16), two engines on the CUDA
runner with EngineConfig.lookahead off and on run the same requests, more than max_num_seqs so that admissions
happen mid-run: "free" — greedy and seeded rows, EOS allowed on some, top-2 logprobs; "json" — JSON-schema rows
(grammar-forced runs: the lookahead path's discarded rows); "prefill" — prompts sharing a long prefix, a small
token budget (PREFILL_BUDGET), so that prompts take several chunks and lookahead steps carry prompt chunks,
admissions and prefix-cache hits whose linear-attention snapshots were taken behind a launched chunk
(lookahead_step.py). Pass: token for token the plain output, or each divergence explained by the arithmetic's
noise; every "json" answer the grammar ended valid JSON, no lookahead failure, and lookahead steps did run,
replaying decode graphs ("prefill": also lookahead steps with prompt chunks, and prefix hits).

The noise rule. The lookahead run's steps hold other rows than the plain run's (a slot frees one step later after
an EOS, a forced run is its own chunk), so its GEMMs see other shapes and, in bf16, round differently. The plain
run's top-2 gap was no measure of that: a sampled row's token need not be its top-1 at all, and bf16 logits of two
batchings differ by more than 0.05 nats. Instead the float32 reference runner (bf16-rounded weights for bf16, as in
check_runner) runs over each plain answer, teacher-forced, the request's grammar masks replayed: its logprobs at
every position. noise = the RMS of (plain - reference) logprobs over the plain run's sampled positions (chosen and
top-2 tokens; at least MIN_NOISE_NATS). At a divergence the prefix is common, so both runs saw one reference
distribution there; each run's token must be one it yields under independent logprob errors of that RMS, within
NOISE_SIGMAS standard deviations: greedy, near the reference's best; sampled, the request's own uniform (its seed's
generator, one draw per sampled token) at the token's CDF interval (possible_tokens). A token the grammar forbids,
one far below the best, or a sampled token whose interval is far from its uniform fails. The lookahead run's own
noise over its shared prefix is reported beside (a run that reads stale state shows there first).
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

from gpu_engine.params import RequestOutput, SamplingParams, TokenLogprob
from tests.cuda_runner.check_runner import CONFIGS
from tests.cuda_runner.check_speculative import run
from tests.cuda_runner.harness import check_main, fresh_seed

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "n": {"type": "integer"}, "ok": {"type": "boolean"}},
          "required": ["name", "n", "ok"], "additionalProperties": False}
REQUESTS, MAX_NUM_SEQS = 12, 8
PREFILL_BUDGET, PREFIX_LEN = 32, 70  # "prefill": tokens a step, shared prompt prefix
CASES = ("free", "json", "prefill")
NOISE_SIGMAS = 8.0  # how far (in standard deviations of the measured noise) a flip may reach
MIN_NOISE_NATS = 1e-5  # float32 measures ~1e-6: a divergence there needs a real tie


@dataclass
class LookaheadResult:
    config: str
    dtype: str
    case: str
    identical: int  # requests token for token the plain run's
    requests: int
    within_noise: bool  # every divergence explained by the noise (module docstring)
    valid_json: bool
    lookahead_steps: int
    discarded_rows: int
    graphed_steps: int
    ok: bool
    note: str = ""
    prefill_steps: int = 0  # lookahead steps holding prompt chunks
    prefix_hits: int = 0  # requests admitted with a prefix-cache hit
    noise_nats: float = 0.0  # largest |plain - reference| logprob over the plain run's sampled positions
    lookahead_noise_nats: float = 0.0  # the same for the lookahead run, over its positions shared with the plain run


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


# ------------------------------------------------------------------------------------------------ the noise rule

def is_forced(lp: TokenLogprob) -> bool:
    """A grammar-forced token (output_processor: logprob 0 and itself as its only top entry): nothing was drawn."""
    return lp.logprob == 0.0 and lp.top == [(lp.token_id, 0.0)]


def reference_logprobs(runner: Any, structured: Any, prompt: list[int], out: RequestOutput,
                       params: SamplingParams) -> np.ndarray:
    """float32 [len(out.token_ids), V]: the reference runner's processed logprobs (grammar-masked, temperature 1,
    as sampling.sample reports them) before each token of `out`, teacher-forced on its tokens in one chunk."""
    from gpu_engine.runner_api import SeqChunk, StepBatch
    from gpu_engine.sampling import apply_allowed_mask, bitmask_to_bool, log_softmax

    ids = np.asarray(prompt + out.token_ids, np.int64)
    pos = np.arange(len(ids), dtype=np.int64)
    table = np.arange(-(-len(ids) // runner.spec.block_size), dtype=np.int32)
    chunk = SeqChunk(0, ids, np.stack([pos, pos, pos]), 0, table, 0, logits="all")
    logits = np.array(runner.forward(StepBatch([chunk])).logits[len(prompt) - 1:-1], np.float32)
    if params.json_schema is not None:
        matcher = structured.new_matcher(params)
        for k, token in enumerate(out.token_ids):
            if matcher.is_stopped():  # the grammar ended: only the EOS after it is left
                break
            apply_allowed_mask(logits[k:k + 1], bitmask_to_bool(structured.bitmask([(matcher, 0)], 1), logits.shape[1]))
            matcher.consume_token(token)
    return log_softmax(logits)


def logprob_errors(out: RequestOutput, ref: np.ndarray, upto: int | None = None) -> list[float]:
    """reported - reference logprob at the sampled positions before `upto`, for the chosen and the top tokens."""
    errors = []
    for k, lp in enumerate((out.logprobs or [])[:upto]):
        if is_forced(lp) or k >= len(ref):
            continue
        for token, value in [(lp.token_id, lp.logprob), *lp.top]:
            if np.isfinite(value) and np.isfinite(ref[k, token]):
                errors.append(float(value) - float(ref[k, token]))
    return errors


def rms(values: list[float]) -> float:
    return float(np.sqrt(np.mean(np.square(values)))) if values else 0.0


def uniform_at(params: SamplingParams, out: RequestOutput, pos: int) -> float:
    """The uniform a seeded sampled request drew for its token at `pos` (one draw per sampled token)."""
    assert params.seed is not None
    rng = np.random.default_rng(params.seed)
    draws = sum(not is_forced(lp) for lp in (out.logprobs or [])[:pos])
    for _ in range(draws):
        rng.random()
    return float(rng.random())


def possible_tokens(ref_lp: np.ndarray, params: SamplingParams, u: float | None, noise: float) -> np.ndarray:
    """bool [V]: the tokens a position can yield when its logprobs carry independent errors of RMS `noise` nats, up
    to NOISE_SIGMAS standard deviations (module docstring). Greedy (or sampled without a seed, judged as strictly):
    within NOISE_SIGMAS x sqrt(2) x noise of the reference's best. Sampled: u within the token's interval of the
    filtered, temperature-scaled CDF in id order (as sampling.sample draws), each edge widened by NOISE_SIGMAS of
    its own spread: a prefix P of the probabilities moves by sum_i p_i (e_i - mean e) / T, whose standard
    deviation is noise / T x sqrt(sum_i p_i^2 (1[i in prefix] - P)^2)."""
    from gpu_engine.sampling import filter_logits, log_softmax

    allowed = np.isfinite(ref_lp)
    if not allowed.any():  # the grammar allowed nothing here: no token is explained
        return allowed
    if params.temperature == 0.0 or u is None:
        return allowed & (ref_lp >= ref_lp[allowed].max() - NOISE_SIGMAS * np.sqrt(2.0) * noise)
    t = params.temperature
    x = filter_logits(ref_lp[None] / t, np.array([params.top_k]), np.array([params.top_p]),
                      np.array([params.min_p]))
    probs = np.exp(log_softmax(x))[0].astype(np.float64)
    upper = np.cumsum(probs)
    lower = upper - probs
    u = u * upper[-1]  # as sample() scales it
    sq = probs ** 2
    # sum_i p_i^2 (1[i <= k] - P_k)^2 for every edge k, from prefix sums of p^2
    below = np.cumsum(sq)
    spread_upper = noise / t * np.sqrt(below * (1.0 - upper) ** 2 + (below[-1] - below) * upper ** 2)
    spread_lower = np.concatenate([[0.0], spread_upper[:-1]])  # token i's lower edge is token i-1's upper edge
    lo, hi = lower - NOISE_SIGMAS * spread_lower, upper + NOISE_SIGMAS * spread_upper
    return allowed & (probs > 0) & (lo < u) & (u <= hi)


def judge(plain: dict[str, RequestOutput], got: dict[str, RequestOutput], refs: dict[str, np.ndarray],
          params: dict[str, SamplingParams], noise: float) -> tuple[bool, bool, str]:
    """(identical, every divergence within the noise, note): each run's token at the first divergence must be a
    possible token of the reference distribution there (module docstring)."""
    explained, notes = True, []
    for rid, ref in plain.items():
        a, b = ref.token_ids, got[rid].token_ids
        if a == b:
            continue
        pos = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        ok, why = False, "one run ended"
        if pos < min(len(a), len(b)) and pos < len(refs[rid]):
            p = params[rid]
            u = uniform_at(p, ref, pos) if p.temperature > 0.0 and p.seed is not None else None
            can = possible_tokens(refs[rid][pos], p, u, noise)
            ok = bool(can[a[pos]] and can[b[pos]])
            best = float(np.max(refs[rid][pos]))
            why = (f"{a[pos]} / {b[pos]}: {float(refs[rid][pos][a[pos]]) - best:.3g} / "
                   f"{float(refs[rid][pos][b[pos]]) - best:.3g} nats from the reference's best"
                   + (f", u {u:.4f}" if u is not None else ""))
        explained &= ok
        notes.append(f"{rid} diverges at {pos} ({why}; {'within' if ok else 'OUTSIDE'} the noise {noise:.3g})")
    return not notes, explained and bool(notes), "; ".join(sorted(notes, key=lambda n: "OUTSIDE" not in n))[:400]


def judge_run(folder: Path, dtype: str, structured: Any, prompts: list[list[int]], params: list[SamplingParams],
              plain: dict[str, RequestOutput], got: dict[str, RequestOutput]) -> tuple[bool, bool, str, float, float]:
    """judge() against the reference runner on `folder`'s weights (bf16-rounded for dtype bf16), with the noise
    measured on the plain run: (identical, within the noise, note, noise, the lookahead run's noise)."""
    from gpu_engine.config import ModelConfig
    from gpu_engine.loader import load_weights
    from gpu_engine.reference.runner import ReferenceRunner
    from gpu_engine.runner_api import CacheSpec
    from tests.cuda_runner.check_runner import _rounded

    config = ModelConfig.from_pretrained(folder)
    weights, _ = load_weights(folder, config)
    runner = ReferenceRunner(config, _rounded(weights) if dtype == "bf16" else weights)
    longest = max(len(p) for p in prompts) + max(len(o.token_ids) for o in plain.values())
    runner.allocate_cache(CacheSpec(num_kv_blocks=-(-longest // 16), block_size=16, num_state_slots=1))
    rids = [f"r{i}" for i in range(len(prompts))]
    refs = {r: reference_logprobs(runner, structured, p, plain[r], sp) for r, p, sp in zip(rids, prompts, params)}
    noise = rms([e for r in rids for e in logprob_errors(plain[r], refs[r])])
    shared = [next((i for i, (x, y) in enumerate(zip(plain[r].token_ids, got[r].token_ids)) if x != y),
                   len(plain[r].token_ids)) for r in rids]
    got_noise = rms([e for r, upto in zip(rids, shared) for e in logprob_errors(got[r], refs[r], upto)])
    same, explained, note = judge(plain, got, refs, dict(zip(rids, params)), max(noise, MIN_NOISE_NATS))
    return same, explained, note, noise, got_noise


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
                        same, tie, note, noise, got_noise = judge_run(folder, dtype, plain_engine.structured,
                                                                      prompt_ids, params, plain, got)
                    except Exception as exc:  # noqa: BLE001 - one failing case must not hide the others
                        results.append(LookaheadResult(cname, dtype, case, 0, REQUESTS, False, False, 0, 0, 0,
                                                       False, f"{type(exc).__name__}: {exc}"[:300]))
                        continue
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
                                                   discarded, graphed, ok, note, prefill, hits, noise, got_noise))
                    print(format_table(results[-1:]).splitlines()[-1], flush=True)  # progress, if cut short
    return results, {"seed": seed, "requests": REQUESTS, "max_num_seqs": MAX_NUM_SEQS,
                     "prefill_budget": PREFILL_BUDGET, "prefix_len": PREFIX_LEN, "noise_sigmas": NOISE_SIGMAS,
                     "min_noise_nats": MIN_NOISE_NATS}


def format_table(results: list[LookaheadResult]) -> str:
    lines = [f"{'config':<40} {'dtype':<5} {'case':<7} {'same':>5} {'json':>5} {'la steps':>8} {'prefill':>7} "
             f"{'hits':>4} {'discard':>7} {'graphed':>7} {'noise':>8} {'la noise':>8}  ok", "-" * 132]
    for r in results:
        lines.append(f"{r.config:<40} {r.dtype:<5} {r.case:<7} {r.identical:>2}/{r.requests:<2} "
                     f"{'ok' if r.valid_json else 'BAD':>5} {r.lookahead_steps:>8} {r.prefill_steps:>7} "
                     f"{r.prefix_hits:>4} {r.discarded_rows:>7} {r.graphed_steps:>7} {r.noise_nats:>8.2g} "
                     f"{r.lookahead_noise_nats:>8.2g}  {'PASS' if r.ok else 'FAIL'}"
                     + (f"  {r.note}" if r.note else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return check_main(__doc__.splitlines()[0], run_all, format_table, argv)


if __name__ == "__main__":
    sys.exit(main())

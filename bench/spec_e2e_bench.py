"""End-to-end speed of speculative decoding at a chosen acceptance (issue 16, "Measuring with random weights" (c)).

    python3 bench/spec_e2e_bench.py [--shape 27b] [--json out.json] [--deadline-s 150] [--quantize none|fp8]
                                    [--rows all|goals]

The drafter is benchmark-only: Replay (speculative/drafters.py) proposes the target's own greedy continuation,
recorded in a first plain run, each draft replaced by another token with probability c. Plain random weights do
not make a target for it: their greedy choice sits at near-ties, so a verify step's other numerics (k + 1 rows a
sequence: other GEMM shapes, other bf16 rounding) pick another token, the run leaves the recorded continuation and
acceptance collapses whatever c is (session 7: 0.02-0.26). Scaling the logits (the final norm) cannot help: the
perturbation scales with them. So the target is made confident (confident_weights), its greedy choice decided far
above any rounding:
- the embedding is scaled by a power of two (rms ~EMBED_RMS): the residual stream carries the current token's
  embedding far above what the layers add, so the last hidden state points along it;
- lm_head row j is the (unscaled) embedding row sigma(j), sigma a seeded permutation: the greedy next token is
  sigma^-1(current), its logit ~sqrt(hidden) standard deviations above the others (tied heads: the current token);
- the final norm's weight puts the top logit near TOP_LOGIT nats.
Every tensor keeps its shape and dtype: the same kernels, FLOPs and bytes per step as the random model (the layers
still run; their outputs barely move the residual). The recording run measures the top-1 margin (top-1 minus top-2
logprob, nats) of every token; the JSON keeps its distribution, and every speculative row counts the requests whose
output equals the plain run's (greedy exactness on this target).

Acceptance, as the engine reports it (spec_acceptance_rate): accepted drafts / drafts verified, a draft after a
rejected one counting as rejected. A row with target t at k drafts a window uses c = 1 - a with a (each draft right,
independently: Leviathan et al.'s alpha) solving (a + a^2 + ... + a^k) / k = t; rows "alpha" use c = 1 - alpha
directly (their engine rate is lower). Rows give the measured rate, the mean accepted length (tokens a window
adds), tokens/s after the prefill and its ratio to the plain (speculative="off") run of the same prompts in the
same process. Named-drafter rows ("ngram" replaced by Replay) draft every step; the "auto" rows obey auto's cost
rule and backoff (at batch 32 the CUDA runner's rule turns auto off: it must not be slower than plain).
Rows stop being measured once --deadline-s is near; the JSON is rewritten after every batch.

--quantize fp8: the confident model, built as above, then quantised as quantize="fp8" does at load (fp8_weights:
every eligible Linear to 128x128-block e4m3 by fp8.quantize; the embedding, lm_head and norms, the only tensors
the confident construction changes, stay bf16 by QUANTIZE_SKIP); the CUDA runner runs its FP8 Linears. Its own
recording run measures the margins again (the FP8 rounding must leave the greedy choice decided). Every row and
info say `quantize`. --rows goals measures the goals' rows only: k = 3, at the smallest batch the Replay target
rows and alpha 0.7, at the largest `auto` alone (~half the time of all).
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from spec_cost_bench import Clock  # noqa: E402  (after the path set-up: bench/ is not a package)

BATCHES = (1, 8, 32)
K = 3  # the goals' drafts per window
MORE_K = (1, 2)  # measured after the k = 3 rows while time is left (batch 1 and 8)
TARGETS = (0.5, 0.7, 0.9)  # engine acceptance rates
PROMPT = 160  # prompt tokens per request
MAX_TOKENS = 96  # output tokens per request
EMBED_RMS = 1024.0  # the scaled embedding's rms: far above the layers' adds (27B random: ~200 after layer 0)
TOP_LOGIT = 24.0  # nats: the greedy token's logit, roughly (the others stay within a few nats of 0)
E2E_BLOCKS = 1000  # KV blocks of 16 tokens: 32 requests of PROMPT + MAX_TOKENS + drafts, twice over


# ------------------------------------------------------------------------------------------- the confident target
def _f32(a: np.ndarray) -> np.ndarray:
    from gpu_engine.cuda.bf16 import bf16_bits_to_f32

    return bf16_bits_to_f32(a) if a.dtype == np.uint16 else np.asarray(a, np.float32)


def _like(x: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """float32 `x` stored as `ref` is (bf16 bits, or float32)."""
    from gpu_engine.cuda.bf16 import f32_to_bf16_bits

    return f32_to_bf16_bits(x) if ref.dtype == np.uint16 else x.astype(np.float32)


def _times_pow2(a: np.ndarray, shift: int) -> np.ndarray:
    """`a` * 2**shift, exactly, in `a`'s storage (bf16 bits: the exponent field; row chunks on all cores)."""
    if a.dtype != np.uint16:
        return np.ldexp(np.asarray(a, np.float32), shift).astype(np.float32)
    from concurrent.futures import ThreadPoolExecutor

    out = np.empty_like(a)
    rows = max(1, a.shape[0] // 64)

    def part(i: int) -> None:
        x = a[i:i + rows]
        exp = (x >> 7) & 0xFF
        if np.any((exp != 0) & ((exp.astype(np.int32) + shift < 1) | (exp.astype(np.int32) + shift > 254))):
            raise ValueError(f"2**{shift} takes a bf16 value out of range")
        out[i:i + rows] = np.where(exp != 0, (x.astype(np.int32) + (shift << 7)).astype(np.uint16), x)

    with ThreadPoolExecutor() as pool:
        list(pool.map(part, range(0, a.shape[0], rows)))
    return out


def fp8_weights(weights: Any) -> Any:
    """`weights` with every Linear quantize="fp8" converts at load (fp8_checkpoint: is_linear_weight, QUANTIZE_SKIP)
    quantised by fp8.quantize, the loader's recipe, as Fp8Tensors in the plain dict (the CUDA runner takes them so,
    like bench/fp8_model_bench.py's); the rest as it is. Tensors of equal content are quantised once and share one
    Fp8Tensor: cuda_bench's random weights tile one block, so a projection of one shape is the same in every
    layer (27B: a few distinct tensors instead of ~25e9 values; content compared by blake2b, on all cores)."""
    import hashlib
    from concurrent.futures import ThreadPoolExecutor

    from gpu_engine import fp8
    from gpu_engine.fp8_checkpoint import QUANTIZE_SKIP, is_linear_weight, module_name, skipped
    from gpu_engine.loader import ModelWeights
    from gpu_engine.tensors import Fp8Tensor

    text = dict(weights.text)
    names = [n for n, a in text.items() if is_linear_weight(n, a.shape) and not skipped(module_name(n), QUANTIZE_SKIP)]

    def content(name: str) -> tuple[Any, ...]:
        a = np.ascontiguousarray(text[name])
        return a.shape, a.dtype.str, hashlib.blake2b(a.data, digest_size=16).digest()

    def quantised(name: str) -> Fp8Tensor:
        bits, scale_inv = fp8.quantize(_f32(text[name]))
        return Fp8Tensor(bits=bits, scale_inv=scale_inv, block=fp8.BLOCK, scale_dtype="F32")

    with ThreadPoolExecutor() as pool:
        keys = dict(zip(names, pool.map(content, names)))
        first: dict[tuple[Any, ...], str] = {}
        for name in names:
            first.setdefault(keys[name], name)
        done = dict(zip(first, pool.map(quantised, first.values())))
    text.update({name: done[keys[name]] for name in names})
    return ModelWeights(text=text, vision=weights.vision, lm_head=None if weights.tied else weights.lm_head,
                        mtp=weights.mtp)


@dataclass(frozen=True)
class Confident:
    weights: Any  # ModelWeights
    embed_shift: int  # the embedding was multiplied by 2**embed_shift
    norm_gain: float  # the final norm's scale (1 + weight)
    tied: bool


def confident_weights(weights: Any, hidden: int, seed: int = 0) -> Confident:
    """The confident variant of random `weights` (module docstring): same names, shapes and dtypes."""
    from gpu_engine.loader import ModelWeights

    text = dict(weights.text)
    embed = text["embed_tokens.weight"]
    sample = _f32(embed[np.linspace(0, embed.shape[0] - 1, 256).astype(np.int64)])
    rms = float(np.sqrt(np.mean(sample * sample)))
    shift = int(round(np.log2(EMBED_RMS / rms)))
    text["embed_tokens.weight"] = _times_pow2(embed, shift)
    row_norm = rms * np.sqrt(hidden) * (2.0 ** shift if weights.tied else 1.0)
    gain = TOP_LOGIT / (np.sqrt(hidden) * row_norm)  # the normed hidden state has norm sqrt(hidden)
    norm = text["norm.weight"]
    text["norm.weight"] = _like(np.full(norm.shape, gain - 1.0, np.float32), norm)  # zero-centred: 1 + w
    head = None
    if not weights.tied:
        sigma = np.random.default_rng(seed).permutation(embed.shape[0])
        head = embed[sigma]  # row j: the embedding of sigma(j), unscaled
    return Confident(ModelWeights(text=text, vision=weights.vision, lm_head=head), shift, float(gain),
                     weights.tied)


def margin_stats(margins: list[float]) -> dict[str, float]:
    m = np.asarray(margins, np.float64)
    if m.size == 0:
        return {"tokens": 0}
    return {"tokens": int(m.size), "min": float(m.min()), "p1": float(np.percentile(m, 1)),
            "p10": float(np.percentile(m, 10)), "median": float(np.median(m)),
            "below_1_nat": float(np.mean(m < 1.0))}


# ------------------------------------------------------------------------------------------------- the runs
@dataclass
class Run:
    tok_s: float  # output tokens after the step at which every request had its first one, per second
    decode_steps: int
    outputs: dict[str, list[int]]
    acceptance_rate: float  # accepted / verified drafts (0 when nothing was drafted)
    mean_accepted_length: float  # tokens a verify window added (0 when none ran)
    windows: int
    margins: list[float]  # top-1 minus top-2 logprob per output token (recording run only)


def run(engine: Any, prompts: list[list[int]], method: str, override: Any = None, margins: bool = False) -> Run:
    from gpu_engine.params import SamplingParams

    engine.spec.override = override
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, speculative=method, logprobs=margins,
                            top_logprobs=2 if margins else 0)
    before = dict(engine.stats())
    for i, p in enumerate(prompts):
        engine.add_request(p, params, request_id=f"r{i}")
    done: dict[str, list[int]] = {}
    gaps: list[float] = []
    produced: dict[str, int] = {}
    t_start, at_start, steps = None, 0, 0
    while engine.has_unfinished():
        for o in engine.step():
            produced[o.request_id] = len(o.token_ids)
            if o.finished:
                done[o.request_id] = o.token_ids
                gaps.extend(t.top[0][1] - t.top[1][1] for t in (o.logprobs or []) if len(t.top) > 1)
        steps += 1
        if t_start is None and len(produced) == len(prompts):
            t_start, at_start, steps = time.perf_counter(), sum(produced.values()), 0
    wall = time.perf_counter() - (t_start or time.perf_counter())
    after = engine.stats()
    drafted = after["spec_draft_tokens"] - before.get("spec_draft_tokens", 0)
    accepted = after["spec_accepted_tokens"] - before.get("spec_accepted_tokens", 0)
    windows = after["spec_verify_windows"] - before.get("spec_verify_windows", 0)
    tokens = sum(len(t) for t in done.values()) - at_start
    return Run(tokens / wall if wall > 0 else float("nan"), steps, done, accepted / drafted if drafted else 0.0,
               (accepted + windows) / windows if windows else 0.0, windows, gaps)


def corruption(target: float, k: int) -> float:
    """c such that (a + ... + a^k) / k = target with a = 1 - c (bisection; the left side grows with a)."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        a = (lo + hi) / 2
        lo, hi = (a, hi) if sum(a ** i for i in range(1, k + 1)) / k < target else (lo, a)
    return 1.0 - (lo + hi) / 2


@dataclass
class Row:
    batch: int
    k: int
    drafter: str  # "replay" (named, every step) or "auto" (Replay under auto's cost rule and backoff)
    rule: str  # "target": the engine rate aimed at; "alpha": each draft right with probability `aim`
    aim: float
    corrupt: float
    acceptance_rate: float
    mean_accepted_length: float
    windows: int
    tok_s: float
    plain_tok_s: float
    speedup: float
    identical_requests: str  # requests whose output is the plain run's, of the batch
    quantize: str  # "none" (the bf16 weights) or "fp8" (their Linears block-FP8: fp8_weights)


def set_k(engine: Any, k: int) -> None:
    """The engine's speculator with k drafts a window (the runner, its cache and graphs stay)."""
    from gpu_engine.speculative import SpeculativeConfig, Speculator

    config = SpeculativeConfig(num_tokens=k, max_step_tokens=engine.spec.config.max_step_tokens)
    engine.spec = Speculator(config, engine.runner, engine._counters)


def batch_rows(engine: Any, b: int, k: int, plans: list[tuple[str, str, float]], rng: np.random.Generator,
               vocab: int, clock: Clock, seed: int, record: dict[str, Any], quantize: str) -> list[Row]:
    """At batch b with k drafts: the recording run (margins), one untimed speculative run (graphs), the plain
    run, then one run per (drafter, rule, aim) of `plans` while time is left."""
    from gpu_engine.speculative.drafters import Replay

    set_k(engine, k)
    prompts = [rng.integers(3, min(vocab, 2000), PROMPT).tolist() for _ in range(b)]
    first = run(engine, prompts, "off", margins=True)
    recorded = first.outputs
    record[f"b{b}_k{k}_margin_nats"] = margin_stats(first.margins)
    run(engine, prompts, "ngram", Replay(recorded, corruption(0.7, k), vocab, seed=seed))  # captures verify shapes
    plain = run(engine, prompts, "off")
    record[f"b{b}_k{k}_plain_repeatable"] = plain.outputs == recorded
    rows = []
    for drafter, rule, aim in plans:
        if clock.left() < 4 + 0.15 * b:
            break
        c = corruption(aim, k) if rule == "target" else 1.0 - aim
        got = run(engine, prompts, "ngram" if drafter == "replay" else "auto", Replay(recorded, c, vocab, seed=seed))
        same = sum(got.outputs.get(r) == t for r, t in recorded.items())
        rows.append(Row(b, k, drafter, rule, aim, round(c, 4), got.acceptance_rate, got.mean_accepted_length,
                        got.windows, got.tok_s, plain.tok_s, got.tok_s / plain.tok_s, f"{same}/{b}", quantize))
    return rows


def measure(engine: Any, vocab: int, batches: tuple[int, ...], clock: Clock, write: Callable[[], None],
            result: dict[str, Any], seed: int = 2, rows_wanted: str = "all", quantize: str = "none") -> None:
    """The rows at `batches` (module docstring); rows_wanted "goals": the goals' rows alone (--rows)."""
    rng = np.random.default_rng(1)
    rows: list[dict[str, Any]] = result.setdefault("rows", [])
    record: dict[str, Any] = result.setdefault("recording", {})
    main = [("replay", "target", t) for t in TARGETS]
    auto = ("auto", "target", 0.7)
    if rows_wanted == "goals":
        plans = {batches[0]: [*main, ("replay", "alpha", 0.7)], batches[-1]: [auto]}
    else:
        plans = {b: [*main, auto, *([("replay", "alpha", t) for t in TARGETS] if b == 1 else [])] for b in batches}
    for b, plan in plans.items():  # k = 3: the goals' rows; auto beside them
        if clock.left() < 10 + 0.3 * b:
            break
        rows.extend(asdict(r) for r in batch_rows(engine, b, K, plan, rng, vocab, clock, seed, record, quantize))
        write()
    if rows_wanted == "goals":
        return
    for k in MORE_K:
        for b in batches[:2]:
            if clock.left() < 10 + 0.3 * b:
                break
            rows.extend(asdict(r) for r in batch_rows(engine, b, k, main, rng, vocab, clock, seed, record, quantize))
            write()


# ------------------------------------------------------------------------------------------------- set-up
def build(shape: str, quantize: str) -> tuple[Any, Any, Confident, str]:
    """(runner, ModelConfig, Confident, shape) on the CUDA runner: random bf16 weights made confident, at `shape`
    or the first smaller class that fits the card's free memory (spec_cost_bench.fitting_shape), then for
    quantize "fp8" their Linears quantised (fp8_weights). Raises CudaUnavailable without a GPU, before building
    anything."""
    from cuda_bench import model_config, random_bf16_weights
    from spec_cost_bench import fitting_shape, sizes

    from gpu_engine.cuda.device import CudaDevice
    from gpu_engine.cuda.options import CudaOptions
    from gpu_engine.cuda.runner import CudaRunner

    shape = fitting_shape(shape, CudaDevice(0).mem_info()[0])
    config, _ = model_config(shape)
    confident = confident_weights(random_bf16_weights(config, np.random.default_rng(0)), config.text.hidden_size)
    if quantize == "fp8":  # after the confident construction: the FP8 model is the confident model quantised
        confident = replace(confident, weights=fp8_weights(confident.weights))
    runner = CudaRunner(config, confident.weights, CudaOptions(dtype="bf16", memory_budget=sum(sizes(shape))))
    return runner, config, confident, shape


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="27b")
    parser.add_argument("--json")
    parser.add_argument("--deadline-s", type=float, default=150.0)
    parser.add_argument("--quantize", default="none", choices=("none", "fp8"),
                        help="fp8: the confident model's Linears block-FP8, as quantize='fp8' at load")
    parser.add_argument("--rows", default="all", choices=("all", "goals"),
                        help="goals: k = 3, batch 1 Replay target rows + alpha 0.7, batch 32 auto only")
    args = parser.parse_args(argv)
    clock = Clock(args.deadline_s)
    from doc_models import write_model

    from gpu_engine.cuda.errors import CudaUnavailable
    from gpu_engine.engine import Engine
    from gpu_engine.engine_config import EngineConfig
    from gpu_engine.speculative import SpeculativeConfig
    from gpu_engine.tokenizer import Tokenizer

    t0 = time.perf_counter()
    try:
        runner, config, confident, shape = build(args.shape, args.quantize)
    except CudaUnavailable as exc:
        print(f"SKIP: {exc}")
        return 0
    ctx = getattr(runner, "ctx", None)  # the CPU test runs the reference runner
    info = {"device": ctx.device.info.name if ctx is not None else runner.name, "shape": shape,
            "shape_asked": args.shape, "k": K, "quantize": args.quantize, "rows": args.rows,
            "prompt": PROMPT, "max_tokens": MAX_TOKENS, "setup_s": round(time.perf_counter() - t0, 1),
            "date_utc": dt.datetime.now(dt.timezone.utc).isoformat(), "command": " ".join(sys.argv),
            "graphs": getattr(runner, "use_graphs", None),
            "target": f"confident random weights: embedding x 2**{confident.embed_shift}, final norm scale "
                      f"{confident.norm_gain:.4f}, lm_head = permuted embedding rows (tied: {confident.tied}); "
                      "same shapes, dtypes and FLOPs as the random model"
                      + ("; then every eligible Linear block-FP8 (e4m3, 128x128 scales) as quantize='fp8' at load"
                         if args.quantize == "fp8" else ""),
            "acceptance": "accepted drafts / drafts verified (engine spec_acceptance_rate); a draft after a "
                          "rejected one counts as rejected",
            "drafter": "Replay (benchmark-only): the recorded greedy continuation, each draft replaced with "
                       "probability corrupt"}
    result: dict[str, Any] = {"info": info}

    def write() -> None:
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1, default=str))

    vocab, pool = config.text.vocab_size, max(BATCHES)
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = Tokenizer.from_pretrained(write_model(shape, Path(tmp) / "m", 0, 1 << 20, weights=False))
        engine = Engine(runner, tokenizer, vocab_size=vocab,
                        config=EngineConfig(max_num_seqs=pool, max_batched_tokens=pool * PROMPT,
                                            num_kv_blocks=E2E_BLOCKS, num_state_slots=pool + 1, block_size=16),
                        speculative=SpeculativeConfig(num_tokens=K))
        info["auto_max_step_tokens"] = engine.spec.max_step_tokens
        try:
            measure(engine, vocab, BATCHES, clock, write, result, rows_wanted=args.rows, quantize=args.quantize)
        except Exception as exc:  # noqa: BLE001 - keep the rows measured so far, and say why the rest are missing
            import traceback

            traceback.print_exc()
            result["error"] = f"{type(exc).__name__}: {exc}"[:400]
    info["seconds"] = round(time.perf_counter() - t0, 1)
    write()
    print(table(result))
    if ctx is not None:
        runner.close()
    return 0


def table(result: dict[str, Any]) -> str:
    info = result["info"]
    lines = [f"spec_e2e_bench {info.get('shape')} quantize {info.get('quantize', 'none')} (Replay-drafter figures on "
             "a confident random target)"]
    for key, stats in result.get("recording", {}).items():
        lines.append(f"  {key:<28} {stats}")
    lines.append(f"  {'q':<4} {'b':>3} {'k':>2} {'drafter':<7} {'rule':<6} {'aim':>4} {'c':>6} {'acc':>5} {'len':>5} "
                 f"{'tok/s':>8} {'plain':>8} {'x':>5} same")
    for r in result.get("rows", []):
        lines.append(f"  {r.get('quantize', 'none'):<4} {r['batch']:>3} {r['k']:>2} {r['drafter']:<7} "
                     f"{r['rule']:<6} {r['aim']:>4} "
                     f"{r['corrupt']:>6.3f} {r['acceptance_rate']:>5.3f} {r['mean_accepted_length']:>5.2f} "
                     f"{r['tok_s']:>8.1f} {r['plain_tok_s']:>8.1f} {r['speedup']:>5.2f} {r['identical_requests']}")
    if "error" in result:
        lines.append(f"  error: {result['error']}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())

"""A mixed stream of image and text requests through the real Engine + AsyncEngine: TTFT and latency p50/p95.

    python3 bench/cuda_stream_bench.py [--json out.json] [--runner cuda] [--requests 64] [--reps 3]

What runs:
1. reference check (--no-reference-check to skip): the bundled tiny checkpoint (gpu_engine.tiny, float32 weights,
   with a vision tower) serves the same 8 mixed requests (greedy, ignore_eos) through Engine.generate on the numpy
   reference runner and through AsyncEngine on the benchmarked runner (for "cuda": CudaRunner in f32, built exactly
   as Engine.from_pretrained builds it except for the dtype; small max_batched_tokens, so image spans are split
   across prefill chunks). Every greedy token must match, except after a near-tie (the reference's top-2 logprob
   gap below --tie-margin). For "cuda" the same requests also run through Engine.from_pretrained(runner="cuda")
   (bf16): its agreement is reported, not required. Any mismatch or unfinished request raises StreamCheckFailed.
2. a model folder of the --shape class (bench/qwen35_shapes.py: its text shape and its own vision tower, random
   bf16 weights, the bundled tokenizer; bench/random_model_dir.py) is written and loaded by Engine.from_pretrained.
3. warm-up: 4 requests (2 images) with logprobs, which must all be finite.
4. --reps repetitions of a --requests-long stream (bench/stream_requests.py: seeded Poisson arrivals, half with
   one random-pixel image of 448..1024 px a side, half text of a few hundred tokens), each repetition with fresh
   content (no prefix- or encoder-cache hits across repetitions), greedy with ignore_eos and --max-tokens each.
   Times are client-side: from the moment a request is handed to AsyncEngine.submit (which prepares the image on
   the caller's thread, as a server would) to its first token and to its last. Every request must finish by
   length with exactly --max-tokens tokens.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from qwen35_shapes import SHAPE_NAMES, model_shape
from stream_requests import RequestTiming, StreamRequest, check_timings, make_stream, summarize

from gpu_engine import Engine, SamplingParams
from gpu_engine.async_engine import AsyncEngine
from gpu_engine.cuda.options import CudaOptions
from gpu_engine.engine_config import EngineConfig
from gpu_engine.params import RequestOutput


class StreamCheckFailed(RuntimeError):
    """The engine's outputs are wrong: a request did not finish as asked, or tokens differ from the reference."""


# ------------------------------------------------------------------------------------------------ driving

def drive(front: AsyncEngine, requests: list[StreamRequest], params: SamplingParams, *, submitters: int = 4,
          timeout_s: float = 600.0) -> tuple[list[RequestTiming], float]:
    """Hand each request to front.submit at its arrival time (a few submitter threads prepare the prompts, as
    server handlers would); returns the timings in request order and the wall time from the first arrival to
    the last finish."""
    timings = [RequestTiming(r.index, r.kind, submitted=math.nan) for r in requests]

    def listener_for(t: RequestTiming) -> Callable[[RequestOutput | BaseException], None]:
        def listen(item: RequestOutput | BaseException) -> None:  # runs on the engine's loop thread
            now = time.perf_counter()
            if isinstance(item, BaseException):
                t.error, t.finished = f"{type(item).__name__}: {item}", now
                return
            if item.token_ids and t.first_token is None:
                t.first_token = now
            if item.finished:
                t.finished, t.finish_reason, t.error = now, item.finish_reason, item.error
                t.prompt_tokens, t.completion_tokens = item.prompt_tokens, len(item.token_ids)
                t.token_ids = item.token_ids
                if item.logprobs is not None:
                    t.logprobs = [lp.logprob for lp in item.logprobs]
        return listen

    with ThreadPoolExecutor(max_workers=submitters) as pool:
        start = time.perf_counter()
        futures = []
        for req, t in zip(requests, timings):
            delay = start + req.arrival_s - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            t.submitted = time.perf_counter()
            futures.append(pool.submit(front.submit, req.messages, params, listener=listener_for(t)))
        handles = [f.result() for f in futures]
    for handle, t in zip(handles, timings):
        try:
            handle.result(timeout=timeout_s)
        except Exception as exc:  # the listener has the details; keep the first error text
            t.error = t.error or f"{type(exc).__name__}: {exc}"
    ends = [t.finished for t in timings if t.finished is not None]
    return timings, (max(ends) if ends else time.perf_counter()) - start


def compare_tokens(reference: list[RequestOutput], candidate: list[RequestTiming], tie_margin: float) -> dict:
    """Greedy tokens of the candidate against the reference's (which carry top-2 logprobs). A first difference
    where the reference's top-2 gap is below `tie_margin` is a near-tie (allowed); any other is a mismatch."""
    identical, ties, mismatches = 0, [], []
    for ref, cand in zip(reference, candidate, strict=True):
        a, b = list(ref.token_ids), list(cand.token_ids)
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if first is None and len(a) == len(b):
            identical += 1
            continue
        if first is None:
            mismatches.append(f"request {cand.index} ({cand.kind}): {len(b)} tokens, reference {len(a)}")
            continue
        top = ref.logprobs[first].top if ref.logprobs else []
        gap = top[0][1] - top[1][1] if len(top) >= 2 else math.inf
        entry = (f"request {cand.index} ({cand.kind}) token {first}: {b[first]} vs reference {a[first]}, "
                 f"top-2 gap {gap:.2e}")
        (ties if gap < tie_margin else mismatches).append(entry)
    return {"requests": len(candidate), "identical": identical, "near_ties": ties, "mismatches": mismatches}


# ------------------------------------------------------------------------------------------------ stages

def reference_check(workdir: Path, runner: str, *, tie_margin: float = 1e-3, max_tokens: int = 12) -> dict:
    """Stage 1 (see the module doc): the tiny checkpoint through the reference and the benchmarked runner."""
    from gpu_engine.tiny import make_tiny_checkpoint

    folder = make_tiny_checkpoint(workdir / "tiny-check", seed=11)
    requests = make_stream(8, seed=5, mean_gap_s=0.005, text_words=(20, 80), min_side=64, max_side=320)
    config = EngineConfig(max_num_seqs=4, max_batched_tokens=48)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, logprobs=True, top_logprobs=2)
    ref_engine = Engine.from_pretrained(folder, runner="reference", config=config)
    reference = ref_engine.generate([r.messages for r in requests], params)
    out: dict[str, Any] = {}
    candidates = {"exact": _exact_engine(folder, runner, config)}
    if runner == "cuda":
        candidates["bf16"] = lambda: Engine.from_pretrained(folder, runner="cuda", config=config)
    problems = []
    for label, make in candidates.items():
        engine = make()
        front = AsyncEngine(engine)
        try:
            timings, _ = drive(front, requests, params)
        finally:
            front.shutdown()
            _close(engine)
        result = compare_tokens(reference, timings, tie_margin)
        result["unfinished"] = check_timings(timings, max_tokens)
        out[label] = result
        if label == "exact":
            problems += result["mismatches"] + result["unfinished"]
        print(f"reference check ({label}): {result['identical']}/{result['requests']} identical, "
              f"{len(result['near_ties'])} near-ties, {len(result['mismatches'])} mismatches, "
              f"{len(result['unfinished'])} unfinished", flush=True)
    out["problems"] = problems
    return out


def _exact_engine(folder: Path, runner: str, config: EngineConfig) -> Callable[[], Engine]:
    """An Engine as Engine.from_pretrained builds one, with the cuda runner in float32 for exact tokens."""
    options = CudaOptions.from_env(dtype="f32", memory_budget=2 << 30) if runner == "cuda" else None
    return lambda: Engine.from_pretrained(folder, runner=runner, config=config, cuda_options=options)


def _close(engine: Engine) -> None:
    close = getattr(engine.runner, "close", None)
    if close is not None:
        close()


def stream_bench(folder: Path, runner: str, *, requests: int, reps: int, max_tokens: int, mean_gap_s: float,
                 seed: int, engine_config: EngineConfig, min_side: int = 448, max_side: int = 1024,
                 text_words: tuple[int, int] = (150, 300), submitters: int = 4,
                 out: dict[str, Any] | None = None) -> dict:
    """Stages 3 and 4 on an existing model folder, filling and returning `out`; raises StreamCheckFailed if an
    output is wrong (what was measured before stays in `out`)."""
    out = {} if out is None else out
    t0 = time.perf_counter()
    engine = Engine.from_pretrained(folder, runner=runner, config=engine_config)
    out.update({"load_s": time.perf_counter() - t0, "runner": runner, "requests": requests, "reps": reps,
                           "max_tokens": max_tokens, "mean_gap_s": mean_gap_s, "seed": seed,
                           "engine_config": {k: getattr(engine_config, k) for k in (
                               "max_num_seqs", "max_batched_tokens", "kv_cache_bytes", "encoder_cache_bytes",
                               "enable_prefix_caching")}})
    front = AsyncEngine(engine)
    stream = lambda n, s, gap: make_stream(n, s, mean_gap_s=gap, min_side=min_side, max_side=max_side,  # noqa: E731 - local helper
                                           text_words=text_words)
    try:
        warm = stream(4, seed + 999_983, 0.0)
        warm_params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, logprobs=True)
        timings, wall = drive(front, warm, warm_params, submitters=submitters)
        problems = check_timings(timings, max_tokens)
        out["warmup"] = {"wall_s": wall, "problems": problems}
        if problems:
            raise StreamCheckFailed("warm-up outputs are wrong: " + "; ".join(problems[:8]))
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        pooled: list[RequestTiming] = []
        walls = 0.0
        out["per_rep"] = []
        for rep in range(reps):
            reqs = stream(requests, seed + rep, mean_gap_s)  # built before the clock starts
            timings, wall = drive(front, reqs, params, submitters=submitters)
            problems = check_timings(timings, max_tokens)
            if problems:
                raise StreamCheckFailed(f"repetition {rep}: " + "; ".join(problems[:8]))
            summary = summarize(timings, wall)
            summary["image_sizes"] = [r.image_size for r in reqs if r.image_size]
            out["per_rep"].append(summary)
            print(f"stream rep {rep}: " + _line(summary), flush=True)
            pooled += timings
            walls += wall
        out["pooled"] = summarize(pooled, walls)
        stats = engine.stats()
        out["engine_stats"] = {k: stats[k] for k in stats
                               if isinstance(stats[k], (int, float)) and not isinstance(stats[k], bool)}
    finally:
        front.shutdown()
        _close(engine)
    return out


def _line(s: dict) -> str:
    a = s["all"]
    return (f"{s['completed']}/{s['requests']} done in {s['wall_s']:.2f} s; TTFT p50 {1e3 * a['ttft_p50_s']:.0f} ms "
            f"p95 {1e3 * a['ttft_p95_s']:.0f} ms; latency p50 {1e3 * a['latency_p50_s']:.0f} ms p95 "
            f"{1e3 * a['latency_p95_s']:.0f} ms; {s['tokens_per_s']:.0f} tok/s, {s['images_per_s']:.1f} images/s")


def table_rows(result: dict) -> list[tuple[str, str]]:
    """The stream's rows for a results table."""
    rows = []
    pooled = result.get("pooled")
    if pooled:
        n = f"{result['requests']} req x {result['reps']}"
        for kind in ("all", "text", "image"):
            s = pooled[kind]
            if s["count"]:
                rows.append((f"stream ({n}), {kind}: TTFT p50 / p95",
                             f"{1e3 * s['ttft_p50_s']:.0f} / {1e3 * s['ttft_p95_s']:.0f} ms"))
                rows.append((f"stream ({n}), {kind}: latency p50 / p95",
                             f"{1e3 * s['latency_p50_s']:.0f} / {1e3 * s['latency_p95_s']:.0f} ms"))
        rows.append((f"stream ({n}): throughput", f"{pooled['tokens_per_s']:.0f} generated tok/s, "
                                                  f"{pooled['prompt_tokens_per_s']:.0f} prompt tok/s, "
                                                  f"{pooled['images_per_s']:.2f} images/s"))
    check = result.get("reference_check")
    if check:
        for label in ("exact", "bf16"):
            if label in check:
                c = check[label]
                rows.append((f"engine vs reference runner, tiny, {label}",
                             f"{c['identical']}/{c['requests']} identical, {len(c['near_ties'])} near-ties, "
                             f"{len(c['mismatches'])} mismatches"))
    return rows


def run(args: argparse.Namespace, result: dict[str, Any]) -> None:
    """Every stage, in order, filling `result` as it goes (so a StreamCheckFailed leaves what was measured)."""
    from random_model_dir import write_random_model_dir

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="docpipe-stream-"))
    if not args.no_reference_check:
        result["reference_check"] = reference_check(workdir, args.runner, tie_margin=args.tie_margin)
        if result["reference_check"]["problems"]:
            raise StreamCheckFailed("engine outputs differ from the reference runner: "
                                    + "; ".join(result["reference_check"]["problems"][:8]))
    text_cfg, vision_cfg, tied = model_shape(args.shape)  # each class with its own tower (out_hidden = hidden)
    t0 = time.perf_counter()
    folder = write_random_model_dir(workdir / f"random-{args.shape}", text_cfg, vision_cfg, tied=tied, seed=args.seed)
    result["write_model_s"] = time.perf_counter() - t0
    config = EngineConfig(max_num_seqs=args.max_num_seqs, max_batched_tokens=args.max_batched_tokens,
                          kv_cache_bytes=args.kv_cache_bytes)
    result["stream"] = {"shape": args.shape}
    stream_bench(folder, args.runner, requests=args.requests, reps=args.reps, max_tokens=args.max_tokens,
                 mean_gap_s=args.mean_gap, seed=args.seed, engine_config=config, out=result["stream"])


def add_arguments(parser: argparse.ArgumentParser, prefix: str = "") -> None:
    """The stream's options (prefix: '' standalone, 'stream-' inside another benchmark's parser)."""
    p = f"--{prefix}"
    parser.add_argument(f"{p}runner", default="cuda", choices=("cuda", "reference"))
    parser.add_argument(f"{p}requests", type=int, default=64)
    parser.add_argument(f"{p}reps", type=int, default=3)
    parser.add_argument(f"{p}max-tokens", type=int, default=48)
    parser.add_argument(f"{p}mean-gap", type=float, default=0.05, help="mean inter-arrival time, seconds")
    parser.add_argument(f"{p}seed", type=int, default=0)
    parser.add_argument(f"{p}max-num-seqs", type=int, default=32)
    parser.add_argument(f"{p}max-batched-tokens", type=int, default=2048)
    parser.add_argument(f"{p}kv-cache-bytes", type=int, default=6 << 30)
    parser.add_argument(f"{p}tie-margin", type=float, default=1e-3)
    parser.add_argument(f"{p}no-reference-check", action="store_true")
    parser.add_argument(f"{p}workdir", help="where the model folders go (default: a new temporary folder)")


def stream_args(args: argparse.Namespace, prefix: str = "") -> argparse.Namespace:
    """The stream's options out of a namespace parsed with add_arguments(prefix)."""
    key = prefix.replace("-", "_")
    names = ("runner", "requests", "reps", "max_tokens", "mean_gap", "seed", "max_num_seqs", "max_batched_tokens",
             "kv_cache_bytes", "tie_margin", "no_reference_check", "workdir")
    out = argparse.Namespace(**{n: getattr(args, key + n) for n in names})
    out.shape = getattr(args, "shape", "2b")
    if out.requests < 2 or out.reps < 1 or out.max_tokens < 1 or out.mean_gap < 0:
        raise SystemExit("stream: --requests must be >= 2, --reps and --max-tokens >= 1, --mean-gap >= 0")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json")
    parser.add_argument("--shape", default="2b", choices=SHAPE_NAMES,
                        help="model class (text + vision tower) of bench/qwen35_shapes.py")
    add_arguments(parser)
    args = parser.parse_args(argv)
    results: dict[str, Any] = {"info": {"date_utc": dt.datetime.now(dt.timezone.utc).isoformat(),
                                        "command": " ".join([os.path.basename(sys.executable), *sys.argv])}}
    try:
        run(stream_args(args), results)
    finally:
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1))
    rows = table_rows({**results.get("stream", {}), "reference_check": results.get("reference_check")})
    width = max((len(r[0]) for r in rows), default=0)
    print("\n".join(f"{name:<{width}}  {value}" for name, value in rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())

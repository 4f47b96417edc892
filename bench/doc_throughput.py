"""Pages per second per GPU: the document workload at saturation, measured against the card's limit (issue 14).

    python3 bench/doc_throughput.py --runner cuda --shapes 9b,27b --modes fixed256,fixed1024,grammar \
        [--units 128] [--max-num-seqs 64] [--json bench/results/doc_throughput.json]
    python3 bench/doc_throughput.py --runner reference --shapes tiny --units 3 --modes fixed4,grammar   # CPU
    python3 bench/doc_throughput.py --runner cuda --shapes 35b-a3b --moe-cuda-unchecked   # MoE, rows labelled

What runs, per shape (bench/doc_models.py: tiny / tiny-moe for the CPU, bench/qwen35_shapes.py's classes, 35b-a3b
among them; MoE on cuda needs --moe-cuda-unchecked and is labelled so, for the reason doc_models gives):
1. the two ceilings of this run: a 2 GiB device-to-device copy (bytes read + written) and a bf16 8192^3 GEMM
   (bench/cuda_bench.py); on the reference runner, a numpy copy and a float32 matmul of the same kind.
2. a model folder with random bf16 weights (bench/random_model_dir.py) and the real processor's pixel budgets
   (--image-max-pixels, default Qwen3-VL's 16,777,216), loaded by Engine.from_pretrained behind an AsyncEngine,
   as pipeline.engine_client.EngineClient builds it.
3. per output mode, `--units` fresh units (bench/doc_workload.py: A4 PDF pages at the pipeline's dpi with their
   text layer, 12 MP phone photos, 8 s videos) become the pipeline's own requests: builtin schema --schema's
   prompt, pipeline.extraction.build_request, SamplingParams from pipeline.extraction.sampling_params (JSON-schema
   grammar, logprobs). Modes: `fixedN` = those params with max_tokens=N and ignore_eos (the schema left uncapped,
   as for a real checkpoint); the engine still ends a request whose JSON is complete (ignore_eos does not outlast
   the grammar), so a unit may stop before N: `grammar_completed_before_length` counts those, and tokens_per_page
   says what was generated (in the H200 run every 9B invoice reached 256 tokens and none 1,024); `grammar` = the
   params the pipeline sends for a random-weight model (its grammar caps, Settings.grammar_caps for the bundled
   model, and max_tokens 2048), ending where the grammar ends, with --grammar-schema (default `form`: on the tiny
   model, the invoice's amounts ran on in digits to max_tokens). A warm-up of three units (one of each kind) runs
   first. All units are submitted at once from
   --submitters threads (each prepares its images, as the pipeline's job threads do); the clock runs from the
   first submit to the last final output.
4. what is reported per (shape, mode): pages/s (units/s: a PDF page, a photo or a whole video each), generated
   and prompt tok/s, tokens per page, TTFT and latency p50/p95, fraction_of_limit = t_limit / wall
   (bench/limit_model.py, over the steps this run scheduled), GPU busy (NVML utilisation sampled every 50 ms
   over the run where NVML answers, else the CUDA-event spans of the steps / wall), peak device memory, the
   time split from the per-step profile (bench/step_profile.py), and for `grammar` how many answers validate
   against the schema (pipeline.extraction.interpret_reply).
Any request that errors, or a fixed-length request that ends short of N for a reason other than the grammar
completing, fails the run (DocBenchFailed); what was measured before stays in the JSON.
`--quantize fp8` (issue 15): the engine loads with quantize="fp8" (from the folder: the Linears become 128x128-block
FP8 at load; in memory on cuda: bench/fp8_model_bench.random_fp8_weights), and every row says `quantize`.
fraction_of_limit still counts bf16 weight bytes and the bf16 GEMM ceiling (row `limit_basis`), so for FP8 it is
not a fraction of the FP8 limit; compare pages/s with the BF16 row of the same command.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from doc_models import QWEN_IMAGE_MAX_PIXELS, SHAPES, build_engine, check_shapes, model_cost, row_labels, write_model
from doc_workload import Unit, make_units, unit_request
from limit_model import ModelCost, limit_seconds
from step_profile import StepProfile
from stream_requests import percentiles


class DocBenchFailed(RuntimeError):
    """A request did not finish as the mode requires."""


# ------------------------------------------------------------------------------------------------ ceilings

def measure_ceilings(runner: str) -> dict[str, Any]:
    """HBM copy rate (bytes read + written per second) and GEMM rate of this machine, measured now."""
    if runner == "cuda":
        from cuda_bench import bench_copy, bench_gemm

        from gpu_engine.cuda.context import GpuContext

        ctx = GpuContext(6 << 30)
        try:
            rng = np.random.default_rng(0)
            copy = bench_copy(ctx, rng, 2 << 30)
            gemm = bench_gemm(ctx, rng, 8192, 8192, 8192)
            name = ctx.device.info.name
        finally:
            ctx.close()
        return {"device": name, "hbm_bytes_per_s": copy["memcpy_GBps"] * 1e9, "gemm_flops_per_s": gemm["TFLOPs"] * 1e12,
                "copy": copy, "gemm": gemm}
    import platform

    src = np.random.default_rng(0).standard_normal(32 << 20).astype(np.float32)  # 128 MiB
    dst = np.empty_like(src)
    t = min(_seconds(lambda: np.copyto(dst, src)) for _ in range(3))
    a = np.random.default_rng(1).standard_normal((1024, 1024)).astype(np.float32)
    g = min(_seconds(lambda: a @ a) for _ in range(3))
    return {"device": f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)",
            "hbm_bytes_per_s": 2 * src.nbytes / t, "gemm_flops_per_s": 2 * 1024 ** 3 / g}


def _seconds(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# ------------------------------------------------------------------------------------------------ one mode

def mode_params(mode: str, spec: Any, folder: Path) -> tuple[Any, Any, int | None]:
    """(pipeline Settings, SamplingParams, fixed length or None) of an output mode."""
    from pipeline.extraction import sampling_params
    from pipeline.settings import BUNDLED_MAX_ARRAY_ITEMS, BUNDLED_MAX_STRING_LENGTH, Settings

    if mode == "grammar":
        settings = Settings(model_dir=folder, grammar_max_string_length=BUNDLED_MAX_STRING_LENGTH,
                            grammar_max_array_items=BUNDLED_MAX_ARRAY_ITEMS)
        return settings, sampling_params(spec.json_schema, settings), None
    if mode.startswith("fixed") and mode[5:].isdigit() and int(mode[5:]) > 0:
        n = int(mode[5:])
        settings = Settings(model_dir=folder)
        params = dataclasses.replace(sampling_params(spec.json_schema, settings), max_tokens=n, ignore_eos=True)
        return settings, params, n
    raise SystemExit(f"unknown mode {mode!r}: use fixedN (e.g. fixed256) or grammar")


@dataclasses.dataclass
class Outcome:
    unit: Unit
    submitted: float = 0.0
    first_token: float | None = None
    finished: float | None = None
    output: Any = None  # the final RequestOutput
    error: str | None = None


def drive(front: Any, units: list[Unit], requests: list[Any], submitters: int) -> tuple[list[Outcome], float]:
    """Submit every request at once (from `submitters` threads) and wait for all; returns outcomes and wall time
    from the first submit to the last final output."""
    outcomes = [Outcome(u) for u in units]
    done = threading.Event()
    left = [len(units)]
    lock = threading.Lock()

    def listener(o: Outcome) -> Any:
        def listen(item: Any) -> None:  # on the engine's loop thread
            now = time.perf_counter()
            if isinstance(item, BaseException):
                o.error, o.finished = f"{type(item).__name__}: {item}", now
            else:
                if item.token_ids and o.first_token is None:
                    o.first_token = now
                if not item.finished:
                    return
                o.finished, o.output = now, item
            with lock:
                left[0] -= 1
                if left[0] == 0:
                    done.set()
        return listen

    def submit(i: int) -> None:
        outcomes[i].submitted = time.perf_counter()
        front.submit(requests[i].messages, requests[i].params, listener=listener(outcomes[i]))

    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=submitters) as pool:
        list(pool.map(submit, range(len(units))))
    if not done.wait(3600):
        raise DocBenchFailed(f"{left[0]} of {len(units)} requests did not finish within an hour")
    return outcomes, max(o.finished for o in outcomes if o.finished is not None) - start


def check_outcomes(outcomes: list[Outcome], fixed: int | None) -> dict[str, Any]:
    """Problems fail the run; grammar completions before a fixed length are counted."""
    problems, early = [], 0
    for o in outcomes:
        out = o.output
        if o.error or out is None or out.finish_reason == "error" or out.finish_reason == "abort":
            problems.append(f"unit {o.unit.index} ({o.unit.kind}): {o.error or (out.error if out else 'no output')}")
        elif fixed is not None and out.completion_tokens != fixed:
            if out.finish_reason == "stop":
                early += 1  # the grammar completed the JSON before N tokens
            else:
                problems.append(f"unit {o.unit.index}: {out.completion_tokens}/{fixed} tokens, {out.finish_reason}")
        if out is not None and out.logprobs is not None and not all(np.isfinite(lp.logprob) for lp in out.logprobs):
            problems.append(f"unit {o.unit.index}: non-finite logprobs")
    if problems:
        raise DocBenchFailed("; ".join(problems[:8]))
    return {"grammar_completed_before_length": early}


def validate(outcomes: list[Outcome], json_schema: dict[str, Any], max_tokens: int) -> dict[str, Any]:
    """The pipeline's own reading of each answer (parse, jsonschema, per-field confidence from logprobs)."""
    from pipeline.engine_client import EngineReply
    from pipeline.extraction import interpret_reply

    ok, reasons = 0, {}
    for o in outcomes:
        out = o.output
        lps = out.logprobs or []
        reply = EngineReply(text=out.text, finish_reason=out.finish_reason, error=out.error,
                            token_texts=[lp.text for lp in lps], token_logprobs=[float(lp.logprob) for lp in lps],
                            prompt_tokens=out.prompt_tokens, completion_tokens=out.completion_tokens)
        result = interpret_reply(reply, json_schema, max_tokens)
        ok += result.ok
        if not result.ok:
            key = (result.error or "")[:80]
            reasons[key] = reasons.get(key, 0) + 1
    return {"schema_valid": ok, "schema_invalid_reasons": reasons}


class NvmlSampler:
    """GPU utilisation (% of time a kernel ran, as nvidia-smi reports it) and memory used, every `period_s`."""

    def __init__(self, period_s: float = 0.05) -> None:
        self.samples: list[tuple[float, float, float]] = []  # (perf_counter, util %, memory used bytes)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml, self._handle = pynvml, pynvml.nvmlDeviceGetHandleByIndex(0)
        except Exception:  # no NVML here (CPU, or a machine without the library)
            self._nvml = self._handle = None
        self.period_s = period_s

    @property
    def available(self) -> bool:
        return self._handle is not None

    def __enter__(self) -> NvmlSampler:
        if self.available:
            self._thread = threading.Thread(target=self._run, daemon=True, name="nvml-sampler")
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        nv, h = self._nvml, self._handle
        while not self._stop.wait(self.period_s):
            util = nv.nvmlDeviceGetUtilizationRates(h).gpu
            mem = nv.nvmlDeviceGetMemoryInfo(h).used
            self.samples.append((time.perf_counter(), float(util), float(mem)))

    def summary(self, t0: float, t1: float) -> dict[str, float | None]:
        inside = [s for s in self.samples if t0 <= s[0] <= t1]
        if not inside:
            return {"nvml_util_mean": None, "nvml_samples": 0, "nvml_memory_used_max_bytes": None}
        return {"nvml_util_mean": float(np.mean([s[1] for s in inside])) / 100, "nvml_samples": len(inside),
                "nvml_memory_used_max_bytes": max(s[2] for s in inside)}


def run_mode(front: Any, engine: Any, profile: StepProfile, cost: ModelCost, ceilings: dict[str, Any],
             units: list[Unit], spec: Any, settings: Any, params: Any, fixed: int | None,
             submitters: int) -> dict[str, Any]:
    requests = [unit_request(u, spec.prompt, params, settings) for u in units]
    stats0 = engine.stats()
    held0 = engine.scheduler.num_held_steps
    profile.reset()
    with NvmlSampler() as nvml:
        t0 = time.perf_counter()
        outcomes, wall = drive(front, units, requests, submitters)
        t1 = t0 + wall
    profile.resolve()
    row: dict[str, Any] = check_outcomes(outcomes, fixed)
    if fixed is None:
        row.update(validate(outcomes, spec.json_schema, params.max_tokens))
    row.update(report(outcomes, wall, profile, cost, ceilings))
    row.update(nvml.summary(t0, t1))
    device_s = [r.device_s for r in profile.steps if r.device_s is not None]
    row["event_busy_fraction"] = sum(device_s) / wall if device_s else None
    if row["nvml_util_mean"] is not None:
        row["gpu_busy_fraction"], row["gpu_busy_source"] = row["nvml_util_mean"], "nvml utilization.gpu, 50 ms samples"
    elif row["event_busy_fraction"] is not None:
        row["gpu_busy_fraction"], row["gpu_busy_source"] = row["event_busy_fraction"], "cuda events around each step"
    else:
        row["gpu_busy_fraction"] = row["time_split"]["runner_s"] / wall
        row["gpu_busy_source"] = "reference runner: forward + encode time / wall"
    stats1 = engine.stats()
    row["engine_counters"] = {k: stats1[k] - stats0.get(k, 0) for k in (
        "steps", "prompt_tokens_computed", "decode_tokens", "forced_tokens", "sampled_tokens", "preemptions",
        "chunked_output_tokens") if isinstance(stats1.get(k), (int, float))}
    row["peak_step_tokens"] = stats1.get("peak_step_tokens")
    row["held_prompt_steps"] = engine.scheduler.num_held_steps - held0
    row["engine_state_slots"] = engine.config.state_slots
    row["min_prefill_tokens"] = engine.config.min_prefill_tokens
    row["max_prefill_hold_steps"] = engine.config.max_prefill_hold_steps
    row["enable_jump_forward"] = engine.config.enable_jump_forward
    runner = engine.runner
    if hasattr(runner, "graph_memory_cap"):  # the CUDA runner's decode graphs at the end of the run
        # bytes: the largest graph's buffers (graphs share memory since the bucketed decode graphs);
        # steps: what the runner's steps ran as since its cache was allocated (warm-up included)
        counts = getattr(runner, "decode_counts", None)
        row["cuda_graphs"] = {"captured": len(getattr(runner, "_graphs", {})),
                              "bytes": getattr(runner, "_graph_bytes", 0), "cap_bytes": runner.graph_memory_cap,
                              "steps": vars(counts) if counts is not None else None}
    for key in ("cache_bytes", "max_model_len", "encoder_cache_budget_bytes"):
        row[f"engine_{key}"] = stats1.get(key)
    arena = getattr(getattr(engine.runner, "ctx", None), "arena", None)
    if arena is not None:
        row["peak_device_memory_bytes"] = int(arena.peak)
        row["device_memory_budget_bytes"] = int(arena.capacity)
        row["peak_device_memory_source"] = "cuda arena high-water mark (one start-up allocation of the budget)"
    else:
        row["peak_device_memory_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        row["peak_device_memory_source"] = "reference runner: process max RSS"
    return row


def report(outcomes: list[Outcome], wall: float, profile: StepProfile, cost: ModelCost,
           ceilings: dict[str, Any]) -> dict[str, Any]:
    """Throughput, latency, the limit model and the time split of one mode's run (pure arithmetic)."""
    n = len(outcomes)
    gen = sum(o.output.completion_tokens for o in outcomes)
    prompt = sum(o.output.prompt_tokens for o in outcomes)
    limit = limit_seconds(cost, (r.shape for r in profile.steps), gemm_flops_per_s=ceilings["gemm_flops_per_s"],
                          hbm_bytes_per_s=ceilings["hbm_bytes_per_s"])
    row: dict[str, Any] = {
        "units": n, "units_by_kind": {k: sum(o.unit.kind == k for o in outcomes) for k in ("pdf", "photo", "video")},
        "wall_s": wall, "pages_per_s": n / wall, "generated_tokens": gen, "prompt_tokens": prompt,
        "generated_tok_per_s": gen / wall, "prompt_tok_per_s": prompt / wall,
        "tokens_per_page": gen / n, "prompt_tokens_per_page": prompt / n,
        "t_limit_s": limit["t_limit_s"], "fraction_of_limit": limit["t_limit_s"] / wall, "limit": limit,
    }
    for label, group in (("all", outcomes), *((k, [o for o in outcomes if o.unit.kind == k])
                                              for k in ("pdf", "photo", "video"))):
        if not group:
            continue
        ttft = percentiles([o.first_token - o.submitted for o in group if o.first_token is not None])
        lat = percentiles([o.finished - o.submitted for o in group])
        row[f"latency_{label}"] = {"ttft_p50_s": ttft["p50"], "ttft_p95_s": ttft["p95"],
                                   "latency_p50_s": lat["p50"], "latency_p95_s": lat["p95"]}
    steps = profile.steps
    split = {
        "steps": len(steps),
        "vision_encode_s": sum(r.encode_s for r in steps),
        "prefill_forward_s": sum(r.forward_s for r in steps if r.has_prefill),
        "decode_forward_s": sum(r.forward_s for r in steps if not r.has_prefill),
        "grammar_mask_s": sum(r.mask_s for r in steps),
        "host_scheduling_s": sum(r.host_s for r in steps),
        "outside_steps_s": max(0.0, wall - sum(r.wall_s for r in steps)),
        "image_preprocessing_s": profile.prepare_s,  # on the submitting threads, overlapping the steps
        "image_preprocessing_count": profile.prepare_count,
    }
    split["runner_s"] = split["vision_encode_s"] + split["prefill_forward_s"] + split["decode_forward_s"]
    device = [r.device_s for r in steps if r.device_s is not None]
    if device:
        split["device_event_s"] = sum(device)
        split["device_event_decode_s"] = sum(r.device_s for r in steps if r.device_s is not None and not r.has_prefill)
    decode_steps = [r for r in steps if not r.has_prefill]
    if decode_steps:
        split["decode_step_mean_ms"] = 1e3 * split["decode_forward_s"] / len(decode_steps)
        split["decode_batch_mean"] = float(np.mean([len(r.shape.decode_contexts) for r in decode_steps]))
    row["time_split"] = split
    return row


# ------------------------------------------------------------------------------------------------ the run

def run_shape(shape: str, args: argparse.Namespace, ceilings: dict[str, Any], info: dict[str, Any],
              rows: list[dict[str, Any]], save: Any = lambda: None) -> None:
    """Every mode of one shape, appending a row per mode (`save()` after each, so a run cut short keeps them)."""
    from gpu_engine.async_engine import AsyncEngine
    from pipeline.builtin_schemas import BUILTIN_SCHEMAS

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="docpipe-doc-"))
    t0 = time.perf_counter()
    folder = write_model(shape, workdir / f"random-{shape}", args.seed, args.image_max_pixels,
                         weights=args.runner != "cuda" or args.load_weights, expert_layout=args.expert_layout)
    write_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    engine = build_engine(folder, args.runner, args)
    load_s = time.perf_counter() - t0
    print(f"{shape}: model folder in {write_s:.1f} s, engine built in {load_s:.1f} s", flush=True)
    cost = model_cost(engine)
    profile = StepProfile.attach(engine)
    front = AsyncEngine(engine)
    try:
        for m, mode in enumerate(args.modes):
            spec = BUILTIN_SCHEMAS[args.grammar_schema if mode == "grammar" else args.schema]
            settings, params, fixed = mode_params(mode, spec, folder)
            warm = make_units(3, args.seed + 1000 + m, settings, mix=(1, 1, 1), **_sizes(args))
            warm_out, warm_wall = drive(front, warm, [unit_request(u, spec.prompt, params, settings) for u in warm],
                                        args.submitters)
            check_outcomes(warm_out, fixed)
            units = make_units(args.units, args.seed + m, settings, mix=args.mix, **_sizes(args))
            row = {"shape": shape, "output_mode": mode, "runner": args.runner, "quantize": args.quantize,
                   "limit_basis": "bf16 weight bytes, bf16 GEMM ceiling", "schema": spec.name,
                   "max_tokens": params.max_tokens, "max_num_seqs": args.max_num_seqs,
                   "max_batched_tokens": args.max_batched_tokens, "write_model_s": write_s, "load_s": load_s,
                   "warmup_wall_s": warm_wall, **info, "device": ceilings["device"],
                   "hbm_bytes_per_s": ceilings["hbm_bytes_per_s"], "gemm_flops_per_s": ceilings["gemm_flops_per_s"],
                   "model_weight_bytes": cost.weight_bytes, **row_labels(shape, args)}
            rows.append(row)
            row.update(run_mode(front, engine, profile, cost, ceilings, units, spec, settings, params, fixed,
                                args.submitters))
            save()
            print(_line(row), flush=True)
    finally:
        front.shutdown()
        profile.detach()
        close = getattr(engine.runner, "close", None)
        if close is not None:
            close()
        if not args.keep_model:
            import shutil

            shutil.rmtree(folder, ignore_errors=True)


def _sizes(args: argparse.Namespace) -> dict[str, Any]:
    return {"photo_size": tuple(args.photo_size), "video_seconds": args.video_seconds,
            "video_size": tuple(args.video_size)}


def _line(r: dict[str, Any]) -> str:
    s, lat = r["time_split"], r["latency_all"]
    return (f"{r['shape']:>5} {r['output_mode']:<10} {r['units']:>4} units {r['wall_s']:7.2f} s  "
            f"{r['pages_per_s']:7.2f} pages/s  {r['generated_tok_per_s']:8.0f} gen tok/s  "
            f"{r['prompt_tok_per_s']:8.0f} prompt tok/s  {r['tokens_per_page']:6.0f} tok/page "
            f"({r['grammar_completed_before_length']} ended by the grammar)  "
            f"limit {r['fraction_of_limit']:.2f}  busy {r['gpu_busy_fraction']:.2f}  "
            f"TTFT p50/p95 {lat['ttft_p50_s']:.2f}/{lat['ttft_p95_s']:.2f} s  "
            f"latency p50/p95 {lat['latency_p50_s']:.2f}/{lat['latency_p95_s']:.2f} s  "
            f"[vision {s['vision_encode_s']:.1f} prefill {s['prefill_forward_s']:.1f} "
            f"decode {s['decode_forward_s']:.1f} "
            f"mask {s['grammar_mask_s']:.1f} host {s['host_scheduling_s']:.1f} outside {s['outside_steps_s']:.1f} "
            f"preprocess {s['image_preprocessing_s']:.1f} s]")


def table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'shape':>5} {'mode':<10} {'units':>5} {'wall s':>7} {'pages/s':>8} {'gen tok/s':>9} {'tok/page':>8} "
            f"{'limit s':>7} {'of limit':>8} {'GPU busy':>8} {'TTFT p50':>8} {'lat p95':>8}")
    lines = [head]
    for r in rows:
        if "wall_s" not in r:
            lines.append(f"{r['shape']:>5} {r['output_mode']:<10} (failed: {r.get('error', '?')[:80]})")
            continue
        lat = r["latency_all"]
        lines.append(f"{r['shape']:>5} {r['output_mode']:<10} {r['units']:>5} {r['wall_s']:>7.2f} "
                     f"{r['pages_per_s']:>8.2f} {r['generated_tok_per_s']:>9.0f} {r['tokens_per_page']:>8.0f} "
                     f"{r['t_limit_s']:>7.2f} {r['fraction_of_limit']:>8.2f} {r['gpu_busy_fraction']:>8.2f} "
                     f"{lat['ttft_p50_s']:>8.2f} {lat['latency_p95_s']:>8.2f}")
    return "\n".join(lines)


def preflight(args: argparse.Namespace) -> None:
    """Everything the modes need from pipeline and vision, tried before any lease time goes to the model."""
    from pipeline.builtin_schemas import BUILTIN_SCHEMAS
    from pipeline.engine_client import EngineReply  # noqa: F401 - imported to prove it imports
    from pipeline.extraction import interpret_reply  # noqa: F401 - imported to prove it imports

    for mode in args.modes:
        spec = BUILTIN_SCHEMAS[args.grammar_schema if mode == "grammar" else args.schema]
        settings, params, _ = mode_params(mode, spec, Path(tempfile.gettempdir()))
        unit_request(make_units(1, 0, settings, mix=(1, 0, 0))[0], spec.prompt, params, settings)


def git_commit() -> str:
    env = os.environ.get("DOCPIPE_BENCH_COMMIT")
    if env:
        return env
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).resolve().parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json")
    parser.add_argument("--runner", default="cuda", choices=("cuda", "reference"))
    parser.add_argument("--shapes", default="9b", help="comma-separated subset of " + ",".join(SHAPES))
    parser.add_argument("--modes", default="fixed256,grammar", help="comma-separated: fixedN and/or grammar")
    parser.add_argument("--units", type=int, default=128, help="units (pages, photos, videos) per mode")
    parser.add_argument("--mix", default="14,1,1", help="PDF pages, photos, videos per period")
    parser.add_argument("--schema", default="invoice", help="builtin schema of the fixedN modes")
    parser.add_argument("--grammar-schema", default="form", help="builtin schema of the grammar mode")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--submitters", type=int, default=8)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-batched-tokens", type=int, default=8192)
    parser.add_argument("--min-prefill-tokens", type=int, default=0,
                        help="EngineConfig.min_prefill_tokens: hold prompt chunks until this many are ready")
    parser.add_argument("--max-prefill-hold-steps", type=int, default=4)
    parser.add_argument("--no-jump-forward", action="store_true",
                        help="EngineConfig.enable_jump_forward=False: grammar-forced tokens one per decode step (a "
                             "step with a forced run is not a plain decode step: no CUDA graph)")
    parser.add_argument("--kv-cache-gib", type=float, default=24.0, help="0: the engine's default (runner-sized)")
    parser.add_argument("--encoder-cache-gib", type=float, default=2.0, help="0: the engine's and runner's defaults")
    parser.add_argument("--image-max-pixels", type=int, default=QWEN_IMAGE_MAX_PIXELS)
    parser.add_argument("--photo-size", type=int, nargs=2, default=(4032, 3024))
    parser.add_argument("--video-size", type=int, nargs=2, default=(960, 540))
    parser.add_argument("--video-seconds", type=float, default=8.0)
    parser.add_argument("--workdir", help="where the model folders go (default: a new temporary folder)")
    parser.add_argument("--keep-model", action="store_true")
    parser.add_argument("--quantize", default="none", choices=("none", "fp8"),
                        help="fp8: the engine loads with quantize='fp8' (issue 15); written in every row")
    parser.add_argument("--load-weights", action="store_true",
                        help="cuda: write the weights into the folder and load them with Engine.from_pretrained")
    parser.add_argument("--expert-layout", default="fused", choices=("fused", "per_expert"),
                        help="MoE folders: routed experts fused (BF16 release) or one tensor per expert (FP8 releases)")
    parser.add_argument("--moe-cuda-unchecked", action="store_true",
                        help="bench only: MoE shapes on cuda through a CudaRunner built directly, which "
                             "gpu_engine.load refuses (bench/doc_models.py says why); rows say moe_cuda_unchecked")
    args = parser.parse_args(argv)
    args.shapes = [s for s in args.shapes.split(",") if s]
    args.modes = [m for m in args.modes.split(",") if m]
    args.mix = tuple(int(x) for x in args.mix.split(","))
    if args.units < 1 or len(args.mix) != 3 or not args.shapes or not args.modes:
        raise SystemExit("need --units >= 1, --mix of three counts, and at least one shape and mode")
    check_shapes(args)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    info = {"date_utc": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"), "git_commit": git_commit(),
            "command": " ".join(["python3", *sys.argv])}
    rows: list[dict[str, Any]] = []
    result: dict[str, Any] = {"info": info, "rows": rows}

    def save() -> None:
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1, default=str))

    try:
        preflight(args)
        ceilings = measure_ceilings(args.runner)
        result["ceilings"] = ceilings
        print(f"ceilings on {ceilings['device']}: copy {ceilings['hbm_bytes_per_s'] / 1e9:.0f} GB/s, "
              f"GEMM {ceilings['gemm_flops_per_s'] / 1e12:.3g} TFLOP/s", flush=True)
        for shape in args.shapes:
            try:
                run_shape(shape, args, ceilings, info, rows, save)
            except DocBenchFailed as exc:
                rows.append({"shape": shape, "output_mode": "?", "error": str(exc)})
                raise
    finally:
        save()
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Pages per second per GPU: the document workload at saturation, measured against the card's limit (issue 14).

    python3 bench/doc_throughput.py --runner cuda --shapes 9b,27b --modes fixed256,fixed1024,grammar \
        [--units 128] [--max-num-seqs 64] [--json bench/results/doc_throughput.json]
    python3 bench/doc_throughput.py --runner reference --shapes tiny --units 3 --modes fixed4,grammar   # CPU
    python3 bench/doc_throughput.py --runner cuda --shapes 35b-a3b   # MoE (BF16)

What runs, per shape (bench/doc_models.py: tiny / tiny-moe for the CPU, bench/qwen35_shapes.py's classes, 35b-a3b
among them):
1. the two ceilings of this run: a 2 GiB device-to-device copy (bytes read + written) and a bf16 8192^3 GEMM
   (bench/cuda_bench.py); on the reference runner, a numpy copy and a float32 matmul of the same kind.
2. a model folder with random bf16 weights (bench/random_model_dir.py) and the real processor's pixel budgets
   (--image-max-pixels, default Qwen3-VL's 16,777,216), loaded by Engine.from_pretrained behind an AsyncEngine,
   as pipeline.engine_client.EngineClient builds it.
3. per output mode, `--units` fresh units (bench/doc_workload.py: A4 PDF pages at the pipeline's dpi with their
   text layer, 12 MP phone photos, 8 s videos) become the pipeline's own requests: the mode's schema's prompt
   (bench/doc_schemas.py: a builtin, or the bench-only olmOCR-style `page_text`), pipeline.extraction.build_request,
   SamplingParams from pipeline.extraction.sampling_params (JSON-schema grammar, logprobs). Modes: `fixedN` = those
   params with max_tokens=N and ignore_eos (the schema left uncapped, as for a real checkpoint). ignore_eos does not
   outlast the grammar (the engine ends a request whose JSON is complete), so --schema auto sends `invoice` up to
   fixed256 (every 9B invoice reached 256 tokens on the H200; its JSON closed at ~484 a page) and `page_text` past
   it, whose natural_text has a minLength that keeps the JSON open for N tokens (doc_schemas' docstring):
   fixed1024 is a 1,024-token page transcription, olmOCR's kind of output. A unit that still stops before N is
   counted in `grammar_completed_before_length`, and tokens_per_page says what was generated. `grammar` = the
   params the pipeline sends for a random-weight model (its grammar caps, Settings.grammar_caps for the bundled
   model, and max_tokens 2048), ending where the grammar ends, with --grammar-schema (default `form`: on the tiny
   model, the invoice's amounts ran on in digits to max_tokens). A warm-up of three units (one of each kind) runs
   first. All units are submitted at once from --submitters threads (each prepares its images, as the pipeline's
   job threads do, in --prep-processes child processes by default as the product's cuda runner does:
   pipeline.page_prep.PagePrepPool); the clock runs from the first submit to the last final output.
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

This file is the run (command line, shapes, modes, the JSON); its parts, one job each: doc_models (the model),
doc_workload (units, requests), doc_schemas (each mode's schema), doc_ceilings (1.), doc_outcomes (submit all,
wait, check, validate), doc_report (throughput, latency, limit, time split), gpu_busy (NVML sampler, busy source),
doc_engine_fields (engine counters, configuration, CUDA graphs, peak memory), doc_table (the printed lines).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_commit import git_commit
from doc_ceilings import measure_ceilings
from doc_engine_fields import EngineMark, engine_fields
from doc_models import QWEN_IMAGE_MAX_PIXELS, SHAPES, build_engine, check_shapes, model_cost, row_labels, write_model
from doc_outcomes import DocBenchFailed, check_outcomes, drive, validate
from doc_outcomes import Outcome as Outcome  # re-exported: the tests build outcomes as doc_throughput.Outcome
from doc_report import report
from doc_schemas import mode_schema
from doc_table import mode_line, table
from doc_workload import Unit, make_units, unit_request
from gpu_busy import NvmlSampler, busy_fields
from limit_model import ModelCost
from step_profile import TIMELINE_COLUMNS, StepProfile

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


def run_mode(front: Any, engine: Any, profile: StepProfile, cost: ModelCost, ceilings: dict[str, Any],
             units: list[Unit], spec: Any, settings: Any, params: Any, fixed: int | None,
             submitters: int, prepare: Callable[[Any], Any] | None) -> dict[str, Any]:
    """One mode's timed run: every unit submitted at once, then its row (outcomes, report, GPU busy, engine)."""
    requests = [unit_request(u, spec.prompt, params, settings) for u in units]
    mark = EngineMark.take(engine)
    profile.reset()
    with NvmlSampler() as nvml:
        t0 = time.perf_counter()
        outcomes, wall = drive(front, units, requests, submitters, prepare)
        t1 = t0 + wall
    profile.resolve()
    row: dict[str, Any] = check_outcomes(outcomes, fixed)
    if fixed is None:
        row.update(validate(outcomes, spec.json_schema, params.max_tokens))
    row.update(report(outcomes, wall, profile, cost, ceilings))
    row.update(nvml.summary(t0, t1))
    row.update(busy_fields(row["nvml_util_mean"], [r.device_s for r in profile.steps if r.device_s is not None],
                           row["time_split"]["runner_s"], wall))
    row.update(engine_fields(engine, mark))
    return row


# ------------------------------------------------------------------------------------------------ the run

def run_shape(shape: str, args: argparse.Namespace, ceilings: dict[str, Any], info: dict[str, Any],
              rows: list[dict[str, Any]], save: Any = lambda: None) -> None:
    """Every mode of one shape, appending a row per mode (`save()` after each, so a run cut short keeps them)."""
    from gpu_engine.async_engine import AsyncEngine

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
    profile = StepProfile.attach(engine, host_profile=args.host_profile)
    front = AsyncEngine(engine)
    pool = None
    try:
        pool = start_prep_pool(folder, args)
        prepare = None if pool is None else profile.timed_prepare(client_prepare(front, folder, pool))
        for m, mode in enumerate(args.modes):
            spec = mode_schema(mode, args.schema, args.grammar_schema)
            settings, params, fixed = mode_params(mode, spec, folder)
            if args.speculative != "product":
                params = dataclasses.replace(params, speculative=args.speculative)
            warm = make_units(3, args.seed + 1000 + m, settings, mix=(1, 1, 1), **_sizes(args))
            warm_out, warm_wall = drive(front, warm, [unit_request(u, spec.prompt, params, settings) for u in warm],
                                        args.submitters, prepare)
            check_outcomes(warm_out, fixed)
            units = make_units(args.units, args.seed + m, settings, mix=args.mix, **_sizes(args))
            row = {"shape": shape, "output_mode": mode, "runner": args.runner, "quantize": args.quantize,
                   "limit_basis": "bf16 weight bytes, bf16 GEMM ceiling", "schema": spec.name,
                   "max_tokens": params.max_tokens, "speculative": params.speculative,
                   "lookahead": engine.lookahead.enabled,
                   "max_num_seqs": args.max_num_seqs, "prep_processes": args.prep_processes,
                   "max_batched_tokens": args.max_batched_tokens, "write_model_s": write_s, "load_s": load_s,
                   "warmup_wall_s": warm_wall, **info, "device": ceilings["device"],
                   "hbm_bytes_per_s": ceilings["hbm_bytes_per_s"], "gemm_flops_per_s": ceilings["gemm_flops_per_s"],
                   "model_weight_bytes": cost.weight_bytes, "photo_size": list(args.photo_size),
                   "photo_max_pixels": settings.max_photo_pixels,  # photos reach the model at most this big
                   **row_labels(shape, args)}
            rows.append(row)
            row.update(run_mode(front, engine, profile, cost, ceilings, units, spec, settings, params, fixed,
                                args.submitters, prepare))
            if args.timeline:
                write_timeline(Path(args.timeline), row, profile)
            save()
            print(mode_line(row), flush=True)
    finally:
        if pool is not None:
            pool.close()
        front.shutdown()
        profile.detach()
        close = getattr(engine.runner, "close", None)
        if close is not None:
            close()
        if not args.keep_model:
            import shutil

            shutil.rmtree(folder, ignore_errors=True)


def start_prep_pool(folder: Path, args: argparse.Namespace) -> Any:
    """The product's page-preparation processes for this model (None with --prep-processes 0)."""
    if not args.prep_processes:
        return None
    from pipeline.page_prep import PagePrepPool
    from pipeline.settings import Settings

    return PagePrepPool(folder, args.prep_processes, timeout_s=Settings().request_timeout_s)


def client_prepare(front: Any, folder: Path, pool: Any) -> Callable[[Any], Any]:
    """What the product's EngineClient does with a request's messages before it submits them (the pool's
    ProcessedPrompt; the PNGs decoded in-process when /dev/shm is full). The client is not closed: run_shape
    shuts the engine and the pool down itself."""
    from pipeline.engine_client import EngineClient
    from pipeline.settings import Settings

    client = EngineClient(front, model_dir=folder, fingerprint="doc_throughput", timeout_s=Settings().request_timeout_s,
                          preparer=pool)
    return client.prepare


def write_timeline(path: Path, row: dict[str, Any], profile: StepProfile) -> None:
    """Append one mode's step timeline (and the engine steps' cProfile with --host-profile) to `path`."""
    runs = json.loads(path.read_text()) if path.exists() else []
    t0 = profile.steps[0].started_s if profile.steps else 0.0
    runs.append({"shape": row["shape"], "output_mode": row["output_mode"], "git_commit": row.get("git_commit"),
                 "columns": TIMELINE_COLUMNS,
                 "steps": profile.timeline(t0), "host_profile_top": profile.host_profile_top()})
    path.write_text(json.dumps(runs))


def _sizes(args: argparse.Namespace) -> dict[str, Any]:
    return {"photo_size": tuple(args.photo_size), "video_seconds": args.video_seconds,
            "video_size": tuple(args.video_size)}


def preflight(args: argparse.Namespace) -> None:
    """Everything the modes need from pipeline and vision, tried before any lease time goes to the model."""
    from pipeline.engine_client import EngineReply  # noqa: F401 - imported to prove it imports
    from pipeline.extraction import interpret_reply  # noqa: F401 - imported to prove it imports
    from pipeline.schemas import validate_schema_definition

    for mode in args.modes:
        spec = mode_schema(mode, args.schema, args.grammar_schema)
        validate_schema_definition(spec.name, spec.json_schema, spec.merge_rules)  # one a user could register
        settings, params, _ = mode_params(mode, spec, Path(tempfile.gettempdir()))
        unit_request(make_units(1, 0, settings, mix=(1, 0, 0))[0], spec.prompt, params, settings)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json")
    parser.add_argument("--runner", default="cuda", choices=("cuda", "reference"))
    parser.add_argument("--shapes", default="9b", help="comma-separated subset of " + ",".join(SHAPES))
    parser.add_argument("--modes", default="fixed256,grammar", help="comma-separated: fixedN and/or grammar")
    parser.add_argument("--units", type=int, default=128, help="units (pages, photos, videos) per mode")
    parser.add_argument("--mix", default="14,1,1", help="PDF pages, photos, videos per period")
    parser.add_argument("--schema", default="auto",
                        help="schema of the fixedN modes: a builtin or page_text; auto = invoice up to fixed256, "
                             "page_text above (bench/doc_schemas.py)")
    parser.add_argument("--grammar-schema", default="form", help="schema of the grammar mode (as --schema's names)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--submitters", type=int, default=8)
    parser.add_argument("--prep-processes", type=int, default=-1,
                        help="page-preparation child processes (pipeline.page_prep); -1: the product's default for "
                             "--runner (Settings.prep_processes: cuda min(4, CPUs/4), reference 0); 0: the engine's "
                             "processor on the submitting threads")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-batched-tokens", type=int, default=8192)
    parser.add_argument("--min-prefill-tokens", type=int, default=0,
                        help="EngineConfig.min_prefill_tokens: hold prompt chunks until this many are ready")
    parser.add_argument("--max-prefill-hold-steps", type=int, default=4)
    parser.add_argument("--no-jump-forward", action="store_true",
                        help="EngineConfig.enable_jump_forward=False: grammar-forced tokens one per decode step (a "
                             "step with a forced run is not a plain decode step: no CUDA graph)")
    parser.add_argument("--no-lookahead", action="store_true",
                        help="EngineConfig.lookahead=False: every step's tokens are taken in before the next step is "
                             "launched (gpu_engine/lookahead.py); rows say which")
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
    parser.add_argument("--timeline", help="write each mode's per-step timeline (JSON) here")
    parser.add_argument("--host-profile", action="store_true",
                        help="cProfile the engine steps (into --timeline's file); slows the steps: not for timing")
    parser.add_argument("--speculative", choices=("product", "auto", "off", "ngram"), default="product",
                        help="SamplingParams.speculative of every request: 'product' keeps what the pipeline sends "
                             "(its default, auto); rows say which")
    args = parser.parse_args(argv)
    args.shapes = [s for s in args.shapes.split(",") if s]
    args.modes = [m for m in args.modes.split(",") if m]
    args.mix = tuple(int(x) for x in args.mix.split(","))
    if args.units < 1 or len(args.mix) != 3 or not args.shapes or not args.modes:
        raise SystemExit("need --units >= 1, --mix of three counts, and at least one shape and mode")
    if args.prep_processes < 0:
        from pipeline.settings import Settings

        args.prep_processes = Settings(runner=args.runner).prep_processes()
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

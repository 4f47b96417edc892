"""Command line: `python -m gpu_engine generate ...` and `python -m gpu_engine bench ...`.

    python -m gpu_engine generate --image page.png --prompt "Invoice number?" [--json-schema schema.json]
    python -m gpu_engine bench --num-requests 32 --prompt-len 128 --max-tokens 64

--model defaults to the bundled tiny model (random weights: output is gibberish, but valid against a schema).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from .engine_config import EngineConfig
from .errors import EngineError
from .params import SamplingParams


def _model_dir(arg: str | None) -> Path:
    if arg:
        return Path(arg)
    from .bundled import bundled_model_dir

    return bundled_model_dir()


def _engine(args: argparse.Namespace) -> Any:
    from .engine import Engine

    config = EngineConfig(
        max_num_seqs=args.max_num_seqs,
        max_batched_tokens=args.max_batched_tokens,
        kv_cache_bytes=args.kv_cache_mib * 1024**2,
    )
    return Engine.from_pretrained(_model_dir(args.model), runner=args.runner, config=config)


EXIT_CUT = 3  # `generate --json-schema`: the output hit max_tokens before the JSON closed


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="checkpoint folder (default: the bundled tiny model)")
    p.add_argument("--runner", default="reference", choices=["reference", "cuda"])
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-batched-tokens", type=int, default=2048)
    p.add_argument("--kv-cache-mib", type=int, default=256)


def cmd_generate(args: argparse.Namespace) -> int:
    schema = None
    if args.json_schema:
        try:
            schema = json.loads(Path(args.json_schema).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            print(f"error: cannot read the JSON schema {args.json_schema}: {exc}", file=sys.stderr)
            return 2
    content: list[dict[str, Any]] = [{"type": "image", "image": str(Path(f))} for f in args.image]
    if args.frame:  # one clip as image files; the engine decodes no video files (see processor.process_video)
        from .media_io import load_image

        frames = [load_image(str(Path(f)), f"frame {f}").convert("RGB") for f in args.frame]
        content.append({"type": "video", "video": frames, "fps": args.fps})
    content.append({"type": "text", "text": args.prompt})
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed, json_schema=schema,
        logprobs=args.json_output,
    )
    engine = _engine(args)
    from .engine import RequestError

    try:
        rid = engine.add_request([{"role": "user", "content": content}], params)
    except RequestError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    final = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id != rid:
                continue
            if not args.json_output:
                print(out.delta, end="", flush=True)
            if out.finished:
                final = out
    assert final is not None
    if args.json_output:
        print(json.dumps({
            "text": final.text, "token_ids": final.token_ids, "finish_reason": final.finish_reason,
            "error": final.error, "prompt_tokens": final.prompt_tokens,
            "logprobs": [lp.logprob for lp in final.logprobs or []],
            "model_fingerprint": engine.model_fingerprint,
        }))
    else:
        print()
        print(f"[finish_reason={final.finish_reason} prompt_tokens={final.prompt_tokens} "
              f"completion_tokens={final.completion_tokens}]", file=sys.stderr)
    if final.finish_reason == "error":
        print(f"error: {final.error}", file=sys.stderr)
        return 1
    if schema is not None and final.finish_reason == "length":
        # Constrained decoding guarantees valid JSON only for an answer that ends by itself; a cut one is not
        # an answer, so say so and fail rather than print it as if it were.
        print(f"error: the answer was cut at --max-tokens {args.max_tokens} before its JSON was complete, so it "
              f"is not valid for the schema; raise --max-tokens", file=sys.stderr)
        return EXIT_CUT
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    """End-to-end engine throughput on random token prompts (prefill and decode reported separately)."""
    engine = _engine(args)
    rng = np.random.default_rng(args.seed)
    vocab = min(engine.vocab_size, 2000)
    prompts = [rng.integers(0, vocab, size=args.prompt_len).tolist() for _ in range(args.num_requests)]
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, temperature=0.0)
    start = time.perf_counter()
    ids = [engine.add_request(p, params) for p in prompts]
    first: dict[str, float] = {}
    done: dict[str, float] = {}
    steps = 0
    while engine.has_unfinished():
        outs = engine.step()
        steps += 1
        now = time.perf_counter() - start
        for out in outs:
            first.setdefault(out.request_id, now)
            if out.finished:
                done[out.request_id] = now
    wall = time.perf_counter() - start
    st = engine.stats()
    ttft = np.array([first[r] for r in ids])
    lat = np.array([done[r] for r in ids])
    result = {
        "requests": args.num_requests, "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
        "runner": args.runner, "wall_s": wall, "steps": steps,
        "prompt_tokens_per_s": st["prompt_tokens_computed"] / wall,
        "generated_tokens_per_s": st["sampled_tokens"] / wall,
        "ttft_p50_s": float(np.percentile(ttft, 50)), "ttft_p95_s": float(np.percentile(ttft, 95)),
        "latency_p50_s": float(np.percentile(lat, 50)), "latency_p95_s": float(np.percentile(lat, 95)),
        "step_time_mean_s": st["step_time_mean_s"], "preemptions": st["preemptions"],
        "model_fingerprint": engine.model_fingerprint,
    }
    for key, value in result.items():
        print(f"{key:>24}  {value:.4g}" if isinstance(value, float) else f"{key:>24}  {value}")
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpu_engine", description="docpipe inference engine")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="one request: images / videos + prompt -> text (or schema-valid JSON)")
    _add_engine_args(g)
    g.add_argument("--prompt", required=True)
    g.add_argument("--image", action="append", default=[], help="image file (repeatable)")
    g.add_argument("--frame", action="append", default=[],
                   help="one frame of a video clip, an image file (repeatable, in order); sampled at --fps")
    g.add_argument("--fps", type=float, default=2.0, help="frame rate of the --frame images")
    g.add_argument("--json-schema", help="file with a JSON schema the output must satisfy")
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--json", dest="json_output", action="store_true", help="print one JSON object with the result")
    g.set_defaults(func=cmd_generate)
    b = sub.add_parser("bench", help="throughput on random prompts")
    _add_engine_args(b)
    b.add_argument("--num-requests", type=int, default=16)
    b.add_argument("--prompt-len", type=int, default=64)
    b.add_argument("--max-tokens", type=int, default=32)
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--output", help="write the results as JSON here")
    b.set_defaults(func=cmd_bench)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as exc:  # bad flag values (SamplingParams / EngineConfig) -> a message, not a traceback
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except EngineError as exc:
        from .config import ModelLoadError
        from .model import RunnerUnavailableError

        if not isinstance(exc, (ModelLoadError, RunnerUnavailableError)):
            raise
        print(f"error: {exc}", file=sys.stderr)  # a model folder or runner the person must change: no traceback
        return 2


if __name__ == "__main__":
    sys.exit(main())

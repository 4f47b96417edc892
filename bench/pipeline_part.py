"""One part of bench/pipeline_throughput.py, in a process of its own (each holds the GPU alone, then lets it go),
with bench/pipeline_probe.py's timers installed. Settings come from the environment, as in docpipe's processes.

    python3 bench/pipeline_part.py engine   --out R.json --batch DIR --warmup W.pdf [--submitters 8]
    python3 bench/pipeline_part.py embedded --out R.json --batch DIR --warmup W.pdf
    python3 bench/pipeline_part.py worker   --probe P -- worker --queues gpu      # the GPU worker, probed

- engine: the pages rendered as the pipeline renders them (bench/pipeline_batch.py), the requests it would send
  (pipeline.extraction.build_request, the schema's prompt and sampling params), submitted all at once to the
  engine the pipeline builds (EngineClient.from_settings: same EngineConfig), as bench/doc_throughput.py drives it.
- embedded: `pipeline.processing.process_paths` over the batch folder, what `docpipe process DIR` runs, SQLite,
  after a warm-up file (engine built); the database then tells what became of every job.
- worker: `workers.cli`'s `worker` command (what `docpipe worker` runs), with the probe answering snapshots.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import pipeline_probe


def say(text: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {text}", flush=True)  # the part's log: where a cut-short part was


def batch_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.pdf"))


def submit_all(front: Any, requests: list[Any], submitters: int, limit: float | None,
               prepare: Callable[[Any], Any]) -> tuple[list[Any], float, bool]:
    """Submit every request at once (from `submitters` threads, as job threads do) and wait for all, or until
    `limit` seconds have passed: (final outputs or error texts, None where unfinished; wall; all finished).
    `prepare` (EngineClient.prepare) makes each request's prompt on its submitting thread, as a job does."""
    from gpu_engine.errors import RequestError

    outputs: list[Any] = [None] * len(requests)
    done, left, lock = threading.Event(), [len(requests)], threading.Lock()

    def listener(i: int) -> Any:
        def listen(item: Any) -> None:  # on the engine's loop thread
            if isinstance(item, BaseException):
                outputs[i] = f"{type(item).__name__}: {item}"
            elif item.finished:
                outputs[i] = item
            else:
                return
            with lock:
                left[0] -= 1
                if left[0] == 0:
                    done.set()
        return listen

    start = time.perf_counter()

    def submit(i: int) -> bool:
        if limit is not None and time.perf_counter() - start > limit:
            return False  # past the window: the rest stays unsubmitted
        try:
            prompt = prepare(requests[i].messages)
        except RequestError as exc:  # refused before the engine: the page's output is the reason, as in a job
            listener(i)(exc)
            return True
        front.submit(prompt, requests[i].params, listener=listener(i))
        return True

    with ThreadPoolExecutor(max_workers=submitters) as pool:
        submitted = sum(pool.map(submit, range(len(requests))))
    complete = submitted == len(requests) and done.wait(
        None if limit is None else max(0.0, limit - (time.perf_counter() - start)))
    return list(outputs), time.perf_counter() - start, complete


def run_engine(args: argparse.Namespace, probe: pipeline_probe.Probe) -> dict[str, Any]:
    from pipeline_batch import render_units

    from pipeline.builtin_schemas import BUILTIN_SCHEMAS
    from pipeline.engine_client import EngineClient, EngineReply
    from pipeline.extraction import build_request, interpret_reply, sampling_params
    from pipeline.settings import Settings

    settings = Settings()
    t0 = time.perf_counter()
    units = render_units(batch_files(args.batch), args.render_processes)
    warm = render_units([args.warmup], 1)
    render_s = time.perf_counter() - t0
    say(f"rendered {len(units)} pages in {render_s:.1f} s")
    t0 = time.perf_counter()
    client = EngineClient.from_settings(settings)
    build_s = time.perf_counter() - t0
    say(f"engine built in {build_s:.1f} s")
    spec = BUILTIN_SCHEMAS[args.schema]
    params = sampling_params(spec.json_schema, settings)
    front = client.async_engine
    complete = False
    try:
        submit_all(front, [build_request(u.unit, spec.prompt, params, settings) for u in warm], args.submitters,
                   None, client.prepare)
        requests = [build_request(u.unit, spec.prompt, params, settings) for u in units]
        say("warm-up done; timed run")
        before = probe.snapshot()
        outputs, wall, complete = submit_all(front, requests, args.submitters, args.run_limit_s, client.prepare)
        split = pipeline_probe.delta(before, probe.snapshot())
        config = front.engine.config
        cache_bytes = front.engine.cache_bytes
    finally:
        if complete:
            client.close()
    errors = [o for o in outputs if isinstance(o, str)] + [o.error for o in outputs if getattr(o, "error", None)]
    ok = completion = prompt = 0
    finished = [o for o in outputs if o is not None and not isinstance(o, str)]
    for out in finished:
        completion, prompt = completion + out.completion_tokens, prompt + out.prompt_tokens
        reply = EngineReply(text=out.text, finish_reason=out.finish_reason, error=out.error,
                            token_texts=[lp.text for lp in out.logprobs or []],
                            token_logprobs=[float(lp.logprob) for lp in out.logprobs or []])
        ok += bool(interpret_reply(reply, spec.json_schema, params.max_tokens).ok)  # as the job reads it
    return {"pages": len(units), "pages_done": sum(o is not None for o in outputs), "complete": complete,
            "pages_ok": ok, "errors": len(errors), "first_errors": errors[:3],
            "wall_s": wall, "completion_tokens": completion, "prompt_tokens": prompt,
            "engine_build_s": build_s, "render_before_s": render_s, "probe": split,
            "engine_config": {"max_num_seqs": config.max_num_seqs, "max_batched_tokens": config.max_batched_tokens,
                              "cache_bytes": cache_bytes}}


def db_summary(settings: Any) -> dict[str, Any]:
    """What the database says about the jobs and results of a run (every job of this data dir but the warm-up's,
    which is the first)."""
    from sqlalchemy import select

    from pipeline.context import Pipeline
    from pipeline.models import Job, Result

    p = Pipeline(settings)
    try:
        with p.db.read_session() as s:
            jobs = list(s.execute(select(Job.id, Job.state, Job.created_at, Job.started_at, Job.finished_at,
                                         Job.model_seconds, Job.completion_tokens, Job.prompt_tokens)
                                  .order_by(Job.id)))[1:]
            first = jobs[0].id if jobs else 0
            rows = select(Result.ok).where(Result.job_id >= first, Result.page_index.is_not(None))
            oks = list(s.scalars(rows))
            units = (len(oks), sum(bool(x) for x in oks))
    finally:
        p.close()
    states: dict[str, int] = {}
    for j in jobs:
        states[j.state] = states.get(j.state, 0) + 1
    waits = [(j.started_at - j.created_at).total_seconds() for j in jobs if j.started_at and j.created_at]
    runs = [(j.finished_at - j.started_at).total_seconds() for j in jobs if j.finished_at and j.started_at]
    return {"jobs": len(jobs), "job_states": states, "unit_results": int(units[0] or 0),
            "pages_ok": int(units[1] or 0), "model_wait_s": float(sum(j.model_seconds or 0.0 for j in jobs)),
            "completion_tokens": int(sum(j.completion_tokens or 0 for j in jobs)),
            "prompt_tokens": int(sum(j.prompt_tokens or 0 for j in jobs)),
            "job_created_to_started_s": float(sum(waits)), "job_started_to_finished_s": float(sum(runs))}


def run_embedded(args: argparse.Namespace, probe: pipeline_probe.Probe) -> dict[str, Any]:
    from pipeline.context import Pipeline
    from pipeline.processing import process_paths
    from pipeline.settings import Settings

    settings = Settings()
    p = Pipeline(settings)
    try:
        t0 = time.perf_counter()
        process_paths(p, [args.warmup], schema=args.schema)  # builds the engine
        build_s = time.perf_counter() - t0
        say(f"engine built and warm-up file done in {build_s:.1f} s; timed run")
        before = probe.snapshot()
        t0 = time.perf_counter()
        reports: list[Any] = []
        run = threading.Thread(target=lambda: reports.append(process_paths(p, [args.batch], schema=args.schema)),
                               daemon=True)
        run.start()
        run.join(args.run_limit_s)
        wall = time.perf_counter() - t0
        split = pipeline_probe.delta(before, probe.snapshot())
        seqs = getattr(p.client, "max_num_seqs", 0)
    finally:
        if reports:
            p.close()
    db = db_summary(settings)
    failed = len(reports[0].failed) if reports else None
    return {"pages_done": db["unit_results"], "complete": bool(reports), "files_failed": failed, "wall_s": wall,
            "warmup_s": build_s, "probe": split, "db": db, "engine_max_num_seqs": seqs,
            "embedded_jobs": settings.embedded_job_threads()}


def run_worker(argv: list[str], probe_path: Path) -> None:
    pipeline_probe.install(probe_path)
    from workers.__main__ import app  # `python -m workers`: the queue commands of `docpipe`

    sys.argv = ["docpipe", *argv]
    app()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "worker":
        ap = argparse.ArgumentParser()
        ap.add_argument("--probe", type=Path, required=True)
        rest = argv[argv.index("--") + 1:] if "--" in argv else []
        args = ap.parse_args(argv[1:argv.index("--")] if "--" in argv else argv[1:])
        run_worker(rest, args.probe)
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("part", choices=("engine", "embedded"))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--batch", type=Path, required=True)
    ap.add_argument("--warmup", type=Path, required=True)
    ap.add_argument("--schema", default="form")
    ap.add_argument("--submitters", type=int, default=8)
    ap.add_argument("--render-processes", type=int, default=max(1, min(16, (os.cpu_count() or 2) - 1)))
    ap.add_argument("--run-limit-s", type=float, help="stop the timed run here and report what finished")
    args = ap.parse_args(argv)
    probe = pipeline_probe.install()
    result = (run_engine if args.part == "engine" else run_embedded)(args, probe)
    args.out.write_text(json.dumps(result, indent=1, default=str))
    if not result["complete"]:
        os._exit(0)  # work still in flight on other threads: leave without waiting for it
    return 0


if __name__ == "__main__":
    sys.exit(main())

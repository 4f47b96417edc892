"""The engine step thread's host time while job threads prepare pages beside it, in-process or in preparation
processes (issue 14, item 2: pipeline.page_prep).

    python3 bench/pipeline_prep_load.py [--seconds 8] [--jobs 8] [--processes 2] [--seqs 64] [--rate 4] [--json OUT]

An engine on bench/_instant_runner.py's runner (no compute: a step is host work only: scheduling, sampling,
grammar-free decode of --seqs text sequences, outputs) runs its AsyncEngine step loop for --seconds per mode:
  alone     nothing else in the process;
  threads   --jobs threads preparing A4 pages at 150 dpi in a loop as job threads did (pipeline.extraction.load_png,
            then the 0.8B checkpoint's processor: resize, patches, hash, template, tokens);
  pool      the same threads handing the same pages to pipeline.page_prep.PagePrepPool (--processes children).
Per mode: steps run, step wall (mean / p50 / p95), the step thread's own CPU time per step (wall minus that is
time the step thread waited for the GIL or a core), and pages prepared per second by the load.
"""
from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _instant_runner import InstantRunner, tiny_tokenizer, write_result

from gpu_engine.async_engine import AsyncEngine
from gpu_engine.engine import Engine
from gpu_engine.engine_config import EngineConfig
from gpu_engine.params import SamplingParams


class StepClock:
    """Wraps one engine's step(): wall and thread CPU of every step."""

    def __init__(self, engine: Engine) -> None:
        self.walls: list[float] = []
        self.cpus: list[float] = []
        self.on = False
        step = engine.step

        def timed() -> Any:
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return step()
            finally:
                if self.on:
                    self.walls.append(time.perf_counter() - t0)
                    self.cpus.append(time.thread_time() - c0)

        engine.step = timed  # type: ignore[method-assign]  # this bench's own engine


def engine_front(seqs: int) -> tuple[AsyncEngine, StepClock]:
    vocab = 2074
    rng = np.random.default_rng(0)
    logits = np.full((seqs, vocab), -10.0, np.float32)
    logits[:, :2000] = rng.standard_normal((seqs, 2000)).astype(np.float32)
    cfg = EngineConfig(max_num_seqs=seqs, max_batched_tokens=max(2048, seqs), num_kv_blocks=seqs * 64 + 64,
                       block_size=16, lookahead=False)
    engine = Engine(InstantRunner(logits), tiny_tokenizer(), vocab_size=vocab, config=cfg)
    clock = StepClock(engine)
    front = AsyncEngine(engine)
    params = SamplingParams(max_tokens=900, ignore_eos=True)

    def submit() -> None:
        front.submit(rng.integers(0, 2000, size=16).tolist(), params, listener=refill)

    def refill(out: Any) -> None:  # on the loop thread: a finished sequence is replaced, the batch stays full
        if getattr(out, "finished", False) and not stopping.is_set():
            submit()

    stopping = threading.Event()
    for _ in range(seqs):
        submit()
    front.refill_stop = stopping  # type: ignore[attr-defined]  # main() sets it before the shutdown
    return front, clock


def page_messages(model_dir: Path, count: int) -> list[list[dict[str, Any]]]:
    """`count` pages' request messages (images as PNG bytes), as the pipeline builds them."""
    from pipeline_batch import render_units, write_batch

    from pipeline.builtin_schemas import BUILTIN_SCHEMAS
    from pipeline.extraction import PngImage, build_request, png_bytes, sampling_params
    from pipeline.settings import Settings

    folder = model_dir.parent / "batch"
    units = render_units(write_batch(folder, 1, count, 0), 1)
    settings, spec = Settings(), BUILTIN_SCHEMAS["form"]
    params = sampling_params(spec.json_schema, settings)
    out = []
    for u in units:
        u.unit.images = [PngImage(png_bytes(image)) for image in u.unit.images]
        out.append(build_request(u.unit, spec.prompt, params, settings).messages)
    return out


def run_mode(clock: StepClock, seconds: float, jobs: int, work: Callable[[int], Any] | None,
             rate: float = 0.0) -> dict[str, Any]:
    stop, done = threading.Event(), [0]
    lock = threading.Lock()

    gap = jobs / rate if rate else 0.0  # each thread's pace, so every mode carries the same load

    def loop(i: int) -> None:
        n, due = 0, time.perf_counter() + i * gap / max(1, jobs)
        while not stop.is_set():
            assert work is not None
            if gap:
                stop.wait(max(0.0, due - time.perf_counter()))
                due += gap
            work(i + n * jobs)
            n += 1
            with lock:
                done[0] += 1

    threads = [threading.Thread(target=loop, args=(i,), daemon=True) for i in range(jobs if work else 0)]
    for t in threads:
        t.start()
    time.sleep(1.0 if work else 0.2)  # the load in full swing before the window opens
    clock.walls.clear()
    clock.cpus.clear()
    with lock:
        done[0] = 0
    clock.on = True
    time.sleep(seconds)
    clock.on = False
    with lock:
        pages = done[0]
    stop.set()
    for t in threads:
        t.join()
    walls, cpus = np.array(clock.walls) * 1e3, np.array(clock.cpus) * 1e3
    return {"steps": len(walls), "step_ms_mean": float(walls.mean()), "step_ms_p50": float(np.percentile(walls, 50)),
            "step_ms_p95": float(np.percentile(walls, 95)), "step_cpu_ms_mean": float(cpus.mean()),
            "step_wait_ms_mean": float(walls.mean() - cpus.mean()), "pages_per_s": pages / seconds}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--jobs", type=int, default=8, help="threads preparing pages")
    ap.add_argument("--processes", type=int, default=2, help="PagePrepPool children in the pool mode")
    ap.add_argument("--seqs", type=int, default=64, help="sequences the engine decodes")
    ap.add_argument("--rate", type=float, default=0.0,
                    help="pages/s the load prepares in all (0 = as fast as it can): the same work in both modes")
    ap.add_argument("--pages", type=int, default=4, help="distinct pages the load cycles through")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/docpipe-prep-load"))
    ap.add_argument("--json", default=str(Path(__file__).resolve().parent / "results" / "pipeline_prep_load.json"))
    args = ap.parse_args()

    from doc_models import QWEN_IMAGE_MAX_PIXELS, write_model

    from pipeline.extraction import decode_pngs
    from pipeline.page_prep import PagePrepPool
    from pipeline.page_prep_child import build_prepare

    model = write_model("0.8b", args.workdir / "model", 0, QWEN_IMAGE_MAX_PIXELS, weights=False)
    pages = page_messages(model, args.pages)
    prepare = build_prepare(model)
    front, clock = engine_front(args.seqs)
    rows: dict[str, Any] = {}
    try:
        rows["alone"] = run_mode(clock, args.seconds, 0, None)
        rows["threads"] = run_mode(clock, args.seconds, args.jobs,
                                   lambda i: prepare(decode_pngs(pages[i % len(pages)])), args.rate)
        pool = PagePrepPool(model, args.processes, timeout_s=120.0)
        try:
            rows["pool"] = run_mode(clock, args.seconds, args.jobs, lambda i: pool.prepare(pages[i % len(pages)]),
                                    args.rate)
        finally:
            pool.close()
    finally:
        front.refill_stop.set()  # type: ignore[attr-defined]  # set by engine_front
        front.shutdown()
    print(f"{'mode':<9}{'steps':>7}{'step ms':>9}{'p50':>7}{'p95':>7}{'cpu ms':>8}{'wait ms':>9}{'pages/s':>9}")
    for mode, r in rows.items():
        print(f"{mode:<9}{r['steps']:>7}{r['step_ms_mean']:>9.2f}{r['step_ms_p50']:>7.2f}{r['step_ms_p95']:>7.2f}"
              f"{r['step_cpu_ms_mean']:>8.2f}{r['step_wait_ms_mean']:>9.2f}{r['pages_per_s']:>9.2f}")
    write_result(args.json, "pipeline_prep_load", {
        "params": {"seconds": args.seconds, "jobs": args.jobs, "processes": args.processes, "seqs": args.seqs,
                   "rate": args.rate,
                   "shape": "0.8b processor, A4 invoice pages at 150 dpi"},
        "rows": rows})
    print(json.dumps({m: round(r["step_ms_mean"], 2) for m, r in rows.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""How full the product keeps the engine: engine steps and mean batch of the GPU worker's job path on the CPU.

    python3 bench/pipeline_feed.py [--docs 12] [--pages 10] [--max-num-seqs 256] [--dpi 72] [--json PATH]

The H200 figures of issue 14 item 2 (bench/pipeline_throughput.py) cannot be reproduced here, but how many page
requests the product keeps at the engine can. This builds the real engine on the bundled tiny model (reference
runner) sized as the cuda engine sizes itself on an H200 (--max-num-seqs 256), and a Pipeline whose settings
are a cuda deployment's (DOCPIPE_RUNNER=cuda, the engine's batch left to the engine), so the pipeline sizes its
page slots and job threads exactly as on the GPU. The batch (bench/pipeline_batch.py's A4 invoice PDFs) is
ingested first, as the Celery ingest worker renders before the gpu queue runs; then every job runs on its own
thread (`run_job`, as the GPU worker's thread pool runs `docpipe.extract`), SQLite. Two runs on the same pages:
  engine    the same requests submitted all at once to the engine (the ceiling);
  jobs      run_job per job, one thread each.
Reported per run: wall, pages/s, engine steps, mean batch (sequences running at each step's start), the most
page requests the product had at the engine at once. On 2 CPU cores the tiny model's steps are host-bound, so
pages/s is indicative; steps and mean batch are the figures to compare.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pipeline_batch import render_units, write_batch  # noqa: E402 - after the path insert


class StepCounter:
    """Engine steps and the sequences running at each step's start (as bench/pipeline_probe counts them)."""

    def __init__(self, engine: Any) -> None:
        self.steps = 0
        self.rows = 0
        step = engine.step

        def counted(*args: Any, **kwargs: Any) -> Any:
            if engine.scheduler.running or engine.scheduler.waiting:  # a step with work
                self.steps += 1
                self.rows += len(engine.scheduler.running)
            return step(*args, **kwargs)

        engine.step = counted

    def reset(self) -> None:
        self.steps = self.rows = 0

    def row(self) -> dict[str, Any]:
        return {"engine_steps": self.steps, "mean_batch": self.rows / self.steps if self.steps else 0.0}


class InFlight:
    """The most requests submitted and not yet answered at once, through one AsyncEngine front."""

    def __init__(self, front: Any) -> None:
        self._front = front
        self._lock = threading.Lock()
        self.now = self.peak = 0

    def submit(self, *args: Any, **kwargs: Any) -> Any:
        handle = self._front.submit(*args, **kwargs)
        with self._lock:
            self.now += 1
            self.peak = max(self.peak, self.now)
        original = handle.result
        done = threading.Event()

        def result(timeout: float | None = None) -> Any:
            try:
                return original(timeout)
            finally:
                if not done.is_set():
                    done.set()
                    with self._lock:
                        self.now -= 1

        handle.result = result
        return handle

    def __getattr__(self, name: str) -> Any:
        return getattr(self._front, name)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--docs", type=int, default=12)
    ap.add_argument("--pages", type=int, default=10, help="pages per PDF")
    ap.add_argument("--max-num-seqs", type=int, default=256, help="the engine's batch (the H200's self-sizing)")
    ap.add_argument("--dpi", type=float, default=72.0, help="render dpi (the pipeline's is 150; smaller for 2 cores)")
    ap.add_argument("--schema", default="form")
    ap.add_argument("--parts", default="engine,jobs")
    ap.add_argument("--setting", nargs=2, action="append", default=[], metavar=("NAME", "VALUE"),
                    help="a Settings field for the jobs run, e.g. --setting engine_pages_in_flight 64")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()

    import gpu_engine
    from gpu_engine.bundled import bundled_model_dir
    from pipeline.builtin_schemas import BUILTIN_SCHEMAS
    from pipeline.context import Pipeline
    from pipeline.engine_client import EngineClient
    from pipeline.extraction import build_request, sampling_params
    from pipeline.ingest import ingest_file
    from pipeline.jobs import run_job
    from pipeline.settings import Settings

    work = Path(tempfile.mkdtemp(prefix="pipeline_feed_"))
    paths = write_batch(work / "batch", args.docs, args.pages, seed=0)
    pages = args.docs * args.pages
    extra = {name: value for name, value in args.setting}
    settings = Settings(data_dir=work / "data", runner="cuda", pdf_dpi=args.dpi, **extra)  # type: ignore[arg-type]
    engine = gpu_engine.Engine.from_pretrained(
        bundled_model_dir(), runner="reference",
        config=gpu_engine.EngineConfig(max_num_seqs=args.max_num_seqs, max_batched_tokens=8192))
    counter = StepCounter(engine)
    front = InFlight(gpu_engine.AsyncEngine(engine))
    client = EngineClient(front, model_dir=Path(bundled_model_dir()), fingerprint=engine.model_fingerprint,
                          timeout_s=settings.request_timeout_s, max_num_seqs=engine.config.max_num_seqs)
    spec = BUILTIN_SCHEMAS[args.schema]
    params = sampling_params(spec.json_schema, settings)
    rows: dict[str, Any] = {}
    try:
        if "engine" in args.parts:
            os.environ["DOCPIPE_PDF_DPI"] = str(args.dpi)  # render_units reads Settings() as the pipeline does
            units = render_units(paths, processes=1)
            requests = [build_request(u.unit, spec.prompt, params, settings) for u in units]
            counter.reset()
            front.peak = 0
            t0 = time.perf_counter()
            handles = [front.submit(r.messages, r.params) for r in requests]
            for h in handles:
                h.result(600)
            wall = time.perf_counter() - t0
            rows["engine"] = {"wall_s": wall, "pages_per_s": pages / wall, "peak_in_flight": front.peak,
                              **counter.row()}
            print("engine", json.dumps(rows["engine"]), flush=True)
        if "jobs" in args.parts:
            p = Pipeline(settings, client=client)
            jobs = [ingest_file(p, path, name=path.name, schema=args.schema).job_id for path in paths]
            counter.reset()
            front.peak = 0
            t0 = time.perf_counter()
            with ThreadPoolExecutor(max_workers=min(len(jobs), settings.engine_job_slots())) as pool:
                runs = list(pool.map(lambda j: run_job(p, j), jobs))
            wall = time.perf_counter() - t0
            rows["jobs"] = {"wall_s": wall, "pages_per_s": pages / wall, "peak_in_flight": front.peak,
                            "states": sorted({r.state for r in runs}), **counter.row()}
            print("jobs", json.dumps(rows["jobs"]), flush=True)
    finally:
        client.close()
    if args.json:
        Path(args.json).write_text(json.dumps({"bench": "pipeline_feed", "argv": sys.argv[1:], "rows": rows},
                                              indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

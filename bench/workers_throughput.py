"""Documents/s through Celery (Redis, an ingest worker and a GPU worker as real processes) versus the in-process
path (`pipeline.processing.process_paths`, what `docpipe process` runs) on the same files, same model, same settings.

    python bench/workers_throughput.py [--docs 100] [--rounds 2] [--redis redis://127.0.0.1:6379] [--out ...]

Both paths start warm (engine built, one warm-up document done) and each uses its own fresh data dir, so no
document is deduplicated against the other run. Timing: from the first submission to the last job finished
(Celery: polled in the database every 20 ms). Reported: docs/s per path and the overhead ratio
in-process docs/s / Celery docs/s (>1: the queue costs throughput; <1: what the queue adds is won back, by the
GPU worker batching concurrent jobs, and in the enqueue variants by the caller ingesting while the worker extracts:
two processes on two cores). The tiny bundled model on the reference runner makes the model time small, so this
measures the queue's overhead near its worst case.
"""
from __future__ import annotations

import os

# Before numpy loads BLAS: one BLAS thread, as in the worker processes (the machine is small and shared; several
# BLAS threads per process only fight each other). Both paths run under the same setting.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", os.environ["OMP_NUM_THREADS"])

import argparse
import io
import json
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import redis
from PIL import Image
from sqlalchemy import func, select

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}


def make_files(folder: Path, n: int, size: int, seed: int) -> list[Path]:
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True)
    paths = []
    for i in range(n):
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(buf, "PNG")
        path = folder / f"doc{i:03d}.png"
        path.write_bytes(buf.getvalue())
        paths.append(path)
    return paths


def base_env(data_dir: Path, broker_url: str | None, args: argparse.Namespace) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DOCPIPE_")}
    env.update({"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "DOCPIPE_DATA_DIR": str(data_dir),
                "DOCPIPE_MAX_TOKENS": str(args.max_tokens), "DOCPIPE_ENGINE_MAX_NUM_SEQS": str(args.batch)})
    if broker_url:
        env["DOCPIPE_BROKER_URL"] = broker_url
    if "DOCPIPE_CACHE_DIR" in os.environ:
        env["DOCPIPE_CACHE_DIR"] = os.environ["DOCPIPE_CACHE_DIR"]
    return env


def settings_from(env: dict[str, str]):
    from pipeline.settings import Settings

    return Settings(**{k[len("DOCPIPE_"):].lower(): v for k, v in env.items() if k.startswith("DOCPIPE_")})


def pipeline_for(env: dict[str, str]):
    from pipeline.context import Pipeline
    from pipeline.schemas import register_schema

    p = Pipeline(settings_from(env))
    with p.db.session() as s:
        register_schema(s, "flag", SCHEMA)
    return p


def run_in_process(files: list[Path], warmup: Path, work: Path, args: argparse.Namespace) -> dict:
    from pipeline.processing import process_paths

    p = pipeline_for(base_env(Path(tempfile.mkdtemp(prefix="inproc-", dir=work)), None, args))
    process_paths(p, [warmup], schema="flag")  # builds the engine
    t0 = time.perf_counter()
    report = process_paths(p, [str(f) for f in files], schema="flag")
    seconds = time.perf_counter() - t0
    ok = sum(f.state == "succeeded" for f in report.files)
    p.close()
    return {"docs": len(files), "succeeded": ok, "seconds": seconds, "docs_per_s": len(files) / seconds}


def claim_db(base_url: str) -> tuple[str, int]:
    for db in range(15, 0, -1):
        client = redis.Redis.from_url(f"{base_url}/{db}")
        if client.set("docpipe:bench:claim", "1", nx=True, ex=1800):
            if client.dbsize() == 1:
                return f"{base_url}/{db}", db
            client.delete("docpipe:bench:claim")
    raise SystemExit("no free Redis database (1-15) for the benchmark")


def finished_jobs(p) -> int:
    from pipeline.models import Job

    with p.db.read_session() as s:
        return int(s.scalar(select(func.count()).select_from(Job)
                            .where(Job.state.in_(["succeeded", "partial", "failed"]))) or 0)


def wait_finished(p, n: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while finished_jobs(p) < n:
        if time.monotonic() > deadline:
            raise SystemExit(f"Celery path: only {finished_jobs(p)} of {n} jobs finished after {timeout} s")
        time.sleep(0.02)


def run_celery(files: list[Path], warmup: Path, work: Path, args: argparse.Namespace, mode: str,
               gpu_concurrency: int | None = None) -> dict:
    """mode 'submit': files staged and ingested by the ingest worker; 'enqueue': ingested here, jobs enqueued.
    gpu_concurrency=1 runs one job at a time, like the in-process path: the difference is then the queue alone."""
    from pipeline.ingest import ingest_file
    from workers.config import WorkerSettings
    from workers.enqueue import enqueue_ingest, enqueue_job

    url, db = claim_db(args.redis)
    env = base_env(Path(tempfile.mkdtemp(prefix=f"celery-{mode}-", dir=work)), url, args)
    p = pipeline_for(env)
    settings, ws = p.settings, WorkerSettings()
    procs = []
    logs = Path(tempfile.mkdtemp(prefix=f"logs-{mode}-", dir=work))
    gpu_cmd = ["worker", "--queues", "gpu"] + (["--concurrency", str(gpu_concurrency)] if gpu_concurrency else [])
    try:
        for name, cmd in (("gpu", gpu_cmd),
                          ("ingest", ["worker", "--queues", "ingest", "--concurrency", "1"])):
            with open(logs / f"{name}.log", "wb") as out:
                procs.append(subprocess.Popen([sys.executable, "-m", "workers", *cmd], cwd=REPO, env=env,
                                              stdout=out, stderr=subprocess.STDOUT, start_new_session=True))
        enqueue_ingest(warmup, schema="flag", settings=settings, worker_settings=ws)
        wait_finished(p, 1, timeout=120)
        t0 = time.perf_counter()
        if mode == "submit":
            for f in files:
                enqueue_ingest(f, schema="flag", settings=settings, worker_settings=ws)
        else:
            for f in files:
                enqueue_job(ingest_file(p, f, schema="flag").job_id, settings=settings, worker_settings=ws)
        wait_finished(p, len(files) + 1, timeout=600)
        seconds = time.perf_counter() - t0
        from pipeline.models import Job

        with p.db.read_session() as s:
            ok = int(s.scalar(select(func.count()).select_from(Job).where(Job.state == "succeeded")) or 0) - 1
    finally:
        for proc in procs:
            os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs:
            proc.wait(timeout=30)
        p.close()
        redis.Redis.from_url(url).flushdb()
    return {"docs": len(files), "succeeded": ok, "seconds": seconds, "docs_per_s": len(files) / seconds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--docs", type=int, default=100)
    ap.add_argument("--size", type=int, default=28, help="image side in pixels")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--batch", type=int, default=4, help="engine batch size = GPU worker thread count")
    ap.add_argument("--redis", default="redis://127.0.0.1:6379")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "workers_throughput.json")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="docpipe-bench-workers-"))
    try:
        files = make_files(work / "files", args.docs, args.size, seed=1)
        warmup = make_files(work / "warmup", 1, args.size, seed=2)[0]
        # This machine is shared: rounds alternate between the paths and each path keeps its best round.
        runs: dict[str, list[dict]] = {k: [] for k in ("in_process", "celery_enqueue_c1", "celery_enqueue",
                                                       "celery_submit")}
        for _ in range(args.rounds):
            runs["in_process"].append(run_in_process(files, warmup, work, args))
            runs["celery_enqueue_c1"].append(run_celery(files, warmup, work, args, "enqueue", gpu_concurrency=1))
            runs["celery_enqueue"].append(run_celery(files, warmup, work, args, "enqueue"))
            runs["celery_submit"].append(run_celery(files, warmup, work, args, "submit"))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    best = {k: max(v, key=lambda r: r["docs_per_s"]) | {"rounds_docs_per_s": [round(r["docs_per_s"], 2) for r in v]}
            for k, v in runs.items()}
    inproc, submit, enqueue, enqueue1 = (best[k] for k in ("in_process", "celery_submit", "celery_enqueue",
                                                             "celery_enqueue_c1"))

    result = {
        "bench": "workers_throughput",
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "params": {"docs": args.docs, "rounds": args.rounds, "image_px": args.size, "max_tokens": args.max_tokens,
                   "engine_batch": args.batch, "runner": "reference", "model": "bundled tiny"},
        "in_process": inproc,
        "celery_enqueue_c1": enqueue1,  # ingested by the caller, one job at a time on the GPU worker
        "celery_enqueue": enqueue,  # ingested by the caller (as the API does), GPU worker batches `engine_batch`
        "celery_submit": submit,  # files staged, ingest worker renders, GPU worker extracts
        # in-process docs/s divided by Celery docs/s: > 1 means the queue costs throughput
        "overhead_ratio_one_at_a_time": inproc["docs_per_s"] / enqueue1["docs_per_s"],
        "overhead_ratio_enqueue": inproc["docs_per_s"] / enqueue["docs_per_s"],
        "overhead_ratio_submit": inproc["docs_per_s"] / submit["docs_per_s"],
    }
    print(f"{'path':<40}{'docs':>6}{'ok':>6}{'seconds':>10}{'docs/s':>10}")
    for name, key in (("in-process (docpipe process)", "in_process"),
                      ("celery: enqueue_job -> gpu (1 at a time)", "celery_enqueue_c1"),
                      (f"celery: enqueue_job -> gpu ({args.batch} threads)", "celery_enqueue"),
                      ("celery: submit -> ingest -> gpu", "celery_submit")):
        r = result[key]
        print(f"{name:<40}{r['docs']:>6}{r['succeeded']:>6}{r['seconds']:>10.2f}{r['docs_per_s']:>10.1f}")
    print(f"overhead ratio (in-process docs/s / celery docs/s): one at a time "
          f"{result['overhead_ratio_one_at_a_time']:.2f}, enqueue {result['overhead_ratio_enqueue']:.2f}, "
          f"submit {result['overhead_ratio_submit']:.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

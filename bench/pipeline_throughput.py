"""Pages per second through the product against the engine alone, on the same pages and model (issue 14, item 2).

    python3 bench/pipeline_throughput.py --runner cuda --shape 0.8b --docs 100 --pages-per-doc 10 \
        [--parts engine,embedded,celery] [--json bench/results/pipeline_throughput.json]
    python3 bench/pipeline_throughput.py --runner reference --shape tiny --docs 3 --pages-per-doc 2   # CPU

One batch of A4 invoice PDFs with a text layer (bench/pipeline_batch.py: doc_workload's pages), one model folder
with random bf16 weights (bench/doc_models.write_model: the real Qwen3.5 shapes, or the tiny CPU one), the
settings of a real deployment (DOCPIPE_MODEL_DIR, DOCPIPE_RUNNER; the engine's batch sizes left to the runner;
the grammar caps the bundled model gets, so random weights end their answers; schema --schema), then three runs,
each in processes of its own, each warm (engine built, one warm-up file done) before its clock starts:
  engine    the pages rendered the pipeline's way, the pipeline's requests submitted all at once to the engine the
            pipeline builds (EngineClient.from_settings), each prepared as that client prepares it (EngineClient.
            prepare: the page-preparation processes on cuda) — the ceiling the product is measured against (every page
            processed at once: ~53 MB of float32 pixels a page at 150 dpi until its encode, 1,000 pages ~53 GB);
  embedded  `process_paths` over the batch folder (what `docpipe process DIR` runs), SQLite;
  celery    redis-server, `docpipe worker --queues ingest` (prepare/render) and `--queues gpu` (the engine), the
            files submitted as `docpipe submit` does, SQLite shared by the workers.
Reported per run: pages/s, the engine's busy fraction (time inside Engine.step over the wall) and mean batch,
and the time split measured in that run: bench/pipeline_probe.py's timers in the engine's process (database
transactions / SQL / commits, rendering, page images, request building, answer reading, thread-seconds), the
database's own record of every job (time waiting on the engine, created -> started), the Celery task times from
the workers' logs. pipeline_to_engine_ratio = pipeline pages/s / engine pages/s (goal: >= 0.90 for celery).
Each run has its own time limit (--part-timeout); the JSON is written after each run, so a run cut short keeps
the others.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_commit import git_commit
from doc_models import QWEN_IMAGE_MAX_PIXELS, write_model
from pipeline_batch import write_batch

PARTS = ("engine", "celery", "embedded")  # the ceiling, then the goal's path
TIMERS = ("db_txn", "db_sql", "db_commit", "render", "page_images", "build_request", "interpret",
          "step_vision_encode", "step_prefill_forward", "step_decode_forward", "step_grammar_mask", "step_host",
          "image_preprocessing", "page_prep")


def part_env(args: argparse.Namespace, model: Path, data_dir: Path, cuda_cache: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DOCPIPE_")}
    env.update({
        "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "bench"), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1"), "PYTHONUNBUFFERED": "1",
        "DOCPIPE_MODEL_DIR": str(model), "DOCPIPE_RUNNER": args.runner, "DOCPIPE_DATA_DIR": str(data_dir),
        "DOCPIPE_CUDA_CACHE": str(cuda_cache), "DOCPIPE_STABLE_SECONDS": "0",
        # The bundled model's caps (pipeline.settings.BUNDLED_*): random weights end their answers there.
        "DOCPIPE_GRAMMAR_MAX_STRING_LENGTH": "24", "DOCPIPE_GRAMMAR_MAX_ARRAY_ITEMS": "3",
    })
    for name, value in args.setting:
        env[f"DOCPIPE_{name.upper()}"] = value
    return env


def run_part(part: str, args: argparse.Namespace, env: dict[str, str], work: Path, files: list[Path],
             warmup: Path) -> dict[str, Any]:
    if part == "celery":
        from pipeline_celery import run_celery

        saved = dict(os.environ)
        os.environ.update({k: v for k, v in env.items() if k.startswith("DOCPIPE_")})  # WorkerSettings() here
        try:
            return run_celery(env, files, warmup, work / "celery", schema=args.schema, timeout=args.part_timeout,
                              redis_archive=args.redis_archive, ingest_concurrency=args.ingest_concurrency,
                              run_limit=args.run_limit_s)
        finally:  # this process's environment as it was (the bench runs inside pytest too)
            os.environ.clear()
            os.environ.update(saved)
    out = work / f"{part}.json"
    cmd = [sys.executable, str(Path(__file__).with_name("pipeline_part.py")), part, "--out", str(out),
           "--batch", str(files[0].parent), "--warmup", str(warmup), "--schema", args.schema,
           "--submitters", str(args.submitters), "--render-processes", str(args.render_processes)]
    if args.run_limit_s:
        cmd += ["--run-limit-s", str(args.run_limit_s)]
    with open(work / f"{part}.log", "wb") as log:
        try:
            proc = subprocess.run(cmd, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                  timeout=args.part_timeout)
        except subprocess.TimeoutExpired:
            proc = None
    if proc is None or proc.returncode != 0:
        tail = (work / f"{part}.log").read_text(errors="replace")[-3000:]
        what = f"not done within {args.part_timeout:.0f} s" if proc is None else f"exited {proc.returncode}"
        raise RuntimeError(f"{part} {what}; its log ends:\n{tail}")
    return json.loads(out.read_text())


def summarise(part: str, raw: dict[str, Any], pages: int) -> dict[str, Any]:
    """One row: pages/s, engine busy, and the time split of the run (thread-seconds and their share of the wall)."""
    wall, probe = float(raw["wall_s"]), raw["probe"]
    busy = float(probe["thread_s"].get("engine_step", 0.0))
    split: dict[str, float] = {"engine_step_s": busy, "engine_idle_s": wall - busy,
                               "process_cpu_s": float(probe["cpu_s"])}
    for name in TIMERS:
        split[f"{name}_s"] = float(probe["thread_s"].get(name, 0.0))
    db = raw.get("db")
    if db:
        split["model_wait_s"] = float(db["model_wait_s"])
        split["job_created_to_started_s"] = float(db["job_created_to_started_s"])
        split["job_started_to_finished_s"] = float(db["job_started_to_finished_s"])
    for worker, tasks in raw.get("tasks", {}).items():
        for task, row in tasks.items():
            split[f"{worker}:{task}_s"] = float(row["seconds"])
    pages_ok = int(db["pages_ok"] if db else raw["pages_ok"])
    done = int(raw["pages_done"])  # pages with an answer inside the window (all of them unless cut short)
    row = {"part": part, "pages": pages, "pages_done": done, "complete": bool(raw["complete"]) and done == pages,
           "pages_ok": pages_ok, "wall_s": wall, "pages_per_s": done / wall,
           "engine_busy_fraction": busy / wall, "engine_steps": int(probe["engine_steps"]),
           "mean_batch": float(probe["mean_batch"]), "engine_config": probe.get("engine_config", {}),
           "timer_calls": probe["calls"],
           "time_split": split,
           "share_of_wall": {k: v / wall for k, v in split.items()}}
    if db:
        row["job_states"] = db["job_states"]
        row["completion_tokens"] = db["completion_tokens"]
    else:
        row["completion_tokens"] = raw["completion_tokens"]
    row["tokens_per_page"] = row["completion_tokens"] / max(1, done)
    return row


def finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def table(result: dict[str, Any]) -> str:
    lines = [f"{'run':<10}{'pages':>7}{'done':>6}{'ok':>6}{'wall s':>9}{'pages/s':>9}{'ratio':>7}{'busy':>6}"
             f"{'batch':>7}{'db':>7}{'render':>8}{'images':>8}"]
    for part, row in result["runs"].items():
        if "error" in row:
            lines.append(f"{part:<10} failed: {row['error'].splitlines()[0][:90]}")
            continue
        ratio = result["pipeline_to_engine_ratio"].get(part)
        share = row["share_of_wall"]
        lines.append(f"{part:<10}{row['pages']:>7}{row['pages_done']:>6}{row['pages_ok']:>6}{row['wall_s']:>9.1f}{row['pages_per_s']:>9.2f}"
                     f"{(f'{ratio:.2f}' if ratio is not None else '-'):>7}{row['engine_busy_fraction']:>6.2f}"
                     f"{row['mean_batch']:>7.1f}{share['db_txn_s']:>7.2f}{share['render_s']:>8.2f}"
                     f"{share['page_images_s']:>8.2f}")
    lines.append("db / render / images: thread-seconds in the engine's process over the wall (celery renders in "
                 "its ingest worker: see time_split)")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runner", default="cuda", choices=("cuda", "reference"))
    ap.add_argument("--shape", default="0.8b", help="bench/doc_models.py shape (tiny for the CPU)")
    ap.add_argument("--docs", type=int, default=100)
    ap.add_argument("--pages-per-doc", type=int, default=10)
    ap.add_argument("--parts", default=",".join(PARTS))
    ap.add_argument("--schema", default="form", help="builtin schema (doc_throughput's grammar mode uses form)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--submitters", type=int, default=8, help="engine run: threads submitting (as job threads)")
    ap.add_argument("--render-processes", type=int, default=max(1, min(16, (os.cpu_count() or 2) - 1)))
    ap.add_argument("--ingest-concurrency", type=int, help="celery: ingest worker processes (default: its own)")
    ap.add_argument("--part-timeout", type=float, default=600.0, help="seconds each part may take, set-up included")
    ap.add_argument("--run-limit-s", type=float,
                    help="stop each timed run here: pages/s then counts the pages answered in the window "
                         "(the row says complete: false)")
    ap.add_argument("--redis-archive", type=Path, help="redis-server + libs (.tar.xz) where none is installed")
    ap.add_argument("--setting", nargs=2, action="append", default=[], metavar=("NAME", "VALUE"),
                    help="a DOCPIPE_ setting for every run, e.g. --setting embedded_jobs 64")
    ap.add_argument("--workdir")
    ap.add_argument("--json", default=str(REPO / "bench" / "results" / "pipeline_throughput.json"))
    args = ap.parse_args(argv)
    args.parts = [p for p in args.parts.split(",") if p]
    if not args.parts or set(args.parts) - set(PARTS):
        raise SystemExit(f"--parts: a comma list of {', '.join(PARTS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="docpipe-pipeline-tp-"))
    work.mkdir(parents=True, exist_ok=True)
    stale = sorted(p.name for p in work.glob("data-*"))
    if stale:  # an earlier run's databases would count its pages as this run's (session 9: 1,122 of 1,000)
        print(f"--workdir {work} holds an earlier run's data ({', '.join(stale)}): give an empty folder",
              file=sys.stderr)
        return 2
    result: dict[str, Any] = {
        "bench": "pipeline_throughput", "git_commit": git_commit(), "command": " ".join(["python3", *sys.argv]),
        "date_utc": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "params": {"runner": args.runner, "shape": args.shape, "docs": args.docs, "pages_per_doc": args.pages_per_doc,
                   "schema": args.schema, "settings": dict(args.setting)},
        "runs": {}, "pipeline_to_engine_ratio": {}}

    def save() -> None:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1, default=str) + "\n")

    t0 = time.perf_counter()
    model = write_model(args.shape, work / "model", args.seed, QWEN_IMAGE_MAX_PIXELS)
    files = write_batch(work / "batch", args.docs, args.pages_per_doc, args.seed)
    warmup = write_batch(work / "warmup", 1, 2, args.seed + 1)[0]
    result["setup_s"] = time.perf_counter() - t0
    pages = args.docs * args.pages_per_doc
    try:
        for part in args.parts:
            env = part_env(args, model, work / f"data-{part}", work / "cuda-cache")
            t1 = time.perf_counter()
            try:
                raw = run_part(part, args, env, work, files, warmup)
                result["runs"][part] = summarise(part, raw, pages) | {"part_s": time.perf_counter() - t1}
            except Exception as exc:  # keep the other runs; the reason is in the JSON
                result["runs"][part] = {"error": f"{type(exc).__name__}: {exc}", "part_s": time.perf_counter() - t1}
            engine = result["runs"].get("engine", {})
            for name, row in result["runs"].items():
                if name != "engine" and "pages_per_s" in row and engine.get("pages_per_s"):
                    result["pipeline_to_engine_ratio"][name] = finite(row["pages_per_s"] / engine["pages_per_s"])
            save()
    finally:
        save()
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    print(table(result))
    return 0 if all("error" not in r for r in result["runs"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())

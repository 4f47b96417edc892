"""Proof that the pipeline's GPU worker runs the CUDA runner with DOCPIPE_RUNNER=cuda and nothing else changed.

For each runner asked for (default: cuda, then reference), two runs over the sample files, each with its own
data dir and SQLite file:
  inproc_<runner>  `docpipe process FILES --json` (embedded: no broker, jobs run in that process)
  celery_<runner>  a throw-away redis-server, `docpipe db upgrade`, `docpipe worker --queues ingest` and
                   `docpipe worker --queues gpu` as processes, `docpipe submit FILES`, `docpipe status --json`
                   polled until every job is terminal, then the workers stopped
A run passes when every file became exactly one document whose one job succeeded with exactly one merged result
and one ok result per page (read back with sqlite3, see pipeline_results). For the GPU worker the check also
requires its start-up line to name the cuda runner, every extraction task to have run in it (its Celery log), and
the CUDA kernels to have been compiled into that run's own module cache (so the runner really ran there).
The runs are then compared: same runner in-process vs Celery, and cuda vs reference. The CUDA runner computes in
bf16 (CudaRunner's default; the engine passes no dtype) while the reference runner is float32, so on the tiny
model's random weights greedy decoding can take another token where two logits nearly tie: those comparisons are
reported, never failed.

    python3 -m tests.cuda_runner.check_pipeline_cuda --out DIR [--runners cuda,reference] \
        [--redis-archive .redis/X.tar.xz]

Without a GPU (or without cuda-python / nvmath) and with cuda among the runners it prints SKIP and exits 0;
`--runners reference` runs the whole flow on the CPU. Exit 1 if any run failed. Writes DIR/summary.json and one
log per run (DIR/<run>.log); tests/cuda_runner/check_pipeline_cuda.sh runs it on the GPU machine.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make `tests.cuda_runner` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.cuda_runner.pipeline_results import DocRow, compare_runs, comparison_json, merged_preview, problems, read_run
from tests.cuda_runner.pipeline_services import Service, ServiceError, install_docpipe_command, start_redis, tail

REPO = Path(__file__).resolve().parents[2]
# The GPU machine has no PyAV (its wheel does not fit the size budget), so videos are left out there.
VIDEO_SUFFIXES = {".mp4", ".mov", ".mkv", ".webm"}
READY_GPU = "engine ready in pid"
EXTRACT_DONE = re.compile(r"Task docpipe\.extract\[[^\]]+\] succeeded in [0-9.]+s: (\{.*\})")


@dataclass
class Run:
    name: str
    runner: str
    mode: str  # inproc | celery
    ok: bool = False
    seconds: float = 0.0
    problems: list[str] = field(default_factory=list)
    evidence: dict[str, Any] = field(default_factory=dict)
    docs: list[DocRow] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        return {"name": self.name, "runner": self.runner, "mode": self.mode, "ok": self.ok,
                "seconds": round(self.seconds, 2), "problems": self.problems, "evidence": self.evidence,
                "documents": [{"name": d.name, "status": d.status, "pages": d.page_count,
                               "jobs": d.jobs, "merged_rows": len(d.merged), "unit_rows": len(d.units),
                               "completion_tokens": sum(u.completion_tokens for u in d.units)} for d in self.docs],
                "merged": merged_preview(self.docs, width=400)}


class GpuSampler:
    """Polls nvidia-smi's compute apps once a second: which pids held GPU memory, and the most each held."""

    def __init__(self) -> None:
        self.enabled = shutil.which("nvidia-smi") is not None
        self.peak_mib: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> "GpuSampler":
        if self.enabled:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self.enabled:
            self._thread.join(5)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                text = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                                       "--format=csv,noheader,nounits"], capture_output=True, text=True,
                                      timeout=10).stdout
            except (OSError, subprocess.SubprocessError):
                text = ""
            for line in text.splitlines():
                parts = [p.strip() for p in line.split(",")]
                if len(parts) == 2 and parts[0].isdigit() and parts[1].isdigit():
                    pid, mib = int(parts[0]), int(parts[1])
                    self.peak_mib[pid] = max(self.peak_mib.get(pid, 0), mib)
            self._stop.wait(1.0)


class Check:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.out = Path(args.out).resolve()
        self.out.mkdir(parents=True, exist_ok=True)
        self.work = Path(tempfile.mkdtemp(prefix="docpipe-cuda-check-", dir=args.workdir))
        self.files = sample_files(Path(args.samples), include_video=args.include_video)
        site, bin_dir = install_docpipe_command(REPO, self.work / "entry")
        self.site, self.bin_dir = site, bin_dir
        self.model_cache = self.work / "model-cache"  # the bundled tiny model, generated once for every run

    # --- environment --------------------------------------------------------------------------------------------
    def env(self, runner: str, data_dir: Path, broker_url: str | None) -> dict[str, str]:
        env = dict(os.environ)
        for key in ("DOCPIPE_BROKER_URL", "DOCPIPE_DATABASE_URL"):
            env.pop(key, None)  # this check's own SQLite file and broker, whatever the caller has set
        paths = [str(self.site), str(REPO)] + [p for p in [env.get("PYTHONPATH")] if p]
        env.update(PYTHONPATH=os.pathsep.join(paths), PATH=os.pathsep.join([str(self.bin_dir), env["PATH"]]),
                   PYTHONUNBUFFERED="1", DOCPIPE_RUNNER=runner, DOCPIPE_DATA_DIR=str(data_dir),
                   DOCPIPE_CACHE_DIR=str(self.model_cache), DOCPIPE_CUDA_CACHE=str(data_dir / "cuda-modules"))
        if broker_url:
            env["DOCPIPE_BROKER_URL"] = broker_url
        return env

    def docpipe(self, args: list[str], env: dict[str, str], cwd: Path, log: Path,
                timeout: float) -> subprocess.CompletedProcess[str]:
        """Run one `docpipe` command; its stderr (and a header) goes to the run's log, stdout is returned."""
        with open(log, "a") as fh:
            fh.write(f"\n===== $ docpipe {' '.join(args)}\n")
            fh.flush()
            done = subprocess.run([str(self.bin_dir / "docpipe"), *args], env=env, cwd=cwd, stdout=subprocess.PIPE,
                                  stderr=fh, text=True, timeout=timeout)
            fh.write(f"===== exit code {done.returncode}\n")
        return done

    # --- runs ---------------------------------------------------------------------------------------------------
    def run_inproc(self, runner: str) -> Run:
        run = Run(f"inproc_{runner}", runner, "inproc")
        data = self.work / run.name
        data.mkdir()
        log = self.out / f"{run.name}.log"
        env = self.env(runner, data, None)
        started = time.monotonic()
        with GpuSampler() as gpu:
            done = self.docpipe(["process", *map(str, self.files), "--json"], env, data, log, self.args.timeout)
        run.seconds = time.monotonic() - started
        with open(log, "a") as fh:
            fh.write("===== stdout (process report)\n" + done.stdout + "\n")
        if done.returncode != 0:
            run.problems.append(f"docpipe process exited with code {done.returncode}")
        self.finish(run, data, gpu)
        return run

    def run_celery(self, runner: str, redis_port: int, db_index: int) -> Run:
        run = Run(f"celery_{runner}", runner, "celery")
        data = self.work / run.name
        data.mkdir()
        log = self.out / f"{run.name}.log"
        env = self.env(runner, data, f"redis://127.0.0.1:{redis_port}/{db_index}")
        started = time.monotonic()
        services: list[Service] = []
        try:
            with GpuSampler() as gpu:
                up = self.docpipe(["db", "upgrade"], env, data, log, 120)  # once, before two workers race to it
                if up.returncode != 0:
                    raise ServiceError(f"docpipe db upgrade exited with code {up.returncode}")
                ingest = Service("ingest worker", [str(self.bin_dir / "docpipe"), "worker", "--queues", "ingest",
                                                   "--concurrency", "2", "--hostname", "ingest@check"],
                                 env, data / "ingest.log", cwd=data)
                services.append(ingest)
                gpu_worker = Service("gpu worker", [str(self.bin_dir / "docpipe"), "worker", "--queues", "gpu",
                                                    "--hostname", "gpu@check"], env, data / "gpu.log", cwd=data)
                services.append(gpu_worker)
                run.evidence["ingest_ready_s"] = round(ingest.wait_for("ingest@check ready.", 120), 1)
                run.evidence["gpu_engine_ready_s"] = round(gpu_worker.wait_for(READY_GPU, self.args.timeout), 1)
                gpu_worker.wait_for("gpu@check ready.", 120)
                submitted = self.docpipe(["submit", *map(str, self.files), "--json"], env, data, log, 120)
                if submitted.returncode != 0:
                    raise ServiceError(f"docpipe submit exited with code {submitted.returncode}")
                run.evidence["submit"] = json.loads(submitted.stdout)
                run.evidence["final_status"] = self.wait_terminal(env, data, log, services)
                run.evidence["gpu_worker_pid"] = gpu_worker.pid
        except (ServiceError, subprocess.TimeoutExpired, json.JSONDecodeError) as exc:
            run.problems.append(str(exc))
        finally:
            codes = {s.name: s.stop() for s in reversed(services)}
            run.evidence["worker_exit_codes"] = codes
            run.seconds = time.monotonic() - started
            with open(log, "a") as fh:
                for s in services:
                    fh.write(f"\n===== {s.name} (pid {s.pid}): {' '.join(s.argv[1:])}\n{s.log_text()}")
        if services:
            self.gpu_worker_evidence(run, services[-1].log_text() if len(services) > 1 else "")
        self.finish(run, data, gpu)
        return run

    def wait_terminal(self, env: dict[str, str], data: Path, log: Path, services: list[Service]) -> dict[str, Any]:
        """Poll `docpipe status --json` until every sent file has a terminal job (or failed at intake)."""
        deadline = time.monotonic() + self.args.timeout
        status: dict[str, Any] = {}
        while time.monotonic() < deadline:
            dead = [s.name for s in services if not s.alive()]
            if dead:
                raise ServiceError(f"{', '.join(dead)} exited while jobs were pending")
            done = subprocess.run([str(self.bin_dir / "docpipe"), "status", "--json"], env=env, cwd=data,
                                  capture_output=True, text=True, timeout=60)
            if done.returncode == 0:
                status = json.loads(done.stdout)
                states = status["jobs_by_state"]
                finished = sum(states.get(s, 0) for s in ("succeeded", "partial", "failed"))
                pending = states.get("queued", 0) + states.get("running", 0)
                if pending == 0 and finished + status["documents_unreadable"] >= len(self.files):
                    with open(log, "a") as fh:
                        fh.write("\n===== $ docpipe status --json (final)\n" + done.stdout)
                    return status
            time.sleep(2.0)
        raise ServiceError(f"jobs not terminal within {self.args.timeout:.0f} s; last status: {json.dumps(status)}")

    def gpu_worker_evidence(self, run: Run, text: str) -> None:
        """What the GPU worker's own log shows: its runner, and the extraction tasks it ran."""
        ready = [line for line in text.splitlines() if READY_GPU in line]
        run.evidence["gpu_worker_ready_line"] = ready[0].strip() if ready else None
        if not ready or f"({run.runner} runner)" not in ready[0]:
            run.problems.append(f"the gpu worker's start-up line does not name the {run.runner} runner: "
                                f"{ready[0].strip() if ready else 'no such line'}")
        ran = [m.group(1) for m in EXTRACT_DONE.finditer(text)]
        succeeded = [r for r in ran if "'state': 'succeeded'" in r and "'ran': True" in r]
        run.evidence["gpu_worker_extract_tasks_succeeded"] = len(succeeded)
        if len(succeeded) != len(self.files):
            run.problems.append(f"the gpu worker's log shows {len(succeeded)} extraction task(s) that ran and "
                                f"succeeded, expected {len(self.files)}")

    def finish(self, run: Run, data: Path, gpu: GpuSampler) -> None:
        db = data / "docpipe.sqlite"
        if db.is_file():
            run.docs = read_run(db)
            run.problems += problems(run.docs, [f.name for f in self.files])
        else:
            run.problems.append(f"no database at {db}")
        cubins = sorted((data / "cuda-modules").glob("*.cubin"))
        run.evidence["cuda_modules_compiled"] = len(cubins)
        if run.runner == "cuda" and not cubins:
            run.problems.append("no CUDA module was compiled into this run's cache: the CUDA runner did not run")
        if gpu.enabled:
            run.evidence["gpu_pids_peak_mib"] = {str(k): v for k, v in sorted(gpu.peak_mib.items())}
        run.ok = not run.problems


def sample_files(folder: Path, include_video: bool) -> list[Path]:
    """The sample media in `folder` (not its README or generator script), videos only when asked for."""
    files = [f for f in sorted(folder.iterdir()) if f.is_file() and not f.name.startswith(".")
             and f.suffix.lower() not in {".py", ".md", ".txt"}]
    return [f for f in files if include_video or f.suffix.lower() not in VIDEO_SUFFIXES]


def gpu_unavailable() -> str | None:
    """Why the CUDA runner cannot run here (None: it can). Checked in a child so this process holds no context."""
    probe = ("from gpu_engine.cuda.device import require_gpu; require_gpu(); import gpu_engine.cuda.runner")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO)] + [p for p in [os.environ.get("PYTHONPATH")]
                                                                         if p]))
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=300)
    if done.returncode == 0:
        return None
    lines = (done.stderr or done.stdout).strip().splitlines()
    return lines[-1] if lines else f"probe exited with code {done.returncode}"


def runner_facts() -> dict[str, Any]:
    """The compute dtype of each runner, read from the code, for the comparison's explanation."""
    facts: dict[str, Any] = {"reference": "float32 (numpy)"}
    try:
        import inspect

        from gpu_engine.cuda.runner import CudaRunner

        facts["cuda"] = inspect.signature(CudaRunner.__init__).parameters["dtype"].default
    except Exception as exc:  # nvmath / cuda-python missing here: the source says it, the import cannot
        facts["cuda"] = f"unknown here ({type(exc).__name__}: {exc})"
    return facts


def comparisons(runs: dict[str, Run]) -> dict[str, Any]:
    pairs = [("inproc_cuda", "celery_cuda"), ("inproc_reference", "celery_reference"),
             ("inproc_reference", "inproc_cuda"), ("celery_reference", "celery_cuda")]
    return {f"{a} vs {b}": comparison_json(compare_runs(runs[a].docs, runs[b].docs))
            for a, b in pairs if a in runs and b in runs}


def table(runs: list[Run], compared: dict[str, Any]) -> str:
    lines = [f"{'run':<18} {'ok':<4} {'seconds':>8}  {'docs':>4}  evidence / problems"]
    for r in runs:
        ev = r.evidence
        notes = [f"cubins={ev.get('cuda_modules_compiled', 0)}"]
        if r.mode == "celery":
            notes.append(f"gpu-worker tasks={ev.get('gpu_worker_extract_tasks_succeeded', '-')}")
            notes.append(f"engine ready {ev.get('gpu_engine_ready_s', '-')} s")
        lines.append(f"{r.name:<18} {'PASS' if r.ok else 'FAIL':<4} {r.seconds:>8.1f}  {len(r.docs):>4}  "
                     + ", ".join(notes))
        lines += [f"{'':<18} - {p}" for p in r.problems]
    for pair, rows in compared.items():
        same = sum(row["merged_equal"] for row in rows)
        units = sum(row["units_equal"] for row in rows)
        total = sum(row["units_total"] for row in rows)
        firsts = "; ".join(f"{row['name']} {row['first_difference']}" for row in rows if row["first_difference"])
        lines.append(f"compare {pair}: merged JSON equal {same}/{len(rows)}, unit texts equal {units}/{total}"
                     + (f" (first differences: {firsts})" if firsts else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder for summary.json and the run logs")
    parser.add_argument("--runners", default="cuda,reference", help="comma list of cuda and/or reference")
    parser.add_argument("--samples", default=str(REPO / "samples"))
    parser.add_argument("--include-video", action="store_true", help="also send the videos (needs PyAV)")
    parser.add_argument("--redis-archive", help="carried redis (.tar.xz of redis-server + lib/); else PATH's")
    parser.add_argument("--workdir", help="parent of the temporary data dirs (default: the system temp dir)")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds for one run's jobs / engine start")
    parser.add_argument("--keep", action="store_true", help="keep the temporary data dirs")
    args = parser.parse_args(argv)
    runners = [r.strip() for r in args.runners.split(",") if r.strip()]
    if not runners or any(r not in ("cuda", "reference") for r in runners):
        parser.error(f"--runners takes cuda and/or reference, got {args.runners!r}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if "cuda" in runners:
        reason = gpu_unavailable()
        if reason is not None:
            print(f"SKIP: the CUDA runner cannot run here: {reason} (use --runners reference for the CPU flow)")
            (out / "summary.json").write_text(json.dumps({"skipped": reason}, indent=1))
            return 0
    check = Check(args)
    print(f"samples: {', '.join(f.name for f in check.files)}"
          + ("" if args.include_video else " (videos left out: no PyAV on the GPU machine)"), flush=True)
    # A `timeout` around this script sends SIGTERM: unwind, so the workers are stopped and their logs kept.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    runs: dict[str, Run] = {}
    redis: Service | None = None
    failure: str | None = "interrupted"
    try:
        archive = Path(args.redis_archive) if args.redis_archive else None
        redis, port = start_redis(check.work, archive=archive)
        print(f"redis-server on 127.0.0.1:{port} (pid {redis.pid})", flush=True)
        for db_index, runner in enumerate(runners):
            for mode in ("inproc", "celery"):
                print(f"== {mode}_{runner}", flush=True)
                run = check.run_inproc(runner) if mode == "inproc" else check.run_celery(runner, port, db_index)
                runs[run.name] = run
                print(f"   {'PASS' if run.ok else 'FAIL'} in {run.seconds:.1f} s"
                      + "".join(f"\n   - {p}" for p in run.problems), flush=True)
        failure = None
    except ServiceError as exc:
        failure = str(exc)
    finally:
        if redis is not None:
            redis.stop(grace=5)
            (out / "redis.log").write_text(tail(redis.log_text(), 200))
        if not args.keep:
            shutil.rmtree(check.work, ignore_errors=True)
        compared = comparisons(runs)
        summary = {"ok": failure is None and all(r.ok for r in runs.values()) and len(runs) == 2 * len(runners),
                   "failure": failure, "runners": runners, "samples": [f.name for f in check.files],
                   "videos_left_out": not args.include_video, "runner_dtype": runner_facts(),
                   "python": sys.version.split()[0], "runs": [r.as_json() for r in runs.values()],
                   "comparisons": compared}
        (out / "summary.json").write_text(json.dumps(summary, indent=1, ensure_ascii=False))
        print(table(list(runs.values()), compared))
        if failure:
            print(f"FAIL: {failure}")
        print("RESULT:", "PASS" if summary["ok"] else "FAIL", flush=True)
    return 0 if summary["ok"] else 1

if __name__ == "__main__":
    sys.exit(main())

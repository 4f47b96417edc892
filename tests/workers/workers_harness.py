"""Test harness for the queue: real Redis, real worker processes (`python -m workers ...`) as subprocesses, and a
SQLite file database in a temporary folder that the test process reads directly.

Each test run claims its own Redis database number (1-15) on 127.0.0.1:6379 with a claim key and flushes it at
the end, so parallel runs and other users of that Redis do not see each other's queues.
"""
from __future__ import annotations

import io
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import redis
from ci_rule import missing
from PIL import Image
from sqlalchemy import func, select

REPO = Path(__file__).resolve().parents[2]
REDIS_HOST, REDIS_PORT = "127.0.0.1", 6379
CLAIM_KEY = "docpipe:test:claim"

# A tiny schema whose valid answer is a few tokens: jobs that finish fast and always succeed.
FLAG_SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
               "additionalProperties": False}


def note_schema(chars: int) -> dict:
    """A schema whose answer is a fixed-length string: each job decodes a predictable number of tokens."""
    return {"type": "object", "properties": {"note": {"type": "string", "minLength": chars, "maxLength": chars}},
            "required": ["note"], "additionalProperties": False}


def require_redis(host: str = REDIS_HOST, port: int = REDIS_PORT) -> None:
    """Skip (printing why) when Redis is not reachable; fail instead on CI, where it must be."""
    try:
        redis.Redis(host=host, port=port, socket_connect_timeout=2).ping()
    except redis.RedisError as exc:
        reason = f"Redis at {host}:{port} is not reachable ({exc}); the queue tests need a real Redis"
        missing(reason)


def claim_redis_db() -> int:
    """A Redis database number no one else uses right now, claimed for this test run."""
    token = uuid.uuid4().hex
    for db in random.sample(range(1, 16), 15):
        client = redis.Redis(host=REDIS_HOST, port=REDIS_PORT, db=db)
        if client.set(CLAIM_KEY, token, nx=True, ex=1800):
            if client.dbsize() == 1:
                return db
            client.delete(CLAIM_KEY)
    pytest.fail("no free Redis database number (1-15) on 127.0.0.1:6379 to run the queue tests in")


def release_redis_db(db: int) -> None:
    redis.Redis(host=REDIS_HOST, port=REDIS_PORT, db=db).flushdb()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def png(size: int = 28, seed: int | None = None) -> bytes:
    """A small random RGB image (random, so every document has its own sha256)."""
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log: Path

    def alive(self) -> bool:
        return self.popen.poll() is None

    def tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return "(no log)"


@dataclass
class Cluster:
    """Settings (as DOCPIPE_* environment) shared by the test process and the worker processes it starts."""

    root: Path
    broker_url: str
    overrides: dict[str, str] = field(default_factory=dict)
    procs: list[Proc] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.data_dir = self.root / "data"
        self.logs = self.root / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self._pipeline = None

    @property
    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("DOCPIPE_")}
        env.update({
            "PYTHONPATH": os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
            "OMP_NUM_THREADS": "1",
            "DOCPIPE_DATA_DIR": str(self.data_dir),
            "DOCPIPE_BROKER_URL": self.broker_url,
            "DOCPIPE_MAX_TOKENS": "48",
            "DOCPIPE_ENGINE_MAX_NUM_SEQS": "4",
            "DOCPIPE_JOB_LEASE_S": "20",
            "DOCPIPE_REQUEST_TIMEOUT_S": "15",
            "DOCPIPE_VISIBILITY_TIMEOUT_S": "120",
            "DOCPIPE_RETRY_BACKOFF_S": "0.2",
            "DOCPIPE_RETRY_BACKOFF_MAX_S": "1",
            "DOCPIPE_REQUEUE_INTERVAL_S": "0.5",
            "DOCPIPE_REQUEUE_QUEUED_AFTER_S": "3",
            "DOCPIPE_BEAT_LOCK_TTL_S": "3",
            "DOCPIPE_WATCH_INTERVAL_S": "0.3",
            "DOCPIPE_STABLE_SECONDS": "0.2",
        })
        if "DOCPIPE_CACHE_DIR" in os.environ:  # where the bundled tiny model is generated (shared, reused)
            env["DOCPIPE_CACHE_DIR"] = os.environ["DOCPIPE_CACHE_DIR"]
        env.update(self.overrides)
        return env

    def settings(self):
        from pipeline.settings import Settings

        fields = Settings.model_fields
        values = {}
        for key, value in self.env.items():
            name = key[len("DOCPIPE_"):].lower() if key.startswith("DOCPIPE_") else None
            if name in fields:
                values[name] = value
        return Settings(**values)

    def worker_settings(self):
        from workers.config import WorkerSettings

        values = {}
        for key, value in self.env.items():
            name = key[len("DOCPIPE_"):].lower() if key.startswith("DOCPIPE_") else None
            if name in WorkerSettings.model_fields:
                values[name] = value
        return WorkerSettings(**values)

    @property
    def pipeline(self):
        if self._pipeline is None:
            from pipeline.context import Pipeline

            self._pipeline = Pipeline(self.settings())
        return self._pipeline

    def register_schema(self, name: str, schema: dict) -> None:
        from pipeline.schemas import register_schema

        with self.pipeline.db.session() as s:
            register_schema(s, name, schema)

    # --- processes -------------------------------------------------------------------------------------------
    def start(self, name: str, *args: str) -> Proc:
        log = self.logs / f"{name}-{len(self.procs)}.log"
        out = open(log, "wb")
        popen = subprocess.Popen([sys.executable, "-m", "workers", *args], cwd=REPO, env=self.env,
                                 stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        out.close()
        proc = Proc(name, popen, log)
        self.procs.append(proc)
        return proc

    def start_worker(self, queues: str, *extra: str) -> Proc:
        return self.start(f"worker-{queues.replace(',', '+')}", "worker", "--queues", queues, *extra)

    def start_beat(self) -> Proc:
        return self.start("beat", "beat")

    def kill(self, proc: Proc, sig: int = signal.SIGKILL) -> None:
        if proc.alive():
            os.killpg(proc.popen.pid, sig)  # the worker and any pool children it started
        proc.popen.wait(timeout=20)

    def stop_all(self) -> None:
        for proc in self.procs:
            if proc.alive():
                os.killpg(proc.popen.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for proc in self.procs:
            try:
                proc.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.popen.pid, signal.SIGKILL)
                proc.popen.wait(timeout=5)
        if self._pipeline is not None:
            self._pipeline.close()

    def logs_text(self) -> str:
        return "\n".join(f"--- {p.name} ({p.log.name}, alive={p.alive()})\n{p.tail()}" for p in self.procs)

    # --- database views --------------------------------------------------------------------------------------
    def receive(self, data: bytes, name: str, schema: str) -> int:
        """Receive in this process and publish the job's preparation (what the API does with an upload): the
        ingest queue renders the pages, then sends the job to the gpu queue. Returns the job id."""
        from pipeline.ingest import receive_file
        from workers.enqueue import enqueue_prepare

        out = receive_file(self.pipeline, data, name=name, schema=schema)
        assert out.job_id is not None and not out.rendered, out
        assert enqueue_prepare(out.job_id, settings=self.settings(), worker_settings=self.worker_settings())
        return out.job_id

    def ingest(self, data: bytes, name: str, schema: str, *, enqueue: bool = True) -> int:
        """Ingest (and render) in this process and enqueue the job on the gpu queue; returns the job id."""
        from pipeline.ingest import ingest_file

        out = ingest_file(self.pipeline, data, name=name, schema=schema)
        assert out.job_id is not None, out
        if enqueue:
            self.enqueue(out.job_id)
        return out.job_id

    def enqueue(self, job_id: int) -> None:
        from workers.enqueue import enqueue_job

        assert enqueue_job(job_id, settings=self.settings(), worker_settings=self.worker_settings())

    def job_states(self) -> dict[str, int]:
        from pipeline.models import Job

        with self.pipeline.db.read_session() as s:
            return {state: n for state, n in s.execute(select(Job.state, func.count()).group_by(Job.state))}

    def jobs(self) -> list:
        from pipeline.models import Job

        with self.pipeline.db.read_session() as s:
            return list(s.scalars(select(Job).order_by(Job.id)))

    def result_units(self) -> dict[int, list[str]]:
        from pipeline.models import Result

        out: dict[int, list[str]] = {}
        with self.pipeline.db.read_session() as s:
            for job_id, unit in s.execute(select(Result.job_id, Result.unit).order_by(Result.id)):
                out.setdefault(job_id, []).append(unit)
        return out

    def wait_for(self, what: str, predicate: Callable[[], bool], timeout: float, poll: float = 0.2) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return
            time.sleep(poll)
        pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}; jobs: {self.job_states()}\n"
                    f"{self.logs_text()}")


def start_redis_server(root: Path, port: int) -> subprocess.Popen:
    """A private redis-server without persistence (a restart loses every message, like a crashed broker)."""
    exe = shutil.which("redis-server")
    if exe is None:
        missing("redis-server is not installed; the broker-restart test starts its own instance")
    root.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", str(root), "--logfile", str(root / f"redis-{port}.log")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=1)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            client.ping()
            return proc
        except redis.RedisError:
            time.sleep(0.05)
    proc.kill()
    pytest.fail(f"our redis-server on port {port} did not start")

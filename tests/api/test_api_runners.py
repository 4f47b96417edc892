"""Background pieces: the embedded job runner (retries while queued) and the sweep of stale partial uploads."""
from __future__ import annotations

import threading
import time

from api.runners import EmbeddedRunner
from pipeline.errors import NotFoundError


def _wait(predicate, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def test_runs_submitted_and_pending_jobs_once_each() -> None:
    ran: list[int] = []
    lock = threading.Lock()

    def run(job_id: int) -> None:
        with lock:
            ran.append(job_id)

    runner = EmbeddedRunner(run, threads=2, pending=lambda: [7, 8])
    runner.start()
    runner.submit([1, 2, 3])
    assert _wait(lambda: len(ran) == 5)
    assert runner.problem() is None
    runner.stop()
    assert sorted(ran) == [1, 2, 3, 7, 8]
    assert runner.problem() == "an embedded worker thread has stopped"  # /readyz would say so


def test_a_failing_job_is_retried_while_queued_and_dropped_when_not() -> None:
    calls: dict[int, int] = {}
    queued = {1: True, 2: False}

    def run(job_id: int) -> None:
        calls[job_id] = calls.get(job_id, 0) + 1
        if job_id == 1 and calls[job_id] < 3:
            raise RuntimeError("engine hiccup")
        if job_id == 2:
            raise RuntimeError("failed for good")  # the pipeline marked it failed: not queued any more
        if job_id == 3:
            raise NotFoundError("job", 3)

    runner = EmbeddedRunner(run, threads=1, still_queued=lambda j: queued.get(j, False), retry_delay_s=0.02)
    runner.start()
    runner.submit([1, 2, 3])
    assert _wait(lambda: calls.get(1) == 3)
    time.sleep(0.2)
    runner.stop()
    assert calls == {1: 3, 2: 1, 3: 1}


def test_duplicate_submissions_of_a_waiting_job_run_it_once() -> None:
    gate = threading.Event()
    ran: list[int] = []

    def run(job_id: int) -> None:
        gate.wait(5)
        ran.append(job_id)

    runner = EmbeddedRunner(run, threads=1)
    runner.start()
    runner.submit([1])  # taken by the thread, blocked on the gate
    assert _wait(lambda: runner.queue_depth() == 0)
    runner.submit([2, 2, 2])
    assert runner.queue_depth() == 1
    gate.set()
    assert _wait(lambda: len(ran) == 2)
    runner.stop()
    assert ran == [1, 2]


def test_sweep_spool_removes_only_old_leftovers(tmp_path) -> None:
    import os

    from api.uploads import sweep_spool

    old, fresh, other = tmp_path / "upload-a.part", tmp_path / "upload-b.part", tmp_path / "keep.txt"
    for path in (old, fresh, other):
        path.write_bytes(b"x")
    os.utime(old, (time.time() - 7200, time.time() - 7200))
    os.utime(other, (time.time() - 7200, time.time() - 7200))
    assert sweep_spool(tmp_path, older_than_s=3600) == 1
    assert not old.exists() and fresh.exists() and other.exists()
    assert sweep_spool(tmp_path / "missing", older_than_s=0) == 0


class _FakePipeline:
    """Stands in for pipeline.Pipeline: `client` blocks until released, then returns or raises."""

    def __init__(self, fail: bool = False) -> None:
        self.release = threading.Event()
        self.fail = fail

    @property
    def client(self):
        self.release.wait(10)
        if self.fail:
            raise FileNotFoundError("no config.json in /models/x")

        class _Engine:
            is_running = True

            def stats(self) -> dict:
                return {"running": 3, "waiting": 1, "kv_usage": 0.25}

        class _Client:
            async_engine = _Engine()

        return _Client()


class _GatedPipeline:
    """A Pipeline stand-in whose engine (the bundled tiny model, reference runner) loads only once `release` is set,
    so the loading state can be observed without a race. The engine is built for this test alone: the test shuts it
    down, and the process-wide engine that `Pipeline.client` shares with every other test must keep running."""

    def __init__(self, settings) -> None:
        self.settings = settings
        self.release = threading.Event()
        self.built = None

    @property
    def client(self):
        from pipeline.engine_client import EngineClient

        self.release.wait(60)
        if self.built is None:
            self.built = EngineClient.from_settings(self.settings)
        return self.built


def test_engine_access_reports_loading_then_ready(tmp_path) -> None:
    import pytest

    from api.engine_access import EngineAccess, EngineUnavailable
    from gpu_engine.params import SamplingParams
    from pipeline.settings import Settings

    gated = _GatedPipeline(Settings(data_dir=tmp_path / "data", engine_max_num_seqs=2))
    access = EngineAccess(gated, preload=True)  # type: ignore[arg-type]  # a stand-in pipeline
    try:
        access.start()
        assert access.status() == "loading the model" and access.stats() is None
        with pytest.raises(EngineUnavailable) as err:
            access.async_engine()
        assert err.value.status == 503 and err.value.headers["Retry-After"]
        gated.release.set()
        assert _wait(lambda: access.status() is None, timeout=120)
        engine = access.async_engine()
        assert gated.built is not None and engine is gated.built.async_engine and engine.is_running
        before = access.stats()
        assert before is not None and before["model_fingerprint"] == gated.built.model_fingerprint
        out = engine.generate([1, 2, 3], SamplingParams(max_tokens=3, temperature=0.0))
        assert len(out.token_ids) == 3
        # /metrics sees the engine's own counters move
        assert _wait(lambda: access.stats()["sampled_tokens"] >= before["sampled_tokens"] + 3, timeout=10)
        engine.shutdown()  # a dead step loop is reported, not taken for ready
        assert access.status() is not None and "step loop has stopped" in access.status()
    finally:
        gated.release.set()
        if gated.built is not None:
            gated.built.close()


def test_engine_access_reports_a_failed_load() -> None:
    from api.engine_access import EngineAccess

    fake = _FakePipeline(fail=True)
    fake.release.set()
    access = EngineAccess(fake, preload=True)  # type: ignore[arg-type]  # a stand-in pipeline
    access.start()
    assert _wait(lambda: access.status() is not None and access.status().startswith("failed to load"))
    assert "config.json" in (access.status() or "")


def test_content_locks_serialise_equal_keys_only() -> None:
    from api.intake import ContentLocks

    locks = ContentLocks()
    inside: list[str] = []
    overlap = []

    def work(key: str) -> None:
        with locks.hold(key):
            overlap.append(sum(1 for k in inside if k == key))
            inside.append(key)
            time.sleep(0.05)
            inside.remove(key)

    threads = [threading.Thread(target=work, args=(k,)) for k in ["a", "a", "a", "b", "b"]]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert overlap == [0] * 5  # never two holders of one key at once
    assert time.monotonic() - start < 0.05 * 5  # different keys did run side by side
    assert len(locks) == 0  # nothing kept once released


def test_unexpected_errors_become_problem_documents() -> None:
    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    from starlette.routing import Route
    from starlette.testclient import TestClient

    from api.auth import Gate, KeyRing
    from api.limits import RateLimiter
    from api.metrics import HttpMetrics, Metrics
    from api.middleware import ApiMiddleware

    def boom(request):
        raise RuntimeError("secret internal detail")

    # Placed as in create_app: inside Starlette's last-resort handler, which would answer and then re-raise.
    metrics = Metrics()
    middleware = Middleware(ApiMiddleware, metrics=HttpMetrics(metrics), limit_for=lambda method, path: 1024,
                            gate=Gate(KeyRing([]), RateLimiter(6000, 100)))
    app = Starlette(routes=[Route("/boom", boom)], middleware=[middleware])
    with TestClient(app) as c:  # raises server exceptions by default: passing means none escaped
        r = c.get("/boom")
    assert r.status_code == 500 and r.headers["content-type"] == "application/problem+json"
    body = r.json()
    assert body["code"] == "internal_error" and len(body["incident"]) == 12
    # Counted as the 500 it was answered with.
    assert metrics.registry.get_sample_value("docpipe_http_requests_total",
                                             {"method": "GET", "route": "/boom", "status": "500"}) == 1
    assert "secret" not in r.text and "Traceback" not in r.text

"""Timers put into a running docpipe process (embedded run, GPU worker, engine-only run) by bench/pipeline_part.py:
where the process's threads spend their time, measured by wrapping the functions that do the work.

    probe = install(Path("gpu.probe"))   # wraps the functions below; a watcher answers snapshot requests
    request_snapshot(Path("gpu.probe"), "t0")  # from another process: gpu.probe.t0.json appears
    split = delta(before, after)         # what happened between two snapshots

Timed (thread-seconds, summed over threads; a nested call inside an already-timed one of the same name counts once):
- engine_step: `Engine.step` (one forward + sampling + outputs); also the number of steps and, per step, the
  sequences running when it began (its batch);
- db_txn: inside `pipeline.db.Database.session()` / `read_session()` blocks (SQLite write-lock waits included);
  db_sql: SQL statements at the cursor; db_commit: the DBAPI commits (SQLite's WAL write);
- render: `pipeline.rendering.render_pages` (the isolated render process, PNG encoding, blob store);
- page_images: `pipeline.jobs._unit_input` (a job's page images from the cache, or PNG decoding);
- build_request / interpret: `pipeline.jobs.build_request` / `pipeline.jobs.interpret_reply` (answer parsing,
  jsonschema validation, confidences);
- page_prep: `pipeline.page_prep.PagePrepPool.prepare` (a job thread waiting for a preparation process and copying
  its pixels out; the preparation itself runs in the child, outside this process's CPU time);
- inside the steps, for every engine built in the process (bench/step_profile.StepProfile attached at its
  construction): vision encodes, prefill / decode forwards, grammar masks, host scheduling (the rest of the step),
  and the processor's image preprocessing on the submitting threads; and the engine's batch sizes as built.
Each snapshot also holds the process CPU time and wall clocks, so a part's split is the delta over its window.
"""
from __future__ import annotations

import contextlib
import functools
import json
import os
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Iterator

POLL_S = 0.02


class Probe:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.step_rows = 0  # sum over steps of the sequences running at the step's start
        self.profiles: list[Any] = []  # a StepProfile per engine built here
        self.engine_config: dict[str, int] = {}
        self._depth = threading.local()

    @contextlib.contextmanager
    def region(self, name: str) -> Iterator[None]:
        depth = getattr(self._depth, name, 0)
        setattr(self._depth, name, depth + 1)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            setattr(self._depth, name, depth)
            if depth == 0:
                self.add(name, time.perf_counter() - t0)

    def add(self, name: str, seconds: float) -> None:
        with self.lock:
            self.seconds[name] += seconds
            self.calls[name] += 1

    def wrap(self, owner: Any, attr: str, name: str) -> None:
        fn = getattr(owner, attr)

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            with self.region(name):
                return fn(*args, **kwargs)

        setattr(owner, attr, timed)

    def wrap_context(self, owner: Any, attr: str, name: str) -> None:
        """A method returning a context manager: time from entering it to leaving it."""
        fn = getattr(owner, attr)

        @functools.wraps(fn)
        @contextlib.contextmanager
        def timed(*args: Any, **kwargs: Any) -> Iterator[Any]:
            with self.region(name), fn(*args, **kwargs) as value:
                yield value

        setattr(owner, attr, timed)

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            seconds = dict(self.seconds)
            for name, value in self._inside_steps().items():
                seconds[name] = value
            return {"time": time.time(), "perf": time.perf_counter(), "cpu_s": time.process_time(),
                    "seconds": seconds, "calls": dict(self.calls), "step_rows": self.step_rows,
                    "engine_config": dict(self.engine_config)}

    def _inside_steps(self) -> dict[str, float]:
        out = dict.fromkeys(("step_vision_encode", "step_prefill_forward", "step_decode_forward", "step_grammar_mask",
                             "step_host", "image_preprocessing"), 0.0)
        for profile in self.profiles:
            for r in list(profile.steps):
                out["step_vision_encode"] += r.encode_s
                out["step_prefill_forward" if r.has_prefill else "step_decode_forward"] += r.forward_s
                out["step_grammar_mask"] += r.mask_s
                out["step_host"] += r.host_s
            out["image_preprocessing"] += profile.prepare_s
        return out


def _wrap_engine_step(probe: Probe) -> None:
    from gpu_engine.engine import Engine

    step = Engine.step

    @functools.wraps(step)
    def timed(self: Any, *args: Any, **kwargs: Any) -> Any:
        rows = len(self.scheduler.running)
        t0 = time.perf_counter()
        try:
            return step(self, *args, **kwargs)
        finally:
            probe.add("engine_step", time.perf_counter() - t0)
            with probe.lock:
                probe.step_rows += rows

    Engine.step = timed  # type: ignore[method-assign]  # a bench probe, this process only
    init = Engine.__init__

    @functools.wraps(init)
    def built(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        from step_profile import StepProfile

        cfg = self.config
        with probe.lock:
            probe.profiles.append(StepProfile.attach(self))
            probe.engine_config.update(max_num_seqs=cfg.max_num_seqs, max_batched_tokens=cfg.max_batched_tokens,
                                       cache_bytes=int(self.cache_bytes))

    Engine.__init__ = built  # type: ignore[method-assign]  # a bench probe, this process only


def _wrap_sql(probe: Probe) -> None:
    from sqlalchemy import event
    from sqlalchemy.engine import Engine as SqlEngine
    from sqlalchemy.engine.default import DefaultDialect

    started = threading.local()

    @event.listens_for(SqlEngine, "before_cursor_execute")
    def before(*_: Any) -> None:
        started.t = time.perf_counter()

    @event.listens_for(SqlEngine, "after_cursor_execute")
    def after(*_: Any) -> None:
        t0 = getattr(started, "t", None)
        if t0 is not None:
            probe.add("db_sql", time.perf_counter() - t0)
            started.t = None

    probe.wrap(DefaultDialect, "do_commit", "db_commit")


def install(path: Path | None = None, *, engine: bool = True, pipeline: bool = True) -> Probe:
    """Wrap the timed functions in this process; with `path`, answer snapshot requests (request_snapshot)."""
    probe = Probe()
    if engine:
        _wrap_engine_step(probe)
    if pipeline:
        import pipeline.db
        import pipeline.jobs
        import pipeline.rendering

        probe.wrap_context(pipeline.db.Database, "session", "db_txn")
        probe.wrap_context(pipeline.db.Database, "read_session", "db_txn")
        _wrap_sql(probe)
        probe.wrap(pipeline.rendering, "render_pages", "render")
        probe.wrap(pipeline.jobs, "_unit_input", "page_images")
        probe.wrap(pipeline.jobs, "build_request", "build_request")
        probe.wrap(pipeline.jobs, "interpret_reply", "interpret")
        import pipeline.page_prep

        probe.wrap(pipeline.page_prep.PagePrepPool, "prepare", "page_prep")
    if path is not None:
        threading.Thread(target=_answer, args=(probe, Path(path)), name="bench-probe", daemon=True).start()
    return probe


def _answer(probe: Probe, path: Path) -> None:
    """Watch `path`.req; for each new tag written there, write `path`.<tag>.json (atomically)."""
    req, seen = path.with_name(path.name + ".req"), ""
    while True:
        try:
            tag = req.read_text().strip()
        except OSError:
            tag = ""
        if tag and tag != seen:
            seen = tag
            tmp = path.with_name(f"{path.name}.{tag}.tmp")
            tmp.write_text(json.dumps(probe.snapshot()))
            os.replace(tmp, snapshot_path(path, tag))
        time.sleep(POLL_S)


def snapshot_path(path: Path, tag: str) -> Path:
    return path.with_name(f"{path.name}.{tag}.json")


def request_snapshot(path: Path, tag: str, timeout: float = 10.0) -> dict[str, Any]:
    """Ask the process probed at `path` for a snapshot and wait for it."""
    req = path.with_name(path.name + ".req")
    tmp = req.with_name(req.name + ".tmp")
    tmp.write_text(tag)
    os.replace(tmp, req)
    out, deadline = snapshot_path(path, tag), time.monotonic() + timeout
    while not out.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no probe snapshot {out.name} within {timeout} s (is the probed process alive?)")
        time.sleep(POLL_S)
    return json.loads(out.read_text())


def delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """What the process did between two snapshots: wall, CPU, thread-seconds and calls per timer, engine steps."""
    names = sorted(set(after["seconds"]) | set(before["seconds"]))
    calls = {n: after["calls"].get(n, 0) - before["calls"].get(n, 0) for n in names}
    steps = calls.get("engine_step", 0)
    rows = after["step_rows"] - before["step_rows"]
    return {"wall_s": after["perf"] - before["perf"], "cpu_s": after["cpu_s"] - before["cpu_s"],
            "engine_config": after.get("engine_config", {}),
            "thread_s": {n: after["seconds"].get(n, 0.0) - before["seconds"].get(n, 0.0) for n in names},
            "calls": calls, "engine_steps": steps, "mean_batch": rows / steps if steps else 0.0}


def timed_call(probe: Probe, fn: Callable[[], Any]) -> tuple[Any, dict[str, Any]]:
    """Run fn() and return (its value, the probe's delta over it)."""
    before = probe.snapshot()
    value = fn()
    return value, delta(before, probe.snapshot())

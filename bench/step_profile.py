"""A per-step profile of a running Engine, taken from the outside (nothing in gpu_engine changes).

    profile = StepProfile.attach(engine)       # wraps engine.step, runner.forward, the vision encoder, the processor
    ... run requests ...
    profile.reset()                            # after a warm-up
    rows = profile.steps                       # one StepRecord per engine.step()
    profile.detach()

StepProfile.attach(engine, host_profile=True) also runs cProfile over every engine.step() (the engine's own thread
only), so host_profile_top() can say where the host time between forwards goes; it slows the steps, so a run that
is timed should not use it. timeline() lists the steps in order for a plot of the run's phases.

Per step: wall time of step(), of runner.forward (prefill / decode run, its device sync and downloads included),
of vision encodes, of grammar masks (the engine's own mask timer), what was run (limit_model.StepShape) and, for
the cuda runner, the device time between CUDA events recorded on the runner's stream before and after each forward
and encode. Host scheduling = step wall - forward - encode - mask. The processor (image resize / patchify, run on
the submitting threads) is timed apart, as it overlaps the steps.
"""
from __future__ import annotations

import cProfile
import io
import pstats
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from limit_model import StepShape


@dataclass
class StepRecord:
    started_s: float = 0.0  # perf_counter() when the step began
    wall_s: float = 0.0
    forward_s: float = 0.0
    encode_s: float = 0.0
    mask_s: float = 0.0
    schedule_s: float = 0.0  # Scheduler.schedule
    sampling_plan_s: float = 0.0  # Engine._runner_sampling (the step's sampling request, masks included)
    after_s: float = 0.0  # Engine._after_forward (tokens appended, grammars advanced, outputs built)
    wait_s: float = 0.0  # inside forward / encodes: the host blocked on the device (stream syncs, copies back)
    cpu_s: float = 0.0  # the engine thread's CPU time in step() (wall - cpu: waits, and the GIL held elsewhere)
    shape: StepShape = field(default_factory=StepShape)
    events: list[tuple[Any, Any]] = field(default_factory=list, repr=False)  # (start, stop) CUDA events
    encode_events: list[tuple[Any, Any]] = field(default_factory=list, repr=False)  # those around vision encodes
    device_s: float | None = None  # sum of all event spans (forwards and encodes), filled by StepProfile.resolve()
    # device span of the vision encodes alone: encodes are enqueued without waiting (cuda/staging.py), so encode_s
    # is the host's enqueue time and the tower's GPU time shows here (and inside the forward's wait)
    encode_device_s: float | None = None

    @property
    def has_prefill(self) -> bool:
        return bool(self.shape.prefill_chunks or self.shape.vision_grids)

    @property
    def host_s(self) -> float:
        return max(0.0, self.wall_s - self.forward_s - self.encode_s - self.mask_s)


class StepProfile:
    def __init__(self, engine: Any, host_profile: bool = False) -> None:
        self.engine = engine
        self.host_profile = cProfile.Profile() if host_profile else None
        self.steps: list[StepRecord] = []
        self.prepare_s = 0.0
        self.prepare_count = 0
        self._lock = threading.Lock()
        self._current = StepRecord()
        self._saved: list[tuple[Any, str, Any]] = []
        device = getattr(getattr(engine.runner, "ctx", None), "device", None)
        self._device = device if device is not None and hasattr(device, "event") else None
        self._thread = threading.local()

    @classmethod
    def attach(cls, engine: Any, host_profile: bool = False) -> StepProfile:
        profile = cls(engine, host_profile)
        profile._wrap(engine, "step", profile._step)
        profile._wrap(engine.runner, "forward", profile._runner_call(True))
        if getattr(engine.runner, "supports_lookahead", False):  # launched steps (gpu_engine/lookahead.py)
            profile._wrap(engine.runner, "launch", profile._runner_call(True))
            profile._wrap(engine.runner, "finish", profile._runner_call(False))
        profile._wrap(engine.encoder, "_encode", profile._encode)
        if getattr(engine.encoder, "_encode_batch", None) is not None:  # same-grid items in one tower call
            profile._wrap(engine.encoder, "_encode_batch", profile._encode_batch)
        profile._wrap(engine.scheduler, "schedule", profile._timer("schedule_s"))
        profile._wrap(engine, "_after_forward", profile._timer("after_s"))
        if getattr(engine, "_runner_sampling", None) is not None:
            profile._wrap(engine, "_runner_sampling", profile._timer("sampling_plan_s"))
        device = getattr(getattr(engine.runner, "ctx", None), "device", None)
        if device is not None and hasattr(device, "sync"):
            profile._wrap(device, "sync", profile._timer("wait_s"))
        if getattr(engine, "_prepare", None) is not None:
            profile._wrap(engine, "_prepare", profile.timed_prepare)
        return profile

    def detach(self) -> None:
        for obj, name, original in reversed(self._saved):
            setattr(obj, name, original)
        self._saved.clear()

    def reset(self) -> None:
        with self._lock:
            self.steps = []
            self.prepare_s, self.prepare_count = 0.0, 0
        if self.host_profile is not None:
            self.host_profile = cProfile.Profile()

    def resolve(self) -> None:
        """Read the CUDA event spans (call once the device is idle)."""
        for rec in self.steps:
            if (rec.events or rec.encode_events) and rec.device_s is None:
                encode = sum(float(stop - start) for start, stop in rec.encode_events) / 1e3  # events give ms
                rec.device_s = sum(float(stop - start) for start, stop in rec.events) / 1e3 + encode
                rec.encode_device_s = encode
                rec.events, rec.encode_events = [], []

    def timeline(self, t0: float) -> list[list[float]]:
        """One row per step, in order (TIMELINE_COLUMNS): start s after t0, wall s, device s (None without
        events), vision-encode s, mask s, decode rows, multi-token chunks, their tokens (prompt chunks and
        jump-forward runs), vision items encoded, then runner.forward's wall s, the host's waits on the device s,
        Scheduler.schedule s, the sampling plan s (masks included), _after_forward s and the engine thread's CPU
        s."""
        rows = []
        for r in self.steps:
            chunks = r.shape.prefill_chunks
            rows.append([round(r.started_s - t0, 4), round(r.wall_s, 5),
                         None if r.device_s is None else round(r.device_s, 5), round(r.encode_s, 5),
                         round(r.mask_s, 5), len(r.shape.decode_contexts), len(chunks), sum(n for _, n, _ in chunks),
                         len(r.shape.vision_grids), round(r.forward_s, 5), round(r.wait_s, 5), round(r.schedule_s, 5),
                         round(r.sampling_plan_s, 5), round(r.after_s, 5), round(r.cpu_s, 5)])
        return rows

    def host_profile_top(self, lines: int = 45) -> list[str]:
        """cProfile's top functions of the engine steps by own time, then by cumulative time ([] when off)."""
        if self.host_profile is None:
            return []
        out = []
        for key in ("tottime", "cumulative"):
            buf = io.StringIO()
            pstats.Stats(self.host_profile, stream=buf).sort_stats(key).print_stats(lines)
            out.extend(buf.getvalue().splitlines())
        return out

    # ---- wrappers ----------------------------------------------------------------------------------------
    def _wrap(self, obj: Any, name: str, make: Callable[[Any], Any]) -> None:
        original = getattr(obj, name)
        self._saved.append((obj, name, original))
        setattr(obj, name, make(original))

    def _timed_on_device(self, fn: Callable[[], Any], encode: bool = False) -> tuple[Any, float]:
        if self._device is None:
            t0 = time.perf_counter()
            return fn(), time.perf_counter() - t0
        if not getattr(self._thread, "current", False):  # cuda.core makes events in the thread's current context
            self._device.dev.set_current()
            self._thread.current = True
        start, stop = self._device.event(), self._device.event()
        self._device.stream.record(start)
        t0 = time.perf_counter()
        out = fn()
        seconds = time.perf_counter() - t0
        self._device.stream.record(stop)
        (self._current.encode_events if encode else self._current.events).append((start, stop))
        return out, seconds

    def _step(self, original: Callable[[], Any]) -> Callable[[], Any]:
        def step() -> Any:
            mask0 = _mask_seconds(self.engine)
            t0, c0 = time.perf_counter(), time.thread_time()
            if self.host_profile is not None:
                self.host_profile.enable()
            try:
                out = original()
            finally:
                if self.host_profile is not None:
                    self.host_profile.disable()
            rec, self._current = self._current, StepRecord()
            rec.started_s = t0
            rec.wall_s = time.perf_counter() - t0
            rec.cpu_s = time.thread_time() - c0
            rec.mask_s = _mask_seconds(self.engine) - mask0
            if rec.forward_s or rec.encode_s:  # steps that ran nothing (idle polls) are not steps of the run
                self.steps.append(rec)
            return out
        return step

    def _timer(self, field_name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """A wrapper adding the call's wall time to the current step's `field_name` (engine thread only)."""
        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            def timed(*args: Any, **kwargs: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    return original(*args, **kwargs)
                finally:
                    rec = self._current
                    setattr(rec, field_name, getattr(rec, field_name) + time.perf_counter() - t0)
            return timed
        return make

    def _runner_call(self, records_batch: bool) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """runner.forward / launch / finish: wall and device span into the step's forward time; forward and launch
        also record what ran (their first argument, the batch). A launch samples the step before it, then enqueues
        its own: its span runs from that sampler to the end of its forward, so spans of consecutive steps do not
        overlap and add up to busy time."""
        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            def call(*args: Any) -> Any:
                out, seconds = self._timed_on_device(lambda: original(*args))
                self._current.forward_s += seconds
                if records_batch:
                    self._record_shape(args[0])
                return out
            return call
        return make

    def _record_shape(self, batch: Any) -> None:
        rec = self._current
        for chunk in batch.chunks:
            n = chunk.num_tokens
            rows = {"none": 0, "last": 1, "all": n}[chunk.logits]
            if n == 1 and chunk.start > 0:
                rec.shape.decode_contexts.append(chunk.start + 1)
            else:
                rec.shape.prefill_chunks.append((chunk.start, n, rows))

    def _encode(self, original: Callable[[Any], Any]) -> Callable[[Any], Any]:
        def encode(item: Any) -> Any:
            out, seconds = self._timed_on_device(lambda: original(item), encode=True)
            self._current.encode_s += seconds
            self._current.shape.vision_grids.append(tuple(int(x) for x in item.grid_thw))
            return out
        return encode

    def _encode_batch(self, original: Callable[[Any], Any]) -> Callable[[Any], Any]:
        def encode_batch(items: Any) -> Any:
            out, seconds = self._timed_on_device(lambda: original(items), encode=True)
            self._current.encode_s += seconds
            self._current.shape.vision_grids.extend(tuple(int(x) for x in item.grid_thw) for item in items)
            return out
        return encode_batch

    def timed_prepare(self, original: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """`original` (messages -> prompt) with its time counted in prepare_s / prepare_count, from any thread."""
        def prepare(messages: Any) -> Any:
            t0 = time.perf_counter()
            out = original(messages)
            with self._lock:
                self.prepare_s += time.perf_counter() - t0
                self.prepare_count += 1
            return out
        return prepare


TIMELINE_COLUMNS = ["start_s", "wall_s", "device_s", "encode_s", "mask_s", "decode_rows", "chunks", "chunk_tokens",
                    "vision_items", "forward_s", "wait_s", "schedule_s", "sampling_plan_s", "after_s", "cpu_s"]


def _mask_seconds(engine: Any) -> float:
    """The engine's grammar-mask timer (Engine._metrics.mask_s; Engine._mask_s before gpu_engine/metrics.py)."""
    metrics = getattr(engine, "_metrics", None)
    return metrics.mask_s if metrics is not None else engine._mask_s

"""AsyncEngine: many callers (HTTP handlers, Celery threads), one engine, one step loop on a background thread.

    front = AsyncEngine(engine)
    h = front.submit(messages, SamplingParams(json_schema=schema))
    out = h.result(timeout=60)                 # blocking wait (threads)
    for piece in front.submit(...).stream():   # blocking streaming
        print(piece.delta, end="")
    out = await front.agenerate(messages, params)       # asyncio (FastAPI)
    async for piece in front.astream(messages, params): ...
    front.shutdown()

Engine state is only touched on the loop thread: submit / cancel queue commands (submit first prepares the prompt
on the caller's thread). A request the engine refuses (bad messages or media, parameters, too long) raises its
RequestError from result() / stream() / agenerate() / astream(); submit() itself raises only EngineStoppedError.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from .engine import Engine, Prompt, RequestError
from .errors import EngineError
from .inputs import ProcessedPrompt
from .params import RequestOutput, SamplingParams

STATS_PERIOD_S = 0.1  # how stale AsyncEngine.stats() may be while the engine is busy

log = logging.getLogger(__name__)

Listener = Callable[[RequestOutput | BaseException], None]


class EngineStoppedError(EngineError, RuntimeError):
    """The AsyncEngine was shut down (or its step loop died); the request cannot complete."""


class Outbox:
    """A request's outputs not yet taken by stream(), at most one unfinished output among them: an output that
    arrives while the previous unfinished one is still waiting replaces it and carries both deltas. A caller that
    only waits for result() (the pipeline) never reads them: kept one by one, a 1,000-token request would hold
    1,000 copies of its growing token and logprob lists, and the garbage collector's walks over them made the
    engine loop's host time per step grow with the output length (bench/results/cuda_notes.md, session 14)."""

    def __init__(self) -> None:
        self._items: deque[RequestOutput | BaseException] = deque()
        self._ready = threading.Condition(threading.Lock())

    def put(self, item: RequestOutput | BaseException) -> None:
        with self._ready:
            last = self._items[-1] if self._items else None
            if isinstance(item, RequestOutput) and isinstance(last, RequestOutput) and not last.finished:
                self._items[-1] = dataclasses.replace(item, delta=last.delta + item.delta)
            else:
                self._items.append(item)
            self._ready.notify()

    def get(self, timeout: float | None = None) -> RequestOutput | BaseException | None:
        """The oldest output (None: nothing came within `timeout` seconds)."""
        with self._ready:
            if not self._ready.wait_for(lambda: self._items, timeout):
                return None
            return self._items.popleft()

    def __len__(self) -> int:
        with self._ready:
            return len(self._items)


class RequestHandle:
    """One submitted request, as seen from any thread."""

    def __init__(self, front: AsyncEngine, request_id: str, listener: Listener | None = None) -> None:
        self.request_id = request_id
        self._front = front
        self._items = Outbox()
        self._done = threading.Event()
        self._final: RequestOutput | None = None
        self._error: BaseException | None = None
        self._listener = listener

    # called on the loop thread
    def _deliver(self, item: RequestOutput | BaseException) -> None:
        if self._done.is_set():
            return
        if isinstance(item, BaseException):
            self._error = item
        elif item.finished:
            self._final = item
        self._items.put(item)
        if self._listener is not None:
            try:
                self._listener(item)
            except Exception:  # a caller's callback (e.g. its event loop is gone) must not stop the step loop
                log.warning("output listener of request %s failed", self.request_id, exc_info=True)
        if self._error is not None or self._final is not None:
            self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def result(self, timeout: float | None = None) -> RequestOutput:
        """The final output; raises TimeoutError if not finished within `timeout` seconds (the request goes on)."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.request_id} not finished after {timeout} s")
        if self._error is not None:
            raise self._error
        assert self._final is not None
        return self._final

    def stream(self, timeout: float | None = None) -> Iterator[RequestOutput]:
        """Outputs as they come (each with its `delta`), ending with the finished one. A reader that falls behind
        gets the latest unfinished output with the deltas it missed joined (Outbox), not one output per step. Use
        once per handle."""
        while True:
            item = self._items.get(timeout)
            if item is None:
                raise TimeoutError(f"request {self.request_id}: no output for {timeout} s")
            if isinstance(item, BaseException):
                raise item
            yield item
            if item.finished:
                return

    def cancel(self) -> None:
        """Abort the request; its final output has finish_reason "abort" (if it had not finished already)."""
        self._front._command(("abort", self.request_id))


class AsyncEngine:
    def __init__(self, engine: Engine, *, idle_wait_s: float = 0.5) -> None:
        self.engine = engine
        self._idle_wait_s = idle_wait_s
        self._commands: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._handles: dict[str, RequestHandle] = {}
        self._stopping = False
        self._dead: BaseException | None = None
        self._stats_lock = threading.Lock()
        self._submit_lock = threading.Lock()  # no request can slip in after the stop command
        self._stats: dict[str, Any] = engine.stats()
        self._stats_at = time.monotonic()
        self._thread = threading.Thread(target=self._loop, name="gpu-engine-step-loop", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------- any thread
    def submit(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        listener: Listener | None = None,
    ) -> RequestHandle:
        """Queue a request. Messages are prepared (chat template, image / video decoding) here, on the caller's
        thread, so big media never stall the step loop. A request-level problem (bad media, bad parameters) is
        raised by the handle's result() / stream(), like every other outcome of the request; only a stopped engine
        raises here."""
        handle = RequestHandle(self, request_id or uuid.uuid4().hex, listener)
        try:
            prompt = self.engine.prepare_prompt(prompt)
        except RequestError as exc:
            if self._stopping or self._dead is not None:
                raise EngineStoppedError("the engine is shut down") from exc
            handle._deliver(exc)
            return handle
        with self._submit_lock:
            if self._stopping or self._dead is not None:
                raise EngineStoppedError(
                    "the engine is shut down" if self._dead is None else f"the engine died: {self._dead}"
                )
            self._command(("add", handle, prompt, params))
        return handle

    def prepare_prompt(self, prompt: Prompt) -> ProcessedPrompt:
        """Messages -> ProcessedPrompt (chat template, media preprocessing, tokenising) on the caller's thread. A
        server calls it on a worker thread and hands the result to astream / agenerate, so its event loop never
        runs that work (submit would run it on the loop). Raises RequestError for bad messages."""
        return self.engine.prepare_prompt(prompt)

    def generate(self, prompt: Prompt, params: SamplingParams | None = None,
                 timeout: float | None = None) -> RequestOutput:
        return self.submit(prompt, params).result(timeout)

    async def agenerate(self, prompt: Prompt, params: SamplingParams | None = None) -> RequestOutput:
        final: RequestOutput | None = None
        async for out in self.astream(prompt, params):
            final = out
        assert final is not None
        return final

    async def astream(self, prompt: Prompt, params: SamplingParams | None = None) -> AsyncIterator[RequestOutput]:
        """Async iterator of outputs; closing it early (client gone, task cancelled, aclose()) aborts the request.
        (A plain `break` out of `async for` closes the generator only when it is garbage-collected: use
        contextlib.aclosing to abort at once.)"""
        loop = asyncio.get_running_loop()
        items: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

        def listener(item: RequestOutput | BaseException) -> None:
            if not loop.is_closed():
                loop.call_soon_threadsafe(items.put_nowait, item)

        handle = self.submit(prompt, params, listener=listener)
        finished = False
        try:
            while True:
                item = await items.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:
                handle.cancel()

    def stats(self) -> dict[str, Any]:
        """Engine counters as of a recent step (at most STATS_PERIOD_S old while busy, exact once the engine is
        idle; a copy; safe from any thread)."""
        with self._stats_lock:
            return dict(self._stats)

    def shutdown(self, timeout: float | None = 10.0) -> None:
        """Stop the loop; requests still running end with finish_reason "abort"."""
        with self._submit_lock:
            self._stopping = True
            self._command(("stop",))
        self._thread.join(timeout)

    @property
    def model_fingerprint(self) -> str:
        return self.engine.model_fingerprint

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive()

    def _command(self, cmd: tuple[Any, ...]) -> None:
        self._commands.put(cmd)
        self._wake.set()

    # ---------------------------------------------------------------- loop thread
    def _refresh_stats(self, now: float) -> None:
        snapshot = self.engine.stats()
        with self._stats_lock:
            self._stats, self._stats_at = snapshot, now

    def _loop(self) -> None:
        try:
            while True:
                if self._drain_commands():
                    break
                if self.engine.has_unfinished():
                    self._dispatch(self.engine.step())
                    # stats() sorts latency windows: refresh the snapshot at most every STATS_PERIOD_S while busy
                    # (a decode step can take ~2 ms) and always once the engine runs dry.
                    now = time.monotonic()
                    if now - self._stats_at >= STATS_PERIOD_S or not self.engine.has_unfinished():
                        self._refresh_stats(now)
                else:
                    self._wake.wait(self._idle_wait_s)
                    self._wake.clear()
        except BaseException as exc:  # an engine bug: fail every caller instead of leaving them waiting
            log.exception("engine step loop died")
            with self._submit_lock:
                self._dead = exc
            for handle in list(self._handles.values()):
                handle._deliver(EngineStoppedError(f"the engine step loop died: {type(exc).__name__}: {exc}"))
            self._handles.clear()
            self._fail_queued(EngineStoppedError(f"the engine step loop died: {exc}"))
            return
        # Orderly stop: abort what is still running and tell its callers.
        for request_id in list(self._handles):
            self.engine.abort(request_id)
        self._dispatch(self.engine.step() if self.engine.has_unfinished() else [])
        for handle in list(self._handles.values()):
            handle._deliver(EngineStoppedError("the engine was shut down"))
        self._handles.clear()
        self._fail_queued(EngineStoppedError("the engine was shut down"))

    def _drain_commands(self) -> bool:
        """Apply queued commands; True when asked to stop."""
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return False
            kind = cmd[0]
            if kind == "stop":
                return True
            if kind == "add":
                _, handle, prompt, params = cmd
                try:
                    self.engine.add_request(prompt, params, request_id=handle.request_id)
                except Exception as exc:  # rejected: only this caller hears about it
                    handle._deliver(exc)
                else:
                    self._handles[handle.request_id] = handle
            elif kind == "abort":
                self.engine.abort(cmd[1])

    def _fail_queued(self, exc: BaseException) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "add":
                cmd[1]._deliver(exc)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            handle = self._handles.get(out.request_id)
            if handle is None:
                continue
            handle._deliver(out)
            if out.finished:
                del self._handles[out.request_id]

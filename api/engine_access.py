"""The engine as this API process sees it: loaded once (shared with embedded jobs), loading state for /readyz,
figures for /metrics.

In embedded mode the engine is loaded in the background at start-up so the first upload does not wait for the
weights, and /readyz says "loading" until it is there. With a broker, jobs run in the workers' engines; this
process loads one only when /v1/chat/completions is first used.
"""
from __future__ import annotations

import logging
import threading
from typing import Any

from pipeline.context import Pipeline

from .errors import ApiError

log = logging.getLogger("docpipe.api.engine")


class EngineUnavailable(ApiError):
    def __init__(self, reason: str) -> None:
        super().__init__(503, "engine_unavailable", f"The model is not available: {reason}",
                         headers={"Retry-After": "5"})


class EngineAccess:
    def __init__(self, pipeline: Pipeline, *, preload: bool) -> None:
        self._pipeline = pipeline
        self._preload = preload
        self._lock = threading.Lock()
        self._loading = False
        self._client: Any = None
        self._error: str | None = None

    def start(self) -> None:
        if self._preload:
            with self._lock:
                self._loading = True
            threading.Thread(target=self._load_quietly, name="docpipe-engine-load", daemon=True).start()

    def _load_quietly(self) -> None:
        try:
            self._load()
        except EngineUnavailable:
            pass  # logged by _load; /readyz and chat requests report it

    def _load(self) -> Any:
        try:
            client = self._pipeline.client  # builds the process-wide engine once (thread-safe)
        except Exception as exc:
            log.exception("loading the engine failed")
            with self._lock:
                self._error = f"{type(exc).__name__}: {exc}"
                self._loading = False
            raise EngineUnavailable(self._error) from exc
        with self._lock:
            self._client, self._error, self._loading = client, None, False
        return client

    def async_engine(self) -> Any:
        """The shared `gpu_engine.AsyncEngine`. While the start-up load runs: 503 with Retry-After. Not loaded
        yet (broker mode): loads it here, blocking, so call it from a worker thread. 503 if it cannot load."""
        with self._lock:
            client, loading = self._client, self._loading
        if client is None and loading:
            raise EngineUnavailable("the model is still loading; retry shortly")
        return _async_engine_of(client or self._load())

    @property
    def model_id(self) -> str:
        """The name clients send as `model`: DOCPIPE_MODEL_ID when set, else the checkpoint folder's name."""
        settings = self._pipeline.settings
        return settings.model_id or settings.resolved_model_dir().name

    def status(self) -> str | None:
        """None when usable (or when this process does not need it yet), else why not."""
        with self._lock:
            if self._error is not None:
                return f"failed to load: {self._error}"
            if self._loading:
                return "loading the model"
            client = self._client
        if client is not None and not _async_engine_of(client).is_running:
            return "the engine's step loop has stopped (see the server log); restart the server"
        return None  # loaded, or (broker mode) loaded on the first chat request

    def stats(self) -> dict[str, Any] | None:
        """The engine's counters (for /metrics), or None when no engine runs in this process."""
        client = self._client
        return None if client is None else _async_engine_of(client).stats()


def _async_engine_of(client: Any) -> Any:
    """The AsyncEngine inside the pipeline's EngineClient (its public `async_engine` property)."""
    return client.async_engine

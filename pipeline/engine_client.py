"""The only place where the pipeline talks to the inference engine.

`ExtractionClient` is what jobs need: submit a batch of requests at once (so the engine's continuous batcher sees
them together) and receive the replies one by one, in request order. `EngineClient` implements it on top of
`gpu_engine.AsyncEngine`; tests of storage or merging may pass any object with the same shape.

`model_key(model_dir)` is a cheap identity of a checkpoint folder, used to dedupe jobs without loading weights:
sha256 over config.json's bytes and every file's name and size, plus the SHA256SUMS file when the folder has one.
Hosts without the weights name the model instead (DOCPIPE_MODEL_ID -> `model_key_for_id`). Quantising at load
(DOCPIPE_ENGINE_QUANTIZE=fp8) makes another model, so it is part of both keys: a document extracted in BF16 is
extracted again in FP8, not answered with the BF16 results. The full weight digest (the engine's
`model_fingerprint`, which names an at-load recipe) is recorded on every result, whatever the key.
"""
from __future__ import annotations

import hashlib
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol, Sequence

from gpu_engine.params import SamplingParams

from .settings import Settings

_GRACE_S = 30.0
log = logging.getLogger(__name__)


@dataclass
class EngineRequest:
    messages: list[dict[str, Any]]
    params: SamplingParams


@dataclass
class EngineReply:
    text: str
    finish_reason: str | None
    error: str | None = None
    token_texts: list[str] = field(default_factory=list)
    token_logprobs: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    seconds: float = 0.0  # wall time from submit to this reply


class ExtractionClient(Protocol):
    model_key: str
    model_fingerprint: str
    engine_version: str

    def run(self, requests: Sequence[EngineRequest]) -> Iterator[EngineReply]:
        """Submit all requests, then yield one reply per request, in request order. A client that can submits
        before returning (jobs call it once a page and keep several calls open: pipeline.page_feed), and closing
        the iterator early cancels the requests not yet answered."""
        ...


def model_key(model_dir: Path, quantize: str | None = None) -> str:
    folder = Path(model_dir)
    digest = hashlib.sha256()
    config = folder / "config.json"
    if not config.is_file():
        raise FileNotFoundError(f"{folder} is not a model checkpoint folder (no config.json)")
    digest.update(config.read_bytes())
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        rel = path.relative_to(folder).as_posix()
        digest.update(f"\n{rel}\t{path.stat().st_size}".encode())
    sums = folder / "SHA256SUMS"
    if sums.is_file():
        digest.update(sums.read_bytes())
    if quantize is not None:  # None keeps the keys of existing jobs
        digest.update(f"\nquantize\t{quantize}".encode())
    return digest.hexdigest()


def model_key_for_id(model_id: str, quantize: str | None = None) -> str:
    """The model key when the model is named by DOCPIPE_MODEL_ID instead of read from its folder."""
    text = f"model-id:{model_id}" if quantize is None else f"model-id:{model_id}\nquantize:{quantize}"
    return hashlib.sha256(text.encode()).hexdigest()


class EngineClient:
    """ExtractionClient backed by one in-process engine (reference or CUDA runner)."""

    def __init__(self, async_engine: Any, *, model_dir: Path, fingerprint: str, timeout_s: float,
                 quantize: str | None = None, max_num_seqs: int = 0, preparer: Any = None) -> None:
        """`preparer`: a pipeline.page_prep.PagePrepPool that prepares the prompts in child processes (None: the
        engine prepares them on the submitting thread)."""
        import gpu_engine

        self._async_engine = async_engine
        self._preparer = preparer
        self._warned_no_space = False
        self.model_key = model_key(model_dir, quantize)
        self.model_fingerprint = fingerprint
        self.engine_version = gpu_engine.__version__
        self._timeout_s = timeout_s
        self.max_num_seqs = max_num_seqs  # the engine's batch as built (0: not known); sizes the page slots

    @property
    def async_engine(self) -> Any:
        """The `gpu_engine.AsyncEngine` behind this client, for callers that talk to the engine directly (the
        API's chat endpoint, /metrics). Shared: do not shut it down, use `close()`."""
        return self._async_engine

    @property
    def prepares_pages(self) -> bool:
        """Whether requests may carry page images as PNG bytes (extraction.PngImage): they are decoded where the
        prompt is prepared, in a preparation process, not on the job's thread."""
        return self._preparer is not None

    @classmethod
    def from_settings(cls, settings: Settings, *,
                      front: Callable[[Any], Any] | None = None) -> "EngineClient":
        """Build the engine described by the settings (loads the weights: call once per process). `front`
        wraps the AsyncEngine the client submits to (the GPU worker's watchdog counts each run's requests)."""
        import gpu_engine

        seqs, tokens = settings.engine_batch()  # 0 = the engine sizes it from the device (cuda)
        config_kwargs: dict[str, Any] = {
            "max_num_seqs": seqs,
            "max_batched_tokens": tokens,
            "max_model_len": settings.engine_max_model_len,
            "lookahead": settings.engine_lookahead,
        }
        if settings.engine_kv_cache_bytes is not None:
            config_kwargs["kv_cache_bytes"] = settings.engine_kv_cache_bytes
        model_dir = settings.resolved_model_dir()
        quantize = settings.engine_quantize_option()
        preparer = None
        if settings.prep_processes():
            from .page_prep import PagePrepPool

            preparer = PagePrepPool(model_dir, settings.prep_processes(), timeout_s=settings.request_timeout_s)
        try:
            engine = gpu_engine.Engine.from_pretrained(
                model_dir, runner=settings.runner, config=gpu_engine.EngineConfig(**config_kwargs), quantize=quantize
            )
        except BaseException:
            if preparer is not None:
                preparer.close()
            raise
        async_engine = gpu_engine.AsyncEngine(engine)
        return cls(
            front(async_engine) if front is not None else async_engine,
            model_dir=model_dir,
            fingerprint=engine.model_fingerprint,
            timeout_s=settings.request_timeout_s,
            quantize=quantize,
            max_num_seqs=engine.config.max_num_seqs,
            preparer=preparer,
        )

    def run(self, requests: Sequence[EngineRequest]) -> Iterator[EngineReply]:
        """A request the engine refuses (too long, bad media) or that times out becomes a reply with `error`;
        a dead or stopped engine raises (that is the job's problem, not the page's)."""
        started = time.perf_counter()
        # Submitted now, not at the first next(): a job keeps several of these open at once (pipeline.page_feed).
        handles = [self._submit(r) for r in requests]
        return _Replies(self, handles, started)

    def prepare(self, messages: list[dict[str, Any]]) -> Any:
        """What this client submits to the engine for `messages`: the ProcessedPrompt from the page-preparation
        processes, or the messages themselves where there are none (the engine prepares them on the submitting
        thread). Raises RequestError when the processor refuses them."""
        if self._preparer is None:
            return messages
        from .extraction import decode_pngs
        from .page_prep import PrepNoSpace

        try:
            return self._preparer.prepare(messages)
        except PrepNoSpace as exc:  # prepared in this process instead, as without the pool
            if not self._warned_no_space:
                self._warned_no_space = True
                log.warning("%s; preparing such requests in the engine's process (said once)", exc)
            return decode_pngs(messages)

    def _submit(self, request: EngineRequest) -> Any:
        from gpu_engine.engine import RequestError

        try:
            prompt = self.prepare(request.messages)
        except RequestError as exc:  # refused as the engine refuses it: the page's reply carries the reason
            return _Refused(exc)
        return self._async_engine.submit(prompt, request.params)

    def _reply(self, handle: Any, started: float) -> EngineReply:
        from gpu_engine.engine import RequestError

        try:
            # The engine ends a request itself at arrival + timeout_s (SamplingParams); this wait is only the
            # safety net against an engine that stopped answering.
            out = handle.result(self._timeout_s + _GRACE_S)
        except RequestError as exc:
            return EngineReply(text="", finish_reason="error", error=f"the engine refused the request: {exc}",
                               seconds=time.perf_counter() - started)
        except TimeoutError:
            handle.cancel()
            return EngineReply(text="", finish_reason="abort",
                               error=f"no answer within {self._timeout_s + _GRACE_S:.0f} s (DOCPIPE_REQUEST_TIMEOUT_S)",
                               seconds=time.perf_counter() - started)
        logprobs = out.logprobs or []
        return EngineReply(
            text=out.text,
            finish_reason=out.finish_reason,
            error=out.error,
            token_texts=[lp.text for lp in logprobs],
            token_logprobs=[float(lp.logprob) for lp in logprobs],
            prompt_tokens=out.prompt_tokens,
            completion_tokens=out.completion_tokens,
            seconds=time.perf_counter() - started,
        )

    def close(self) -> None:
        self._async_engine.shutdown()
        if self._preparer is not None:
            self._preparer.close()


class _Refused:
    """The handle of a request whose preparation the processor refused: it never reached the engine."""

    request_id = ""

    def __init__(self, error: BaseException) -> None:
        self._error = error

    def result(self, timeout: float | None = None) -> Any:
        raise self._error

    def done(self) -> bool:
        return True

    def cancel(self) -> None:
        pass


class _Replies:
    """One run's replies, in request order; close() cancels the requests not yet answered (the run was taken
    over or failed: the engine need not finish them), whether or not any reply was asked for."""

    def __init__(self, client: EngineClient, handles: list[Any], started: float) -> None:
        self._client, self._handles, self._started = client, handles, started
        self._next = 0

    def __iter__(self) -> "_Replies":
        return self

    def __next__(self) -> EngineReply:
        if self._next >= len(self._handles):
            raise StopIteration
        handle = self._handles[self._next]
        self._next += 1
        return self._client._reply(handle, self._started)

    def close(self) -> None:
        for handle in self._handles[self._next:]:
            handle.cancel()
        self._next = len(self._handles)


_shared: dict[tuple[str, str, str], EngineClient] = {}
_shared_lock = threading.Lock()


def shared_client(settings: Settings) -> EngineClient:
    """One engine per (model, runner, quantize) per process, built on first use (embedded CLI/API runs share it)."""
    key = (str(settings.resolved_model_dir()), settings.runner, settings.engine_quantize)
    with _shared_lock:
        client = _shared.get(key)
        if client is None:
            client = _shared[key] = EngineClient.from_settings(settings)
        return client

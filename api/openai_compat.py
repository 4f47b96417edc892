"""OpenAI-compatible `POST /v1/chat/completions` and `GET /v1/models`, served by our engine.

This module and its media helper (api/media.py) are the api modules that import `gpu_engine` directly. Why: the
endpoint exposes the raw model, so it speaks the engine's own request types (`SamplingParams`, `RequestOutput`);
routing them through `pipeline` would add a pass-through layer with nothing to do. Everything document-shaped still
goes through `pipeline`.

Budget and threads: a request's text and media are counted before anything is decoded (api/media.py,
`ApiLimits.max_prompt_bytes` / `max_images_per_request` / `max_request_pixels`); decoding and tokenising run on a
worker thread, never on the event loop, so one large request cannot stall `/healthz` or other clients; memory the
request used is handed back to the OS when it ends (api/memory.py).
"""
from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import jsonschema
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.types import Receive, Scope, Send

from gpu_engine.async_engine import EngineStoppedError
from gpu_engine.engine import RequestError
from gpu_engine.inputs import ProcessedPrompt
from gpu_engine.params import RequestOutput, SamplingParams, TokenLogprob
from pipeline.errors import SchemaTooComplexError
from pipeline.schemas import check_schema_budget

from .bounds import MAX_SEED
from .errors import ApiError, schema_too_complex
from .limits import ApiLimits, EngineSlots
from .media import MediaBudget, decode_image, decode_video, public_text
from .memory import give_back_memory
from .openai_schema import (
    AssistantMessage,
    ChatCompletion,
    ChatCompletionRequest,
    ChatMessage,
    Choice,
    ChoiceLogprobs,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    TokenLogprobOut,
    Usage,
)


class ChatEngine(Protocol):
    """What this endpoint needs from `gpu_engine.AsyncEngine`."""

    def prepare_prompt(self, messages: list[dict[str, Any]]) -> ProcessedPrompt: ...

    async def agenerate(self, prompt: ProcessedPrompt, params: SamplingParams) -> RequestOutput: ...

    def astream(self, prompt: ProcessedPrompt, params: SamplingParams) -> AsyncGenerator[RequestOutput, None]:
        ...

    def stats(self) -> dict[str, Any]: ...


@dataclass
class ChatBackend:
    """The served model: its public id and a way to get the (lazily started, shared) engine."""

    model_id: str
    get_engine: Callable[[], ChatEngine]
    default_max_tokens: int = 512
    request_timeout_s: float | None = None
    created: int = 0  # unix time the model was made available (shown by /v1/models)


class UnknownModel(ApiError):
    def __init__(self, asked: str, served: str) -> None:
        super().__init__(404, "model_not_found", f"This server serves the model {served!r}, not {asked!r}.")


# --- request -> engine ----------------------------------------------------------------------------------------


@dataclass
class EngineRequest:
    messages: list[dict[str, Any]]
    params: SamplingParams


def _check_text_budget(messages: list[ChatMessage], limits: ApiLimits) -> None:
    """Refuse oversized text before it is tokenised: every token is at least one UTF-8 byte, so the byte count
    bounds the tokenizer's work (and the prompt's tokens) from above."""
    total = 0
    for message in messages:
        texts = [message.content] if isinstance(message.content, str) else [
            p.text for p in message.content or [] if p.type == "text"]
        for text in texts:
            total += len(text.encode("utf-8", "surrogatepass"))
            if total > limits.max_prompt_bytes:
                raise ApiError(413, "prompt_too_large",
                               f"The messages carry more than {limits.max_prompt_bytes:,} bytes of text; this server "
                               "takes at most that many per request. Send less text.")


def _engine_messages(messages: list[ChatMessage], limits: ApiLimits) -> list[dict[str, Any]]:
    _check_text_budget(messages, limits)
    if not any(m.role == "user" for m in messages):
        raise ApiError(400, "no_user_message", "The conversation needs at least one user message.")
    budget = MediaBudget(max_parts=limits.max_images_per_request, max_pixels=limits.max_request_pixels)
    max_bytes = limits.max_image_bytes
    out: list[dict[str, Any]] = []
    for m_index, message in enumerate(messages):
        role = "system" if message.role == "developer" else message.role  # our template knows no 'developer'
        if message.content is None or isinstance(message.content, str):
            out.append({"role": role, "content": message.content or ""})
            continue
        parts: list[dict[str, Any]] = []
        for p_index, part in enumerate(message.content):
            what = f"message {m_index}, part {p_index}"
            if part.type == "text":
                parts.append({"type": "text", "text": part.text})
                continue
            if role != "user":
                raise ApiError(400, "media_not_in_user_message", "Images and videos must be in user messages.")
            if part.type == "image_url":
                image = decode_image(part.image_url.url, what, max_bytes, budget, limits.image_decode_timeout_s)
                parts.append({"type": "image", "image": image})
            elif part.type == "video_url":
                video = decode_video(part.video_url.url, what, part.fps or 2.0, max_bytes, budget)
                parts.append({"type": "video", "video": video.frames, "timestamps": video.timestamps})
            else:  # frames: the engine samples them at `fps`, as transformers does with a frame list
                frames = [decode_image(url, f"{what}, frame {i}", max_bytes, budget, limits.image_decode_timeout_s)
                          for i, url in enumerate(part.video)]
                parts.append({"type": "video", "video": frames, "fps": part.fps})
        out.append({"role": role, "content": parts})
    return out


def _json_schema_of(req: ChatCompletionRequest) -> dict[str, Any] | None:
    fmt = req.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "object"}
    if fmt.json_schema is None or not fmt.json_schema.schema_:
        raise ApiError(400, "invalid_response_format", "response_format json_schema needs a json_schema.schema.")
    schema = fmt.json_schema.schema_
    try:
        check_schema_budget(schema, "response_format.json_schema.schema")  # before anything recurses into it
    except SchemaTooComplexError as exc:
        raise schema_too_complex(exc, 400) from None
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise ApiError(400, "invalid_json_schema", f"response_format.json_schema.schema is not valid JSON Schema: "
                       f"{exc.message}") from exc
    return schema


def build_engine_request(req: ChatCompletionRequest, backend: ChatBackend, limits: ApiLimits) -> EngineRequest:
    """Check the request and decode its media (blocking: call it on a worker thread)."""
    if req.tools:
        raise ApiError(400, "unsupported_parameter", "Tool calling is not supported by this server.")
    if req.top_logprobs and not req.logprobs:
        raise ApiError(400, "invalid_request", "top_logprobs needs logprobs: true.")
    if req.top_logprobs:
        raise ApiError(400, "unsupported_parameter", "top_logprobs is not supported; use logprobs: true for the "
                       "chosen tokens' log probabilities.")
    if req.seed is not None and not 0 <= req.seed <= MAX_SEED:
        raise ApiError(400, "seed_out_of_range", f"seed must be an integer from 0 to {MAX_SEED}, got {req.seed}.")
    asked = req.max_completion_tokens or req.max_tokens
    if asked is not None and asked > limits.max_completion_tokens:
        raise ApiError(400, "max_tokens_too_large",
                       f"max_tokens {asked} is above this server's limit of {limits.max_completion_tokens}.")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    try:
        params = SamplingParams(
            max_tokens=asked or min(backend.default_max_tokens, limits.max_completion_tokens),
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            presence_penalty=req.presence_penalty or 0.0,
            seed=req.seed,
            stop=stop,
            logprobs=req.logprobs,
            json_schema=_json_schema_of(req),
            timeout_s=backend.request_timeout_s,
        )
    except ValueError as exc:
        raise ApiError(400, "invalid_request", public_text(str(exc))) from exc
    # Parameters first: a request refused for them costs no decoding.
    return EngineRequest(messages=_engine_messages(req.messages, limits), params=params)


# --- engine -> response ---------------------------------------------------------------------------------------

_FINISH = {"stop": "stop", "length": "length"}


def _finish_reason(out: RequestOutput) -> str | None:
    if out.finish_reason == "error":
        raise EngineFailed(out.error or "the engine reported an error without a message")
    if out.finish_reason == "abort":
        raise EngineFailed("the request was aborted (timeout or shutdown)")
    return _FINISH.get(out.finish_reason or "", None)


class EngineFailed(ApiError):
    def __init__(self, reason: str) -> None:
        super().__init__(503, "engine_error", public_text(f"The model could not complete this request: {reason}"))


def _engine_error(exc: Exception) -> ApiError:
    """The engine's refusals are the client's fault (400); a stopped engine is ours (503)."""
    if isinstance(exc, RequestError):
        return ApiError(400, "invalid_request", public_text(f"The model cannot run this request: {exc}"))
    if isinstance(exc, EngineStoppedError):
        return ApiError(503, "engine_unavailable", public_text(f"The model is not available: {exc}"),
                        headers={"Retry-After": "5"})
    if isinstance(exc, ApiError):
        return exc
    raise exc


def _usage(out: RequestOutput) -> Usage:
    return Usage(
        prompt_tokens=out.prompt_tokens,
        completion_tokens=out.completion_tokens,
        total_tokens=out.prompt_tokens + out.completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=out.cached_prompt_tokens),
    )


def _logprobs(items: Sequence[TokenLogprob] | None) -> ChoiceLogprobs | None:
    if items is None:
        return None
    return ChoiceLogprobs(
        content=[TokenLogprobOut(token=t.text, logprob=t.logprob, bytes=list(t.text.encode())) for t in items]
    )


def _sse(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


class _SlotResponse(StreamingResponse):
    """A streaming response that gives its engine slot (and temp files) back however the stream ends —
    including when the client is gone before the first byte."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], Awaitable[None]]) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._on_close()


async def _prepend(first: RequestOutput, rest: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
    yield first
    async for out in rest:
        yield out


async def _stream_events(
    stream: AsyncGenerator[RequestOutput, None], first: RequestOutput, completion_id: str, model_id: str, created: int,
    include_usage: bool,
) -> AsyncIterator[bytes]:
    def chunk(delta: dict[str, Any], finish: str | None, logprobs: ChoiceLogprobs | None = None) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish}
        if logprobs is not None:
            choice["logprobs"] = logprobs.model_dump()
        return {"id": completion_id, "object": "chat.completion.chunk", "created": created, "model": model_id,
                "choices": [choice]}

    yield _sse(chunk({"role": "assistant", "content": ""}, None))
    last: RequestOutput | None = None
    sent_logprobs = 0
    try:
        async for out in _prepend(first, stream):
            last = out
            new_lp = None
            if out.logprobs is not None and len(out.logprobs) > sent_logprobs:
                new_lp = _logprobs(out.logprobs[sent_logprobs:])
                sent_logprobs = len(out.logprobs)
            if out.finished:
                finish = _finish_reason(out)
                yield _sse(chunk({"content": out.delta} if out.delta else {}, finish, new_lp))
                break
            if out.delta or new_lp is not None:
                yield _sse(chunk({"content": out.delta}, None, new_lp))
    except (ApiError, RequestError, EngineStoppedError) as exc:
        # Headers are already sent: report the error in-band, the way OpenAI's streaming API does.
        problem = _engine_error(exc)
        yield _sse({"error": {"message": problem.detail, "type": problem.code, "code": problem.code}})
        yield _sse("[DONE]")
        return
    finally:
        await stream.aclose()  # cancels the engine request when the client went away mid-stream
    if include_usage and last is not None:
        yield _sse({"id": completion_id, "object": "chat.completion.chunk", "created": created, "model": model_id,
                    "choices": [], "usage": _usage(last).model_dump()})
    yield _sse("[DONE]")


# --- router ---------------------------------------------------------------------------------------------------


def chat_router(backend: ChatBackend, limits: ApiLimits, slots: EngineSlots) -> APIRouter:
    router = APIRouter(tags=["openai"])

    @router.get("/v1/models", response_model=ModelList)
    def list_models() -> ModelList:
        return ModelList(data=[ModelCard(id=backend.model_id, created=backend.created)])

    @router.post(
        "/v1/chat/completions",
        response_model=ChatCompletion,
        responses={200: {"content": {"text/event-stream": {}}, "description": "A completion, or SSE chunks when "
                                                                              "stream is true."}},
    )
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        if body.model != backend.model_id:
            raise UnknownModel(body.model, backend.model_id)
        principal = request.state.principal
        slots.acquire(principal.key_id)  # before any decoding: the slot caps a key's concurrent decodes too
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                slots.release(principal.key_id)
                give_back_memory()

        completion_id = "chatcmpl-" + uuid.uuid4().hex
        created = int(time.time())
        try:
            ereq = await run_in_threadpool(build_engine_request, body, backend, limits)
            engine = await run_in_threadpool(backend.get_engine)  # may load the model: not on the event loop
            try:  # chat template, tokenising and pixel preprocessing: a worker thread too
                prompt = await run_in_threadpool(engine.prepare_prompt, ereq.messages)
            except (RequestError, EngineStoppedError) as exc:
                raise _engine_error(exc) from exc
            ereq.messages.clear()  # the decoded media now live in the prompt only
        except BaseException:
            release()
            raise
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            stream = engine.astream(prompt, ereq.params)
            try:
                # Wait for the first output before sending headers, so a refused request is a proper 400.
                first = await anext(stream)
            except (RequestError, EngineStoppedError) as exc:
                release()
                raise _engine_error(exc) from exc
            except BaseException:
                release()
                await stream.aclose()
                raise
            events = _stream_events(stream, first, completion_id, backend.model_id, created, include_usage)

            async def close() -> None:
                await stream.aclose()  # also when the client left before the first event (request cancelled)
                release()

            return _SlotResponse(events, on_close=close)
        try:
            out = await engine.agenerate(prompt, ereq.params)
        except (RequestError, EngineStoppedError) as exc:
            raise _engine_error(exc) from exc
        finally:
            release()
        completion = ChatCompletion(
            id=completion_id,
            created=created,
            model=backend.model_id,
            choices=[Choice(message=AssistantMessage(content=out.text), finish_reason=_finish_reason(out),
                            logprobs=_logprobs(out.logprobs))],
            usage=_usage(out),
            system_fingerprint=engine.stats().get("model_fingerprint"),
        )
        return JSONResponse(completion.model_dump())

    return router

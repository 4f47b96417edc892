"""Errors as RFC 9457 problem documents: every failure the API returns is JSON with a stable `code`.

Handlers are installed for our own `ApiError`, FastAPI/Starlette HTTP errors, request validation errors and
anything unexpected (logged server-side; the client only sees a code and an incident id, never a stack trace).
"""
from __future__ import annotations

import logging
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pipeline.errors import (
    InvalidSchemaError,
    JobStateError,
    NotFoundError,
    PipelineError,
    SchemaTooComplexError,
    UnknownSchemaError,
    UnstorableTextError,
)

log = logging.getLogger("docpipe.api")

PROBLEM_JSON = "application/problem+json"


class ApiError(Exception):
    """An error a client can act on. `code` is stable (clients branch on it); `detail` is for people."""

    def __init__(
        self,
        status: int,
        code: str,
        detail: str,
        *,
        title: str | None = None,
        headers: dict[str, str] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(detail)
        self.status = status
        self.code = code
        self.detail = detail
        self.title = title or _default_title(status)
        self.headers = headers or {}
        self.extra = extra or {}


class NotFound(ApiError):
    def __init__(self, what: str, ident: object) -> None:
        super().__init__(404, f"{what}_not_found", f"No {what.replace('_', ' ')} with id {ident!r}.")


class BodyTooLarge(ApiError):
    def __init__(self, limit: int) -> None:
        super().__init__(
            413,
            "payload_too_large",
            f"The request body exceeds the limit of {limit} bytes; send a smaller file.",
            extra={"limit_bytes": limit},
        )


class RateLimited(ApiError):
    def __init__(self, code: str, detail: str, retry_after_s: float) -> None:
        retry = max(1, int(retry_after_s + 0.999))  # Retry-After is whole seconds, never 0
        super().__init__(429, code, detail, headers={"Retry-After": str(retry)}, extra={"retry_after_s": retry})


_TITLES = {
    400: "Bad Request",
    401: "Unauthorized",
    403: "Forbidden",
    404: "Not Found",
    405: "Method Not Allowed",
    408: "Request Timeout",
    409: "Conflict",
    413: "Content Too Large",
    415: "Unsupported Media Type",
    422: "Unprocessable Content",
    429: "Too Many Requests",
    500: "Internal Server Error",
    503: "Service Unavailable",
}

# Stable codes for errors raised by the framework itself (routing, method matching).
_HTTP_CODES = {
    400: "bad_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    406: "not_acceptable",
    413: "payload_too_large",
    415: "unsupported_media_type",
    422: "invalid_request",
    503: "unavailable",
}


def _default_title(status: int) -> str:
    return _TITLES.get(status, "Error")


def problem_response(
    status: int,
    code: str,
    detail: str,
    *,
    title: str | None = None,
    instance: str | None = None,
    headers: dict[str, str] | None = None,
    extra: dict[str, Any] | None = None,
) -> JSONResponse:
    body: dict[str, Any] = {
        "type": f"https://docpipe.dev/problems/{code}",
        "title": title or _default_title(status),
        "status": status,
        "code": code,
        "detail": detail,
    }
    if instance:
        body["instance"] = instance
    if extra:
        body.update(extra)
    return JSONResponse(body, status_code=status, headers=headers, media_type=PROBLEM_JSON)


def new_incident() -> str:
    return uuid.uuid4().hex[:12]


def _logged_incident(request: Request, status: int, code: str, detail: str) -> dict[str, Any]:
    """A 5xx answer's `incident` id, written to the server log with what the client was told, so an operator
    can find any 5xx a client reports; nothing for a 4xx (the client's to fix)."""
    if status < 500:
        return {}
    incident = new_incident()
    log.error("%s %s answered %d %s (incident %s): %s", request.method, request.url.path, status, code, incident,
              detail)
    return {"incident": incident}


async def _api_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ApiError)
    return problem_response(
        exc.status, exc.code, exc.detail, title=exc.title, instance=request.url.path, headers=exc.headers,
        extra={**exc.extra, **_logged_incident(request, exc.status, exc.code, exc.detail)},
    )


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    code = _HTTP_CODES.get(exc.status_code, f"http_{exc.status_code}")
    detail = exc.detail if isinstance(exc.detail, str) else _default_title(exc.status_code)
    return problem_response(
        exc.status_code, code, detail, instance=request.url.path, headers=getattr(exc, "headers", None),
        extra=_logged_incident(request, exc.status_code, code, detail),
    )


def _jsonable(value: Any) -> Any:
    """Validation error contexts may hold exceptions or bytes; keep only what JSON can carry."""
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return str(value)


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errors = [
        {"loc": _jsonable(list(e.get("loc", ()))), "msg": str(e.get("msg", "")), "type": str(e.get("type", ""))}
        for e in exc.errors()
    ]
    first = errors[0] if errors else {"loc": [], "msg": "invalid request"}
    where = ".".join(str(p) for p in first["loc"])
    return problem_response(
        422, "invalid_request", f"{where}: {first['msg']}" if where else str(first["msg"]),
        instance=request.url.path, extra={"errors": errors},
    )


def pipeline_error_to_api(exc: PipelineError) -> ApiError:
    """The pipeline's own exceptions already carry messages a person can act on; give each a status and code."""
    if isinstance(exc, NotFoundError):
        return ApiError(404, f"{exc.kind.replace(' ', '_')}_not_found", str(exc))
    if isinstance(exc, UnknownSchemaError):
        return ApiError(422, "unknown_schema", str(exc))
    if isinstance(exc, SchemaTooComplexError):
        return schema_too_complex(exc, 422)
    if isinstance(exc, UnstorableTextError):
        return ApiError(422, "invalid_text", str(exc), extra={"field": exc.field})
    if isinstance(exc, InvalidSchemaError):
        return ApiError(422, "invalid_schema", str(exc))
    if isinstance(exc, JobStateError):
        return ApiError(409, "job_state_conflict", str(exc))
    return ApiError(422, "pipeline_error", str(exc))


def schema_too_complex(exc: SchemaTooComplexError, status: int) -> ApiError:
    """A schema over the budget: 422 where a schema is the resource (POST /v1/schemas), 400 where it is one
    parameter of a request (the chat endpoint's response_format)."""
    return ApiError(status, "schema_too_complex", str(exc), extra={"limit": exc.limit, "maximum": exc.maximum})


async def _pipeline_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, PipelineError)
    return await _api_error(request, pipeline_error_to_api(exc))


def unexpected_error_response(method: str, path: str) -> JSONResponse:
    """A 500 problem document for an exception nothing else handled (logged here with an incident id; the
    client sees the id, never the exception)."""
    incident = new_incident()
    log.exception("unhandled error on %s %s (incident %s)", method, path, incident)
    return problem_response(
        500, "internal_error", f"The server failed to handle this request (incident {incident}); "
        "the operator can find the cause in the server log.", instance=path, extra={"incident": incident},
    )


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(PipelineError, _pipeline_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _validation_error)

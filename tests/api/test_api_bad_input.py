"""Issue #20's table, one test per row, over real HTTP against embedded SQLite, embedded PostgreSQL and broker mode
with PostgreSQL (the modes the table was found in): each case answers the expected 4xx problem document with a
stable code (it used to be 500 internal_error), and a refused request writes nothing. Also the multipart framing
limits and the incident id of a 5xx in the server log."""
from __future__ import annotations

import io
import logging
import random
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from apitest_support import LiveServer, database_url, live_server, test_settings
from PIL import Image
from test_api_broker import REDIS_HOST, REDIS_PORT, _claim_redis_db

from api.bounds import MAX_ROW_ID, MAX_SEED
from api.queries import encode_cursor
from api.uploads import MAX_BOUNDARY_BYTES, MAX_PART_HEADER_BYTES, MAX_PART_HEADERS
from pipeline.schemas import SCHEMA_BUDGET

OBJECT_SCHEMA = {"type": "object", "properties": {"a": {"type": "string"}}}


@pytest.fixture(scope="module", params=["sqlite", "postgresql", "broker-postgresql"])
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    data_dir = tmp_path_factory.mktemp(f"bad-input-{request.param}")
    if request.param != "broker-postgresql":
        with database_url(request.param, data_dir) as url, live_server(test_settings(data_dir, url)) as live:
            yield live
        return
    db, redis_client = _claim_redis_db()  # jobs are only enqueued there; nothing runs them
    try:
        with database_url("postgresql", data_dir) as url, live_server(test_settings(
                data_dir, url, broker_url=f"redis://{REDIS_HOST}:{REDIS_PORT}/{db}")) as live:
            yield live
    finally:
        redis_client.flushdb()


def assert_problem(response: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/problem+json")
    body = response.json()
    assert body["status"] == status and body["code"] == code, body
    assert body["detail"] and "Traceback" not in response.text
    return body


def nested_schema(levels: int) -> dict[str, Any]:
    """An object schema with `levels` objects nested inside it (two JSON levels each)."""
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def fresh_png() -> bytes:
    img = Image.frombytes("RGB", (16, 16), random.randbytes(16 * 16 * 3))
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return buf.getvalue()


def raw_multipart(boundary: str, filename: str, data: bytes, extra_headers: str = "") -> bytes:
    """A one-file multipart body written by hand: httpx would percent-encode a NUL in the file name, and it
    picks its own boundary."""
    head = (f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="{filename}"\r\n'
            f"Content-Type: application/octet-stream\r\n{extra_headers}\r\n")
    return head.encode() + data + f"\r\n--{boundary}--\r\n".encode()


def post_multipart(c: httpx.Client, boundary: str, body: bytes) -> httpx.Response:
    return c.post("/v1/documents", content=body, headers={"Content-Type": f"multipart/form-data; boundary={boundary}"})


def document_ids(c: httpx.Client) -> set[int]:
    return {d["id"] for d in c.get("/v1/documents", params={"limit": 200}).json()["items"]}


def schema_versions(c: httpx.Client) -> list[tuple[str, int]]:
    return sorted((s["name"], s["version"]) for s in c.get("/v1/schemas").json()["items"])


def spool_files(server: LiveServer) -> list[Any]:
    spool = server.app.state.ctx.spool_dir
    return list(spool.iterdir()) if spool.exists() else []


def chat(c: httpx.Client, **fields: Any) -> httpx.Response:
    model = c.get("/v1/models").json()["data"][0]["id"]
    body = {"model": model, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 1, **fields}
    return c.post("/v1/chat/completions", json=body)


# --- the table --------------------------------------------------------------------------------------------------


def test_chat_seed_outside_the_engines_range_is_400(server: LiveServer) -> None:
    with server.client() as c:
        for seed in (-1, MAX_SEED + 1, 10**30):
            body = assert_problem(chat(c, seed=seed), 400, "seed_out_of_range")
            assert str(MAX_SEED) in body["detail"]
        for seed in (0, MAX_SEED):  # both ends of the range are served
            r = chat(c, seed=seed)
            assert r.status_code == 200, r.text


def test_chat_response_format_nested_300_levels_is_400_naming_the_limit(server: LiveServer) -> None:
    with server.client() as c:
        fmt = {"type": "json_schema", "json_schema": {"name": "deep", "schema": nested_schema(300)}}
        body = assert_problem(chat(c, response_format=fmt), 400, "schema_too_complex")
        assert body["limit"] == "depth" and body["maximum"] == SCHEMA_BUDGET.max_depth
        assert "response_format" in body["detail"] and str(SCHEMA_BUDGET.max_depth) in body["detail"]
        ok = {"type": "json_schema", "json_schema": {"name": "flat", "schema": nested_schema(3)}}
        assert chat(c, response_format=ok).status_code == 200


def test_schema_nested_200_levels_is_422_naming_the_limit_and_not_stored(server: LiveServer) -> None:
    with server.client() as c:
        before = schema_versions(c)
        r = c.post("/v1/schemas", json={"name": "deep-200", "json_schema": nested_schema(200)})
        body = assert_problem(r, 422, "schema_too_complex")
        assert body["limit"] == "depth" and str(SCHEMA_BUDGET.max_depth) in body["detail"]
        many = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(SCHEMA_BUDGET.max_values)}}
        assert assert_problem(c.post("/v1/schemas", json={"name": "wide", "json_schema": many}), 422,
                              "schema_too_complex")["limit"] == "size"
        refs = {"type": "object", "$defs": {"s": {"type": "string"}},
                "properties": {f"p{i}": {"$ref": "#/$defs/s"} for i in range(SCHEMA_BUDGET.max_refs + 1)}}
        assert assert_problem(c.post("/v1/schemas", json={"name": "refs", "json_schema": refs}), 422,
                              "schema_too_complex")["limit"] == "refs"
        assert schema_versions(c) == before
        assert_problem(c.get("/v1/schemas/deep-200"), 404, "schema_not_found")


def test_cursor_holding_a_huge_integer_is_400(server: LiveServer) -> None:
    with server.client() as c:
        assert_problem(c.get("/v1/documents", params={"cursor": "ZDo5OTk5OTk5OTk5OTk5OTk5OTk5OTk5OTk5"}), 400,
                       "invalid_cursor")
        assert_problem(c.get("/v1/documents", params={"cursor": encode_cursor(MAX_ROW_ID + 1)}), 400,
                       "invalid_cursor")
        assert c.get("/v1/documents", params={"cursor": encode_cursor(MAX_ROW_ID)}).status_code == 200


def test_schema_lookup_by_a_name_with_nul_is_404(server: LiveServer) -> None:
    with server.client() as c:
        assert_problem(c.get("/v1/schemas/%00"), 404, "schema_not_found")
        assert_problem(c.get("/v1/schemas/generic%00"), 404, "schema_not_found")
        assert_problem(c.get("/v1/schemas/%00", params={"version": 1}), 404, "schema_not_found")


def test_document_list_filtered_by_a_schema_with_nul_is_empty(server: LiveServer) -> None:
    with server.client() as c:
        assert upload_png(c, "listed.png").status_code == 202  # something the filter must not match
        r = c.get("/v1/documents", params={"schema": "generic\x00"})
        assert r.status_code == 200, r.text
        assert r.json() == {"items": [], "next_cursor": None}
        doc_id = max(document_ids(c))
        assert_problem(c.get(f"/v1/documents/{doc_id}/result", params={"schema": "\x00"}), 404, "result_not_found")


def test_schema_name_or_prompt_with_nul_is_422_and_not_stored(server: LiveServer) -> None:
    with server.client() as c:
        before = schema_versions(c)
        assert_problem(c.post("/v1/schemas", json={"name": "nul\x00name", "json_schema": OBJECT_SCHEMA}), 422,
                       "invalid_schema")
        body = assert_problem(c.post("/v1/schemas", json={"name": "nul-prompt", "prompt": "Read\x00 it.",
                                                          "json_schema": OBJECT_SCHEMA}), 422, "invalid_text")
        assert "prompt" in body["field"] and "NUL" in body["detail"]
        nul_key = {"type": "object", "properties": {"a\x00": {"type": "string"}}}
        assert_problem(c.post("/v1/schemas", json={"name": "nul-key", "json_schema": nul_key}), 422, "invalid_text")
        # A lone surrogate (JSON can carry one as an escape) is no more storable than NUL.
        raw = b'{"name": "lone", "json_schema": {"type": "object", "properties": {"\\ud800": {"type": "string"}}}}'
        r = c.post("/v1/schemas", content=raw, headers={"Content-Type": "application/json"})
        assert_problem(r, 422, "invalid_text")
        assert schema_versions(c) == before
        # The upload form's schema field is looked up, not stored: a name with NUL is simply not registered.
        r = c.post("/v1/documents", files={"file": ("a.png", fresh_png())}, data={"schema": "generic\x00"})
        assert_problem(r, 422, "unknown_schema")


def upload_png(c: httpx.Client, name: str) -> httpx.Response:
    return c.post("/v1/documents", files={"file": (name, fresh_png(), "application/octet-stream")})


def test_upload_whose_file_name_contains_nul_is_202_with_a_cleaned_name(server: LiveServer) -> None:
    with server.client() as c:
        r = post_multipart(c, "nulname0123", raw_multipart("nulname0123", "in\x00voice\x07.png", fresh_png()))
        assert r.status_code == 202, r.text
        doc = r.json()["document"]
        assert doc["name"] == "invoice.png"
        detail = c.get(f"/v1/documents/{doc['id']}").json()
        assert detail["name"] == "invoice.png"


@pytest.mark.parametrize("length", [10_000, 100_000])
def test_multipart_with_a_huge_boundary_is_400_and_stores_nothing(server: LiveServer, length: int) -> None:
    with server.client() as c:
        before = document_ids(c)
        boundary = "b" * length
        r = post_multipart(c, boundary, raw_multipart(boundary, "a.png", fresh_png()))
        if r.headers["content-type"].startswith("text/plain"):
            # A request head this long may already be refused by the HTTP server (uvicorn/h11 limits the bytes
            # it buffers before the head is complete); it answers 400 too, before any of ours runs.
            assert r.status_code == 400 and length > 16 * 1024, r.text
        else:
            body = assert_problem(r, 400, "multipart_boundary_too_long")
            assert body["limit_bytes"] == MAX_BOUNDARY_BYTES
        assert document_ids(c) == before
    assert spool_files(server) == []


# --- the multipart framing limits -------------------------------------------------------------------------------


def test_multipart_boundary_at_the_limit_is_accepted(server: LiveServer) -> None:
    boundary = "x" * MAX_BOUNDARY_BYTES
    with server.client() as c:
        r = post_multipart(c, boundary, raw_multipart(boundary, "edge.png", fresh_png()))
        assert r.status_code == 202, r.text


@pytest.mark.parametrize("split", [False, True], ids=["one-line", "many-lines"])
def test_multipart_part_headers_over_the_limit_are_413(server: LiveServer, split: bool) -> None:
    boundary = "hdrlimit42"
    if split:  # each line under the limit, together over it, in fewer headers than allowed
        extra = "".join(f"X-Pad-{i}: {'p' * 1000}\r\n" for i in range(5))
        assert len(extra) > MAX_PART_HEADER_BYTES and 5 + 2 <= MAX_PART_HEADERS
    else:
        extra = f"X-Pad: {'p' * (MAX_PART_HEADER_BYTES + 1)}\r\n"
    with server.client() as c:
        before = document_ids(c)
        body = assert_problem(post_multipart(c, boundary, raw_multipart(boundary, "h.png", fresh_png(), extra)), 413,
                              "multipart_headers_too_large")
        assert body["limit_bytes"] == MAX_PART_HEADER_BYTES
        assert document_ids(c) == before
    assert spool_files(server) == []


def test_multipart_with_too_many_part_headers_or_parts_is_400(server: LiveServer) -> None:
    boundary = "countlimit7"
    extra = "".join(f"X-{i}: v\r\n" for i in range(MAX_PART_HEADERS))
    many_parts = "".join(f'--{boundary}\r\nContent-Disposition: form-data; name="f"\r\n\r\nv\r\n' for _ in range(200))
    with server.client() as c:
        before = document_ids(c)
        assert_problem(post_multipart(c, boundary, raw_multipart(boundary, "c.png", fresh_png(), extra)), 400,
                       "too_many_part_headers")
        body = (many_parts.encode() + raw_multipart(boundary, "c.png", fresh_png()))
        assert_problem(post_multipart(c, boundary, body), 400, "too_many_parts")
        assert document_ids(c) == before


# --- a 5xx leaves its incident id in the server log -------------------------------------------------------------


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def api_log() -> Any:
    handler = _Records()
    logger = logging.getLogger("docpipe.api")
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)


def test_every_5xx_answer_carries_an_incident_id_found_in_the_log(server: LiveServer, api_log: _Records,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    import api.routes.schemas as schema_routes
    from api.errors import ApiError

    def broken(*_: Any, **__: Any) -> Any:
        raise RuntimeError("simulated failure")

    def unavailable(*_: Any, **__: Any) -> Any:
        raise ApiError(503, "unavailable_for_test", "simulated outage")

    with server.client() as c:
        for fault, code in ((broken, "internal_error"), (unavailable, "unavailable_for_test")):
            monkeypatch.setattr(schema_routes, "list_schemas", fault)
            r = c.get("/v1/schemas")
            body = r.json()
            assert r.status_code >= 500 and body["code"] == code, r.text
            incident = body["incident"]
            assert len(incident) == 12 and any(incident in m for m in api_log.messages), api_log.messages
        monkeypatch.undo()
        assert c.get("/v1/schemas").status_code == 200
        # A failure before the routes (authentication, in the middleware) is answered and logged the same way.
        from api.auth import Gate

        monkeypatch.setattr(Gate, "admit", broken)
        r = c.get("/v1/schemas")
        assert r.status_code == 500 and r.json()["code"] == "internal_error", r.text
        assert any(r.json()["incident"] in m for m in api_log.messages)
        monkeypatch.undo()
        assert c.get("/v1/schemas").status_code == 200

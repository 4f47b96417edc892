"""README / api/README promises of the HTTP layer, each checked so that the test fails when the promise breaks
(issue #22): where uploads are held, both body-limit layers, key comparison, busy deletes, PDF passwords, the
OpenAI endpoint's parameters."""
from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from starlette.requests import Request

from api.uploads import MEMORY_FILE_BYTES, MemoryBudget, ReceivedForm, receive_form

BOUNDARY = b"docpipe-test-boundary"


def _multipart(files: list[tuple[str, bytes]]) -> bytes:
    out = b""
    for name, data in files:
        out += (b"--" + BOUNDARY + b"\r\nContent-Disposition: form-data; name=\"file\"; filename=\"" +
                name.encode() + b"\"\r\nContent-Type: application/octet-stream\r\n\r\n" + data + b"\r\n")
    return out + b"--" + BOUNDARY + b"--\r\n"


def _receive(body: bytes, spool: Path, memory: MemoryBudget, chunk: int = 64 * 1024) -> ReceivedForm:
    """receive_form over an ASGI request whose body arrives in `chunk`-byte messages."""
    pieces = [body[i : i + chunk] for i in range(0, len(body), chunk)]

    async def receive() -> dict[str, object]:
        piece = pieces.pop(0)
        return {"type": "http.request", "body": piece, "more_body": bool(pieces)}

    scope = {"type": "http", "method": "POST", "path": "/v1/documents", "headers": [
        (b"content-type", b"multipart/form-data; boundary=" + BOUNDARY)]}
    return asyncio.run(receive_form(Request(scope, receive), spool, memory, max_file_bytes=64 * MEMORY_FILE_BYTES,
                                    max_files=4))


# --- uploads: up to 1 MiB in memory, larger ones spooled to disk ------------------------------------------------
def test_an_upload_of_up_to_1_mib_stays_in_memory_and_a_larger_one_is_spooled(tmp_path: Path) -> None:
    assert MEMORY_FILE_BYTES == 1024 * 1024  # the size api/README promises
    memory = MemoryBudget(64 * MEMORY_FILE_BYTES)
    small, large = b"s" * MEMORY_FILE_BYTES, b"L" * (MEMORY_FILE_BYTES + 1)
    form = _receive(_multipart([("small.bin", small), ("large.bin", large)]), tmp_path / "spool", memory)
    (_, kept), (_, spooled) = form.files
    assert kept.data == small and kept.path is None  # exactly 1 MiB: memory
    assert memory.used == MEMORY_FILE_BYTES  # counted in the budget, and only it
    assert spooled.data is None and spooled.path is not None and spooled.path.read_bytes() == large
    assert spooled.path.parent == tmp_path / "spool"
    form.discard()
    assert memory.used == 0 and not spooled.path.exists()


def test_an_upload_spools_once_the_shared_memory_budget_is_spent(tmp_path: Path) -> None:
    memory = MemoryBudget(MEMORY_FILE_BYTES)  # room for one small file
    first, second = b"a" * 1000, b"b" * (MEMORY_FILE_BYTES - 999)  # together one byte over the cap
    form = _receive(_multipart([("a.bin", first), ("b.bin", second)]), tmp_path / "spool", memory)
    (_, a), (_, b) = form.files
    assert a.data == first and a.path is None
    assert b.data is None and b.path is not None and b.path.read_bytes() == second
    assert memory.used == len(first)
    form.discard()
    assert memory.used == 0


# --- body limits: a declared Content-Length over the limit is refused; the bytes received are counted -----------
LIMIT = 100


class _BodyReader:
    """An ASGI app that reads its whole body and answers 200 with the byte count; records what it saw."""

    def __init__(self) -> None:
        self.calls = 0
        self.read = 0
        self.refused: BaseException | None = None

    async def __call__(self, scope: dict, receive, send) -> None:
        from api.errors import BodyTooLarge

        self.calls += 1
        try:
            while True:
                message = await receive()
                self.read += len(message.get("body", b""))
                if not message.get("more_body"):
                    break
        except BodyTooLarge as exc:  # what FastAPI's handler turns into a 413 in the real app
            self.refused = exc
            await send({"type": "http.response.start", "status": 413, "headers": []})
            await send({"type": "http.response.body", "body": b""})
            return
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": str(self.read).encode()})


def _through_middleware(app: _BodyReader, chunks: list[bytes], headers: list[tuple[bytes, bytes]]) -> tuple[
        int, int]:
    """Send one POST through ApiMiddleware (no keys, limit LIMIT); (status, body chunks the client handed over)."""
    from api.auth import Gate, KeyRing
    from api.limits import RateLimiter
    from api.metrics import HttpMetrics, Metrics
    from api.middleware import ApiMiddleware

    middleware = ApiMiddleware(app, metrics=HttpMetrics(Metrics()), gate=Gate(KeyRing([]), RateLimiter(6000, 100)),
                               limit_for=lambda method, path: LIMIT)
    pending = list(chunks)
    sent: list[dict] = []

    async def receive() -> dict[str, object]:
        piece = pending.pop(0)
        return {"type": "http.request", "body": piece, "more_body": bool(pending)}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/schemas", "headers": headers, "client": ("127.0.0.1", 1),
             "query_string": b"", "http_version": "1.1", "scheme": "http", "server": ("127.0.0.1", 80)}
    asyncio.run(middleware(scope, receive, send))
    [start] = [m for m in sent if m["type"] == "http.response.start"]
    return start["status"], len(chunks) - len(pending)


def test_a_declared_content_length_over_the_limit_is_refused_before_the_body_is_read() -> None:
    app = _BodyReader()
    # The client claims more than the limit but sends only 10 bytes: only the declaration can refuse it.
    status, handed_over = _through_middleware(app, [b"x" * 10], [(b"content-length", str(LIMIT + 1).encode())])
    assert status == 413 and app.calls == 0 and handed_over == 0
    # at the limit it is let through
    status, _ = _through_middleware(app, [b"x" * LIMIT], [(b"content-length", str(LIMIT).encode())])
    assert status == 200 and app.read == LIMIT


def test_the_bytes_received_are_counted_whatever_the_headers_say() -> None:
    # chunked (no Content-Length): three chunks of 40 bytes; the third passes the limit
    app = _BodyReader()
    status, handed_over = _through_middleware(app, [b"y" * 40] * 3, [])
    assert status == 413 and app.refused is not None and app.read == 80 and handed_over == 3  # the 3rd raised
    # a Content-Length that lies low is no way around it
    app = _BodyReader()
    status, _ = _through_middleware(app, [b"y" * 60] * 2, [(b"content-length", b"50")])
    assert status == 413 and app.refused is not None
    # exactly the limit, in pieces, is fine
    app = _BodyReader()
    status, _ = _through_middleware(app, [b"z" * 50] * 2, [])
    assert status == 200 and app.read == LIMIT and app.refused is None


# --- API keys compared in constant time -------------------------------------------------------------------------
def test_api_keys_are_compared_as_fixed_length_digests_with_no_early_exit(monkeypatch: pytest.MonkeyPatch) -> None:
    import hmac

    from api import auth

    keys = ["k" * 16 + "first", "a-much-longer-second-key-" * 3, "third-key-0123456789"]
    ring = auth.KeyRing(keys)
    compared: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", spy)
    for presented in (keys[0], keys[1], "wrong", "k" * 16 + "firs"):
        compared.clear()
        found = ring.match(presented)
        assert (found is not None) == (presented in keys)
        if found is not None:
            assert found[0] == auth.key_id(presented)
        # every configured key compared, each as a 32-byte digest: the time depends on neither which key
        # matched, nor the keys' lengths, nor how many leading characters a guess got right
        assert len(compared) == len(keys)
        assert all(len(a) == len(b) == 32 for a, b in compared)


# --- the OpenAI endpoint: refused and honoured parameters ---------------------------------------------------------
def _engine_request(**body: object):
    from api.limits import ApiLimits
    from api.openai_compat import ChatBackend, build_engine_request
    from api.openai_schema import ChatCompletionRequest

    req = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                **body})
    return build_engine_request(req, ChatBackend(model_id="m", get_engine=lambda: None), ApiLimits())


def test_chat_parameters_reach_the_engine_request() -> None:
    params = _engine_request(stop="END", presence_penalty=1.5, max_completion_tokens=7, temperature=0.2,
                             top_p=0.9, seed=11, logprobs=True, response_format={"type": "json_object"}).params
    assert params.stop == ["END"] and params.presence_penalty == 1.5 and params.max_tokens == 7
    assert (params.temperature, params.top_p, params.seed, params.logprobs) == (0.2, 0.9, 11, True)
    assert params.json_schema == {"type": "object"}  # json_object: any JSON object
    assert _engine_request(stop=["a", "b"]).params.stop == ["a", "b"]
    assert _engine_request(max_tokens=9).params.max_tokens == 9
    assert _engine_request(max_completion_tokens=5, max_tokens=9).params.max_tokens == 5  # the newer name wins
    defaults = _engine_request().params
    assert defaults.presence_penalty == 0.0 and defaults.stop == [] and defaults.json_schema is None
    assert defaults.temperature == 1.0  # OpenAI's default, not greedy


def test_chat_refuses_tools_and_n_above_one() -> None:
    from pydantic import ValidationError

    from api.errors import ApiError

    with pytest.raises(ApiError) as err:
        _engine_request(tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}])
    assert (err.value.status, err.value.code) == (400, "unsupported_parameter")
    with pytest.raises(ValidationError, match="n"):
        _engine_request(n=2)
    with pytest.raises(ApiError) as err:
        _engine_request(max_completion_tokens=4097)
    assert err.value.code == "max_tokens_too_large"


def test_the_declared_refusal_is_a_problem_document_that_closes_the_connection() -> None:
    import json

    from api.bodylimit import declared_too_large

    assert declared_too_large({b"content-length": b"100"}, 100, "/v1/x") is None
    assert declared_too_large({}, 100, "/v1/x") is None  # chunked: nothing declared, counting decides
    assert declared_too_large({b"content-length": b"lots"}, 100, "/v1/x") is None  # unreadable: counting decides
    refused = declared_too_large({b"content-length": b"101"}, 100, "/v1/upload")
    assert refused is not None and refused.status_code == 413
    assert refused.headers["connection"] == "close"  # the unread body must not be read as the next request
    body = json.loads(refused.body)
    assert body["code"] == "payload_too_large" and body["limit_bytes"] == 100 and body["instance"] == "/v1/upload"
    assert body["detail"] == "The request body exceeds the limit of 100 bytes; send a smaller file."


def test_counting_passes_every_message_through_and_counts_only_request_bodies() -> None:
    from api.bodylimit import counting_receive
    from api.errors import BodyTooLarge

    messages = [{"type": "http.request", "body": b"a" * 60, "more_body": True},
                {"type": "http.disconnect"},  # not a body message: not counted
                {"type": "http.request", "body": b"b" * 40, "more_body": True},
                {"type": "http.request", "more_body": False},  # no body key at all
                {"type": "http.request", "body": b"c", "more_body": False}]

    async def receive() -> dict[str, object]:
        return messages.pop(0)

    async def drain() -> list[dict[str, object]]:
        counted = counting_receive(receive, 100)
        return [await counted() for _ in range(4)]

    seen = asyncio.run(drain())
    assert [m["type"] for m in seen] == ["http.request", "http.disconnect", "http.request", "http.request"]
    assert seen[0]["body"] == b"a" * 60  # handed on unchanged
    with pytest.raises(BodyTooLarge) as err:  # byte 101 arrives
        asyncio.run(_one_more(counting_receive, [{"type": "http.request", "body": b"x" * 101}]))
    assert err.value.extra == {"limit_bytes": 100}


async def _one_more(make, messages):
    async def receive() -> dict[str, object]:
        return messages.pop(0)

    return await make(receive, 100)()


# --- authentication: who is let in, from the headers alone ---------------------------------------------------------
def _gate(keys: list[str], burst: int = 100):
    from api.auth import Gate, KeyRing
    from api.limits import RateLimiter

    return Gate(KeyRing(keys), RateLimiter(60, burst))


def _scope(path: str, client: str = "10.0.0.7") -> dict:
    return {"type": "http", "path": path, "client": (client, 5555)}


def test_keys_are_taken_from_bearer_or_x_api_key() -> None:
    from api.auth import presented_key

    assert presented_key({b"authorization": b"Bearer abc"}) == "abc"
    assert presented_key({b"authorization": b"BEARER  abc  "}) == "abc"
    assert presented_key({b"authorization": b"Basic abc", b"x-api-key": b" k2 "}) == "k2"  # not Bearer: X-API-Key
    assert presented_key({b"authorization": b"Bearer abc", b"x-api-key": b"k2"}) == "abc"  # Bearer first
    assert presented_key({b"authorization": b"Bearer   ", b"x-api-key": b"   "}) is None
    assert presented_key({b"authorization": b"Bearerabc"}) is None
    assert presented_key({}) is None


def test_the_gate_refuses_missing_and_wrong_keys_except_on_open_paths() -> None:
    from api.auth import is_open_path, key_id
    from api.errors import ApiError

    key = "k" * 20
    gate = _gate([key])
    assert is_open_path("/healthz") and is_open_path("/") and is_open_path("/ui/app.js")
    assert not is_open_path("/v1/documents") and not is_open_path("/uix") and not is_open_path("/healthz/x")
    scope = _scope("/v1/documents")
    principal = gate.admit(scope, {b"x-api-key": key.encode()})
    assert principal is not None and principal.authenticated and principal.key_id == key_id(key)
    assert scope["state"]["principal"] is principal
    for headers, status, code in (({}, 401, "auth_required"), ({b"x-api-key": b"wrong-key-0000000000"}, 403,
                                                                 "invalid_api_key")):
        with pytest.raises(ApiError) as err:
            gate.admit(_scope("/v1/documents"), headers)
        assert (err.value.status, err.value.code) == (status, code)
    # open paths: no key or a wrong one is no refusal (the probe answers), a right one is still recognised
    assert gate.admit(_scope("/healthz"), {}) is None
    assert gate.admit(_scope("/readyz"), {b"x-api-key": b"wrong-key-0000000000"}) is None
    opened = gate.admit(_scope("/healthz"), {b"authorization": f"Bearer {key}".encode()})
    assert opened is not None and opened.authenticated


def test_without_keys_callers_are_told_apart_by_address_and_refusals_are_rate_limited() -> None:
    from api.errors import ApiError, RateLimited

    open_gate = _gate([])
    anon = open_gate.admit(_scope("/v1/documents", "10.1.1.1"), {})
    assert anon is not None and not anon.authenticated and anon.key_id == "addr-10.1.1.1"
    # guessing keys is charged to the client's address: after the burst, 429 instead of 403
    gate = _gate(["k" * 20], burst=2)
    codes = []
    for _ in range(3):
        try:
            gate.admit(_scope("/v1/documents", "10.9.9.9"), {b"x-api-key": b"guess-000000000000"})
        except RateLimited:
            codes.append(429)
        except ApiError as exc:
            codes.append(exc.status)
    assert codes == [403, 403, 429]
    # and a valid key's requests are limited per key on non-open paths, never on open ones
    key = "q" * 20
    limited = _gate([key], burst=1)
    limited.admit(_scope("/v1/documents"), {b"x-api-key": key.encode()})
    with pytest.raises(RateLimited):
        limited.admit(_scope("/v1/documents"), {b"x-api-key": key.encode()})
    for _ in range(3):
        assert limited.admit(_scope("/healthz"), {b"x-api-key": key.encode()}) is not None


def test_form_fields_heads_exact_budget_and_a_discard_after_the_spool_file_went(tmp_path: Path) -> None:
    from api.auth import key_id
    from pipeline.ingest import HashedFile

    body = (b"--" + BOUNDARY + b"\r\nContent-Disposition: form-data; name=\"schema\"\r\n\r\ninvoice\r\n"
            + _multipart([("exact.bin", b"e" * MEMORY_FILE_BYTES)]))
    memory = MemoryBudget(MEMORY_FILE_BYTES)  # exactly one 1 MiB file fits
    form = _receive(body, tmp_path / "spool", memory)
    assert form.fields == {"schema": "invoice"}  # a part without filename is a text field, not a file
    [(field, exact)] = form.files
    assert field == "file" and exact.filename == "exact.bin" and exact.path is None
    assert memory.used == MEMORY_FILE_BYTES and exact.head == b"e" * HashedFile.HEAD_BYTES
    form.discard()
    large = _receive(_multipart([("big.bin", b"\x01\x02" * MEMORY_FILE_BYTES)]), tmp_path / "spool", memory)
    [(_, big)] = large.files
    assert big.head == (b"\x01\x02" * MEMORY_FILE_BYTES)[: HashedFile.HEAD_BYTES] and big.path is not None
    big.path.unlink()  # already moved into the blob store (or swept): discarding must not fail on it
    large.discard()
    assert memory.used == 0 and large.files == []
    assert key_id("some-key") == "key-" + __import__("hashlib").sha256(b"some-key").hexdigest()[:12]


# --- the multipart framing limits and refusals, each with its code and message -----------------------------------
def _part(headers: bytes, data: bytes = b"v") -> bytes:
    return b"--" + BOUNDARY + b"\r\n" + headers + b"\r\n\r\n" + data + b"\r\n"


def _field(name: str, value: bytes = b"v") -> bytes:
    return _part(b'Content-Disposition: form-data; name="' + name.encode() + b'"', value)


def _file(name: str, data: bytes = b"d") -> bytes:
    return _part(b'Content-Disposition: form-data; name="file"; filename="' + name.encode() + b'"', data)


END = b"--" + BOUNDARY + b"--\r\n"


def _refusal(body: bytes, tmp_path: Path, *, content_type: bytes | None = None, max_files: int = 2,
             max_file_bytes: int = 1000, chunks: list[bytes] | None = None):
    from api.errors import ApiError

    pieces = list(chunks) if chunks is not None else [body]
    memory = MemoryBudget(1 << 20)

    async def receive() -> dict[str, object]:
        if not pieces:
            return {"type": "http.disconnect"}
        piece = pieces.pop(0)
        return {"type": "http.request", "body": piece, "more_body": bool(pieces) or chunks is not None}

    ctype = content_type if content_type is not None else b"multipart/form-data; boundary=" + BOUNDARY
    scope = {"type": "http", "method": "POST", "path": "/v1/documents", "headers": [(b"content-type", ctype)]}
    spool = tmp_path / "spool"
    with pytest.raises(ApiError) as err:
        asyncio.run(receive_form(Request(scope, receive), spool, memory, max_file_bytes=max_file_bytes,
                                 max_files=max_files))
    # an aborted upload leaves no spool file and no memory behind
    assert memory.used == 0 and (not spool.exists() or list(spool.iterdir()) == [])
    return err.value


@pytest.mark.parametrize("body, status, code, detail", [
    (b"".join(_file(f"f{i}") for i in range(3)) + END, 400, "too_many_files", "At most 2 file(s) per request."),
    (b"".join(_field(f"k{i}") for i in range(33)) + END, 400, "too_many_fields",
     "At most 32 form fields per request."),
    (b"".join(_field("same") for _ in range(35)) + END, 400, "too_many_parts",
     "At most 34 parts per multipart request (2 file(s) and 32 fields)."),
    (_field("schema", b"s" * (64 * 1024 + 1)) + END, 400, "field_too_large",
     "Form field 'schema' exceeds 65536 bytes."),
    (_part(b"Content-Disposition: form-data") + END, 400, "malformed_multipart",
     "Every form part needs a Content-Disposition name."),
    (_part(b'Content-Disposition: form-data; name="f"' + b"".join(b"\r\nX-H%d: 1" % i for i in range(8))) + END,
     400, "too_many_part_headers", "A form part has more than 8 headers."),
    (_part(b'Content-Disposition: form-data; name="f"\r\nX-Big: ' + b"h" * 4100) + END, 413,
     "multipart_headers_too_large", "The headers of one form part exceed 4096 bytes; a file part needs only "
     "Content-Disposition and Content-Type."),
    (_file("big.bin", b"x" * 1001) + END, 413, "payload_too_large",
     "The request body exceeds the limit of 1000 bytes; send a smaller file."),
    (b"--" + BOUNDARY + b'\r\nContent-Disposition: form-data; name="file"; filename="cut.bin"\r\n\r\nxyz', 400,
     "malformed_multipart", "The multipart body ended in the middle of a file."),
])
def test_multipart_refusals(tmp_path: Path, body: bytes, status: int, code: str, detail: str) -> None:
    err = _refusal(body, tmp_path)
    assert (err.status, err.code, err.detail) == (status, code, detail)


def test_multipart_refusals_of_the_request_itself(tmp_path: Path) -> None:
    err = _refusal(END, tmp_path, content_type=b"application/json")
    assert (err.status, err.code, err.detail) == (415, "unsupported_media_type", "Send the upload as "
                                                                                  "multipart/form-data.")
    err = _refusal(END, tmp_path, content_type=b"multipart/form-data")
    assert (err.status, err.code) == (400, "malformed_multipart") and "no boundary" in err.detail
    err = _refusal(END, tmp_path, content_type=b"multipart/form-data; boundary=" + b"b" * 71)
    assert (err.status, err.code, err.extra) == (400, "multipart_boundary_too_long", {"limit_bytes": 70})
    assert err.detail.startswith("The multipart boundary is 71 bytes long; at most 70 are allowed")
    ok_boundary = b"b" * 70  # exactly the RFC's maximum is accepted
    body = (b"--" + ok_boundary + b'\r\nContent-Disposition: form-data; name="k"\r\n\r\nv\r\n--' + ok_boundary
            + b"--\r\n")

    async def receive() -> dict[str, object]:
        return {"type": "http.request", "body": body, "more_body": False}

    scope = {"type": "http", "method": "POST", "path": "/", "headers": [
        (b"content-type", b"multipart/form-data; boundary=" + ok_boundary)]}
    form = asyncio.run(receive_form(Request(scope, receive), tmp_path, MemoryBudget(10), max_file_bytes=10,
                                    max_files=1))
    assert form.fields == {"k": "v"}
    # a client that goes away mid-file: 400 client_disconnected, and the partial spool file is removed
    partial = [_file("gone.bin", b"y" * (MEMORY_FILE_BYTES + 5000))[:-40]]  # spooled; no closing boundary
    err = _refusal(b"", tmp_path, chunks=partial, max_file_bytes=4 * MEMORY_FILE_BYTES)
    assert (err.status, err.code) == (400, "client_disconnected")


def test_multipart_limits_accept_their_exact_maximum_and_count_across_chunks(tmp_path: Path) -> None:
    # exactly 2 files + 32 fields (the part cap), 8 headers in a part, 4096 header bytes: all accepted
    def values(form: ReceivedForm) -> tuple[dict[str, str], list[str]]:
        return form.fields, [f.filename for _, f in form.files]

    many = b"".join(_field(f"k{i}") for i in range(32)) + _file("a.bin") + _file("b.bin") + END
    fields, files = values(_receive(many, tmp_path, MemoryBudget(1 << 20)))
    assert len(fields) == 32 and files == ["a.bin", "b.bin"]
    eight = _part(b'Content-Disposition: form-data; name="f"' + b"".join(b"\r\nX-H%d: 1" % i for i in range(7))) + END
    assert values(_receive(eight, tmp_path, MemoryBudget(10)))[0] == {"f": "v"}
    disposition = b'Content-Disposition: form-data; name="f"'
    used = len(b"Content-Disposition") + len(b'form-data; name="f"') + len(b"X-Pad")
    exact = _part(disposition + b"\r\nX-Pad: " + b"p" * (4096 - used)) + END
    assert values(_receive(exact, tmp_path, MemoryBudget(10)))[0] == {"f": "v"}
    # several headers, each well under the parser's own per-header limit, count together
    spread = _part(disposition + b"".join(b"\r\nX-P%d: " % i + b"p" * 1500 for i in range(3))) + END
    err = _refusal(spread, tmp_path)
    assert (err.status, err.code) == (413, "multipart_headers_too_large")
    # header names and values split over many small chunks are put back together
    body = _field("schema", b"invoice") + _file("tiny.bin", b"0123456789") + END
    form = _receive(body, tmp_path, MemoryBudget(1 << 20), chunk=7)
    assert form.fields == {"schema": "invoice"} and [(n, f.filename, f.data) for n, f in form.files] == [
        ("file", "tiny.bin", b"0123456789")]
    # a name that is not UTF-8 is kept, replaced, not refused; a part with no Content-Disposition is refused
    odd = _part(b'Content-Disposition: form-data; name="\xffx"', b"1") + END
    assert _receive(odd, tmp_path, MemoryBudget(10)).fields == {"\ufffdx": "1"}
    err = _refusal(_part(b"Content-Type: text/plain") + END, tmp_path)
    assert (err.code, err.detail) == ("malformed_multipart", "Every form part needs a Content-Disposition name.")


def test_spooled_and_kept_files_carry_size_digest_head_and_a_sweepable_name(tmp_path: Path) -> None:
    import hashlib

    from api.uploads import sweep_spool
    from pipeline.ingest import HashedFile

    head_plus = bytes(range(256)) * ((HashedFile.HEAD_BYTES + 50) // 256 + 1)
    head_plus = head_plus[: HashedFile.HEAD_BYTES + 50]
    big = b"B" * (MEMORY_FILE_BYTES + 10)
    body = (_field("note", b"caf\xe9") + _file("exact.bin", b"m" * 1000) + _file("head.bin", head_plus) + END)
    spool = tmp_path / "deep" / "spool"  # made on first use, parents too
    form = _receive(body, spool, MemoryBudget(1 << 20), chunk=7)  # heads and values span many chunks
    assert form.fields == {"note": "caf\ufffd"}  # a value that is not UTF-8 is replaced, not refused
    (_, exact), (_, headed) = form.files
    assert exact.size == 1000 and exact.sha256 == hashlib.sha256(b"m" * 1000).hexdigest()
    assert headed.head == head_plus[: HashedFile.HEAD_BYTES] and headed.size == len(head_plus)
    # a file of exactly max_file_bytes (here 64 MiB by _receive) is accepted; the spool file is named for the sweep
    spilled = _receive(_multipart([("big.bin", big), ("big2.bin", big)]), spool, MemoryBudget(1 << 20))
    [(_, on_disk), (_, second)] = spilled.files  # the first makes the spool folder, the second finds it
    for f in (on_disk, second):
        assert f.path is not None and f.path.name.startswith("upload-") and f.path.suffix == ".part"
    assert on_disk.size == len(big) and on_disk.sha256 == hashlib.sha256(big).hexdigest()
    import os

    for f in (on_disk, second):
        os.utime(f.path, (0, 0))  # leftovers of a crashed process: swept
    assert sweep_spool(spool, older_than_s=60) == 2 and not on_disk.path.exists() and not second.path.exists()


def test_a_file_of_exactly_the_size_limit_is_accepted(tmp_path: Path) -> None:
    data = b"L" * 1000

    async def receive() -> dict[str, object]:
        return {"type": "http.request", "body": _multipart([("limit.bin", data)]), "more_body": False}

    scope = {"type": "http", "method": "POST", "path": "/", "headers": [
        (b"content-type", b"multipart/form-data; boundary=" + BOUNDARY)]}
    form = asyncio.run(receive_form(Request(scope, receive), tmp_path, MemoryBudget(1 << 20), max_file_bytes=1000,
                                    max_files=1))
    assert form.files[0][1].size == 1000


def test_a_stalled_upload_is_cut_off_with_408_and_leaves_nothing(tmp_path: Path) -> None:
    from api.errors import ApiError

    sent = [_file("slow.bin", b"s" * (MEMORY_FILE_BYTES + 100))[:-10]]  # spooled, then the client goes quiet

    async def receive() -> dict[str, object]:
        if sent:
            return {"type": "http.request", "body": sent.pop(), "more_body": True}
        await asyncio.sleep(3600)  # never sends again
        raise AssertionError("unreachable")

    scope = {"type": "http", "method": "POST", "path": "/", "headers": [
        (b"content-type", b"multipart/form-data; boundary=" + BOUNDARY)]}
    memory = MemoryBudget(1 << 22)
    with pytest.raises(ApiError) as err:
        asyncio.run(receive_form(Request(scope, receive), tmp_path / "spool", memory, max_file_bytes=1 << 22,
                                 max_files=1, idle_timeout_s=0.3))
    assert (err.value.status, err.value.code) == (408, "upload_stalled")
    assert err.value.detail.startswith("No upload data arrived for 0 s; the upload was abandoned. Send it again.")
    assert err.value.headers == {"Connection": "close"}
    assert memory.used == 0 and list((tmp_path / "spool").iterdir()) == []


def test_the_gate_messages_tenants_and_per_key_and_per_address_buckets() -> None:
    from api.errors import ApiError, RateLimited

    tenant_key, admin_key, plain = "t" * 20, "a" * 20, "p" * 20
    gate = _gate([f"acme:{tenant_key}", f"*:{admin_key}", plain], burst=1)
    acme = gate.admit(_scope("/v1/documents"), {b"x-api-key": tenant_key.encode()})
    admin = gate.admit(_scope("/v1/documents"), {b"x-api-key": admin_key.encode()})
    other = gate.admit(_scope("/v1/documents"), {b"x-api-key": plain.encode()})  # its own bucket: not limited
    assert acme is not None and (acme.access.tenant, acme.access.admin, acme.tenant) == ("acme", False, "acme")
    assert admin is not None and admin.access.admin and other is not None and not other.access.admin
    with pytest.raises(ApiError) as err:
        _gate([plain]).admit(_scope("/v1/x"), {})
    assert err.value.detail == ("This server requires an API key: send 'Authorization: Bearer <key>' or "
                                "'X-API-Key: <key>'.")
    with pytest.raises(ApiError) as err:
        _gate([plain]).admit(_scope("/v1/x"), {b"x-api-key": b"nope-nope-nope-nope"})
    assert err.value.detail == "The API key is not valid for this server."
    # refused guesses are charged per client address (not per port, not all together)
    guarded = _gate([plain], burst=1)
    with pytest.raises(ApiError):
        guarded.admit({"type": "http", "path": "/v1/x", "client": ("10.0.0.1", 7)}, {b"x-api-key": b"g" * 20})
    with pytest.raises(RateLimited):
        guarded.admit({"type": "http", "path": "/v1/x", "client": ("10.0.0.1", 8)}, {b"x-api-key": b"g" * 20})
    with pytest.raises(ApiError) as err:
        guarded.admit({"type": "http", "path": "/v1/x", "client": ("10.0.0.2", 7)}, {b"x-api-key": b"g" * 20})
    assert err.value.status == 403
    # no client address in the scope (a test client, a unix socket): one "local" caller
    anon = _gate([]).admit({"type": "http", "path": "/v1/x"}, {})
    assert anon is not None and anon.key_id == "addr-local"
    with pytest.raises(ApiError):
        guarded.admit({"type": "http", "path": "/v1/x"}, {b"x-api-key": b"g" * 20})
    with pytest.raises(RateLimited):  # the second local guess: the "local" bucket is spent
        guarded.admit({"type": "http", "path": "/v1/x"}, {b"x-api-key": b"g" * 20})

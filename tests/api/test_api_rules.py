"""api/auth.py and api/uploads.py pieces no faster test reached (the mutation pass of issue #22,
tests/MUTATION.md): the gate's refusal document, the spool sweep, a spooled file's pipeline view, the parser's own
header-limit errors. In memory or in a tmp folder, no server.
"""
from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

import pytest
from python_multipart.exceptions import MultipartParseError
from starlette.requests import Request

from api.auth import Gate, KeyRing, Principal, refusal_response
from api.errors import ApiError
from api.limits import RateLimiter
from api.uploads import (
    MAX_FIELD_BYTES,
    MEMORY_FILE_BYTES,
    MemoryBudget,
    SpooledFile,
    _FormBuilder,
    _header_limit_error,
    receive_form,
    sweep_spool,
)

BOUNDARY = b"rules-boundary"


def _body(response: object) -> dict[str, object]:
    return json.loads(response.body)  # type: ignore[attr-defined]  # a JSONResponse


def test_a_401_refusal_names_the_scheme_and_keeps_the_errors_headers() -> None:
    exc = ApiError(401, "missing_api_key", "Send an API key.", headers={"X-Trace": "t1"}, extra={"hint": "Bearer"})
    response = refusal_response(exc, "/v1/documents")
    assert response.status_code == 401
    assert response.headers["www-authenticate"] == 'Bearer realm="docpipe"'
    assert response.headers["x-trace"] == "t1"
    assert response.headers["content-type"] == "application/problem+json"
    body = _body(response)
    assert (body["status"], body["code"], body["detail"], body["instance"]) == (
        401, "missing_api_key", "Send an API key.", "/v1/documents")
    assert body["hint"] == "Bearer" and body["type"] == "https://docpipe.dev/problems/missing_api_key"
    assert exc.headers == {"X-Trace": "t1"}  # the error's own headers are not changed for the next refusal


def test_other_refusals_carry_no_authentication_challenge() -> None:
    exc = ApiError(429, "rate_limited", "Slow down.", headers={"Retry-After": "3"})
    response = refusal_response(exc, "/v1/jobs")
    assert response.status_code == 429 and response.headers["retry-after"] == "3"
    assert "www-authenticate" not in response.headers
    body = _body(response)
    assert (body["code"], body["detail"], body["instance"], body["status"]) == (
        "rate_limited", "Slow down.", "/v1/jobs", 429)
    forbidden = refusal_response(ApiError(403, "forbidden", "Not yours."), "/admin")
    assert "www-authenticate" not in forbidden.headers and _body(forbidden)["instance"] == "/admin"


def test_the_sweep_removes_only_old_partial_uploads_and_chat_media(tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    assert sweep_spool(spool, 60) == 0  # no folder yet
    spool.mkdir()
    old = time.time() - 600
    names = {"upload-a.part": True, "chat-video-b.mp4": True, "keep.txt": False, "uploaded.part": False}
    for name in names:
        path = spool / name
        path.write_bytes(b"x")
        os.utime(path, (old, old))
    recent = spool / "upload-new.part"
    recent.write_bytes(b"y")  # another process's upload in flight
    folder = spool / "upload-dir"
    folder.mkdir()
    os.utime(folder, (old, old))
    assert sweep_spool(spool, 60) == 2
    left = {p.name for p in spool.iterdir()}
    assert left == {"keep.txt", "uploaded.part", "upload-new.part", "upload-dir"}
    assert sweep_spool(spool, 60) == 0
    assert sweep_spool(spool, -10) == 1  # older than "ten seconds in the future": the recent one too
    assert not recent.exists()


def test_a_spooled_file_is_handed_to_the_pipeline_as_received(tmp_path: Path) -> None:
    on_disk = SpooledFile(filename="a.pdf", size=5, sha256="ab" * 32, head=b"%PDF-", path=tmp_path / "p")
    view = on_disk.hashed()
    assert (view.sha256, view.size, view.path, view.data, view.head) == ("ab" * 32, 5, tmp_path / "p", None, b"%PDF-")
    in_memory = SpooledFile(filename="b.png", size=3, sha256="cd" * 32, head=b"abc", data=b"abc")
    view = in_memory.hashed()
    assert (view.sha256, view.size, view.path, view.data, view.head) == ("cd" * 32, 3, None, b"abc", b"abc")


def test_the_parsers_own_header_limits_are_answered_as_ours() -> None:
    size = _header_limit_error(MultipartParseError("Maximum header size exceeded: 4097 > 4096"))
    assert size is not None
    assert (size.status, size.code, size.extra) == (413, "multipart_headers_too_large", {"limit_bytes": 4096})
    assert size.detail == ("The headers of one form part exceed 4096 bytes; a file part needs only "
                           "Content-Disposition and Content-Type.")
    count = _header_limit_error(MultipartParseError("Maximum header count exceeded: 9 > 8"))
    assert count is not None
    assert (count.status, count.code, count.detail) == (400, "too_many_part_headers",
                                                        "A form part has more than 8 headers.")
    assert _header_limit_error(MultipartParseError("Did not find boundary character 'x' at index 2")) is None


def test_without_keys_a_caller_is_an_unauthenticated_address() -> None:
    gate = Gate(KeyRing([]), RateLimiter(60, 100))
    assert gate.admit({"type": "http", "path": "/v1/jobs", "client": ("10.2.3.4", 999)}, {}) == Principal(
        key_id="addr-10.2.3.4", authenticated=False)
    assert gate.admit({"type": "http", "path": "/v1/jobs"}, {}) == Principal(key_id="addr-local",
                                                                             authenticated=False)


def test_the_sweep_keeps_a_file_of_exactly_the_age_and_tolerates_a_sweeper_that_was_faster(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spool = tmp_path / "spool"
    spool.mkdir()
    at_cutoff, older = spool / "upload-edge.part", spool / "upload-old.part"
    for path, mtime in ((at_cutoff, 1_000_000), (older, 999_999)):
        path.write_bytes(b"x")
        os.utime(path, (mtime, mtime))
    monkeypatch.setattr(time, "time", lambda: 1_000_060.0)
    real_unlink = Path.unlink

    def raced(self: Path, missing_ok: bool = False) -> None:
        os.remove(self)  # another API process sharing the data dir swept it first
        real_unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", raced)
    assert sweep_spool(spool, 60) == 1  # older than 60 s: only the one 61 s old
    assert [p.name for p in spool.iterdir()] == ["upload-edge.part"]


def _form_request(body: bytes) -> Request:
    async def receive() -> dict[str, object]:
        return {"type": "http.request", "body": body, "more_body": False}

    return Request({"type": "http", "method": "POST", "path": "/", "headers": [
        (b"content-type", b"multipart/form-data; boundary=" + BOUNDARY)]}, receive)


def test_a_field_of_exactly_the_field_limit_is_accepted(tmp_path: Path) -> None:
    value = b"v" * MAX_FIELD_BYTES
    body = (b"--" + BOUNDARY + b'\r\nContent-Disposition: form-data; name="k"\r\n\r\n' + value + b"\r\n--" + BOUNDARY
            + b"--\r\n")
    form = asyncio.run(receive_form(_form_request(body), tmp_path, MemoryBudget(10), max_file_bytes=10, max_files=1))
    assert form.fields == {"k": value.decode()}


def test_an_abort_after_the_spool_file_went_is_quiet(tmp_path: Path) -> None:
    memory = MemoryBudget(MEMORY_FILE_BYTES)
    builder = _FormBuilder(tmp_path, 8 * MEMORY_FILE_BYTES, 1, memory)
    builder.on_part_begin()
    for field_, value in ((b"Content-Disposition", b'form-data; name="f"; filename="a.bin"'),):
        builder.on_header_field(field_, 0, len(field_))
        builder.on_header_value(value, 0, len(value))
        builder.on_header_end()
    builder.on_headers_finished()
    chunk = b"z" * (MEMORY_FILE_BYTES + 1)
    builder.on_part_data(chunk, 0, len(chunk))  # past the memory share: on disk now
    spooled = list(tmp_path.iterdir())
    assert len(spooled) == 1 and memory.used == 0
    spooled[0].unlink()  # e.g. swept by another process while the upload stalled
    builder.abort()
    assert list(tmp_path.iterdir()) == [] and builder.open_part is None


def _part(headers: bytes, value: bytes = b"v") -> bytes:
    return b"--" + BOUNDARY + b"\r\n" + headers + b"\r\n\r\n" + value + b"\r\n"


END = b"--" + BOUNDARY + b"--\r\n"


def test_exactly_max_files_plus_max_fields_parts_are_accepted(tmp_path: Path) -> None:
    body = (b"".join(_part(b'Content-Disposition: form-data; name="k%d"' % i) for i in range(32))
            + b"".join(_part(b'Content-Disposition: form-data; name="f"; filename="%d.bin"' % i) for i in range(2))
            + END)
    form = asyncio.run(receive_form(_form_request(body), tmp_path, MemoryBudget(100), max_file_bytes=10,
                                    max_files=2))
    assert len(form.fields) == 32 and [f.filename for _, f in form.files] == ["0.bin", "1.bin"]
    form.discard()


def test_a_file_name_that_is_not_utf8_is_replaced_not_refused(tmp_path: Path) -> None:
    body = _part(b'Content-Disposition: form-data; name="f"; filename="\xffa.bin"', b"data") + END
    form = asyncio.run(receive_form(_form_request(body), tmp_path, MemoryBudget(100), max_file_bytes=10,
                                    max_files=1))
    assert [(name, f.filename, f.data) for name, f in form.files] == [("f", "\ufffda.bin", b"data")]
    form.discard()


def _headers(builder: _FormBuilder, headers: list[tuple[bytes, bytes]]) -> None:
    for name, value in headers:
        builder.on_header_field(name, 0, len(name))
        builder.on_header_value(value, 0, len(value))
        builder.on_header_end()


def test_the_form_builder_counts_part_headers_itself(tmp_path: Path) -> None:
    """Older python-multipart releases have no header limits: the callbacks enforce ours whatever the parser."""
    builder = _FormBuilder(tmp_path, 10, 1, MemoryBudget(100))
    disposition = [(b"Content-Disposition", b'form-data; name="k"')]
    for _ in range(2):  # the count starts again with every part
        builder.on_part_begin()
        _headers(builder, disposition + [(b"X-H%d" % i, b"1") for i in range(7)])  # 8 headers: the maximum
        builder.on_headers_finished()
        assert builder.part.name == "k" and builder.header_count == 8
    builder.on_part_begin()
    with pytest.raises(ApiError) as caught:
        _headers(builder, disposition + [(b"X-H%d" % i, b"1") for i in range(8)])
    assert (caught.value.status, caught.value.code) == (400, "too_many_part_headers")


def test_a_multipart_content_type_without_a_boundary_says_so(tmp_path: Path) -> None:
    async def receive() -> dict[str, object]:
        return {"type": "http.request", "body": END, "more_body": False}

    request = Request({"type": "http", "method": "POST", "path": "/", "headers": [
        (b"content-type", b"multipart/form-data")]}, receive)
    with pytest.raises(ApiError) as caught:
        asyncio.run(receive_form(request, tmp_path, MemoryBudget(10), max_file_bytes=10, max_files=1))
    assert (caught.value.status, caught.value.code, caught.value.detail) == (
        400, "malformed_multipart", "The multipart Content-Type has no boundary.")


def _refused(request: Request, tmp_path: Path) -> ApiError:
    memory = MemoryBudget(1 << 20)
    with pytest.raises(ApiError) as caught:
        asyncio.run(receive_form(request, tmp_path / "spool", memory, max_file_bytes=1 << 22, max_files=1))
    assert memory.used == 0 and not (tmp_path / "spool").exists()
    return caught.value


def test_a_body_the_parser_cannot_read_is_a_400_that_says_so(tmp_path: Path) -> None:
    err = _refused(_form_request(b"garbage"), tmp_path)
    assert (err.status, err.code) == (400, "malformed_multipart")
    assert err.detail.startswith("The multipart body could not be parsed: ") and len(err.detail) > 41


def test_any_other_error_of_the_parser_is_a_400_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from python_multipart.multipart import MultipartParser

    def refuse(self: MultipartParser, data: bytes) -> int:
        raise ValueError("bad framing")  # python-multipart raises ValueError for some malformed input

    monkeypatch.setattr(MultipartParser, "write", refuse)
    err = _refused(_form_request(END), tmp_path)
    assert (err.status, err.code, err.detail) == (400, "malformed_multipart",
                                                  "The multipart body could not be parsed: bad framing")


def test_a_spool_disk_error_is_the_servers_not_a_malformed_upload(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A file over the in-memory size goes to the spool folder; when that disk fails (here: full), the error is
    raised as it is (the app answers it 500 with an incident id), never 400 malformed_multipart, and nothing stays
    behind."""
    import errno

    import api.uploads

    def full(*args: object, **kwargs: object) -> tuple[int, str]:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(api.uploads.tempfile, "mkstemp", full)
    body = _part(b'Content-Disposition: form-data; name="file"; filename="big.bin"',
                 os.urandom(MEMORY_FILE_BYTES + 1)) + END
    memory = MemoryBudget(1 << 22)
    with pytest.raises(OSError, match="No space left"):
        asyncio.run(receive_form(_form_request(body), tmp_path / "spool", memory, max_file_bytes=1 << 22,
                                 max_files=1))
    assert memory.used == 0


def test_a_client_that_leaves_mid_upload_is_told_what_happened(tmp_path: Path) -> None:
    pieces = [_part(b'Content-Disposition: form-data; name="f"; filename="a.bin"', b"x" * 100)[:-20]]

    async def receive() -> dict[str, object]:
        if pieces:
            return {"type": "http.request", "body": pieces.pop(), "more_body": True}
        return {"type": "http.disconnect"}

    request = Request({"type": "http", "method": "POST", "path": "/", "headers": [
        (b"content-type", b"multipart/form-data; boundary=" + BOUNDARY)]}, receive)
    err = _refused(request, tmp_path)
    assert (err.status, err.code, err.detail) == (400, "client_disconnected",
                                                  "The client closed the connection before the upload finished.")

"""Streaming multipart/form-data reception: file parts are hashed and counted as they arrive, and kept in memory
while small (within a process-wide MemoryBudget) or written to a spool file as they stream in.

Starlette's form parser spools the whole body before the route sees it, so a size limit could only be checked
afterwards. Here every received byte is counted, the limit is enforced on bytes actually received (whatever
Content-Length claims), and an aborted upload leaves no file behind.
"""
from __future__ import annotations

import asyncio
import hashlib
import os
import tempfile
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.requests import ClientDisconnect, Request

from pipeline.ingest import HashedFile

from .errors import ApiError, BodyTooLarge

MAX_FIELD_BYTES = 64 * 1024  # text fields (schema name, password) are small
MAX_FIELDS = 32
# The multipart framing itself, explicit rather than whatever the installed parser allows (python-multipart takes
# 256-byte boundaries; its header limits exist only in recent releases, older ones buffer any amount of headers).
MAX_BOUNDARY_BYTES = 70  # RFC 2046, section 5.1.1; what browsers, curl and httpx send is 30-70
MAX_PART_HEADER_BYTES = 4096  # names and values of one part's headers together
MAX_PART_HEADERS = 8  # headers of one part (Content-Disposition and Content-Type are what we read)
MEMORY_FILE_BYTES = 1024 * 1024  # a file part up to this size may stay in memory (see MemoryBudget)


class MemoryBudget:
    """Bytes of uploaded file parts this process holds in memory, across all requests, and their cap.

    Small uploads stay in memory until the worker thread writes them into the blob store: creating a spool file
    from the event loop blocked it for about a millisecond per upload (the file system journal is busy with the
    other uploads' fsyncs), and every other request waited meanwhile. A part that would pass `MEMORY_FILE_BYTES`,
    or the cap, goes to a spool file instead, so memory stays bounded whatever the load."""

    def __init__(self, cap_bytes: int) -> None:
        self.cap_bytes = cap_bytes
        self._used = 0
        self._lock = threading.Lock()  # taken on the event loop, given back from worker threads

    def take(self, n: int) -> bool:
        with self._lock:
            if self._used + n > self.cap_bytes:
                return False
            self._used += n
            return True

    def give_back(self, n: int) -> None:
        with self._lock:
            self._used -= n

    @property
    def used(self) -> int:
        with self._lock:
            return self._used


@dataclass
class SpooledFile:
    """One received file part: in memory (`data`, counted in the form's MemoryBudget) or on disk (`path`, in the
    spool directory next to the blob store)."""

    filename: str  # the client's name: display only, never used as a path
    size: int
    sha256: str
    head: bytes  # the first HashedFile.HEAD_BYTES (all of a smaller file): the type is sniffed from these
    path: Path | None = None
    data: bytes | None = None

    def hashed(self) -> HashedFile:
        """The pipeline's view of this file: stored in the blob store, neither read nor hashed again."""
        return HashedFile(sha256=self.sha256, size=self.size, path=self.path, data=self.data, head=self.head)


@dataclass
class ReceivedForm:
    fields: dict[str, str] = field(default_factory=dict)
    files: list[tuple[str, SpooledFile]] = field(default_factory=list)  # (form field name, file)
    memory: MemoryBudget | None = None  # what in-memory files are counted in

    def discard(self) -> None:
        """Drop every received file (after an error, or once the blob store has its own copies)."""
        for _, f in self.files:
            if f.path is not None:
                f.path.unlink(missing_ok=True)
            if f.data is not None and self.memory is not None:
                self.memory.give_back(len(f.data))
        self.files.clear()


class _Part:
    def __init__(self) -> None:
        self.headers: dict[bytes, bytes] = {}
        self.name: str = ""
        self.filename: str | None = None  # None: a text field
        self.data = bytearray()  # a text field's value, or a file's bytes while it stays in memory
        self.out: BinaryIO | None = None  # a file's spool file, once it went to disk
        self.path: Path | None = None
        self.hasher = hashlib.sha256()
        self.size = 0
        self.head = b""


class _FormBuilder:
    """Receives python-multipart callbacks and builds a ReceivedForm, enforcing per-file and count limits."""

    def __init__(self, spool_dir: Path, max_file_bytes: int, max_files: int, memory: MemoryBudget) -> None:
        self.spool_dir = spool_dir
        self.max_file_bytes = max_file_bytes
        self.max_files = max_files
        self.max_parts = max_files + MAX_FIELDS  # repeated field names overwrite: count the parts themselves
        self.memory = memory
        self.form = ReceivedForm(memory=memory)
        self.part = _Part()
        self.parts = 0
        self.header_name = b""
        self.header_value = b""
        self.header_bytes = 0  # of the current part's headers
        self.header_count = 0
        self.open_part: _Part | None = None  # the file part being received (cleaned up on abort)

    # -- callbacks ------------------------------------------------------------------------------------------------
    def on_part_begin(self) -> None:
        self.parts += 1
        if self.parts > self.max_parts:
            raise ApiError(400, "too_many_parts", f"At most {self.max_parts} parts per multipart request "
                           f"({self.max_files} file(s) and {MAX_FIELDS} fields).")
        self.part = _Part()
        self.header_bytes = 0
        self.header_count = 0

    def _count_header_bytes(self, n: int) -> None:
        self.header_bytes += n
        if self.header_bytes > MAX_PART_HEADER_BYTES:
            raise _headers_too_large()

    def on_header_field(self, data: bytes, start: int, end: int) -> None:
        self._count_header_bytes(end - start)
        self.header_name += data[start:end]

    def on_header_value(self, data: bytes, start: int, end: int) -> None:
        self._count_header_bytes(end - start)
        self.header_value += data[start:end]

    def on_header_end(self) -> None:
        self.header_count += 1
        if self.header_count > MAX_PART_HEADERS:
            raise _too_many_headers()
        self.part.headers[self.header_name.strip().lower()] = self.header_value.strip()
        self.header_name = b""
        self.header_value = b""

    def on_headers_finished(self) -> None:
        _, options = parse_options_header(self.part.headers.get(b"content-disposition", b""))
        if b"name" not in options:
            raise ApiError(400, "malformed_multipart", "Every form part needs a Content-Disposition name.")
        self.part.name = options[b"name"].decode("utf-8", "replace")
        if b"filename" in options:
            if len(self.form.files) >= self.max_files:
                raise ApiError(400, "too_many_files", f"At most {self.max_files} file(s) per request.")
            self.part.filename = options[b"filename"].decode("utf-8", "replace")
            self.open_part = self.part
        elif len(self.form.fields) >= MAX_FIELDS:
            raise ApiError(400, "too_many_fields", f"At most {MAX_FIELDS} form fields per request.")

    def on_part_data(self, data: bytes, start: int, end: int) -> None:
        chunk = data[start:end]
        part = self.part
        if part.filename is None:
            if len(part.data) + len(chunk) > MAX_FIELD_BYTES:
                raise ApiError(400, "field_too_large", f"Form field {part.name!r} exceeds {MAX_FIELD_BYTES} bytes.")
            part.data.extend(chunk)
            return
        part.size += len(chunk)
        if part.size > self.max_file_bytes:
            raise BodyTooLarge(self.max_file_bytes)
        part.hasher.update(chunk)
        if len(part.head) < HashedFile.HEAD_BYTES:
            part.head += chunk[:HashedFile.HEAD_BYTES - len(part.head)]
        if part.out is None:
            if part.size <= MEMORY_FILE_BYTES and self.memory.take(len(chunk)):
                part.data += chunk
                return
            self._to_disk(part)
        assert part.out is not None
        part.out.write(chunk)

    def on_part_end(self) -> None:
        part = self.part
        if part.filename is None:
            self.form.fields[part.name] = part.data.decode("utf-8", "replace")
            return
        if part.out is not None:
            part.out.close()
        self.open_part = None
        received = SpooledFile(filename=part.filename, size=part.size, sha256=part.hasher.hexdigest(),
                               head=part.head, path=part.path, data=None if part.out is not None else bytes(part.data))
        self.form.files.append((part.name, received))
        part.data = bytearray()  # its bytes now belong to `received` (and its share of the memory budget)

    def _to_disk(self, part: _Part) -> None:
        """Move a file part that outgrew its memory share into a spool file, and continue there."""
        try:
            fd, name = tempfile.mkstemp(prefix="upload-", suffix=".part", dir=self.spool_dir)
        except FileNotFoundError:  # first upload, or the folder was removed: made here, not checked per request
            self.spool_dir.mkdir(parents=True, exist_ok=True)
            fd, name = tempfile.mkstemp(prefix="upload-", suffix=".part", dir=self.spool_dir)
        part.out = os.fdopen(fd, "wb")
        part.path = Path(name)
        part.out.write(part.data)
        self.memory.give_back(len(part.data))
        part.data = bytearray()

    # -- cleanup --------------------------------------------------------------------------------------------------
    def abort(self) -> None:
        part = self.open_part
        if part is not None:
            if part.out is not None:
                part.out.close()
                if part.path is not None:
                    part.path.unlink(missing_ok=True)
            else:
                self.memory.give_back(len(part.data))
            part.data = bytearray()
            self.open_part = None
        self.form.discard()


async def _chunks(request: Request, idle_timeout_s: float) -> AsyncIterator[bytes]:
    """The body's chunks; a client that sends nothing for `idle_timeout_s` seconds is cut off (408), so a stalled
    or deliberately slow upload cannot hold a connection and a spool file forever."""
    stream = request.stream()
    while True:
        try:
            async with asyncio.timeout(idle_timeout_s):  # unlike wait_for, no extra task per chunk
                chunk = await anext(stream)
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise ApiError(408, "upload_stalled", f"No upload data arrived for {idle_timeout_s:.0f} s; the upload "
                           "was abandoned. Send it again.", headers={"Connection": "close"}) from None
        yield chunk


async def receive_form(request: Request, spool_dir: Path, memory: MemoryBudget, *, max_file_bytes: int,
                       max_files: int, idle_timeout_s: float = 60.0) -> ReceivedForm:
    """Parse a multipart/form-data request body as it streams in. Raises ApiError (400/408/413/415) on bad input,
    the framing limits above included."""
    content_type, params = parse_options_header(request.headers.get("content-type", ""))
    if content_type != b"multipart/form-data":
        raise ApiError(415, "unsupported_media_type", "Send the upload as multipart/form-data.")
    boundary = params.get(b"boundary")
    if not boundary:
        raise ApiError(400, "malformed_multipart", "The multipart Content-Type has no boundary.")
    if len(boundary) > MAX_BOUNDARY_BYTES:
        raise ApiError(400, "multipart_boundary_too_long", f"The multipart boundary is {len(boundary)} bytes long; "
                       f"at most {MAX_BOUNDARY_BYTES} are allowed (RFC 2046).",
                       extra={"limit_bytes": MAX_BOUNDARY_BYTES})
    builder = _FormBuilder(spool_dir, max_file_bytes, max_files, memory)
    callbacks = {
        name: getattr(builder, name)
        for name in ("on_part_begin", "on_part_data", "on_part_end", "on_header_field", "on_header_value",
                     "on_header_end", "on_headers_finished")
    }
    completed = False
    try:
        parser = _parser(boundary, callbacks)
        async for chunk in _chunks(request, idle_timeout_s):
            if chunk:
                parser.write(chunk)
        parser.finalize()
        if builder.open_part is not None:
            raise ApiError(400, "malformed_multipart", "The multipart body ended in the middle of a file.")
        completed = True
        return builder.form
    except ApiError:
        raise
    except ClientDisconnect as exc:
        raise ApiError(400, "client_disconnected",
                       "The client closed the connection before the upload finished.") from exc
    except MultipartParseError as exc:
        raise _header_limit_error(exc) or ApiError(400, "malformed_multipart", "The multipart body could not be "
                                                   f"parsed: {exc}") from exc
    except OSError:
        raise  # our spool's disk failing (full, unwritable) is the server's error: a 5xx with an incident id
    except Exception as exc:  # python-multipart raises its own parse errors (and ValueError) on malformed input
        raise ApiError(400, "malformed_multipart", f"The multipart body could not be parsed: {exc}") from exc
    finally:
        if not completed:
            builder.abort()


def _parser(boundary: bytes, callbacks: dict[str, Any]) -> MultipartParser:
    """The parser, with our header limits where its version takes them (older releases have none; our callbacks
    count the same limits either way)."""
    try:
        return MultipartParser(boundary, callbacks,  # type: ignore[arg-type]  # callbacks: a plain dict
                               max_header_size=MAX_PART_HEADER_BYTES, max_header_count=MAX_PART_HEADERS)
    except TypeError:
        return MultipartParser(boundary, callbacks)  # type: ignore[arg-type]  # callbacks: a plain dict


def _header_limit_error(exc: MultipartParseError) -> ApiError | None:
    """The parser's own header limits (it checks a header line as it scans it, before our callbacks see it)
    answered as ours are."""
    message = str(exc)
    if "Maximum header size" in message:
        return _headers_too_large()
    if "Maximum header count" in message:
        return _too_many_headers()
    return None


def _headers_too_large() -> ApiError:
    return ApiError(413, "multipart_headers_too_large", f"The headers of one form part exceed "
                    f"{MAX_PART_HEADER_BYTES} bytes; a file part needs only Content-Disposition and Content-Type.",
                    extra={"limit_bytes": MAX_PART_HEADER_BYTES})


def _too_many_headers() -> ApiError:
    return ApiError(400, "too_many_part_headers", f"A form part has more than {MAX_PART_HEADERS} headers.")


def sweep_spool(spool_dir: Path, older_than_s: float) -> int:
    """Remove partial uploads and chat media left by a crashed process (older than `older_than_s`, so that
    another API process sharing the data dir keeps its in-flight files). Returns how many were removed."""
    if not spool_dir.is_dir():
        return 0
    cutoff = time.time() - older_than_s
    removed = 0
    for path in spool_dir.iterdir():
        if path.is_file() and path.name.startswith(("upload-", "chat-video-")) and path.stat().st_mtime < cutoff:
            path.unlink(missing_ok=True)
            removed += 1
    return removed

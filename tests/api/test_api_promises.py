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

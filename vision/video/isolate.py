"""Run the video decoder (`_worker.py`) in a child process with time and memory limits.

Why a process: FFmpeg decoders can crash on damaged streams (PyAV issue 2344: SIGSEGV on truncated H.264). In a
child, a crash or an out-of-memory kill becomes `DecoderCrashedError`; a stuck decoder is killed after
`MediaLimits.decode_timeout_s` and becomes `DecodeTimeoutError`. The parent never loads a decoder itself.

Limits: the child's address space is capped with `RLIMIT_AS` (set with `prlimit` before the child receives its
request, so no decoding happens unlimited; `preexec_fn` is avoided because it is unsafe in threaded parents such as
Celery's thread pool), and its CPU time with `RLIMIT_CPU`. The wall-clock limit counts only the time the parent
spends waiting for the child, so a slow consumer of frames does not count against the decoder.
"""

from __future__ import annotations

import json
import math
import os
import resource
import select
import signal
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

from ..errors import CorruptMediaError, DecoderCrashedError, DecodeTimeoutError, MediaError

WORKER = Path(__file__).with_name("_worker.py")


class _Child:
    """One worker process and the reading side of its protocol."""

    def __init__(self, request: dict[str, Any], *, timeout_s: float, memory_bytes: int, name: str,
                 script: Path = WORKER) -> None:
        self.name = name
        self.timeout_s = timeout_s
        self.waited = 0.0
        self.stderr = tempfile.TemporaryFile()
        env = dict(os.environ, OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-u", str(script)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr, env=env, close_fds=True,
        )
        try:
            resource.prlimit(self.proc.pid, resource.RLIMIT_AS, (memory_bytes, memory_bytes))
            cpu = math.ceil(timeout_s) + 1
            resource.prlimit(self.proc.pid, resource.RLIMIT_CPU, (cpu, cpu + 1))
        except (ProcessLookupError, OSError):
            pass  # the child already died; reading below reports how
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write(json.dumps(request).encode() + b"\n")
            self.proc.stdin.close()
        except BrokenPipeError:
            pass
        self.fd = self.proc.stdout.fileno()

    def _read_exact(self, n: int) -> bytes | None:
        chunks: list[bytes] = []
        need = n
        while need:
            remaining = self.timeout_s - self.waited
            if remaining <= 0:
                raise self._timed_out()
            t0 = time.monotonic()
            ready, _, _ = select.select([self.fd], [], [], remaining)
            self.waited += time.monotonic() - t0
            if not ready:
                raise self._timed_out()
            chunk = os.read(self.fd, min(need, 1 << 20))
            if not chunk:
                return None  # EOF: the child exited or died
            chunks.append(chunk)
            need -= len(chunk)
        return b"".join(chunks)

    def _timed_out(self) -> MediaError:
        self.kill()
        return DecodeTimeoutError(
            f"decoding {self.name} took longer than {self.timeout_s:g} s (MediaLimits.decode_timeout_s); the file "
            f"may be damaged or too long. Shorten the video or raise the limit."
        )

    def _died(self) -> MediaError:
        code = self.proc.wait()
        self.stderr.seek(0)
        tail = self.stderr.read()[-300:].decode(errors="replace").strip()
        if code < 0:
            how = f"was killed by {signal.Signals(-code).name}"
            if -code == signal.SIGXCPU:
                how += " (CPU time limit)"
        else:
            how = f"exited with status {code}"
        if "MemoryError" in tail or "Cannot allocate" in tail or "std::bad_alloc" in tail:
            how += " (out of its memory limit, MediaLimits.decode_memory_bytes)"
        return DecoderCrashedError(
            f"the video decoder {how} while reading {self.name}; the stream is probably damaged or truncated — "
            f"re-encode or upload the video again." + (f" Decoder said: {tail}" if tail else "")
        )

    def messages(self) -> Iterator[tuple[dict[str, Any], bytes]]:
        """Yield (header, payload) until "done" or "error"; raises on crash or timeout."""
        while True:
            raw_len = self._read_exact(4)
            if raw_len is None:
                raise self._died()
            raw = self._read_exact(struct.unpack(">I", raw_len)[0])
            if raw is None:
                raise self._died()
            header = json.loads(raw)
            payload = self._read_exact(header["nbytes"]) if header["nbytes"] else b""
            if payload is None:
                raise self._died()
            yield header, payload
            if header["type"] in ("done", "error"):
                return

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def close(self) -> None:
        self.kill()
        if self.proc.stdout:
            self.proc.stdout.close()
        self.stderr.close()


def run(request: dict[str, Any], *, timeout_s: float, memory_bytes: int, name: str,
        script: Path = WORKER) -> Iterator[tuple[dict[str, Any], bytes]]:
    """Start a worker for `request` and yield its messages; the child is always reaped, even if the caller stops
    early. Worker-reported decode errors become `CorruptMediaError` unless the caller handles them (kind
    "no_video" is passed through as a message for the caller to map)."""
    child = _Child(request, timeout_s=timeout_s, memory_bytes=memory_bytes, name=name, script=script)
    try:
        for header, payload in child.messages():
            if header["type"] == "error" and header.get("kind") == "memory":
                raise DecoderCrashedError(
                    f"the video decoder ran out of its memory limit (MediaLimits.decode_memory_bytes) while reading "
                    f"{name}; raise the limit or reduce the video's resolution."
                )
            if header["type"] == "error" and header.get("kind") == "corrupt":
                raise CorruptMediaError(
                    f"{name} cannot be decoded as video ({header['message']}); it is truncated or damaged — "
                    f"re-encode or upload it again."
                )
            yield header, payload
    finally:
        child.close()

"""Run the video decoder (`_worker.py`) in a child process with time and memory limits.

Why a process: FFmpeg decoders can crash on damaged streams (PyAV issue 2344: SIGSEGV on truncated H.264). In a
child, a crash or an out-of-memory kill becomes `DecoderCrashedError`; a stuck decoder is killed after
`MediaLimits.decode_timeout_s` and becomes `DecodeTimeoutError`. The parent never loads a decoder itself.

One child serves one file: the probe at open time and, later, the decode of the sampled frames (starting Python
and loading FFmpeg costs ~0.25 s, so it is paid once per file). The child exits when its stdin closes.

Limits: the child's address space is capped with `RLIMIT_AS` (set with `prlimit` before the child receives a
request, so no decoding happens unlimited; `preexec_fn` is avoided because it is unsafe in threaded parents such as
Celery's thread pool), and its CPU time with `RLIMIT_CPU`. The wall-clock limit counts only the time the parent
spends waiting for the child during one request, so an idle child or a slow consumer of frames does not count.
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
_LAST = {"probe", "done", "error"}  # header types that end a request


class DecoderProcess:
    """One isolated decoder child and our side of its protocol."""

    def __init__(self, *, timeout_s: float, memory_bytes: int, name: str, script: Path = WORKER) -> None:
        self.name = name
        self.timeout_s = timeout_s
        self.stderr = tempfile.TemporaryFile()
        env = dict(os.environ, OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-u", str(script)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr, env=env, close_fds=True,
        )
        try:
            resource.prlimit(self.proc.pid, resource.RLIMIT_AS, (memory_bytes, memory_bytes))
            cpu = math.ceil(2 * timeout_s) + 1  # a probe and a decode
            resource.prlimit(self.proc.pid, resource.RLIMIT_CPU, (cpu, cpu + 1))
        except (ProcessLookupError, OSError):
            pass  # the child already died; reading reports how
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.fd = self.proc.stdout.fileno()
        self.waited = 0.0
        self.closed = False

    def request(self, request: dict[str, Any]) -> Iterator[tuple[dict[str, Any], bytes]]:
        """Send one request and yield its (header, payload) messages; the last one is probe, done or error.
        Raises `DecoderCrashedError` / `DecodeTimeoutError`, and `CorruptMediaError` for decode errors the child
        reports (kind "no_video" is yielded for the caller to map)."""
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(request).encode() + b"\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise self._died() from None
        self.waited = 0.0
        while True:
            header, payload = self._message()
            if header["type"] == "error" and header.get("kind") == "memory":
                raise DecoderCrashedError(
                    f"the video decoder ran out of its memory limit (MediaLimits.decode_memory_bytes) while reading "
                    f"{self.name}; raise the limit or reduce the video's resolution."
                )
            if header["type"] == "error" and header.get("kind") == "corrupt":
                raise CorruptMediaError(
                    f"{self.name} cannot be decoded as video ({header['message']}); it is truncated or damaged — "
                    f"re-encode or upload it again."
                )
            yield header, payload
            if header["type"] in _LAST:
                return

    def _message(self) -> tuple[dict[str, Any], bytes]:
        raw_len = self._read_exact(4)
        raw = self._read_exact(struct.unpack(">I", raw_len)[0])
        header = json.loads(raw)
        return header, self._read_exact(header["nbytes"]) if header["nbytes"] else b""

    def _read_exact(self, n: int) -> bytes:
        if self.closed:
            raise MediaError(f"{self.name} was closed while its frames were being read; open it again.")
        chunks: list[bytes] = []
        need = n
        while need:
            remaining = self.timeout_s - self.waited
            t0 = time.monotonic()
            ready = select.select([self.fd], [], [], max(remaining, 0))[0] if remaining > 0 else []
            self.waited += time.monotonic() - t0
            if not ready:
                raise self._timed_out()
            chunk = os.read(self.fd, min(need, 1 << 20))
            if not chunk:
                raise self._died()  # EOF: the child exited or was killed
            chunks.append(chunk)
            need -= len(chunk)
        return b"".join(chunks)

    def _timed_out(self) -> MediaError:
        self.close()
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
        if "MemoryError" in tail or "Cannot allocate" in tail or "failed to map" in tail:
            how += " (out of its memory limit, MediaLimits.decode_memory_bytes)"
        return DecoderCrashedError(
            f"the video decoder {how} while reading {self.name}; the stream is probably damaged or truncated — "
            f"re-encode or upload the video again." + (f" Decoder said: {tail}" if tail else "")
        )

    def close(self) -> None:
        """Stop the child (if still running) and release pipes; safe to call twice."""
        self.closed = True
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                try:
                    f.close()
                except BrokenPipeError:
                    pass
        self.stderr.close()


def run(request: dict[str, Any], *, timeout_s: float, memory_bytes: int, name: str,
        script: Path = WORKER) -> Iterator[tuple[dict[str, Any], bytes]]:
    """One request in a fresh child, which is always reaped, even if the caller stops early."""
    child = DecoderProcess(timeout_s=timeout_s, memory_bytes=memory_bytes, name=name, script=script)
    try:
        yield from child.request(request)
    finally:
        child.close()

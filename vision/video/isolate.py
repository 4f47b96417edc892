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

import sys
from pathlib import Path
from typing import Any, Iterator

from ..child import ChildDied, ChildProcess, ChildTimeout
from ..errors import CorruptMediaError, DecoderCrashedError, DecodeTimeoutError, MediaError

WORKER = Path(__file__).with_name("_worker.py")
_LAST = {"probe", "done", "error"}  # header types that end a request


class DecoderProcess:
    """One isolated decoder child (a `vision.child.ChildProcess`: limits, pipes, framing) and our side of its
    protocol: a wall-clock limit per request, and the decoder's failures as `MediaError`s about this file."""

    def __init__(self, *, timeout_s: float, memory_bytes: int, name: str, script: Path = WORKER) -> None:
        self.name = name
        self.timeout_s = timeout_s
        # The script by path, not `-m`: it runs without our package importable (see _worker.py).
        self._child = ChildProcess([sys.executable, "-u", str(script)], memory_bytes=memory_bytes,
                                   cpu_seconds=2 * timeout_s)  # a probe and a decode
        self.proc = self._child.proc
        self.waited = 0.0

    @property
    def closed(self) -> bool:
        return self._child.closed

    def request(self, request: dict[str, Any]) -> Iterator[tuple[dict[str, Any], bytearray]]:
        """Send one request and yield its (header, payload) messages; the last one is probe, done or error.
        Raises `DecoderCrashedError` / `DecodeTimeoutError`, and `CorruptMediaError` for decode errors the child
        reports (kind "no_video" is yielded for the caller to map)."""
        try:
            self._child.request(request)
        except ChildDied as died:
            raise self._crashed(died) from None
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

    def _message(self) -> tuple[dict[str, Any], bytearray]:
        """The next message, within what is left of this request's time (the wait is what counts)."""
        if self.closed:
            raise MediaError(f"{self.name} was closed while its frames were being read; open it again.")
        try:
            header, payload, waited = self._child.read(self.timeout_s - self.waited)
        except ChildTimeout:
            raise self._timed_out() from None
        except ChildDied as died:
            raise self._crashed(died) from None
        self.waited += waited
        return header, payload

    def _timed_out(self) -> MediaError:
        self.close()
        return DecodeTimeoutError(
            f"decoding {self.name} took longer than {self.timeout_s:g} s (MediaLimits.decode_timeout_s); the file "
            f"may be damaged or too long. Shorten the video or raise the limit."
        )

    def _crashed(self, died: ChildDied) -> MediaError:
        return DecoderCrashedError(
            f"the video decoder {died.how} while reading {self.name}; the stream is probably damaged or truncated — "
            f"re-encode or upload the video again." + (f" Decoder said: {died.stderr_tail}" if died.stderr_tail
                                                        else "")
        )

    def close(self) -> None:
        """Stop the child (if still running) and release pipes; safe to call twice."""
        self._child.close()


def run(request: dict[str, Any], *, timeout_s: float, memory_bytes: int, name: str,
        script: Path = WORKER) -> Iterator[tuple[dict[str, Any], bytearray]]:
    """One request in a fresh child, which is always reaped, even if the caller stops early."""
    child = DecoderProcess(timeout_s=timeout_s, memory_bytes=memory_bytes, name=name, script=script)
    try:
        yield from child.request(request)
    finally:
        child.close()

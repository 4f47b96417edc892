"""A child process we talk to over pipes, with an address-space and CPU limit and a wall-clock limit per reply.

The framing both sides use (`send` / `ChildProcess.read`): a 4-byte big-endian header length, a JSON header with
`nbytes`, then that many raw bytes. Requests go the other way as one JSON line each.

Failures are two internal exceptions, `ChildTimeout` and `ChildDied`; the caller turns them into `MediaError`s
with a message about its own file (this module does not know what the child was doing).
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
from collections.abc import Mapping
from typing import Any, BinaryIO


class ChildTimeout(Exception):
    """The child did not answer within the time given; it has been killed."""


class ChildDied(Exception):
    """The child exited (or was killed) before answering. `how` says which, for a message to a person."""

    def __init__(self, how: str, stderr_tail: str) -> None:
        super().__init__(how)
        self.how = how
        self.stderr_tail = stderr_tail


def _without_secrets(environ: Mapping[str, str]) -> dict[str, str]:
    """The environment minus docpipe's settings (database URL, API keys...): the child parses hostile files and
    needs none of them, so a decoder exploited there finds no credentials."""
    return {k: v for k, v in environ.items() if not k.startswith("DOCPIPE_")}


def send(out: BinaryIO, header: dict[str, Any], payload: bytes | memoryview = b"") -> None:
    """Write one framed message (child side)."""
    header["nbytes"] = len(payload)
    raw = json.dumps(header).encode()
    out.write(struct.pack(">I", len(raw)) + raw)
    if payload:
        out.write(payload)
    out.flush()


class ChildProcess:
    """`argv` started with its stdin/stdout as pipes, stderr kept in a temporary file for error messages."""

    def __init__(self, argv: list[str], *, memory_bytes: int, cpu_seconds: float,
                 env: dict[str, str] | None = None) -> None:
        self.stderr = tempfile.TemporaryFile()  # noqa: SIM115 — lives as long as the child; closed in close()
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr, close_fds=True,
            env=dict(_without_secrets(os.environ), OMP_NUM_THREADS="1", **(env or {})),
        )
        try:
            # prlimit, not preexec_fn: the latter is unsafe in threaded parents (a web server, Celery threads)
            resource.prlimit(self.proc.pid, resource.RLIMIT_AS, (memory_bytes, memory_bytes))
            cpu = math.ceil(cpu_seconds) + 1
            resource.prlimit(self.proc.pid, resource.RLIMIT_CPU, (cpu, cpu + 1))
        except (ProcessLookupError, OSError):
            pass  # the child already died; the first read reports how
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self._fd = self.proc.stdout.fileno()
        self.closed = False

    @classmethod
    def python_module(cls, module: str, **kwargs: Any) -> ChildProcess:
        """`python -m module` with this interpreter, our package importable whatever the working directory."""
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
        return cls([sys.executable, "-u", "-m", module], env={"PYTHONPATH": path}, **kwargs)

    def alive(self) -> bool:
        return not self.closed and self.proc.poll() is None

    def request(self, request: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(request).encode() + b"\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            raise self._died() from None

    def read(self, timeout_s: float) -> tuple[dict[str, Any], bytearray, float]:
        """The next message and the seconds spent waiting for it. Raises ChildTimeout (child killed) when the
        whole message did not arrive within `timeout_s`, ChildDied when the child is gone."""
        started = time.monotonic()
        deadline = started + max(timeout_s, 0.0)
        raw_len = self._read_exact(4, deadline)
        header = json.loads(self._read_exact(struct.unpack(">I", raw_len)[0], deadline))
        payload = self._read_exact(header["nbytes"], deadline) if header["nbytes"] else bytearray()
        return header, payload, time.monotonic() - started

    def _read_exact(self, n: int, deadline: float) -> bytearray:
        # Read into one buffer of the final size: a page's pixels (megabytes) cost one allocation, not a list of
        # chunks and a join, so the heap a request leaves behind is one block that trimming gives back.
        buffer = bytearray(n)
        view = memoryview(buffer)
        got = 0
        while got < n:
            remaining = deadline - time.monotonic()
            ready = select.select([self._fd], [], [], remaining)[0] if remaining > 0 else []
            if not ready:
                self.close()
                raise ChildTimeout()
            count = os.readv(self._fd, [view[got:]])
            if not count:
                raise self._died()  # EOF: the child exited or was killed
            got += count
        view.release()
        return buffer  # bytes-like (callers only read it); not copied into bytes, which would double the memory

    def _died(self) -> ChildDied:
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
        self.close()
        return ChildDied(how, tail)

    def close(self) -> None:
        """Kill the child if it still runs, reap it and release the pipes; safe to call twice."""
        if self.closed:
            return
        self.closed = True
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                try:
                    f.close()
                except OSError:
                    pass
        self.stderr.close()

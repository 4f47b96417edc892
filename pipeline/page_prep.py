"""Page preparation in child processes, so the engine's step thread keeps the GIL (issue 14, item 2).

Preparing one page request (PNG decode, bicubic resize, float32 patches, content hash, chat template, tokens) costs
~0.1-0.15 s of CPU, much of it holding the GIL; run on the job threads beside the engine's step thread it doubled
the host time of each engine step in the GPU worker. `PagePrepPool` runs it in `processes` children instead: a job
thread hands its messages (page images as PNG bytes) to an idle child and waits on the pipe (GIL released), the
child runs the engine's own processor and writes the pixels into a file in /dev/shm that the parent maps, copies
out on the job thread (no pickle, no pipe, the GIL released) and unlinks at once. The result is the
ProcessedPrompt the engine would have built.

Failure rules:
- the processor refuses the messages: `RequestError("cannot prepare the messages: ...")`, as the engine raises it;
- a child dies (segfault, OOM kill): it is replaced and the request tried once more on a fresh child; a second
  death raises `PagePrepError` (transient to the queue: the job is retried, then fails at its attempt cap);
- a child takes longer than `timeout_s`: it is killed and replaced, `PagePrepError`;
- the shared-memory folder is full: `PrepNoSpace`; the caller prepares that request in-process instead;
- a PNG that does not decode, any other child error: `PagePrepError` with the child's exception text.
Pixel files are named by the parent (`docpipe-prep-<pid>-<n>`), removed whatever the outcome, and files of a
parent that died are removed when the next pool starts in that folder.
"""
from __future__ import annotations

import itertools
import logging
import mmap
import os
import queue
import socket
import subprocess
import sys
import tempfile
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

from gpu_engine.errors import RequestError
from gpu_engine.inputs import ProcessedPrompt, VisionItem

from .page_prep_child import PreparedParts

log = logging.getLogger(__name__)

PIXEL_FILE_ROOM = 256 << 20  # one request's pixel file (an A4 page at 150 dpi: 53 MB), with room to spare
START_TIMEOUT_S = 180.0  # a child imports numpy/PIL/tokenizers and loads the checkpoint's tokenizer
FILE_PREFIX = "docpipe-prep-"
_NAMES = itertools.count()  # pixel file numbers, unique in this process whatever the number of pools


class PagePrepError(RuntimeError):
    """A page could not be prepared for a reason that is not the request's (a child died, hung, or the pool is
    closed): the job's error, retried by the queue like an engine that stopped."""


class PrepNoSpace(PagePrepError):
    """The shared-memory folder could not hold this request's pixels."""


def default_pixel_dir(need_bytes: int = 0) -> Path:
    """/dev/shm where it is writable with `need_bytes` free (a container's default 64 MB is not), else the temp
    folder: a file unlinked milliseconds after it was written is dropped from the page cache, not written back."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        stat = os.statvfs(shm)
        if stat.f_bavail * stat.f_frsize >= need_bytes:
            return shm
    return Path(tempfile.gettempdir())


class _Child:
    """One preparation process: `python -m pipeline.page_prep_child` on one end of a socket pair (a fresh
    interpreter: nothing of this process is forked or re-imported, its CUDA context least of all)."""

    def __init__(self, model_dir: Path) -> None:
        ours, theirs = socket.socketpair()
        env = dict(os.environ)  # the parent's import path, so the child imports this very pipeline and engine
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "pipeline.page_prep_child", str(theirs.fileno()), str(model_dir)],
                pass_fds=(theirs.fileno(),), env=env, stdin=subprocess.DEVNULL)
        except OSError as exc:
            ours.close()
            raise PagePrepError(f"cannot start a page preparation process: {exc}") from exc
        finally:
            theirs.close()
        self.conn = Connection(ours.detach())

    def wait_ready(self, timeout_s: float) -> None:
        if not self.conn.poll(timeout_s):
            self.kill()
            raise PagePrepError(f"a page preparation process did not start within {timeout_s:.0f} s")
        try:
            kind, detail = self.conn.recv()
        except (EOFError, OSError):
            raise PagePrepError(f"a page preparation process exited while starting ({self.exit_text()})") from None
        if kind != "ready":
            self.kill()
            raise PagePrepError(f"a page preparation process could not load the prompt processor: {detail}")

    def exit_text(self) -> str:
        try:
            code = self.process.wait(1.0)
        except subprocess.TimeoutExpired:
            return "still running"
        return f"killed by signal {-code}" if code < 0 else f"exit code {code}"

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        try:
            self.process.wait(5.0)
        except subprocess.TimeoutExpired:
            log.error("page preparation process %d did not end after SIGKILL", self.process.pid)
        self.conn.close()


class _Died(Exception):
    pass


class PagePrepPool:
    """`processes` children preparing prompts for `model_dir`'s processor. Thread-safe; `close()` ends them."""

    def __init__(self, model_dir: Path, processes: int, *, timeout_s: float,
                 pixel_dir: Path | None = None) -> None:
        if processes < 1:
            raise ValueError(f"a page preparation pool needs at least 1 process, got {processes}")
        self.model_dir, self.processes, self.timeout_s = Path(model_dir), processes, timeout_s
        # Files live from the child's write to the parent's copy: at most one per child at a time.
        self.pixel_dir = Path(pixel_dir) if pixel_dir is not None else default_pixel_dir(processes * PIXEL_FILE_ROOM)
        self._idle: queue.Queue[_Child] = queue.Queue()
        self._children: set[_Child] = set()
        self._lock = threading.Lock()
        self._closed = False
        self.deaths = 0  # children that died or were killed (tests, logs)
        remove_orphan_files(self.pixel_dir)
        started = [_Child(self.model_dir) for _ in range(processes)]
        try:
            for child in started:
                child.wait_ready(START_TIMEOUT_S)
        except BaseException:
            for child in started:
                child.kill()
            raise
        for child in started:
            self._children.add(child)
            self._idle.put(child)

    def prepare(self, messages: list[dict[str, Any]]) -> ProcessedPrompt:
        """The engine's ProcessedPrompt for `messages`, prepared in a child (see the module docstring for what
        it raises)."""
        for attempt in (1, 2):
            child = self._take()
            path = str(self.pixel_dir / f"{FILE_PREFIX}{os.getpid()}-{next(_NAMES)}")
            try:
                reply = self._ask(child, messages, path)
            except _Died as died:
                self._replace(child)
                _remove(path)  # the child may have written it before it died
                if attempt == 2:
                    raise PagePrepError(f"the page preparation process died twice on this request ({died})") from None
                log.warning("page preparation process died (%s); trying the request once more", died)
                continue
            return _prompt(reply, path)
        raise AssertionError("unreachable")  # the loop returns or raises

    def _take(self) -> _Child:
        while True:
            if self._closed:
                raise PagePrepError("the page preparation pool is closed")
            try:
                return self._idle.get(timeout=1.0)  # a close() while we wait is noticed within a second
            except queue.Empty:
                continue

    def _ask(self, child: _Child, messages: list[dict[str, Any]], path: str) -> tuple[Any, ...]:
        """Send one task and wait for its "ok" reply; the child goes back to the idle queue unless it died
        (`_Died`: the caller replaces it) or hung (replaced here)."""
        try:
            payload = _dumps(("prep", messages, path))
        except BaseException:
            self._idle.put(child)
            raise
        try:
            child.conn.send_bytes(payload)
            reply = child.conn.recv() if child.conn.poll(self.timeout_s) else None
        except (EOFError, OSError):
            raise _Died(child.exit_text()) from None
        except BaseException:  # interrupted mid-task, or a reply that does not unpickle: the child is out of step
            self._replace(child)
            _remove(path)
            raise
        if reply is None:
            self._replace(child)
            _remove(path)
            raise PagePrepError(f"preparing the request took more than {self.timeout_s:.0f} s "
                                "(DOCPIPE_REQUEST_TIMEOUT_S); its preparation process was restarted")
        self._idle.put(child)
        if reply[0] == "ok":
            return reply
        _remove(path)
        if reply[0] == "refused":
            raise RequestError(reply[1])
        if reply[0] == "no_space":
            raise PrepNoSpace(reply[1])
        raise PagePrepError(f"preparing the request failed in its preparation process: {reply[1]}")

    def _replace(self, child: _Child) -> None:
        self.deaths += 1
        child.kill()
        with self._lock:
            self._children.discard(child)
            if self._closed:
                return
        fresh = _Child(self.model_dir)
        try:
            fresh.wait_ready(START_TIMEOUT_S)
        except PagePrepError:
            log.error("a page preparation process could not be restarted; the pool runs with one fewer")
            return
        with self._lock:
            if self._closed:
                fresh.kill()
                return
            self._children.add(fresh)
        self._idle.put(fresh)

    def close(self) -> None:
        """Stop the children (idle ones are asked, busy ones killed: their callers get PagePrepError)."""
        with self._lock:
            self._closed = True
            children = list(self._children)
            self._children.clear()
        for child in children:
            try:
                child.conn.send(("stop",))
            except OSError:
                pass
        deadline = time.monotonic() + 5.0
        for child in children:
            try:
                child.process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            child.kill()


def _prompt(reply: tuple[Any, ...], path: str) -> ProcessedPrompt:
    """The ProcessedPrompt of an "ok" reply, its pixels copied out of the child's file (then unlinked)."""
    parts: PreparedParts = reply[1]
    items: list[VisionItem] = []
    if parts.pixel_bytes:
        pixels = _read_pixels(path, parts.pixel_bytes)
        for it in parts.items:
            start = it.offset // 4
            rows = pixels[start:start + int(np.prod(it.shape))].reshape(it.shape)
            items.append(VisionItem(it.kind, rows, it.grid_thw, it.token_start, it.num_tokens, it.content_hash,
                                    timestamp=it.timestamp))
    return ProcessedPrompt(token_ids=parts.token_ids, positions=parts.positions, rope_delta=parts.rope_delta,
                           vision_items=items)


def _read_pixels(path: str, size: int) -> np.ndarray:
    """float32 pixels of the file, in this process's own memory, the file unmapped and unlinked before return.
    Mapped with MAP_POPULATE and copied out on the job's thread (syscall and copy run without the GIL): freeing
    a tmpfs mapping costs ~10 ms a page, which must not land on the engine's step thread when it drops a
    finished sequence; a private copy is freed there in well under a millisecond."""
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    fd = os.open(path, os.O_RDONLY)
    try:
        mapped = mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
        _remove(path)
    try:
        out = np.empty(size // 4, np.float32)
        source = np.frombuffer(mapped, np.float32)
        np.copyto(out, source)
        del source  # the mapping cannot close while a view exports it
    finally:
        mapped.close()
    return out


def _dumps(task: tuple[Any, ...]) -> Any:
    """The task pickled before it is sent: a message that cannot be pickled fails here, the child untouched."""
    from multiprocessing.reduction import ForkingPickler

    try:
        return ForkingPickler.dumps(task)
    except Exception as exc:
        raise PagePrepError(f"the request cannot be sent to a preparation process: {type(exc).__name__}: {exc}") \
            from exc


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def remove_orphan_files(folder: Path) -> int:
    """Remove pixel files left by pools whose process is gone (a parent killed mid-request). Returns how many."""
    removed = 0
    for path in folder.glob(f"{FILE_PREFIX}*"):
        pid_text = path.name[len(FILE_PREFIX):].split("-", 1)[0]
        if not pid_text.isdigit() or _alive(int(pid_text)):
            continue
        _remove(str(path))
        removed += 1
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True

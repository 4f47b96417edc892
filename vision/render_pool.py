"""Warm render processes kept between documents, so a document does not pay for starting one.

Starting a render process (Python, MuPDF, Pillow) costs ~0.3 s of CPU; a small image renders in milliseconds. So a
process that finished a document cleanly goes back to a small idle pool, and the next document (in any thread of
this process) takes it instead of starting one. A process that was killed, crashed, or was interrupted mid-request
never goes back; one that served `RECYCLE_AFTER` documents is replaced (bounding leaks in the decoders and the
CPU-time limit it was started with). A forked child (Celery's prefork pool) does not use its parent's processes.
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass

from .child import ChildProcess

RECYCLE_AFTER = 25  # documents one render process serves before it is replaced
MAX_IDLE = 2  # warm processes kept per serving process


@dataclass
class RenderChild:
    """One render process: `served` documents so far, `ready` once its start-up message was read."""

    process: ChildProcess
    memory_bytes: int
    served: int = 0
    ready: bool = False


class RenderPool:
    def __init__(self, module: str, max_idle: int = MAX_IDLE) -> None:
        self._module = module
        self._max_idle = max_idle
        self._idle: list[RenderChild] = []
        self._pid = os.getpid()
        self._lock = threading.Lock()

    def take(self, *, memory_bytes: int, document_budget_s: float) -> RenderChild:
        """An idle process with this memory limit, or a new one (not `ready` yet)."""
        with self._lock:
            if os.getpid() != self._pid:  # forked: those processes talk to our parent
                self._idle, self._pid = [], os.getpid()
            for child in self._idle:
                if child.memory_bytes == memory_bytes and child.process.alive():
                    self._idle.remove(child)
                    child.served += 1
                    return child
        process = ChildProcess.python_module(self._module, memory_bytes=memory_bytes,
                                             cpu_seconds=document_budget_s * RECYCLE_AFTER)
        return RenderChild(process, memory_bytes, served=1)

    def give_back(self, child: RenderChild) -> None:
        """Keep a process that finished its document cleanly (no request in flight), else stop it."""
        with self._lock:
            keep = (os.getpid() == self._pid and child.ready and child.process.alive()
                    and child.served < RECYCLE_AFTER and len(self._idle) < self._max_idle)
            if keep:
                self._idle.append(child)
                return
        child.process.close()

    def clear(self) -> None:
        """Stop every idle process (tests, shutdown)."""
        with self._lock:
            idle, self._idle = self._idle, []
        for child in idle:
            child.process.close()

"""Handing memory back to the OS after a chat request: decoded images and pixel arrays are freed when the request
ends, but glibc keeps freed heap (one arena per worker thread) mapped unless asked to trim it."""
from __future__ import annotations

import ctypes
import ctypes.util
import gc
import threading
import time
from collections.abc import Callable

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_trim = getattr(_libc, "malloc_trim", None)  # glibc only; elsewhere freed memory is the allocator's business
_busy = threading.Lock()
# The engine frees a finished request's pixels on its next step, the response's objects go when it is sent: trim
# shortly after, and once more a little later for what was freed in between.
TRIM_AFTER_S = (0.5, 2.0)


def _trim_soon(trim: Callable[[int], int]) -> None:
    try:
        for delay in TRIM_AFTER_S:
            time.sleep(delay)
            # What a request left in reference cycles (its images among them, seen in the tests) is freed
            # only by the cyclic collector, which may not run for a long while in a server that allocates little.
            gc.collect()
            trim(0)  # releases the GIL (ctypes): the event loop keeps running while glibc walks its arenas
    finally:
        _busy.release()


def give_back_memory() -> None:
    """Trim the C heap shortly, on a thread of its own (never on the caller's); one trim at a time covers every
    request that ended meanwhile."""
    if _trim is None or not _busy.acquire(blocking=False):
        return
    threading.Thread(target=_trim_soon, args=(_trim,), name="malloc-trim", daemon=True).start()

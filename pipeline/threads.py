"""How many threads the BLAS library (numpy's OpenBLAS, torch's OpenMP) may use in a docpipe process.

Why: a docpipe process already runs several busy threads of its own — the engine's step loop, job threads that
render pages and encode PNGs, an HTTP server or Celery's pool. By default BLAS starts one spinning thread per core
for every matrix product, and those threads fight the process's own threads for the cores. On a busy 2-core
machine the in-process path (`docpipe process`) ran about 7x slower without `OMP_NUM_THREADS=1`.

The rule: unless the user already set a thread count, every docpipe entry point (the `docpipe` command — process,
demo, worker, beat, serve — and `api.app`, which `uvicorn --factory api.app:create_app` imports) sets it to
`default_blas_threads()`: half the CPUs this process may run on, at least 1, at most 4 (the reference runner's
products are small; past a few threads they stop getting faster). A value the user set in the environment
(`OMP_NUM_THREADS=8 docpipe process ...`) always wins, for every variable named in `BLAS_ENV_VARS`.

The variables are read once, when the BLAS library loads, so this must run before numpy or torch is imported;
`cap_blas_threads` reports whether it was in time.
"""
from __future__ import annotations

import os
import sys

# OpenMP (torch, OpenBLAS built with OpenMP), OpenBLAS's pthreads build (numpy's wheels), MKL, BLIS, Accelerate.
BLAS_ENV_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "BLIS_NUM_THREADS",
                 "VECLIB_MAXIMUM_THREADS")
MAX_DEFAULT_THREADS = 4


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask, e.g. a container's cpuset), not the host's count."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def default_blas_threads(cpus: int | None = None) -> int:
    """Half the usable CPUs, at least 1 and at most MAX_DEFAULT_THREADS: the other half stays free for the
    process's own threads (engine step loop, rendering, PNG encoding, HTTP, Celery)."""
    return max(1, min(MAX_DEFAULT_THREADS, (cpus if cpus is not None else usable_cpus()) // 2))


def cap_blas_threads(environ: dict[str, str] | None = None, *, cpus: int | None = None) -> bool:
    """Set every BLAS thread variable the user did not set to `default_blas_threads()`; a variable the user set
    is left alone (and the OpenMP one, when set, is also used for the others). Returns False when numpy or torch
    was imported already (then the library has read its settings and this call changes nothing for it)."""
    env = os.environ if environ is None else environ
    user = env.get("OMP_NUM_THREADS")
    value = user if user else str(default_blas_threads(cpus))
    for name in BLAS_ENV_VARS:
        if not env.get(name):
            env[name] = value
    return not any(module in sys.modules for module in ("numpy", "torch"))

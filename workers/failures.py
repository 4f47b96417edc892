"""What a task does with an exception: bad input fails at once, anything else is retried with backoff and jitter
until the job's attempt cap (counted in the database by `run_job`, so crashes and lost messages count too).

Permanent ("bad input") errors are the ones that would fail the same way on every run: the pipeline's own errors
(unknown schema, missing job, ...), media that cannot be read, and requests the engine refuses (too long a
prompt, an unusable grammar). Everything else (database or broker hiccups, a storage read that failed, an engine
that stopped) is presumed transient; a document that fails "transiently" on every attempt is a poison document
and ends `failed` with the last error once `job_max_attempts` runs were spent.
"""
from __future__ import annotations

import random

from sqlalchemy import select

from pipeline.context import Pipeline
from pipeline.errors import PipelineError
from pipeline.models import Job

from .staging import StagingError


def permanent_error_types() -> tuple[type[BaseException], ...]:
    import vision
    from gpu_engine.errors import InvalidRequestError  # requests the engine refuses: bad prompt, media, grammar

    return (PipelineError, StagingError, vision.MediaError, InvalidRequestError)


def is_permanent(exc: BaseException) -> bool:
    return isinstance(exc, permanent_error_types())


def backoff_seconds(attempt: int, base_s: float, max_s: float, rng: random.Random | None = None) -> float:
    """Delay before retry number `attempt` (1, 2, ...): doubling from `base_s`, capped at `max_s`, with "equal
    jitter" (half fixed, half random) so retries of many jobs that failed together do not return together."""
    if attempt < 1:
        raise ValueError(f"attempt numbers start at 1, got {attempt}")
    ceiling = min(max_s, base_s * 2 ** min(attempt - 1, 30))
    return ceiling / 2 + (rng or random).uniform(0, ceiling / 2)


def job_state(p: Pipeline, job_id: int) -> tuple[str, int] | None:
    """(state, attempts) of a job, None when it does not exist."""
    with p.db.read_session() as s:
        row = s.execute(select(Job.state, Job.attempts).where(Job.id == job_id)).first()
    return (row.state, row.attempts) if row else None

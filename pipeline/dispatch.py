"""Handing queued jobs to a job queue (broker mode) without `pipeline` importing who implements it.

Import arrows point down (api -> pipeline <- workers), so the API cannot import the Celery producer and
`pipeline` must not either. The implementation registers a factory under the entry-point group `docpipe.dispatch`
with the name `broker` (docpipe's own: `workers.dispatch:broker_dispatcher`, see pyproject.toml); callers ask
`broker_dispatcher(settings)` for it. Publishing is best effort: the database row is the record and the workers'
reconciler publishes again whatever has no message waiting, so `send` may fail quietly.
"""
from __future__ import annotations

from dataclasses import dataclass
from importlib import metadata
from typing import Any, Callable, Iterable

from .errors import PipelineError
from .settings import Settings

DISPATCH_GROUP = "docpipe.dispatch"


class DispatchUnavailableError(PipelineError):
    """A broker is configured but no installed package provides the producer side."""


@dataclass(frozen=True)
class Dispatcher:
    # Publish a queued job (its document may still need rendering); best effort, and it must return at once
    # (callers are request threads): docpipe's broker dispatcher hands the id to a publishing thread.
    send: Callable[[int], object]
    ping: Callable[[], object]  # raises when the broker cannot be reached (for readiness checks); result unused


def broker_dispatcher(settings: Settings, entry_points: Iterable[Any] | None = None) -> Dispatcher:
    """The registered broker dispatcher for `settings.broker_url`; its factory checks the set-up and raises an
    error in words when it cannot work."""
    found = [ep for ep in (entry_points if entry_points is not None else metadata.entry_points(group=DISPATCH_GROUP))
             if ep.name == "broker"]
    if not found:
        raise DispatchUnavailableError(
            f"DOCPIPE_BROKER_URL is set but no package registers a '{DISPATCH_GROUP}' entry point named 'broker' "
            "(docpipe's workers package does: reinstall docpipe with `pip install -e .`), so jobs could not be queued."
        )
    return found[0].load()(settings)

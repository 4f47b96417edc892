"""The engine's error bases: every error gpu_engine raises on purpose derives from EngineError (tests/engine/
test_engine_errors.py walks the package to keep it so), and the ones a retry cannot cure from
InvalidRequestError, so that a caller (a worker deciding whether to retry, a server choosing a status code) can
classify by base class instead of importing each module's own errors."""
from __future__ import annotations


class EngineError(Exception):
    """Base class of every error gpu_engine raises on purpose; the message says what to do about it."""


class InvalidRequestError(EngineError):
    """The request itself cannot be served (bad prompt or parameters, unreadable media, an unusable grammar):
    running it again fails the same way."""


class RunnerInputError(EngineError, ValueError):
    """A step batch or cache request that breaks the runner contract (shapes, ids, cache indices); every runner
    raises this one type, with the same words (gpu_engine/runner_rules.py)."""


class RequestError(InvalidRequestError, ValueError):
    """A request that can never run as given (bad prompt, bad parameters, too long for this engine)."""

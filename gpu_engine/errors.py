"""The engine's error base: every error gpu_engine raises on purpose derives from EngineError, so a caller (a
worker deciding whether to retry, a server choosing a status code) can tell the engine's refusals from bugs."""
from __future__ import annotations


class EngineError(Exception):
    """Base class of every error gpu_engine raises on purpose; the message says what to do about it."""


class RunnerInputError(EngineError, ValueError):
    """A step batch or cache request that breaks the runner contract (shapes, ids, cache indices); every runner
    raises this one type, with the same words (gpu_engine/runner_rules.py)."""

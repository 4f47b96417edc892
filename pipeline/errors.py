"""Exceptions raised by `pipeline`. Each message says what was wrong and what a person can do about it.

    PipelineError
    ├── UnknownSchemaError      a schema name that is not registered
    ├── InvalidSchemaError      a user schema that is not a usable JSON Schema
    ├── NotFoundError           a document / job / batch id that does not exist
    ├── JobStateError           an operation not allowed in the job's current state
    └── ModelNotAvailableError  the configured model folder cannot be read on this host
"""
from __future__ import annotations


class PipelineError(Exception):
    """Base class of every error raised by `pipeline`."""


class UnknownSchemaError(PipelineError):
    def __init__(self, name: str, known: list[str]) -> None:
        super().__init__(f"unknown extraction schema {name!r}; registered schemas: {', '.join(sorted(known))}")
        self.name = name


class InvalidSchemaError(PipelineError):
    """A user schema was refused at registration (not JSON Schema, not an object schema, bad name, ...)."""


class NotFoundError(PipelineError):
    def __init__(self, kind: str, ident: object) -> None:
        super().__init__(f"no {kind} with id {ident!r}")
        self.kind = kind
        self.ident = ident


class JobStateError(PipelineError):
    """The job is not in a state that allows the requested operation."""


class ModelNotAvailableError(PipelineError):
    """The model folder is missing or unreadable here (and no DOCPIPE_MODEL_ID names the model instead)."""

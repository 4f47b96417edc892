"""Exceptions raised by `pipeline`. Each message says what was wrong and what a person can do about it.

    PipelineError
    ├── UnknownSchemaError      a schema name that is not registered
    ├── InvalidSchemaError      a user schema that is not a usable JSON Schema
    │   └── SchemaTooComplexError   one over the depth / size / $ref budget (checked before compiling it)
    ├── UnstorableTextError     client text the database cannot store (NUL, lone surrogates)
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


class SchemaTooComplexError(InvalidSchemaError):
    """A JSON schema over one of the limits of pipeline.schemas.SchemaBudget; `limit` names which one."""

    def __init__(self, message: str, *, limit: str, maximum: int) -> None:
        super().__init__(message)
        self.limit = limit  # depth | size | refs
        self.maximum = maximum


class UnstorableTextError(PipelineError):
    """Client text that the database cannot store (see pipeline.storable_text); `field` says where it was."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field} {problem}")
        self.field = field


class NotFoundError(PipelineError):
    def __init__(self, kind: str, ident: object) -> None:
        super().__init__(f"no {kind} with id {ident!r}")
        self.kind = kind
        self.ident = ident


class JobStateError(PipelineError):
    """The job is not in a state that allows the requested operation."""


class ModelNotAvailableError(PipelineError):
    """The model folder is missing or unreadable here (and no DOCPIPE_MODEL_ID names the model instead)."""

"""The schema registry: built-in schemas plus user schemas, versioned, validated when they enter.

A user schema must be a JSON Schema (draft 2020-12) for an object, compilable by the decoding grammar (llguidance),
with merge rules naming top-level properties only. Registering the same name with different content creates the
next version; the same content again returns the existing version. Built-in names are reserved.

User schemas belong to a tenant (pipeline.tenancy): a tenant sees the built-in schemas and its own, and two
tenants may register the same name independently (each its own versions).
"""
from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import jsonschema
from sqlalchemy import bindparam, func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from .builtin_schemas import BUILTIN_SCHEMAS, SchemaSpec
from .errors import InvalidSchemaError, PipelineError, SchemaTooComplexError, UnknownSchemaError
from .merge import MERGE_RULES
from .models import Schema
from .storable_text import check_storable, storable
from .tenancy import DEFAULT_TENANT, SHARED, Access

NAME_RE = re.compile(r"^[a-z][a-z0-9_-]{0,63}$")
DEFAULT_USER_PROMPT = (
    "Extract the information on this page into JSON that matches the schema. Use null where a value is absent; "
    "never guess."
)


@dataclass(frozen=True)
class SchemaBudget:
    """What a JSON schema may hold before anything compiles it. jsonschema and llguidance recurse once or more per
    nesting level (Python's recursion limit ended a 100-level schema with RecursionError; llguidance stops at 128
    JSON levels), and their work grows with the schema's size and its $ref expansions."""

    max_depth: int = 64  # objects and arrays nested in one another (a schema level is usually two)
    max_values: int = 10_000  # JSON values in all: objects, arrays, strings, numbers, booleans, nulls
    max_refs: int = 100  # "$ref" keys

    def __post_init__(self) -> None:
        assert self.max_depth >= 1 and self.max_values >= 1 and self.max_refs >= 0, self


SCHEMA_BUDGET = SchemaBudget()


def _entries(container: dict[str, Any] | list[Any]) -> Iterator[tuple[str | None, Any]]:
    if isinstance(container, dict):
        return iter(container.items())
    return ((None, item) for item in container)


def _walk(root: Any) -> Iterator[tuple[Any, int, bool]]:
    """Every value of a JSON document with its depth (the root counts 1, its members 2, ...), and every object key
    (flagged True), depth first. Iterative, so no depth can exhaust the stack; it holds one iterator per open
    container, so a consumer that stops at a limit has used memory for that many levels, not for the whole
    document (a 32 MiB body can be a list of 16 million numbers)."""
    yield root, 1, False
    if not isinstance(root, (dict, list)):
        return
    open_containers: list[tuple[Iterator[tuple[str | None, Any]], int]] = [(_entries(root), 2)]
    while open_containers:
        entries, depth = open_containers[-1]
        entry = next(entries, None)
        if entry is None:
            open_containers.pop()
            continue
        key, value = entry
        if key is not None:
            yield key, depth - 1, True
        yield value, depth, False
        if isinstance(value, (dict, list)):
            open_containers.append((_entries(value), depth + 1))


def check_schema_budget(json_schema: Any, what: str, budget: SchemaBudget = SCHEMA_BUDGET) -> None:
    """SchemaTooComplexError naming the limit when `json_schema` (called `what` in the message) is over `budget`.
    Run it before jsonschema or llguidance sees the schema (uploaded schemas and chat response formats alike)."""
    values = refs = 0
    for node, depth, is_key in _walk(json_schema):
        if is_key:
            if node == "$ref":
                refs += 1
                if refs > budget.max_refs:
                    raise SchemaTooComplexError(
                        f"{what} has more than {budget.max_refs} \"$ref\" references; the limit is "
                        f"{budget.max_refs}: inline or merge some definitions", limit="refs", maximum=budget.max_refs)
            continue
        values += 1
        if values > budget.max_values:
            raise SchemaTooComplexError(
                f"{what} has more than {budget.max_values} JSON values; the limit is {budget.max_values}: split it "
                "into smaller schemas or drop what extraction does not need", limit="size", maximum=budget.max_values)
        if depth > budget.max_depth and isinstance(node, (dict, list)):
            raise SchemaTooComplexError(
                f"{what} is nested more than {budget.max_depth} levels deep (objects and arrays); the limit is "
                f"{budget.max_depth}: flatten it or move repeated parts into $defs", limit="depth",
                maximum=budget.max_depth)


def _check_schema_text(json_schema: Any, name: str) -> None:
    """Every key and string of a schema that will be stored must be text the database can store."""
    for node, _, _ in _walk(json_schema):
        if isinstance(node, str):
            check_storable(node, f"a key or string of schema {name!r}")


def validate_schema_definition(name: str, json_schema: Any, merge_rules: dict[str, str] | None = None) -> None:
    """Raise InvalidSchemaError (with the reason) unless this schema can be used for extraction."""
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise InvalidSchemaError(
            f"schema name {name!r} is not allowed: use 1-64 lowercase letters, digits, '_' or '-', starting with a "
            "letter"
        )
    if not isinstance(json_schema, dict):
        raise InvalidSchemaError(f"schema {name!r} must be a JSON object, got {type(json_schema).__name__}")
    check_schema_budget(json_schema, f"schema {name!r}")  # before anything recurses into it
    _check_schema_text(json_schema, name)
    try:
        jsonschema.Draft202012Validator.check_schema(json_schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path) or "(root)"
        raise InvalidSchemaError(f"schema {name!r} is not valid JSON Schema at {where}: {exc.message}") from None
    if json_schema.get("type") != "object" or not isinstance(json_schema.get("properties"), dict):
        raise InvalidSchemaError(
            f"schema {name!r} must describe an object (\"type\": \"object\" with \"properties\") so that page "
            "results can be merged field by field"
        )
    import llguidance  # the grammar library the engine uses; refusing here beats failing every job later

    problem = llguidance.LLMatcher.validate_grammar(llguidance.grammar_from("json_schema", json.dumps(json_schema)))
    if problem:
        raise InvalidSchemaError(f"schema {name!r} cannot be used for constrained decoding: {problem.strip()}")
    for field_name, rule in (merge_rules or {}).items():
        if field_name not in json_schema["properties"]:
            raise InvalidSchemaError(f"merge rule for {field_name!r}: schema {name!r} has no such top-level property")
        if rule not in MERGE_RULES:
            raise InvalidSchemaError(
                f"merge rule {rule!r} for {field_name!r} is unknown; use one of {', '.join(sorted(MERGE_RULES))}"
            )


def _same(row: Schema, spec: SchemaSpec) -> bool:
    return row.json_schema == spec.json_schema and row.prompt == spec.prompt and row.merge_rules == spec.merge_rules


def ensure_builtin_schemas(session: Session) -> None:
    """Insert the built-in schemas that are missing (safe to call from many processes at once).

    A stored built-in whose content differs from this release's under the same version is refused: results
    would name a schema version that no longer describes how they were made. Changing a built-in means bumping
    its `version` in builtin_schemas.py."""
    have = {(r.name, r.version): r for r in session.scalars(select(Schema).where(Schema.builtin))}
    for spec in BUILTIN_SCHEMAS.values():
        stored = have.get((spec.name, spec.version))
        if stored is not None:
            if not _same(stored, spec):
                raise PipelineError(
                    f"built-in schema {spec.name!r} version {spec.version} in the database differs from this "
                    "release's definition; bump its version in pipeline/builtin_schemas.py"
                )
            continue
        try:
            with session.begin_nested():
                session.add(
                    Schema(
                        name=spec.name,
                        version=spec.version,
                        json_schema=spec.json_schema,
                        prompt=spec.prompt,
                        merge_rules=spec.merge_rules,
                        builtin=True,
                    )
                )
        except IntegrityError:
            pass  # another process inserted it first


def register_schema(
    session: Session,
    name: str,
    json_schema: Any,
    *,
    prompt: str | None = None,
    merge_rules: dict[str, str] | None = None,
    tenant: str = DEFAULT_TENANT,
) -> Schema:
    """Validate and store a user schema of `tenant`; returns the stored row (a new version only if the content
    changed)."""
    if name in BUILTIN_SCHEMAS:
        raise InvalidSchemaError(f"{name!r} is a built-in schema name; choose another name for your schema")
    validate_schema_definition(name, json_schema, merge_rules)
    if prompt is not None:
        check_storable(prompt, f"the prompt of schema {name!r}")
    spec = SchemaSpec(name=name, json_schema=json_schema, prompt=prompt or DEFAULT_USER_PROMPT,
                      merge_rules=dict(merge_rules or {}))
    for _ in range(5):  # concurrent registrations of one name: each retry sees the version the other one took
        latest = _latest(session, name, tenant)
        if latest is not None and _same(latest, spec):
            return latest
        row = Schema(
            tenant=tenant,
            name=name,
            version=(latest.version + 1) if latest else 1,
            json_schema=spec.json_schema,
            prompt=spec.prompt,
            merge_rules=spec.merge_rules,
            builtin=False,
        )
        try:
            with session.begin_nested():
                session.add(row)
                session.flush()
            return row
        except IntegrityError:
            continue
    raise InvalidSchemaError(f"schema {name!r} is being registered by others right now; try again")


def _visible(tenant: str) -> Any:
    """Schemas a tenant may use: the built-in ones and its own."""
    return Schema.tenant.in_((SHARED, tenant))


def _latest(session: Session, name: str, tenant: str) -> Schema | None:
    return session.scalars(select(Schema).where(Schema.name == name, _visible(tenant))
                           .order_by(Schema.version.desc()).limit(1)).first()


class SchemaRef(NamedTuple):
    """What a job needs of its schema row to be queued and shown: never changes for a given id."""

    id: int
    name: str
    version: int


# Built once: the statement's cache key is memoised, so an upload's lookup costs no statement construction.
_LATEST_REF = (select(Schema.id, Schema.version)
               .where(Schema.name == bindparam("name"), Schema.tenant.in_((SHARED, bindparam("tenant"))))
               .order_by(Schema.version.desc()).limit(1))


def latest_schema_ref(session: Session, name: str, tenant: str = DEFAULT_TENANT) -> SchemaRef:
    """The named schema's latest version (among those `tenant` sees), without loading the row (its JSON schema
    and prompt are not needed to queue a job); UnknownSchemaError as `get_schema` raises it."""
    found = session.execute(_LATEST_REF, {"name": name, "tenant": tenant}).first() if storable(name) else None
    if found is None:
        row = get_schema(session, name, tenant=tenant)  # raises UnknownSchemaError, listing the known names
        return SchemaRef(row.id, row.name, row.version)
    return SchemaRef(int(found.id), name, int(found.version))


def get_schema(session: Session, name: str, version: int | None = None, *, tenant: str = DEFAULT_TENANT) -> Schema:
    """The named schema among those `tenant` sees (latest version unless one is given); UnknownSchemaError lists
    the names it sees."""
    if not storable(name):  # no stored name holds such text, and PostgreSQL would refuse it as a parameter
        row = None
    elif version is None:
        row = _latest(session, name, tenant)
    else:
        row = session.scalars(select(Schema).where(Schema.name == name, Schema.version == version,
                                                   _visible(tenant))).first()
    if row is None:
        known = sorted(set(session.scalars(select(Schema.name).where(_visible(tenant)).distinct())))
        if version is not None and name in known:
            raise UnknownSchemaError(f"{name} version {version}", known)
        raise UnknownSchemaError(name, known)
    return row


def list_schemas(session: Session, access: Access = Access()) -> list[Schema]:
    """Latest version of every schema `access` sees (an admin: every tenant's), by name."""
    seen = access.owns(Schema.tenant) | (Schema.tenant == SHARED)
    latest = (select(Schema.tenant, Schema.name, func.max(Schema.version).label("v")).where(seen)
              .group_by(Schema.tenant, Schema.name).subquery())
    stmt = select(Schema).join(latest, (Schema.tenant == latest.c.tenant) & (Schema.name == latest.c.name)
                               & (Schema.version == latest.c.v))
    return list(session.scalars(stmt.order_by(Schema.name, Schema.tenant)))

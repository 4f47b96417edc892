"""Tenants: who owns a document, a batch or a user schema, and what one caller may see.

Every API key belongs to one tenant, or is an admin key. `DOCPIPE_API_KEYS` entries are `key` (the default
tenant), `tenant:key`, or `*:key` (admin: sees and deletes every tenant's rows; writes into the default tenant).
Rows carry their tenant's name; the built-in schemas belong to no tenant (`SHARED`) and every tenant sees them.
Without keys (loopback use) and from the CLI, watch folders and staged submissions, everything is the default
tenant's.

`Access` is what the read model and intake are given: the one place a query learns whose rows it may touch.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from sqlalchemy import ColumnElement, true

DEFAULT_TENANT = "default"
SHARED = ""  # the tenant of the built-in schemas: visible to all
ADMIN_MARK = "*"
MIN_KEY_CHARS = 16
TENANT_RE = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,63}$")


@dataclass(frozen=True)
class KeyEntry:
    """One configured API key: its tenant, or admin."""

    key: str
    tenant: str = DEFAULT_TENANT
    admin: bool = False


def parse_key_entry(entry: str, position: int) -> KeyEntry:
    """`key`, `tenant:key` or `*:key`. Errors name the entry by position and never echo the key."""
    head, sep, rest = entry.partition(":")
    if sep and (head == ADMIN_MARK or TENANT_RE.match(head)):
        key, tenant, admin = rest, (DEFAULT_TENANT if head == ADMIN_MARK else head), head == ADMIN_MARK
    else:
        key, tenant, admin = entry, DEFAULT_TENANT, False
    if len(key) < MIN_KEY_CHARS:
        raise ValueError(f"API key #{position + 1} is shorter than {MIN_KEY_CHARS} characters (generate one: "
                         "openssl rand -hex 24); entries are 'key', 'tenant:key' or '*:key' for an admin key")
    return KeyEntry(key=key, tenant=tenant, admin=admin)


def parse_key_entries(entries: list[str]) -> list[KeyEntry]:
    return [parse_key_entry(entry, i) for i, entry in enumerate(entries)]


@dataclass(frozen=True)
class Access:
    """Whose rows a caller may touch. `tenant` is where its uploads, batches and schemas go and where schema names
    are looked up; an admin additionally reads and deletes the rows of every tenant."""

    tenant: str = DEFAULT_TENANT
    admin: bool = False

    def owns(self, tenant_column: Any) -> ColumnElement[bool]:
        """A WHERE condition: rows of `tenant_column` this caller may see (always true for an admin)."""
        return true() if self.admin else tenant_column == self.tenant

    def may_see(self, tenant: str) -> bool:
        return self.admin or tenant == self.tenant


LOCAL = Access()  # the CLI, watch folders, staged submissions and an API without keys: the default tenant
EVERYONE = Access(admin=True)  # maintenance (retention, the reconciler, status): every tenant

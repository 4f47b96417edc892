"""API-key authentication and per-key request rate limiting, applied by the API's middleware (api.middleware).

Why a middleware and not a route dependency: it runs before any request body is read, so an unauthenticated
client cannot make the server stream a large upload, and unknown paths do not reveal which routes exist.

Keys arrive as `Authorization: Bearer <key>` (what the OpenAI client sends) or `X-API-Key: <key>`.
No key -> 401 `auth_required`; a key that matches none -> 403 `invalid_api_key`.
Health probes and the static web UI (which holds no data and asks the user for a key) stay open.

Each key belongs to a tenant or is an admin key (pipeline.tenancy); the caller's `Principal.access` is what every
route hands to the read model and to intake. Without configured keys (loopback use) the one user sees everything.
"""
from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence
from dataclasses import dataclass

from starlette.responses import JSONResponse
from starlette.types import Scope

from pipeline.tenancy import Access, parse_key_entries

from .errors import ApiError, problem_response
from .limits import RateLimiter

# Paths reachable without a key. "/" and /ui/* are the static web UI; its API calls carry the key.
OPEN_PATHS = frozenset({"/healthz", "/readyz", "/", "/favicon.ico"})
OPEN_PREFIXES = ("/ui/",)


UNKEYED = Access(admin=True)  # no keys configured: a single user, who owns every row


@dataclass(frozen=True)
class Principal:
    """Who is calling: a short, non-secret key id (never the key itself), used for rate limits and logs, and
    the rows it may touch (its tenant, or every tenant for an admin key)."""

    key_id: str
    authenticated: bool
    access: Access = UNKEYED

    @property
    def tenant(self) -> str:
        """The tenant this caller's uploads, batches and schemas belong to (and whose job cap they count in)."""
        return self.access.tenant


def key_id(key: str) -> str:
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:12]


class KeyRing:
    """The configured API keys (`DOCPIPE_API_KEYS` entries: `key`, `tenant:key`, `*:key`), compared in constant
    time."""

    def __init__(self, entries: Sequence[str]) -> None:
        # Compare digests, so timing does not depend on the length of the configured key either.
        self._digests = [(hashlib.sha256(e.key.encode()).digest(), key_id(e.key), Access(e.tenant, e.admin))
                         for e in parse_key_entries(list(entries))]

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def match(self, presented: str) -> tuple[str, Access] | None:
        """(key id, access) of `presented`, or None. Every configured key is compared (no early exit)."""
        digest = hashlib.sha256(presented.encode()).digest()
        found: tuple[str, Access] | None = None
        for expected, ident, access in self._digests:
            if hmac.compare_digest(digest, expected):
                found = (ident, access)
        return found


def presented_key(headers: dict[bytes, bytes]) -> str | None:
    auth = headers.get(b"authorization")
    if auth is not None:
        scheme, _, value = auth.decode("latin-1").partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            return value.strip()
    x_key = headers.get(b"x-api-key")
    if x_key is not None and x_key.strip():
        return x_key.decode("latin-1").strip()
    return None


def is_open_path(path: str) -> bool:
    return path in OPEN_PATHS or path.startswith(OPEN_PREFIXES)


class Gate:
    """Authentication and the per-key rate limit of one request, decided from its headers alone (see
    api.middleware for where it runs)."""

    def __init__(self, keys: KeyRing, limiter: RateLimiter) -> None:
        self.keys = keys
        self.limiter = limiter

    def admit(self, scope: Scope, headers: dict[bytes, bytes]) -> Principal | None:
        """The caller (None on an open path without a key), also stored as `scope["state"]["principal"]`.
        Raises ApiError (401/403/429) for a request that must be refused."""
        principal = self._authenticate_limited(scope, headers)
        if principal is not None and not is_open_path(scope["path"]):
            self.limiter.check(principal.key_id)
        scope.setdefault("state", {})["principal"] = principal
        return principal

    def _authenticate_limited(self, scope: Scope, headers: dict[bytes, bytes]) -> Principal | None:
        """Refused attempts are charged to the client address, so guessing keys is rate limited too."""
        try:
            return self._authenticate(scope, headers)
        except ApiError:
            client = scope.get("client") or ("local", 0)
            self.limiter.check(f"addr-{client[0]}")
            raise

    def _authenticate(self, scope: Scope, headers: dict[bytes, bytes]) -> Principal | None:
        open_path = is_open_path(scope["path"])
        if not self.keys.enabled:
            # No keys configured (loopback use): clients are told apart by address for the limits.
            client = scope.get("client") or ("local", 0)
            return Principal(key_id=f"addr-{client[0]}", authenticated=False)
        key = presented_key(headers)
        if key is None:
            if open_path:
                return None
            raise ApiError(401, "auth_required", "This server requires an API key: send 'Authorization: Bearer "
                           "<key>' or 'X-API-Key: <key>'.")
        found = self.keys.match(key)
        if found is None:
            if open_path:
                return None
            raise ApiError(403, "invalid_api_key", "The API key is not valid for this server.")
        ident, access = found
        return Principal(key_id=ident, authenticated=True, access=access)


def refusal_response(exc: ApiError, path: str) -> JSONResponse:
    """The problem document for a request `Gate.admit` refused (a 401 names the scheme to use)."""
    headers = dict(exc.headers)
    if exc.status == 401:
        headers["WWW-Authenticate"] = 'Bearer realm="docpipe"'
    return problem_response(exc.status, exc.code, exc.detail, instance=path, headers=headers, extra=exc.extra)

"""Render slots shared by every ingest worker (broker mode), kept in Redis: per API key, and optionally per tenant.

At most `limit` documents of one label render at once, across all ingest workers. `RenderCaps` takes one slot of
the document's key (`ingest_renders_per_key`; documents without a key count per tenant, pipeline.render_owner)
and, when set, one of its tenant (`ingest_renders_per_tenant`). A `prepare` message that finds a slot taken does
not render: it is retried a moment later (`docpipe.prepare`), so the workers meanwhile take the messages of other
keys behind it. One key's expensive uploads thus hold at most `ingest_renders_per_key` ingest processes, however
many they send, whether the other keys belong to its tenant or to another.

A slot is a member of the sorted set `docpipe:render:<label>` scored with its expiry; expired members are dropped
before every count, so the slot of a worker killed mid-render frees itself after `ttl_s` (the ingest task's hard
time limit: no render can legitimately hold it longer).
"""
from __future__ import annotations

import time
from typing import Any

from pipeline.render_owner import RenderOwner

from .markers import PREFIX

# KEYS[1] the tenant's set; ARGV: holder, now (s), ttl (s), limit. 1 = the holder has a slot (new or renewed).
_ACQUIRE = """
local key, holder = KEYS[1], ARGV[1]
local now, ttl, limit = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
if redis.call('ZSCORE', key, holder) or redis.call('ZCARD', key) < limit then
  redis.call('ZADD', key, now + ttl, holder)
  redis.call('PEXPIRE', key, math.ceil(ttl * 1000))
  return 1
end
return 0
"""


class RenderSlots:
    def __init__(self, client: Any, *, limit: int, ttl_s: float) -> None:
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        self._client = client
        self._limit = limit
        self._ttl_s = ttl_s
        self._acquire = client.register_script(_ACQUIRE)

    @staticmethod
    def key(tenant: str) -> str:
        return f"{PREFIX}render:{tenant}"

    def acquire(self, tenant: str, holder: str) -> bool:
        """Take one of the tenant's slots for `holder` (a job's id); False when all are taken by others."""
        return bool(self._acquire(keys=[self.key(tenant)], args=[holder, time.time(), self._ttl_s, self._limit]))

    def release(self, tenant: str, holder: str) -> None:
        self._client.zrem(self.key(tenant), holder)

    def holders(self, tenant: str) -> list[str]:
        """Who holds the tenant's slots now (for tests and `docpipe status`)."""
        self._client.zremrangebyscore(self.key(tenant), "-inf", time.time())
        return [h.decode() for h in self._client.zrange(self.key(tenant), 0, -1)]


class RenderCaps:
    """The key's slot, then the tenant's (if capped); both or neither."""

    def __init__(self, client: Any, *, per_key: int | None, per_tenant: int | None, ttl_s: float) -> None:
        self._key = RenderSlots(client, limit=per_key, ttl_s=ttl_s) if per_key else None
        self._tenant = RenderSlots(client, limit=per_tenant, ttl_s=ttl_s) if per_tenant else None

    @property
    def enabled(self) -> bool:
        return self._key is not None or self._tenant is not None

    def _slots(self, owner: RenderOwner) -> list[tuple[RenderSlots, str]]:
        out = []
        if self._key is not None:
            out.append((self._key, owner.lane))
        if self._tenant is not None:
            out.append((self._tenant, f"tenant-all:{owner.tenant}"))
        return out

    def acquire(self, owner: RenderOwner, holder: str) -> str | None:
        """None when `holder` got every slot it needs, else the label whose slots are all taken."""
        taken: list[tuple[RenderSlots, str]] = []
        for slots, label in self._slots(owner):
            if not slots.acquire(label, holder):
                for got, got_label in taken:
                    got.release(got_label, holder)
                return label
            taken.append((slots, label))
        return None

    def release(self, owner: RenderOwner, holder: str) -> None:
        for slots, label in self._slots(owner):
            slots.release(label, holder)

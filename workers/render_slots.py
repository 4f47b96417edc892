"""Per-tenant render slots shared by every ingest worker (broker mode), kept in Redis.

At most `limit` documents of one tenant render at once, across all ingest workers. A `prepare` message that
finds its tenant's slots taken does not render: it is retried a moment later (`docpipe.prepare`), so the workers
meanwhile take the messages of other tenants behind it. One tenant's expensive uploads thus hold at most `limit`
ingest processes, however many they send.

A slot is a member of the sorted set `docpipe:render:<tenant>` scored with its expiry; expired members are dropped
before every count, so the slot of a worker killed mid-render frees itself after `ttl_s` (the ingest task's hard
time limit: no render can legitimately hold it longer).
"""
from __future__ import annotations

import time
from typing import Any

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

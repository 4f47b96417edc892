"""A Redis lease lock: `SET key token NX PX ttl` to take it, compare-and-extend to keep it, compare-and-delete to
give it back. The token is unique per holder, so a holder whose lease ran out can never extend or delete the
lock someone else has taken since. Used for the single beat instance and for one scan per watch folder.
"""
from __future__ import annotations

import os
import socket
import uuid

import redis

from .markers import reply_text

# KEYS[1] = lock key, ARGV[1] = token, ARGV[2] = ttl ms. Returns 1 when the caller holds the lock afterwards.
_ACQUIRE_OR_EXTEND = """
local current = redis.call('GET', KEYS[1])
if current == ARGV[1] then
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
    return 1
end
if current == false then
    redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
    return 1
end
return 0
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
    return redis.call('DEL', KEYS[1])
end
return 0
"""


class RedisLock:
    def __init__(self, client: redis.Redis, key: str, ttl_s: float) -> None:
        self.client = client
        self.key = key
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self.token = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:12]}"
        self._acquire = client.register_script(_ACQUIRE_OR_EXTEND)
        self._release = client.register_script(_RELEASE)

    def acquire_or_extend(self) -> bool:
        """Take the lock if free, extend it if ours; False when another holder has it."""
        return bool(self._acquire(keys=[self.key], args=[self.token, self.ttl_ms]))

    def release(self) -> None:
        self._release(keys=[self.key], args=[self.token])

    def holder(self) -> str | None:
        value = self.client.get(self.key)
        return reply_text(value) if value is not None else None

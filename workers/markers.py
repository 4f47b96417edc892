"""Which jobs and staged intakes have a message waiting in the queue, read from the broker itself.

Every message docpipe publishes carries a task id that names what it is for: `job-<job id>-<random>` on the `gpu`
queue, `stage-<stage id>-<random>` on the `ingest` queue (a retry keeps its id). The reconciler reads the
queue lists (kombu's Redis transport keeps one list per queue) and sends again only what has no message
waiting there. That holds whatever happened to the missing message: the broker restarted without persistence,
or a worker took it and died before running it (it then sits in Redis's unacked set until the visibility
timeout, which is hours). Reading a list of N waiting messages costs one pass over N short JSON strings,
done once per reconciler tick and only when some job looks stale.

Also here: one Redis client per URL per process, for the queue's own keys (locks, watch-folder state).
"""
from __future__ import annotations

import re
import threading
import uuid

import redis

_clients: dict[str, redis.Redis] = {}
_clients_lock = threading.Lock()

PREFIX = "docpipe:"
# kombu's Redis transport: one list per queue, plus "<queue>\x06\x16<priority>" lists when priorities are used.
_PRIORITY_SEP = "\x06\x16"
# The message's own task id (`"id"` in the headers; `"root_id"` / `"parent_id"` do not match this pattern).
_TASK_ID = re.compile(rb'"id": ?"(job|stage)-([0-9a-f]+)-')
_CHUNK = 1000


def redis_client(url: str) -> redis.Redis:
    """One connection pool per URL per process (redis-py clients are thread-safe)."""
    with _clients_lock:
        client = _clients.get(url)
        if client is None:
            client = _clients[url] = redis.Redis.from_url(
                url, socket_timeout=5, socket_connect_timeout=5, health_check_interval=10
            )
        return client


def reply_text(value: bytes | str) -> str:
    """A Redis reply as text (redis-py types replies as bytes | str; our clients do not decode responses)."""
    return value.decode() if isinstance(value, bytes) else value


def job_task_id(job_id: int) -> str:
    return f"job-{int(job_id)}-{uuid.uuid4().hex[:12]}"


def ingest_task_id(stage_id: str) -> str:
    return f"stage-{stage_id}-{uuid.uuid4().hex[:12]}"


def queue_keys(client: redis.Redis, queue: str) -> list[str]:
    return [queue] + sorted(k.decode() for k in client.scan_iter(match=f"{queue}{_PRIORITY_SEP}*", count=100))


def waiting(client: redis.Redis, queue: str) -> dict[str, set[str]]:
    """{"job": {job ids}, "stage": {stage ids}} of the messages waiting in `queue` right now."""
    found: dict[str, set[str]] = {"job": set(), "stage": set()}
    for key in queue_keys(client, queue):
        start = 0
        while True:
            chunk = client.lrange(key, start, start + _CHUNK - 1)
            for raw in chunk:
                match = _TASK_ID.search(raw) if isinstance(raw, bytes) else None  # replies are not decoded
                if match:
                    found[match.group(1).decode()].add(match.group(2).decode())
            if len(chunk) < _CHUNK:
                break
            start += _CHUNK
    return found

"""Redis keys the queue keeps next to Celery's own, all under the `docpipe:` prefix of the broker's database.

Enqueue markers: `docpipe:enq:job:<id>` (and `docpipe:enq:ingest:<stage id>`) exist from the moment a message is
published until a worker receives it. The reconciler reads them to tell "a message for this job is waiting in the
queue" (leave it alone) from "no message exists" (the broker lost it, or the worker holding it died): only the
second case is sent again. A broker that loses its contents loses the markers with them, which is exactly right.
"""
from __future__ import annotations

import threading
import time

import redis

_clients: dict[str, redis.Redis] = {}
_clients_lock = threading.Lock()

PREFIX = "docpipe:"


def redis_client(url: str) -> redis.Redis:
    """One connection pool per URL per process (redis-py clients are thread-safe)."""
    with _clients_lock:
        client = _clients.get(url)
        if client is None:
            client = _clients[url] = redis.Redis.from_url(
                url, socket_timeout=5, socket_connect_timeout=5, health_check_interval=10
            )
        return client


def job_marker(job_id: int) -> str:
    return f"{PREFIX}enq:job:{job_id}"


def ingest_marker(stage_id: str) -> str:
    return f"{PREFIX}enq:ingest:{stage_id}"


def set_marker(client: redis.Redis, key: str, ttl_s: float) -> None:
    client.set(key, f"{time.time():.3f}", px=int(ttl_s * 1000))


def clear_marker(client: redis.Redis, key: str) -> None:
    client.delete(key)


def markers_present(client: redis.Redis, keys: list[str]) -> list[bool]:
    if not keys:
        return []
    pipe = client.pipeline(transaction=False)
    for key in keys:
        pipe.exists(key)
    return [bool(n) for n in pipe.execute()]

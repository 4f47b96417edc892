"""Worker heartbeats, so that a job owned by a worker on a machine that died is recovered in seconds, not after
its lease (`job_lease_s`, 15 minutes by default).

The pipeline can only tell that a job's owner (`host:pid`) is dead when the owner ran on the same host. Across
machines, every worker process refreshes `docpipe:alive:<host:pid>` (expiring after `heartbeat_ttl_s`, timed by
the Redis server, so clocks need not agree) and is listed in the set `docpipe:workers`. An owner that is listed
but whose key expired is dead: the reconciler sends its running jobs again, marked as a takeover. An owner that
was never listed (an in-process `docpipe process` run sharing the database) is left to its lease.

A takeover of a live but silent worker (its Redis connection broken for longer than the TTL) costs work, never
correctness: the run that lost the job is fenced out by the pipeline (its writes check the attempt number).
"""
from __future__ import annotations

import logging
import threading

import redis
from redis.exceptions import RedisError

from pipeline.leases import this_owner

from .markers import PREFIX, reply_text

log = logging.getLogger(__name__)

WORKERS_KEY = f"{PREFIX}workers"


def alive_key(owner: str) -> str:
    return f"{PREFIX}alive:{owner}"


def beat_once(client: redis.Redis, owner: str, ttl_s: float) -> None:
    pipe = client.pipeline(transaction=False)
    pipe.set(alive_key(owner), "1", px=int(ttl_s * 1000))
    pipe.sadd(WORKERS_KEY, owner)
    pipe.execute()


class Heartbeat:
    """A daemon thread refreshing this process's alive key every `interval_s` (TTL = 3 intervals)."""

    def __init__(self, client: redis.Redis, interval_s: float, owner: str | None = None) -> None:
        self.client = client
        self.interval_s = interval_s
        self.owner = owner or this_owner()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="docpipe-heartbeat", daemon=True)

    def start(self) -> "Heartbeat":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        try:  # a clean exit is not a death: leave the registry without waiting for the TTL
            self.client.delete(alive_key(self.owner))
            self.client.srem(WORKERS_KEY, self.owner)
        except RedisError:
            pass

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                beat_once(self.client, self.owner, 3 * self.interval_s)
            except RedisError as exc:  # the broker is down: nothing to do but try again
                log.debug("heartbeat of %s not sent: %s", self.owner, exc)
            self._stop.wait(self.interval_s)


def registered(client: redis.Redis) -> set[str]:
    return {reply_text(m) for m in client.smembers(WORKERS_KEY)}


def dead_owners(client: redis.Redis, owners: set[str]) -> set[str]:
    """The owners among `owners` that are registered workers whose heartbeat expired."""
    candidates = sorted(o for o in owners if o)
    if not candidates:
        return set()
    pipe = client.pipeline(transaction=False)
    for owner in candidates:
        pipe.sismember(WORKERS_KEY, owner)
        pipe.exists(alive_key(owner))
    replies = pipe.execute()
    return {owner for owner, listed, alive in zip(candidates, replies[::2], replies[1::2]) if listed and not alive}


def forget(client: redis.Redis, owners: set[str]) -> None:
    """Drop dead owners from the registry once none of their jobs is left running."""
    if owners:
        client.srem(WORKERS_KEY, *sorted(owners))

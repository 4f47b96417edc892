"""kombu's Redis transport with two changes: an acknowledgement that Redis could not record still frees its prefetch
slot, and publishing reuses one Redis client object per channel.

Why (the GPU worker that stopped consuming after a Redis restart): kombu's Redis QoS releases a delivered
message's prefetch slot only after its ZREM/HDEL on the unacked index succeeded. With acks_late, prefetch =
concurrency and every slot busy, no BRPOP is outstanding, so the consumer does not notice Redis going away;
kombu drops the idle BRPOP connection when it sees it close and reconnects "once credit returns". When the
running tasks finish while Redis is still down, their acks fail (Celery only logs "Couldn't ack"), the slots
are never released, credit never returns, no BRPOP is ever sent again and no connection error ever reaches the
consumer: the worker is idle forever with messages waiting (observed in test_workers_redis_restart*).

Here a failed ack or reject still releases the slot (and the error still propagates, so Celery logs it). The
next poll then reconnects or, with Redis still down, raises a connection error in the event loop, which sends
the consumer through Celery's ordinary reconnect. Nothing is lost by forgetting the slot: the message either
died with the broker (the reconciler resends its job from the database) or is still in Redis's unacked set and
comes back after the visibility timeout; its task had already finished, and running a finished job again is a
no-op (`run_job` is idempotent).

The client: kombu builds a new redis-py client object for every message it publishes outside the worker's event
loop (the API's and the reconciler's producers); constructing one copies redis-py's ~170 response callbacks, about
a quarter of an enqueue's CPU (profiled: 0.4 of ~1.8 ms). The client is a thin wrapper over the channel's
connection pool, so one per channel (rebuilt when kombu replaces the pool after a connection error) does the same.

`celery_config` selects this transport (`broker_transport`); the URL stays `redis://...`.
"""
from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Any, Iterator

from kombu.transport import redis as kombu_redis
from kombu.transport import virtual

log = logging.getLogger(__name__)


class SlotReleasingQoS(kombu_redis.QoS):
    def _release_slot(self, delivery_tag: str, exc: BaseException) -> None:
        log.warning("broker did not record the ack of %s (%s: %s); its prefetch slot is freed anyway, so the "
                    "consumer polls again and reconnects", delivery_tag, type(exc).__name__, exc)
        virtual.QoS.ack(self, delivery_tag)  # the local bookkeeping only: no Redis command

    def ack(self, delivery_tag: str) -> None:
        try:
            super().ack(delivery_tag)
        except Exception as exc:  # connection errors, but also e.g. OOM/READONLY replies: the slot is ours
            self._release_slot(delivery_tag, exc)
            raise

    def reject(self, delivery_tag: str, requeue: bool = False) -> None:
        try:
            super().reject(delivery_tag, requeue=requeue)
        except Exception as exc:
            self._release_slot(delivery_tag, exc)
            raise


class SlotReleasingChannel(kombu_redis.Channel):
    QoS = SlotReleasingQoS
    _publish_client: Any = None

    @contextmanager
    def conn_or_acquire(self, client: Any = None) -> Iterator[Any]:
        if client:
            yield client
            return
        cached = self._publish_client
        if cached is None or cached.connection_pool is not self.pool:
            cached = self._publish_client = self._create_client()
        yield cached


class Transport(kombu_redis.Transport):
    Channel = SlotReleasingChannel


TRANSPORT = f"{__name__}:Transport"

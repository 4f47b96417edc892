"""workers.broker: the Redis transport whose failed acks still free their prefetch slot (the GPU worker stalled for
good after a Redis restart without it; test_workers_redis_restart_phases shows that end to end)."""
from __future__ import annotations

import ssl
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

import pytest
import redis
from celery import Celery
from workers_harness import free_port

from pipeline.settings import Settings
from workers.broker import SlotReleasingQoS, Transport
from workers.config import WorkerSettings, celery_config


@dataclass
class _Message:
    body: str
    delivery_info: dict[str, str] = field(default_factory=lambda: {"exchange": "", "routing_key": "gpu"})

    @property
    def _raw(self) -> dict[str, Any]:
        return {"body": self.body, "headers": {}, "properties": {}}


class _Channel:
    """What kombu's Redis QoS uses of its channel: the unacked keys and a client."""

    do_restore = False  # kombu restores unacked messages at interpreter exit; these are not real messages

    def __init__(self, url: str) -> None:
        self.client = redis.Redis.from_url(url, socket_connect_timeout=1, socket_timeout=1)
        tag = uuid.uuid4().hex[:8]
        self.unacked_key, self.unacked_index_key = f"unacked-{tag}", f"unacked_index-{tag}"
        self.unacked_mutex_key, self.unacked_mutex_expire, self.visibility_timeout = f"mutex-{tag}", 300, 3600

    @contextmanager
    def conn_or_acquire(self, client: redis.Redis | None = None) -> Iterator[redis.Redis]:
        yield client or self.client


def _busy_qos(channel: _Channel, tags: list[str]) -> SlotReleasingQoS:
    """A QoS whose every slot holds a delivered message, as in a worker running `len(tags)` tasks."""
    qos = SlotReleasingQoS(channel, prefetch_count=len(tags))
    for tag in tags:
        qos._quick_append(tag, _Message(tag))  # kombu's own bookkeeping, without the Redis write of append()
    assert not qos.can_consume()
    return qos


def test_acks_and_rejects_that_redis_cannot_record_still_free_their_slots():
    dead = _Channel(f"redis://127.0.0.1:{free_port()}/0")  # nothing listens there: every command is refused
    tags = [uuid.uuid4().hex for _ in range(3)]
    qos = _busy_qos(dead, tags)
    with pytest.raises(redis.ConnectionError):  # still raised: Celery logs "Couldn't ack"
        qos.ack(tags[0])
    assert qos.can_consume() and qos.can_consume_max_estimate() == 1
    with pytest.raises(redis.ConnectionError):
        qos.reject(tags[1], requeue=True)
    with pytest.raises(redis.ConnectionError):
        qos.reject(tags[2])
    assert qos.can_consume_max_estimate() == 3


def test_a_recorded_ack_frees_the_slot_and_removes_the_message_from_the_unacked_set(redis_url):
    channel = _Channel(redis_url)
    qos = SlotReleasingQoS(channel, prefetch_count=1)
    qos.append(_Message("m1"), "tag-1")  # written to Redis's unacked set, as the transport does on delivery
    assert not qos.can_consume() and channel.client.hexists(channel.unacked_key, "tag-1")
    qos.ack("tag-1")
    assert qos.can_consume()
    assert not channel.client.hexists(channel.unacked_key, "tag-1")
    assert channel.client.zscore(channel.unacked_index_key, "tag-1") is None


@pytest.mark.parametrize("scheme", ["redis", "rediss"])
def test_the_celery_app_consumes_through_this_transport(tmp_path, scheme):
    conf = celery_config(Settings(data_dir=tmp_path, broker_url=f"{scheme}://127.0.0.1:{free_port()}/4"),
                         WorkerSettings())
    app = Celery("t", set_as_current=False)
    app.conf.update(conf)
    conn = app.connection_for_read()  # builds the transport; connects to nothing yet
    try:
        assert isinstance(conn.transport, Transport)
        assert conn.transport.Channel.QoS is SlotReleasingQoS
        assert conn.ssl == ({"ssl_cert_reqs": ssl.CERT_REQUIRED} if scheme == "rediss" else False)
    finally:
        conn.release()


def test_publishing_reuses_one_client_per_connection_pool(redis_url):
    """Messages published through the transport arrive; the channel builds one redis-py client for them, and a new
    one once kombu replaces its connection pool (as after a connection error)."""
    from kombu import Connection, Exchange, Producer, Queue

    queue = Queue("reuse-test", Exchange("reuse-test"), "reuse-test")
    with Connection(redis_url, transport=Transport) as conn:
        channel = conn.channel()
        built: list[Any] = []
        create = channel._create_client

        def counting_create(asynchronous: bool = False) -> Any:
            client = create(asynchronous=asynchronous)
            if not asynchronous:
                built.append(client)
            return client

        channel._create_client = counting_create
        producer = Producer(channel, exchange=queue.exchange, routing_key="reuse-test")
        producer.declare()
        queue(channel).declare()
        for i in range(5):
            producer.publish({"n": i})
        assert len(built) == 1
        channel._disconnect_pools()  # what kombu does on a connection error; the next pool is a new object
        producer.publish({"n": 5})
        assert len(built) == 2 and built[1].connection_pool is channel.pool
        got = [queue(channel).get(no_ack=True).payload["n"] for _ in range(6)]
        assert got == list(range(6))

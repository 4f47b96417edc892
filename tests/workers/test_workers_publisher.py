"""Publishing off the request path (issue 21 item 10): `send` returns at once whatever the broker does, and a
broker that is down costs one failed publish per pause, not one per upload."""
from __future__ import annotations

import threading
import time

from workers.publisher import BackgroundPublisher


def wait_for(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def test_send_returns_while_the_publish_is_stuck() -> None:
    release = threading.Event()
    published: list[tuple[int, str]] = []

    def publish(job_id: int) -> bool:
        release.wait(30)  # a broker that does not answer
        published.append((job_id, threading.current_thread().name))
        return True

    publisher = BackgroundPublisher(publish)
    publisher.send(1)
    publisher.send(2)  # both returned although the first publish has not finished
    assert published == []
    release.set()
    wait_for(lambda: len(published) == 2)
    assert [j for j, _ in published] == [1, 2] and {name for _, name in published} == {"docpipe-publish"}


def test_a_failed_publish_pauses_publishing_and_leaves_the_jobs_to_the_reconciler() -> None:
    now = [100.0]
    broker_up = threading.Event()
    attempts: list[int] = []
    first_done = threading.Event()

    def publish(job_id: int) -> bool:
        attempts.append(job_id)
        first_done.set()
        return broker_up.is_set()

    publisher = BackgroundPublisher(publish, pause_s=5.0, clock=lambda: now[0])
    publisher.send(1)
    first_done.wait(10)
    wait_for(lambda: publisher.dropped == 1)
    for job_id in (2, 3, 4):  # within the pause: dropped at once, no publish attempted
        publisher.send(job_id)
    assert attempts == [1] and publisher.dropped == 4 and publisher.pending() == 0
    broker_up.set()
    now[0] += 5.0  # the pause is over: publishing resumes
    publisher.send(5)
    wait_for(lambda: attempts == [1, 5])
    assert publisher.dropped == 4


def test_a_raising_publish_does_not_stop_the_thread() -> None:
    calls: list[int] = []

    def publish(job_id: int) -> bool:
        calls.append(job_id)
        if job_id == 1:
            raise ConnectionError("refused")
        return True

    now = [0.0]
    publisher = BackgroundPublisher(publish, pause_s=1.0, clock=lambda: now[0])
    publisher.send(1)
    wait_for(lambda: publisher.dropped == 1)
    now[0] = 2.0
    publisher.send(2)
    wait_for(lambda: calls == [1, 2])

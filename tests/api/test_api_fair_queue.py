"""The embedded runner's FairQueue: owners served in turn, and an owner at its render cap waits."""
from __future__ import annotations

import threading

import pytest

from api.fair_queue import FairQueue


def test_owners_are_served_in_turn_whatever_their_lane_length() -> None:
    q = FairQueue(per_owner=10)
    for job in (1, 2, 3, 4):
        q.put(job, "alice")
    q.put(9, "bob")
    order = []
    for _ in range(5):
        taken = q.get()
        assert taken is not None
        order.append(taken)
    assert order == [(1, "alice"), (9, "bob"), (2, "alice"), (3, "alice"), (4, "alice")]


def test_an_owner_at_its_render_cap_gets_nothing_until_a_render_finished() -> None:
    q = FairQueue(per_owner=1)
    q.put(1, "alice")
    q.put(2, "alice")
    assert q.get() == (1, "alice")
    got: list[object] = []
    waiter = threading.Thread(target=lambda: got.append(q.get()))
    waiter.start()
    waiter.join(0.3)
    assert waiter.is_alive() and not got  # alice's second job waits while her first renders
    q.put(7, "bob")
    waiter.join(5)
    assert got == [(7, "bob")]  # another owner is not held up by alice's cap
    q.rendered("alice")
    assert q.get() == (2, "alice")
    assert len(q) == 0


def test_close_wakes_waiting_threads() -> None:
    q = FairQueue(per_owner=1)
    got: list[object] = []
    waiter = threading.Thread(target=lambda: got.append(q.get()))
    waiter.start()
    q.close()
    waiter.join(5)
    assert got == [None]
    with pytest.raises(ValueError, match="per_owner"):
        FairQueue(per_owner=0)

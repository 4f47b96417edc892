"""RequestHandle's Outbox: outputs nobody has taken yet stay O(1) per request (unfinished ones merge, deltas
joined), while a stream that keeps up still sees every output, and a stream that falls behind loses no text."""
from __future__ import annotations

import random
import threading

import pytest

from gpu_engine.async_engine import Outbox
from gpu_engine.params import RequestOutput


def out(text: str, delta: str, finished: bool = False) -> RequestOutput:
    return RequestOutput(request_id="r", text=text, token_ids=list(range(len(text))), finished=finished,
                         finish_reason="length" if finished else None, delta=delta)


def test_unread_outputs_merge_into_one_with_the_joined_deltas() -> None:
    box = Outbox()
    text = ""
    for i in range(1000):
        piece = chr(97 + i % 26)
        text += piece
        box.put(out(text, piece))
    assert len(box) == 1
    item = box.get(0)
    assert isinstance(item, RequestOutput)
    assert item.delta == text and item.text == text and item.token_ids == list(range(1000)) and not item.finished


def test_the_final_output_absorbs_a_waiting_one_and_ends_the_stream() -> None:
    box = Outbox()
    box.put(out("ab", "ab"))
    box.put(out("abc", "c", finished=True))
    item = box.get(0)
    assert isinstance(item, RequestOutput) and item.finished and item.delta == "abc" and len(box) == 0


def test_errors_and_finished_outputs_are_never_merged_over() -> None:
    box = Outbox()
    err = RuntimeError("boom")
    box.put(out("a", "a"))
    box.put(err)
    box.put(out("ab", "b"))  # after an error: a new entry, the error stays where it was
    assert len(box) == 3 and box.get(0).delta == "a" and box.get(0) is err
    box.put(out("abc", "c", finished=True))
    box.put(out("abcd", "d"))  # nothing after a finished output merges into it
    assert box.get(0).delta == "bc" and box.get(0).delta == "d"


def test_a_reader_that_keeps_up_gets_every_output() -> None:
    box = Outbox()
    for i in range(5):
        box.put(out("x" * (i + 1), "x"))
        assert box.get(0).text == "x" * (i + 1)


def test_get_times_out_with_none() -> None:
    assert Outbox().get(0.01) is None


@pytest.mark.parametrize("seed", [random.randrange(1 << 30)])
def test_a_slow_concurrent_reader_loses_no_text(seed) -> None:
    rng = random.Random(seed)
    pieces = [rng.choice("abcdef") * rng.randint(1, 3) for _ in range(2000)]
    box, got = Outbox(), []

    def reader() -> None:
        while True:
            item = box.get(5)
            assert isinstance(item, RequestOutput)
            got.append(item.delta)
            if rng.random() < 0.01:
                threading.Event().wait(0.001)  # fall behind now and then
            if item.finished:
                return

    t = threading.Thread(target=reader)
    t.start()
    text = ""
    for i, piece in enumerate(pieces):
        text += piece
        box.put(out(text, piece, finished=i == len(pieces) - 1))
    t.join(10)
    assert "".join(got) == text, seed

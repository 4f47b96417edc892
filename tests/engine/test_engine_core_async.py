"""AsyncEngine: many threads / asyncio tasks, one step loop."""
from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import numpy as np
import pytest
from test_engine_core_fakes import FakeRunner, tiny_tokenizer

from gpu_engine.async_engine import AsyncEngine, EngineStoppedError
from gpu_engine.engine import Engine, RequestError
from gpu_engine.engine_config import EngineConfig
from gpu_engine.params import SamplingParams


class SlowRunner(FakeRunner):
    def forward(self, batch):
        time.sleep(0.002)
        return super().forward(batch)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return tiny_tokenizer(tmp_path_factory.mktemp("tok"))


def new_engine(tok, runner=None) -> Engine:
    return Engine(runner or FakeRunner(), tok, vocab_size=2074, config=EngineConfig(max_num_seqs=8, num_kv_blocks=512))


@pytest.fixture
def front(tok):
    f = AsyncEngine(new_engine(tok, SlowRunner()), idle_wait_s=0.01)
    yield f
    f.shutdown()


def prompts(n, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 2000, size=int(rng.integers(2, 20))).tolist() for _ in range(n)]


def test_many_threads_get_the_sequential_results(tok, front):
    ps = prompts(20)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    expected = [o.token_ids for o in new_engine(tok).generate(ps, params)]
    results: dict[int, list[int]] = {}

    def worker(i):
        results[i] = front.submit(ps[i], params).result(timeout=30).token_ids

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [results[i] for i in range(20)] == expected


def test_stream_deltas_add_up(front):
    h = front.submit(prompts(1, 1)[0], SamplingParams(max_tokens=12, ignore_eos=True))
    items = list(h.stream(timeout=30))
    assert items[-1].finished and not any(i.finished for i in items[:-1])
    assert "".join(i.delta for i in items) == items[-1].text
    assert h.result(timeout=1) is items[-1]


def test_cancel_and_rejection(front):
    long = front.submit([1, 2, 3], SamplingParams(max_tokens=5000, ignore_eos=True))
    empty = front.submit([], SamplingParams(max_tokens=3))  # refused while preparing, on the caller's thread
    with pytest.raises(RequestError, match="prompt must be"):
        empty.result(timeout=1)
    bad = front.submit([1, 2], SamplingParams(max_tokens=3, top_logprobs=99, logprobs=True))  # refused by the engine
    ok = front.submit([4, 5, 6], SamplingParams(max_tokens=4, ignore_eos=True))
    with pytest.raises(RequestError):
        bad.result(timeout=30)
    assert ok.result(timeout=30).finish_reason == "length"
    long.cancel()
    out = long.result(timeout=30)
    assert out.finish_reason == "abort" and 0 < len(out.token_ids) < 5000
    with pytest.raises(TimeoutError):
        front.submit([7, 8], SamplingParams(max_tokens=4000, ignore_eos=True)).result(timeout=0.01)


def test_asyncio_helpers(front):
    async def main():
        outs = await asyncio.gather(*[front.agenerate(p, SamplingParams(max_tokens=6, ignore_eos=True))
                                      for p in prompts(5, 2)])
        pieces = [o async for o in front.astream([9, 9, 9], SamplingParams(max_tokens=5, ignore_eos=True))]
        # Closing a stream early aborts its request.
        async with contextlib.aclosing(front.astream([1, 1], SamplingParams(max_tokens=5000, ignore_eos=True))) as s:
            async for _ in s:
                break
        return outs, pieces

    outs, pieces = asyncio.run(main())
    assert all(o.finished and len(o.token_ids) == 6 for o in outs)
    assert pieces[-1].finished and len(pieces[-1].token_ids) == 5
    deadline = time.time() + 10
    while front.stats()["finished_abort"] < 1 and time.time() < deadline:
        time.sleep(0.01)
    assert front.stats()["finished_abort"] >= 1


def test_shutdown_aborts_running_and_refuses_new(tok):
    f = AsyncEngine(new_engine(tok, SlowRunner()), idle_wait_s=0.01)
    h = f.submit([1, 2, 3], SamplingParams(max_tokens=5000, ignore_eos=True))
    h.stream(timeout=30).__next__()  # running
    f.shutdown()
    assert not f.is_running
    assert h.result(timeout=1).finish_reason == "abort"
    with pytest.raises(EngineStoppedError):
        f.submit([1], SamplingParams(max_tokens=2))


def test_failing_listener_does_not_stop_the_loop(front):
    def boom(item):
        raise RuntimeError("caller gone")

    h = front.submit([1, 2], SamplingParams(max_tokens=3, ignore_eos=True), listener=boom)
    assert h.result(timeout=30).finish_reason == "length"
    assert front.submit([3, 4], SamplingParams(max_tokens=3, ignore_eos=True)).result(timeout=30).finished
    assert front.is_running


def test_stats_snapshot_is_exact_once_the_engine_runs_dry(front):
    """stats() is refreshed at most every STATS_PERIOD_S while busy, but always once the work is done."""
    handles = [front.submit(p, SamplingParams(max_tokens=5, ignore_eos=True)) for p in prompts(12, seed=3)]
    for h in handles:
        h.result(timeout=30)
    # the snapshot may lag the results by a moment (results are delivered before it is refreshed), never longer
    deadline = time.time() + 5
    while front.stats()["sampled_tokens"] < 12 * 5 and time.time() < deadline:
        time.sleep(0.005)
    st = front.stats()
    assert (st["running"], st["waiting"]) == (0, 0)
    assert st["sampled_tokens"] == 12 * 5

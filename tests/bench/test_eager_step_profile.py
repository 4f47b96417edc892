"""bench/eager_step_profile.py's host parts: the blocked-time accounting and the sampling request it sends."""
from __future__ import annotations

import time

import eager_step_profile as esp
import numpy as np


class SlowDevice:
    def __init__(self) -> None:
        self.calls = 0

    def sync(self, stream=None) -> None:
        self.calls += 1
        time.sleep(0.01)


class FakeRunner:
    """forward(): 20 ms of host work, then one 10 ms sync (the GPU finishing)."""

    def __init__(self, device: SlowDevice) -> None:
        self.ctx = type("Ctx", (), {"device": device})()

    def forward(self, batch) -> None:
        time.sleep(0.02)
        self.ctx.device.sync()


def test_sync_time_is_counted_apart_from_host_work_and_the_wrapper_comes_off():
    device = SlowDevice()
    original = device.sync
    timer = esp.SyncTimer(device)
    r = esp.timed(FakeRunner(device), lambda i: None, steps=3, sync=timer)
    assert 8 < r["gpu_wait_ms"] < 60 and 15 < r["host_ms"] < 80  # wide: a loaded CI machine sleeps long
    assert abs(r["wall_ms"] - r["gpu_wait_ms"] - r["host_ms"]) < 1e-6
    timer.restore()
    assert device.sync == original and device.calls == 3 + 3 * 3  # warm-ups: 1 each; timed: before, inside, after


class CountingDevice(SlowDevice):
    def launch(self, *args, **kw) -> None:
        pass


class Blas:
    def __init__(self) -> None:
        self._plans: dict = {}

    def linear(self, m: int) -> None:
        self._plans.setdefault(m, object())  # a new row count: a new plan


class LaunchingRunner:
    """forward(batch): two launches and one GEMM at m = batch (a new m adds a plan)."""

    def __init__(self) -> None:
        self.ctx = type("Ctx", (), {"device": CountingDevice(), "blas": Blas()})()

    def forward(self, batch) -> None:
        self.ctx.device.launch()
        self.ctx.device.launch()
        self.ctx.blas.linear(batch)


def test_launches_gemms_and_new_plans_are_counted_per_timed_step():
    runner = LaunchingRunner()
    calls = esp.CallCounter(runner.ctx)
    timer = esp.SyncTimer(runner.ctx.device)
    same = esp.timed(runner, lambda i: 7, steps=4, sync=timer, calls=calls)
    assert same["launches"] == 2 and same["gemm_calls"] == 1 and same["new_gemm_plans"] == 0
    new = esp.timed(runner, lambda i: 100 + i, steps=4, sync=timer, calls=calls)
    assert new["new_gemm_plans"] == 1  # the warm-ups (i < 0) made their own
    calls.restore()
    timer.restore()
    runner.forward(1000)
    assert calls.launches == 2 * 14 and calls.gemms == 14  # nothing counted after restore()


class DownloadingDevice(SlowDevice):
    """A download that blocks 10 ms itself (the pageable copy waiting for the GPU), then syncs."""

    def download(self, host, src):
        time.sleep(0.01)
        self.sync()
        return host


def test_a_blocking_download_counts_once_as_waiting():
    device = DownloadingDevice()
    timer = esp.SyncTimer(device)
    timer.seconds = 0.0
    device.download(None, 0)
    assert 0.018 < timer.seconds < 0.2  # the copy's 10 ms + its inner sync's 10 ms, not the sync twice
    device.sync()
    assert timer.seconds > 0.028
    timer.restore()
    assert "download" not in vars(device) or vars(device)["download"] == DownloadingDevice.download.__get__(device)


def test_greedy_request_has_one_row_per_chunk():
    req = esp.greedy(7)
    assert req.num_rows == 7 and not req.temperature.any() and (req.num_logprobs == -1).all()
    assert req.top_p.dtype == np.float32 and req.bitmask is None


def test_the_timing_waits_for_the_start_file_at_most_its_limit(tmp_path):
    flag = tmp_path / "go"
    assert esp.wait_for(None) < 0.1
    assert 0.2 <= esp.wait_for(str(flag), limit_s=0.3) < 2.0  # never there: gives up at the limit
    flag.write_text("")
    assert esp.wait_for(str(flag)) < 0.1

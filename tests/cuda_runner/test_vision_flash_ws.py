"""The warp-specialised vision attention (kernels/vision_flash_ws.cu) on the CPU: its host constants and launches,
and its mbarrier stage ring replayed under random interleavings of the producer and the consumer warpgroups (the
kernel itself runs in tests/cuda_runner/check_vision_flash.py on a GPU)."""
from __future__ import annotations

import random
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from gpu_engine.cuda import vision_flash
from gpu_engine.cuda.device import KERNEL_DIR, compile_arch, expand_source
from tests.cuda_runner.no_launch import arr
from tests.cuda_runner.test_vision_flash_tiling import RecordingDevice

SOURCE = Path(KERNEL_DIR) / "vision_flash_ws.cu"


@pytest.mark.parametrize("variant", sorted(vision_flash.WS_VARIANTS))
def test_each_variant_names_a_kernel_with_its_template_and_block(variant: str) -> None:
    consumers, keys, stages, q_smem = vision_flash.WS_VARIANTS[variant]
    src = SOURCE.read_text()
    name = vision_flash.kernel_name(72, variant)
    threads = 128 * (1 + consumers)
    assert re.search(rf"__launch_bounds__\({threads}, 1\) {name}\(", src), name
    body = src[src.index(f"{name}("):]
    assert f"vs_attention<{consumers}, {keys}, {stages}, {str(q_smem).lower()}>(" in body[: body.index("}")]
    assert vision_flash.VARIANTS[variant] == (consumers, keys)  # tile rows = 64 per consumer warpgroup
    assert compile_arch("sm_90", expand_source(SOURCE)) == "sm_90a"


@pytest.mark.parametrize("variant", sorted(vision_flash.WS_VARIANTS))
def test_launch_grid_threads_and_shared_memory(variant: str) -> None:
    consumers, keys, stages, q_smem = vision_flash.WS_VARIANTS[variant]
    ctx = SimpleNamespace(device=RecordingDevice("sm_90"))
    seg, segments, heads = 8580, 2, 16
    n = seg * segments
    vision_flash.vision_flash_attention(ctx, arr((n, heads * 72)), arr((n, 3 * heads * 72)), heads, 72, seg,
                                        72 ** -0.5, variant=variant)
    (call,) = ctx.device.calls
    tiles = -(-seg // (64 * consumers))
    assert call[:4] == ("vision_flash_ws", vision_flash.kernel_name(72, variant), (segments * tiles, heads),
                        128 * (1 + consumers))
    assert call[4] == ['int', 'int', 'int32', 'int32', 'int32', 'float32']
    # the kernel traps unless it gets STAGES x (K tile of 80 columns + V tile of 72) bf16 rows of `keys`, and with
    # Q in shared memory 64 rows of 80 columns per consumer
    assert call[5] == (stages * keys * (80 + 72) + q_smem * consumers * 64 * 80) * 2 <= 227 * 1024


def test_other_devices_and_head_dims_fall_back_to_m2n32() -> None:
    for variant in vision_flash.WS_VARIANTS:
        assert vision_flash.resolve_variant(72, variant, "sm_80") == "m2n32"
        assert vision_flash.resolve_variant(64, variant, "sm_90") == "m2n32"


class Barrier:
    """An mbarrier: `expected` arrivals complete a phase; try_wait.parity(q) succeeds while the current phase's
    parity differs from q (the phase of parity q has completed), exactly what the hardware compares."""

    def __init__(self, expected: int) -> None:
        self.expected, self.pending, self.phase = expected, expected, 0

    def arrive(self) -> None:
        self.pending -= 1
        if self.pending == 0:
            self.phase, self.pending = self.phase + 1, self.expected

    def passed(self, parity: int) -> bool:
        return (self.phase & 1) != parity


def replay(n_kt: int, stages: int, consumers: int, seed: int, release_lag: int = 1) -> list[str]:
    """vs_produce / vs_consume's protocol, one actor per warpgroup (a warpgroup's arrivals count as one), interleaved
    at random. Consumer step j reads K_j and V_{j-1} and then releases tile j - release_lag (the kernel: 1, after
    the P V of j - 1 retired); the producer's copy of tile t fills stage t % stages and lands (arrives on full) after
    it issued tile t + 1, or at the end. Returns what goes wrong: a read of a stage not holding the landed tile, a
    copy over a stage still read, or a deadlock."""
    full = [Barrier(1) for _ in range(stages)]
    empty = [Barrier(consumers) for _ in range(stages)]
    occupant: dict[int, tuple[int, bool]] = {}  # stage -> (tile, landed)
    reading: dict[int, set[int]] = {st: set() for st in range(stages)}  # stage -> consumers reading it
    bad: list[str] = []

    def producer():
        for t in range(n_kt):
            st = t % stages
            if t >= stages:
                while not empty[st].passed((t // stages - 1) & 1):
                    yield False
            if reading[st]:
                bad.append(f"tile {t} copied over stage {st} while consumers {sorted(reading[st])} read it")
            occupant[st] = (t, False)
            yield True
            if t >= 1:
                prev = (t - 1) % stages
                occupant[prev] = (t - 1, True)
                full[prev].arrive()
                yield True
        last = (n_kt - 1) % stages
        occupant[last] = (n_kt - 1, True)
        full[last].arrive()

    def consumer(c: int):
        for j in range(n_kt):
            st = j % stages
            while not full[st].passed((j // stages) & 1):
                yield False
            for tile in {j, j - 1} - {-1}:
                if occupant.get(tile % stages) != (tile, True):
                    bad.append(f"consumer {c} step {j}: tile {tile} not in stage {tile % stages}")
                reading[tile % stages].add(c)
            yield True
            done = j - release_lag
            if done >= 0:
                reading[done % stages].discard(c)
                empty[done % stages].arrive()
            yield True

    rng = random.Random(seed)
    actors = [producer()] + [consumer(c) for c in range(consumers)]
    progress = [True] * len(actors)
    while actors:
        i = rng.randrange(len(actors))
        try:
            progress[i] = next(actors[i])
        except StopIteration:
            del actors[i], progress[i]
            continue
        if progress and not any(progress):  # every live actor blocked: try each once more before calling it
            if not any(next(a, True) for a in actors):
                return bad + [f"deadlock (n_kt {n_kt}, stages {stages})"]
            progress = [True] * len(actors)
    return bad


@pytest.mark.parametrize("variant", sorted(vision_flash.WS_VARIANTS))
def test_the_stage_ring_holds_under_random_interleavings(variant: str) -> None:
    consumers, _, stages, _ = vision_flash.WS_VARIANTS[variant]
    for n_kt in range(1, 14):
        for seed in range(40):
            assert replay(n_kt, stages, consumers, seed) == [], (n_kt, seed)


def test_the_replay_has_teeth() -> None:
    # two stages deadlock (the producer waits for a release that needs the tile it has not landed yet)
    assert any("deadlock" in " ".join(replay(n, 2, 2, s)) for n in range(3, 8) for s in range(20))
    # releasing tile j, whose V the next step still reads, lets the producer overwrite it
    assert any(replay(n, 3, 2, s, release_lag=0) for n in range(4, 10) for s in range(40))

"""The engine's AUTO batch sizes (gpu_engine/batch_defaults.py): small on the reference runner, sized from the
runner's cache budget on a runner that has one, explicit values kept. Pure arithmetic with stand-in runners."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from gpu_engine.batch_defaults import SEQ_KV_TOKENS, resolve_batching, sized_max_num_seqs
from gpu_engine.engine_config import AUTO, EngineConfig, EngineConfigError

GIB, MIB, KIB = 1 << 30, 1 << 20, 1 << 10


class SizedRunner:
    """A runner that sizes its own cache (as CudaRunner.cache_budget): `budget` bytes less 1 MiB per logits row,
    so the budget it offers depends on the batch size asked about."""

    def __init__(self, budget: int, state_bytes: int, kv_bytes_per_token: int) -> None:
        self.budget, self.state, self.kv = budget, state_bytes, kv_bytes_per_token
        self.asked: list[tuple[int, int]] = []

    def cache_budget(self, max_num_seqs: int, max_batched_tokens: int) -> SimpleNamespace:
        self.asked.append((max_num_seqs, max_batched_tokens))
        return SimpleNamespace(nbytes=self.budget - max_num_seqs * MIB)

    def kv_bytes_per_block(self, block_size: int) -> int:
        return self.kv * block_size

    def state_bytes_per_slot(self) -> int:
        return self.state


# The H200 figures of session 6 (bench/results/cuda_notes.md): runner-sized cache, state slot and KV per token.
H200_9B = (int(90.8 * GIB), 49 * MIB, 32 * KIB)
H200_27B = (int(56.8 * GIB), 147 * MIB, 64 * KIB)


def test_reference_runner_keeps_the_small_defaults():
    cfg = resolve_batching(EngineConfig(), object())
    assert (cfg.max_num_seqs, cfg.max_batched_tokens) == (32, 2048)
    assert resolve_batching(EngineConfig(max_num_seqs=300), object()).max_batched_tokens == 2048
    assert resolve_batching(EngineConfig(max_num_seqs=3000), object()).max_batched_tokens == 3000
    assert resolve_batching(EngineConfig(max_batched_tokens=16), object()).max_num_seqs == 16


@pytest.mark.parametrize("figures, want", [(H200_9B, 256), (H200_27B, 128)])
def test_sized_runner_gets_the_batch_measured_best_on_the_h200(figures, want):
    runner = SizedRunner(*figures)
    cfg = resolve_batching(EngineConfig(), runner)
    assert (cfg.max_num_seqs, cfg.max_batched_tokens) == (want, 8192)
    assert all(tokens == 8192 for _, tokens in runner.asked)  # budgets asked at the step size the engine will use


def test_the_chosen_batch_fits_and_twice_it_does_not():
    budget, state, kv = H200_27B
    cfg = resolve_batching(EngineConfig(), SizedRunner(budget, state, kv))
    n = cfg.max_num_seqs

    def need(seqs: int) -> int:
        return (seqs + min(seqs, 32)) * state + seqs * SEQ_KV_TOKENS * kv

    assert need(n) <= budget - n * MIB
    assert need(2 * n) > budget - 2 * n * MIB


def test_smaller_budgets_get_smaller_batches_never_zero():
    _, state, kv = H200_27B
    sizes = [resolve_batching(EngineConfig(), SizedRunner(b, state, kv)).max_num_seqs
             for b in (int(56.8 * GIB), 40 * GIB, 16 * GIB, 4 * GIB, 64 * MIB)]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] == 128 and sizes[-1] == 1


def test_explicit_values_win():
    runner = SizedRunner(*H200_9B)
    cfg = resolve_batching(EngineConfig(max_num_seqs=48, max_batched_tokens=1024), runner)
    assert (cfg.max_num_seqs, cfg.max_batched_tokens) == (48, 1024) and runner.asked == []
    assert resolve_batching(EngineConfig(max_num_seqs=48), runner).max_batched_tokens == 8192
    assert resolve_batching(EngineConfig(max_batched_tokens=100), runner).max_num_seqs == 64  # tokens >= seqs
    # an explicit kv_cache_bytes is the budget, not the runner's
    small = resolve_batching(EngineConfig(kv_cache_bytes=2 * GIB), SizedRunner(*H200_9B))
    assert small.max_num_seqs == 8  # 16 would need 32 slots x 49 MiB + 16 x 2048 x 32 KiB = 2.5 GiB
    assert resolve_batching(EngineConfig(num_state_slots=40), SizedRunner(*H200_9B)).max_num_seqs == 32


def test_auto_is_the_default_and_negative_is_refused():
    assert EngineConfig().max_num_seqs == AUTO and EngineConfig().max_batched_tokens == AUTO
    with pytest.raises(EngineConfigError, match="max_num_seqs"):
        EngineConfig(max_num_seqs=-1)
    with pytest.raises(EngineConfigError, match="AUTO"):
        _ = EngineConfig().state_slots


def test_sized_max_num_seqs_is_a_power_of_two_at_most_the_cap():
    assert sized_max_num_seqs(lambda n: True) == 256
    assert sized_max_num_seqs(lambda n: True, cap=100) == 64
    assert sized_max_num_seqs(lambda n: n <= 20) == 16
    assert sized_max_num_seqs(lambda n: False) == 1


def test_a_reference_engine_reports_the_resolved_sizes():
    from gpu_engine import Engine
    from gpu_engine.bundled import bundled_model_dir

    engine = Engine.from_pretrained(bundled_model_dir(), runner="reference")
    assert (engine.config.max_num_seqs, engine.config.max_batched_tokens) == (32, 2048)

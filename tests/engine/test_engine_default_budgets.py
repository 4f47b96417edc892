"""The engine's byte budgets when EngineConfig leaves them unset (#14): the cache from the runner's own budget
(CudaRunner.cache_budget: GPU memory after the weights; gpu_engine/cuda/memory_plan.py) or the small default for
runners without one, and the encoder cache from the runner's on-device region or room for the largest image."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from test_engine_core_fakes import FakeRunner, tiny_tokenizer, vision_prompt

from gpu_engine.cache_sizing import cache_budget, size_cache
from gpu_engine.config import ModelConfig
from gpu_engine.cuda import memory_plan
from gpu_engine.cuda.options import DEFAULT_ENCODER_MEMORY, CudaOptions, encoder_region_bytes
from gpu_engine.encoder_cache import DEFAULT_ENCODER_TOKENS, MIN_ENCODER_BUDGET, default_encoder_budget
from gpu_engine.engine import Engine, RequestError
from gpu_engine.engine_config import DEFAULT_KV_CACHE_BYTES, EngineConfig, EngineConfigError
from gpu_engine.params import SamplingParams

GIB = 1 << 30


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return tiny_tokenizer(tmp_path_factory.mktemp("tok"))


class BudgetRunner(FakeRunner):
    """FakeRunner with a runner-sized cache (as CudaRunner) and optionally an on-device encoder region."""

    def __init__(self, budget: int, region: int = 0, hidden: int = 4) -> None:
        super().__init__(hidden=hidden)
        self.budget, self.encoder_region_bytes, self.asked = budget, region, []

    def cache_budget(self, max_num_seqs: int, max_batched_tokens: int) -> memory_plan.CacheBudget:
        self.asked.append((max_num_seqs, max_batched_tokens))
        return memory_plan.CacheBudget(nbytes=self.budget, arena_bytes=2 * self.budget,
                                       after_weights_bytes=self.budget + 5, reserve_bytes=5)


def test_explicit_kv_cache_bytes_wins_over_the_runners_budget() -> None:
    runner = BudgetRunner(budget=10**9)
    assert cache_budget(EngineConfig(kv_cache_bytes=12345), runner)[0] == 12345
    assert runner.asked == []


def test_runner_budget_is_asked_with_the_batch_limits() -> None:
    runner = BudgetRunner(budget=int(np.random.default_rng().integers(10**6, 10**9)))
    nbytes, source = cache_budget(EngineConfig(max_num_seqs=7, max_batched_tokens=300), runner)
    assert nbytes == runner.budget and runner.asked == [(7, 300)]
    assert "default cache budget" in source and "kv_cache_bytes" in source


def test_runners_without_a_budget_keep_the_small_default() -> None:
    assert cache_budget(EngineConfig(), FakeRunner()) == (DEFAULT_KV_CACHE_BYTES,
                                                          f"the default kv_cache_bytes={DEFAULT_KV_CACHE_BYTES}")


def test_engine_sizes_its_cache_from_the_runner(tok) -> None:
    budget = int(np.random.default_rng().integers(1 << 20, 1 << 24))
    eng = Engine(BudgetRunner(budget), tok, vocab_size=2074, config=EngineConfig(max_num_seqs=4, max_batched_tokens=64))
    assert budget - 8 * 16 < eng.cache_bytes <= budget  # blocks of 8 * 16 bytes fill the budget


def test_too_small_runner_budget_says_where_it_came_from(tok) -> None:
    with pytest.raises(EngineConfigError, match="default cache budget: arena.*too small"):
        Engine(BudgetRunner(budget=100), tok, vocab_size=2074, config=EngineConfig(max_num_seqs=4,
                                                                                   max_batched_tokens=64))
    with pytest.raises(EngineConfigError, match="kv_cache_bytes=100"):
        size_cache(EngineConfig(kv_cache_bytes=100, max_num_seqs=4, max_batched_tokens=64), 8 * 16, 16)


def test_encoder_budget_is_the_runners_device_region_when_it_has_one() -> None:
    region = int(np.random.default_rng().integers(MIN_ENCODER_BUDGET, 4 * GIB))
    assert default_encoder_budget(BudgetRunner(1, region=region)) == region
    assert default_encoder_budget(BudgetRunner(1, region=1)) == MIN_ENCODER_BUDGET  # never below the old default


@pytest.mark.parametrize("hidden,expected", [(4, MIN_ENCODER_BUDGET), (4096, DEFAULT_ENCODER_TOKENS * 4096 * 4)])
def test_encoder_budget_without_a_region_fits_the_largest_image(hidden, expected) -> None:
    assert default_encoder_budget(FakeRunner(hidden=hidden)) == expected


def test_engine_checks_requests_against_its_default_encoder_budget(tok) -> None:
    # FakeRunner embeddings are hidden * 4 bytes a token: 2**16 hidden makes an 8-token image 2 MiB
    small = Engine(BudgetRunner(1 << 20, region=1, hidden=1 << 16), tok, vocab_size=2074,
                   config=EngineConfig(max_num_seqs=4, max_batched_tokens=64, encoder_cache_bytes=1 << 20))
    prompt = vision_prompt(np.random.default_rng(), [1, ("image", 8, "x")])
    with pytest.raises(RequestError, match="encoder_cache_bytes"):
        small.add_request(prompt, SamplingParams(max_tokens=2))
    default = Engine(BudgetRunner(1 << 20, region=1, hidden=1 << 16), tok, vocab_size=2074,
                     config=EngineConfig(max_num_seqs=4, max_batched_tokens=64))
    assert default.encoder.budget_bytes == MIN_ENCODER_BUDGET
    default.add_request(prompt, SamplingParams(max_tokens=2))  # 2 MiB fits 64 MiB


def test_cuda_default_encoder_region_holds_a_12_mp_photo_at_27b() -> None:
    photo_tokens, hidden_27b = 11844, 5120
    assert CudaOptions().encoder_memory is None  # sized from the memory budget
    h200 = encoder_region_bytes(None, 119 * GIB)
    assert h200 == DEFAULT_ENCODER_MEMORY
    assert photo_tokens * hidden_27b * 2 < h200
    assert DEFAULT_ENCODER_TOKENS * hidden_27b * 2 < h200  # the largest image too


@pytest.mark.parametrize("budget", [1 << 30, 256 << 20, 3 << 30])
def test_cuda_default_encoder_region_takes_at_most_a_quarter_of_a_small_budget(budget: int) -> None:
    assert encoder_region_bytes(None, budget) == min(DEFAULT_ENCODER_MEMORY, budget // 4)
    assert encoder_region_bytes(12345, budget) == 12345  # an explicit size is kept


TEXT_9B = ModelConfig.from_dict({"model_type": "qwen3_5", "text_config": {}, "vision_config": {}}).text  # 9B
VISION_9B = SimpleNamespace(patch_dim=1536, hidden_size=1152, intermediate_size=4304)


def test_reserve_grows_with_the_step_and_the_budget_is_what_is_left() -> None:
    rng = np.random.default_rng()
    tokens = int(rng.integers(16, 16384))
    small = memory_plan.step_reserve_bytes(TEXT_9B, tokens, 8, 2)
    assert memory_plan.step_reserve_bytes(TEXT_9B, 2 * tokens, 8, 2) > small
    assert memory_plan.step_reserve_bytes(TEXT_9B, tokens, 64, 2) > small
    vision = memory_plan.vision_reserve_bytes(VISION_9B, 2)
    assert vision > memory_plan.vision_reserve_bytes(VISION_9B, 2, patches=1000) > 0
    assert memory_plan.vision_reserve_bytes(None, 2) == 0
    after = int(rng.integers(50, 120)) * GIB
    b = memory_plan.default_cache_budget(140 * GIB, after, 2 * GIB, small, vision)
    assert b.nbytes == after - (2 * GIB + small + vision + memory_plan.MARGIN_BYTES) == after - b.reserve_bytes
    tight = memory_plan.default_cache_budget(GIB, GIB // 2, 2 * GIB, small, vision)  # reserve > what is left
    assert tight.nbytes == tight.reserve_bytes == GIB // 4  # the reserve takes at most half
    assert memory_plan.default_cache_budget(GIB, 0, 2 * GIB, small, vision).nbytes == 0


def test_9b_on_an_h200_gets_most_of_the_card_and_fits_its_state_slots() -> None:
    # H200: 0.85 of ~140 GiB free, 9B bf16 weights + tower ~19 GiB; 128 state slots of 9B take 6.3 GiB
    step = memory_plan.step_reserve_bytes(TEXT_9B, 8192, 64, 2)
    b = memory_plan.default_cache_budget(119 * GIB, 100 * GIB, 2 * GIB, step,
                                         memory_plan.vision_reserve_bytes(VISION_9B, 2))
    assert 85 * GIB < b.nbytes < 100 * GIB
    assert b.nbytes > 128 * 49_152 * 1024  # state slots of 9B (runner_rules.state_bytes_per_slot: ~48 MiB each)

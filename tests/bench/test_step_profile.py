"""bench/step_profile.py on an engine that launches steps (lookahead, the reference runner with runner sampling and
launches switched on): every step that ran something is recorded, with its runner time and what it ran."""
from __future__ import annotations

import numpy as np
from step_profile import StepProfile

from gpu_engine.engine import Engine
from gpu_engine.engine_config import EngineConfig
from gpu_engine.params import SamplingParams
from gpu_engine.speculative import SpeculativeConfig
from gpu_engine.tiny import make_tiny_checkpoint
from tests.bench import _paths  # noqa: F401  (bench/ on sys.path)


def test_launched_steps_are_recorded_with_their_runner_time_and_rows(tmp_path) -> None:
    eng = Engine.from_pretrained(make_tiny_checkpoint(tmp_path / "m", seed=9),
                                 config=EngineConfig(max_num_seqs=4, block_size=8),
                                 speculative=SpeculativeConfig(num_tokens=0))
    eng.runner.samples_on_device = eng.runner.supports_lookahead = eng.lookahead.enabled = True
    profile = StepProfile.attach(eng)
    rng = np.random.default_rng()
    eng.generate([rng.integers(3, 1000, 12).tolist() for _ in range(3)], SamplingParams(max_tokens=6, ignore_eos=True))
    profile.detach()
    stats = eng.stats()
    assert stats["lookahead_steps"] > 0
    assert 0 < len(profile.steps) <= stats["steps"]
    assert all(r.forward_s > 0 for r in profile.steps)
    decode_rows = sum(len(r.shape.decode_contexts) for r in profile.steps)
    assert decode_rows >= 3 * 5  # every decode row of the lookahead launches is in some step's shape

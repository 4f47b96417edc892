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


class _Clock:
    """A fake CUDA event: a point on the device's timeline in ms (event - event gives ms, like cuda.core's)."""

    def __init__(self, ms: float) -> None:
        self.ms = ms

    def __sub__(self, other: "_Clock") -> float:
        return self.ms - other.ms


def test_encode_spans_are_kept_apart_from_the_forward_spans() -> None:
    """Encodes return before the tower has run (staged uploads): their device time comes from their own events, and
    the step's device time adds both kinds of span."""
    from types import SimpleNamespace

    from step_profile import StepRecord

    rng = np.random.default_rng()
    fwd, enc = rng.uniform(1, 50, 3), rng.uniform(1, 50, 2)
    profile = StepProfile(SimpleNamespace(runner=SimpleNamespace()))
    rec = StepRecord(events=[(_Clock(0.0), _Clock(x)) for x in fwd],
                     encode_events=[(_Clock(10.0), _Clock(10.0 + x)) for x in enc])
    profile.steps.append(rec)
    profile.resolve()
    assert rec.encode_device_s is not None and rec.device_s is not None
    assert abs(rec.encode_device_s - enc.sum() / 1e3) < 1e-12
    assert abs(rec.device_s - (fwd.sum() + enc.sum()) / 1e3) < 1e-12
    assert rec.events == [] and rec.encode_events == []

"""spec_cost_bench on the CPU (reference runner, tiny model): decode steps, verify windows and all-rejected windows
with their rollbacks through forward(), per rollback strategy (the end-to-end rows: test_spec_e2e_bench)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import spec_cost_bench as scb

from gpu_engine.engine import Engine
from gpu_engine.engine_config import EngineConfig
from gpu_engine.runner_api import CacheSpec
from gpu_engine.speculative import SpeculativeConfig
from gpu_engine.tiny import make_tiny_checkpoint


def test_step_costs_time_decode_verify_and_rejected_windows(tmp_path: Path, monkeypatch: Any) -> None:
    eng = Engine.from_pretrained(make_tiny_checkpoint(tmp_path / "m", seed=2))
    runner = eng.runner
    runner.allocate_cache(CacheSpec(num_kv_blocks=2 * 64, block_size=16, num_state_slots=3))
    monkeypatch.setattr(scb, "CONTEXT", 12)
    out = scb.step_costs(runner, eng.vocab_size, (1, 2), np.random.default_rng(0), scb.Clock(60), reps=4)
    for b in (1, 2):
        assert out[f"b{b}_decode_ms"] > 0 and out[f"b{b}_verify{scb.K + 1}_reject_all_ms"] > 0
        assert all(out[f"b{b}_verify{n}_over_decode"] > 0 for n in scb.WINDOWS)


def test_main_runs_every_part_and_writes_json(tmp_path: Path, monkeypatch: Any) -> None:
    import json

    from gpu_engine.config import ModelConfig

    folder = make_tiny_checkpoint(tmp_path / "m", seed=5)
    eng = Engine.from_pretrained(folder)
    monkeypatch.setattr(scb, "build_runner", lambda shape: (eng.runner, ModelConfig.from_pretrained(folder)))
    monkeypatch.setattr(scb, "BATCHES", (1, 2))
    monkeypatch.setattr(scb, "CONTEXT", 12)
    out = tmp_path / "r.json"
    assert scb.main(["--shape", "tiny", "--json", str(out), "--deadline-s", "100"]) == 0
    result = json.loads(out.read_text())
    for strategy in ("recompute", "window"):
        assert "error" not in result[f"steps_{strategy}"] and "b2_decode_ms" in result[f"steps_{strategy}"]


def test_a_shape_that_does_not_fit_falls_back_to_a_smaller_class() -> None:
    gib = 1 << 30
    need = {name: sum(scb.sizes(name)) for name in scb.FALLBACK}
    assert need["27b"] > need["9b"] > need["2b"] and 50 * gib < need["27b"] < 90 * gib
    assert scb.fitting_shape("27b", 139 * gib) == "27b"
    assert scb.fitting_shape("27b", need["27b"] - 1) == "9b"
    assert scb.fitting_shape("27b", 21 * gib) == "2b"  # the shared card of session 7 had 21.8 GB free
    assert scb.fitting_shape("27b", 1 * gib) == "27b"  # nothing fits: the runner says why

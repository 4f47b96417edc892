"""spec_cost_bench's two parts on the CPU (reference runner, tiny model): the step-cost part runs decode steps,
verify windows and all-rejected windows with their rollbacks through forward(); the end-to-end part's speculative
runs give the plain run's tokens (the reference runner is exact) and report speed-ups and acceptance."""
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


def test_e2e_rows_report_speedups_with_plain_outputs(tmp_path: Path, monkeypatch: Any) -> None:
    folder = make_tiny_checkpoint(tmp_path / "m", seed=4)
    monkeypatch.setattr(scb, "PROMPT", 8)
    base = Engine.from_pretrained(folder)

    def make_engine(max_step_tokens: int) -> Engine:
        return Engine(base.runner, base.tokenizer, vocab_size=base.vocab_size,
                      config=EngineConfig(max_num_seqs=2, block_size=4),
                      speculative=SpeculativeConfig(num_tokens=scb.K, max_step_tokens=max_step_tokens))

    out = scb.e2e_rows(make_engine, base.vocab_size, (1, 2), 12, np.random.default_rng(0), scb.Clock(120), seed=1)
    for b in (1, 2):
        assert out[f"b{b}_plain_tok_s"] > 0 and out[f"b{b}_plain_repeatable"]
        for a in scb.ACCEPTANCE:
            assert out[f"b{b}_a{a}_identical_requests"] == f"{b}/{b}"
            assert 0 < out[f"b{b}_a{a}_acceptance_rate"] <= 1 and out[f"b{b}_a{a}_mean_accepted_length"] > 1
    assert out["b2_auto_off_over_plain"] > 0


def test_main_runs_every_part_and_writes_json(tmp_path: Path, monkeypatch: Any) -> None:
    import json

    from gpu_engine.config import ModelConfig

    folder = make_tiny_checkpoint(tmp_path / "m", seed=5)
    eng = Engine.from_pretrained(folder)
    monkeypatch.setattr(scb, "build_runner", lambda shape: (eng.runner, ModelConfig.from_pretrained(folder)))
    monkeypatch.setattr(scb, "BATCHES", (1, 2))
    monkeypatch.setattr(scb, "CONTEXT", 12)
    monkeypatch.setattr(scb, "PROMPT", 8)
    out = tmp_path / "r.json"
    assert scb.main(["--shape", "tiny", "--json", str(out), "--deadline-s", "100", "--max-tokens", "8"]) == 0
    result = json.loads(out.read_text())
    for strategy in ("recompute", "window"):
        assert "error" not in result[f"steps_{strategy}"] and "b2_decode_ms" in result[f"steps_{strategy}"]
        assert result[f"e2e_{strategy}"]["b1_a0.9_identical_requests"] == "1/1"


def test_a_shape_that_does_not_fit_falls_back_to_a_smaller_class() -> None:
    gib = 1 << 30
    need = {name: sum(scb.sizes(name)) for name in scb.FALLBACK}
    assert need["27b"] > need["9b"] > need["2b"] and 50 * gib < need["27b"] < 90 * gib
    assert scb.fitting_shape("27b", 139 * gib) == "27b"
    assert scb.fitting_shape("27b", need["27b"] - 1) == "9b"
    assert scb.fitting_shape("27b", 21 * gib) == "2b"  # the shared card of session 7 had 21.8 GB free
    assert scb.fitting_shape("27b", 1 * gib) == "27b"  # nothing fits: the runner says why

"""spec_e2e_bench on the CPU (reference runner, tiny model): the confident target's greedy choice survives a
perturbation of the numerics that flips the random model's (its weights rounded to bf16: larger than a verify
step's batch-shape rounding), with margins of several nats; the bench's rows run end to end, every speculative run
gives the plain run's tokens and the acceptance follows the corruption."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import spec_e2e_bench as se

from gpu_engine.cuda.bf16 import f32_to_bf16_bits, round_to_bf16
from gpu_engine.engine import Engine
from gpu_engine.engine_config import EngineConfig
from gpu_engine.loader import ModelWeights
from gpu_engine.params import SamplingParams
from gpu_engine.reference.runner import ReferenceRunner
from gpu_engine.tiny import make_tiny_checkpoint


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    return Engine.from_pretrained(make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "m", seed=4))


def plain_weights(eng: Engine) -> ModelWeights:
    w = eng.runner.weights  # type: ignore[attr-defined]
    return ModelWeights(text=dict(w.text), vision={}, lm_head=np.asarray(w.lm_head))


def bf16_rounded(w: ModelWeights) -> ModelWeights:
    text = {k: round_to_bf16(np.asarray(v, np.float32)) for k, v in w.text.items()}
    return ModelWeights(text=text, vision={}, lm_head=round_to_bf16(np.asarray(w.lm_head, np.float32)))


def greedy(base: Engine, weights: ModelWeights) -> tuple[list[list[int]], list[float]]:
    eng = Engine(ReferenceRunner(base.runner.config, weights), base.tokenizer,  # type: ignore[attr-defined]
                 vocab_size=base.vocab_size, config=EngineConfig(max_num_seqs=4, block_size=4))
    prompts = [np.random.default_rng(i).integers(3, 2000, 8).tolist() for i in range(4)]
    outs = eng.generate(prompts, SamplingParams(max_tokens=48, ignore_eos=True, speculative="off", logprobs=True,
                                                top_logprobs=2))
    return [o.token_ids for o in outs], [t.top[0][1] - t.top[1][1] for o in outs for t in o.logprobs or []]


def test_the_confident_target_keeps_its_greedy_choice_where_the_random_one_flips(base: Engine) -> None:
    random = plain_weights(base)
    tokens, margins = greedy(base, random)
    assert greedy(base, bf16_rounded(random))[0] != tokens  # near-ties: rounding picks other tokens
    assert se.margin_stats(margins)["below_1_nat"] > 0.5
    confident = se.confident_weights(random, base.runner.config.text.hidden_size)  # type: ignore[attr-defined]
    tokens, margins = greedy(base, confident.weights)
    assert greedy(base, bf16_rounded(confident.weights))[0] == tokens
    stats = se.margin_stats(margins)
    assert stats["min"] > 5.0 and stats["below_1_nat"] == 0.0
    for name, w in random.text.items():  # same names, shapes and dtypes
        assert confident.weights.text[name].shape == w.shape and confident.weights.text[name].dtype == w.dtype
    assert confident.weights.lm_head.shape == random.lm_head.shape


def test_bf16_bits_scale_by_a_power_of_two_exactly() -> None:
    x = np.random.default_rng(0).standard_normal((300, 7)).astype(np.float32) * 0.02
    x[0, 0] = 0.0
    bits = f32_to_bf16_bits(x)
    got = se._f32(se._times_pow2(bits, 16))
    assert np.array_equal(got, round_to_bf16(x) * np.float32(2.0 ** 16))
    with pytest.raises(ValueError):
        se._times_pow2(bits, 200)


def test_corruption_gives_the_engine_rate_aimed_at() -> None:
    assert se.corruption(0.7, 1) == pytest.approx(0.3)
    a = 1.0 - se.corruption(0.7, 3)
    assert (a + a * a + a ** 3) / 3 == pytest.approx(0.7) and 0.82 < a < 0.84


@pytest.mark.parametrize("on_device", [False, True])
def test_main_measures_rows_on_the_reference_runner(base: Engine, tmp_path: Path, monkeypatch: Any,
                                                    on_device: bool) -> None:
    confident = se.confident_weights(plain_weights(base), base.runner.config.text.hidden_size)  # type: ignore
    runner = ReferenceRunner(base.runner.config, confident.weights)  # type: ignore[attr-defined]
    # on_device: the CUDA runner's path (sampling on the runner, lookahead launches, auto's whole-step rule)
    runner.samples_on_device = runner.supports_lookahead = on_device  # type: ignore[misc]
    monkeypatch.setattr(se, "build", lambda shape: (runner, base.runner.config, confident, shape))  # type: ignore
    monkeypatch.setattr(se, "BATCHES", (1, 2))
    monkeypatch.setattr(se, "PROMPT", 8)
    monkeypatch.setattr(se, "MAX_TOKENS", 24)
    monkeypatch.setattr(se, "E2E_BLOCKS", 64)
    out = tmp_path / "r.json"
    assert se.main(["--shape", "tiny", "--json", str(out), "--deadline-s", "200"]) == 0
    result = json.loads(out.read_text())
    assert "error" not in result
    rec = result["recording"]
    assert rec["b1_k3_plain_repeatable"] and rec["b2_k3_margin_nats"]["min"] > 5.0
    rows = result["rows"]
    assert {(r["batch"], r["k"]) for r in rows} == {(1, 3), (2, 3), (1, 1), (2, 1), (1, 2), (2, 2)}
    assert all(r["identical_requests"] == f"{r['batch']}/{r['batch']}" and r["tok_s"] > 0 for r in rows)
    named = [r for r in rows if r["drafter"] == "replay" and r["rule"] == "target" and r["k"] == 3]
    rates = [r["acceptance_rate"] for r in sorted(named, key=lambda r: r["aim"])]
    assert len(named) == 6 and all(0 < x <= 1 for x in rates)
    assert any(r["drafter"] == "auto" for r in rows) and any(r["rule"] == "alpha" for r in rows)
    assert "2**" in result["info"]["target"] and result["info"]["auto_max_step_tokens"] == 128

"""spec_e2e_bench on the CPU (reference runner, tiny model): the confident target's greedy choice survives a
perturbation of the numerics that flips the random model's (its weights rounded to bf16: larger than a verify
step's batch-shape rounding), with margins of several nats; the bench's rows run end to end, every speculative run
gives the plain run's tokens and the acceptance follows the corruption. --quantize fp8: fp8_weights quantises what
quantize="fp8" at load does, bit for bit (equal tensors once); the confident model quantised keeps its greedy tokens
and margins on the reference runner emulating the FP8 kernels' activation quantisation, and its goals' rows run."""
from __future__ import annotations

import json
from dataclasses import replace
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
from gpu_engine.tensors import Fp8Tensor, StoredTensor, Tensors
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


def for_reference(w: ModelWeights) -> ModelWeights:
    """fp8_weights' plain dict as the reference runner reads block-FP8 weights: a Tensors, dequantised on read."""
    entries = {n: v if isinstance(v, Fp8Tensor) else StoredTensor("F32", np.asarray(v, np.float32))
               for n, v in w.text.items()}
    return ModelWeights(text=Tensors(entries), vision={}, lm_head=np.asarray(w.lm_head))


def reference(base: Engine, weights: ModelWeights) -> ReferenceRunner:
    """The reference runner; for FP8 weights emulating the kernels' activation quantisation too."""
    config = base.runner.config  # type: ignore[attr-defined]
    if any(isinstance(v, Fp8Tensor) for v in weights.text.values()):
        return ReferenceRunner(config, for_reference(weights), fp8_activations=True)
    return ReferenceRunner(config, weights)


def greedy(base: Engine, weights: ModelWeights) -> tuple[list[list[int]], list[float]]:
    eng = Engine(reference(base, weights), base.tokenizer,
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


def test_fp8_weights_quantise_as_the_loader_does(base: Engine, tmp_path: Path) -> None:
    folder = make_tiny_checkpoint(tmp_path / "m", seed=4)
    loaded = Engine.from_pretrained(folder, quantize="fp8").runner.weights.text  # type: ignore[attr-defined]
    plain = plain_weights(base)
    ours = se.fp8_weights(plain)
    quantised = {n for n, v in ours.text.items() if isinstance(v, Fp8Tensor)}
    assert quantised == set(loaded.fp8_names()) and quantised
    for name in quantised:
        want, got = loaded.fp8(name), ours.text[name]
        assert np.array_equal(got.bits, want.bits) and np.array_equal(got.scale_inv, want.scale_inv), name
    assert all(ours.text[n] is plain.text[n] for n in plain.text if n not in quantised)
    assert ours.lm_head is plain.lm_head
    # equal content: one Fp8Tensor, the same as quantising each
    name = sorted(quantised)[0]
    same = dict(plain.text)
    other = name.replace(".weight", "_copy.weight")
    same[other] = np.array(plain.text[name])
    got = se.fp8_weights(ModelWeights(text=same, vision={}, lm_head=plain.lm_head)).text
    assert got[other] is got[name] and np.array_equal(got[name].bits, ours.text[name].bits)


def test_the_confident_target_quantised_to_fp8_keeps_its_greedy_choice(base: Engine) -> None:
    confident = se.confident_weights(plain_weights(base), base.runner.config.text.hidden_size)  # type: ignore
    tokens, _ = greedy(base, confident.weights)
    fp8_tokens, margins = greedy(base, se.fp8_weights(confident.weights))
    assert fp8_tokens == tokens
    stats = se.margin_stats(margins)
    assert stats["min"] > 5.0 and stats["below_1_nat"] == 0.0


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
    monkeypatch.setattr(se, "build", lambda shape, q: (runner, base.runner.config, confident, shape))  # type: ignore
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


def test_main_fp8_goal_rows_on_the_reference_runner(base: Engine, tmp_path: Path, monkeypatch: Any) -> None:
    confident = se.confident_weights(plain_weights(base), base.runner.config.text.hidden_size)  # type: ignore
    built: list[str] = []

    def build(shape: str, quantize: str) -> tuple[Any, ...]:
        built.append(quantize)
        target = replace(confident, weights=se.fp8_weights(confident.weights))  # as se.build does
        runner = reference(base, target.weights)
        runner.samples_on_device = runner.supports_lookahead = True  # type: ignore[misc]
        return runner, base.runner.config, target, shape  # type: ignore[attr-defined]

    monkeypatch.setattr(se, "build", build)
    monkeypatch.setattr(se, "BATCHES", (1, 2, 3))
    monkeypatch.setattr(se, "PROMPT", 8)
    monkeypatch.setattr(se, "MAX_TOKENS", 24)
    monkeypatch.setattr(se, "E2E_BLOCKS", 64)
    out = tmp_path / "r.json"
    assert se.main(["--shape", "tiny", "--json", str(out), "--quantize", "fp8", "--rows", "goals"]) == 0
    assert built == ["fp8"]
    result = json.loads(out.read_text())
    assert "error" not in result and result["info"]["quantize"] == "fp8" and "FP8" in result["info"]["target"]
    rec = result["recording"]
    assert set(rec) == {"b1_k3_margin_nats", "b1_k3_plain_repeatable", "b3_k3_margin_nats", "b3_k3_plain_repeatable"}
    assert rec["b1_k3_margin_nats"]["below_1_nat"] == 0.0 and rec["b3_k3_margin_nats"]["min"] > 5.0
    rows = result["rows"]
    got = sorted((r["batch"], r["drafter"], r["rule"], r["aim"]) for r in rows)
    assert got == [(1, "replay", "alpha", 0.7), (1, "replay", "target", 0.5), (1, "replay", "target", 0.7),
                   (1, "replay", "target", 0.9), (3, "auto", "target", 0.7)]
    assert all(r["quantize"] == "fp8" and r["k"] == 3 and r["identical_requests"] == f"{r['batch']}/{r['batch']}"
               for r in rows)
    assert "fp8" in se.table(result)


def test_the_deadline_clock_has_one_home() -> None:
    import spec_cost_bench

    assert se.Clock is spec_cost_bench.Clock  # spec_e2e_bench kept its own copy of the class

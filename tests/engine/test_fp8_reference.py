"""The reference runner on block-FP8 models: exact dequantisation, the activation-quantisation emulation, and the
whole tiny FP8 model against the BF16 model it was quantised from.

Tolerance of FP8 vs BF16 (the tiny random model, 64 text positions): relative L2 of all logits <= 0.5, with FP8
weights and with the activations quantised too, and the same top-1 token at >= 50% of positions. Measured over
seeds 0-29: mean 0.17 / max 0.33 with FP8 weights, mean 0.21 / max 0.34 with FP8 activations too, top-1 >= 61%.
This random model amplifies weight noise about 7x (random 3% relative noise on the same Linears moves its logits
19%), and e4m3 rounding is 2.6% relative per weight. The exact checks below carry the correctness; this one bounds
the damage FP8 does and catches a mis-scaled block (that is off by far more than 1).
"""
from __future__ import annotations

import numpy as np
import pytest
from fp8_truth import dequantize64, fake_quantize64

import gpu_engine
from gpu_engine import fp8
from gpu_engine.reference import ops
from gpu_engine.tiny import make_tiny_checkpoint, write_safetensors, write_sums
from gpu_engine.tiny_fp8 import make_tiny_fp8_checkpoint


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    seed = int(np.random.default_rng().integers(1000))
    root = tmp_path_factory.mktemp("pair")
    bf16 = make_tiny_checkpoint(root / "bf16", seed=seed, dtype="bfloat16")
    return bf16, make_tiny_fp8_checkpoint(root / "fp8", seed=seed)


def ids(n: int) -> np.ndarray:
    return np.random.default_rng().integers(0, 250, size=n)  # text ids, clear of the vision specials


def test_fp8_linear_with_activation_emulation_matches_float64():
    rng = np.random.default_rng()
    w = rng.standard_normal((300, 200)).astype(np.float32) * 0.1
    bits, scale_inv = fp8.quantize(w)
    weight = fp8.dequantize(bits, scale_inv)
    x = rng.standard_normal((7, 200)).astype(np.float32) * 3
    want = fake_quantize64(x) @ dequantize64(bits, scale_inv).T
    got = ops.linear(x, weight.view(ops.Fp8InputWeight))
    assert type(got) is np.ndarray and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * np.abs(want).max())
    plain = ops.linear(x, weight)  # untagged: the exact input times the dequantised weight
    np.testing.assert_allclose(plain, x.astype(np.float64) @ dequantize64(bits, scale_inv).T, rtol=2e-5,
                               atol=2e-5 * np.abs(want).max())
    assert np.abs(got - plain).max() > 1e-4 * np.abs(plain).max()  # the emulation does something


def test_fp8_model_is_exactly_the_model_of_its_dequantised_weights(pair, tmp_path):
    """Write the dequantised FP8 weights (and the BF16 rest) as a float32 checkpoint: same logits, bit for bit."""
    _, fp8_dir = pair
    model = gpu_engine.load(fp8_dir)
    w = model.runner.weights
    dense = tmp_path / "dense"
    make_tiny_checkpoint(dense, seed=0)  # tokenizer, configs; weights replaced below
    tensors = {"model.language_model." + n: np.array(w.text[n]) for n in w.text}
    tensors.update({"model.visual." + n: np.array(w.vision[n]) for n in w.vision})
    tensors["lm_head.weight"] = np.array(w.lm_head)
    write_safetensors(dense / "model.safetensors", tensors)
    write_sums(dense)
    for name in w.text.fp8_names():  # what went in really is the exact float64 dequantisation
        t = w.text.fp8(name)
        np.testing.assert_array_equal(tensors["model.language_model." + name],
                                      dequantize64(t.bits, t.scale_inv).astype(np.float32))
    prompt = ids(40)
    np.testing.assert_array_equal(model.logits(prompt), gpu_engine.load(dense).logits(prompt))


@pytest.mark.parametrize("emulate", [False, True])
def test_fp8_model_stays_near_the_bf16_model_it_came_from(pair, emulate):
    bf16_dir, fp8_dir = pair
    prompt = ids(64)
    want = gpu_engine.load(bf16_dir).logits(prompt)
    got = gpu_engine.load(fp8_dir, fp8_activations=emulate).logits(prompt)
    assert rel(got, want) <= 0.5
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.5


def test_activation_emulation_quantises_the_input_of_every_fp8_linear_once(pair, monkeypatch):
    _, fp8_dir = pair
    model = gpu_engine.load(fp8_dir, fp8_activations=True)
    calls: list[tuple[int, ...]] = []

    def counting(x, group=fp8.GROUP):
        calls.append(x.shape)
        return fp8.fake_quantize_activations(x, group)

    monkeypatch.setattr(ops, "fake_quantize_activations", counting)
    model.logits(ids(5))
    assert len(calls) == len(model.runner.weights.fp8_names()) == 25  # lm_head and in_proj_a/b are not FP8
    assert all(shape[0] == 5 for shape in calls)


def test_quantize_at_load_runs_and_equals_the_official_layout_with_f32_scales(tmp_path):
    seed = int(np.random.default_rng().integers(1000))
    bf16 = make_tiny_checkpoint(tmp_path / "bf16", seed=seed, dtype="bfloat16")
    official = make_tiny_fp8_checkpoint(tmp_path / "fp8", seed=seed, scale_dtype="F32")
    prompt = ids(20)
    at_load = gpu_engine.load(bf16, quantize="fp8", fp8_activations=True)
    np.testing.assert_array_equal(at_load.logits(prompt),
                                  gpu_engine.load(official, fp8_activations=True).logits(prompt))
    assert at_load.fingerprint != gpu_engine.load(bf16).fingerprint
    assert at_load.generate(prompt, max_tokens=3) == gpu_engine.load(official, fp8_activations=True).generate(
        prompt, max_tokens=3)

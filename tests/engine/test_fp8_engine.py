"""Engine.from_pretrained(quantize=...): the option reaches the loader (the engine computes with the FP8 weights and
records the at-load fingerprint), and a value other than None / "fp8" is refused by name before a file is read."""
from __future__ import annotations

import numpy as np
import pytest

import gpu_engine
from gpu_engine.engine import Engine
from gpu_engine.fp8_checkpoint import QUANTIZE_VARIANT
from gpu_engine.model import LoadedModel
from gpu_engine.params import SamplingParams
from gpu_engine.tiny import make_tiny_checkpoint
from gpu_engine.tiny_fp8 import make_tiny_fp8_checkpoint


@pytest.fixture(scope="module")
def bf16(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("bf16"), seed=5, dtype="bfloat16")


def _logits_of(engine: Engine, folder, ids: np.ndarray) -> np.ndarray:
    """The engine's own runner driven by the one-sequence helper (its weights, not a fresh load's); the engine is
    not usable afterwards (its cache was re-allocated)."""
    probe = LoadedModel(config=gpu_engine.load(folder).config, fingerprint=engine.model_fingerprint, path=folder,
                        runner=engine.runner)
    return probe.logits(ids)


def test_quantize_fp8_reaches_the_loader(bf16):
    ids = np.arange(3, 40)
    plain = Engine.from_pretrained(bf16)
    at_load = Engine.from_pretrained(bf16, quantize="fp8")
    oracle = gpu_engine.load(bf16, quantize="fp8")
    # the fingerprint says in words what was done, and is not the BF16 checkpoint's
    assert at_load.model_fingerprint == oracle.fingerprint
    assert at_load.model_fingerprint.endswith("+" + QUANTIZE_VARIANT)
    assert at_load.model_fingerprint.split("+")[0] != plain.model_fingerprint
    assert len(plain.model_fingerprint) == 64 and "+" not in plain.model_fingerprint
    assert at_load.stats()["model_fingerprint"] == oracle.fingerprint
    # and the engine computes with the FP8 weights: it generates the quantised model's tokens, and its runner gives
    # that model's logits exactly (probed last: the probe re-sizes the runner's cache under the engine)
    [out] = at_load.generate(list(ids), SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert out.token_ids == oracle.generate(list(ids), max_tokens=4, stop_token_ids=[])
    fp8_logits = _logits_of(at_load, bf16, ids)
    np.testing.assert_array_equal(fp8_logits, oracle.logits(ids))
    assert not np.array_equal(fp8_logits, _logits_of(plain, bf16, ids))


def test_an_fp8_checkpoint_is_used_as_it_is(tmp_path):
    folder = make_tiny_fp8_checkpoint(tmp_path / "fp8", seed=2)
    stored = Engine.from_pretrained(folder)
    asked = Engine.from_pretrained(folder, quantize="fp8")
    assert asked.model_fingerprint == stored.model_fingerprint == gpu_engine.load(folder).fingerprint
    assert "+" not in stored.model_fingerprint  # its files are the FP8 model: nothing was done at load


@pytest.mark.parametrize("value", ["fp9", "FP8", "none", "", 8])
def test_unknown_quantize_is_refused_by_name_before_reading(value, tmp_path):
    missing = tmp_path / "no-such-checkpoint"  # a file read would fail differently
    for build in (lambda: Engine.from_pretrained(missing, quantize=value),
                  lambda: gpu_engine.load(missing, quantize=value)):
        got = repr(value).replace("'", ".")
        with pytest.raises(ValueError, match=r"quantize must be None .* or 'fp8' .*got " + got):
            build()

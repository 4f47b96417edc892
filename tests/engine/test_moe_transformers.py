"""Reference runner (numpy) vs transformers' Qwen3_5MoeForConditionalGeneration on text, three tiny MoE configs.

Tolerances as the dense parity tests (engine_hf_models.assert_logit_parity; test_engine_text_parity says why):
relative L2 error of the logits <= 1e-4 over all positions, and at every position <= 1e-4 or within float32 noise
of a float64 transformers run. Greedy generations are token-identical. transformers saves the model in both expert
layouts (its default save_pretrained: one tensor per expert; save_original_format=False: fused); both give the
same logits here, and transformers reads our tiny MoE writer's folders (both layouts, float32 and bfloat16) with the
logits we compute.
"""
from __future__ import annotations

import shutil

import numpy as np
import pytest
from ci_rule import require_module

torch = require_module("torch")
require_module("transformers")

from engine_hf_models import assert_logit_parity, float64_copy, float64_logits, rel_err
from moe_hf_models import MOE_HF_CONFIGS, build_hf_moe_checkpoint

import gpu_engine
from gpu_engine.reference.moe import MoeMlp
from gpu_engine.tiny_moe import make_tiny_moe_checkpoint, to_per_expert_layout

torch.set_num_threads(1)


@pytest.fixture(scope="module", params=sorted(MOE_HF_CONFIGS))
def pair(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    fused = tmp_path_factory.mktemp(request.param + "-fused")
    hf = build_hf_moe_checkpoint(request.param, folder, seed=sorted(MOE_HF_CONFIGS).index(request.param) + 20,
                                 fused=fused)
    return hf, gpu_engine.load(folder), fused


def text_ids(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 250, size=n)  # below the special vision ids


def hf_logits(hf, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return hf(input_ids=torch.from_numpy(ids)[None]).logits[0].numpy()


def test_logits_match_transformers_at_every_position(pair):
    hf, ours, _ = pair
    ids = text_ids(90, seed=1)
    got = ours.logits(ids)
    assert got.dtype == np.float32
    assert isinstance(ours.runner.text.mlps[0], MoeMlp)
    hf64 = float64_logits(float64_copy(hf), input_ids=torch.from_numpy(ids)[None])
    assert_logit_parity(got, hf_logits(hf, ids), hf64)


def test_routing_matches_transformers_router(pair):
    """The experts each token picks and their weights, layer 0, against Qwen3_5MoeTopKRouter on the same input."""
    hf, ours, _ = pair
    x = np.random.default_rng(2).standard_normal((40, ours.config.text.hidden_size)).astype(np.float32)
    chosen, weights = ours.runner.text.mlps[0].route(x)
    with torch.no_grad():
        _, scores, indices = hf.model.language_model.layers[0].mlp.gate(torch.from_numpy(x))
    np.testing.assert_array_equal(chosen, indices.numpy())
    np.testing.assert_allclose(weights, scores.numpy(), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(weights.sum(axis=-1), 1.0, rtol=1e-6)


def test_greedy_generation_is_token_identical(pair):
    hf, ours, _ = pair
    ids = text_ids(17, seed=3)
    with torch.no_grad():
        out = hf.generate(input_ids=torch.from_numpy(ids)[None], max_new_tokens=20, do_sample=False)
    expected = out[0, ids.size:].tolist()
    assert len(expected) == 20
    assert ours.generate(ids, max_tokens=20) == expected
    assert ours.generate(ids.tolist(), max_tokens=20, chunk_size=5) == expected


@pytest.mark.parametrize("chunk", [1, 7])
def test_chunked_prefill_equals_whole(pair, chunk):
    _, ours, _ = pair
    ids = text_ids(40, seed=4)
    assert rel_err(ours.logits(ids, chunk_size=chunk), ours.logits(ids)) <= 1e-5


def test_transformers_fused_save_gives_the_same_logits(pair, tmp_path):
    """The fused save, and our conversion of it back to one tensor per expert, give the per-expert save's logits."""
    hf, ours, fused_folder = pair
    assert any(".experts.0.gate_proj.weight" in n for n in ours.runner.weights.text)
    fused = gpu_engine.load(fused_folder)
    assert any(n.endswith(".experts.gate_up_proj") for n in fused.runner.weights.text)
    assert fused.fingerprint != ours.fingerprint  # other files, other fingerprint
    ids = text_ids(30, seed=5)
    np.testing.assert_array_equal(fused.logits(ids), ours.logits(ids))  # the same numbers in the same order
    converted = shutil.copytree(fused_folder, tmp_path / "converted")
    to_per_expert_layout(converted)
    again = gpu_engine.load(converted)
    assert again.fingerprint == ours.fingerprint  # byte-identical to transformers' own per-expert file
    assert rel_err(again.logits(ids), hf_logits(hf, ids)) <= 1e-4


@pytest.mark.parametrize("layout", ["fused", "per_expert"])
def test_tiny_moe_checkpoint_loads_in_transformers_with_equal_logits(tmp_path, layout):
    from transformers import Qwen3_5MoeForConditionalGeneration

    for dtype in ("float32", "bfloat16"):
        folder = make_tiny_moe_checkpoint(tmp_path / dtype, seed=11, dtype=dtype, layout=layout)
        hf = Qwen3_5MoeForConditionalGeneration.from_pretrained(folder, dtype=torch.float32,
                                                                experts_implementation="eager").eval()
        ids = np.random.default_rng(12).integers(0, 1500, size=40)
        ours = gpu_engine.load(folder).logits(ids)
        assert_logit_parity(ours, hf_logits(hf, ids),
                            float64_logits(float64_copy(hf), input_ids=torch.from_numpy(ids)[None]))

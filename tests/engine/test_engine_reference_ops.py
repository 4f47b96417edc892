"""Reference building blocks vs transformers' own functions, and chunked DeltaNet vs recurrent DeltaNet."""
from __future__ import annotations

import numpy as np
import pytest
from ci_rule import require_module

from gpu_engine.reference.deltanet import causal_conv, chunked_gated_delta, recurrent_gated_delta
from gpu_engine.reference.ops import apply_rope, gated_rms_norm, l2norm, mrope_cos_sin, rms_norm, softplus


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


def random_delta_inputs(rng: np.random.Generator, n: int, heads: int = 3, dk: int = 8, dv: int = 5):
    q = l2norm(rng.standard_normal((n, heads, dk)).astype(np.float32)) * np.float32(dk**-0.5)
    k = l2norm(rng.standard_normal((n, heads, dk)).astype(np.float32))
    v = rng.standard_normal((n, heads, dv)).astype(np.float32)
    g = -rng.uniform(0.0, 3.0, size=(n, heads)).astype(np.float32)
    beta = rng.uniform(0.0, 1.0, size=(n, heads)).astype(np.float32)
    state = rng.standard_normal((heads, dk, dv)).astype(np.float32)
    return q, k, v, g, beta, state


@pytest.mark.parametrize("n,chunk", [(1, 64), (5, 64), (70, 64), (70, 16), (33, 1)])
def test_chunked_delta_rule_equals_recurrent(n, chunk):
    q, k, v, g, beta, state = random_delta_inputs(np.random.default_rng(n * 100 + chunk), n)
    out_r, s_r = recurrent_gated_delta(q, k, v, g, beta, state)
    out_c, s_c = chunked_gated_delta(q, k, v, g, beta, state, chunk=chunk)
    assert rel_err(out_c, out_r) <= 1e-5
    assert rel_err(s_c, s_r) <= 1e-5


def test_delta_rule_split_across_calls_equals_one_call():
    q, k, v, g, beta, state = random_delta_inputs(np.random.default_rng(1), 40)
    whole, s_whole = chunked_gated_delta(q, k, v, g, beta, state)
    first, s_mid = chunked_gated_delta(q[:13], k[:13], v[:13], g[:13], beta[:13], state)
    second, s_end = recurrent_gated_delta(q[13:], k[13:], v[13:], g[13:], beta[13:], s_mid)
    assert rel_err(np.concatenate([first, second]), whole) <= 1e-5
    assert rel_err(s_end, s_whole) <= 1e-5


def test_causal_conv_with_carried_state_equals_whole():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((20, 6)).astype(np.float32)
    w = rng.standard_normal((6, 4)).astype(np.float32)
    whole, _ = causal_conv(x, np.zeros((6, 3), np.float32), w)
    a, state = causal_conv(x[:7], np.zeros((6, 3), np.float32), w)
    b, state = causal_conv(x[7:8], state, w)
    c, _ = causal_conv(x[8:], state, w)
    assert rel_err(np.concatenate([a, b, c]), whole) <= 1e-6


# ---------------------------------------------------------------------------------------------- vs transformers

torch = require_module("torch")
qwen = require_module("transformers.models.qwen3_5.modeling_qwen3_5")


@pytest.mark.parametrize("n,initial", [(10, False), (130, True)])
def test_delta_rules_match_transformers_torch_versions(n, initial):
    rng = np.random.default_rng(3 + n)
    heads, dk, dv = 2, 8, 6
    q_raw = rng.standard_normal((n, heads, dk)).astype(np.float32)
    k_raw = rng.standard_normal((n, heads, dk)).astype(np.float32)
    v = rng.standard_normal((n, heads, dv)).astype(np.float32)
    g = -rng.uniform(0.0, 2.0, size=(n, heads)).astype(np.float32)
    beta = rng.uniform(0.0, 1.0, size=(n, heads)).astype(np.float32)
    state = (rng.standard_normal((heads, dk, dv)).astype(np.float32) if initial
             else np.zeros((heads, dk, dv), np.float32))
    t = lambda a: torch.from_numpy(a)[None]
    expected, exp_state = qwen.torch_chunk_gated_delta_rule(
        t(q_raw), t(k_raw), t(v), g=t(g), beta=t(beta), initial_state=torch.from_numpy(state)[None],
        output_final_state=True, use_qk_l2norm_in_kernel=True,
    )
    q = l2norm(q_raw) * np.float32(dk**-0.5)
    k = l2norm(k_raw)
    for rule in (chunked_gated_delta, recurrent_gated_delta):
        out, s = rule(q, k, v, g, beta, state)
        assert rel_err(out, expected[0].numpy()) <= 1e-5
        assert rel_err(s, exp_state[0].numpy()) <= 1e-5


def test_norms_and_softplus_match_transformers():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((7, 3, 16)).astype(np.float32)
    gate = rng.standard_normal((7, 3, 16)).astype(np.float32)
    w = (0.3 * rng.standard_normal(16)).astype(np.float32)
    norm = qwen.Qwen3_5RMSNorm(16, eps=1e-6)
    gnorm = qwen.Qwen3_5RMSNormGated(16, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.from_numpy(w))
        gnorm.weight.copy_(torch.from_numpy(1 + w))
        assert rel_err(rms_norm(x, w, 1e-6), norm(torch.from_numpy(x)).numpy()) <= 1e-6
        expected = gnorm(torch.from_numpy(x), torch.from_numpy(gate)).numpy()
        assert rel_err(gated_rms_norm(x, gate, 1 + w, 1e-6), expected) <= 1e-6
        z = np.linspace(-30, 30, 101, dtype=np.float32)
        assert rel_err(softplus(z), torch.nn.functional.softplus(torch.from_numpy(z)).numpy()) <= 1e-6


@pytest.mark.parametrize("head_dim,factor,section", [(16, 0.5, [2, 1, 1]), (24, 0.25, [1, 1, 1]), (32, 1.0, [8, 4, 4])])
def test_mrope_matches_transformers_rotary_embedding(head_dim, factor, section):
    from transformers import Qwen3_5TextConfig

    cfg = Qwen3_5TextConfig(
        hidden_size=64, num_attention_heads=4, head_dim=head_dim,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": factor,
                         "mrope_section": section, "mrope_interleaved": True},
    )
    rope = qwen.Qwen3_5TextRotaryEmbedding(cfg)
    rng = np.random.default_rng(6)
    n = 11
    positions = rng.integers(0, 500, size=(3, n))
    cos_t, sin_t = rope(torch.zeros(1, dtype=torch.float32), torch.from_numpy(positions)[:, None, :])
    cos, sin = mrope_cos_sin(positions, int(head_dim * factor), 10000.0, tuple(section))
    np.testing.assert_allclose(cos, cos_t[0].numpy(), atol=2e-6)
    np.testing.assert_allclose(sin, sin_t[0].numpy(), atol=2e-6)
    q = rng.standard_normal((n, 4, head_dim)).astype(np.float32)
    k = rng.standard_normal((n, 2, head_dim)).astype(np.float32)
    q_t, k_t = qwen.apply_rotary_pos_emb(
        torch.from_numpy(q).transpose(0, 1)[None], torch.from_numpy(k).transpose(0, 1)[None], cos_t, sin_t
    )
    assert rel_err(apply_rope(q, cos, sin), q_t[0].transpose(0, 1).numpy()) <= 1e-6
    assert rel_err(apply_rope(k, cos, sin), k_t[0].transpose(0, 1).numpy()) <= 1e-6

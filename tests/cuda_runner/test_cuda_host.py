"""CPU-side parts of the CUDA backend (no GPU needed): arena, bf16 conversion, module-cache keys, rotary tables,
and the float64 references the GPU checks rely on, compared against transformers' own Qwen3.5 functions."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from ci_rule import require_module

from gpu_engine.cuda import rotary
from gpu_engine.cuda.arena import ALIGN, Arena
from gpu_engine.cuda.bf16 import bf16_bits_to_f32, f32_to_bf16_bits
from gpu_engine.cuda.device import KERNEL_DIR, ModuleCache, expand_source
from gpu_engine.cuda.errors import ArenaExhausted
from tests.cuda_runner import references as ref

torch.set_num_threads(1)
qwen = require_module("transformers.models.qwen3_5.modeling_qwen3_5")


def test_arena_aligns_and_releases() -> None:
    arena = Arena(base=1 << 20, capacity=10_000)
    a = arena.alloc(10, "a")
    mark = arena.mark()
    b = arena.alloc(300, "b")
    assert a == 1 << 20 and b == a + ALIGN
    arena.release(mark)
    assert arena.alloc(1, "c") == b  # released space is reused
    with pytest.raises(ArenaExhausted, match="budget"):
        arena.alloc(20_000, "too-big")
    with pytest.raises(ValueError):
        arena.alloc(-1, "negative")
    with pytest.raises(ValueError):
        arena.release(99)


def test_bf16_round_trip_matches_torch() -> None:
    x = np.random.default_rng().standard_normal(10_000).astype(np.float32) * 100
    x[:3] = [np.inf, -np.inf, 0.0]
    ours = bf16_bits_to_f32(f32_to_bf16_bits(x))
    theirs = torch.from_numpy(x).to(torch.bfloat16).float().numpy()
    assert np.array_equal(ours, theirs)
    assert np.isnan(bf16_bits_to_f32(f32_to_bf16_bits(np.array([np.nan], np.float32))))[0]


def test_module_cache_key_covers_source_arch_options(tmp_path) -> None:
    base = ModuleCache.key("src", "sm_90", ("std=c++17",), "nvrtc-13.0")
    assert base != ModuleCache.key("src2", "sm_90", ("std=c++17",), "nvrtc-13.0")
    assert base != ModuleCache.key("src", "sm_80", ("std=c++17",), "nvrtc-13.0")
    assert base != ModuleCache.key("src", "sm_90", ("std=c++20",), "nvrtc-13.0")
    assert base != ModuleCache.key("src", "sm_90", ("std=c++17",), "nvrtc-13.1")
    cache = ModuleCache(tmp_path)
    assert cache.get(base) is None
    cache.put(base, b"\x7fELF")
    assert cache.get(base) == b"\x7fELF" and (cache.hits, cache.misses) == (1, 1)


def test_kernel_sources_inline_their_header() -> None:
    for path in KERNEL_DIR.glob("*.cu"):
        text = expand_source(path)
        assert "#include" not in text, path.name
        assert "from_f<bf16_t>" in text, path.name


def _hf_text_rope(rot_dim: int, section: list[int], theta: float, pos: np.ndarray):
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

    cfg = Qwen3_5TextConfig(head_dim=rot_dim * 2, rope_parameters={"rope_type": "default", "rope_theta": theta,
                                                                   "partial_rotary_factor": 0.5,
                                                                   "mrope_section": section})
    emb = qwen.Qwen3_5TextRotaryEmbedding(cfg)
    x = torch.zeros(1, dtype=torch.float32)
    cos, sin = emb(x, torch.from_numpy(pos)[:, None, :])
    return cos[0].numpy(), sin[0].numpy()


def test_mrope_reference_matches_transformers() -> None:
    rng = np.random.default_rng()
    n, heads, rot_dim, hd = 7, 2, 64, 128
    pos = np.stack([rng.integers(0, 3000, n), rng.integers(0, 50, n), rng.integers(0, 50, n)])
    cos, sin = _hf_text_rope(rot_dim, [11, 11, 10], 1e7, pos)
    x = rng.standard_normal((n, heads, hd)).astype(np.float32)
    q = torch.from_numpy(x).transpose(0, 1)[None]  # [1, heads, n, hd]
    hf, _ = qwen.apply_rotary_pos_emb(q, q, torch.from_numpy(cos)[None], torch.from_numpy(sin)[None])
    ours = ref.rope(x, pos, rotary.inv_freq(1e7, rot_dim), rotary.mrope_axis(rot_dim, (11, 11, 10)), rot_dim)
    np.testing.assert_allclose(ours, hf[0].transpose(0, 1).numpy(), rtol=1e-4, atol=1e-4)


def test_gated_delta_rule_reference_matches_transformers() -> None:
    rng = np.random.default_rng()
    n, kh, vh, dk, dv = 5, 2, 4, 16, 8
    q, k = rng.standard_normal((n, kh, dk)), rng.standard_normal((n, kh, dk))
    v, a, b = rng.standard_normal((n, vh, dv)), rng.standard_normal((n, vh)), rng.standard_normal((n, vh))
    A_log, dt_bias = np.log(rng.uniform(0.5, 4, vh)), rng.standard_normal(vh) * 0.5
    S0 = rng.standard_normal((vh, dk, dv)) * 0.3
    ours_o, ours_s = ref.gated_delta_rule(q, k, v, a, b, A_log, dt_bias, S0)
    T = lambda arr: torch.from_numpy(np.asarray(arr, np.float32))
    g = -T(A_log).exp() * torch.nn.functional.softplus(T(a) + T(dt_bias))
    rep = vh // kh
    hf_o, hf_s = qwen.torch_recurrent_gated_delta_rule(
        T(q).repeat_interleave(rep, 1)[None], T(k).repeat_interleave(rep, 1)[None], T(v)[None], g=g[None],
        beta=torch.sigmoid(T(b))[None], initial_state=T(S0)[None], output_final_state=True,
        use_qk_l2norm_in_kernel=True)
    np.testing.assert_allclose(ours_o, hf_o[0].reshape(n, -1).numpy(), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(ours_s, hf_s[0].numpy(), rtol=1e-4, atol=1e-4)


def test_conv_and_gated_norm_references_match_transformers() -> None:
    rng = np.random.default_rng()
    n, C, K = 6, 10, 4
    x, w = rng.standard_normal((n, C)), rng.standard_normal((C, K))
    ours, state = ref.causal_conv1d_silu(x, w, np.zeros((K - 1, C)))
    hf = qwen.causal_conv1d_fn(torch.from_numpy(x.T[None].copy()), torch.from_numpy(w), None, activation="silu")
    np.testing.assert_allclose(ours, hf[0].T.numpy(), rtol=1e-10, atol=1e-10)
    np.testing.assert_array_equal(state, x[-(K - 1):])
    norm = qwen.Qwen3_5RMSNormGated(8, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.from_numpy(rng.standard_normal(8)))
    xs, zs = rng.standard_normal((3, 8)), rng.standard_normal((3, 8))
    hf = norm(torch.from_numpy(xs), torch.from_numpy(zs)).detach().numpy()
    np.testing.assert_allclose(ref.rmsnorm_gated(xs, zs, norm.weight.detach().numpy(), 1e-6), hf, rtol=1e-5, atol=1e-6)
    zc = qwen.Qwen3_5RMSNorm(8, eps=1e-6)
    with torch.no_grad():
        zc.weight.copy_(torch.from_numpy(rng.standard_normal(8)))
    np.testing.assert_allclose(ref.rmsnorm(xs, zc.weight.detach().numpy(), 1e-6, True),
                               zc(torch.from_numpy(xs)).detach().numpy(), rtol=1e-5, atol=1e-6)

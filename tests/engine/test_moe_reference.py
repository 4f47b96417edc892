"""reference/moe.py's MoeMlp against the block's formula written per token in float64, and its routing rules."""
from __future__ import annotations

import numpy as np
import pytest

from gpu_engine.config import MoeConfig
from gpu_engine.reference.moe import MoeMlp

H = 24


def random_mlp(rng: np.random.Generator, moe: MoeConfig, *, fused: bool) -> dict[str, np.ndarray]:
    e, i, s = moe.num_experts, moe.moe_intermediate_size, moe.shared_expert_intermediate_size
    w = {
        "gate.weight": rng.standard_normal((e, H)),
        "shared_expert.gate_proj.weight": rng.standard_normal((s, H)) / H**0.5,
        "shared_expert.up_proj.weight": rng.standard_normal((s, H)) / H**0.5,
        "shared_expert.down_proj.weight": rng.standard_normal((H, s)) / s**0.5,
        "shared_expert_gate.weight": rng.standard_normal((1, H)) / H**0.5,
        "experts.gate_up_proj": rng.standard_normal((e, 2 * i, H)) / H**0.5,
        "experts.down_proj": rng.standard_normal((e, H, i)) / i**0.5,
    }
    if not fused:
        gate_up, down = w.pop("experts.gate_up_proj"), w.pop("experts.down_proj")
        for k in range(e):
            w[f"experts.{k}.gate_proj.weight"] = gate_up[k, :i]
            w[f"experts.{k}.up_proj.weight"] = gate_up[k, i:]
            w[f"experts.{k}.down_proj.weight"] = down[k]
    return {n: a.astype(np.float32) for n, a in w.items()}


def expected(x: np.ndarray, w: dict[str, np.ndarray], moe: MoeConfig) -> np.ndarray:
    """Qwen3_5MoeSparseMoeBlock for one token at a time, float64, from the fused tensors."""
    w64 = {n: a.astype(np.float64) for n, a in w.items()}
    i = moe.moe_intermediate_size

    def swiglu(t, gate, up, down):
        g = gate @ t
        return down @ (g / (1 + np.exp(-g)) * (up @ t))

    out = []
    for t in x.astype(np.float64):
        logits = w64["gate.weight"] @ t
        p = np.exp(logits - logits.max())
        p /= p.sum()
        top = np.argsort(-p)[: moe.num_experts_per_tok]
        y = sum(p[e] / p[top].sum() * swiglu(t, w64["experts.gate_up_proj"][e, :i],
                                             w64["experts.gate_up_proj"][e, i:], w64["experts.down_proj"][e])
                for e in top)
        shared_gate = 1 / (1 + np.exp(-(w64["shared_expert_gate.weight"][0] @ t)))
        y = y + shared_gate * swiglu(t, w64["shared_expert.gate_proj.weight"], w64["shared_expert.up_proj.weight"],
                                     w64["shared_expert.down_proj.weight"])
        out.append(y)
    return np.array(out)


@pytest.mark.parametrize(("experts", "top_k"), [(6, 2), (5, 3), (7, 1), (4, 4)])
def test_matches_the_per_token_formula_in_either_layout(experts, top_k):
    moe = MoeConfig(num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=11,
                    shared_expert_intermediate_size=9)
    rng = np.random.default_rng(experts * 10 + top_k)
    w = random_mlp(rng, moe, fused=True)
    x = rng.standard_normal((33, H)).astype(np.float32)
    want = expected(x, w, moe)
    got = MoeMlp(moe, w)(x)
    assert got.dtype == np.float32 and got.shape == (33, H)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-6
    w_split = random_mlp(np.random.default_rng(experts * 10 + top_k), moe, fused=False)
    np.testing.assert_array_equal(MoeMlp(moe, w_split)(x), got)


def test_routing_picks_the_largest_probabilities_and_renormalises():
    moe = MoeConfig(num_experts=5, num_experts_per_tok=2, moe_intermediate_size=3, shared_expert_intermediate_size=3)
    w = random_mlp(np.random.default_rng(0), moe, fused=True)
    w["gate.weight"] = np.eye(5, H, dtype=np.float32)  # the router logit of expert e is x[e]
    x = np.zeros((3, H), np.float32)
    x[0, :5] = [0.0, 3.0, 1.0, 2.0, -1.0]
    x[1, :5] = [5.0, 5.0, 0.0, 0.0, 5.0]  # a three-way tie: the lower ids win (our rule; torch.topk leaves
    # ties unspecified: on CPU it picks 1 and 4 here). float32 router logits practically never tie.
    chosen, weights = MoeMlp(moe, w).route(x)
    assert chosen[0].tolist() == [1, 3]
    p = np.exp([3.0, 2.0])
    np.testing.assert_allclose(weights[0], p / p.sum(), rtol=1e-6)
    assert chosen[1].tolist() == [0, 1]
    np.testing.assert_allclose(weights[1], [0.5, 0.5], rtol=1e-6)
    assert chosen[2].tolist() == [0, 1]  # all equal
    np.testing.assert_allclose(weights.sum(axis=1), 1.0, rtol=1e-6)


def test_an_expert_no_token_picked_is_not_run():
    moe = MoeConfig(num_experts=4, num_experts_per_tok=1, moe_intermediate_size=5, shared_expert_intermediate_size=5)
    w = random_mlp(np.random.default_rng(1), moe, fused=False)
    w["gate.weight"] = np.zeros((4, H), np.float32)
    w["gate.weight"][2] = 1.0  # with positive inputs expert 2 always wins
    x = np.abs(np.random.default_rng(2).standard_normal((6, H))).astype(np.float32)
    clean = MoeMlp(moe, w)(x)
    w["experts.0.down_proj.weight"] = np.full_like(w["experts.0.down_proj.weight"], np.nan)
    np.testing.assert_array_equal(MoeMlp(moe, w)(x), clean)

"""A qwen3_5_moe layer's MLP in numpy float32: a softmax router over the routed experts plus a gated shared expert.

For each token x (as transformers 5.17's Qwen3_5MoeSparseMoeBlock computes it):
    p = softmax(x W_router^T)                   over all experts
    top = the num_experts_per_tok largest p     renormalised: w_k = p_k / sum(p_top)
    y = sum_k w_k * SwiGLU_k(x) + sigmoid(x . w_shared_gate) * SwiGLU_shared(x)
Each expert runs once per step on the tokens that chose it (the grouped GEMM of a GPU runner, written plainly).
"""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from ..config import MoeConfig
from ..moe_layout import routed_experts
from .ops import linear, sigmoid, softmax, swiglu


class MoeMlp:
    def __init__(self, moe: MoeConfig, w: Mapping[str, np.ndarray]) -> None:
        """w: one layer's MLP tensors, keyed relative to its `mlp.` (either expert layout, gpu_engine/moe_layout)."""
        self.top_k = moe.num_experts_per_tok
        self.router = w["gate.weight"]
        self.experts = routed_experts(w, moe)
        self.shared = (w["shared_expert.gate_proj.weight"], w["shared_expert.up_proj.weight"],
                       w["shared_expert.down_proj.weight"])
        self.shared_gate = w["shared_expert_gate.weight"]

    def route(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(expert ids int64 [n, k] by falling probability, their renormalised weights float32 [n, k])."""
        probs = softmax(linear(x, self.router).astype(np.float32, copy=False), axis=-1)
        # stable sort of -p: among equal probabilities the lower expert id comes first (torch.topk leaves ties
        # unspecified; float32 router logits practically never tie)
        chosen = np.argsort(-probs, axis=-1, kind="stable")[:, : self.top_k]
        top = np.take_along_axis(probs, chosen, axis=-1)
        return chosen, (top / top.sum(axis=-1, keepdims=True)).astype(np.float32)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """x [n, hidden] -> [n, hidden]."""
        chosen, weights = self.route(x)
        out = np.zeros_like(x, dtype=np.float32)
        for e in np.unique(chosen):  # in expert order, as transformers adds them up
            tokens, slot = np.nonzero(chosen == e)  # a token picks an expert at most once
            expert = self.experts[int(e)]
            y = swiglu(x[tokens], expert.gate, expert.up, expert.down)
            out[tokens] += y * weights[tokens, slot][:, None]
        shared = swiglu(x, *self.shared) * sigmoid(linear(x, self.shared_gate))
        return out + shared

"""The limit model of issue 14: the least time a GPU could take for the steps an engine run actually scheduled.

    cost = ModelCost.from_config(model_config, kv_bytes_per_token=..., state_bytes_per_seq=...)
    limit = limit_seconds(cost, steps, gemm_flops_per_s=..., hbm_bytes_per_s=...)

t_limit = (prefill FLOPs + vision-tower FLOPs) / GEMM rate
        + sum over steps with decode rows of max(bytes the decode rows read / HBM rate, their FLOPs / GEMM rate)

What is counted (every dimension from the config; the runner gives the cache layout):
- projections: 2 x rows x params of every 2-D text weight but the embedding (a gather); the LM head (the embedding
  when tied) runs on the rows that want logits only. DeltaNet layers add their recurrence, 7 x dk x dv per value
  head and token (decay, two state reads, the rank-1 update, the output), full-attention layers QK^T and PV over
  the keys each query sees (causal inside a chunk).
- decode bytes: every text weight once per step (the embedding once, as the LM head, when tied; the embedding
  gather of a few rows is ignored), the KV of every decode row's context read once, and each row's
  linear-attention state (+ conv window) read and written once.
- vision tower (per encoded item, as gpu_engine.cuda.vision.GpuVisionTower.flops): patch embedding, per block
  qkv / proj / fc1 / fc2 and attention inside each frame (t x (h w)^2), and the 2x2 merger.
- mixture of experts (qwen3_5_moe): "active parameters". The router, the shared expert and everything else 2-D
  count as above; the routed experts add 2 x k x (3 x I x H) per token and layer (the k experts a token picks). A
  decode step reads the dense weights once plus, per MoE layer, the distinct experts its B rows touch: under
  uniform routing (each row an independent uniformly drawn k-subset of E) an expert escapes one row with
  probability 1 - k/E, so the expected count is E x (1 - (1 - k/E)^B) (expected_distinct_experts; exact for that
  model, tests/bench/test_limit_model_moe.py checks it against enumeration). Real routers are not uniform, so the
  bytes are an estimate for the random-weight benches, not a bound for a trained model.
Prefill steps are counted as pure arithmetic (their weight reads are amortised over hundreds of rows). Sampling,
norms, activations and the grammar masks are not counted: the limit is a floor, not a prediction.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

import numpy as np


@dataclass(frozen=True)
class ModelCost:
    """Per-row costs of one model (see the module docstring for what each counts)."""

    body_params: int  # 2-D text weights except the embedding and the LM head
    head_params: int  # LM head (vocab x hidden; the embedding when tied)
    weight_bytes: int  # every text weight read once (a tied embedding once)
    full_layers: int
    q_heads: int
    head_dim: int
    linear_layers: int
    linear_state_flops: int  # per token and DeltaNet layer: 7 x v_heads x dk x dv
    kv_bytes_per_token: int  # K + V of one token over all full-attention layers (as the runner stores them)
    state_bytes_per_seq: int  # one sequence's linear-attention state + conv window over all layers
    vision: dict[str, int] = field(default_factory=dict)
    # qwen3_5_moe: routed experts (0 for a dense model); body_params and the FLOPs above exclude them
    moe_layers: int = 0
    num_experts: int = 0
    experts_per_token: int = 0
    expert_params: int = 0  # one routed expert of one layer: gate + up + down, 3 x I x H
    expert_bytes: int = 0  # its bytes as stored (weight_bytes counts all E x moe_layers of them)

    @classmethod
    def from_config(cls, config: Any, *, kv_bytes_per_token: int, state_bytes_per_seq: int,
                    weight_itemsize: int = 2) -> ModelCost:
        """`config`: gpu_engine.config.ModelConfig; the cache sizes come from the runner (its own storage dtype)."""
        from gpu_engine.loader import expected_shapes

        text = config.text
        shapes = expected_shapes(config)
        body = head = total = 0
        for name, shape in shapes.items():
            size = int(np.prod(shape, dtype=np.int64))
            if name.startswith("text/"):
                total += size
                if ".mlp.experts." in name:  # routed experts: counted per token below, not as body
                    continue
                if name == "text/embed_tokens.weight":
                    if config.tie_word_embeddings:
                        head += size
                elif len(shape) == 2:
                    body += size
            elif name == "lm_head/weight":
                total += size
                head += size
        v = config.vision
        moe = text.moe
        expert = 0 if moe is None else 3 * moe.moe_intermediate_size * text.hidden_size
        return cls(
            body_params=body, head_params=head, weight_bytes=total * weight_itemsize,
            full_layers=len(text.full_attention_layers), q_heads=text.num_attention_heads, head_dim=text.head_dim,
            linear_layers=len(text.linear_attention_layers),
            linear_state_flops=7 * text.linear_num_value_heads * text.linear_key_head_dim * text.linear_value_head_dim,
            kv_bytes_per_token=int(kv_bytes_per_token), state_bytes_per_seq=int(state_bytes_per_seq),
            vision={"hidden": v.hidden_size, "intermediate": v.intermediate_size, "depth": v.depth,
                    "patch_dim": v.in_channels * v.temporal_patch_size * v.patch_size ** 2,
                    "merge_unit": v.spatial_merge_size ** 2, "out_hidden": v.out_hidden_size},
            moe_layers=0 if moe is None else text.num_hidden_layers,  # every qwen3_5_moe layer is sparse
            num_experts=0 if moe is None else moe.num_experts,
            experts_per_token=0 if moe is None else moe.num_experts_per_tok,
            expert_params=expert, expert_bytes=expert * weight_itemsize,
        )

    # ---- FLOPs -------------------------------------------------------------------------------------------
    def chunk_flops(self, start: int, n: int, logit_rows: int) -> float:
        """n tokens appended to a sequence that holds `start` tokens; `logit_rows` of them reach the LM head."""
        # query i (0-based in the chunk) sees start + i + 1 keys
        keys = n * start + n * (n + 1) / 2
        attention = self.full_layers * 4.0 * self.q_heads * self.head_dim * keys
        recurrence = float(self.linear_layers * self.linear_state_flops * n)
        experts = 2.0 * self.moe_layers * self.experts_per_token * self.expert_params * n
        return (2.0 * self.body_params * n + 2.0 * self.head_params * logit_rows + attention + recurrence
                + experts)

    def vision_flops(self, grid_thw: tuple[int, int, int]) -> float:
        """One encoded item (an image, or one frame group of a video) of grid (t, h, w) patches."""
        v = self.vision
        t, h, w = grid_thw
        n, hid = t * h * w, v["hidden"]
        merged = hid * v["merge_unit"]
        per_block = 2.0 * n * hid * (4 * hid + 2 * v["intermediate"]) + 4.0 * n * h * w * hid
        return (2.0 * n * hid * v["patch_dim"] + v["depth"] * per_block
                + 2.0 * (n // v["merge_unit"]) * merged * (merged + v["out_hidden"]))

    # ---- bytes -------------------------------------------------------------------------------------------
    def decode_bytes(self, contexts: Iterable[int]) -> float:
        """One step's decode rows, each at `context` tokens (itself included): weights once + KV + state."""
        ctx = list(contexts)
        if not ctx:
            return 0.0
        return float(self.weights_read(len(ctx)) + self.kv_bytes_per_token * sum(ctx)
                     + 2 * self.state_bytes_per_seq * len(ctx))

    def weights_read(self, rows: int) -> float:
        """Weight bytes one decode step of `rows` tokens reads: everything once for a dense model; for MoE the dense
        parts once plus the expected distinct routed experts per layer (module docstring)."""
        if self.moe_layers == 0:
            return float(self.weight_bytes)
        all_experts = self.moe_layers * self.num_experts * self.expert_bytes
        touched = expected_distinct_experts(rows, self.experts_per_token, self.num_experts)
        return float(self.weight_bytes - all_experts + self.moe_layers * touched * self.expert_bytes)


def expected_distinct_experts(rows: int, k: int, experts: int) -> float:
    """Expected number of distinct experts `rows` tokens pick, each an independent uniform k-subset of `experts`:
    E x (1 - (1 - k/E)^rows)."""
    if not 0 < k <= experts or rows < 0:
        raise ValueError(f"need 0 < k <= experts and rows >= 0, got k={k}, experts={experts}, rows={rows}")
    return experts * (1.0 - (1.0 - k / experts) ** rows)


@dataclass
class StepShape:
    """What one engine step ran: decode rows (context length each, the new token included), prefill chunks
    (start, tokens, logit rows) and the vision items encoded for it (grid t, h, w)."""

    decode_contexts: list[int] = field(default_factory=list)
    prefill_chunks: list[tuple[int, int, int]] = field(default_factory=list)
    vision_grids: list[tuple[int, int, int]] = field(default_factory=list)


def limit_seconds(cost: ModelCost, steps: Iterable[StepShape], *, gemm_flops_per_s: float,
                  hbm_bytes_per_s: float) -> dict[str, float]:
    """The limit time of these steps and its parts (seconds), plus the totals it was built from."""
    if gemm_flops_per_s <= 0 or hbm_bytes_per_s <= 0:
        raise ValueError(f"rates must be positive, got {gemm_flops_per_s} FLOP/s and {hbm_bytes_per_s} B/s")
    prefill_flops = vision_flops = decode_flops = decode_bytes = 0.0
    decode_s = 0.0
    decode_steps = bytes_bound_steps = 0
    for step in steps:
        prefill_flops += sum(cost.chunk_flops(s, n, r) for s, n, r in step.prefill_chunks)
        vision_flops += sum(cost.vision_flops(g) for g in step.vision_grids)
        if step.decode_contexts:
            f = sum(cost.chunk_flops(c - 1, 1, 1) for c in step.decode_contexts)
            b = cost.decode_bytes(step.decode_contexts)
            decode_flops += f
            decode_bytes += b
            decode_steps += 1
            t_bytes, t_flops = b / hbm_bytes_per_s, f / gemm_flops_per_s
            bytes_bound_steps += t_bytes >= t_flops
            decode_s += max(t_bytes, t_flops)
    prefill_s = prefill_flops / gemm_flops_per_s
    vision_s = vision_flops / gemm_flops_per_s
    return {"t_limit_s": prefill_s + vision_s + decode_s, "prefill_s": prefill_s, "vision_s": vision_s,
            "decode_s": decode_s, "prefill_flops": prefill_flops, "vision_flops": vision_flops,
            "decode_flops": decode_flops, "decode_bytes": decode_bytes, "decode_steps": decode_steps,
            "decode_steps_bytes_bound": bytes_bound_steps}

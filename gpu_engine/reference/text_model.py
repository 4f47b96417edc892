"""The Qwen3.5 language model in numpy float32: embeddings, decoder layers by `layer_types`, final norm, lm head.

Each decoder layer: x += mixer(rms_norm(x)) with the mixer a Gated DeltaNet (linear_attention) or gated full
attention (full_attention); then x += mlp(rms_norm(x)) with the MLP a SwiGLU (qwen3_5) or a mixture of experts
(qwen3_5_moe, reference/moe.py).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from ..config import TextConfig
from ..loader import ModelWeights
from .attention import attention_forward
from .deltanet import deltanet_forward
from .fp8_kv import KvArray
from .moe import MoeMlp
from .ops import Fp8InputWeight, linear, mrope_cos_sin, rms_norm, swiglu


@dataclass
class SequenceCache:
    """What one sequence's step sees of the runner's cache (all arrays are writable views into it)."""

    start: int  # tokens of this sequence already in the cache
    block_table: np.ndarray  # int [>= ceil((start + n) / block_size)] physical block ids
    kv: Mapping[int, tuple[KvArray, KvArray]]  # full-attention layer -> (k_cache, v_cache), all blocks
    conv: Mapping[int, np.ndarray]  # linear-attention layer -> this sequence's conv state [C, K-1]
    recurrent: Mapping[int, np.ndarray]  # linear-attention layer -> this sequence's state [Hv, dk, dv]


class TextModel:
    def __init__(self, config: TextConfig, weights: ModelWeights, *, fp8_activations: bool = False) -> None:
        """fp8_activations: the block-FP8 Linears quantise their inputs as the dynamic scheme does (an emulation of
        the FP8 kernels); without it they multiply the exact float32 input by the exactly dequantised weight."""
        self.config = config
        fp8 = set(weights.fp8_names()) if fp8_activations else set()
        text = {n: (w.view(Fp8InputWeight) if f"text/{n}" in fp8 else w) for n, w in weights.text.items()}
        self.embed = text["embed_tokens.weight"]
        self.final_norm = text["norm.weight"]
        self.lm_head = weights.lm_head.view(Fp8InputWeight) if "lm_head/weight" in fp8 else weights.lm_head
        self.layers: list[dict[str, np.ndarray]] = []  # per layer, names relative to "layers.{i}."
        self.mixers: list[dict[str, np.ndarray]] = []  # relative to linear_attn. / self_attn.
        self.mlps: list[Callable[[np.ndarray], np.ndarray]] = []  # [n, hidden] -> [n, hidden]
        for i, kind in enumerate(config.layer_types):
            layer = _sub(text, f"layers.{i}.")
            self.layers.append(layer)
            self.mixers.append(_sub(layer, "linear_attn." if kind == "linear_attention" else "self_attn."))
            mlp = _sub(layer, "mlp.")
            self.mlps.append(DenseMlp(mlp) if config.moe is None else MoeMlp(config.moe, mlp))

    def embed_tokens(self, token_ids: np.ndarray) -> np.ndarray:
        return self.embed[token_ids].astype(np.float32)

    def forward(
        self, embeds: np.ndarray, positions: np.ndarray, cache: SequenceCache, *, recurrent: bool | None = None
    ) -> np.ndarray:
        """embeds [n, hidden] of positions [3, n] -> final-norm hidden states [n, hidden]; updates the cache."""
        cfg = self.config
        cos, sin = mrope_cos_sin(positions, cfg.rotary_dim, cfg.rope_theta, cfg.mrope_section)
        x = embeds.astype(np.float32)
        for i, (kind, w) in enumerate(zip(cfg.layer_types, self.layers)):
            h = rms_norm(x, w["input_layernorm.weight"], cfg.rms_norm_eps)
            if kind == "linear_attention":
                h = deltanet_forward(h, self.mixers[i], cfg, cache.conv[i], cache.recurrent[i], recurrent=recurrent)
            else:
                k_cache, v_cache = cache.kv[i]
                h = attention_forward(h, self.mixers[i], cfg, cos, sin, k_cache, v_cache, cache.block_table,
                                      cache.start)
            x = x + h
            h = rms_norm(x, w["post_attention_layernorm.weight"], cfg.rms_norm_eps)
            x = x + self.mlps[i](h)
        return rms_norm(x, self.final_norm, cfg.rms_norm_eps)

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        return linear(hidden, self.lm_head).astype(np.float32, copy=False)


class DenseMlp:
    """A qwen3_5 layer's MLP: SwiGLU of `mlp.{gate,up,down}_proj.weight`."""

    def __init__(self, w: Mapping[str, np.ndarray]) -> None:
        self.gate, self.up, self.down = w["gate_proj.weight"], w["up_proj.weight"], w["down_proj.weight"]

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return swiglu(x, self.gate, self.up, self.down)


def _sub(w: Mapping[str, np.ndarray], prefix: str) -> dict[str, np.ndarray]:
    return {k[len(prefix):]: a for k, a in w.items() if k.startswith(prefix)}

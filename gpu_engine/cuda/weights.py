"""Upload the Qwen3.5 text weights once, fused the way the forward wants them.

Fusions (each saves launches and re-reads of the activations):
- full attention: q_proj | k_proj | v_proj -> one [2*H*hd + 2*KV*hd, hidden] matrix (q_proj already holds the
  per-head (query, gate) pairs; their order is kept);
- Gated DeltaNet: in_proj_qkv | in_proj_z | in_proj_b | in_proj_a -> one matrix;
- MLP: gate_proj | up_proj -> one matrix.
Norm weights, conv weights and GEMM weights take the runner's dtype; A_log and dt_bias stay fp32 (small, and
transformers computes the decay in fp32). Arrays of dtype uint16 are taken as bf16 bit patterns as they are
(the benchmark builds random bf16 weights that way, without a float32 copy of a multi-GB model).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..config import TextConfig
from ..loader import ModelWeights
from ..tensors import raw_tensor
from .bf16 import bf16_bits_to_f32, f32_to_bf16_bits
from .context import DArray, GpuContext
from .errors import CudaBackendError


@dataclass(frozen=True)
class AttentionWeights:
    qkv: DArray  # [2*H*hd + 2*KV*hd, hidden]
    q_norm: DArray
    k_norm: DArray
    o_proj: DArray  # [hidden, H*hd]


@dataclass(frozen=True)
class DeltaNetWeights:
    in_proj: DArray  # [conv_dim + value_dim + 2*Hv, hidden]: qkv | z | b | a
    conv: DArray  # [conv_dim, K]
    A_log: DArray  # f32 [Hv]
    dt_bias: DArray  # f32 [Hv]
    norm: DArray  # [dv] (plain scale)
    out_proj: DArray  # [hidden, value_dim]


@dataclass(frozen=True)
class LayerWeights:
    kind: str  # "linear_attention" | "full_attention"
    input_norm: DArray
    post_norm: DArray
    mixer: AttentionWeights | DeltaNetWeights
    gate_up: DArray  # [2*I, hidden]
    down: DArray  # [hidden, I]


@dataclass(frozen=True)
class TextWeights:
    embed: DArray
    layers: list[LayerWeights]
    final_norm: DArray
    lm_head: DArray
    nbytes: int


def _device_bits(arr: np.ndarray, dtype: str) -> np.ndarray:
    if arr.dtype == np.uint16:
        if dtype != "bf16":
            raise CudaBackendError("bf16 bit-pattern weights given to a runner whose dtype is not bf16")
        return arr
    return f32_to_bf16_bits(arr) if dtype == "bf16" else np.ascontiguousarray(arr, np.float32)


def _float32(arr: np.ndarray) -> np.ndarray:
    """float32 of a host weight: uint16 arrays are bf16 bit patterns (the loader's raw form)."""
    return bf16_bits_to_f32(arr) if arr.dtype == np.uint16 else np.ascontiguousarray(arr, np.float32)


class _Uploader:
    def __init__(self, ctx: GpuContext, dtype: str) -> None:
        self.ctx, self.dtype, self.nbytes = ctx, dtype, 0

    def put(self, name: str, *parts: np.ndarray, dtype: str | None = None) -> DArray:
        """Upload the row-wise concatenation of `parts` (converted to the runner dtype unless dtype='f32')."""
        dtype = dtype or self.dtype
        host = [(_device_bits(p, dtype) if dtype != "f32" else _float32(p)) for p in parts]
        data = host[0] if len(host) == 1 else np.concatenate(host, axis=0)
        arr = self.ctx.empty(data.shape, dtype, name)
        self.ctx.device.upload(arr.ptr, data)
        self.nbytes += arr.nbytes
        return arr


def upload_text_weights(ctx: GpuContext, cfg: TextConfig, weights: ModelWeights, dtype: str) -> TextWeights:
    if cfg.attention_bias:
        raise CudaBackendError("attention_bias=True is not supported by the CUDA runner yet (Qwen3.5 has none)")
    text = weights.text
    # bf16: the stored bits as they are (a view of the mapped file, no float32 copy); f32: float32 from the loader
    w = {n: raw_tensor(text, n) for n in text} if dtype == "bf16" else text
    head = weights.raw_lm_head() if dtype == "bf16" else weights.lm_head
    up = _Uploader(ctx, dtype)
    embed = up.put("embed_tokens", w["embed_tokens.weight"])
    tied = weights.tied or np.shares_memory(head, w["embed_tokens.weight"])
    layers = []
    for i, kind in enumerate(cfg.layer_types):
        p = f"layers.{i}."
        mixer: AttentionWeights | DeltaNetWeights
        if kind == "full_attention":
            a = p + "self_attn."
            mixer = AttentionWeights(
                qkv=up.put(f"{a}qkv", w[a + "q_proj.weight"], w[a + "k_proj.weight"], w[a + "v_proj.weight"]),
                q_norm=up.put(a + "q_norm", w[a + "q_norm.weight"]),
                k_norm=up.put(a + "k_norm", w[a + "k_norm.weight"]),
                o_proj=up.put(a + "o_proj", w[a + "o_proj.weight"]),
            )
        else:
            a = p + "linear_attn."
            conv = w[a + "conv1d.weight"]
            mixer = DeltaNetWeights(
                in_proj=up.put(f"{a}in_proj", w[a + "in_proj_qkv.weight"], w[a + "in_proj_z.weight"],
                               w[a + "in_proj_b.weight"], w[a + "in_proj_a.weight"]),
                conv=up.put(a + "conv1d", conv.reshape(conv.shape[0], conv.shape[-1])),
                A_log=up.put(a + "A_log", w[a + "A_log"], dtype="f32"),
                dt_bias=up.put(a + "dt_bias", w[a + "dt_bias"], dtype="f32"),
                norm=up.put(a + "norm", w[a + "norm.weight"]),
                out_proj=up.put(a + "out_proj", w[a + "out_proj.weight"]),
            )
        layers.append(LayerWeights(
            kind=kind,
            input_norm=up.put(p + "input_layernorm", w[p + "input_layernorm.weight"]),
            post_norm=up.put(p + "post_attention_layernorm", w[p + "post_attention_layernorm.weight"]),
            mixer=mixer,
            gate_up=up.put(p + "mlp.gate_up", w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]),
            down=up.put(p + "mlp.down", w[p + "mlp.down_proj.weight"]),
        ))
    final_norm = up.put("norm", w["norm.weight"])
    lm_head = embed if tied else up.put("lm_head", head)
    return TextWeights(embed=embed, layers=layers, final_norm=final_norm, lm_head=lm_head, nbytes=up.nbytes)

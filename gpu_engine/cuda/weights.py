"""Upload the Qwen3.5 text weights once, fused the way the forward wants them.

Fusions (each saves launches and re-reads of the activations):
- full attention: q_proj | k_proj | v_proj -> one [2*H*hd + 2*KV*hd, hidden] matrix (q_proj already holds the
  per-head (query, gate) pairs; their order is kept);
- Gated DeltaNet: in_proj_qkv | in_proj_z | in_proj_b | in_proj_a -> one matrix;
- MLP: gate_proj | up_proj -> one matrix (an MoE layer's experts, router and shared expert: moe_weights.py).
Norm weights, conv weights and GEMM weights take the runner's dtype; A_log and dt_bias stay fp32 (small, and
transformers computes the decay in fp32). Arrays of dtype uint16 are taken as bf16 bit patterns as they are
(the benchmark builds random bf16 weights that way, without a float32 copy of a multi-GB model).

Every projection is a linear layer type (linear.py). Block-FP8 weights (an FP8 checkpoint, or quantize="fp8")
stay FP8 on the device (Fp8Linear; bf16 runners only). A fusion joins FP8 parts into one matrix when their scale
grids join (every part but the last ends on a 128-row block), else the parts sit side by side (ConcatLinear), as
do FP8 and BF16 parts of one fusion (DeltaNet's qkv|z FP8, b|a BF16 in Qwen's FP8 releases).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from ..config import TextConfig
from ..loader import ModelWeights
from ..mtp_layout import held_layout_shapes
from ..tensors import Fp8Tensor, Tensors, raw_tensor
from .bf16 import bf16_bits_to_f32, f32_to_bf16_bits
from .context import DArray, GpuContext
from .errors import CudaBackendError
from .fp8_ops import BLOCK, upload_fp8_weight
from .linear import DenseLinear, Fp8Linear, Linear, SwigluMlp, concat
from .moe import MoeLayer
from .moe_weights import refuse_fp8_experts, upload_moe_mlp


@dataclass(frozen=True)
class AttentionWeights:
    qkv: Linear  # [2*H*hd + 2*KV*hd, hidden]
    q_norm: DArray
    k_norm: DArray
    o_proj: Linear  # [hidden, H*hd]


@dataclass(frozen=True)
class DeltaNetWeights:
    in_proj: Linear  # [conv_dim + value_dim + 2*Hv, hidden]: qkv | z | b | a
    conv: DArray  # [conv_dim, K]
    A_log: DArray  # f32 [Hv]
    dt_bias: DArray  # f32 [Hv]
    norm: DArray  # [dv] (plain scale)
    out_proj: Linear  # [hidden, value_dim]


@dataclass(frozen=True)
class LayerWeights:
    kind: str  # "linear_attention" | "full_attention"
    input_norm: DArray
    post_norm: DArray
    mixer: AttentionWeights | DeltaNetWeights
    mlp: SwigluMlp | MoeLayer  # dense SwiGLU (gate|up, down), or a qwen3_5_moe layer's experts (moe.py)


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


def _fp8_entry(text: object, name: str) -> Fp8Tensor | None:
    """The block-FP8 form of `name`: from the loader's Tensors, or an Fp8Tensor put in a plain dict."""
    if isinstance(text, Tensors):
        return text.fp8(name)
    value = text[name]  # type: ignore[index]
    return value if isinstance(value, Fp8Tensor) else None


def refuse_unsupported_fp8(weights: ModelWeights, dtype: str) -> None:
    """What the CUDA runner cannot run in FP8 fails here, by name, before anything is uploaded: FP8 with an f32
    runner, an FP8 vision tower, lm_head or embedding (Qwen's FP8 releases keep those BF16). The MTP head is
    checked apart (mtp_head_problem): an FP8 head leaves the runner without one."""
    names = weights.fp8_names()  # the loader's "group/name"; a plain dict's Fp8Tensor entries count as text
    if not isinstance(weights.text, Tensors):
        names += [f"text/{n}" for n, v in weights.text.items() if isinstance(v, Fp8Tensor)]
    text = [n for n in names if n.startswith("text/")]
    if text and dtype != "bf16":
        raise CudaBackendError(f"block-FP8 weights need the bf16 CUDA runner (dtype={dtype!r} was asked): the FP8 "
                               "GEMMs read bf16 activations and write bf16")
    for group, what in (("vision/", "the vision tower"), ("lm_head/", "lm_head"), ("text/embed_tokens", "embedding")):
        found = [n for n in names if n.startswith(group)]
        if found:
            raise CudaBackendError(f"the CUDA runner has no FP8 path for {what}: {', '.join(found[:3])} (Qwen's FP8 "
                                   "releases keep it BF16)")


class _Uploader:
    def __init__(self, ctx: GpuContext, dtype: str, text: object = None, w: Mapping[str, np.ndarray] | None = None
                 ) -> None:
        self.ctx, self.dtype, self.nbytes = ctx, dtype, 0
        self.text, self.w = text, w or {}  # what linear() reads (the vision tower's uploads use put() alone)

    def linear(self, name: str, *parts: str) -> Linear:
        """The projection made of the checkpoint weights `parts` (rows concatenated), as a linear layer type."""
        pieces: list[DenseLinear | Fp8Linear] = []
        run: list[str] = []

        def flush() -> None:
            if not run:
                return
            fp8 = [_fp8_entry(self.text, p) for p in run]
            label = name if len(run) == len(parts) else f"{name}[{run[0]}..]"
            if fp8[0] is None:
                pieces.append(DenseLinear(self.put(label, *(self.w[p] for p in run))))
            else:
                weight = upload_fp8_weight(self.ctx, label, [f for f in fp8 if f is not None])
                self.nbytes += weight.nbytes
                pieces.append(Fp8Linear(weight))
            run.clear()

        for part in parts:
            fp8 = _fp8_entry(self.text, part)
            if run:
                prev = _fp8_entry(self.text, run[-1])
                if (prev is None) != (fp8 is None) or (prev is not None and prev.shape[0] % BLOCK):
                    flush()  # a change of format, or FP8 scale grids that do not join
            run.append(part)
        flush()
        return concat(pieces)

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
    refuse_unsupported_fp8(weights, dtype)
    if cfg.moe is not None:
        refuse_fp8_experts(weights.fp8_names())
    text = weights.text
    # bf16: the stored bits as they are (a view of the mapped file, no float32 copy); f32: float32 from the loader
    w = {n: raw_tensor(text, n) for n in text if _fp8_entry(text, n) is None} if dtype == "bf16" else text
    head = weights.raw_lm_head() if dtype == "bf16" else weights.lm_head
    up = _Uploader(ctx, dtype, text, w)
    embed = up.put("embed_tokens", w["embed_tokens.weight"])
    tied = weights.tied or np.shares_memory(head, w["embed_tokens.weight"])
    layers = []
    for i, kind in enumerate(cfg.layer_types):
        p = f"layers.{i}."
        mixer: AttentionWeights | DeltaNetWeights
        if kind == "full_attention":
            mixer = _full_attention(up, w, p + "self_attn.")
        else:
            a = p + "linear_attn."
            conv = w[a + "conv1d.weight"]
            mixer = DeltaNetWeights(
                in_proj=up.linear(f"{a}in_proj", a + "in_proj_qkv.weight", a + "in_proj_z.weight",
                                  a + "in_proj_b.weight", a + "in_proj_a.weight"),
                conv=up.put(a + "conv1d", conv.reshape(conv.shape[0], conv.shape[-1])),
                A_log=up.put(a + "A_log", w[a + "A_log"], dtype="f32"),
                dt_bias=up.put(a + "dt_bias", w[a + "dt_bias"], dtype="f32"),
                norm=up.put(a + "norm", w[a + "norm.weight"]),
                out_proj=up.linear(a + "out_proj", a + "out_proj.weight"),
            )
        layers.append(_layer(up, cfg, w, p, kind, mixer))
    final_norm = up.put("norm", w["norm.weight"])
    lm_head = embed if tied else up.put("lm_head", head)
    return TextWeights(embed=embed, layers=layers, final_norm=final_norm, lm_head=lm_head, nbytes=up.nbytes)


def _full_attention(up: _Uploader, w: Mapping[str, np.ndarray], a: str) -> AttentionWeights:
    """The gated full-attention mixer whose tensors are named `a` + ... (e.g. "layers.3.self_attn.")."""
    return AttentionWeights(
        qkv=up.linear(f"{a}qkv", a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"),
        q_norm=up.put(a + "q_norm", w[a + "q_norm.weight"]),
        k_norm=up.put(a + "k_norm", w[a + "k_norm.weight"]),
        o_proj=up.linear(a + "o_proj", a + "o_proj.weight"),
    )


def _layer(up: _Uploader, cfg: TextConfig, w: Mapping[str, np.ndarray], p: str, kind: str,
           mixer: AttentionWeights | DeltaNetWeights) -> LayerWeights:
    """A decoder layer at prefix `p`: its norms, `mixer`, and its MLP (dense SwiGLU or the layer's experts)."""
    return LayerWeights(
        kind=kind,
        input_norm=up.put(p + "input_layernorm", w[p + "input_layernorm.weight"]),
        post_norm=up.put(p + "post_attention_layernorm", w[p + "post_attention_layernorm.weight"]),
        mixer=mixer,
        mlp=(upload_moe_mlp(up, cfg.moe, w, p + "mlp.") if cfg.moe is not None else
             SwigluMlp(up.linear(p + "mlp.gate_up", p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
                       up.linear(p + "mlp.down", p + "mlp.down_proj.weight"))),
    )


@dataclass(frozen=True)
class MtpWeights:
    """The checkpoint's MTP head (gpu_engine/mtp_layout.py): fc over [embedding | hidden] (each normed first), one
    full-attention decoder layer of the trunk's kind, its final norm; embeddings and lm_head are the trunk's."""

    fc: Linear  # [hidden, 2 * hidden]
    pre_fc_norm_embedding: DArray
    pre_fc_norm_hidden: DArray
    layer: LayerWeights
    norm: DArray
    nbytes: int


def mtp_head_problem(cfg: TextConfig, weights: ModelWeights) -> str | None:
    """Why this runner has no MTP head for `weights` (None: it has one). A checkpoint without a complete head
    still runs; it just has no MTP drafter."""
    held = weights.mtp
    if not held:
        return "the checkpoint has no MTP head (mtp.* weights)"
    missing = [n for n in held_layout_shapes(cfg, held) if n not in held]
    if missing:
        return f"the checkpoint's MTP head lacks mtp.{', mtp.'.join(missing[:3])}"
    fp8 = [n for n in weights.fp8_names() if n.startswith("mtp/")]
    if not isinstance(held, Tensors):
        fp8 += [f"mtp/{n}" for n, v in held.items() if isinstance(v, Fp8Tensor)]
    if fp8:
        return f"the CUDA runner has no FP8 path for the MTP head yet ({', '.join(fp8[:3])})"
    return None


def upload_mtp_weights(ctx: GpuContext, cfg: TextConfig, weights: ModelWeights, dtype: str) -> MtpWeights:
    """The MTP head on the device, in the runner's dtype (mtp_head_problem(...) must be None)."""
    held = weights.mtp
    # bf16: the stored bits as they are; f32: float32 from the loader (as upload_text_weights)
    w = {n: raw_tensor(held, n) for n in held} if dtype == "bf16" else held
    up = _Uploader(ctx, dtype, held, w)
    p = "layers.0."
    layer = _layer(up, cfg, w, p, "full_attention", _full_attention(up, w, p + "self_attn."))
    return MtpWeights(
        fc=up.linear("mtp.fc", "fc.weight"),
        pre_fc_norm_embedding=up.put("mtp.pre_fc_norm_embedding", w["pre_fc_norm_embedding.weight"]),
        pre_fc_norm_hidden=up.put("mtp.pre_fc_norm_hidden", w["pre_fc_norm_hidden.weight"]),
        layer=layer, norm=up.put("mtp.norm", w["norm.weight"]), nbytes=up.nbytes)

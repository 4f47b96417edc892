"""Which checkpoint tensors are block-FP8, checked against config.json; and FP8 from a BF16 checkpoint at load.

What is quantised is decided as transformers 5.17 decides it (replace_with_fp8_linear): every nn.Linear whose module
name `modules_to_not_convert` does not match. A pattern matches a module name when it matches at its start as a
regular expression, or when the name ends with it (quantizers_utils.should_convert_module). The names are the
checkpoint's own (the file's list is written in them). A Linear weight here is a 2-D `*.weight` that is not an
embedding table nor an MoE router (`mlp.gate`: Qwen3_5MoeTopKRouter is no nn.Linear, so transformers never converts
it); conv1d (3-D), patch_embed (5-D), norms and A_log / dt_bias (1-D) never are. A qwen3_5_moe checkpoint's experts
are Linears when stored one tensor per expert (the official FP8 layout); fused 3-D expert tensors are not.

Official checkpoints (`pair_fp8`): a converted Linear `X` stores `X.weight` as F8_E4M3 and `X.weight_scale_inv`
(BF16 or F32) of shape [ceil(out/128), ceil(in/128)], every scale finite and positive. Every departure is one
problem naming the tensor; the loader reports them all at once.

At load (`quantize_checkpoint`): a BF16/F32 checkpoint's eligible Linears become Fp8Tensors with the recipe of
gpu_engine/fp8.py, skipping QUANTIZE_SKIP (the modules Qwen's FP8 releases keep in BF16).
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

import numpy as np

from . import fp8
from .config import Fp8Config
from .tensors import Entry, Fp8Tensor, StoredTensor

SCALE_SUFFIX = "_scale_inv"  # X.weight -> X.weight_scale_inv
SCALE_DTYPES = ("BF16", "F32")
# Not converted when quantising at load, as in Qwen's FP8 releases: the head and embeddings, the DeltaNet conv1d and
# its two per-head projections, the whole vision tower, the MTP layer's fc, an MoE layer's shared-expert gate (one
# [1, hidden] row, kept in BF16 as vLLM keeps it), and (not Linears anyway) norms and the DeltaNet decay parameters.
QUANTIZE_SKIP = ("lm_head", "embed_tokens", "conv1d", "in_proj_a", "in_proj_b", "model.visual", "visual",
                 "mtp.fc", "shared_expert_gate", "norm", "A_log", "dt_bias")
# The fingerprint of a model quantised at load names the recipe, so its results are not taken for the BF16 model's.
QUANTIZE_VARIANT = "fp8-e4m3-block128x128-at-load"
_EMBEDDINGS = ("embed_tokens", "pos_embed")
_ROUTER = ".mlp.gate"  # an MoE layer's router (the dense MLP's projections are mlp.gate_proj etc.)


def is_linear_weight(checkpoint_name: str, shape: tuple[int, ...]) -> bool:
    """The weight of an nn.Linear: what transformers' FP8 integration converts."""
    if len(shape) != 2 or not checkpoint_name.endswith(".weight"):
        return False
    module = module_name(checkpoint_name)
    return module.rsplit(".", 1)[-1] not in _EMBEDDINGS and not module.endswith(_ROUTER)


def module_name(checkpoint_name: str) -> str:
    """model.language_model.layers.0.mlp.up_proj.weight -> model.language_model.layers.0.mlp.up_proj"""
    return checkpoint_name[: -len(".weight")] if checkpoint_name.endswith(".weight") else checkpoint_name


def skipped(module: str, patterns: Iterable[str]) -> bool:
    """transformers' rule: a pattern matching at the start (regex), or a suffix of the name."""
    return any(re.match(p, module) or module.endswith(p) for p in patterns)


def pair_fp8(
    found: Mapping[str, StoredTensor], source: Mapping[str, str], quant: Fp8Config | None
) -> tuple[dict[str, Entry], list[str]]:
    """Join each F8_E4M3 weight with its scale; returns (entries by our name, problems naming checkpoint tensors).

    `found` is keyed by our names (group/name), `source` gives each one's checkpoint name. Scale tensors are consumed
    (they do not appear in the result)."""
    problems: list[str] = []
    scales = {n[: -len(SCALE_SUFFIX)]: n for n in found if n.endswith(SCALE_SUFFIX)}
    entries: dict[str, Entry] = {}
    for ours, tensor in found.items():
        if ours.endswith(SCALE_SUFFIX):
            if ours[: -len(SCALE_SUFFIX)] not in found:
                problems.append(f"{source[ours]} has no weight {source[ours][: -len(SCALE_SUFFIX)]}")
            continue
        name = source[ours]
        scale = found.get(scales[ours]) if ours in scales else None
        linear = is_linear_weight(name, tensor.shape)
        converted = quant is not None and linear and not skipped(module_name(name), quant.modules_to_not_convert)
        if tensor.dtype != "F8_E4M3":
            if scale is not None:
                problems.append(f"{name} is stored {tensor.dtype} but has a scale {name}{SCALE_SUFFIX}")
            elif converted:
                problems.append(f"{name} is stored {tensor.dtype}, but modules_to_not_convert does not list "
                                f"{module_name(name)}, so quantization_config says it is F8_E4M3")
            entries[ours] = tensor
            continue
        if quant is None:
            problems.append(f"{name} is stored F8_E4M3 but config.json has no quantization_config")
        elif not linear:
            problems.append(f"{name} is stored F8_E4M3 but is not a Linear weight (block FP8 covers Linears only)")
        elif not converted:
            problems.append(f"{name} is stored F8_E4M3 but modules_to_not_convert lists {module_name(name)}")
        elif scale is None:
            problems.append(f"{name} is stored F8_E4M3 but its scale {name}{SCALE_SUFFIX} is missing")
        else:
            problem = _scale_problem(name, tensor.shape, scale, quant.weight_block_size)
            if problem:
                problems.append(problem)
            else:
                entries[ours] = Fp8Tensor(bits=tensor.raw, scale_inv=scale.to_float32(),
                                          block=quant.weight_block_size, scale_dtype=scale.dtype)
    return entries, problems


def _scale_problem(name: str, shape: tuple[int, ...], scale: StoredTensor, block: tuple[int, int]) -> str | None:
    scale_name = name + SCALE_SUFFIX
    want = fp8.scale_grid((shape[0], shape[1]), block)
    if scale.dtype not in SCALE_DTYPES:
        return f"{scale_name} is stored {scale.dtype}; scales must be {' or '.join(SCALE_DTYPES)}"
    if scale.shape != want:
        return (f"{scale_name} has shape {scale.shape}; a {shape} weight in {block[0]}x{block[1]} blocks needs "
                f"{want}")
    values = scale.to_float32()
    if not np.all(np.isfinite(values) & (values > 0)):
        return f"{scale_name} holds scales that are not finite and positive"
    return None


def quantize_checkpoint(entries: dict[str, Entry], source: Mapping[str, str]) -> int:
    """Quantise every eligible BF16/F32/F16 Linear weight in place (QUANTIZE_SKIP honoured); returns how many."""
    count = 0
    for ours, entry in entries.items():
        name = source[ours]
        if (isinstance(entry, StoredTensor) and is_linear_weight(name, entry.shape)
                and not skipped(module_name(name), QUANTIZE_SKIP)):
            bits, scale_inv = fp8.quantize(entry.to_float32())
            entries[ours] = Fp8Tensor(bits=bits, scale_inv=scale_inv, block=fp8.BLOCK, scale_dtype="F32")
            count += 1
    return count

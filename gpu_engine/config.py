"""ModelConfig: a checkpoint folder's config.json for `qwen3_5` and `qwen3_5_moe`, parsed as transformers 5.17 reads it.

Where each value comes from (transformers' Qwen3_5Config / Qwen3_5TextConfig / Qwen3_5VisionConfig and
PreTrainedConfig.convert_rope_params_to_dict / standardize_rope_params):
- text values come from `text_config` only; text-looking keys at the top level are ignored by the model.
- RoPE: legacy `text_config.rope_scaling` wins over `rope_parameters` when it is a non-empty dict. Inside that
  dict `rope_theta` and `partial_rotary_factor` win; otherwise `text_config.rope_theta` (default 10000) and
  `text_config.partial_rotary_factor` (default 0.25) fill in. `mrope_section` defaults to [11, 11, 10].
- `layer_types` defaults to a linear/full pattern from `text_config.full_attention_interval` (default 4), and the
  legacy names `mamba` / `attention` are mapped to `linear_attention` / `full_attention`.
- `tie_word_embeddings` of the top level decides tying for Qwen3_5ForConditionalGeneration; the text_config copy
  is not used. `image_token_id` and friends are top-level keys.
- eos ids: generation_config.json, else the top level, else text_config (GenerationConfig.from_model_config).
- `quantization_config` (top level): only fine-grained FP8 as Qwen publishes it (quant_method "fp8", fmt "e4m3",
  activation_scheme "dynamic", weight_block_size [128, 128]); anything else is refused by name (Fp8Config).
- Missing keys take the transformers dataclass defaults (so a sparse config.json means what it means there).
- `qwen3_5_moe` (Qwen3_5MoeTextConfig): every layer's MLP is routed experts + a gated shared expert (MoeConfig);
  there is no dense MLP (intermediate_size 0). Its router always renormalises the top-k and every layer is sparse,
  so `norm_topk_prob` false, `decoder_sparse_step` != 1 or a non-empty `mlp_only_layers` (keys transformers
  drops) are refused rather than run differently from what their author meant.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import EngineError


class ModelLoadError(EngineError):
    """Base class of every error raised while reading a checkpoint folder."""


class ConfigError(ModelLoadError):
    """config.json is missing, not valid JSON, or has a value of the wrong type / an inconsistent value."""


class UnsupportedModelError(ModelLoadError):
    """config.json is well formed but describes something this engine does not implement."""


SUPPORTED_MODEL_TYPES = ("qwen3_5", "qwen3_5_moe")
_TEXT_MODEL_TYPES = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}
_TEXT_ACTS = ("silu", "swish")  # the MLP and the DeltaNet conv both use hidden_act; both names mean SiLU
_VISION_ACTS = ("gelu_pytorch_tanh", "gelu_new", "gelu")
_LEGACY_LAYER_TYPES = {"mamba": "linear_attention", "attention": "full_attention", "conv": "linear_attention"}
_LAYER_TYPES = ("linear_attention", "full_attention")

# Qwen3_5TextConfig dataclass defaults (transformers 5.17) for the keys we read.
_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 248320,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 32,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "hidden_act": "silu",
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "attention_bias": False,
    "head_dim": 256,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
}
# Qwen3_5MoeTextConfig (35B-A3B) defaults where they differ from the dense ones, and its expert keys.
_MOE_TEXT_DEFAULTS: dict[str, Any] = {"hidden_size": 2048, "num_hidden_layers": 40, "num_key_value_heads": 2}
_MOE_DEFAULTS: dict[str, Any] = {"num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 512,
                                 "shared_expert_intermediate_size": 512}
# Qwen3_5VisionConfig defaults.
_VISION_DEFAULTS: dict[str, Any] = {
    "depth": 27,
    "hidden_size": 1152,
    "hidden_act": "gelu_pytorch_tanh",
    "intermediate_size": 4304,
    "num_heads": 16,
    "in_channels": 3,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "out_hidden_size": 3584,
    "num_position_embeddings": 2304,
}
# Qwen3_5Config defaults.
_TOP_DEFAULTS: dict[str, Any] = {
    "image_token_id": 248056,
    "video_token_id": 248057,
    "vision_start_token_id": 248053,
    "vision_end_token_id": 248054,
    "tie_word_embeddings": False,
}


@dataclass(frozen=True)
class MoeConfig:
    """Every decoder layer's MLP of a qwen3_5_moe model (HF field names): softmax router over num_experts, the
    top num_experts_per_tok renormalised to sum 1, plus one shared expert scaled by sigmoid(shared_expert_gate)."""

    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int  # each routed expert's SwiGLU width
    shared_expert_intermediate_size: int


@dataclass(frozen=True)
class TextConfig:
    """The language model (HF field names)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int  # the dense SwiGLU width; 0 for an MoE model, which has no dense MLP (see moe)
    num_hidden_layers: int
    layer_types: tuple[str, ...]
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    hidden_act: str
    rms_norm_eps: float
    attention_bias: bool
    max_position_embeddings: int
    linear_conv_kernel_dim: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    rope_type: str
    rope_theta: float
    partial_rotary_factor: float
    mrope_section: tuple[int, int, int]
    mrope_interleaved: bool
    moe: MoeConfig | None = None  # set for qwen3_5_moe: every layer's MLP is a mixture of experts

    @property
    def rotary_dim(self) -> int:
        """Leading head dims that are rotated (int(head_dim * partial_rotary_factor), as transformers)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def full_attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "full_attention")

    @property
    def linear_attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "linear_attention")

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def linear_conv_dim(self) -> int:
        """Channels of the DeltaNet causal conv: q, k and v concatenated."""
        return 2 * self.linear_key_dim + self.linear_value_dim


@dataclass(frozen=True)
class VisionConfig:
    """The vision tower (HF field names)."""

    depth: int
    hidden_size: int
    hidden_act: str
    intermediate_size: int
    num_heads: int
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    out_hidden_size: int
    num_position_embeddings: int
    rope_theta: float

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


@dataclass(frozen=True)
class Fp8Config:
    """config.json's `quantization_config` of a block-FP8 checkpoint (transformers' FineGrainedFP8Config keys)."""

    weight_block_size: tuple[int, int]  # (rows, columns) of a weight block sharing one scale
    modules_to_not_convert: tuple[str, ...]  # transformers' patterns (prefix regex, or a name suffix)
    activation_scheme: str = "dynamic"  # activations quantised per token and 128-wide group, at run time

    @classmethod
    def from_dict(cls, raw: Any, source: str) -> Fp8Config:
        src = f"{source} quantization_config"
        if not isinstance(raw, dict):
            raise ConfigError(f"{src} must be an object, got {type(raw).__name__}")
        wanted = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
        for key, value in wanted.items():
            if raw.get(key, value) != value:
                raise UnsupportedModelError(f"{src}: {key}={raw[key]!r} is not supported (only {value!r})")
        if raw.get("scale_fmt", "float") != "float":
            raise UnsupportedModelError(f"{src}: scale_fmt={raw['scale_fmt']!r} is not supported (only 'float')")
        block = raw.get("weight_block_size")
        if (not isinstance(block, list) or len(block) != 2
                or not all(isinstance(b, int) and not isinstance(b, bool) for b in block)):
            raise ConfigError(f"{src}: weight_block_size must be a list of two integers, got {block!r}")
        if block != [128, 128]:
            raise UnsupportedModelError(f"{src}: weight_block_size={block} is not supported (only [128, 128], "
                                        "the block the FP8 kernels are written for)")
        # Without a list transformers keeps the output embedding (get_keys_to_not_convert): lm_head.
        skip = raw.get("modules_to_not_convert")
        skip = ["lm_head"] if skip is None else skip
        if not isinstance(skip, list) or not all(isinstance(m, str) for m in skip):
            raise ConfigError(f"{src}: modules_to_not_convert must be a list of module names, got {skip!r}")
        return cls(weight_block_size=(block[0], block[1]), modules_to_not_convert=tuple(skip))


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    text: TextConfig
    vision: VisionConfig
    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    raw: dict[str, Any] = field(repr=False, compare=False)
    quantization: Fp8Config | None = None  # the checkpoint's own block-FP8 format, when it has one

    @classmethod
    def from_pretrained(cls, folder: str | Path) -> ModelConfig:
        """Read `folder/config.json` (and `generation_config.json` for eos ids, when present)."""
        folder = Path(folder)
        path = folder / "config.json"
        raw = _read_json(path)
        generation_file = folder / "generation_config.json"
        generation = _read_json(generation_file) if generation_file.exists() else {}
        return cls.from_dict(raw, generation_config=generation, source=str(path))

    @classmethod
    def from_dict(
        cls, raw: dict[str, Any], *, generation_config: dict[str, Any] | None = None, source: str = "config.json"
    ) -> ModelConfig:
        if not isinstance(raw, dict):
            raise ConfigError(f"{source}: expected a JSON object, got {type(raw).__name__}")
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"{source}: model_type={model_type!r} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        text_raw = _sub_dict(raw, "text_config", source)
        vision_raw = _sub_dict(raw, "vision_config", source)
        text_type = text_raw.get("model_type", _TEXT_MODEL_TYPES[model_type])
        if text_type in _TEXT_MODEL_TYPES.values() and text_type != _TEXT_MODEL_TYPES[model_type]:
            # the other family's text model: half of a hand-edited config (transformers would ignore the key)
            raise ConfigError(f"{source}: text_config.model_type={text_type!r} does not belong to "
                              f"model_type={model_type!r} (expected {_TEXT_MODEL_TYPES[model_type]!r})")
        text = _parse_text(text_raw, source, moe=model_type == "qwen3_5_moe")
        vision = _parse_vision(vision_raw, source)
        top = {**_TOP_DEFAULTS, **{k: raw[k] for k in _TOP_DEFAULTS if k in raw}}
        eos = _eos_ids(generation_config or {}, raw, text_raw, source)
        quant = raw.get("quantization_config")
        return cls(
            model_type=model_type,
            text=text,
            vision=vision,
            image_token_id=_int(top, "image_token_id", source),
            video_token_id=_int(top, "video_token_id", source),
            vision_start_token_id=_int(top, "vision_start_token_id", source),
            vision_end_token_id=_int(top, "vision_end_token_id", source),
            tie_word_embeddings=_bool(top, "tie_word_embeddings", source),
            eos_token_ids=eos,
            raw=raw,
            quantization=None if quant is None else Fp8Config.from_dict(quant, source),
        )


# --------------------------------------------------------------------------------------------------- parsing


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"{path} not found: a checkpoint folder needs a config.json")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path} is not valid JSON: {exc}") from exc


def _sub_dict(raw: dict[str, Any], key: str, source: str) -> dict[str, Any]:
    value = raw.get(key)
    if value is None:
        return {}  # transformers builds the sub-config from its defaults
    if not isinstance(value, dict):
        raise ConfigError(f"{source}: {key} must be an object, got {type(value).__name__}")
    return value


def _int(d: dict[str, Any], key: str, source: str, *, minimum: int = 0) -> int:
    value = d[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{source}: {key} must be an integer, got {value!r}")
    if value < minimum:
        raise ConfigError(f"{source}: {key} must be >= {minimum}, got {value}")
    return value


def _float(d: dict[str, Any], key: str, source: str) -> float:
    value = d[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{source}: {key} must be a number, got {value!r}")
    return float(value)


def _bool(d: dict[str, Any], key: str, source: str) -> bool:
    value = d[key]
    if not isinstance(value, bool):
        raise ConfigError(f"{source}: {key} must be true or false, got {value!r}")
    return value


def _layer_types(text_raw: dict[str, Any], num_layers: int, source: str) -> tuple[str, ...]:
    given = text_raw.get("layer_types")
    if given is None:
        interval = text_raw.get("full_attention_interval", 4)
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise ConfigError(f"{source}: text_config.full_attention_interval must be a positive integer, "
                              f"got {interval!r}")
        return tuple("linear_attention" if (i + 1) % interval else "full_attention" for i in range(num_layers))
    if not isinstance(given, list) or not all(isinstance(t, str) for t in given):
        raise ConfigError(f"{source}: text_config.layer_types must be a list of strings, got {given!r}")
    names: list[str] = given
    types = tuple(_LEGACY_LAYER_TYPES.get(t, t) for t in names)
    for i, t in enumerate(types):
        if t not in _LAYER_TYPES:
            raise UnsupportedModelError(
                f"{source}: text_config.layer_types[{i}]={t!r} is not supported (supported: {', '.join(_LAYER_TYPES)})"
            )
    if len(types) != num_layers:
        raise ConfigError(
            f"{source}: text_config.layer_types has {len(types)} entries but num_hidden_layers={num_layers}"
        )
    return types


def _rope(text_raw: dict[str, Any], source: str) -> tuple[str, float, float, tuple[int, int, int], bool]:
    params = text_raw.get("rope_scaling") or text_raw.get("rope_parameters") or {}
    if not isinstance(params, dict):
        raise ConfigError(f"{source}: text_config.rope_parameters must be an object, got {params!r}")
    if any(t in params for t in _LAYER_TYPES):
        raise UnsupportedModelError(f"{source}: per-layer-type rope_parameters ({sorted(params)}) are not supported")
    merged = {
        "rope_theta": text_raw.get("rope_theta", 10000.0),
        "partial_rotary_factor": text_raw.get("partial_rotary_factor", 0.25),
        "mrope_section": [11, 11, 10],
        "mrope_interleaved": True,
        **params,
    }
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise UnsupportedModelError(
            f"{source}: text_config rope_type={rope_type!r} is not supported (only 'default' M-RoPE)"
        )
    theta = _float(merged, "rope_theta", source)
    factor = _float(merged, "partial_rotary_factor", source)
    if not 0.0 < factor <= 1.0:
        raise ConfigError(f"{source}: partial_rotary_factor must be in (0, 1], got {factor}")
    section = merged["mrope_section"]
    if (
        not isinstance(section, list)
        or len(section) != 3
        or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in section)
    ):
        raise ConfigError(f"{source}: mrope_section must be a list of 3 non-negative integers, got {section!r}")
    interleaved = merged["mrope_interleaved"]
    if interleaved is not True:
        # transformers 5.17 always interleaves the (t, h, w) sections; a checkpoint that says otherwise would be
        # run differently by its authors than by our reference, so refuse rather than guess.
        raise UnsupportedModelError(f"{source}: mrope_interleaved={interleaved!r} is not supported (only true)")
    return rope_type, theta, factor, (section[0], section[1], section[2]), True


def _parse_moe(text_raw: dict[str, Any], src: str) -> MoeConfig:
    d = {**_MOE_DEFAULTS, **{k: text_raw[k] for k in _MOE_DEFAULTS if k in text_raw}}
    ints = {k: _int(d, k, src, minimum=1) for k in _MOE_DEFAULTS}
    if ints["num_experts_per_tok"] > ints["num_experts"]:
        raise ConfigError(f"{src}: num_experts_per_tok={ints['num_experts_per_tok']} is more than "
                          f"num_experts={ints['num_experts']}")
    # Qwen3_5MoeTextConfig drops these Qwen3-Next keys: its router always renormalises, every layer is sparse.
    for key, meant in (("norm_topk_prob", True), ("decoder_sparse_step", 1), ("mlp_only_layers", [])):
        if key in text_raw and text_raw[key] != meant:
            raise UnsupportedModelError(f"{src}: {key}={text_raw[key]!r} is not supported: qwen3_5_moe (as "
                                        f"transformers 5.17 runs it) always behaves as {key}={meant!r}")
    return MoeConfig(**ints)


def _parse_text(text_raw: dict[str, Any], source: str, *, moe: bool = False) -> TextConfig:
    defaults = {**_TEXT_DEFAULTS, **_MOE_TEXT_DEFAULTS} if moe else _TEXT_DEFAULTS
    d = {**defaults, **{k: text_raw[k] for k in defaults if k in text_raw}}
    src = f"{source} text_config"
    ints = {
        k: _int(d, k, src, minimum=1)
        for k in (
            "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "max_position_embeddings", "linear_conv_kernel_dim",
            "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads",
        )
    }
    ints["intermediate_size"] = 0 if moe else _int(d, "intermediate_size", src, minimum=1)
    if d["hidden_act"] not in _TEXT_ACTS:
        raise UnsupportedModelError(f"{src}: hidden_act={d['hidden_act']!r} is not supported (supported: {_TEXT_ACTS})")
    if ints["num_attention_heads"] % ints["num_key_value_heads"]:
        raise ConfigError(
            f"{src}: num_attention_heads={ints['num_attention_heads']} is not a multiple of "
            f"num_key_value_heads={ints['num_key_value_heads']}"
        )
    if ints["linear_num_value_heads"] % ints["linear_num_key_heads"]:
        raise ConfigError(
            f"{src}: linear_num_value_heads={ints['linear_num_value_heads']} is not a multiple of "
            f"linear_num_key_heads={ints['linear_num_key_heads']}"
        )
    rope_type, theta, factor, section, interleaved = _rope(text_raw, src)
    if int(ints["head_dim"] * factor) % 2:
        raise ConfigError(f"{src}: rotary dim int(head_dim * partial_rotary_factor) must be even")
    eps = _float(d, "rms_norm_eps", src)
    return TextConfig(
        **ints,
        layer_types=_layer_types(text_raw, ints["num_hidden_layers"], src),
        hidden_act=d["hidden_act"],
        rms_norm_eps=eps,
        attention_bias=_bool(d, "attention_bias", src),
        rope_type=rope_type,
        rope_theta=theta,
        partial_rotary_factor=factor,
        mrope_section=section,
        mrope_interleaved=interleaved,
        moe=_parse_moe(text_raw, src) if moe else None,
    )


def _parse_vision(vision_raw: dict[str, Any], source: str) -> VisionConfig:
    vision_raw = dict(vision_raw)
    if "num_attention_heads" in vision_raw and "num_heads" not in vision_raw:  # transformers' attribute_map
        vision_raw["num_heads"] = vision_raw["num_attention_heads"]
    d = {**_VISION_DEFAULTS, **{k: vision_raw[k] for k in _VISION_DEFAULTS if k in vision_raw}}
    src = f"{source} vision_config"
    for key in ("patch_size", "temporal_patch_size"):
        if isinstance(d[key], list):
            raise UnsupportedModelError(f"{src}: {key}={d[key]!r} (a list) is not supported, only one integer")
    ints = {
        k: _int(d, k, src, minimum=1)
        for k in (
            "depth", "hidden_size", "intermediate_size", "num_heads", "in_channels", "patch_size",
            "spatial_merge_size", "temporal_patch_size", "out_hidden_size", "num_position_embeddings",
        )
    }
    if d["hidden_act"] not in _VISION_ACTS:
        raise UnsupportedModelError(f"{src}: hidden_act={d['hidden_act']!r} is not supported "
                                    f"(supported: {_VISION_ACTS})")
    if ints["hidden_size"] % ints["num_heads"]:
        raise ConfigError(f"{src}: hidden_size={ints['hidden_size']} is not a multiple of "
                          f"num_heads={ints['num_heads']}")
    rope = vision_raw.get("rope_scaling") or vision_raw.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise ConfigError(f"{src}: rope_parameters must be an object, got {rope!r}")
    rope_type = rope.get("rope_type", rope.get("type", "axial"))
    if rope_type not in ("axial", "default"):  # transformers maps "default" to the vision tower's "axial"
        raise UnsupportedModelError(f"{src}: rope_type={rope_type!r} is not supported (only 'axial')")
    theta = _float({"rope_theta": rope.get("rope_theta", vision_raw.get("rope_theta", 10000.0))}, "rope_theta", src)
    return VisionConfig(**ints, hidden_act=d["hidden_act"], rope_theta=theta)


def _eos_ids(
    generation: dict[str, Any], raw: dict[str, Any], text_raw: dict[str, Any], source: str
) -> tuple[int, ...]:
    for where, d in (("generation_config.json", generation), ("config.json", raw), ("text_config", text_raw)):
        value = d.get("eos_token_id")
        if value is None:
            continue
        ids = value if isinstance(value, list) else [value]
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            raise ConfigError(f"{source}: eos_token_id in {where} must be an id or a list of ids, got {value!r}")
        return tuple(ids)
    return ()

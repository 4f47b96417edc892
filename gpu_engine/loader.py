"""Checkpoint loading: safetensors (single file or sharded), memory-mapped, no torch; integrity and fingerprint.

Reading (gpu_engine/tensors.py): every file is memory-mapped, its tensors are views of the mapping; F32, F16, BF16
and F8_E4M3 are read. `ModelWeights` hands the reference runner float32 (converted on first read, see Tensors),
while a runner that uploads bf16 reads the stored bits with `raw_tensor` / `ModelWeights.raw_lm_head`, with no
float32 copy of the model on the host.

Block FP8 (gpu_engine/fp8_checkpoint.py): with a `quantization_config` in config.json, each converted Linear's
F8_E4M3 weight is joined with its `weight_scale_inv` and checked (dtype, shape of the 128x128 grid, values);
`quantize="fp8"` turns a BF16 checkpoint's eligible Linears into the same format at load.

Names: transformers writes `model.language_model.*`, `model.visual.*`, `lm_head.weight` for
Qwen3_5ForConditionalGeneration; upstream checkpoints add `mtp.*`. Older VL layouts (`model.layers.*`, `visual.*`,
`language_model.model.*`) are mapped too. Everything is checked against the name -> shape table that ModelConfig
implies; all problems are reported in one CheckpointError. A qwen3_5_moe layer's experts may be stored fused or one
tensor per expert (gpu_engine/moe_layout.py); each layer is checked against the layout it holds. The MTP head
(`mtp.*`) is optional; the tensors it holds are checked too (gpu_engine/mtp_layout.py).

Fingerprint (`checkpoint_fingerprint`): sha256 of the UTF-8 text made of one line per file,
`<file name>\\0<sha256 hex of the file>\\n`, for config.json followed by the weight files in sorted name order.
It changes whenever the config or any weight byte changes (FP8 scales included: they are weight-file bytes) and
does not depend on the folder's location. A model quantised at load adds a last line `quantize\0<recipe>\n` to
the hashed text and `+<recipe>` to the fingerprint (`<hex>+fp8-e4m3-block128x128-at-load`), so a result recorded with
it says in words that the weights were quantised at load, and never carries the BF16 checkpoint's fingerprint.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import cast

import numpy as np

from .config import ModelConfig, ModelLoadError
from .fp8_checkpoint import QUANTIZE_VARIANT, pair_fp8, quantize_checkpoint
from .moe_layout import moe_shapes, per_expert_layers
from .mtp_layout import mtp_problems
from .tensors import CheckpointError, StoredTensor, Tensors, raw_tensor, read_safetensors

QUANTIZE_CHOICES = (None, "fp8")


def check_quantize(quantize: object) -> None:
    """Refuse a `quantize` other than QUANTIZE_CHOICES by name (called before any weight file is read)."""
    if quantize not in QUANTIZE_CHOICES:
        raise ValueError(
            f"quantize must be None (the weights as stored) or 'fp8' (a BF16 checkpoint's eligible Linears become "
            f"128x128-block FP8 at load; an FP8 checkpoint is used as it is), got {quantize!r}"
        )


class IntegrityError(ModelLoadError):
    """A file's SHA-256 does not match the expected digest (SHA256SUMS or caller-supplied)."""


SUMS_FILE = "SHA256SUMS"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

# The names transformers' save_pretrained writes, per group (used for messages and by the tiny generator).
CANONICAL_PREFIX = {"text": "model.language_model.", "vision": "model.visual.", "lm_head": "lm_head.", "mtp": "mtp."}

# (checkpoint prefix, our group) in the order they are tried; the first match wins.
_PREFIXES: tuple[tuple[str, str], ...] = (
    ("model.language_model.", "text"),
    ("model.visual.", "vision"),
    ("language_model.model.", "text"),
    ("language_model.lm_head.", "lm_head"),
    ("lm_head.", "lm_head"),
    ("mtp.", "mtp"),
    ("visual.", "vision"),
    ("model.", "text"),
)


class ModelWeights:
    """The model's tensors, keyed relative to their component prefix; reading one gives float32.

    text: e.g. "layers.0.linear_attn.in_proj_qkv.weight", "embed_tokens.weight"; vision: e.g.
    "blocks.0.attn.qkv.weight"; mtp: e.g. "fc.weight" (kept for speculative decoding). Plain dicts of arrays
    work too (benchmarks build them).
    lm_head: the [vocab, hidden] matrix, or a Tensors holding it under "weight"; None ties it to the embedding.
    """

    def __init__(
        self,
        text: Mapping[str, np.ndarray],
        vision: Mapping[str, np.ndarray],
        lm_head: np.ndarray | Tensors | None,
        mtp: Mapping[str, np.ndarray] | None = None,
    ) -> None:
        self.text, self.mtp = text, mtp if mtp is not None else {}
        # Read by name only, everywhere; typed dict for cuda/vision.py's GpuVisionTower, whose signature still says
        # dict though it reads a Mapping (change it to Mapping there, then drop this cast).
        self.vision = cast(dict[str, np.ndarray], vision)
        self._head = lm_head

    @property
    def tied(self) -> bool:
        return self._head is None

    @property
    def lm_head(self) -> np.ndarray:
        """float32 [vocab, hidden] (the embedding matrix itself when tied)."""
        if self._head is None:
            return self.text["embed_tokens.weight"]
        return self._head["weight"] if isinstance(self._head, Tensors) else self._head

    def raw_lm_head(self) -> np.ndarray:
        """The head as stored (uint16 bf16 bits for a BF16 checkpoint), with no float32 copy."""
        if self._head is None:
            return raw_tensor(self.text, "embed_tokens.weight")
        return self._head.raw("weight") if isinstance(self._head, Tensors) else self._head

    def fp8_names(self) -> list[str]:
        """`group/name` of every block-FP8 weight (empty for a BF16 / F32 model)."""
        groups = {"text": self.text, "vision": self.vision, "mtp": self.mtp, "lm_head": self._head}
        return [f"{g}/{n}" for g, t in groups.items() if isinstance(t, Tensors) for n in t.fp8_names()]


# ------------------------------------------------------------------------------------------------ expected shapes


def expected_shapes(config: ModelConfig, per_expert: Collection[int] = ()) -> dict[str, tuple[int, ...]]:
    """Every tensor the model needs, as `group/name` -> shape (group: text, vision, lm_head). An MoE model's experts
    are fused (the BF16 releases' layout, gpu_engine/moe_layout.py) except in the text layers listed in `per_expert`."""
    t, v = config.text, config.vision
    h = t.hidden_size
    out: dict[str, tuple[int, ...]] = {
        "text/embed_tokens.weight": (t.vocab_size, h),
        "text/norm.weight": (h,),
    }
    for i, kind in enumerate(t.layer_types):
        p = f"text/layers.{i}."
        out[p + "input_layernorm.weight"] = (h,)
        out[p + "post_attention_layernorm.weight"] = (h,)
        if t.moe is not None:
            out.update(moe_shapes(p + "mlp.", t.moe, h, per_expert=i in per_expert))
        else:
            out[p + "mlp.gate_proj.weight"] = (t.intermediate_size, h)
            out[p + "mlp.up_proj.weight"] = (t.intermediate_size, h)
            out[p + "mlp.down_proj.weight"] = (h, t.intermediate_size)
        if kind == "linear_attention":
            nv = t.linear_num_value_heads
            a = p + "linear_attn."
            out[a + "in_proj_qkv.weight"] = (t.linear_conv_dim, h)
            out[a + "in_proj_z.weight"] = (t.linear_value_dim, h)
            out[a + "in_proj_b.weight"] = (nv, h)
            out[a + "in_proj_a.weight"] = (nv, h)
            out[a + "conv1d.weight"] = (t.linear_conv_dim, 1, t.linear_conv_kernel_dim)
            out[a + "dt_bias"] = (nv,)
            out[a + "A_log"] = (nv,)
            out[a + "norm.weight"] = (t.linear_value_head_dim,)
            out[a + "out_proj.weight"] = (h, t.linear_value_dim)
        else:
            a = p + "self_attn."
            q, kv = t.num_attention_heads * t.head_dim, t.num_key_value_heads * t.head_dim
            out[a + "q_proj.weight"] = (2 * q, h)  # query and output gate, interleaved per head
            out[a + "k_proj.weight"] = (kv, h)
            out[a + "v_proj.weight"] = (kv, h)
            out[a + "o_proj.weight"] = (h, q)
            out[a + "q_norm.weight"] = (t.head_dim,)
            out[a + "k_norm.weight"] = (t.head_dim,)
            if t.attention_bias:
                out[a + "q_proj.bias"] = (2 * q,)
                out[a + "k_proj.bias"] = (kv,)
                out[a + "v_proj.bias"] = (kv,)
                out[a + "o_proj.bias"] = (h,)
    if not config.tie_word_embeddings:
        out["lm_head/weight"] = (t.vocab_size, h)

    vh, m2 = v.hidden_size, v.spatial_merge_size**2
    out["vision/patch_embed.proj.weight"] = (vh, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size)
    out["vision/patch_embed.proj.bias"] = (vh,)
    out["vision/pos_embed.weight"] = (v.num_position_embeddings, vh)
    for i in range(v.depth):
        p = f"vision/blocks.{i}."
        for norm in ("norm1", "norm2"):
            out[p + norm + ".weight"] = (vh,)
            out[p + norm + ".bias"] = (vh,)
        out[p + "attn.qkv.weight"] = (3 * vh, vh)
        out[p + "attn.qkv.bias"] = (3 * vh,)
        out[p + "attn.proj.weight"] = (vh, vh)
        out[p + "attn.proj.bias"] = (vh,)
        out[p + "mlp.linear_fc1.weight"] = (v.intermediate_size, vh)
        out[p + "mlp.linear_fc1.bias"] = (v.intermediate_size,)
        out[p + "mlp.linear_fc2.weight"] = (vh, v.intermediate_size)
        out[p + "mlp.linear_fc2.bias"] = (vh,)
    out["vision/merger.norm.weight"] = (vh,)
    out["vision/merger.norm.bias"] = (vh,)
    out["vision/merger.linear_fc1.weight"] = (vh * m2, vh * m2)
    out["vision/merger.linear_fc1.bias"] = (vh * m2,)
    out["vision/merger.linear_fc2.weight"] = (v.out_hidden_size, vh * m2)
    out["vision/merger.linear_fc2.bias"] = (v.out_hidden_size,)
    return out


def checkpoint_name(ours: str) -> str:
    """The name transformers writes for our `group/name` (e.g. text/norm.weight -> model.language_model.norm.weight)."""
    group, name = ours.split("/", 1)
    return CANONICAL_PREFIX[group] + name


def _our_name(checkpoint_name: str) -> str | None:
    """`group/relative name` for a checkpoint tensor name, or None if it belongs to nothing we know."""
    for prefix, group in _PREFIXES:
        if checkpoint_name.startswith(prefix):
            rest = checkpoint_name[len(prefix):]
            return f"{group}/{rest}"
    return None


# ------------------------------------------------------------------------------------------------ files


def weight_files(folder: Path) -> list[str]:
    """Weight file names of a checkpoint folder (the shards an index lists, or model.safetensors)."""
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{index} is not a valid safetensors index (needs a 'weight_map' object): "
                                  f"{exc}") from exc
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (folder / f).is_file()]
        if missing:
            raise CheckpointError(f"{index} lists shard files that do not exist: {', '.join(missing)}")
        return files
    if (folder / SINGLE_FILE).is_file():
        return [SINGLE_FILE]
    raise CheckpointError(f"{folder}: no {SINGLE_FILE} and no {INDEX_FILE}; is this a safetensors checkpoint folder?")


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def read_sums_file(path: Path) -> dict[str, str]:
    """Parse `<hex>  <filename>` lines (sha256sum output; a `*` binary marker is accepted)."""
    digests: dict[str, str] = {}
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split(None, 1)
        if len(parts) != 2 or len(parts[0]) != 64 or any(c not in "0123456789abcdefABCDEF" for c in parts[0]):
            raise IntegrityError(f"{path}:{lineno}: expected '<64 hex digits>  <file name>', got {line!r}")
        digests[parts[1].strip().lstrip("*")] = parts[0].lower()
    return digests


def verify_digests(folder: Path, expected: Mapping[str, str], *, required: list[str]) -> dict[str, str]:
    """Hash every file in `expected`; mismatch, missing file, or a required file not covered -> IntegrityError.

    Returns the computed digests (reused for the fingerprint so big files are read once).
    """
    uncovered = [name for name in required if name not in expected]
    if uncovered:
        raise IntegrityError(
            f"{folder}: the expected digests do not cover {', '.join(uncovered)}; every config and weight file "
            "must be listed"
        )
    actual: dict[str, str] = {}
    bad: list[str] = []
    for name, want in sorted(expected.items()):
        path = folder / name
        if not path.is_file():
            bad.append(f"{name}: listed but missing")
            continue
        actual[name] = sha256_file(path)
        if actual[name] != want.lower():
            bad.append(f"{name}: sha256 {actual[name]} != expected {want.lower()}")
    if bad:
        raise IntegrityError(f"{folder}: integrity check failed:\n  " + "\n  ".join(bad))
    return actual


def checkpoint_fingerprint(
    folder: Path, files: list[str], known: Mapping[str, str] | None = None, *, quantized: str | None = None
) -> str:
    """sha256 over config.json + weight files (see the module docstring for the exact recipe)."""
    known = known or {}
    lines = []
    for name in ["config.json", *sorted(files)]:
        digest = known.get(name) or sha256_file(folder / name)
        lines.append(f"{name}\0{digest}\n")
    if quantized is not None:
        lines.append(f"quantize\0{quantized}\n")
    digest = hashlib.sha256("".join(lines).encode("utf-8")).hexdigest()
    return digest if quantized is None else f"{digest}+{quantized}"


# ------------------------------------------------------------------------------------------------ weights


def load_weights(
    folder: str | Path,
    config: ModelConfig,
    *,
    expected_digests: Mapping[str, str] | None = None,
    quantize: str | None = None,
) -> tuple[ModelWeights, str]:
    """Verify (SHA256SUMS or `expected_digests`), read and validate the weights; returns (weights, fingerprint).

    quantize="fp8": a checkpoint without its own quantization_config gets its eligible Linears quantised to
    128x128-block FP8 here (gpu_engine/fp8_checkpoint.py); an FP8 checkpoint is used as it is."""
    check_quantize(quantize)
    folder = Path(folder)
    files = weight_files(folder)
    digests: dict[str, str] = {}
    expected = dict(expected_digests) if expected_digests is not None else None
    if expected is None and (folder / SUMS_FILE).is_file():
        expected = read_sums_file(folder / SUMS_FILE)
    if expected is not None:
        digests = verify_digests(folder, expected, required=["config.json", *files])
    at_load = quantize == "fp8" and config.quantization is None
    fingerprint = checkpoint_fingerprint(folder, files, digests, quantized=QUANTIZE_VARIANT if at_load else None)

    found: dict[str, StoredTensor] = {}
    source: dict[str, str] = {}  # our name -> the checkpoint's name, for messages
    unknown: list[str] = []
    for file in files:
        for name, tensor in read_safetensors(folder / file).items():
            ours = _our_name(name)
            if ours is None:
                unknown.append(name)
            elif ours in found:  # e.g. the same tensor in two shards, or under an old and a new name
                unknown.append(f"{name} (duplicate of {source[ours]})")
            else:
                found[ours] = tensor
                source[ours] = name

    # A tied checkpoint may still carry a (duplicate) lm_head; transformers ties it to the embedding anyway.
    if config.tie_word_embeddings:
        found.pop("lm_head/weight", None)
        found.pop("lm_head/weight_scale_inv", None)
    entries, fp8_problems = pair_fp8(found, source, config.quantization)
    want = expected_shapes(config, per_expert_layers(entries) if config.text.moe is not None else ())
    missing = sorted(checkpoint_name(n) for n in want if n not in entries)
    unexpected = sorted(unknown + [source[n] for n in entries if n not in want and not n.startswith("mtp/")])
    misshaped = sorted(
        f"{source[n]}: {tuple(entries[n].shape)} (expected {want[n]})"
        for n in want
        if n in entries and tuple(entries[n].shape) != want[n]
    )
    # the MTP head is optional, but what mtp.* holds must be right (gpu_engine/mtp_layout.py)
    mtp_missing, mtp_unexpected, mtp_misshaped = mtp_problems(
        config.text, {n[4:]: tuple(entries[n].shape) for n in entries if n.startswith("mtp/")})
    missing += mtp_missing
    unexpected = sorted(unexpected + mtp_unexpected)
    misshaped = sorted(misshaped + mtp_misshaped)
    if missing or unexpected or misshaped or fp8_problems:
        parts = []
        if missing:
            parts.append("missing: " + ", ".join(missing))
        if unexpected:
            parts.append("unexpected: " + ", ".join(unexpected))
        if misshaped:
            parts.append("wrong shape: " + "; ".join(misshaped))
        if fp8_problems:
            parts.append("block FP8: " + "; ".join(sorted(fp8_problems)))
        raise CheckpointError(f"{folder}: weights do not match config.json ({'; '.join(parts)})")
    if at_load:
        quantize_checkpoint(entries, source)

    def group(g: str) -> Tensors:
        return Tensors({n[len(g) + 1:]: t for n, t in entries.items() if n.startswith(g + "/")})

    head = None if config.tie_word_embeddings else group("lm_head")
    return ModelWeights(text=group("text"), vision=group("vision"), lm_head=head, mtp=group("mtp")), fingerprint

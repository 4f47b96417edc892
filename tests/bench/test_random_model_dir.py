"""The real-size random model folder writer (bench/random_model_dir.py), at tiny size."""
from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
from ci_rule import require_module
from random_model_dir import write_bf16_safetensors, write_random_model_dir
from safetensors.numpy import load_file

from gpu_engine.config import ModelConfig
from gpu_engine.loader import load_weights
from gpu_engine.tiny import TINY_TEXT, TINY_VISION
from gpu_engine.tokenizer import Tokenizer


def test_folder_loads_with_the_config_vocab(tmp_path: Path) -> None:
    folder = write_random_model_dir(tmp_path / "m", {**TINY_TEXT, "vocab_size": 3000}, TINY_VISION, tied=True,
                                    seed=1, sums=True)
    config = ModelConfig.from_pretrained(folder)
    assert config.text.vocab_size == 3000 and config.tie_word_embeddings
    assert Tokenizer.from_pretrained(folder).vocab_size < 3000
    weights, _ = load_weights(folder, config)  # checks every name and shape, and the SHA256SUMS
    with open(folder / "model.safetensors", "rb") as f:
        header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
    assert {v["dtype"] for k, v in header.items() if k != "__metadata__"} == {"BF16"}
    assert "lm_head.weight" not in header and weights.lm_head is weights.text["embed_tokens.weight"]
    text, vision = weights.text, weights.vision
    assert np.all(text["layers.0.linear_attn.norm.weight"] == 1.0)
    assert np.all(vision["blocks.0.norm1.weight"] == 1.0) and np.all(vision["merger.norm.weight"] == 1.0)
    assert np.all(text["layers.0.linear_attn.dt_bias"] == 1.0)
    a = np.exp(text["layers.0.linear_attn.A_log"].astype(np.float64))
    assert np.all((a > 0.99) & (a < 16.1))  # log U(1, 16), rounded to bf16
    emb = text["embed_tokens.weight"]
    assert abs(emb.std() - 0.02) < 0.002 and abs(emb.mean()) < 0.002
    g0, g1 = text["layers.0.mlp.gate_proj.weight"], text["layers.1.mlp.gate_proj.weight"]
    assert abs(g0.std() - 0.02) < 0.002 and not np.array_equal(g0, g1)  # same shape, different contents


def test_bf16_bits_round_trip_through_an_independent_reader(tmp_path: Path) -> None:
    rng = np.random.default_rng()
    bits = {"a": rng.integers(0, 2**16, (3, 5), dtype=np.uint16), "b": rng.integers(0, 2**16, (7,), dtype=np.uint16)}
    path = tmp_path / "x.safetensors"
    write_bf16_safetensors(path, {k: v.shape for k, v in bits.items()}, iter(sorted(bits.items())))
    torch = require_module("torch")
    from safetensors.torch import load_file as load_torch

    back = load_torch(str(path))
    for k, v in bits.items():
        assert back[k].dtype == torch.bfloat16
        assert np.array_equal(back[k].view(torch.int16).numpy().view(np.uint16), v)
    # numpy has no bf16 of its own (the engine's loader views these bytes itself); once ml_dtypes is imported
    # (gpu_engine.fp8 does) safetensors' numpy reader knows the name, and must then give the same bits
    try:
        arrays = load_file(str(path))
    except TypeError as exc:
        assert "bfloat16" in str(exc)
    else:
        for k, v in bits.items():
            assert np.array_equal(arrays[k].view(np.uint16), v)


def test_bad_inputs(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="smaller than the bundled tokenizer"):
        write_random_model_dir(tmp_path / "small", {**TINY_TEXT, "vocab_size": 100}, TINY_VISION, tied=True)
    with pytest.raises(ValueError, match="does not match"):
        write_bf16_safetensors(tmp_path / "y.safetensors", {"a": (2, 2)},
                               iter([("a", np.zeros((2, 3), np.uint16))]))
    with pytest.raises(ValueError):  # fewer tensors than the header promised
        write_bf16_safetensors(tmp_path / "z.safetensors", {"a": (2,), "b": (2,)},
                               iter([("a", np.zeros(2, np.uint16))]))


@pytest.mark.parametrize("layout", ["fused", "per_expert"])
def test_moe_folder_in_either_expert_layout(tmp_path: Path, layout: str) -> None:
    from gpu_engine.moe_layout import routed_experts
    from gpu_engine.tiny_moe import TINY_MOE_TEXT

    text = {**TINY_MOE_TEXT, "vocab_size": 3000}
    folder = write_random_model_dir(tmp_path / layout, text, TINY_VISION, tied=False, seed=2, expert_layout=layout)
    raw = json.loads((folder / "config.json").read_text())
    assert raw["model_type"] == "qwen3_5_moe" and raw["architectures"] == ["Qwen3_5MoeForConditionalGeneration"]
    config = ModelConfig.from_pretrained(folder)
    moe = config.text.moe
    assert moe is not None and (moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size,
                                moe.shared_expert_intermediate_size) == (6, 2, 21, 37)
    weights, _ = load_weights(folder, config)  # every name and shape of the layout it holds
    names = set(weights.text)
    fused = {n for n in names if n.endswith("mlp.experts.gate_up_proj")}
    per_expert = {n for n in names if ".mlp.experts.5.down_proj.weight" in n}
    assert (len(fused), len(per_expert)) == ((4, 0) if layout == "fused" else (0, 4))
    mlp = {n[len("layers.1.mlp."):]: w for n, w in weights.text.items() if n.startswith("layers.1.mlp.")}
    experts = routed_experts(mlp, moe)
    assert experts[0].gate.shape == (21, 64) and experts[5].down.shape == (64, 21)
    assert abs(experts[3].up.std() - 0.02) < 0.004 and not np.array_equal(experts[0].gate, experts[1].gate)
    assert mlp["gate.weight"].shape == (6, 64) and mlp["shared_expert_gate.weight"].shape == (1, 64)


def test_35b_a3b_config_comes_from_the_shape(tmp_path: Path) -> None:
    from qwen35_shapes import moe_model_shape

    text, vision, tied = moe_model_shape("35b-a3b")
    folder = write_random_model_dir(tmp_path / "m", text, vision, tied=tied, weights=False)
    config = ModelConfig.from_pretrained(folder)
    t, moe = config.text, config.text.moe
    assert config.model_type == "qwen3_5_moe" and not config.tie_word_embeddings and moe is not None
    assert (moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size,
            moe.shared_expert_intermediate_size) == (256, 8, 512, 512)
    assert (t.num_hidden_layers, t.hidden_size, t.num_attention_heads, t.num_key_value_heads) == (40, 2048, 16, 2)
    assert len(t.full_attention_layers) == 10 and config.vision.out_hidden_size == 2048
    assert not (folder / "model.safetensors").exists()
    with pytest.raises(ValueError, match="expert_layout"):
        write_random_model_dir(tmp_path / "x", text, vision, tied=tied, expert_layout="stacked")

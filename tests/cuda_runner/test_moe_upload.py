"""qwen3_5_moe weights on their way to the GPU, on the CPU (a recording stand-in for GpuContext): both checkpoint
layouts upload the same expert stacks [E, 2I, H] / [E, H, I], the router and shared_expert_gate travel as one
[E + 1, H] matrix, the shared expert is a pair of linear layers, and FP8 routed experts are refused by name before
anything is uploaded."""
from __future__ import annotations

import numpy as np
import pytest

from gpu_engine.config import ModelConfig
from gpu_engine.cuda.errors import CudaBackendError
from gpu_engine.cuda.linear import DenseLinear, SwigluMlp
from gpu_engine.cuda.moe import MoeLayer
from gpu_engine.cuda.weights import upload_text_weights
from gpu_engine.loader import load_weights
from gpu_engine.tiny_moe import make_tiny_moe_checkpoint
from tests.cuda_runner.recording_context import RecordingContext


@pytest.fixture(scope="module")
def both_layouts(tmp_path_factory):
    seed = int(np.random.default_rng().integers(1000))
    out = {}
    for layout in ("fused", "per_expert"):
        folder = make_tiny_moe_checkpoint(tmp_path_factory.mktemp(layout), seed=seed, dtype="bfloat16", layout=layout)
        config = ModelConfig.from_pretrained(folder)
        out[layout] = (config, load_weights(folder, config)[0])
    return out


@pytest.mark.parametrize("dtype", ["bf16", "f32"])
def test_both_layouts_upload_the_same_expert_stacks(both_layouts, dtype: str) -> None:
    sent = {}
    for layout, (config, weights) in both_layouts.items():
        ctx = RecordingContext()
        tw = upload_text_weights(ctx, config.text, weights, dtype)
        moe = config.text.moe
        e, inter, h = moe.num_experts, moe.moe_intermediate_size, config.text.hidden_size
        for i, layer in enumerate(tw.layers):
            mlp = layer.mlp
            assert isinstance(mlp, MoeLayer) and isinstance(mlp.shared, SwigluMlp)  # widths 21 / 37: apart
            assert mlp.gate_up.shape == (e, 2 * inter, h) and mlp.down.shape == (e, h, inter)
            assert mlp.router.shape == (e + 1, h) and mlp.top_k == moe.num_experts_per_tok
            assert isinstance(mlp.shared.gate_up, DenseLinear)
            assert mlp.shared.gate_up.shape == (2 * moe.shared_expert_intermediate_size, h)
            p = f"layers.{i}.mlp."
            text = weights.text
            router = ctx.sent[p + "router"]
            want = np.concatenate([text[p + "gate.weight"], text[p + "shared_expert_gate.weight"]])
            got = router if dtype == "f32" else (router.astype(np.uint32) << 16).view(np.float32)
            np.testing.assert_array_equal(got, want)  # a bf16 checkpoint: the bits as stored
            stack = ctx.sent[p + "experts.gate_up"]
            e3 = 2
            gate = text[f"{p}experts.{e3}.gate_proj.weight"] if layout == "per_expert" else \
                text[p + "experts.gate_up_proj"][e3, :inter]
            got = stack[e3, :inter] if dtype == "f32" else (stack[e3, :inter].astype(np.uint32) << 16).view(np.float32)
            np.testing.assert_array_equal(got, gate)
        sent[layout] = ctx.sent
    fused, per = sent["fused"], sent["per_expert"]
    names = [n for n in fused if ".mlp." in n]
    assert names and all(np.array_equal(fused[n], per[n]) for n in names)


@pytest.mark.parametrize("layout", ["fused", "per_expert"])
def test_a_shared_expert_as_wide_as_the_experts_is_stacked_last(tmp_path, layout: str) -> None:
    folder = make_tiny_moe_checkpoint(tmp_path, seed=4, dtype="bfloat16", layout=layout,
                                      text_config={"moe_intermediate_size": 24, "shared_expert_intermediate_size": 24})
    config = ModelConfig.from_pretrained(folder)
    weights, _ = load_weights(folder, config)
    ctx = RecordingContext()
    tw = upload_text_weights(ctx, config.text, weights, "f32")
    e, h = config.text.moe.num_experts, config.text.hidden_size
    for i, layer in enumerate(tw.layers):
        p, mlp = f"layers.{i}.mlp.", layer.mlp
        assert isinstance(mlp, MoeLayer) and mlp.shared is None and mlp.slots == mlp.top_k + 1
        assert mlp.gate_up.shape == (e + 1, 48, h) and mlp.down.shape == (e + 1, h, 24)
        gu, dn = ctx.sent[p + "experts.gate_up"], ctx.sent[p + "experts.down"]
        text = weights.text
        np.testing.assert_array_equal(gu[e, :24], text[p + "shared_expert.gate_proj.weight"])
        np.testing.assert_array_equal(gu[e, 24:], text[p + "shared_expert.up_proj.weight"])
        np.testing.assert_array_equal(dn[e], text[p + "shared_expert.down_proj.weight"])
        up0 = (text[p + "experts.0.up_proj.weight"] if layout == "per_expert"
               else text[p + "experts.gate_up_proj"][0, 24:])
        np.testing.assert_array_equal(gu[0, 24:], up0)


def test_fp8_experts_are_refused_by_name(tmp_path) -> None:
    folder = make_tiny_moe_checkpoint(tmp_path, seed=3, dtype="bfloat16", layout="per_expert",
                                      text_config={"hidden_size": 128, "moe_intermediate_size": 128,
                                                   "shared_expert_intermediate_size": 128})
    config = ModelConfig.from_pretrained(folder)
    weights, _ = load_weights(folder, config, quantize="fp8")
    ctx = RecordingContext()
    with pytest.raises(CudaBackendError, match="no FP8 path for routed experts"):
        upload_text_weights(ctx, config.text, weights, "bf16")
    assert not ctx.sent  # refused before any upload

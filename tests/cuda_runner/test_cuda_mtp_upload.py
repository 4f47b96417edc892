"""The MTP head's upload (gpu_engine/cuda/weights.py: mtp_head_problem, upload_mtp_weights) on the CPU, through a
recording stand-in for GpuContext: what reaches the device is the head's tensors in the runner's dtype, q|k|v and
gate|up fused as the trunk's, a MoE head's experts stacked by the trunk's MoE upload; a checkpoint without a head,
with part of one or with an FP8 head gets no MTP head and a reason."""
from __future__ import annotations

import numpy as np
import pytest

from gpu_engine.config import ModelConfig
from gpu_engine.cuda.bf16 import f32_to_bf16_bits
from gpu_engine.cuda.weights import mtp_head_problem, upload_mtp_weights
from gpu_engine.loader import ModelWeights, load_weights
from gpu_engine.reference.mtp import random_mtp_weights
from gpu_engine.tensors import Fp8Tensor
from gpu_engine.tiny import make_tiny_checkpoint
from gpu_engine.tiny_moe import make_tiny_moe_checkpoint
from tests.cuda_runner.recording_context import RecordingContext


def _weights(folder, mtp):
    config = ModelConfig.from_pretrained(folder)
    weights, _ = load_weights(folder, config)
    return config, ModelWeights(weights.text, weights.vision, weights.lm_head, mtp=mtp)


@pytest.mark.parametrize("dtype", ["bf16", "f32"])
def test_a_dense_head_reaches_the_device_fused_like_the_trunk(tmp_path, dtype: str) -> None:
    folder = make_tiny_checkpoint(tmp_path / "m", seed=2)
    config = ModelConfig.from_pretrained(folder)
    mtp = random_mtp_weights(config.text, seed=1)
    config, weights = _weights(folder, mtp)
    assert mtp_head_problem(config.text, weights) is None
    ctx = RecordingContext()
    head = upload_mtp_weights(ctx, config.text, weights, dtype)
    sent = ctx.sent

    def want(*names: str) -> np.ndarray:
        x = np.concatenate([mtp[n] for n in names])
        return f32_to_bf16_bits(x) if dtype == "bf16" else x

    a = "layers.0.self_attn."
    assert np.array_equal(sent["mtp.fc"], want("fc.weight"))
    assert np.array_equal(sent[a + "qkv"], want(a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"))
    assert np.array_equal(sent["layers.0.mlp.gate_up"], want("layers.0.mlp.gate_proj.weight",
                                                             "layers.0.mlp.up_proj.weight"))
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        assert np.array_equal(sent[f"mtp.{name}"], want(f"{name}.weight"))
    assert head.layer.kind == "full_attention" and head.nbytes == sum(v.nbytes for v in sent.values())


def test_a_moe_head_uploads_its_experts_stacked(tmp_path) -> None:
    folder = make_tiny_moe_checkpoint(tmp_path / "m", seed=2, mtp=True)
    config = ModelConfig.from_pretrained(folder)
    weights, _ = load_weights(folder, config)
    assert mtp_head_problem(config.text, weights) is None
    ctx = RecordingContext()
    upload_mtp_weights(ctx, config.text, weights, "bf16")
    moe = config.text.moe
    assert moe is not None
    stack = ctx.sent["layers.0.mlp.experts.gate_up"]
    assert stack.shape[0] in (moe.num_experts, moe.num_experts + 1)
    assert stack.shape[1:] == (2 * moe.moe_intermediate_size, config.text.hidden_size)


def test_no_head_part_of_one_or_an_fp8_one_leaves_the_runner_without(tmp_path) -> None:
    folder = make_tiny_checkpoint(tmp_path / "m", seed=2)
    config = ModelConfig.from_pretrained(folder)
    assert "no MTP head" in (mtp_head_problem(config.text, _weights(folder, None)[1]) or "")
    partial = random_mtp_weights(config.text)
    del partial["fc.weight"]
    assert "lacks mtp.fc.weight" in (mtp_head_problem(config.text, _weights(folder, partial)[1]) or "")
    fp8 = random_mtp_weights(config.text)
    q = fp8["layers.0.mlp.down_proj.weight"]
    fp8["layers.0.mlp.down_proj.weight"] = Fp8Tensor(np.zeros(q.shape, np.uint8), np.ones((1, 1), np.float32),
                                                     (128, 128), "F32")
    assert "FP8" in (mtp_head_problem(config.text, _weights(folder, fp8)[1]) or "")


def test_a_tiny_checkpoint_with_a_head_loads_it_and_uploads_its_stored_bits(tmp_path) -> None:
    """make_tiny_checkpoint(mtp=True) writes the 15 tensors of a dense head under `mtp.`; the loader keeps them,
    the reference runner drafts with them, and a bf16 upload sends the file's bits."""
    import gpu_engine
    from gpu_engine.reference.runner import ReferenceRunner

    folder = make_tiny_checkpoint(tmp_path / "m", seed=2, dtype="bfloat16", mtp=True)
    loaded = gpu_engine.load(folder)
    assert isinstance(loaded.runner, ReferenceRunner) and loaded.runner.mtp_head
    weights = loaded.runner.weights
    assert len(list(weights.mtp)) == 15 and mtp_head_problem(loaded.config.text, weights) is None
    ctx = RecordingContext()
    upload_mtp_weights(ctx, loaded.config.text, weights, "bf16")
    assert np.array_equal(ctx.sent["mtp.fc"], f32_to_bf16_bits(np.asarray(weights.mtp["fc.weight"], np.float32)))
    plain = make_tiny_checkpoint(tmp_path / "p", seed=2, dtype="bfloat16")
    assert np.array_equal(gpu_engine.load(plain).runner.weights.text["embed_tokens.weight"],
                          weights.text["embed_tokens.weight"])  # the head does not change the trunk's draw

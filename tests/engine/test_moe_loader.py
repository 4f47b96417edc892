"""Loading a qwen3_5_moe checkpoint: both expert layouts, one clear error per bad tensor (named as the checkpoint
names it), the fingerprint over the expert bytes, the cuda runner's gate (BF16 MoE taken, FP8 MoE refused), and the
unchanged serving surface (gpu_engine.load / Engine on an MoE model folder)."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from safetensors.numpy import load_file

import gpu_engine
from gpu_engine.config import ModelConfig
from gpu_engine.engine import Engine
from gpu_engine.engine_config import EngineConfig
from gpu_engine.loader import CheckpointError, IntegrityError, load_weights
from gpu_engine.model import RunnerUnavailableError
from gpu_engine.params import SamplingParams
from gpu_engine.reference.moe import MoeMlp
from gpu_engine.tiny import make_tiny_checkpoint, write_safetensors, write_sums
from gpu_engine.tiny_moe import make_tiny_moe_checkpoint, moe_random_weights

L0 = "model.language_model.layers.0.mlp."


@pytest.fixture(scope="module")
def fused(tmp_path_factory) -> Path:
    return make_tiny_moe_checkpoint(tmp_path_factory.mktemp("moe") / "fused", seed=5)


@pytest.fixture(scope="module")
def per_expert(tmp_path_factory) -> Path:
    return make_tiny_moe_checkpoint(tmp_path_factory.mktemp("moe") / "per_expert", seed=5, layout="per_expert")


def edited(folder: Path, tmp_path: Path, edit) -> Path:
    """A copy of `folder` whose model.safetensors (float32) went through `edit`, SHA256SUMS refreshed."""
    dst = shutil.copytree(folder, tmp_path / "edited")
    tensors = {k: np.array(v) for k, v in load_file(dst / "model.safetensors").items()}
    edit(tensors)
    write_safetensors(dst / "model.safetensors", tensors)
    write_sums(dst)
    return dst


def load_error(folder: Path) -> str:
    with pytest.raises(CheckpointError) as info:
        load_weights(folder, ModelConfig.from_pretrained(folder))
    return str(info.value)


def test_both_layouts_hold_the_same_experts(fused, per_expert):
    config = ModelConfig.from_pretrained(fused)
    a, _ = load_weights(fused, config)
    b, _ = load_weights(per_expert, config)
    inter = config.text.moe.moe_intermediate_size
    written = moe_random_weights(config, seed=5)
    np.testing.assert_array_equal(a.text["layers.2.mlp.experts.gate_up_proj"], written[
        "model.language_model.layers.2.mlp.experts.gate_up_proj"])
    np.testing.assert_array_equal(b.text["layers.2.mlp.experts.4.gate_proj.weight"],
                                  a.text["layers.2.mlp.experts.gate_up_proj"][4, :inter])
    np.testing.assert_array_equal(b.text["layers.2.mlp.experts.4.up_proj.weight"],
                                  a.text["layers.2.mlp.experts.gate_up_proj"][4, inter:])
    np.testing.assert_array_equal(b.text["layers.2.mlp.experts.4.down_proj.weight"],
                                  a.text["layers.2.mlp.experts.down_proj"][4])
    assert "layers.2.mlp.experts.gate_up_proj" not in b.text and "layers.2.mlp.gate_proj.weight" not in a.text


def test_bf16_and_sharded_per_expert_checkpoint_gives_the_fused_logits(tmp_path):
    ids = np.arange(3, 40)
    ref = gpu_engine.load(make_tiny_moe_checkpoint(tmp_path / "f", seed=2, dtype="bfloat16")).logits(ids)
    folder = make_tiny_moe_checkpoint(tmp_path / "p", seed=2, dtype="bfloat16", layout="per_expert", shards=3)
    assert len(list(folder.glob("model-*-of-00003.safetensors"))) == 3
    np.testing.assert_array_equal(gpu_engine.load(folder).logits(ids), ref)


def test_fingerprint_covers_every_expert_byte(fused, per_expert, tmp_path):
    base = gpu_engine.load(per_expert).fingerprint
    assert gpu_engine.load(fused).fingerprint != base  # same numbers, other files

    def nudge(tensors):
        tensors[L0 + "experts.5.down_proj.weight"][3, 7] += 1e-3

    changed = edited(per_expert, tmp_path, nudge)
    assert gpu_engine.load(changed).fingerprint != base


def test_a_missing_expert_is_named(per_expert, tmp_path):
    folder = edited(per_expert, tmp_path, lambda t: t.pop(L0 + "experts.3.up_proj.weight"))
    assert f"missing: {L0}experts.3.up_proj.weight" in load_error(folder)


def test_an_expert_of_the_wrong_shape_is_named(per_expert, tmp_path):
    def shrink(tensors):
        tensors[L0 + "experts.2.down_proj.weight"] = tensors[L0 + "experts.2.down_proj.weight"][:, :20]

    message = load_error(edited(per_expert, tmp_path, shrink))
    assert f"wrong shape: {L0}experts.2.down_proj.weight: (64, 20) (expected (64, 21))" in message


def test_fused_experts_of_the_wrong_count_or_shape_are_named(fused, tmp_path):
    def drop_one(tensors):
        tensors[L0 + "experts.gate_up_proj"] = tensors[L0 + "experts.gate_up_proj"][:5]
        tensors[L0 + "experts.down_proj"] = np.swapaxes(tensors[L0 + "experts.down_proj"], 1, 2)

    message = load_error(edited(fused, tmp_path, drop_one))
    assert f"{L0}experts.gate_up_proj: (5, 42, 64) (expected (6, 42, 64))" in message
    assert f"{L0}experts.down_proj: (6, 21, 64) (expected (6, 64, 21))" in message


def test_an_expert_beyond_num_experts_is_unexpected(per_expert, tmp_path):
    def add(tensors):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            tensors[L0 + f"experts.6.{proj}.weight"] = tensors[L0 + f"experts.0.{proj}.weight"].copy()

    assert f"unexpected: {L0}experts.6.down_proj.weight, {L0}experts.6.gate_proj.weight" in load_error(
        edited(per_expert, tmp_path, add))


def test_a_layer_mixing_both_layouts_keeps_the_fused_one_and_names_the_rest(fused, tmp_path):
    def mix(tensors):
        tensors[L0 + "experts.0.gate_proj.weight"] = tensors[L0 + "experts.gate_up_proj"][0, :21].copy()
        del tensors[L0 + "experts.down_proj"]

    message = load_error(edited(fused, tmp_path, mix))
    assert f"missing: {L0}experts.down_proj" in message
    assert f"unexpected: {L0}experts.0.gate_proj.weight" in message


def test_router_and_shared_expert_are_checked(fused, tmp_path):
    def damage(tensors):
        del tensors[L0 + "shared_expert_gate.weight"]
        tensors[L0 + "gate.weight"] = tensors[L0 + "gate.weight"][:5]

    message = load_error(edited(fused, tmp_path, damage))
    assert f"missing: {L0}shared_expert_gate.weight" in message
    assert f"wrong shape: {L0}gate.weight: (5, 64) (expected (6, 64))" in message


def test_dense_and_moe_checkpoints_do_not_pass_for_each_other(fused, tmp_path):
    dense = make_tiny_checkpoint(tmp_path / "dense", seed=5)
    moe_config = ModelConfig.from_pretrained(fused)
    with pytest.raises(CheckpointError, match=rf"missing: .*{L0}experts\.gate_up_proj.*unexpected: .*{L0}gate_proj"):
        load_weights(dense, moe_config)
    with pytest.raises(CheckpointError, match=rf"missing: .*{L0}gate_proj.weight.*unexpected: .*{L0}experts"):
        load_weights(fused, ModelConfig.from_pretrained(dense))


def test_cuda_runner_takes_a_bf16_moe_model(fused, tmp_path):
    """The refusal is lifted for BF16 MoE checkpoints (check_moe passes on the GPU, bench/results/cuda_notes.md):
    gpu_engine.load goes on to read the weights (here damaged, so it stops there, before any GPU is needed)."""
    folder = shutil.copytree(fused, tmp_path / "m")
    (folder / "model.safetensors").write_bytes(b"damaged")
    with pytest.raises(IntegrityError, match="model.safetensors"):
        gpu_engine.load(folder, runner="cuda")


@pytest.fixture(scope="module")
def fp8_moe(tmp_path_factory) -> Path:
    from gpu_engine.tiny_fp8 import make_tiny_fp8_checkpoint

    return make_tiny_fp8_checkpoint(tmp_path_factory.mktemp("fp8moe") / "m", seed=4, base=make_tiny_moe_checkpoint,
                                    layout="per_expert")


def test_cuda_runner_refuses_fp8_moe_before_reading_weights(fp8_moe, fused, tmp_path):
    """FP8 MoE stays refused on cuda (no FP8 expert stacks yet), an FP8 checkpoint and quantize='fp8' alike, before
    a weight file is read."""
    for source, quantize in ((fp8_moe, None), (fused, "fp8")):
        folder = shutil.copytree(source, tmp_path / f"m{quantize}")
        for f in folder.glob("*.safetensors"):
            f.write_bytes(b"not read")
        with pytest.raises(RunnerUnavailableError, match=r"mixture of experts\) from BF16 weights only.*issue 17"):
            gpu_engine.load(folder, runner="cuda", quantize=quantize)


def test_cli_says_why_it_cannot_run_an_fp8_moe_folder_on_cuda(fp8_moe):
    """python -m gpu_engine with runner cuda: the refusal as one line and exit code 2, no traceback."""
    cmd = [sys.executable, "-m", "gpu_engine", "generate", "--model", str(fp8_moe), "--runner", "cuda",
           "--prompt", "hi"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: runner='cuda' runs model_type='qwen3_5_moe' (a mixture of experts) from BF16")
    assert "Traceback" not in proc.stderr


def test_engine_serves_an_moe_folder_like_a_dense_one(per_expert):
    """The pipeline's door (Engine.from_pretrained + generate, continuous batching, an image prompt) on an MoE
    model dir: tokens equal the one-sequence oracle's."""
    oracle = gpu_engine.load(per_expert)
    assert all(isinstance(m, MoeMlp) for m in oracle.runner.text.mlps)
    rng = np.random.default_rng(9)
    picture = Image.fromarray(rng.integers(0, 256, (48, 80, 3), dtype=np.uint8))
    prompts = [rng.integers(0, 1500, size=n).tolist() for n in (5, 19, 11)]
    prompts.append([{"role": "user", "content": [{"type": "image", "image": picture},
                                                 {"type": "text", "text": "What does it say?"}]}])
    expected = [oracle.generate(p, max_tokens=12, stop_token_ids=[]) for p in prompts]
    engine = Engine.from_pretrained(per_expert, config=EngineConfig(max_num_seqs=3, max_batched_tokens=16,
                                                                    block_size=4))
    outs = engine.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
    assert [o.token_ids for o in outs] == expected
    assert engine.model_fingerprint == oracle.fingerprint  # what the pipeline records with every result
    computed = engine.stats()["prompt_tokens_computed"]
    again = engine.generate(prompts[3:], SamplingParams(max_tokens=12, ignore_eos=True))  # the prefix cache's turn
    assert again[0].token_ids == expected[3]
    assert engine.stats()["prompt_tokens_computed"] - computed < len(oracle.prepare(prompts[3])) // 2

"""bench/doc_throughput.py with mixture-of-experts shapes on the CPU (issue 17): tiny-moe runs end to end on the
reference runner from a folder of either expert layout, its limit counts active parameters, MoE on cuda refuses only
what the CUDA runner cannot do (FP8 experts) or the bench does not time (loading 70 GB), and the in-memory cuda
weights are the fused stacks cuda/moe_weights.py uploads."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import doc_models
import doc_throughput as dtp
import numpy as np
import pytest

from gpu_engine.config import ModelConfig

TINY = ["--image-max-pixels", str(64 * 32 * 32), "--photo-size", "640", "480", "--video-seconds", "2",
        "--video-size", "320", "240", "--submitters", "2", "--max-num-seqs", "4", "--max-batched-tokens", "256",
        "--kv-cache-gib", "0.05", "--encoder-cache-gib", "0.05"]


@pytest.mark.parametrize("layout", ["fused", "per_expert"])
def test_tiny_moe_runs_on_the_reference_runner(tmp_path: Path, layout: str) -> None:
    out = tmp_path / "doc.json"
    assert dtp.main(["--runner", "reference", "--shapes", "tiny-moe", *TINY, "--units", "1", "--mix", "1,0,0",
                     "--modes", "fixed8", "--expert-layout", layout, "--json", str(out)]) == 0
    [row] = json.loads(out.read_text())["rows"]
    assert row["shape"] == "tiny-moe" and row["tokens_per_page"] == 8 and row["expert_layout"] == layout
    assert "active parameters" in row["limit_basis"]
    assert 0 < row["fraction_of_limit"] < 1 and row["limit"]["decode_steps"] >= 1


def test_moe_folder_and_cost_follow_the_shape(tmp_path: Path) -> None:
    folder = doc_models.write_model("tiny-moe", tmp_path / "m", 0, 64 * 32 * 32, expert_layout="per_expert")
    engine = doc_models.build_engine(folder, "reference", dtp.parse_args(["--runner", "reference", *TINY]))
    cost = doc_models.model_cost(engine)
    moe = engine.runner.config.text.moe
    assert moe is not None and (cost.num_experts, cost.experts_per_token) == (moe.num_experts, moe.num_experts_per_tok)
    assert cost.expert_params == 3 * moe.moe_intermediate_size * engine.runner.config.text.hidden_size
    assert cost.weights_read(1) < cost.weights_read(4) < cost.weight_bytes


def _args(*extra: str) -> list[str]:
    return ["--runner", "cuda", "--shapes", "35b-a3b", *extra]


def test_moe_on_cuda_refuses_fp8_experts_and_loading() -> None:
    with pytest.raises(SystemExit, match="--load-weights"):
        dtp.parse_args(_args("--load-weights"))
    with pytest.raises(SystemExit, match="FP8 routed experts"):
        dtp.parse_args(_args("--quantize", "fp8"))
    with pytest.raises(SystemExit, match="unknown shape"):
        dtp.parse_args(["--runner", "reference", "--shapes", "35b"])
    args = dtp.parse_args(_args())
    assert doc_models.row_labels("35b-a3b", args)["expert_layout"] == "fused, in memory"
    assert doc_models.row_labels("9b", args) == {}
    dtp.parse_args(["--runner", "cuda", "--shapes", "9b,27b"])  # dense shapes need no flag


class _Built(Exception):
    """Raised by the stand-in CudaRunner with what it was given."""


def test_in_memory_cuda_weights_are_the_fused_expert_stacks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from gpu_engine.cuda import runner as cuda_runner
    from gpu_engine.cuda.moe_weights import stacked_experts, stacks_shared

    def capture(config: ModelConfig, weights: object, options: object) -> None:
        raise _Built(config, weights)

    monkeypatch.setattr(cuda_runner, "CudaRunner", capture)
    args = dtp.parse_args(["--runner", "cuda", "--shapes", "tiny-moe", *TINY])
    folder = doc_models.write_model("tiny-moe", tmp_path / "m", 0, 64 * 32 * 32, weights=False)
    assert not (folder / "model.safetensors").exists()
    with pytest.raises(_Built) as built:
        doc_models.in_memory_engine(folder, argparse.Namespace(), None, args.seed)
    config, weights = built.value.args
    moe, h = config.text.moe, config.text.hidden_size
    for layer in range(config.text.num_hidden_layers):
        prefix = f"layers.{layer}.mlp."
        assert weights.text[prefix + "experts.gate_up_proj"].dtype == np.uint16  # bf16 bits
        gate_up, down = stacked_experts(weights.text, prefix, moe)
        stacks = moe.num_experts + stacks_shared(moe, weights.text, prefix)
        assert gate_up.shape == (stacks, 2 * moe.moe_intermediate_size, h)
        assert down.shape == (stacks, h, moe.moe_intermediate_size)
        assert weights.text[prefix + "gate.weight"].shape == (moe.num_experts, h)
    assert weights.vision and all(not k.startswith("vision/") for k in weights.vision)

"""The MTP head of a qwen3_5_moe checkpoint (its layer's MLP is a mixture of experts, stored one tensor per expert as
in the published checkpoints; gpu_engine/tiny_moe.py writes it): the reference runner drafts with it, the engine's
drafts after every step equal the head run over the whole sequence at once, greedy output equals plain decoding; the
loader names what is wrong in an MoE head's tensors."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from test_spec_mtp import PROMPTS, from_scratch, run_checking_drafts

import gpu_engine
from gpu_engine.config import ModelConfig
from gpu_engine.engine import Engine
from gpu_engine.engine_config import EngineConfig
from gpu_engine.loader import ModelWeights, load_weights
from gpu_engine.params import SamplingParams
from gpu_engine.reference.moe import MoeMlp
from gpu_engine.reference.mtp import random_mtp_weights
from gpu_engine.reference.runner import ReferenceRunner
from gpu_engine.speculative import SpeculativeConfig
from gpu_engine.tensors import CheckpointError, read_safetensors
from gpu_engine.tiny import write_sums
from gpu_engine.tiny_fp8 import write_tagged_safetensors
from gpu_engine.tiny_moe import make_tiny_moe_checkpoint
from gpu_engine.tokenizer import Tokenizer

K = 3


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_moe_checkpoint(tmp_path_factory.mktemp("tiny_moe") / "m", seed=4, mtp=True)


def moe_engine(folder: Path, k: int = K) -> Engine:
    loaded = gpu_engine.load(folder)
    return Engine(loaded.runner, Tokenizer.from_pretrained(folder), vocab_size=loaded.config.text.vocab_size,
                  config=EngineConfig(max_num_seqs=3, block_size=4), speculative=SpeculativeConfig(num_tokens=k),
                  prepare=loaded.prepare)


def test_the_checkpoint_holds_the_head_with_experts_one_tensor_per_expert(folder: Path) -> None:
    names = {n for f in folder.glob("*.safetensors") for n in read_safetensors(f)}
    moe = ModelConfig.from_pretrained(folder).text.moe
    assert moe is not None
    for e in range(moe.num_experts):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            assert f"mtp.layers.0.mlp.experts.{e}.{proj}.weight" in names
    assert "mtp.layers.0.mlp.experts.gate_up_proj" not in names and "mtp.layers.0.mlp.gate_proj.weight" not in names
    runner = gpu_engine.load(folder).runner
    assert isinstance(runner, ReferenceRunner) and runner.mtp is not None and isinstance(runner.mtp.mlp, MoeMlp)


def test_moe_mtp_drafts_equal_the_head_over_the_whole_sequence_and_output_is_exact(folder: Path) -> None:
    plain = moe_engine(folder, k=0)
    want = {f"r{i}": plain.generate([p], SamplingParams(max_tokens=24, ignore_eos=True))[0].token_ids
            for i, p in enumerate(PROMPTS)}
    eng = moe_engine(folder)
    got, checked = run_checking_drafts(eng, PROMPTS)
    assert got == want
    st = eng.stats()
    assert checked > 20 and st["mtp_head_runs"] > 20 and st["spec_draft_tokens"] > 20


def test_the_head_routes_through_its_own_experts(folder: Path) -> None:
    """The drafts depend on the MTP layer's experts (not the trunk's, not a dense MLP): changing one expert the head
    routes to changes what from_scratch drafts; the fused layout of the same numbers drafts the same."""
    eng = moe_engine(folder)
    rid = eng.add_request(PROMPTS[0], SamplingParams(max_tokens=8, ignore_eos=True, speculative="mtp"))
    seq = eng._live[rid]
    for _ in range(3):  # the prompt, then the head drafts
        eng.step()
        if seq.mtp_drafts:
            break
    runner = eng.runner
    assert isinstance(runner, ReferenceRunner) and seq.mtp_drafts == from_scratch(runner, seq, K)
    mtp = dict(runner.weights.mtp)
    cfg = runner.config.text
    assert cfg.moe is not None
    fused = dict(mtp)
    prefix = "layers.0.mlp.experts."
    e_range = range(cfg.moe.num_experts)
    fused[prefix + "gate_up_proj"] = np.stack([np.concatenate([mtp[f"{prefix}{e}.gate_proj.weight"],
                                                               mtp[f"{prefix}{e}.up_proj.weight"]]) for e in e_range])
    fused[prefix + "down_proj"] = np.stack([mtp[f"{prefix}{e}.down_proj.weight"] for e in e_range])
    for e in e_range:
        for proj in ("gate_proj", "up_proj", "down_proj"):
            del fused[f"{prefix}{e}.{proj}.weight"]
    w = runner.weights
    as_fused = ReferenceRunner(runner.config, ModelWeights(w.text, w.vision, w.lm_head, mtp=fused))
    assert from_scratch(as_fused, seq, K) == seq.mtp_drafts
    changed = 0
    for e in e_range:  # drafts of random heads hang on little; some expert's down projection must matter
        edited = dict(mtp)
        edited[f"{prefix}{e}.down_proj.weight"] = 50.0 * mtp[f"{prefix}{e}.down_proj.weight"]
        other = ReferenceRunner(runner.config, ModelWeights(w.text, w.vision, w.lm_head, mtp=edited))
        changed += from_scratch(other, seq, K) != seq.mtp_drafts
    assert changed > 0


def rewrite_mtp(folder: Path, edit) -> None:  # type: ignore[no-untyped-def]
    """Rewrite the single weight file with `edit` applied to its {name: (dtype, raw array)} table."""
    path = folder / "model.safetensors"
    tensors = {n: (t.dtype, np.array(t.raw)) for n, t in read_safetensors(path).items()}
    edit(tensors)
    write_tagged_safetensors(path, tensors)
    write_sums(folder)


def load_error(folder: Path) -> str:
    with pytest.raises(CheckpointError) as info:
        load_weights(folder, ModelConfig.from_pretrained(folder))
    return str(info.value)


def test_the_loader_names_what_is_wrong_in_an_moe_head(tmp_path: Path) -> None:
    folder = make_tiny_moe_checkpoint(tmp_path / "m", seed=4, mtp=True)
    p = "mtp.layers.0.mlp."

    def break_it(t):  # type: ignore[no-untyped-def]
        del t[p + "experts.3.up_proj.weight"]  # one expert incomplete
        dtype, raw = t[p + "experts.1.down_proj.weight"]
        t[p + "experts.1.down_proj.weight"] = (dtype, raw[:, :-1].copy())  # a wrong shape
        t[p + "gate_proj.weight"] = (dtype, np.zeros((4, 4), raw.dtype))  # a dense MLP's name in an MoE head

    rewrite_mtp(folder, break_it)
    msg = load_error(folder)
    assert "missing: mtp.layers.0.mlp.experts.3.up_proj.weight" in msg
    assert "mtp.layers.0.mlp.experts.1.down_proj.weight: (64, 20) (expected (64, 21))" in msg
    assert "unexpected: mtp.layers.0.mlp.gate_proj.weight" in msg


def test_an_moe_head_without_the_mtp_layer_mlp_loads_without_a_drafter(tmp_path: Path) -> None:
    """A head whose MoE MLP is absent altogether is incomplete, not broken: it loads, with no MTP drafter."""
    folder = make_tiny_moe_checkpoint(tmp_path / "m", seed=4, mtp=True)
    rewrite_mtp(folder, lambda t: [t.pop(n) for n in list(t) if n.startswith("mtp.layers.0.mlp.")])
    loaded = gpu_engine.load(folder)
    assert isinstance(loaded.runner, ReferenceRunner) and not loaded.runner.mtp_head
    assert json.loads((folder / "config.json").read_text())["model_type"] == "qwen3_5_moe"


def test_random_mtp_weights_fit_an_moe_config(folder: Path) -> None:
    cfg = ModelConfig.from_pretrained(folder).text
    for per_expert in (True, False):
        w = random_mtp_weights(cfg, per_expert=per_expert)
        assert ("layers.0.mlp.experts.0.gate_proj.weight" in w) is per_expert
        assert ("layers.0.mlp.experts.gate_up_proj" in w) is not per_expert

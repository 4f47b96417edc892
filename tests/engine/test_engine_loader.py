"""Loader: dtypes, shards, name layouts, integrity, fingerprint, and one clear error per kind of bad checkpoint."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from ci_rule import require_module
from safetensors.numpy import load_file, save_file

import gpu_engine
from gpu_engine.bundled import bundled_model_dir
from gpu_engine.config import ConfigError, ModelConfig, UnsupportedModelError
from gpu_engine.loader import CheckpointError, IntegrityError, load_weights
from gpu_engine.tiny import make_tiny_checkpoint, random_weights, write_safetensors, write_sums


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "m", seed=3)


@pytest.fixture
def copy_of(tiny, tmp_path):
    def make(name: str = "m") -> Path:
        dst = tmp_path / name
        shutil.copytree(tiny, dst)
        return dst

    return make


def rewrite(folder: Path, edit) -> None:
    """Apply `edit` to the tensors of model.safetensors (float32) and refresh SHA256SUMS."""
    tensors = {k: np.array(v) for k, v in load_file(folder / "model.safetensors").items()}
    edit(tensors)
    write_safetensors(folder / "model.safetensors", tensors)
    write_sums(folder)


def test_tiny_checkpoint_is_deterministic_and_complete(tiny, tmp_path):
    again = make_tiny_checkpoint(tmp_path / "again", seed=3)
    assert (again / "SHA256SUMS").read_text() == (tiny / "SHA256SUMS").read_text()
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                 "tokenizer_config.json", "chat_template.jinja", "preprocessor_config.json",
                 "video_preprocessor_config.json"):
        assert (tiny / name).is_file(), name
    other = make_tiny_checkpoint(tmp_path / "other", seed=4)
    assert gpu_engine.load(other).fingerprint != gpu_engine.load(tiny).fingerprint


def test_weights_land_under_our_names_with_values(tiny):
    config = ModelConfig.from_pretrained(tiny)
    weights, _ = load_weights(tiny, config)
    expected = random_weights(config, seed=3)
    np.testing.assert_array_equal(weights.text["layers.0.linear_attn.in_proj_qkv.weight"],
                                  expected["model.language_model.layers.0.linear_attn.in_proj_qkv.weight"])
    np.testing.assert_array_equal(weights.vision["blocks.1.attn.qkv.weight"],
                                  expected["model.visual.blocks.1.attn.qkv.weight"])
    np.testing.assert_array_equal(weights.lm_head, expected["lm_head.weight"])
    assert weights.mtp == {}
    assert all(a.dtype == np.float32 for a in weights.text.values())


def test_bf16_and_sharded_checkpoints_load_exactly(tmp_path):
    torch = require_module("torch")
    fp32 = make_tiny_checkpoint(tmp_path / "fp32", seed=5)
    bf16 = make_tiny_checkpoint(tmp_path / "bf16", seed=5, dtype="bfloat16", shards=3)
    assert (bf16 / "model.safetensors.index.json").is_file()
    config = ModelConfig.from_pretrained(fp32)
    w32, _ = load_weights(fp32, config)
    w16, _ = load_weights(bf16, config)
    for name, array in w32.text.items():
        rounded = torch.from_numpy(np.array(array)).to(torch.bfloat16).to(torch.float32).numpy()
        np.testing.assert_array_equal(w16.text[name], rounded, err_msg=name)


def test_fp16_tensors_are_widened(copy_of):
    folder = copy_of()
    tensors = load_file(folder / "model.safetensors")
    save_file({k: v.astype(np.float16) for k, v in tensors.items()}, str(folder / "model.safetensors"))
    write_sums(folder)
    config = ModelConfig.from_pretrained(folder)
    weights, _ = load_weights(folder, config)
    want = tensors["model.language_model.embed_tokens.weight"].astype(np.float16).astype(np.float32)
    np.testing.assert_array_equal(weights.text["embed_tokens.weight"], want)


def test_legacy_names_tied_head_and_mtp_tensors(copy_of):
    folder = copy_of()
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text())
    config["tie_word_embeddings"] = True
    config_path.write_text(json.dumps(config))

    def edit(t):
        for name in list(t):
            if name.startswith("model.language_model."):
                t["model." + name[len("model.language_model."):]] = t.pop(name)
            elif name.startswith("model.visual."):
                t["visual." + name[len("model.visual."):]] = t.pop(name)
        del t["lm_head.weight"]
        t["mtp.fc.weight"] = np.ones((64, 128), np.float32)

    rewrite(folder, edit)
    weights, _ = load_weights(folder, ModelConfig.from_pretrained(folder))
    assert weights.lm_head is weights.text["embed_tokens.weight"]
    assert "blocks.0.norm1.weight" in weights.vision
    np.testing.assert_array_equal(weights.mtp["fc.weight"], np.ones((64, 128), np.float32))


def test_missing_unexpected_and_misshaped_tensors_are_listed_together(copy_of):
    folder = copy_of()

    def edit(t):
        del t["model.language_model.layers.1.linear_attn.A_log"]
        t["model.language_model.layers.0.mlp.up_proj.weight"] = np.zeros((3, 3), np.float32)
        t["something.else"] = np.zeros(2, np.float32)

    rewrite(folder, edit)
    with pytest.raises(CheckpointError) as info:
        gpu_engine.load(folder)
    message = str(info.value)
    assert "missing: model.language_model.layers.1.linear_attn.A_log" in message
    assert "unexpected: something.else" in message
    assert "model.language_model.layers.0.mlp.up_proj.weight: (3, 3) (expected (128, 64))" in message


def test_missing_lm_head_when_untied(copy_of):
    folder = copy_of()
    rewrite(folder, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(CheckpointError, match="missing: lm_head.weight"):
        gpu_engine.load(folder)


def test_truncated_safetensors(copy_of):
    folder = copy_of()
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) - 1000])
    (folder / "SHA256SUMS").unlink()
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        gpu_engine.load(folder)


def test_no_weights_and_broken_index(copy_of):
    folder = copy_of()
    (folder / "model.safetensors").unlink()
    (folder / "SHA256SUMS").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        gpu_engine.load(folder)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "model-1.safetensors"}}))
    with pytest.raises(CheckpointError, match="do not exist: model-1.safetensors"):
        gpu_engine.load(folder)


def test_unknown_model_type(copy_of):
    folder = copy_of()
    config = json.loads((folder / "config.json").read_text())
    config["model_type"] = "qwen2_vl"
    (folder / "config.json").write_text(json.dumps(config))
    write_sums(folder)
    with pytest.raises(UnsupportedModelError, match="model_type='qwen2_vl'"):
        gpu_engine.load(folder)


def test_integrity_errors(copy_of):
    folder = copy_of()
    # one flipped byte in the weights
    data = bytearray((folder / "model.safetensors").read_bytes())
    data[-1] ^= 1
    (folder / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match="model.safetensors: sha256"):
        gpu_engine.load(folder)
    # malformed SHA256SUMS line
    write_sums(folder)
    (folder / "SHA256SUMS").write_text("abc  config.json\n")
    with pytest.raises(IntegrityError, match="expected '<64 hex digits>"):
        gpu_engine.load(folder)
    # SHA256SUMS that does not cover the weights
    write_sums(folder)
    lines = [line for line in (folder / "SHA256SUMS").read_text().splitlines() if "model.safetensors" not in line]
    (folder / "SHA256SUMS").write_text("\n".join(lines) + "\n")
    with pytest.raises(IntegrityError, match="do not cover model.safetensors"):
        gpu_engine.load(folder)
    # a listed file that is gone
    write_sums(folder)
    (folder / "tokenizer.json").unlink()
    with pytest.raises(IntegrityError, match="tokenizer.json: listed but missing"):
        gpu_engine.load(folder)


def test_caller_digests_override_sums_file(copy_of):
    folder = copy_of()
    (folder / "SHA256SUMS").unlink()
    good = {line.split()[1]: line.split()[0] for line in _sums(folder)}
    gpu_engine.load(folder, expected_digests=good)
    bad = {**good, "config.json": "0" * 64}
    with pytest.raises(IntegrityError, match="config.json: sha256"):
        gpu_engine.load(folder, expected_digests=bad)


def _sums(folder: Path) -> list[str]:
    write_sums(folder)
    lines = (folder / "SHA256SUMS").read_text().splitlines()
    (folder / "SHA256SUMS").unlink()
    return lines


def test_fingerprint_is_location_independent_and_content_sensitive(tiny, copy_of):
    a = gpu_engine.load(tiny).fingerprint
    moved = copy_of("elsewhere")
    assert gpu_engine.load(moved).fingerprint == a
    (moved / "SHA256SUMS").unlink()
    config = json.loads((moved / "config.json").read_text())
    config["text_config"]["rms_norm_eps"] = 1e-5
    (moved / "config.json").write_text(json.dumps(config))
    assert gpu_engine.load(moved).fingerprint != a
    assert len(a) == 64 and int(a, 16) >= 0


def test_runner_names(tiny):
    with pytest.raises(ValueError, match="unknown runner 'tpu'"):
        gpu_engine.load(tiny, runner="tpu")


def test_config_error_is_reported_before_weights(tmp_path):
    with pytest.raises(ConfigError, match="config.json not found"):
        gpu_engine.load(tmp_path)


def test_reference_path_never_imports_torch(tiny):
    code = (
        "import sys, gpu_engine\n"
        f"m = gpu_engine.load({str(tiny)!r})\n"
        "assert m.logits([1, 2, 3]).shape[0] == 3\n"
        "m.generate([1, 2, 3], max_tokens=2)\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[2])


def test_bundled_model_is_generated_once_and_repaired(tmp_path, monkeypatch):
    monkeypatch.setenv("DOCPIPE_CACHE_DIR", str(tmp_path))
    first = bundled_model_dir()
    assert first.is_relative_to(tmp_path)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert bundled_model_dir() == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp  # reused, not rewritten
    fingerprint = gpu_engine.load(first).fingerprint
    (first / "model.safetensors").write_bytes(b"damaged")
    repaired = bundled_model_dir()
    assert gpu_engine.load(repaired).fingerprint == fingerprint
    assert not [p for p in repaired.parent.iterdir() if p.name.startswith(".")]  # no staging left behind


def test_missing_tokenizer_is_reported_when_a_chat_prompt_needs_it(copy_of):
    from gpu_engine.tokenizer import TokenizerError

    folder = copy_of()
    (folder / "tokenizer.json").unlink()
    with pytest.raises(IntegrityError, match="tokenizer.json: listed but missing"):  # SHA256SUMS catches it first
        gpu_engine.load(folder)
    (folder / "SHA256SUMS").unlink()
    model = gpu_engine.load(folder)
    assert model.logits([1, 2]).shape[0] == 2  # token ids need no tokenizer
    with pytest.raises(TokenizerError, match="no tokenizer.json"):
        model.logits_for_messages([{"role": "user", "content": "hi"}])


def test_duplicate_tensor_under_two_names(copy_of):
    folder = copy_of()

    def edit(t):
        t["model.norm.weight"] = t["model.language_model.norm.weight"].copy()  # old and new layout at once

    rewrite(folder, edit)
    with pytest.raises(CheckpointError, match="duplicate of"):
        gpu_engine.load(folder)


def test_cuda_options_reach_the_cuda_runner_and_only_it(tiny, monkeypatch):
    """gpu_engine.load passes cuda_options to the cuda runner (bench/cuda_stream_bench builds its float32 engine
    through Engine.from_pretrained that way), and without them reads the DOCPIPE_CUDA_* variables; with the
    reference runner they are refused, not ignored."""
    import types

    import gpu_engine.model
    from gpu_engine.cuda.options import CudaOptions
    from gpu_engine.engine import Engine

    options = CudaOptions(dtype="f32", memory_budget=1 << 30)
    with pytest.raises(ValueError, match="cuda_options are for runner='cuda'"):
        gpu_engine.load(tiny, runner="reference", cuda_options=options)

    class FakeCudaRunner:  # stands in for gpu_engine.cuda.runner.CudaRunner (no GPU here)
        def __init__(self, config, weights, options):
            self.options = options

    monkeypatch.setitem(sys.modules, "gpu_engine.cuda.runner", types.SimpleNamespace(CudaRunner=FakeCudaRunner))
    loaded = gpu_engine.load(tiny, runner="cuda", cuda_options=options)
    assert loaded.runner.options == options
    monkeypatch.setenv("DOCPIPE_CUDA_GRAPHS", "0")
    monkeypatch.setenv("DOCPIPE_CUDA_ENCODER_MEMORY", str(1 << 20))
    from_env = gpu_engine.load(tiny, runner="cuda").runner.options
    assert from_env == CudaOptions(use_graphs=False, encoder_memory=1 << 20)

    class Stop(Exception):
        pass

    def fake_load(folder, **kwargs):
        raise Stop(kwargs)

    monkeypatch.setattr(gpu_engine.model, "load", fake_load)
    with pytest.raises(Stop) as stopped:
        Engine.from_pretrained(tiny, runner="cuda", cuda_options=options)
    assert stopped.value.args[0]["cuda_options"] == options


def test_cuda_options_are_validated_and_read_from_the_environment_in_one_place():
    from gpu_engine.cuda.errors import ShapeError
    from gpu_engine.cuda.options import CudaOptions

    env = {"DOCPIPE_CUDA_MEMORY_FRACTION": "0.5", "DOCPIPE_CUDA_GRAPHS": "0", "DOCPIPE_CUDA_GRAPH_MEMORY": "1024",
           "DOCPIPE_CUDA_PDL": "1", "DOCPIPE_CUDA_ENCODER_MEMORY": "2048", "DOCPIPE_CUDA_CACHE": "/tmp/cubins"}
    assert CudaOptions.from_env(env, dtype="f32") == CudaOptions(
        dtype="f32", memory_fraction=0.5, use_graphs=False, graph_memory=1024, use_pdl=True, encoder_memory=2048,
        module_cache=Path("/tmp/cubins"))
    assert CudaOptions.from_env({}) == CudaOptions()
    with pytest.raises(ShapeError, match="DOCPIPE_CUDA_MEMORY_FRACTION"):
        CudaOptions.from_env({"DOCPIPE_CUDA_MEMORY_FRACTION": "1.5"})
    with pytest.raises(ShapeError, match="dtype"):
        CudaOptions(dtype="fp8")
    with pytest.raises(TypeError, match="unknown CudaOptions"):
        CudaOptions.from_env({}, graphs=False)

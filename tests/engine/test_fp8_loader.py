"""Loader on block-FP8 checkpoints: the official layout read exactly, one clear error per kind of bad file, the raw
(bf16 bits) accessor, FP8 from BF16 at load, and the cuda runner's refusal."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from fp8_truth import dequantize64

import gpu_engine
from gpu_engine import fp8
from gpu_engine.config import ConfigError, ModelConfig, UnsupportedModelError
from gpu_engine.fp8_checkpoint import QUANTIZE_VARIANT
from gpu_engine.loader import CheckpointError, load_weights
from gpu_engine.model import RunnerUnavailableError
from gpu_engine.tensors import read_safetensors
from gpu_engine.tiny import make_tiny_checkpoint, write_sums
from gpu_engine.tiny_fp8 import make_tiny_fp8_checkpoint, write_tagged_safetensors

T = "model.language_model."
QUANTISED = ("linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.out_proj", "mlp.gate_proj",
             "mlp.up_proj", "mlp.down_proj", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
             "self_attn.o_proj")
# Ragged everywhere: hidden 192 = 128 + 64, intermediate 320 = 2 * 128 + 64.
RAGGED = {"text_config": {"hidden_size": 192, "intermediate_size": 320}, "vision_config": {"out_hidden_size": 192}}


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory) -> Path:
    seed = int(np.random.default_rng().integers(99))
    return make_tiny_fp8_checkpoint(tmp_path_factory.mktemp("fp8") / "m", seed=seed, **RAGGED)


@pytest.fixture
def copy_of(fp8_dir, tmp_path):
    def make() -> Path:
        return Path(shutil.copytree(fp8_dir, tmp_path / "m"))

    return make


def stored(folder: Path) -> dict[str, tuple[str, np.ndarray]]:
    return {n: (t.dtype, np.array(t.raw)) for n, t in read_safetensors(folder / "model.safetensors").items()}


def rewrite(folder: Path, edit) -> None:
    tensors = stored(folder)
    edit(tensors)
    write_tagged_safetensors(folder / "model.safetensors", tensors)
    write_sums(folder)


def edit_config(folder: Path, edit) -> None:
    config = json.loads((folder / "config.json").read_text())
    edit(config["quantization_config"])
    (folder / "config.json").write_text(json.dumps(config))
    write_sums(folder)


def load_error(folder: Path, error=CheckpointError) -> str:
    with pytest.raises(error) as info:
        gpu_engine.load(folder)
    return str(info.value)


def test_official_layout_loads_every_quantised_linear_exactly(fp8_dir):
    config = ModelConfig.from_pretrained(fp8_dir)
    assert config.quantization is not None and config.quantization.weight_block_size == (128, 128)
    weights, _ = load_weights(fp8_dir, config)
    want = {f"text/layers.{i}.{m}.weight" for i, kind in enumerate(config.text.layer_types) for m in QUANTISED
            if m.startswith("mlp") or m.startswith("linear_attn" if kind == "linear_attention" else "self_attn")}
    assert set(weights.fp8_names()) == want
    files = stored(fp8_dir)
    for name in want:
        ckpt = T + name.split("/", 1)[1]
        tensor = weights.text.fp8(name.split("/", 1)[1])
        dtype, bits = files[ckpt]
        scale_dtype, scale = files[ckpt + "_scale_inv"]
        assert dtype == "F8_E4M3" and scale_dtype == "BF16" == tensor.scale_dtype
        np.testing.assert_array_equal(tensor.bits, bits)
        scale64 = (scale.astype(np.uint32) << 16).view(np.float32)
        assert tensor.scale_inv.shape == (-(-bits.shape[0] // 128), -(-bits.shape[1] // 128))
        np.testing.assert_array_equal(weights.text[name.split("/", 1)[1]],
                                      dequantize64(bits, scale64).astype(np.float32))
    # what stays BF16 is read as before
    for name in ("layers.0.linear_attn.in_proj_a.weight", "layers.0.linear_attn.conv1d.weight", "embed_tokens.weight"):
        assert weights.text.fp8(name) is None and weights.text.stored_dtype(name) == "BF16"
    assert weights.vision["blocks.0.attn.qkv.weight"].dtype == np.float32 and not weights.vision.fp8_names()


@pytest.mark.parametrize("scale_dtype", ["F32", "BF16"])
def test_f32_and_bf16_scales_are_accepted(tmp_path, scale_dtype):
    folder = make_tiny_fp8_checkpoint(tmp_path / "m", seed=2, scale_dtype=scale_dtype)
    weights, _ = load_weights(folder, ModelConfig.from_pretrained(folder))
    tensor = weights.text.fp8("layers.3.self_attn.q_proj.weight")
    assert tensor is not None and tensor.scale_dtype == scale_dtype and tensor.scale_inv.dtype == np.float32


def test_fingerprint_covers_the_scales(copy_of):
    folder = copy_of()
    (folder / "SHA256SUMS").unlink()
    before = gpu_engine.load(folder)
    name = T + "layers.0.mlp.up_proj.weight_scale_inv"

    def double_one_scale(t):
        dtype, scale = t[name]
        scale = scale.copy()
        scale[0, 0] += 1 << 7  # bf16 exponent + 1: that block's scale doubles
        t[name] = (dtype, scale)

    rewrite(folder, double_one_scale)
    (folder / "SHA256SUMS").unlink()
    after = gpu_engine.load(folder)
    assert after.fingerprint != before.fingerprint
    w0 = before.runner.weights.text["layers.0.mlp.up_proj.weight"]
    w1 = after.runner.weights.text["layers.0.mlp.up_proj.weight"]
    np.testing.assert_array_equal(w1[:128, :128], 2 * w0[:128, :128])
    np.testing.assert_array_equal(w1[128:], w0[128:])


def test_scale_of_the_wrong_shape(copy_of):
    folder = copy_of()
    name = T + "layers.1.mlp.down_proj.weight_scale_inv"
    rewrite(folder, lambda t: t.__setitem__(name, (t[name][0], t[name][1][:, :1].copy())))
    message = load_error(folder)
    assert f"{name} has shape (2, 1); a (192, 320) weight in 128x128 blocks needs (2, 3)" in message


def test_unsupported_block_size_and_format_are_refused_by_name(copy_of):
    folder = copy_of()
    edit_config(folder, lambda q: q.__setitem__("weight_block_size", [64, 64]))
    assert "weight_block_size=[64, 64] is not supported (only [128, 128]" in load_error(folder, UnsupportedModelError)
    for key, value in (("fmt", "e5m2"), ("activation_scheme", "static"), ("quant_method", "gptq"),
                       ("scale_fmt", "ue8m0")):
        raw = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
               key: value}
        with pytest.raises(UnsupportedModelError, match=f"{key}={value!r} is not supported"):
            gpu_engine.config.Fp8Config.from_dict(raw, "config.json")
    with pytest.raises(ConfigError, match="weight_block_size must be a list of two integers"):
        gpu_engine.config.Fp8Config.from_dict({"weight_block_size": 128}, "config.json")
    with pytest.raises(ConfigError, match="modules_to_not_convert must be a list"):
        gpu_engine.config.Fp8Config.from_dict({"weight_block_size": [128, 128], "modules_to_not_convert": "x"}, "c")


def test_module_listed_as_converted_but_stored_bf16(copy_of):
    folder = copy_of()
    name = T + "layers.2.linear_attn.out_proj.weight"
    bf16 = stored(make_tiny_checkpoint(folder.parent / "bf16", seed=0, dtype="bfloat16", **RAGGED))

    def back_to_bf16(t):
        t[name] = bf16[name]
        del t[name + "_scale_inv"]

    rewrite(folder, back_to_bf16)
    message = load_error(folder)
    assert (f"{name} is stored BF16, but modules_to_not_convert does not list "
            f"{name[:-len('.weight')]}, so quantization_config says it is F8_E4M3") in message


def test_scale_missing(copy_of):
    folder = copy_of()
    name = T + "layers.3.self_attn.k_proj.weight"
    rewrite(folder, lambda t: t.pop(name + "_scale_inv"))
    assert f"{name} is stored F8_E4M3 but its scale {name}_scale_inv is missing" in load_error(folder)


def test_fp8_weight_of_a_module_the_list_keeps(copy_of):
    folder = copy_of()
    module = T + "layers.3.self_attn.v_proj"
    edit_config(folder, lambda q: q["modules_to_not_convert"].append(module))
    assert f"{module}.weight is stored F8_E4M3 but modules_to_not_convert lists {module}" in load_error(folder)


def test_fp8_tensors_without_quantization_config(copy_of):
    folder = copy_of()
    config = json.loads((folder / "config.json").read_text())
    del config["quantization_config"]
    (folder / "config.json").write_text(json.dumps(config))
    write_sums(folder)
    message = load_error(folder)
    assert f"{T}layers.0.mlp.up_proj.weight is stored F8_E4M3 but config.json has no quantization_config" in message
    assert message.count("has no quantization_config") == 25  # every FP8 tensor is named, in one error


def test_bad_scales_and_stray_tensors_are_all_named_at_once(copy_of):
    folder = copy_of()
    a, b, c, d = (T + f"layers.{i}.mlp.gate_proj.weight" for i in range(4))
    conv = T + "layers.0.linear_attn.conv1d.weight"
    kept = T + "layers.1.linear_attn.in_proj_a.weight"

    def damage(t):
        t[a + "_scale_inv"] = ("F16", t[a + "_scale_inv"][1].copy())  # bits now read as fp16: wrong dtype anyway
        bad = t[b + "_scale_inv"][1].copy()
        bad[0, 0] = 0  # bf16 +0: not a usable scale
        t[b + "_scale_inv"] = ("BF16", bad)
        nan = t[c + "_scale_inv"][1].copy()
        nan[1, 1] = 0x7FC0
        t[c + "_scale_inv"] = ("BF16", nan)
        t[T + "layers.9.mlp.up_proj.weight_scale_inv"] = t.pop(d + "_scale_inv")  # a scale without its weight
        t[kept + "_scale_inv"] = ("BF16", np.full((1, 2), 0x3F80, np.uint16))  # a scale for a BF16 weight
        t[conv] = ("F8_E4M3", np.zeros(t[conv][1].shape, np.uint8))  # FP8 where only Linears may be

    rewrite(folder, damage)
    message = load_error(folder)
    for part in (f"{a}_scale_inv is stored F16; scales must be BF16 or F32",
                 f"{b}_scale_inv holds scales that are not finite and positive",
                 f"{c}_scale_inv holds scales that are not finite and positive",
                 f"{d} is stored F8_E4M3 but its scale {d}_scale_inv is missing",
                 f"{T}layers.9.mlp.up_proj.weight_scale_inv has no weight {T}layers.9.mlp.up_proj.weight",
                 f"{kept} is stored BF16 but has a scale {kept}_scale_inv",
                 f"{conv} is stored F8_E4M3 but is not a Linear weight"):
        assert part in message, part


def test_raw_accessor_gives_the_stored_bf16_bits_without_a_float32_copy(tmp_path):
    folder = make_tiny_checkpoint(tmp_path / "m", seed=4, dtype="bfloat16")
    weights, _ = load_weights(folder, ModelConfig.from_pretrained(folder))
    files = stored(folder)
    name = "layers.0.mlp.up_proj.weight"
    raw = weights.text.raw(name)
    assert raw.dtype == np.uint16 and not raw.flags.writeable and not raw.flags.owndata  # a view of the file
    np.testing.assert_array_equal(raw, files[T + name][1])
    assert weights.text.stored_dtype(name) == "BF16"
    assert not weights.text._float32, "reading raw bits made a float32 copy"
    np.testing.assert_array_equal(weights.raw_lm_head(), files["lm_head.weight"][1])
    np.testing.assert_array_equal(weights.text[name], (raw.astype(np.uint32) << 16).view(np.float32))
    assert weights.text[name] is weights.text[name]  # converted once, then kept
    fp8_folder = make_tiny_fp8_checkpoint(tmp_path / "f", seed=4)
    fp8_weights, _ = load_weights(fp8_folder, ModelConfig.from_pretrained(fp8_folder))
    with pytest.raises(TypeError, match=r"block-FP8 weight: read its bits and scales with fp8"):
        fp8_weights.text.raw(name)


def test_tied_head_reads_the_embedding(tmp_path):
    folder = make_tiny_checkpoint(tmp_path / "m", seed=4, dtype="bfloat16", tie_word_embeddings=True)
    weights, _ = load_weights(folder, ModelConfig.from_pretrained(folder))
    assert weights.tied and weights.lm_head is weights.text["embed_tokens.weight"]
    assert weights.raw_lm_head() is weights.text.raw("embed_tokens.weight")


def test_quantize_at_load_matches_the_official_layout(tmp_path):
    seed = int(np.random.default_rng().integers(99))
    bf16 = make_tiny_checkpoint(tmp_path / "bf16", seed=seed, dtype="bfloat16", **RAGGED)
    official = make_tiny_fp8_checkpoint(tmp_path / "fp8", seed=seed, scale_dtype="F32", **RAGGED)
    config = ModelConfig.from_pretrained(bf16)
    at_load, fingerprint = load_weights(bf16, config, quantize="fp8")
    files, _ = load_weights(official, ModelConfig.from_pretrained(official))
    assert sorted(at_load.fp8_names()) == sorted(files.fp8_names())
    for name in at_load.fp8_names():
        ours, theirs = at_load.text.fp8(name[5:]), files.text.fp8(name[5:])
        np.testing.assert_array_equal(ours.bits, theirs.bits)
        np.testing.assert_array_equal(ours.scale_inv, theirs.scale_inv)
        assert ours.block == fp8.BLOCK and ours.scale_dtype == "F32"
    # the skip list: head, embeddings, conv1d, in_proj_a/b, vision tower stay as stored
    for name in ("layers.0.linear_attn.in_proj_b.weight", "layers.0.linear_attn.conv1d.weight"):
        assert at_load.text.stored_dtype(name) == "BF16"
    assert not at_load.vision.fp8_names() and at_load.raw_lm_head().dtype == np.uint16
    plain = load_weights(bf16, config)[1]
    assert fingerprint != plain  # results of the quantised model are not recorded as the BF16 model's
    from gpu_engine.loader import checkpoint_fingerprint, weight_files

    assert fingerprint == checkpoint_fingerprint(bf16, weight_files(bf16), quantized=QUANTIZE_VARIANT)
    # an FP8 checkpoint is used as it is: nothing more to quantise, same fingerprint
    fp8_config = ModelConfig.from_pretrained(official)
    assert load_weights(official, fp8_config, quantize="fp8")[1] == load_weights(official, fp8_config)[1]
    with pytest.raises(ValueError, match=r"quantize must be None \(.*\) or 'fp8' .*got 'int4'"):
        load_weights(bf16, config, quantize="int4")


def test_cuda_runner_takes_fp8_in_bf16_and_refuses_f32_before_reading_weights(fp8_dir, tmp_path, monkeypatch):
    import gpu_engine.model
    from gpu_engine.cuda.options import CudaOptions

    def no_weights(*args, **kwargs):
        raise AssertionError("weights were read")

    monkeypatch.setattr(gpu_engine.model, "load_weights", no_weights)
    f32 = CudaOptions(dtype="f32")
    with pytest.raises(RunnerUnavailableError, match=r"runner='cuda' runs an FP8 checkpoint with dtype='bf16' only"):
        gpu_engine.load(fp8_dir, runner="cuda", cuda_options=f32)
    bf16 = make_tiny_checkpoint(tmp_path / "bf16", seed=1)
    with pytest.raises(RunnerUnavailableError, match=r"runner='cuda' runs quantize='fp8' with dtype='bf16' only"):
        gpu_engine.load(bf16, runner="cuda", quantize="fp8", cuda_options=f32)
    for folder, quantize in ((fp8_dir, None), (bf16, "fp8")):  # bf16: no refusal, the weights are read
        with pytest.raises(AssertionError, match="weights were read"):
            gpu_engine.load(folder, runner="cuda", quantize=quantize, cuda_options=CudaOptions(dtype="bf16"))
    with pytest.raises(ValueError, match="fp8_activations is an option of runner='reference'"):
        gpu_engine.load(fp8_dir, runner="cuda", fp8_activations=True)
    monkeypatch.undo()
    with pytest.raises(ValueError, match="fp8_activations=True needs block-FP8 weights"):
        gpu_engine.load(bf16, fp8_activations=True)


def test_quantization_config_without_a_list_keeps_lm_head_as_transformers_does():
    from gpu_engine.config import Fp8Config

    raw = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    assert Fp8Config.from_dict(raw, "c").modules_to_not_convert == ("lm_head",)
    assert Fp8Config.from_dict({**raw, "modules_to_not_convert": []}, "c").modules_to_not_convert == ()


def test_sharded_fp8_checkpoint_with_scales_in_other_shards(copy_of):
    folder = copy_of()
    tensors = stored(folder)
    (folder / "model.safetensors").unlink()
    names = sorted(tensors)
    weight_map = {}
    for i in range(2):  # alternate names: a weight and its scale (adjacent when sorted) land in different shards
        file = f"model-{i + 1:05d}-of-00002.safetensors"
        part = {n: tensors[n] for n in names[i::2]}
        write_tagged_safetensors(folder / file, part)
        weight_map.update({n: file for n in part})
    name = T + "layers.0.mlp.up_proj.weight"
    assert weight_map[name] != weight_map[name + "_scale_inv"]
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    write_sums(folder)
    weights, _ = load_weights(folder, ModelConfig.from_pretrained(folder))
    np.testing.assert_array_equal(weights.text.fp8("layers.0.mlp.up_proj.weight").bits, tensors[name][1])
    assert len(weights.fp8_names()) == 25


def test_mtp_linears_follow_the_same_rule(copy_of):
    folder = copy_of()
    rng = np.random.default_rng()
    bits, scale = fp8.quantize(rng.standard_normal((320, 192)).astype(np.float32))  # [intermediate, hidden]

    def add_mtp(t):
        t["mtp.layers.0.mlp.up_proj.weight"] = ("F8_E4M3", bits)
        t["mtp.layers.0.mlp.up_proj.weight_scale_inv"] = ("F32", scale)
        t["mtp.fc.weight"] = ("BF16", np.full((192, 384), 0x3F80, np.uint16))
        t["mtp.norm.weight"] = ("BF16", np.zeros(192, np.uint16))

    rewrite(folder, add_mtp)
    assert "mtp.fc.weight is stored BF16, but modules_to_not_convert does not list mtp.fc" in load_error(folder)
    edit_config(folder, lambda q: q["modules_to_not_convert"].append("mtp.fc"))
    weights, _ = load_weights(folder, ModelConfig.from_pretrained(folder))
    np.testing.assert_array_equal(weights.mtp["layers.0.mlp.up_proj.weight"], fp8.dequantize(bits, scale))
    assert weights.mtp.stored_dtype("fc.weight") == "BF16" and "mtp/layers.0.mlp.up_proj.weight" in weights.fp8_names()

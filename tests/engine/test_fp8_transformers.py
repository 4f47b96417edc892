"""Our tiny FP8 files as transformers 5.17 reads them, on the CPU: its fine-grained FP8 integration loads them
(with accelerate) and, having no GPU, dequantises every FP8 Linear at load (Fp8Dequantize) and runs the model in
the dtype asked for. That is the CPU truth for the weight format; its FP8 GEMMs (Triton / DeepGEMM kernels) only run
on a GPU, which tests/cuda_runner/check_fp8_hf.py covers.

Its dequantisation derives the block from the scale grid (rows // grid rows), so the tiny model here keeps every
Linear dimension either below 128 or a multiple of it: ragged edge blocks (e.g. 320 = 2 x 128 + 64) are refused
there, or mis-blocked (192 rows over a grid of 2 read as two blocks of 96). Ours handles them (test_fp8_format).
Tolerance: the BF16 parity rule of test_engine_text_parity (engine_hf_models.assert_logit_parity).
"""
from __future__ import annotations

import numpy as np
import pytest
from ci_rule import require_module

torch = require_module("torch")
require_module("transformers")
require_module("accelerate", "needed by transformers' FP8 integration (the [test] extra)")

from engine_hf_models import assert_logit_parity, float64_copy, float64_logits

import gpu_engine
from gpu_engine.tiny_fp8 import make_tiny_fp8_checkpoint

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from transformers import Qwen3_5ForConditionalGeneration

    seed = int(np.random.default_rng().integers(1000))
    folder = make_tiny_fp8_checkpoint(tmp_path_factory.mktemp("fp8") / "m", seed=seed)
    hf = Qwen3_5ForConditionalGeneration.from_pretrained(str(folder), dtype=torch.float32).eval()
    return hf, gpu_engine.load(folder)


def test_transformers_dequantises_our_files_to_our_weights_exactly(pair):
    hf, ours = pair
    assert not [m for m in hf.modules() if "FP8" in type(m).__name__]  # no GPU: dequantised at load
    params = dict(hf.named_parameters())
    weights = ours.runner.weights
    assert weights.fp8_names()
    for name in weights.fp8_names():
        theirs = params["model.language_model." + name.split("/", 1)[1]]
        assert theirs.dtype == torch.float32
        np.testing.assert_array_equal(theirs.detach().numpy(), weights.text[name.split("/", 1)[1]], err_msg=name)
    assert not any(n.endswith("_scale_inv") for n in params)  # folded into the weights


@pytest.mark.parametrize("length", [1, 45])
def test_logits_match_transformers_on_the_same_fp8_files(pair, length):
    hf, ours = pair
    ids = torch.from_numpy(np.random.default_rng().integers(0, 250, size=length))[None]
    with torch.no_grad():
        expected = hf(input_ids=ids).logits[0].numpy()
    got = ours.logits(ids[0].numpy())
    assert_logit_parity(got, expected, float64_logits(float64_copy(hf), input_ids=ids))

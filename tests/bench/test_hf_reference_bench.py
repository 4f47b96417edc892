"""transformers' side of the comparison (bench/hf_reference_bench.py) on CPU torch, tiny config."""
from __future__ import annotations

import math
import subprocess
import sys

import hf_reference_bench as hfb
import pytest
from ci_rule import require_module

torch = require_module("torch")
require_module("transformers.models.qwen3_5")

TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 32, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
        "linear_key_head_dim": 16, "linear_value_head_dim": 16, "vocab_size": 512}


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    return hfb.build_model(TINY, tied=False, device="cpu")


def test_random_model_is_bf16_and_initialised(model) -> None:
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert torch.get_default_dtype() == torch.float32  # restored after the build
    w = model.model.layers[0].mlp.gate_proj.weight.float()
    # transformers' init: N(0, initializer_range = 0.02); 8192 samples -> std within a few %
    assert abs(w.std().item() - model.config.initializer_range) < 0.1 * model.config.initializer_range
    a_log = model.model.layers[0].linear_attn.A_log.float()
    assert torch.isfinite(a_log).all()
    with torch.no_grad():
        logits = model(torch.randint(0, 512, (1, 9))).logits
    assert logits.shape == (1, 9, 512) and torch.isfinite(logits).all() and logits.float().std() > 0


def test_measure_reports_each_length_and_batch(model) -> None:
    out = hfb.measure(model, "cpu", prefill=[12, 20], batches=[1, 3], context=8, steps=2)
    for key in ("prefill_12_tok_s", "prefill_20_tok_s", "decode_b1_ms", "decode_b3_ms", "decode_b3_tok_s",
                "decode_b1_prefill_s"):
        assert math.isfinite(out[key]) and out[key] > 0, key
    assert out["decode_b3_tok_s"] == pytest.approx(3e3 / out["decode_b3_ms"])
    assert out["param_dtypes"] == ["torch.bfloat16"]
    assert out["param_bytes"] == 2 * sum(p.numel() for p in model.parameters())


def test_step_clock_counts_one_call_per_generated_token(model) -> None:
    clock = hfb._StepClock(lambda: None)
    from transformers import LogitsProcessorList

    ids = torch.randint(0, 512, (2, 5))
    with torch.no_grad():
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, min_new_tokens=4,
                       do_sample=False, pad_token_id=0, logits_processor=LogitsProcessorList([clock]))
    assert len(clock.stamps) == 4 and clock.stamps == sorted(clock.stamps)


def test_child_rejects_bad_arguments() -> None:
    proc = subprocess.run([sys.executable, hfb.__file__, "--config", "{}", "--steps", "1"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and "--steps" in proc.stderr
    out = hfb.run_child({}, False, prefill=[4], batches=[1], context=4, steps=1, device="cpu", timeout_s=60)
    assert "error" in out and "--steps" in out["error"]

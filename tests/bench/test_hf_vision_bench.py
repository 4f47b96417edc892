"""bench/hf_vision_bench.py on CPU torch with a small tower: one merged row per 2 x 2 patches, bad sizes refused."""
from __future__ import annotations

import pytest
from ci_rule import require_module
from hf_vision_bench import measure

require_module("torch")
require_module("transformers.models.qwen3_5")

SMALL = {"depth": 2, "hidden_size": 64, "num_heads": 4, "intermediate_size": 128, "patch_size": 16,
         "temporal_patch_size": 2, "spatial_merge_size": 2, "in_channels": 3, "out_hidden_size": 96,
         "num_position_embeddings": 64, "hidden_act": "gelu_pytorch_tanh"}


def test_one_image_encodes_to_one_row_per_merge_window():
    result = measure(SMALL, side=96, device="cpu", repeats=1)
    assert result["patches"] == 36 and result["output_rows"] == 9
    assert result["encode_ms"] > 0 and result["images_per_s"] == pytest.approx(1e3 / result["encode_ms"])


def test_a_side_that_is_not_a_whole_number_of_merge_windows_is_refused():
    with pytest.raises(ValueError, match="multiple"):
        measure(SMALL, side=80, device="cpu", repeats=1)

"""bench/doc_throughput.py --quantize fp8 on the CPU: the engine it builds loads with quantize="fp8", and each row
says so (issue 15: the next GPU run measures FP8 pages/s beside BF16 with the same command)."""
from __future__ import annotations

import json
from pathlib import Path

import doc_throughput as dtp
import pytest

from gpu_engine.fp8_checkpoint import QUANTIZE_VARIANT

TINY = ["--runner", "reference", "--shapes", "tiny", "--image-max-pixels", str(64 * 32 * 32), "--photo-size", "640",
        "480", "--video-seconds", "2", "--video-size", "320", "240", "--submitters", "2", "--max-num-seqs", "4",
        "--max-batched-tokens", "256", "--kv-cache-gib", "0.05", "--encoder-cache-gib", "0.05"]


def test_the_engine_loads_quantized_and_the_rows_say_so(tmp_path: Path) -> None:
    folder = dtp.write_model("tiny", tmp_path / "m", 0, 64 * 32 * 32)
    plain = dtp.build_engine(folder, "reference", dtp.parse_args(TINY))
    fp8 = dtp.build_engine(folder, "reference", dtp.parse_args([*TINY, "--quantize", "fp8"]))
    assert fp8.model_fingerprint.endswith("+" + QUANTIZE_VARIANT)
    assert "+" not in plain.model_fingerprint
    out = tmp_path / "doc.json"
    assert dtp.main([*TINY, "--units", "1", "--mix", "1,0,0", "--modes", "fixed8", "--quantize", "fp8",
                     "--json", str(out)]) == 0
    [row] = json.loads(out.read_text())["rows"]
    assert row["quantize"] == "fp8" and row["limit_basis"].startswith("bf16") and row["tokens_per_page"] == 8
    assert dtp.parse_args(TINY).quantize == "none"
    with pytest.raises(SystemExit):
        dtp.parse_args([*TINY, "--quantize", "int8"])

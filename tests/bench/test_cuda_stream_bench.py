"""The mixed-stream driver through the real Engine + AsyncEngine, on the reference runner (CPU), and its checks."""
from __future__ import annotations

from pathlib import Path

import cuda_stream_bench as csb
import pytest
from random_model_dir import write_random_model_dir
from stream_requests import RequestTiming

from gpu_engine.engine_config import EngineConfig
from gpu_engine.params import RequestOutput, TokenLogprob
from gpu_engine.tiny import TINY_TEXT, TINY_VISION


def _ref(tokens: list[int], gaps: list[float]) -> RequestOutput:
    lps = [TokenLogprob(t, "", -1.0, top=[(t, -1.0), (t + 1, -1.0 - g)]) for t, g in zip(tokens, gaps)]
    return RequestOutput("r", "", tokens, True, "length", logprobs=lps)


def _cand(i: int, tokens: list[int]) -> RequestTiming:
    return RequestTiming(i, "text", submitted=0.0, token_ids=tokens, completion_tokens=len(tokens))


def test_compare_tokens_tells_ties_from_mismatches() -> None:
    ref = [_ref([1, 2, 3], [0.5, 0.5, 0.5]), _ref([1, 2, 3], [0.5, 1e-5, 0.5]), _ref([1, 2, 3], [0.5, 0.5, 0.5]),
           _ref([1, 2, 3], [0.5, 0.5, 0.5])]
    cand = [_cand(0, [1, 2, 3]), _cand(1, [1, 9, 9]), _cand(2, [1, 2, 7]), _cand(3, [1, 2])]
    out = csb.compare_tokens(ref, cand, tie_margin=1e-3)
    assert out["identical"] == 1
    assert len(out["near_ties"]) == 1 and out["near_ties"][0].startswith("request 1 ")
    assert [m.split()[1] for m in out["mismatches"]] == ["2", "3"]
    with pytest.raises(ValueError):
        csb.compare_tokens(ref, cand[:2], tie_margin=1e-3)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_model_dir(tmp_path_factory.mktemp("stream") / "m", {**TINY_TEXT, "vocab_size": 3000},
                                  TINY_VISION, tied=True, seed=2, image_max_pixels=64 * 32 * 32)


def test_stream_bench_runs_every_request_to_its_length(tiny_folder: Path) -> None:
    out = csb.stream_bench(tiny_folder, "reference", requests=4, reps=2, max_tokens=3, mean_gap_s=0.002, seed=5,
                           engine_config=EngineConfig(max_num_seqs=4, max_batched_tokens=64), min_side=64,
                           max_side=128, text_words=(10, 20), submitters=2)
    assert out["warmup"]["problems"] == []
    assert len(out["per_rep"]) == 2 and all(r["completed"] == 4 for r in out["per_rep"])
    pooled = out["pooled"]
    assert pooled["completed"] == 8 and pooled["generated_tokens"] == 8 * 3
    assert pooled["image"]["count"] == 4 and pooled["text"]["count"] == 4
    assert 0 < pooled["all"]["ttft_p50_s"] <= pooled["all"]["latency_p50_s"]
    # fresh content per repetition: nothing but the chat template's few tokens can come from the prefix cache
    assert out["engine_stats"]["finished_length"] == 4 + 8


def test_stream_bench_fails_loudly_when_requests_cannot_finish(tiny_folder: Path) -> None:
    result: dict = {}
    with pytest.raises(csb.StreamCheckFailed, match="warm-up"):
        csb.stream_bench(tiny_folder, "reference", requests=2, reps=1, max_tokens=3, mean_gap_s=0.0, seed=1,
                         engine_config=EngineConfig(max_num_seqs=2, max_batched_tokens=64, max_model_len=24),
                         min_side=64, max_side=64, text_words=(10, 12), submitters=1, out=result)
    assert result["warmup"]["problems"] and "load_s" in result


def test_reference_check_on_the_reference_runner(tmp_path: Path) -> None:
    # the reference runner against itself: the same numpy arithmetic on the same inputs, so every request must be
    # token for token identical (a near tie can only come from a difference, and there is none to excuse)
    out = csb.reference_check(tmp_path, "reference", max_tokens=4)
    assert out["problems"] == []
    exact = out["exact"]
    assert (exact["requests"], exact["identical"], exact["near_ties"], exact["mismatches"]) == (8, 8, [], [])


def test_arguments_with_prefix() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    csb.add_arguments(parser, "stream-")
    args = csb.stream_args(parser.parse_args(["--stream-requests", "8", "--stream-runner", "reference"]), "stream-")
    assert args.requests == 8 and args.runner == "reference" and args.reps == 3 and args.shape == "2b"
    with pytest.raises(SystemExit):
        csb.stream_args(parser.parse_args(["--stream-requests", "1"]), "stream-")
    with pytest.raises(SystemExit):
        parser.parse_args(["--stream-runner", "tpu"])

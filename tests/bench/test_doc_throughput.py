"""bench/doc_throughput.py on the CPU: the limit model's arithmetic, and a whole run on the tiny model through the
reference runner (the report's fields, its sums and its checks)."""
from __future__ import annotations

import json
from pathlib import Path

import doc_throughput as dtp
import pytest
from limit_model import ModelCost, StepShape, limit_seconds

from gpu_engine.config import ModelConfig
from gpu_engine.tiny import TINY_TEXT, TINY_VISION


def _cost(**kw: object) -> ModelCost:
    base = dict(body_params=1000, head_params=500, weight_bytes=4000, full_layers=1, q_heads=2, head_dim=4,
                linear_layers=3, linear_state_flops=10, kv_bytes_per_token=16, state_bytes_per_seq=100,
                vision={"hidden": 8, "intermediate": 16, "depth": 2, "patch_dim": 12, "merge_unit": 4,
                        "out_hidden": 6})
    base.update(kw)
    return ModelCost(**base)  # type: ignore[arg-type]  # **dict[str, object] of the right fields


def test_chunk_flops_count_projections_head_attention_and_recurrence() -> None:
    c = _cost()
    # 3 tokens after 5 cached: keys seen 6 + 7 + 8 = 21
    assert c.chunk_flops(5, 3, 1) == 2 * 1000 * 3 + 2 * 500 * 1 + 1 * 4 * 2 * 4 * 21 + 3 * 10 * 3
    assert c.chunk_flops(0, 1, 0) == 2 * 1000 + 4 * 2 * 4 * 1 + 3 * 10


def test_vision_flops_match_the_towers_formula() -> None:
    c = _cost()
    t, h, w = 1, 4, 6
    n = t * h * w
    expected = (2 * n * 8 * 12 + 2 * (2 * n * 8 * (4 * 8 + 2 * 16) + 4 * n * h * w * 8)
                + 2 * (n // 4) * 32 * (32 + 6))
    assert c.vision_flops((t, h, w)) == expected


def test_limit_is_prefill_and_vision_arithmetic_plus_each_decode_steps_roofline() -> None:
    c = _cost()
    steps = [StepShape(prefill_chunks=[(0, 10, 1)], vision_grids=[(1, 4, 4)]),
             StepShape(decode_contexts=[11, 21], prefill_chunks=[(10, 5, 0)]),
             StepShape(decode_contexts=[12])]
    gemm, hbm = 1e6, 1e5
    out = limit_seconds(c, steps, gemm_flops_per_s=gemm, hbm_bytes_per_s=hbm)
    prefill = c.chunk_flops(0, 10, 1) + c.chunk_flops(10, 5, 0)
    decode1_bytes = 4000 + 16 * (11 + 21) + 2 * 100 * 2
    decode1_flops = c.chunk_flops(10, 1, 1) + c.chunk_flops(20, 1, 1)
    decode2_bytes = 4000 + 16 * 12 + 2 * 100
    decode2_flops = c.chunk_flops(11, 1, 1)
    expected_decode = max(decode1_bytes / hbm, decode1_flops / gemm) + max(decode2_bytes / hbm, decode2_flops / gemm)
    assert out["prefill_s"] == pytest.approx(prefill / gemm)
    assert out["vision_s"] == pytest.approx(c.vision_flops((1, 4, 4)) / gemm)
    assert out["decode_s"] == pytest.approx(expected_decode)
    assert out["t_limit_s"] == pytest.approx(out["prefill_s"] + out["vision_s"] + out["decode_s"])
    assert out["decode_steps"] == 2 and out["decode_bytes"] == decode1_bytes + decode2_bytes
    with pytest.raises(ValueError):
        limit_seconds(c, steps, gemm_flops_per_s=0, hbm_bytes_per_s=hbm)


def test_model_cost_from_config_counts_every_weight_once() -> None:
    cfg = ModelConfig.from_dict({"model_type": "qwen3_5", "text_config": TINY_TEXT, "vision_config": TINY_VISION,
                                 "tie_word_embeddings": True})
    t = cfg.text
    cost = ModelCost.from_config(cfg, kv_bytes_per_token=7, state_bytes_per_seq=9)
    h, i, v = t.hidden_size, t.intermediate_size, t.vocab_size
    attn = h * (2 * t.num_attention_heads * t.head_dim) + 2 * h * t.num_key_value_heads * t.head_dim \
        + t.num_attention_heads * t.head_dim * h
    lin = (h * (2 * t.linear_key_dim + t.linear_value_dim) + h * t.linear_value_dim
           + 2 * h * t.linear_num_value_heads + t.linear_value_dim * h)
    mlp = 3 * h * i
    body = len(t.full_attention_layers) * (attn + mlp) + len(t.linear_attention_layers) * (lin + mlp)
    assert cost.body_params == body
    assert cost.head_params == v * h  # tied: the embedding is the head
    norms = (2 * t.num_hidden_layers + 1) * h + len(t.full_attention_layers) * 2 * t.head_dim + \
        len(t.linear_attention_layers) * (t.linear_value_head_dim + 2 * t.linear_num_value_heads
                                          + t.linear_conv_dim * t.linear_conv_kernel_dim)
    assert cost.weight_bytes == 2 * (body + v * h + norms)
    assert cost.full_layers == 1 and cost.linear_layers == 3
    assert cost.linear_state_flops == 7 * t.linear_num_value_heads * t.linear_key_head_dim * t.linear_value_head_dim


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("doc") / "doc.json"
    argv = ["--runner", "reference", "--shapes", "tiny", "--units", "3", "--mix", "1,1,1", "--modes", "fixed40,grammar",
            "--image-max-pixels", str(64 * 32 * 32), "--photo-size", "640", "480", "--video-seconds", "2",
            "--video-size", "320", "240", "--submitters", "2", "--max-num-seqs", "4", "--max-batched-tokens", "256",
            "--kv-cache-gib", "0.05", "--encoder-cache-gib", "0.05", "--json", str(out)]
    assert dtp.main(argv) == 0
    return json.loads(out.read_text())


def test_report_carries_the_issue_fields(tiny_run: dict) -> None:
    rows = tiny_run["rows"]
    assert [(r["shape"], r["output_mode"]) for r in rows] == [("tiny", "fixed40"), ("tiny", "grammar")]
    for r in rows:
        for key in ("shape", "output_mode", "pages_per_s", "fraction_of_limit", "gpu_busy_fraction",
                    "tokens_per_page", "date_utc", "device", "git_commit", "time_split", "latency_all",
                    "peak_device_memory_bytes", "generated_tok_per_s", "prompt_tok_per_s"):
            assert key in r, key
        assert r["units"] == 3 and r["units_by_kind"] == {"pdf": 1, "photo": 1, "video": 1}
        assert r["pages_per_s"] == pytest.approx(3 / r["wall_s"])
        assert r["fraction_of_limit"] == pytest.approx(r["t_limit_s"] / r["wall_s"])
        lim = r["limit"]
        assert r["t_limit_s"] == pytest.approx(lim["prefill_s"] + lim["vision_s"] + lim["decode_s"])
        assert lim["prefill_flops"] > 0 and lim["vision_flops"] > 0 and lim["decode_steps"] >= 1
        assert 0 < r["fraction_of_limit"] < 1 and 0 < r["gpu_busy_fraction"] <= 1.0 + 1e-9
        split = r["time_split"]
        assert split["image_preprocessing_count"] == 3 and split["vision_encode_s"] > 0
        # the reference runner declares no longest decode chunk, so no forced run is cut
        assert r["max_decode_chunk_tokens"] is None and r["cut_forced_runs"] == 0
        assert r["speculative"] == "auto"  # the pipeline's default
        assert {"spec_verify_windows", "spec_draft_tokens", "spec_accepted_tokens"} <= set(r["engine_counters"])
        lat = r["latency_all"]
        assert 0 < lat["ttft_p50_s"] <= lat["latency_p95_s"] <= r["wall_s"] + 1e-6
    fixed, grammar = rows
    assert fixed["tokens_per_page"] == 40 and fixed["generated_tokens"] == 120
    assert fixed["schema"] == "invoice" and grammar["schema"] == "form"
    # the grammar mode ends by the grammar, and the pipeline reads every answer
    assert grammar["schema_valid"] == 3 and grammar["max_tokens"] == 2048
    assert grammar["tokens_per_page"] < 2048
    assert tiny_run["ceilings"]["hbm_bytes_per_s"] > 0 and tiny_run["ceilings"]["gemm_flops_per_s"] > 0


def test_speculation_can_be_turned_off_for_every_request(tmp_path: Path) -> None:
    out = tmp_path / "doc.json"
    argv = ["--runner", "reference", "--shapes", "tiny", "--units", "1", "--mix", "1,0,0", "--modes", "fixed12",
            "--image-max-pixels", str(64 * 32 * 32), "--submitters", "1", "--max-num-seqs", "4",
            "--max-batched-tokens", "256", "--kv-cache-gib", "0.05", "--encoder-cache-gib", "0.05",
            "--speculative", "off", "--json", str(out)]
    assert dtp.main(argv) == 0
    [row] = json.loads(out.read_text())["rows"]
    assert row["speculative"] == "off"
    assert row["engine_counters"]["spec_verify_windows"] == 0 and row["engine_counters"]["spec_draft_tokens"] == 0


def test_pages_are_prepared_in_the_products_child_processes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--prep-processes N: the bench's process never runs the processor (it would raise here); the children do."""
    from gpu_engine.processor import Processor

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a page was prepared in the bench's own process")

    monkeypatch.setattr(Processor, "prepare", refuse)
    out = tmp_path / "doc.json"
    argv = ["--runner", "reference", "--shapes", "tiny", "--units", "2", "--mix", "1,1,0", "--modes", "fixed6",
            "--image-max-pixels", str(64 * 32 * 32), "--photo-size", "640", "480", "--submitters", "2",
            "--max-num-seqs", "4", "--max-batched-tokens", "256", "--kv-cache-gib", "0.05",
            "--encoder-cache-gib", "0.05", "--prep-processes", "1", "--json", str(out)]
    assert dtp.main(argv) == 0
    [row] = json.loads(out.read_text())["rows"]
    assert row["prep_processes"] == 1 and row["tokens_per_page"] == 6
    assert row["time_split"]["image_preprocessing_count"] == 2  # timed on the submitting threads


def test_the_reference_runners_default_prepares_in_process() -> None:
    assert dtp.parse_args(["--runner", "reference", "--shapes", "tiny"]).prep_processes == 0
    assert dtp.parse_args(["--runner", "reference", "--shapes", "tiny", "--prep-processes", "3"]).prep_processes == 3


def test_the_timeline_lists_every_step_and_the_host_profile_its_functions(tmp_path: Path) -> None:
    out, timeline = tmp_path / "doc.json", tmp_path / "timeline.json"
    argv = ["--runner", "reference", "--shapes", "tiny", "--units", "2", "--mix", "1,0,0", "--modes", "fixed12",
            "--image-max-pixels", str(64 * 32 * 32), "--submitters", "1", "--max-num-seqs", "4",
            "--max-batched-tokens", "256", "--kv-cache-gib", "0.05", "--encoder-cache-gib", "0.05",
            "--json", str(out), "--timeline", str(timeline), "--host-profile"]
    assert dtp.main(argv) == 0
    [row] = json.loads(out.read_text())["rows"]
    [run] = json.loads(timeline.read_text())
    steps = run["steps"]
    assert len(steps) == row["time_split"]["steps"]
    col = {name: i for i, name in enumerate(run["columns"])}
    starts = [s[col["start_s"]] for s in steps]
    assert starts[0] == 0.0 and starts == sorted(starts)
    # every prompt token and every decode row of the run is in some step
    assert sum(s[col["chunk_tokens"]] for s in steps) >= row["prompt_tokens"]
    assert sum(s[col["decode_rows"]] for s in steps) > 0
    assert sum(s[col["vision_items"]] for s in steps) == 2  # one page each, encoded once
    assert any("step" in line for line in run["host_profile_top"])
    # the host phases lie inside their step: each phase and the engine thread's CPU time within its wall
    for s in steps:
        wall = s[col["wall_s"]]
        for phase in ("forward_s", "schedule_s", "sampling_plan_s", "after_s"):
            assert 0.0 <= s[col[phase]] <= wall + 1e-4, (phase, s)
        assert s[col["wait_s"]] <= s[col["forward_s"]] + s[col["encode_s"]] + 1e-4
    assert sum(s[col["schedule_s"]] for s in steps) > 0 and sum(s[col["after_s"]] for s in steps) > 0
    assert 0 < sum(s[col["cpu_s"]] for s in steps) <= sum(s[col["wall_s"]] for s in steps) + 1e-3


def test_bad_modes_and_arguments_are_refused() -> None:
    with pytest.raises(SystemExit):
        dtp.parse_args(["--mix", "1,2"])
    with pytest.raises(SystemExit):
        dtp.mode_params("fixedx", None, Path("."))


def test_a_request_that_ends_short_fails_the_run() -> None:
    from doc_workload import Unit

    from gpu_engine.params import RequestOutput

    unit = Unit(0, "pdf", None, 0)
    short = dtp.Outcome(unit, output=RequestOutput("r", "", [1, 2], True, "length"))
    with pytest.raises(dtp.DocBenchFailed):
        dtp.check_outcomes([short], fixed=3)
    stopped = dtp.Outcome(unit, output=RequestOutput("r", "{}", [1, 2], True, "stop"))
    assert dtp.check_outcomes([stopped], fixed=3) == {"grammar_completed_before_length": 1}
    failed = dtp.Outcome(unit, output=RequestOutput("r", "", [], True, "error", error="boom"))
    with pytest.raises(dtp.DocBenchFailed, match="boom"):
        dtp.check_outcomes([failed], fixed=None)


def test_a_page_the_preparation_refuses_fails_the_run_with_its_reason() -> None:
    """drive(): a RequestError from `prepare` reaches the request's outcome (nothing submitted for it), so
    check_outcomes fails the run naming it; the other requests still run."""
    from types import SimpleNamespace

    from doc_outcomes import drive
    from doc_workload import Unit

    from gpu_engine.errors import RequestError
    from gpu_engine.params import RequestOutput

    submitted = []

    class Front:
        def submit(self, prompt, params, listener):
            submitted.append(prompt)
            listener(RequestOutput("r", "{}", [1], True, "stop"))

    def prepare(messages):
        if messages == "bad":
            raise RequestError("cannot prepare the messages: no image")
        return ("prepared", messages)

    units = [Unit(0, "pdf", None, 0), Unit(1, "pdf", None, 1)]
    requests = [SimpleNamespace(messages="bad", params=None), SimpleNamespace(messages="good", params=None)]
    outcomes, _ = drive(Front(), units, requests, submitters=2, prepare=prepare)
    assert submitted == [("prepared", "good")]
    assert outcomes[0].error == "RequestError: cannot prepare the messages: no image" and outcomes[1].error is None
    with pytest.raises(dtp.DocBenchFailed, match="unit 0 .*cannot prepare"):
        dtp.check_outcomes(outcomes, fixed=None)


def test_engine_fields_count_only_the_timed_runs_cut_forced_runs() -> None:
    from types import SimpleNamespace

    from doc_engine_fields import EngineMark, engine_fields

    scheduler = SimpleNamespace(num_held_steps=2, num_cut_runs=5, decode_chunk_limit=31)
    engine = SimpleNamespace(stats=lambda: {"steps": 10}, scheduler=scheduler, runner=object(),
                             config=SimpleNamespace(state_slots=8, min_prefill_tokens=0, max_prefill_hold_steps=4,
                                                    enable_jump_forward=True))
    mark = EngineMark.take(engine)
    scheduler.num_cut_runs, scheduler.num_held_steps = 12, 3
    row = engine_fields(engine, mark)
    assert row["cut_forced_runs"] == 7 and row["held_prompt_steps"] == 1 and row["max_decode_chunk_tokens"] == 31

"""/metrics' speculative-decoding families carry the engine's own figures (api/metrics.py engine_metrics), read from a
real engine that ran speculative requests on the bundled tiny model, not from a stats dict written by the test."""
from __future__ import annotations

import numpy as np
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from api.metrics import ENGINE_COUNTERS, ENGINE_GAUGES, engine_metrics
from gpu_engine import Engine, EngineConfig, SamplingParams
from gpu_engine.bundled import bundled_model_dir
from gpu_engine.speculative import SpeculativeConfig
from gpu_engine.speculative.drafters import Replay


class _Collector:
    def __init__(self, stats: dict) -> None:
        self.stats = stats

    def collect(self):
        return engine_metrics(self.stats)


def _scrape(stats: dict) -> dict[str, float]:
    registry = CollectorRegistry()
    registry.register(_Collector(stats))
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for sample in family.samples:
            if not sample.labels:
                values[sample.name] = sample.value
    return values


def _run(engine: Engine, prompt: list[int], params: SamplingParams) -> list[int]:
    engine.add_request(prompt, params, request_id="r0")
    tokens: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                tokens = list(out.token_ids)
    return tokens


def test_spec_figures_of_a_real_engine_reach_metrics() -> None:
    rng = np.random.default_rng()
    engine = Engine.from_pretrained(bundled_model_dir(), config=EngineConfig(max_num_seqs=4, max_batched_tokens=64),
                                    speculative=SpeculativeConfig(num_tokens=3))
    prompt = rng.integers(10, 500, size=12).tolist()
    # a named drafter drafts every step (auto would rest after windows that gain nothing: speculative/backoff.py)
    params = SamplingParams(max_tokens=24, ignore_eos=True, speculative="ngram")
    truth = _run(engine, prompt, SamplingParams(max_tokens=24, ignore_eos=True, speculative="off"))
    # The greedy continuation itself as drafts, half of them corrupted: some accepted, some rejected.
    engine.spec.override = Replay({"r0": truth}, 0.5, engine.vocab_size, seed=int(rng.integers(1 << 30)))
    assert _run(engine, prompt, params) == truth
    stats = engine.stats()
    assert stats["spec_verify_windows"] > 0 and 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]
    scraped = _scrape(stats)
    for key, (name, _) in ENGINE_GAUGES.items():
        if key.startswith("spec_"):
            assert scraped[name] == float(stats[key]), name
    for key, (name, _) in ENGINE_COUNTERS.items():
        if key.startswith("spec_"):
            assert scraped[name + "_total"] == float(stats[key]), name
    # Every speculative count the engine reports is exported (the rejected count is verified - accepted)
    assert {k for k in stats if k.startswith("spec_")} <= {*ENGINE_GAUGES, *ENGINE_COUNTERS, "spec_rejected_tokens"}

"""bench/engine_host_overhead.py's document workload on a few sequences: the runner-sampled lookahead path runs
every request to 1,024 tokens inside the page_text grammar, and the timed windows and profile are filled in."""
from __future__ import annotations

import engine_host_overhead as eho
from _instant_runner import tiny_tokenizer


def test_document_rows_and_profile() -> None:
    row = eho.measure_document(tiny_tokenizer(), 3, eho.document_params(), profile=True)
    assert row["num_seqs"] == 3 and row["lookahead_steps"] > 900  # nearly every step was a lookahead launch
    for p in eho.POSITIONS:
        assert row[f"timed_steps_at_{p}"] > 0 and row[f"host_us_p50_at_{p}"] > 0
    assert row["profile_steps"] == eho.PROFILE_STEPS and len(row["profile_top20"]) == 20


def test_outputs_are_the_grammars() -> None:
    eng, _ = eho.document_engine(tiny_tokenizer(), 2, eho.document_params())
    finals = []
    while eng.has_unfinished():
        finals += [o for o in eng.step() if o.finished]
    assert [o.finish_reason for o in finals] == ["length", "length"]
    assert all(o.text.startswith('{"primary_language":') and '"natural_text":"' in o.text for o in finals)
    assert all(len(o.token_ids) == len(o.logprobs) == eho.DOC_TOKENS for o in finals)

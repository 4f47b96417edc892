"""A PDF page's text layer reaches the engine as SamplingParams.lookup_text (prompt lookup drafts from the whole
layer, whatever part of it the prompt holds), and the result is unchanged by it. The real engine (bundled tiny model,
reference runner, speculative decoding on by default); what it receives is read from its own sequences."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pymupdf as fitz
import pytest
from sqlalchemy import select

from pipeline import models
from pipeline.ingest import ingest_file
from pipeline.jobs import run_job
from pipeline.queries import get_results
from pipeline.schemas import register_schema

# one short string (the bundled model's grammar caps strings at 24 characters): the answer fits in a text layer
COLOUR = {"type": "object", "properties": {"colour": {"type": "string"}}, "required": ["colour"],
          "additionalProperties": False}


def pdf(path: Path, invisible_text: str | None) -> Path:
    """One page with a drawing on it; `invisible_text` is a text layer that renders nothing (render mode 3), so the
    page image, and with anchor_text_chars=0 the whole prompt, is the same with and without it."""
    doc = fitz.open()
    page = doc.new_page(width=200, height=200)
    page.draw_rect(fitz.Rect(30, 30, 150, 90), color=(0.8, 0.1, 0.1), fill=(0.9, 0.6, 0.2))
    if invisible_text is not None:
        page.insert_textbox(fitz.Rect(5, 100, 195, 195), invisible_text, fontsize=5, render_mode=3)
    doc.save(path)
    return path


class Received:
    """Records the Sequence the real engine builds for each request it is given (its params, its lookup tokens)."""

    def __init__(self, engine: Any) -> None:
        self.engine, self.seqs = engine, []
        self._add = engine.add_request

    def __call__(self, prompt: Any, params: Any = None, request_id: str | None = None) -> str:
        rid = self._add(prompt, params, request_id=request_id)
        self.seqs.append(self.engine._live[rid])
        return rid


def run_one(p: Any, path: Path) -> tuple[dict[str, Any], int]:
    with p.db.session() as s:
        register_schema(s, "colour", COLOUR)
    intake = ingest_file(p, path, schema="colour")
    run_job(p, intake.job_id)
    [unit] = get_results(p, intake.document_id)["results"][0]["units"]
    return unit, intake.document_id


def test_a_page_text_layer_is_the_engine_request_lookup_text(make_pipeline: Any, engine_client: Any,
                                                             tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = engine_client.async_engine.engine
    received = Received(engine)
    monkeypatch.setattr(engine, "add_request", received)
    p = make_pipeline(client=engine_client, anchor_text_chars=0)  # the text layer stays out of the prompt

    plain, _ = run_one(p, pdf(tmp_path / "plain.pdf", None))  # no text layer: no lookup_text
    [first] = received.seqs
    assert first.params.lookup_text is None and first.lookup_ids is None
    answer = plain["raw_text"]
    assert answer

    before = engine.stats()
    layered, document_id = run_one(p, pdf(tmp_path / "layered.pdf", answer))  # the answer hidden in the layer
    second = received.seqs[1]
    with p.db.read_session() as s:
        text_layer = s.scalars(select(models.Page.text_layer).where(models.Page.document_id == document_id)).one()
    assert text_layer.strip() and second.params.lookup_text == text_layer.strip()
    want = engine.tokenizer.encode(text_layer.strip(), add_special_tokens=False)
    assert second.lookup_ids is not None and np.array_equal(second.lookup_ids, want)
    assert second.prompt.token_ids.tolist() == first.prompt.token_ids.tolist()  # the same prompt, image included

    after = engine.stats()
    accepted = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
    assert accepted > 0  # prompt lookup drafted from the text layer, and the target kept some of those drafts
    assert second.accepted_draft_tokens == accepted
    assert layered["raw_text"] == answer and layered["data"] == plain["data"]  # greedy: unchanged by it


def test_the_prompt_holds_a_cut_layer_and_lookup_text_the_whole_one() -> None:
    from PIL import Image

    from pipeline.extraction import UnitInput, build_request, sampling_params
    from pipeline.settings import Settings

    settings = Settings(anchor_text_chars=12)
    params = sampling_params(COLOUR, settings)
    layer = "Invoice 123 total 45.00 EUR"
    page = UnitInput(unit="page:0", page_index=0, images=[Image.new("RGB", (8, 8))], timestamps=[None],
                     anchor_text=f"  {layer}\n")
    request = build_request(page, "Read it.", params, settings)
    assert "total" not in request.messages[0]["content"][-1]["text"] and request.params.lookup_text == layer
    assert params.lookup_text is None  # the job's shared params are not changed
    blank = UnitInput(unit="page:1", page_index=1, images=[Image.new("RGB", (8, 8))], timestamps=[None],
                      anchor_text=" \n")
    assert build_request(blank, "Read it.", params, settings).params.lookup_text is None


def test_a_huge_text_layer_reaches_the_engine_cut_to_the_lookup_cap() -> None:
    """A crafted page can carry megabytes of text; the engine tokenises lookup_text when the request is added, so the
    pipeline hands it at most MAX_LOOKUP_TEXT_CHARS (the page's start), and the engine refuses more by name."""
    from PIL import Image

    from gpu_engine.params import MAX_LOOKUP_TEXT_CHARS, SamplingParams
    from pipeline.extraction import UnitInput, build_request, sampling_params
    from pipeline.settings import Settings

    settings = Settings()
    rng = np.random.default_rng()
    words = rng.choice(["total", "EUR", "Invoice", "12.50", "ACME"], size=MAX_LOOKUP_TEXT_CHARS // 2)
    layer = " ".join(words)  # ~3 x the cap
    assert len(layer) > 2 * MAX_LOOKUP_TEXT_CHARS
    page = UnitInput(unit="page:0", page_index=0, images=[Image.new("RGB", (8, 8))], timestamps=[None],
                     anchor_text=layer)
    got = build_request(page, "Read it.", sampling_params(COLOUR, settings), settings).params.lookup_text
    assert got == layer[:MAX_LOOKUP_TEXT_CHARS]
    SamplingParams(lookup_text="x" * MAX_LOOKUP_TEXT_CHARS)  # the cap itself is accepted
    with pytest.raises(ValueError, match="MAX_LOOKUP_TEXT_CHARS"):
        SamplingParams(lookup_text="x" * (MAX_LOOKUP_TEXT_CHARS + 1))

"""Rendering under the budgets of MediaLimits, in the isolated render process: what a document and its pages
become when a page or the whole document runs past its budget, and the repair flag on the document row."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import hostile_media as hostile
from pipeline_test_support import FAST
from sqlalchemy import select

from pipeline.ingest import receive_file
from pipeline.models import Document, Job, Page
from pipeline.rendering import render_document

# A page budget well below what one depth-6 page takes to draw here (seconds), and a document budget that the
# start of the render process plus two stopped pages spend.
BUDGET = {"page_render_timeout_s": 1.0, "document_render_timeout_s": 4.0, "max_page_draw_ops": 10**9}


def _rows(p: Any, doc_id: int) -> tuple[Document, list[Page], list[Job]]:
    with p.db.read_session() as s:
        doc = s.get(Document, doc_id)
        pages = list(s.scalars(select(Page).where(Page.document_id == doc_id).order_by(Page.index)))
        jobs = list(s.scalars(select(Job).where(Job.document_id == doc_id)))
        return doc, pages, jobs


def test_a_document_past_its_budget_keeps_its_rendered_pages_and_names_the_budget(make_pipeline: Any) -> None:
    p = make_pipeline(**BUDGET)
    out = receive_file(p, hostile.nested_xobject_pdf(30, 6, 10, cheap_first=True), name="laughs.pdf")
    assert render_document(p, out.document_id) == "ingested"
    _, pages, _ = _rows(p, out.document_id)
    assert len(pages) == 30 and pages[0].error is None and pages[0].image_blob
    assert "page 2 of laughs.pdf took longer than 1 s" in (pages[1].error or "")
    assert "document_render_timeout_s" in (pages[-1].error or "")
    assert all(pg.error for pg in pages[1:])


def test_a_document_without_any_page_inside_the_budget_fails_with_its_jobs(make_pipeline: Any) -> None:
    p = make_pipeline(**BUDGET)
    out = receive_file(p, hostile.nested_xobject_pdf(30, 6, 10), name="all-slow.pdf")
    assert render_document(p, out.document_id) == "failed"
    doc, pages, jobs = _rows(p, out.document_id)
    assert doc.error_type == "RenderTimeoutError" and "document_render_timeout_s" in (doc.error or "")
    assert not pages
    assert [j.state for j in jobs] == ["failed"] and jobs[0].error == doc.error


def test_drawing_work_over_the_cap_fails_the_page_without_drawing_it(make_pipeline: Any) -> None:
    p = make_pipeline()  # default budgets: the count refuses the page before any time is spent on it
    out = receive_file(p, hostile.nested_xobject_pdf(2, 7, 10, cheap_first=True), name="deep-forms.pdf")
    assert render_document(p, out.document_id) == "ingested"
    _, pages, _ = _rows(p, out.document_id)
    assert pages[0].error is None and "max_page_draw_ops" in (pages[1].error or "")


def test_a_document_none_of_whose_pages_rendered_fails_with_the_first_pages_reason(make_pipeline: Any) -> None:
    p = make_pipeline()  # default budgets: the count refuses every page, none is drawn, the budgets are unspent
    out = receive_file(p, hostile.nested_xobject_pdf(3, 7, 10), name="all-forms.pdf")
    assert render_document(p, out.document_id) == "failed"
    doc, pages, jobs = _rows(p, out.document_id)
    assert doc.error_type == "LimitExceededError" and not pages
    assert "none of the 3 pages of all-forms.pdf" in (doc.error or "") and "page 1 of" in (doc.error or "")
    assert "max_page_draw_ops" in (doc.error or "")
    assert [j.state for j in jobs] == ["failed"] and jobs[0].error == doc.error


def test_the_repair_flag_reaches_the_document_row(make_pipeline: Any) -> None:
    p = make_pipeline()
    cut = receive_file(p, hostile.truncated_pdf(), name="cut.pdf")
    whole = receive_file(p, hostile.cheap_pages_pdf(2), name="whole.pdf")
    render_document(p, cut.document_id)
    render_document(p, whole.document_id)
    assert _rows(p, cut.document_id)[0].repaired is True
    assert _rows(p, whole.document_id)[0].repaired is False


def test_the_cli_table_and_results_show_a_repaired_file(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from pipeline.cli import app

    env = {"DOCPIPE_DATA_DIR": str(tmp_path / "data"), "COLUMNS": "200",
           **{f"DOCPIPE_{k.upper()}": str(v) for k, v in FAST.items()}}
    path = tmp_path / "cut.pdf"
    path.write_bytes(hostile.truncated_pdf())
    done = CliRunner().invoke(app, ["process", str(path)], env=env, catch_exceptions=False)
    lines = done.stdout.splitlines()
    header = next(line for line in lines if "repaired" in line and "intake" in line)
    row = next(line for line in lines if "cut.pdf" in line and "│" in line)
    column = [c.strip() for c in header.split("┃")].index("repaired")
    assert [c.strip() for c in row.split("│")][column] == "yes", done.stdout
    assert json.loads(CliRunner().invoke(app, ["process", str(path), "--json"], env=env).stdout)["files"][0][
        "repaired"] is True
    shown = CliRunner().invoke(app, ["results", "1", "--json"], env=env, catch_exceptions=False)
    data = json.loads(shown.stdout)
    assert data["repaired"] is True
    assert data["results"][0]["units"] and all(u["repaired"] for u in data["results"][0]["units"])

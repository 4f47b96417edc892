"""Render budgets: drawing work counted before a PDF page is drawn, and the isolated render process
(`open_isolated`) that stops a page or a document at its time budget. Inputs come from tests/hostile_media.py."""
from __future__ import annotations

import secrets
import sys
from pathlib import Path

import hostile_media as hostile
import numpy as np
import pymupdf
import pytest
from vision_media_factory import pdf_bytes, random_words

import vision
from vision import MediaLimits, RenderTimeoutError

# Nested forms fanned out 10 ways: depth 7 draws ~7.4e7 operations per page (refused by the count); depth 6
# (7.4e6) passes a raised count and takes tens of seconds to draw here: the time budget is what stops it.
REFUSED_DEPTH, SLOW_DEPTH = 7, 6
FAST_BUDGET = MediaLimits(page_render_timeout_s=1.5, document_render_timeout_s=30.0, max_page_draw_ops=10**9)


def _write(tmp_path: Path, name: str, data: bytes) -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


def test_page_budget_cannot_exceed_document_budget() -> None:
    with pytest.raises(ValueError, match="page_render_timeout_s"):
        MediaLimits(page_render_timeout_s=10.0, document_render_timeout_s=5.0)
    with pytest.raises(ValueError, match="max_page_draw_ops"):
        MediaLimits(max_page_draw_ops=0)


def test_nested_forms_are_refused_by_their_drawing_count_before_drawing() -> None:
    data = hostile.nested_xobject_pdf(3, REFUSED_DEPTH, 10, cheap_first=True)
    with vision.open_media(data, name="laughs.pdf") as doc:
        pages = list(doc.pages())
    assert pages[0].ok
    for page in pages[1:]:
        assert isinstance(page.error, vision.LimitExceededError)
        assert "max_page_draw_ops" in str(page.error) and "laughs.pdf" in str(page.error)
        assert "74,444,441 operations" in str(page.error)  # 10**7 leaves + 4 operators per form call, by level


@pytest.mark.parametrize("user_password", [True, False], ids=["user-password", "owner-password-only"])
def test_drawing_count_reads_the_decrypted_streams_of_an_encrypted_pdf(tmp_path: Path, user_password: bool) -> None:
    plain = hostile.nested_xobject_pdf(2, REFUSED_DEPTH, 10, cheap_first=True)
    password = secrets.token_urlsafe(8)
    with pymupdf.open(stream=plain, filetype="pdf") as doc:
        locked = doc.tobytes(encryption=pymupdf.PDF_ENCRYPT_AES_256, owner_pw=password + "-owner",
                             user_pw=password if user_password else "")
    path = _write(tmp_path, "locked.pdf", locked)
    # In the render process, as uploads are rendered; a count of still-encrypted streams would find no
    # operator, and the page would be drawn until the time budget stopped it.
    limits = MediaLimits(page_render_timeout_s=10.0, document_render_timeout_s=30.0)  # the default count
    with vision.open_isolated(path, password=password if user_password else None, limits=limits) as iso, \
            vision.open_media(plain, name="locked.pdf") as local:
        locked_pages, plain_pages = list(iso.pages()), list(local.pages())
    assert iso.metadata["encrypted"] is True
    assert locked_pages[0].ok and locked_pages[0].draw_ops == plain_pages[0].draw_ops
    refused = locked_pages[1]
    assert isinstance(refused.error, vision.LimitExceededError) and refused.image is None
    assert "max_page_draw_ops" in str(refused.error) and "74,444,441 operations" in str(refused.error)
    assert refused.draw_ops == plain_pages[1].draw_ops


def test_drawing_count_of_ordinary_pages_is_far_below_the_default(rng: np.random.Generator) -> None:
    from vision.pdf_work import DrawWork

    doc = pymupdf.open(stream=pdf_bytes([random_words(rng, 40) for _ in range(3)]), filetype="pdf")
    counts = [DrawWork(doc).page(page) for page in doc]
    assert all(0 < c < MediaLimits().max_page_draw_ops / 1000 for c in counts)
    nested = pymupdf.open(stream=hostile.nested_xobject_pdf(1, 4, 10), filetype="pdf")
    # 10**4 leaf drawings of 2 operators, plus 4 operators per form call at each level
    assert DrawWork(nested).page(nested[0]) > 2 * 10**4


def test_isolated_pages_equal_in_process_pages(tmp_path: Path, rng: np.random.Generator) -> None:
    path = _write(tmp_path, "plain.pdf", pdf_bytes([random_words(rng) for _ in range(3)]))
    with vision.open_media(path) as local, vision.open_isolated(path) as isolated:
        assert (isolated.kind, isolated.page_count) == ("pdf", 3)
        assert isolated.metadata["page_count"] == local.metadata["page_count"]
        for mine, theirs in zip(local.pages(), isolated.pages(), strict=True):
            assert theirs.ok and theirs.image is not None and mine.image is not None
            assert theirs.image.size == mine.image.size and theirs.dpi == mine.dpi
            assert np.array_equal(np.asarray(theirs.image), np.asarray(mine.image))
            assert theirs.text == mine.text


def test_slow_page_is_stopped_at_its_budget_and_the_next_page_renders(tmp_path: Path) -> None:
    data = hostile.nested_xobject_pdf(3, SLOW_DEPTH, 10, cheap_first=True)
    with pymupdf.open(stream=data, filetype="pdf") as doc:  # page 3 made cheap too: pages after a kill still come
        doc[2].set_contents(doc[0].get_contents()[0])
        data = doc.tobytes()
    path = _write(tmp_path, "slow.pdf", data)
    with vision.open_isolated(path, limits=FAST_BUDGET) as doc:
        pages = list(doc.pages())
        spent = doc.seconds_spent  # type: ignore[attr-defined]  # the isolated document\'s own
    assert [p.ok for p in pages] == [True, False, True]
    assert isinstance(pages[1].error, RenderTimeoutError)
    assert "page 2 of slow.pdf" in str(pages[1].error) and "page_render_timeout_s" in str(pages[1].error)
    assert spent < FAST_BUDGET.document_render_timeout_s


def test_document_budget_ends_rendering_with_the_rest_unrendered(tmp_path: Path) -> None:
    limits = MediaLimits(page_render_timeout_s=1.0, document_render_timeout_s=4.0, max_page_draw_ops=10**9)
    path = _write(tmp_path, "many-slow.pdf", hostile.nested_xobject_pdf(40, SLOW_DEPTH, 10, cheap_first=True))
    with vision.open_isolated(path, limits=limits) as doc:
        pages = list(doc.pages())
        spent = doc.seconds_spent  # type: ignore[attr-defined]  # the isolated document\'s own
    assert len(pages) == 40 and pages[0].ok
    assert spent <= limits.document_render_timeout_s + 0.5  # the budget, plus the last wait's bookkeeping
    last = pages[-1].error
    assert isinstance(last, RenderTimeoutError) and "document_render_timeout_s" in str(last)
    assert not any(p.ok for p in pages[1:])


def test_document_budget_fails_a_document_without_any_rendered_page(tmp_path: Path) -> None:
    limits = MediaLimits(page_render_timeout_s=1.0, document_render_timeout_s=3.0, max_page_draw_ops=10**9)
    path = _write(tmp_path, "all-slow.pdf", hostile.nested_xobject_pdf(20, SLOW_DEPTH, 10))
    with vision.open_isolated(path, limits=limits) as doc, \
            pytest.raises(RenderTimeoutError, match="all-slow.pdf.*document_render_timeout_s"):
        list(doc.pages())


def test_an_image_that_decodes_slowly_is_stopped_at_the_page_budget(tmp_path: Path) -> None:
    """Issue 19 item 1 for images: decode time is bounded like a PDF page's drawing. A 5000x5000 16-bit RGBA PNG
    (a few hundred KB) takes seconds to decode; under a 0.3 s page budget the render process is stopped and the
    image ends with the budget's reason, well inside the document budget."""
    limits = MediaLimits(page_render_timeout_s=0.3, document_render_timeout_s=20.0)
    path = _write(tmp_path, "slow.png", hostile.slow_png(5000, 5000))
    with pytest.raises(RenderTimeoutError, match="slow.png.*page_render_timeout_s"):
        with vision.open_isolated(path, limits=limits) as doc:
            pages = list(doc.pages())
            for page in pages:  # an image document may also report its one page as failed
                if page.error is not None:
                    raise page.error
    # The same image under the default budgets decodes (it is slow, not broken).
    with vision.open_isolated(path) as doc:
        assert [p.ok for p in doc.pages()] == [True]


def test_render_process_crash_is_a_media_error_not_a_crash_of_ours(tmp_path: Path) -> None:
    path = _write(tmp_path, "any.pdf", pdf_bytes(["hello"]))
    tiny = MediaLimits(decode_memory_bytes=32 * 1024 * 1024)  # Python cannot even load MuPDF in this
    with pytest.raises(vision.DecoderCrashedError, match="render process"):
        vision.open_isolated(path, limits=tiny)


def test_isolated_document_errors_keep_their_class(tmp_path: Path) -> None:
    with pytest.raises(vision.LimitExceededError, match="max_image_pixels"):
        vision.open_isolated(_write(tmp_path, "bomb.png", hostile.png_bomb()))
    with pytest.raises(vision.LimitExceededError, match="max_pages"):
        vision.open_isolated(_write(tmp_path, "many.tif", hostile.many_page_tiff(2001)))
    with pytest.raises(vision.UnsupportedMediaError):
        vision.open_isolated(_write(tmp_path, "bomb.docx", hostile.zip_bomb_docx(8 * 1024 * 1024)))


@pytest.mark.parametrize("name, make", [
    ("deep.pdf", lambda: hostile.deep_nesting_pdf(100_000)),
    ("jpx.pdf", lambda: hostile.huge_image_pdf(b"JPXDecode")),
    ("jbig2.pdf", lambda: hostile.huge_image_pdf(b"JBIG2Decode")),
    ("many.gif", lambda: hostile.many_frame_gif(2000)),
    ("tiff.tif", lambda: hostile.many_page_tiff(300)),
    ("cheap.pdf", lambda: hostile.cheap_pages_pdf(300)),
    ("bad.mp4", hostile.malformed_mp4),
])
def test_hostile_files_end_inside_their_budget(tmp_path: Path, name: str, make: object) -> None:
    limits = MediaLimits(page_render_timeout_s=2.0, document_render_timeout_s=20.0)
    path = _write(tmp_path, name, make())  # type: ignore[operator]  # make: a zero-argument factory
    try:
        with vision.open_isolated(path, limits=limits) as doc:
            pages = list(doc.pages())
            spent = doc.seconds_spent  # type: ignore[attr-defined]  # the isolated document\'s own
    except vision.MediaError as exc:
        assert str(exc)  # a reason a person can read
        return
    assert pages and spent <= limits.document_render_timeout_s + 0.5
    assert all(p.ok or str(p.error) for p in pages)


def test_repaired_pdf_says_so_through_the_render_process(tmp_path: Path) -> None:
    with vision.open_isolated(_write(tmp_path, "cut.pdf", hostile.truncated_pdf())) as doc:
        assert doc.metadata["repaired"] is True
        assert any(p.ok for p in doc.pages())


def test_a_clean_render_process_serves_the_next_document_and_a_killed_one_does_not(tmp_path: Path) -> None:
    from vision.isolated import POOL

    POOL.clear()
    plain = _write(tmp_path, "a.pdf", pdf_bytes(["one", "two"]))
    with vision.open_isolated(plain) as first:
        list(first.pages())
        pid = first._child.proc.pid  # type: ignore[attr-defined]  # which process served it
    with vision.open_isolated(plain) as second:
        assert second._child.proc.pid == pid  # type: ignore[attr-defined]  # the same process
        assert all(p.ok for p in second.pages())
    slow = _write(tmp_path, "slow.pdf", hostile.nested_xobject_pdf(1, SLOW_DEPTH, 10))
    limits = MediaLimits(page_render_timeout_s=1.0, document_render_timeout_s=30.0, max_page_draw_ops=10**9)
    with vision.open_isolated(slow, limits=limits) as doc:
        assert doc._child.proc.pid == pid  # type: ignore[attr-defined]  # still the same process
        assert isinstance(next(iter(doc.pages())).error, RenderTimeoutError)
    with vision.open_isolated(plain, limits=limits) as after:
        assert after._child.proc.pid != pid  # type: ignore[attr-defined]  # the killed process is gone
        assert all(p.ok for p in after.pages())
    POOL.clear()


def test_a_normal_2000_page_scan_renders_inside_the_default_budgets(tmp_path: Path) -> None:
    path = _write(tmp_path, "long.pdf", hostile.cheap_pages_pdf(2000))
    with vision.open_isolated(path, options=vision.RenderOptions(pdf_dpi=50.0)) as doc:
        pages = list(doc.pages())
        spent = doc.seconds_spent  # type: ignore[attr-defined]  # the isolated document\'s own
    assert len(pages) == 2000 and all(p.ok for p in pages)
    assert spent < MediaLimits().document_render_timeout_s


def test_the_render_process_does_not_inherit_docpipe_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    from vision.child import ChildProcess

    monkeypatch.setenv("DOCPIPE_DATABASE_URL", "postgresql://user:secret@db/docpipe")
    child = ChildProcess([sys.executable, "-c", "import os, sys; sys.stdout.write(repr(sorted(os.environ)))"],
                         memory_bytes=1 << 30, cpu_seconds=10)
    try:
        child.proc.wait(timeout=30)
        assert child.proc.stdout is not None
        names = child.proc.stdout.read().decode()
    finally:
        child.close()
    assert "DOCPIPE_DATABASE_URL" not in names and "OMP_NUM_THREADS" in names


def test_a_video_gets_at_most_half_the_document_budget_per_decoder_run(tmp_path: Path,
                                                                      rng: np.random.Generator) -> None:
    from vision_media_factory import gradient_frames, write_video

    path = tmp_path / "clip.mp4"
    write_video(path, gradient_frames(rng, 6))
    limits = MediaLimits(page_render_timeout_s=1.0, document_render_timeout_s=8.0)
    with vision.open_isolated(path, limits=limits) as doc:
        assert doc.kind == "video"
        assert doc._limits.decode_timeout_s == 4.0  # type: ignore[attr-defined]  # 120 s by default, capped
        assert all(p.ok for p in doc.pages())


@pytest.mark.parametrize("isolated", [False, True])
def test_document_drawing_budget_refuses_pages_past_it_before_drawing(tmp_path: Path, isolated: bool) -> None:
    # depth 4, fan 10: 74,441 operations a page (the page's own Do included); two fit in 200,000, a third not
    limits = MediaLimits(max_document_draw_ops=200_000)
    path = _write(tmp_path, "forms.pdf", hostile.nested_xobject_pdf(4, 4, 10))
    opener = vision.open_isolated if isolated else vision.open_media
    with opener(path, limits=limits) as doc:
        pages = list(doc.pages())
    assert [p.ok for p in pages] == [True, True, False, False]
    assert all(p.draw_ops == 74_441 for p in pages)
    assert isinstance(pages[2].error, vision.LimitExceededError)
    assert "max_document_draw_ops" in str(pages[2].error) and "148,882 spent" in str(pages[2].error)

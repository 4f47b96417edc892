"""PDF input: rendering, text layer, /Rotate, pixel cap, page limit, passwords, broken/truncated/repaired files."""

from __future__ import annotations

import numpy as np
import pymupdf
import pytest
from PIL import ImageDraw
from vision_media_factory import (
    pdf_bytes,
    pdf_scan_like,
    pdf_with_broken_page,
    pdf_with_transparency,
    pdf_with_undecodable_content,
    random_words,
)

from vision import (
    CorruptMediaError,
    EncryptedDocumentError,
    LimitExceededError,
    MediaError,
    MediaLimits,
    RenderOptions,
    WrongPasswordError,
    open_media,
)
from vision.pdf import render_scale


def dark_fraction(img, box) -> float:
    a = np.asarray(img.convert("L").crop(box), dtype=np.float64)
    return float((a < 64).mean())


def test_pages_text_and_dpi(rng):
    texts = [random_words(rng) for _ in range(3)]
    with open_media(pdf_bytes(texts), options=RenderOptions(pdf_dpi=72)) as doc:
        assert (doc.kind, doc.media_type, doc.page_count) == ("pdf", "application/pdf", 3)
        assert doc.metadata["repaired"] is False and doc.metadata["encrypted"] is False
        pages = list(doc.pages())
        assert [p.index for p in pages] == [0, 1, 2]
        for page, text in zip(pages, texts):
            assert page.ok and page.kind == "page" and page.error is None
            assert page.image.mode == "RGB"
            assert page.image.size == (200, 300)  # 72 dpi: one pixel per point
            assert page.source_size == (200, 300)
            assert page.dpi == pytest.approx(72)
            assert page.text.strip() == text
            assert dark_fraction(page.image, (2, 2, 28, 28)) > 0.95  # the black top-left marker


def test_dpi_scales_the_render(rng):
    with open_media(pdf_bytes([random_words(rng)]), options=RenderOptions(pdf_dpi=150)) as doc:
        page = next(doc.pages())
    # MuPDF rounds the pixmap outwards; within one pixel of points * dpi / 72
    assert abs(page.image.width - 200 * 150 / 72) <= 1 and abs(page.image.height - 300 * 150 / 72) <= 1


@pytest.mark.parametrize("rotation", [90, 180, 270])
def test_rotate_is_honoured(rng, rotation):
    data = pdf_bytes([random_words(rng)], rotate={0: rotation})
    with open_media(data, options=RenderOptions(pdf_dpi=72)) as doc:
        page = next(doc.pages())
    w, h = page.image.size
    assert (w, h) == ((300, 200) if rotation in (90, 270) else (200, 300))
    assert page.source_size == (w, h)
    # /Rotate turns the page clockwise: the top-left marker moves to top-right (90), bottom-right (180),
    # bottom-left (270).
    corner = {90: (w - 28, 2, w - 2, 28), 180: (w - 28, h - 28, w - 2, h - 2), 270: (2, h - 28, 28, h - 2)}[rotation]
    assert dark_fraction(page.image, corner) > 0.95
    assert dark_fraction(page.image, (2, 2, 28, 28)) < 0.05


def test_pixel_cap_lowers_the_dpi(rng):
    limits = MediaLimits(max_page_pixels=200 * 300)  # exactly the 72-dpi size
    with open_media(pdf_bytes([random_words(rng)]), limits=limits, options=RenderOptions(pdf_dpi=300)) as doc:
        page = next(doc.pages())
    assert page.image.width * page.image.height <= 200 * 300
    assert page.dpi < 72
    assert page.image.width == pytest.approx(200 * page.dpi / 72, abs=1)


def test_the_photo_pixel_cap_leaves_pdf_pages_alone(rng):
    # 200 x 300 pt at 720 dpi is 2000 x 3000 = 6 MP: above MediaLimits.max_photo_pixels (raster images only), under
    # max_page_pixels, so the page keeps its dpi
    with open_media(pdf_bytes([random_words(rng)]), options=RenderOptions(pdf_dpi=720)) as doc:
        (page,) = list(doc.pages())
    assert page.image.width * page.image.height > MediaLimits().max_photo_pixels
    assert page.dpi == pytest.approx(720)


def get_pixmap_rgb(data: bytes, dpi: float) -> np.ndarray:
    with pymupdf.open(stream=data, filetype="pdf") as ref:
        pix = ref[0].get_pixmap(matrix=pymupdf.Matrix(dpi / 72, dpi / 72), alpha=False)
        return np.frombuffer(pix.samples, dtype=np.uint8).reshape(pix.height, pix.width, 3)


@pytest.mark.parametrize("zero_copy", [True, False], ids=["fromarrow", "convert"])
@pytest.mark.parametrize("rotation", [0, 90, 270])
def test_render_matches_pymupdf_get_pixmap(rng, rotation, zero_copy, monkeypatch):
    # zero_copy=False is the route taken on Pillow < 13, whose fromarrow re-typing crashes (vision.pdf).
    monkeypatch.setattr("vision.pdf.ARROW_RETYPE_SAFE", zero_copy)
    # Vector pages are drawn into the PIL image's own memory (vision.pdf._render_rgb); the independent reference is
    # PyMuPDF's get_pixmap at the same scale. Blended pixels may round differently: at most one level, rarely.
    data = pdf_with_transparency(rng, rotate=rotation)
    dpi = float(rng.uniform(50, 160))
    with open_media(data, options=RenderOptions(pdf_dpi=dpi)) as doc:
        page = next(doc.pages())
    expected = get_pixmap_rgb(data, dpi)
    assert page.image.mode == "RGB" and page.image.size == (expected.shape[1], expected.shape[0])
    diff = np.abs(np.asarray(page.image, dtype=np.int16) - expected)
    assert diff.max() <= 1
    assert (diff > 0).mean() < 0.01


def test_scanned_page_render_matches_pymupdf_get_pixmap(rng):
    # Pages that are mostly one image take get_pixmap's own route (faster for images): equal to the reference.
    data = pdf_scan_like(rng)
    dpi = float(rng.uniform(50, 160))
    with open_media(data, options=RenderOptions(pdf_dpi=dpi)) as doc:
        page = next(doc.pages())
    assert page.image.mode == "RGB"
    np.testing.assert_array_equal(np.asarray(page.image), get_pixmap_rgb(data, dpi))


def test_rendered_image_is_an_ordinary_pil_image(rng):
    with open_media(pdf_bytes([random_words(rng)]), options=RenderOptions(pdf_dpi=72)) as doc:
        page = next(doc.pages())
    image = page.image
    del page
    assert image.getpixel((5, 5)) == (0, 0, 0) and image.getpixel((150, 250)) == (255, 255, 255)
    ImageDraw.Draw(image).rectangle((100, 200, 120, 220), fill=(10, 200, 30))  # drawing on it works
    assert image.getpixel((110, 210)) == (10, 200, 30)
    assert image.copy().tobytes() == image.tobytes() and image.convert("L").getpixel((5, 5)) == 0


def test_render_scale_reference():
    # Independent arithmetic: a 1000x1000 pt page at 144 dpi is 2000x2000 = 4 Mpx; a 1 Mpx cap halves the scale.
    assert render_scale(1000, 1000, 144, 10**7) == pytest.approx(2.0)
    assert render_scale(1000, 1000, 144, 10**6) == pytest.approx(1.0, rel=2e-3)


def test_page_limit_refuses_before_rendering(rng):
    data = pdf_bytes([random_words(rng) for _ in range(5)])
    with pytest.raises(LimitExceededError, match=r"has 5 pages; the limit is 3 \(MediaLimits.max_pages\)"):
        open_media(data, limits=MediaLimits(max_pages=3))


def encrypted_pdf(texts: list[str], user: str, owner: str) -> bytes:
    return pdf_bytes(texts, encryption=pymupdf.PDF_ENCRYPT_AES_256, user_pw=user, owner_pw=owner)


def test_encrypted_without_password(rng):
    data = encrypted_pdf([random_words(rng)], "u-secret", "o-secret")
    with pytest.raises(EncryptedDocumentError, match="password-protected; send the password") as e:
        open_media(data, name="bank.pdf")
    assert type(e.value) is EncryptedDocumentError
    assert "bank.pdf" in str(e.value)


def test_encrypted_with_wrong_password(rng):
    data = encrypted_pdf([random_words(rng)], "u-secret", "o-secret")
    with pytest.raises(WrongPasswordError, match="is not accepted"):
        open_media(data, password="guess")


@pytest.mark.parametrize("password", ["u-secret", "o-secret"])
def test_encrypted_with_right_password(rng, password):
    texts = [random_words(rng) for _ in range(2)]
    with open_media(encrypted_pdf(texts, "u-secret", "o-secret"), password=password) as doc:
        assert doc.metadata["encrypted"] is True
        assert [p.text.strip() for p in doc.pages()] == texts


def test_owner_password_only_opens_without_password(rng):
    texts = [random_words(rng)]
    with open_media(encrypted_pdf(texts, "", "o-secret")) as doc:
        assert doc.metadata["encrypted"] is True
        assert next(doc.pages()).text.strip() == texts[0]


def test_one_broken_page_becomes_a_page_error(rng):
    texts = [random_words(rng) for _ in range(3)]
    with open_media(pdf_with_broken_page(texts, broken=1)) as doc:
        pages = list(doc.pages())
    assert [p.ok for p in pages] == [True, False, True]
    assert pages[1].image is None and isinstance(pages[1].error, CorruptMediaError)
    assert "page 2 of the input cannot be rendered" in str(pages[1].error)
    assert pages[0].text.strip() == texts[0] and pages[2].text.strip() == texts[2]


def test_page_rendered_with_complaints_carries_warnings(rng):
    texts = [random_words(rng) for _ in range(3)]
    with open_media(pdf_with_undecodable_content(texts, page=1)) as doc:
        pages = list(doc.pages())
    assert all(p.ok for p in pages)  # MuPDF renders what it can (here: a blank page)...
    assert pages[0].warnings == () and pages[2].warnings == ()
    assert any("zlib" in w for w in pages[1].warnings)  # ...and says why it may be incomplete
    assert pages[1].text == "" and pages[2].text.strip() == texts[2]


def test_truncated_pdf_header_is_corrupt(rng):
    data = pdf_bytes([random_words(rng) for _ in range(2)])
    with pytest.raises(CorruptMediaError, match="cannot be opened .*truncated or damaged"):
        open_media(data[:40])


def test_unopenable_pdf_error_names_the_user_file_not_the_storage_path(rng, tmp_path):
    stored = tmp_path / "blobs" / "ab" / "cdef0123"  # how a server stores uploads: a path clients must never see
    stored.parent.mkdir(parents=True)
    stored.write_bytes(pdf_bytes([random_words(rng)])[:40])
    with pytest.raises(CorruptMediaError) as info:
        open_media(stored, name="invoice.pdf")
    assert "invoice.pdf" in str(info.value)
    assert str(tmp_path) not in str(info.value) and "cdef0123" not in str(info.value)


def test_truncated_pdf_missing_trailer_is_repaired(rng):
    texts = [random_words(rng) for _ in range(2)]
    data = pdf_bytes(texts)
    cut = data[: data.rindex(b"startxref")]  # everything but the cross-reference pointer and EOF marker
    with open_media(cut) as doc:
        assert doc.metadata["repaired"] is True
        assert any("repair" in w for w in doc.metadata["warnings"])
        assert [p.text.strip() for p in doc.pages()] == texts


@pytest.mark.parametrize("fraction", [0.3, 0.5, 0.7, 0.9])
def test_truncated_pdf_anywhere_is_either_corrupt_or_repaired(rng, fraction):
    data = pdf_bytes([random_words(rng) for _ in range(3)])
    try:
        doc = open_media(data[: int(len(data) * fraction)])
    except CorruptMediaError:
        return
    with doc:
        assert doc.metadata["repaired"] is True
        for page in doc.pages():
            assert page.ok or isinstance(page.error, CorruptMediaError)


def test_text_still_readable_after_close_and_pages_refused(rng):
    text = random_words(rng)
    doc = open_media(pdf_bytes([text, random_words(rng)]))
    it = doc.pages()
    page = next(it)
    doc.close()
    assert page.text.strip() == text
    with pytest.raises(MediaError, match="was closed; open it again"):
        next(it)


def test_pages_are_lazy(rng):
    doc = open_media(pdf_bytes([random_words(rng) for _ in range(4)]))
    it = doc.pages()
    first = next(it)
    assert first.index == 0  # nothing else needs rendering to get here
    it.close()
    doc.close()


def test_pages_render_correctly_from_several_threads(rng):
    # PyMuPDF is not thread-safe; vision serialises its calls, so threaded callers get correct pages.
    from concurrent.futures import ThreadPoolExecutor

    texts = [random_words(rng) for _ in range(6)]
    data = pdf_bytes(texts)

    def read_all(_: int) -> list[str]:
        with open_media(data, options=RenderOptions(pdf_dpi=72)) as doc:
            return [p.text.strip() for p in doc.pages() if p.ok]

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(read_all, range(8)))
    assert all(r == texts for r in results)

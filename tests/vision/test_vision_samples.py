"""The committed samples open as described in samples/README.md."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from gpu_engine.frame_sampling import QwenFrameSampler
from vision import RenderOptions, open_media

SAMPLES = Path(__file__).resolve().parents[2] / "samples"


def test_samples_stay_small():
    total = sum(p.stat().st_size for p in SAMPLES.iterdir() if p.is_file())
    assert total <= 5 * 2**20


def test_invoice_pdf_has_two_pages_of_vector_text():
    with open_media(SAMPLES / "invoice.pdf") as doc:
        pages = list(doc.pages())
    assert doc.kind == "pdf" and len(pages) == 2
    assert "INV-2026-00417" in pages[0].text and "Northwind Logistics AG" in pages[0].text
    assert "Total due" in pages[1].text and "Total due" not in pages[0].text


def test_receipt_is_upright_after_exif_orientation_6():
    with open_media(SAMPLES / "receipt.jpg") as doc:
        page = next(doc.pages())
    w, h = page.image.size
    assert h > 1.5 * w  # a till receipt is tall; the stored pixels are wide
    # the shop name is printed at the top: the top band has more ink than the bottom band
    grey = np.asarray(page.image.convert("L"), dtype=np.float64)
    assert (grey[40:120] < 128).mean() > (grey[-120:-40] < 128).mean()


def test_form_tiff_has_three_pages():
    with open_media(SAMPLES / "form.tif") as doc:
        pages = list(doc.pages())
    # A4 at 200 dpi (1654 x 2339, 3.9 MP) is above MediaLimits.max_photo_pixels (3.1 MP): ~180 dpi out; p.dpi is
    # the file's own resolution
    assert [p.image.size for p in pages] == [(1491, 2109)] * 3 and all(p.dpi == 200 for p in pages)


def test_phone_photo_opens():
    with open_media(SAMPLES / "phone_photo.jpg") as doc:
        page = next(doc.pages())
    assert page.image.size == (1200, 1600)


@pytest.mark.parametrize("dedupe, expected", [(False, 12), (True, None)])
def test_pan_video(dedupe, expected):
    options = RenderOptions(frame_sampler=QwenFrameSampler(), dedupe_frames=dedupe)
    with open_media(SAMPLES / "pan.mp4", options=options) as doc:
        assert doc.metadata["duration"] == pytest.approx(6.0, abs=0.1)
        frames = list(doc.pages())
    if expected is not None:
        assert len(frames) == expected
    else:  # the still first and last seconds collapse
        assert len(frames) < 12 and len(frames) % 2 == 0

"""Type detection by content: empty files, text posing as PDF, polyglots, refused types, size limit."""

from __future__ import annotations

import io
import zipfile

import numpy as np
import pytest
from vision_media_factory import encoded, pdf_bytes, random_words, smooth_rgb

from vision import (
    AmbiguousMediaError,
    EmptyMediaError,
    LimitExceededError,
    MediaLimits,
    UnsupportedMediaError,
    open_media,
)
from vision.sniff import sniff


def test_zero_byte_file_and_bytes(tmp_path):
    empty = tmp_path / "scan.pdf"
    empty.write_bytes(b"")
    with pytest.raises(EmptyMediaError, match=r"scan\.pdf is empty \(0 bytes\).*send the file again"):
        open_media(empty)
    with pytest.raises(EmptyMediaError):
        open_media(b"")


def test_text_file_named_pdf_is_refused_naming_what_it_is(tmp_path, rng):
    fake = tmp_path / "invoice.pdf"
    words = random_words(rng)
    fake.write_text(f"Dear customer,\n{words}\n")
    with pytest.raises(UnsupportedMediaError,
                       match=r"invoice\.pdf is not an accepted media type: found plain text") as e:
        open_media(fake)
    assert "Dear customer" in str(e.value)
    assert "Accepted: PDF" in str(e.value)


def test_polyglot_pdf_after_jpeg_header_is_refused(rng):
    jpeg_head = b"\xff\xd8\xff\xe0\x00\x10JFIF\x00\x01\x01\x00\x00\x01\x00\x01\x00\x00"
    polyglot = jpeg_head + pdf_bytes([random_words(rng)])
    with pytest.raises(AmbiguousMediaError, match=r"starts as image/jpeg but also carries a PDF header at byte 20"):
        open_media(polyglot, name="upload.jpg")


def test_polyglot_is_an_unsupported_media_error_subclass():
    # Callers that only catch the broad class still catch polyglots.
    assert issubclass(AmbiguousMediaError, UnsupportedMediaError)


def test_pdf_appended_beyond_first_kib_of_a_complete_jpeg_opens_as_the_jpeg_only(rng):
    img = smooth_rgb(rng, 64, 48)
    data = encoded(img, "JPEG", quality=95) + b"\x00" * 2048 + pdf_bytes([random_words(rng)])
    with open_media(data) as doc:
        assert (doc.kind, doc.media_type, doc.page_count) == ("image", "image/jpeg", 1)
        page = next(doc.pages())
        assert page.image.size == (64, 48)


@pytest.mark.parametrize(
    "head, expected",
    [
        (b"\x00\x00\x00\x1cftypavif\x00\x00\x00\x00avifmif1miaf" + b"\x00" * 64, "AVIF is not supported"),
        (b"ID3\x03\x00\x00\x00\x00\x00\x00" + b"\x00" * 64, "audio/mpeg"),
    ],
)
def test_recognised_but_refused_types_name_the_type(head, expected):
    with pytest.raises(UnsupportedMediaError, match=expected):
        sniff(head, name="x")


def test_zip_is_refused_with_a_hint():
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("a.txt", "hello")
    with pytest.raises(UnsupportedMediaError, match="application/zip.*archives are not unpacked"):
        open_media(buf.getvalue())


def test_unknown_binary_is_refused_with_its_first_bytes(rng):
    blob = bytes([0x00, 0x01, 0xFE, 0xFF]) + rng.integers(0, 256, 100, dtype=np.uint8).tobytes()
    with pytest.raises(UnsupportedMediaError, match="unrecognised .*data starting with 00 01 fe ff " + " ".join(
            f"{b:02x}" for b in blob[4:8]) + r"\. Accepted"):
        open_media(blob)


def test_extension_is_ignored(tmp_path, rng):
    # A PNG named .pdf is a PNG.
    path = tmp_path / "report.pdf"
    path.write_bytes(encoded(smooth_rgb(rng, 20, 10), "PNG"))
    with open_media(path) as doc:
        assert (doc.kind, doc.media_type) == ("image", "image/png")


def test_file_size_limit(rng):
    data = pdf_bytes([random_words(rng)])
    with pytest.raises(LimitExceededError, match=r"the limit is 100 \(MediaLimits.max_file_bytes\)"):
        open_media(data, limits=MediaLimits(max_file_bytes=100))


def test_missing_path_is_an_os_error(tmp_path):
    with pytest.raises(FileNotFoundError):
        open_media(tmp_path / "nope.pdf")


def test_limits_validate_fields():
    with pytest.raises(ValueError, match="max_pages must be > 0"):
        MediaLimits(max_pages=0)


def test_text_with_a_multibyte_character_at_the_cut_is_still_text():
    text = ("a" * 511 + "é" + " more").encode()  # "é" is two bytes: byte 512 splits it
    with pytest.raises(UnsupportedMediaError, match="found plain text"):
        sniff(text, name="notes.pdf")


# --- sniff() itself, exactly (cases the mutation pass of issue #22 found unpinned) --------------------------------
def _image(fmt: str, **save: object) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (8, 6), (10, 200, 30)).save(buf, fmt, **save)
    return buf.getvalue()


@pytest.mark.parametrize("fmt, media_type", [("PNG", "image/png"), ("JPEG", "image/jpeg"), ("GIF", "image/gif"),
                                             ("BMP", "image/bmp"), ("WEBP", "image/webp"), ("TIFF", "image/tiff")])
def test_each_image_type_is_named_and_kinded(fmt: str, media_type: str) -> None:
    found = sniff(_image(fmt))
    assert (found.kind, found.media_type) == ("image", media_type)


@pytest.mark.parametrize("head, kind, media_type", [
    (b"%PDF-1.7\n%\xe2\xe3\xcf\xd3\n" + b"0" * 64, "pdf", "application/pdf"),
    (b"\x00\x00\x00\x18ftypmp42\x00\x00\x00\x00mp42isom" + b"\x00" * 64, "video", "video/mp4"),
    (b"\x00\x00\x00\x14ftypqt  \x00\x00\x00\x00qt  " + b"\x00" * 64, "video", "video/quicktime"),
    (b"\x1aE\xdf\xa3\x93B\x82\x88matroska" + b"\x00" * 64, "video", "video/x-matroska"),
    (b"\x1aE\xdf\xa3\x9fB\x86\x81\x01B\xf7\x81\x01B\xf2\x81\x04B\xf3\x81\x08B\x82\x84webm" + b"\x00" * 64, "video",
     "video/webm"),
])
def test_documents_and_videos_are_named_and_kinded(head: bytes, kind: str, media_type: str) -> None:
    found = sniff(head)
    assert (found.kind, found.media_type) == (kind, media_type)


def test_the_pdf_header_window_is_the_first_kib_exactly() -> None:
    png = _image("PNG")
    pad = b"\x00" * (2048 - len(png))
    # "%PDF-" must lie wholly within the first 1024 bytes: starting at 1019 it ends at byte 1024
    for start, refused in ((1019, True), (1020, False), (len(png), True)):
        head = (png + pad)[:start] + b"%PDF-" + b"\x00" * 16
        if refused:
            with pytest.raises(AmbiguousMediaError, match=f"PDF header at byte {start}"):
                sniff(head, name="poly.png")
        else:
            assert sniff(head).media_type == "image/png"
    assert sniff(b"%PDF-1.4\n" + b"%PDF-" * 10).kind == "pdf"  # a PDF may repeat its own header


def test_refusal_messages_name_the_file_and_what_to_do() -> None:
    with pytest.raises(EmptyMediaError, match=r"^scan\.pdf is empty \(0 bytes\)"):
        sniff(b"", name="scan.pdf")
    with pytest.raises(UnsupportedMediaError, match=r"^notes is not an accepted media type: found plain text "
                                                     r"starting with 'hello world'\. Accepted: PDF, JPEG, PNG"):
        sniff(b"hello world", name="notes")
    with pytest.raises(UnsupportedMediaError, match=r"^x is audio/mpeg \(\.mp3\), which is not accepted: convert "
                                                     r"it to PDF, PNG/JPEG or MP4\.$"):
        sniff(b"ID3\x03\x00\x00\x00\x00\x00\x00" + b"\x00" * 64, name="x")
    long_text = "a" * 100
    with pytest.raises(UnsupportedMediaError, match=f"starting with '{'a' * 40}'\\. "):
        sniff(long_text.encode())


def test_plain_text_is_told_from_binary_and_from_media() -> None:
    from vision.sniff import is_plain_text

    assert is_plain_text(b"line one\r\nline\ttwo\n")
    assert is_plain_text("caf\u00e9 ".encode() * 200)  # a character cut at byte 512 is still text
    assert is_plain_text(b"a" * 512 + b"\x00\x01\x02")  # only the first 512 bytes are read as text
    assert not is_plain_text(b"text with a bell \x07")
    assert not is_plain_text(b"\xff\xfe\x00binary")
    assert not is_plain_text(b"")
    assert not is_plain_text(b"%PDF-1.7 looks like text but is a PDF")
    assert not is_plain_text(_image("PNG"))


def test_a_polyglot_is_reported_at_its_first_pdf_header() -> None:
    png = _image("PNG")
    head = png + b"%PDF-1.4\n" + b"\x00" * 16 + b"%PDF-1.7\n"  # two headers in the first KiB: the first one counts
    with pytest.raises(AmbiguousMediaError) as caught:
        sniff(head, name="poly.png")
    assert str(caught.value) == (
        f"poly.png starts as image/png but also carries a PDF header at byte {len(png)}, so it reads as two different "
        "documents (a polyglot file). Re-export it from the original application as a single format.")


def test_a_head_sniffed_without_a_name_is_called_input() -> None:
    with pytest.raises(EmptyMediaError, match=r"^input is empty \(0 bytes\)"):
        sniff(b"")
    with pytest.raises(UnsupportedMediaError, match=r"^input is not an accepted media type: found plain text"):
        sniff(b"just words")

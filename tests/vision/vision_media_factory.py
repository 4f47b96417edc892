"""Builders for fresh test media (random content each run, tiny sizes). Used by tests/vision/test_vision_*.py."""

from __future__ import annotations

import io
import struct
import zlib
from pathlib import Path

import av
import numpy as np
import pymupdf
from PIL import Image, ImageDraw

WORDS = ["invoice", "total", "amount", "receipt", "customer", "order", "payment", "tax", "date", "item", "price",
         "quantity", "address", "number", "account", "balance"]


def random_words(rng: np.random.Generator, n: int = 4) -> str:
    return " ".join(rng.choice(WORDS, size=n)) + f" {int(rng.integers(1000, 9999))}"


def pdf_bytes(texts: list[str], *, rotate: dict[int, int] | None = None, size: tuple[int, int] = (200, 300),
              **save: object) -> bytes:
    """One page per text, the text drawn as real PDF text; `rotate` maps page number -> /Rotate."""
    doc = pymupdf.open()
    for number, text in enumerate(texts):
        page = doc.new_page(width=size[0], height=size[1])
        page.insert_text((20, 40), text, fontsize=9)
        page.draw_rect(pymupdf.Rect(0, 0, 30, 30), color=None, fill=(0, 0, 0))  # a top-left marker
        if rotate and number in rotate:
            page.set_rotation(rotate[number])
    data = doc.tobytes(**save)
    doc.close()
    return data


def _with_page_content(texts: list[str], page: int, content: bytes, *, compress: bool,
                       flate_filter: bool = False) -> bytes:
    """`pdf_bytes(texts)` with page `page`'s content stream replaced by `content` (declared Flate-compressed if
    `flate_filter`, whatever it holds)."""
    doc = pymupdf.open(stream=pdf_bytes(texts), filetype="pdf")
    xref = doc[page].get_contents()[0]
    doc.update_stream(xref, content, compress=compress)
    if flate_filter:
        doc.xref_set_key(xref, "Filter", "/FlateDecode")
    data = doc.tobytes()
    doc.close()
    return data


def pdf_with_broken_page(texts: list[str], broken: int) -> bytes:
    """Page `broken` gets a content stream MuPDF refuses to render (graphics states nested beyond its limit)."""
    return _with_page_content(texts, broken, b"q " * 100_000, compress=True)


def pdf_with_undecodable_content(texts: list[str], page: int) -> bytes:
    """Page `page`'s content stream claims Flate compression but holds garbage: MuPDF renders it blank, warning."""
    return _with_page_content(texts, page, b"\x00garbage" * 10, compress=False, flate_filter=True)


def pdf_with_transparency(rng: np.random.Generator, rotate: int = 0) -> bytes:
    """One page that exercises blending: translucent fills, an RGBA image (soft mask), a CMYK JPEG, a Multiply
    highlight annotation and a translucent free-text annotation, an offset crop box, and `rotate` as /Rotate."""
    doc = pymupdf.open()
    page = doc.new_page(width=int(rng.integers(200, 320)), height=int(rng.integers(200, 320)))
    page.insert_text((20, 40), random_words(rng), fontsize=11)
    page.draw_rect(pymupdf.Rect(10, 50, 150, 150), color=(1, 0, 0), fill=tuple(rng.random(3)), fill_opacity=0.4)
    page.draw_circle((120, 120), 50, fill=tuple(rng.random(3)), fill_opacity=0.6)
    rgba = Image.fromarray(rng.integers(0, 256, (30, 40, 4), dtype=np.uint8), "RGBA")
    page.insert_image(pymupdf.Rect(20, 150, 120, 190), stream=png_bytes(rgba))
    cmyk = Image.fromarray(rng.integers(0, 256, (20, 20, 4), dtype=np.uint8), "CMYK")
    page.insert_image(pymupdf.Rect(130, 150, 180, 190), stream=encoded(cmyk, "JPEG"))
    highlight = page.add_highlight_annot(pymupdf.Rect(15, 25, 150, 45))
    highlight.set_blendmode(pymupdf.PDF_BM_Multiply)
    highlight.update()
    page.add_freetext_annot(pymupdf.Rect(100, 10, 190, 40), "note", fill_color=(1, 1, 0), opacity=0.5)
    page.set_cropbox(pymupdf.Rect(3.3, 5.7, page.rect.width - 7.1, page.rect.height - 2.9))
    page.set_rotation(rotate)
    data = doc.tobytes()
    doc.close()
    return data


def pdf_scan_like(rng: np.random.Generator) -> bytes:
    """One page that is one full-page JPEG, as scanners write them (plus a line of text over it)."""
    doc = pymupdf.open()
    page = doc.new_page(width=200, height=280)
    scan = smooth_rgb(rng, 300, 420)
    page.insert_image(page.rect, stream=encoded(scan, "JPEG", quality=80))
    page.insert_text((20, 40), random_words(rng), fontsize=9)
    data = doc.tobytes()
    doc.close()
    return data


def png_bytes(img: Image.Image, **save: object) -> bytes:
    buf = io.BytesIO()
    img.save(buf, "PNG", **save)
    return buf.getvalue()


def encoded(img: Image.Image, fmt: str, **save: object) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **save)
    return buf.getvalue()


def png_header_only(width: int, height: int) -> bytes:
    """A PNG signature and an IHDR chunk claiming `width` x `height` RGB pixels, then an empty IDAT and IEND."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")


def random_rgb(rng: np.random.Generator, w: int, h: int) -> Image.Image:
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), "RGB")


def smooth_rgb(rng: np.random.Generator, w: int, h: int) -> Image.Image:
    """Random but smooth content (compresses well, survives JPEG, differs in perceptual hash)."""
    base = rng.integers(0, 256, (4, 4, 3), dtype=np.uint8)
    return Image.fromarray(base, "RGB").resize((w, h), Image.Resampling.BICUBIC)


def write_video(path: Path, frames: list[np.ndarray], *, fps: int = 10, codec: str = "libx264", gop: int | None = None,
                rotation: int | None = None, faststart: bool = False, fmt: str | None = None) -> Path:
    h, w = frames[0].shape[:2]
    options = {"movflags": "+faststart"} if faststart else {}
    with av.open(str(path), "w", format=fmt, options=options) as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
        if gop is not None:
            stream.codec_context.gop_size = gop
        if rotation is not None:
            stream.set_display_rotation(rotation)
        for a in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(a, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def gradient_frames(rng: np.random.Generator, n: int, w: int = 64, h: int = 48) -> list[np.ndarray]:
    """Frames whose brightness encodes their number (so a frame can be recognised after lossy coding)."""
    noise = rng.integers(0, 20, (h, w, 3), dtype=np.uint8)
    return [np.clip(noise.astype(np.int32) + int(200 * i / max(n - 1, 1)), 0, 255).astype(np.uint8) for i in range(n)]


def write_audio_only_mp4(path: Path, seconds: float = 0.5) -> Path:
    rate = 16000
    with av.open(str(path), "w", format="mp4") as container:
        stream = container.add_stream("aac", rate=rate)
        samples = int(rate * seconds)
        t = np.arange(samples, dtype=np.float32) / rate
        tone = (0.2 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)[None, :]
        frame = av.AudioFrame.from_ndarray(tone, format="fltp", layout="mono")
        frame.sample_rate = rate
        for packet in stream.encode(frame):
            container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def document_like(rng: np.random.Generator, w: int = 160, h: int = 120) -> np.ndarray:
    """White page with random black 'text lines' (what a document video shows)."""
    img = Image.new("RGB", (w, h), "white")
    draw = ImageDraw.Draw(img)
    for _ in range(12):
        x, y = int(rng.integers(5, w - 40)), int(rng.integers(5, h - 8))
        draw.rectangle((x, y, x + int(rng.integers(10, 35)), y + 3), fill="black")
    return np.asarray(img)

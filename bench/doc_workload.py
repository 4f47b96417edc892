"""The document workload of bench/doc_throughput.py: page units as the pipeline makes them, and its requests.

    units = make_units(n, seed, settings)              # PDF pages, phone photos, short videos (seeded, generated here)
    requests = [unit_request(u, spec, params, settings) for u in units]   # pipeline.extraction.build_request

- PDF pages: A4 invoice-like pages written with PyMuPDF (a text layer of ~1.5-2k characters: header, addresses,
  a table of line items, totals), read back through `vision.open_media` with the pipeline's own
  `Settings.render_options()` / `media_limits()` (150 dpi by default: 1240 x 1754 px) — image and text layer
  exactly as `pipeline.rendering` stores them, the text layer becoming the prompt's anchor text.
- phone photos: 4032 x 3024 JPEGs (a smooth shaded scene with a bright paper rectangle and sensor noise, EXIF
  orientation 6 so the opener rotates them), also through `vision.open_media`.
- short videos: the frames the pipeline hands to the model for one video unit (the video is one unit: all sampled
  frames in one video part, timestamps at `Settings.video_fps`), generated directly as RGB frames: the GPU
  machine has no PyAV, and decoding is the vision package's cost, measured by bench/vision_render.py.
Mix: of every 16 units, 14 are PDF pages, 1 a photo and 1 a video (`mix=` changes it).
"""
from __future__ import annotations

import functools
import io
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

# Words for the generated invoices (plain ASCII: any tokenizer splits them).
_WORDS = ("steel bracket hinge cable conduit valve gasket bearing pump filter sensor relay fuse panel mount screw "
          "bolt washer nut clamp pipe elbow flange coupling adapter seal ring spring lever handle cover plate").split()
_CITIES = ("Rotterdam", "Lyon", "Graz", "Aarhus", "Porto", "Gdansk", "Leuven", "Turku", "Brno", "Cork")


@dataclass(frozen=True)
class Unit:
    """One extraction unit: `kind` is "pdf", "photo" or "video"; `unit` is the pipeline's UnitInput."""

    index: int
    kind: str
    unit: Any  # pipeline.extraction.UnitInput
    source_bytes: int  # size of the file it came from (0 for generated video frames)


def invoice_pdf(pages: int, rng: np.random.Generator) -> bytes:
    """An A4 PDF of `pages` invoice-like pages with a real text layer."""
    import pymupdf

    doc = pymupdf.open()
    for p in range(pages):
        page = doc.new_page(width=595, height=842)  # A4 in points
        y = 60.0

        def line(text: str, size: float = 9.0, x: float = 50.0, page: Any = page) -> None:
            nonlocal y
            page.insert_text((x, y), text, fontsize=size, fontname="helv")
            y += size * 1.5

        number = int(rng.integers(10_000, 99_999))
        line(f"INVOICE  No. {number}-{p + 1}", 16)
        line(f"Date: 2026-{int(rng.integers(1, 13)):02d}-{int(rng.integers(1, 29)):02d}    "
             f"Due: 2026-{int(rng.integers(1, 13)):02d}-{int(rng.integers(1, 29)):02d}    Currency: EUR")
        for who in ("Vendor", "Customer"):
            city = _CITIES[int(rng.integers(len(_CITIES)))]
            line(f"{who}: {' '.join(rng.choice(_WORDS, 2)).title()} B.V.", 10)
            line(f"{int(rng.integers(1, 300))} {rng.choice(_WORDS).title()} Street, {int(rng.integers(1000, 9999))} "
                 f"{city}    VAT NL{int(rng.integers(10**8, 10**9))}B01")
        y += 8
        line("Description                                   Qty      Unit price      Amount", 9)
        total = 0.0
        for _ in range(int(rng.integers(14, 22))):
            qty, price = int(rng.integers(1, 40)), float(rng.integers(100, 90_000)) / 100
            total += qty * price
            desc = " ".join(rng.choice(_WORDS, int(rng.integers(2, 5))))
            line(f"{desc:<44} {qty:>4} {price:>14.2f} {qty * price:>14.2f}")
        y += 8
        line(f"Subtotal {total:.2f}   VAT 21% {0.21 * total:.2f}   Total {1.21 * total:.2f} EUR", 10)
        line(f"Payment: IBAN NL{int(rng.integers(10, 99))}BANK0{int(rng.integers(10**8, 10**9))}, "
             f"reference {number}. Thank you for your order.")
    data = doc.tobytes()
    doc.close()
    return data


def phone_photo(rng: np.random.Generator, size: tuple[int, int] = (4032, 3024)) -> bytes:
    """A JPEG shaped like a phone camera's (12 MP, EXIF orientation 6, quality 90): a shaded scene with a sheet of
    paper and sensor noise. The noisy scene is built once per size; each photo shifts it and prints its own
    marks on the paper, so no two photos share pixels (no encoder- or prefix-cache hits)."""
    arr = np.roll(_photo_scene(size), int(rng.integers(1, size[0])), axis=1)
    w, h = size
    for _ in range(24):  # "text lines" of random length and grey level
        y, x = int(rng.integers(h // 5, 4 * h // 5)), int(rng.integers(w // 4, w // 2))
        arr[y:y + 18, x:x + int(rng.integers(200, w // 3))] = int(rng.integers(20, 120))
    out = io.BytesIO()
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise when shown
    Image.fromarray(arr).save(out, format="JPEG", quality=90, exif=exif)
    return out.getvalue()


@functools.lru_cache(maxsize=2)
def _photo_scene(size: tuple[int, int]) -> np.ndarray:
    w, h = size
    rng = np.random.default_rng(12345)
    yy, xx = np.mgrid[0:h:8, 0:w:8].astype(np.float32)  # shaded at 1/8 resolution, then upscaled (fast)
    base = (90 + 60 * np.sin(xx / 300) + 40 * np.cos(yy / 210)).clip(0, 255)
    small = np.stack([base, base * 0.9, base * 0.8], axis=-1).astype(np.uint8)
    arr = np.asarray(Image.fromarray(small).resize((w, h), Image.BILINEAR)).copy()
    x0, y0 = int(w * 0.2), int(h * 0.15)
    arr[y0:h - y0, x0:w - x0] = (235, 232, 225)  # the paper
    noise = rng.integers(0, 12, (h, w, 1), dtype=np.uint8)
    return np.minimum(arr, 243) + noise


def video_frames(rng: np.random.Generator, seconds: float, fps: float, size: tuple[int, int] = (960, 540)
                 ) -> tuple[list[Image.Image], list[float]]:
    """Frames sampled at `fps` from a clip of `seconds` (count padded to even, as the pipeline's sampling does):
    a paper sheet panning across a shaded background."""
    n = max(4, int(round(seconds * fps)))
    n += n % 2
    w, h = size
    frames, stamps = [], []
    yy, xx = np.mgrid[0:h, 0:w]
    for k in range(n):
        shift = int(k * w / (3 * n))
        arr = np.empty((h, w, 3), np.uint8)
        arr[..., 0] = (60 + (xx + shift) % 128).astype(np.uint8)
        arr[..., 1] = (50 + yy % 96).astype(np.uint8)
        arr[..., 2] = 80
        arr[h // 5: 4 * h // 5, w // 4 + shift // 2: 3 * w // 4 + shift // 2] = (240, 238, 230)
        arr = (arr + rng.integers(0, 8, arr.shape, dtype=np.uint8)).astype(np.uint8)
        frames.append(Image.fromarray(arr))
        stamps.append(k / fps)
    return frames, stamps


def make_units(n: int, seed: int, settings: Any, *, mix: tuple[int, int, int] = (14, 1, 1),
               photo_size: tuple[int, int] = (4032, 3024), video_seconds: float = 8.0,
               video_size: tuple[int, int] = (960, 540)) -> list[Unit]:
    """`n` units, kinds interleaved by `mix` = (PDF pages, photos, videos) per period; `settings`:
    pipeline.Settings (render options and limits). Same arguments -> the same units."""
    import vision
    from pipeline.extraction import UnitInput

    if n < 1 or min(mix) < 0 or sum(mix) < 1:
        raise ValueError(f"bad workload: n={n}, mix={mix}")
    period = ["pdf"] * mix[0] + ["photo"] * mix[1] + ["video"] * mix[2]
    kinds = [period[i % len(period)] for i in range(n)]
    rng = np.random.default_rng(seed)
    n_pdf = kinds.count("pdf")
    pdf_pages: list[Any] = []
    pdf_size = 0
    if n_pdf:
        data = invoice_pdf(n_pdf, rng)
        pdf_size = len(data)
        with vision.open_media(data, limits=settings.media_limits(), options=settings.render_options(),
                               name="bench-invoices.pdf") as doc:
            pdf_pages = [pg for pg in doc.pages()]
        bad = [pg.index for pg in pdf_pages if pg.image is None]
        if bad or len(pdf_pages) != n_pdf:
            raise RuntimeError(f"the generated PDF rendered {len(pdf_pages)} of {n_pdf} pages (failed: {bad})")
    units, next_pdf = [], 0
    for i, kind in enumerate(kinds):
        if kind == "pdf":
            pg = pdf_pages[next_pdf]
            next_pdf += 1
            unit = UnitInput(unit=f"page:{pg.index}", page_index=pg.index, images=[pg.image],
                             timestamps=[None], anchor_text=pg.text)
            units.append(Unit(i, kind, unit, pdf_size // max(1, n_pdf)))
        elif kind == "photo":
            data = phone_photo(rng, photo_size)
            with vision.open_media(data, limits=settings.media_limits(), options=settings.render_options(),
                                   name=f"photo-{i}.jpg") as doc:
                (pg,) = list(doc.pages())
            unit = UnitInput(unit="page:0", page_index=0, images=[pg.image], timestamps=[None], anchor_text=None)
            units.append(Unit(i, kind, unit, len(data)))
        else:
            frames, stamps = video_frames(rng, video_seconds, settings.video_fps, video_size)
            unit = UnitInput(unit="video", page_index=None, images=frames, timestamps=list(stamps))
            units.append(Unit(i, kind, unit, 0))
    return units


def unit_request(unit: Unit, schema_prompt: str, params: Any, settings: Any) -> Any:
    """The engine request the pipeline sends for this unit (pipeline.extraction.build_request)."""
    from pipeline.extraction import build_request

    return build_request(unit.unit, schema_prompt, params, settings)

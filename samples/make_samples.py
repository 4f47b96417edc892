"""Generate docpipe's sample inputs (deterministic: fixed seeds, fixed content, no timestamps).

    python samples/make_samples.py            # writes into samples/

Outputs (see samples/README.md): invoice.pdf, receipt.jpg, form.tif, phone_photo.jpg, pan.mp4.
Only PyMuPDF, Pillow, numpy and PyAV are used; fonts are PDF base-14 (PDF) and Pillow's bundled default font
(rasters), so the script runs the same on any host.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import av
import numpy as np
import pymupdf
from PIL import Image, ImageDraw, ImageFilter, ImageFont

OUT = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Item:
    description: str
    qty: int
    unit_price: float


ITEMS = [
    Item("A4 copy paper, 80 g/m2, box of 5 reams", 4, 23.90),
    Item("Toner cartridge TN-2420, black", 2, 61.50),
    Item("Ring binder, 50 mm, blue", 12, 2.35),
    Item("Ballpoint pens, pack of 10", 6, 4.20),
    Item("Desk organiser, mesh steel", 3, 14.99),
    Item("Sticky notes 76x76 mm, 12 pads", 5, 6.75),
    Item("Whiteboard markers, assorted, 4", 8, 5.10),
    Item("Archive boxes, pack of 10", 2, 19.80),
    Item("Stapler, 30 sheets", 2, 11.45),
    Item("Staples 24/6, 5000 pcs", 4, 1.95),
    Item("Label printer tape 12 mm", 6, 9.30),
    Item("USB-C cable 2 m", 3, 8.99),
    Item("Laminating pouches A4, 100", 1, 17.60),
    Item("Hole punch, 2 holes", 2, 7.25),
    Item("Envelopes C4, 250", 1, 24.40),
]
VAT_RATE = 0.19


def money(value: float) -> str:
    return f"{value:,.2f} EUR"


def make_invoice_pdf(path: Path) -> None:
    """Two A4 pages with real (vector) text: header, addresses, item table spilling onto page 2, totals."""
    doc = pymupdf.open()
    rows_per_page = 10
    pages = [ITEMS[:rows_per_page], ITEMS[rows_per_page:]]
    subtotal = sum(i.qty * i.unit_price for i in ITEMS)
    for number, rows in enumerate(pages, start=1):
        page = doc.new_page(width=595, height=842)
        page.insert_text((50, 60), "ACME Office Supplies GmbH", fontsize=18, fontname="helv")
        page.insert_text((50, 78), "Industriestrasse 12 - 70565 Stuttgart - VAT ID DE123456789", fontsize=8)
        page.insert_text((400, 60), "INVOICE", fontsize=20, fontname="hebo")
        page.insert_text((400, 80), "No. INV-2026-00417", fontsize=10)
        page.insert_text((400, 94), "Date: 2026-11-03", fontsize=10)
        page.insert_text((400, 108), f"Page {number} of {len(pages)}", fontsize=10)
        if number == 1:
            page.insert_text((50, 130), "Bill to:", fontsize=10, fontname="hebo")
            for k, line in enumerate(["Northwind Logistics AG", "Attn. Accounts Payable", "Hafenweg 7",
                                      "20457 Hamburg"]):
                page.insert_text((50, 145 + 13 * k), line, fontsize=10)
            page.insert_text((320, 130), "Order ref: PO-88231   Customer no: C-10442", fontsize=9)
        top = 230
        page.draw_rect(pymupdf.Rect(50, top - 16, 545, top + 4), color=(0, 0, 0), fill=(0.88, 0.9, 0.95))
        for x, title in [(55, "Pos"), (85, "Description"), (360, "Qty"), (400, "Unit price"), (475, "Amount")]:
            page.insert_text((x, top), title, fontsize=9, fontname="hebo")
        y = top + 22
        first = 0 if number == 1 else rows_per_page
        for k, item in enumerate(rows):
            amount = item.qty * item.unit_price
            page.insert_text((55, y), str(first + k + 1), fontsize=9)
            page.insert_text((85, y), item.description, fontsize=9)
            page.insert_text((365, y), str(item.qty), fontsize=9)
            page.insert_text((400, y), money(item.unit_price), fontsize=9)
            page.insert_text((475, y), money(amount), fontsize=9)
            page.draw_line((50, y + 6), (545, y + 6), color=(0.7, 0.7, 0.7), width=0.5)
            y += 22
        if number == len(pages):
            vat = subtotal * VAT_RATE
            for k, (label, value) in enumerate([("Subtotal", subtotal), (f"VAT {VAT_RATE:.0%}", vat),
                                                ("Total due", subtotal + vat)]):
                font = "hebo" if label == "Total due" else "helv"
                page.insert_text((380, y + 20 + 16 * k), label, fontsize=10, fontname=font)
                page.insert_text((465, y + 20 + 16 * k), money(value), fontsize=10, fontname=font)
            page.insert_text((50, y + 90), "Payment within 14 days. IBAN DE89 3704 0044 0532 0130 00, BIC COBADEFFXXX.",
                             fontsize=9)
        page.insert_text((50, 810), "ACME Office Supplies GmbH - Registered at Amtsgericht Stuttgart HRB 12345",
                         fontsize=7, color=(0.4, 0.4, 0.4))
    # no_new_id + no metadata dates: the same bytes on every run
    doc.set_metadata({"title": "Invoice INV-2026-00417", "author": "ACME Office Supplies GmbH",
                      "producer": "docpipe samples", "creator": "docpipe samples"})
    doc.save(path, garbage=3, deflate=True, no_new_id=True)


def font(size: int) -> ImageFont.FreeTypeFont:
    return ImageFont.load_default(size=size)


def receipt_image() -> Image.Image:
    """An upright till receipt on thermal paper (before scanning effects)."""
    w, h = 560, 1200
    img = Image.new("L", (w, h), 246)
    d = ImageDraw.Draw(img)
    y = 30
    for line, size in [("CORNER MARKET", 40), ("Marktplatz 3, 72070 Tuebingen", 20), ("Tel 07071 555 010", 20)]:
        tw = d.textlength(line, font=font(size))
        d.text(((w - tw) / 2, y), line, fill=20, font=font(size))
        y += size + 12
    y += 10
    d.text((30, y), "2026-11-21  17:42   Till 2   #0831", fill=30, font=font(20))
    y += 40
    lines = [("Whole milk 1 l", 1.19), ("Rye bread 750 g", 2.89), ("Apples 1.2 kg", 3.58), ("Coffee beans 500 g", 8.99),
             ("Butter 250 g", 2.29), ("Eggs, 10", 3.49), ("Tomatoes 500 g", 1.99), ("Dish soap", 1.65)]
    for text, price in lines:
        d.text((30, y), text, fill=25, font=font(22))
        d.text((w - 130, y), f"{price:6.2f}", fill=25, font=font(22))
        y += 34
    total = sum(p for _, p in lines)
    d.line((30, y + 6, w - 30, y + 6), fill=40, width=2)
    y += 20
    d.text((30, y), "TOTAL EUR", fill=10, font=font(30))
    d.text((w - 150, y), f"{total:6.2f}", fill=10, font=font(30))
    y += 50
    d.text((30, y), f"incl. VAT 7%   {total - total / 1.07:5.2f}", fill=30, font=font(20))
    y += 30
    d.text((30, y), "Card payment  **** 4417", fill=30, font=font(20))
    y += 60
    d.text((150, y), "Thank you for shopping!", fill=30, font=font(22))
    return img


def scanned(img: Image.Image, rng: np.random.Generator, angle: float) -> Image.Image:
    """Scanner look: slight skew, uneven grey paper, sensor noise, a little blur."""
    img = img.rotate(angle, resample=Image.Resampling.BICUBIC, expand=True, fillcolor=235)
    a = np.asarray(img, dtype=np.float32)
    gradient = np.linspace(0, -18, a.shape[1], dtype=np.float32)[None, :]
    a = a + gradient + rng.normal(0, 7, a.shape).astype(np.float32)
    out = Image.fromarray(np.clip(a, 0, 255).astype(np.uint8), mode="L")
    return out.filter(ImageFilter.GaussianBlur(0.6))


def make_receipt_jpeg(path: Path, rng: np.random.Generator) -> None:
    """Scanned receipt stored sideways with EXIF orientation 6 (viewer must rotate 90 degrees clockwise)."""
    upright = scanned(receipt_image(), rng, angle=1.8).convert("RGB")
    stored = upright.transpose(Image.Transpose.ROTATE_90)  # what a sideways camera sensor records
    exif = Image.Exif()
    exif[0x0112] = 6
    exif[0x010F] = "docpipe samples"
    stored.save(path, "JPEG", quality=72, exif=exif.tobytes(), dpi=(200, 200))


def form_page(number: int) -> Image.Image:
    w, h = 1654, 2339  # A4 at 200 dpi
    img = Image.new("L", (w, h), 255)
    d = ImageDraw.Draw(img)
    d.text((120, 110), "APPLICATION FOR BUSINESS PARKING PERMIT", fill=0, font=font(44))
    d.text((120, 180), f"Form PK-7   -   page {number} of 3", fill=0, font=font(28))
    fields = {
        1: [("Applicant name", "Dana Whitfield"), ("Company", "Northwind Logistics AG"), ("Street", "Hafenweg 7"),
            ("Postcode / City", "20457 Hamburg"), ("Phone", "+49 40 555 0199")],
        2: [("Vehicle registration", "HH-NW 2041"), ("Vehicle make / model", "VW Caddy Cargo"),
            ("Permit zone", "B - Harbour East"), ("Valid from", "2026-12-01"), ("Valid until", "2027-11-30")],
        3: [("Fee (EUR)", "120.00"), ("Payment method", "SEPA direct debit"), ("Date", "2026-11-18"),
            ("Signature", "D. Whitfield"), ("Office use: reference", "PK7-26-1187")],
    }[number]
    y = 320
    for label, value in fields:
        d.text((120, y), label, fill=0, font=font(30))
        d.rectangle((620, y - 12, 1530, y + 52), outline=0, width=3)
        d.text((640, y), value, fill=0, font=font(34))
        y += 150
    d.rectangle((120, y + 40, 1530, y + 440), outline=0, width=3)
    d.text((140, y + 60), "Remarks", fill=0, font=font(28))
    return img


def make_form_tiff(path: Path) -> None:
    """Three bilevel pages, CCITT G4 compressed: a typical multi-page scanner / fax TIFF."""
    pages = [form_page(n).point(lambda v: 255 if v > 128 else 0).convert("1") for n in (1, 2, 3)]
    pages[0].save(path, "TIFF", save_all=True, append_images=pages[1:], compression="group4", dpi=(200, 200))


def render_invoice_page(path: Path, dpi: int) -> Image.Image:
    with pymupdf.open(path) as doc:
        pix = doc[0].get_pixmap(dpi=dpi, alpha=False)
        return Image.frombytes("RGB", (pix.width, pix.height), pix.samples)


def perspective_coeffs(dst: list[tuple[float, float]], src: list[tuple[float, float]]) -> list[float]:
    """Coefficients for Image.transform(PERSPECTIVE) mapping output points `dst` to input points `src`."""
    rows = []
    for (x, y), (u, v) in zip(dst, src):
        rows.append([x, y, 1, 0, 0, 0, -u * x, -u * y])
        rows.append([0, 0, 0, x, y, 1, -v * x, -v * y])
    a = np.array(rows, dtype=np.float64)
    b = np.array([c for pt in src for c in pt], dtype=np.float64)
    return list(np.linalg.solve(a, b))


def make_phone_photo(path: Path, invoice: Path, rng: np.random.Generator) -> None:
    """The invoice's first page photographed on a desk: perspective, a hand's shadow, vignetting, noise."""
    page = render_invoice_page(invoice, dpi=110)
    pw, ph = page.size
    w, h = 1200, 1600
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    desk = np.stack([120 + 25 * np.sin(xx / 37.0 + yy / 410.0), 85 + 18 * np.sin(xx / 37.0 + yy / 410.0),
                     60 + 10 * np.sin(xx / 37.0)], axis=-1)  # wood-like grain
    corners = [(170.0, 150.0), (1060.0, 215.0), (1120.0, 1450.0), (95.0, 1505.0)]  # page corners in the photo
    coeffs = perspective_coeffs(corners, [(0, 0), (pw, 0), (pw, ph), (0, ph)])
    warped = page.transform((w, h), Image.Transform.PERSPECTIVE, coeffs, Image.Resampling.BICUBIC, fillcolor=None)
    mask = Image.new("L", page.size, 255).transform((w, h), Image.Transform.PERSPECTIVE, coeffs,
                                                     Image.Resampling.BILINEAR)
    m = np.asarray(mask, dtype=np.float32)[..., None] / 255.0
    a = np.asarray(warped, dtype=np.float32) * m + desk * (1 - m)
    shadow = 1 - 0.45 * np.exp(-(((xx - 1050) / 260) ** 2 + ((yy - 1250) / 420) ** 2))  # a hand holding the phone
    vignette = 1 - 0.25 * (((xx - w / 2) / w) ** 2 + ((yy - h / 2) / h) ** 2) * 2
    a = a * (shadow * vignette)[..., None] * np.array([1.0, 0.97, 0.9])  # warm indoor light
    a = a + rng.normal(0, 4, a.shape)
    Image.fromarray(np.clip(a, 0, 255).astype(np.uint8)).save(path, "JPEG", quality=80)


def make_pan_video(path: Path, invoice: Path, rng: np.random.Generator) -> None:
    """~6 s, 640x360 at 25 fps: holds the page top still for 1 s (dedupe demo), then pans down, then holds."""
    page = np.asarray(render_invoice_page(invoice, dpi=110), dtype=np.float32)
    fps, seconds, out_w, out_h = 25, 6, 640, 360
    crop_w = page.shape[1] - 60
    crop_h = int(crop_w * out_h / out_w)
    travel = int(page.shape[0] * 0.55) - crop_h  # the item table and totals; the page foot is blank
    with av.open(str(path), "w", format="mp4", options={"fflags": "+bitexact"}) as container:
        stream = container.add_stream("libx264", rate=fps, options={"crf": "30", "preset": "medium", "threads": "1"})
        stream.width, stream.height, stream.pix_fmt = out_w, out_h, "yuv420p"
        for i in range(fps * seconds):
            t = i / fps
            progress = min(max((t - 1.0) / 4.0, 0.0), 1.0)  # still 0-1 s, pan 1-5 s, still 5-6 s
            top = 30 + int(travel * (0.5 - 0.5 * np.cos(np.pi * progress)))
            wobble = int(round(3 * np.sin(2 * np.pi * t * 0.7))) if 0 < progress < 1 else 0
            crop = page[top:top + crop_h, 30 + wobble:30 + wobble + crop_w]
            img = Image.fromarray(crop.astype(np.uint8)).resize((out_w, out_h), Image.Resampling.BILINEAR)
            a = np.asarray(img, dtype=np.float32) + rng.normal(0, 2, (out_h, out_w, 3))
            frame = av.VideoFrame.from_ndarray(np.clip(a, 0, 255).astype(np.uint8), format="rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def main(out: Path = OUT) -> int:
    out.mkdir(parents=True, exist_ok=True)
    invoice = out / "invoice.pdf"
    make_invoice_pdf(invoice)
    make_receipt_jpeg(out / "receipt.jpg", np.random.default_rng(1))
    make_form_tiff(out / "form.tif")
    make_phone_photo(out / "phone_photo.jpg", invoice, np.random.default_rng(2))
    make_pan_video(out / "pan.mp4", invoice, np.random.default_rng(3))
    total = 0
    for name in ("invoice.pdf", "receipt.jpg", "form.tif", "phone_photo.jpg", "pan.mp4"):
        size = (out / name).stat().st_size
        total += size
        print(f"{name:16s} {size / 1024:8.1f} KiB")
    print(f"{'total':16s} {total / 1024:8.1f} KiB")
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]) if len(sys.argv) > 1 else OUT))

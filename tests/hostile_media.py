"""A hostile-input corpus, generated on the fly (no binary blobs): files built to cost a reader time or memory.

Shared by tests/vision, tests/pipeline and tests/api (tests/ is on sys.path through the root conftest). Every
builder is sized for 2-core CI: the attack's shape is real, its size is scaled so that a test's budget (set low
in its settings) is what stops it, in seconds.
"""
from __future__ import annotations

import io
import random
import struct
import zipfile
import zlib

import pymupdf
from PIL import Image


# --- PDF, written by hand: the structures MuPDF has to walk are exactly the ones we mean ---------------------------
def _pdf(objects: dict[int, tuple[bytes, bytes | None]], root: int = 1) -> bytes:
    """A PDF from numbered objects (dictionary, stream or None); a correct xref table."""
    size = max(objects) + 1
    out = bytearray(b"%PDF-1.7\n%\xe2\xe3\xcf\xd3\n")
    offsets: dict[int, int] = {}
    for number in sorted(objects):
        body, stream = objects[number]
        offsets[number] = len(out)
        out += b"%d 0 obj\n" % number
        if stream is None:
            out += body
        else:
            assert body.endswith(b">>")
            out += body[:-2] + b" /Length %d >>\nstream\n" % len(stream) + stream + b"\nendstream"
        out += b"\nendobj\n"
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % size
    for number in range(1, size):
        out += b"%010d 00000 n \n" % offsets[number] if number in offsets else b"0000000000 65535 f \n"
    out += b"trailer\n<< /Size %d /Root %d 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (size, root, xref)
    return bytes(out)


def _pages(page_dicts: list[bytes], first: int) -> dict[int, tuple[bytes, bytes | None]]:
    """Catalog (1), page tree (2) and the page objects, numbered from `first`."""
    kids = b" ".join(b"%d 0 R" % (first + i) for i in range(len(page_dicts)))
    objects: dict[int, tuple[bytes, bytes | None]] = {
        1: (b"<< /Type /Catalog /Pages 2 0 R >>", None),
        2: (b"<< /Type /Pages /Count %d /Kids [%s] >>" % (len(page_dicts), kids), None),
    }
    for i, page in enumerate(page_dicts):
        objects[first + i] = (b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 200 200] " + page + b" >>", None)
    return objects


def nested_xobject_pdf(pages: int, depth: int, fan: int, *, cheap_first: bool = False) -> bytes:
    """Every page draws one form XObject that draws the one below it `fan` times, `depth` levels deep: a few
    hundred bytes that cost about fan**depth drawing operations per page. `cheap_first`: page 1 is a plain page."""
    objects: dict[int, tuple[bytes, bytes | None]] = {}
    leaf = 3
    objects[leaf] = (b"<< /Type /XObject /Subtype /Form /BBox [0 0 200 200] >>", b"0 0 1 rg 10 10 5 5 re f")
    below = leaf
    for level in range(depth):
        me = 4 + level
        draws = b" ".join(b"q 0.9 0 0 0.9 %d %d cm /X0 Do Q" % (i, i) for i in range(fan))
        objects[me] = (b"<< /Type /XObject /Subtype /Form /BBox [0 0 200 200] /Resources << /XObject << /X0 %d 0 R "
                       b">> >> >>" % below, draws)
        below = me
    top = below
    draw, plain = 4 + depth, 5 + depth
    objects[draw] = (b"<< >>", b"/X0 Do")
    objects[plain] = (b"<< >>", b"0 0 0 rg 20 20 50 50 re f")
    dicts = [b"/Resources << /XObject << /X0 %d 0 R >> >> /Contents %d 0 R" % (top, draw) for _ in range(pages)]
    if cheap_first:
        dicts[0] = b"/Contents %d 0 R" % plain
    objects.update(_pages(dicts, 6 + depth))
    return _pdf(objects)


def cheap_pages_pdf(pages: int) -> bytes:
    """`pages` pages sharing one tiny content stream: the most pages for the fewest bytes."""
    objects: dict[int, tuple[bytes, bytes | None]] = {3: (b"<< >>", b"0 0 0 rg 20 20 40 40 re f")}
    objects.update(_pages([b"/Contents 3 0 R"] * pages, 4))
    return _pdf(objects)


def deep_nesting_pdf(depth: int) -> bytes:
    """A page whose dictionary holds arrays nested `depth` deep (a parser's recursion, not its drawing)."""
    nested = b"[" * depth + b"]" * depth
    objects: dict[int, tuple[bytes, bytes | None]] = {3: (b"<< >>", b"0 0 0 rg 20 20 40 40 re f")}
    objects.update(_pages([b"/Contents 3 0 R /Junk " + nested], 4))
    return _pdf(objects)


def huge_image_pdf(filter_name: bytes, width: int = 1_000_000, height: int = 1_000_000) -> bytes:
    """A page drawing an image XObject that declares `width` x `height` pixels behind `filter_name` (JPXDecode,
    JBIG2Decode) with a few bytes of garbage as its data."""
    data = b"\x00\x00\x00\x0cjP  \r\n\x87\n" + bytes(range(64)) if filter_name == b"JPXDecode" else bytes(range(64))
    objects: dict[int, tuple[bytes, bytes | None]] = {
        3: (b"<< /Type /XObject /Subtype /Image /Width %d /Height %d /ColorSpace /DeviceGray /BitsPerComponent 1 "
            b"/Filter /%s >>" % (width, height, filter_name), data),
        4: (b"<< >>", b"q 200 0 0 200 0 0 cm /Im0 Do Q"),
    }
    objects.update(_pages([b"/Resources << /XObject << /Im0 3 0 R >> >> /Contents 4 0 R"], 5))
    return _pdf(objects)


def truncated_pdf(pages: int = 9) -> bytes:
    """A valid PDF cut to a third of its bytes (its xref and trailer lost): MuPDF repairs it on open, and the
    document reports `repaired`."""
    doc = pymupdf.open()
    for number in range(pages):
        doc.new_page(width=200, height=200).insert_text((20, 40), f"page {number + 1}")
    whole = doc.tobytes(garbage=0, deflate=False)
    doc.close()
    return whole[: len(whole) // 3]


# --- rasters ---------------------------------------------------------------------------------------------------------
def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def png_bomb(side: int = 12_000) -> bytes:
    """A real PNG of `side` x `side` black grey pixels: ~side**2 bytes decoded from a few hundred KB."""
    raw = zlib.compressobj(9)
    row = b"\x00" + b"\x00" * side
    body = b"".join(raw.compress(row) for _ in range(side)) + raw.flush()
    ihdr = struct.pack(">IIBBBBB", side, side, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", body) + _chunk(b"IEND", b"")


def slow_png(width: int, height: int) -> bytes:
    """16 bits per channel with alpha: 8 bytes a pixel to inflate and convert, a few hundred KB on the wire.
    About 3 s to decode at 5000x5000 on a loaded 2-core machine, well over a second on a quiet one."""
    deflate = zlib.compressobj(1)
    row = b"\0" + random.randbytes(8) * width  # filter byte, then one random pixel repeated
    idat = b"".join(deflate.compress(row) for _ in range(height)) + deflate.flush()
    ihdr = struct.pack(">IIBBBBB", width, height, 16, 6, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", idat) + _chunk(b"IEND", b"")


def many_frame_gif(frames: int) -> bytes:
    """An animated GIF of `frames` 2x2 frames, ~27 bytes each: Pillow encodes one, and its image block is repeated
    behind a graphics control extension per frame (Pillow itself writes a 768-byte palette into every frame)."""
    one = Image.new("P", (2, 2), 1)
    one.putpalette([0, 0, 0, 255, 255, 255] + [0] * 762)
    buf = io.BytesIO()
    one.save(buf, "GIF")
    data = buf.getvalue()
    flags = data[10]
    table_end = 13 + (3 * 2 ** ((flags & 7) + 1) if flags & 0x80 else 0)  # header, screen, colour table
    start = table_end
    while data[start] == 0x21:  # skip the extensions Pillow wrote
        start += 2
        while data[start]:
            start += data[start] + 1
        start += 1
    image = data[start:-1]  # image descriptor and its LZW data, without the trailer
    control = b"\x21\xf9\x04\x00\x01\x00\x00\x00"  # 10 ms per frame
    loop = b"\x21\xff\x0bNETSCAPE2.0\x03\x01\x00\x00\x00"
    return data[:table_end] + loop + (control + image) * frames + b";"


def many_page_tiff(pages: int) -> bytes:
    """A multi-page TIFF of `pages` 1x1 grey pages, written by hand (Pillow takes seconds for thousands): a chain
    of image directories all pointing at one shared pixel."""
    entries = [(256, 3, 1), (257, 3, 1), (258, 3, 8), (259, 3, 1), (262, 3, 1), (273, 4, 8), (277, 3, 1),
               (278, 3, 1), (279, 4, 1)]  # (tag, type: 3 SHORT / 4 LONG, value); 273: the pixel at offset 8
    ifd_size = 2 + 12 * len(entries) + 4
    out = bytearray(b"II*\x00" + struct.pack("<I", 12) + b"\x80\x00\x00\x00")  # header, pixel, padding
    for number in range(pages):
        start = 12 + number * ifd_size
        following = start + ifd_size if number + 1 < pages else 0
        out += struct.pack("<H", len(entries))
        for tag, kind, value in entries:
            out += struct.pack("<HHI", tag, kind, 1) + (struct.pack("<HH", value, 0) if kind == 3
                                                        else struct.pack("<I", value))
        out += struct.pack("<I", following)
    return bytes(out)


# --- containers ------------------------------------------------------------------------------------------------------
def zip_bomb_docx(inflated_bytes: int = 64 * 1024 * 1024) -> bytes:
    """A ZIP laid out like a DOCX ([Content_Types].xml, word/document.xml) whose document inflates to
    `inflated_bytes` of zeros."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as z:
        z.writestr("[Content_Types].xml", '<?xml version="1.0"?><Types xmlns="http://schemas.openxmlformats.org/'
                   'package/2006/content-types"/>')
        with z.open("word/document.xml", "w", force_zip64=True) as f:
            block = b"\x00" * (1 << 20)
            for _ in range(inflated_bytes // len(block)):
                f.write(block)
    return buf.getvalue()


def _atom(kind: bytes, body: bytes, size: int | None = None) -> bytes:
    return struct.pack(">I", size if size is not None else 8 + len(body)) + kind + body


def malformed_mp4() -> bytes:
    """An MP4 whose atoms lie: a moov claiming 4 GiB, a trak nested in itself, an mdat running past the end."""
    ftyp = _atom(b"ftyp", b"isom\x00\x00\x02\x00isomiso2avc1mp41")
    trak = _atom(b"trak", _atom(b"trak", _atom(b"tkhd", b"\x00" * 84, size=0x7FFFFFFF)))
    moov = _atom(b"moov", _atom(b"mvhd", b"\x00" * 100) + trak, size=0xFFFFFFF0)
    mdat = _atom(b"mdat", b"\x00\x00\x00\x01" * 64, size=0x40000000)
    return ftyp + moov + mdat

"""Raster images: every accepted format, EXIF orientation, mode normalisation, bombs, truncation, TIFF pages, GIF."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image
from vision_media_factory import encoded, png_bytes, png_header_only, random_rgb, smooth_rgb

from vision import CorruptMediaError, LimitExceededError, MediaLimits, UnsupportedMediaError, open_media


def only_page(data: bytes, **kw):
    with open_media(data, **kw) as doc:
        pages = list(doc.pages())
        assert doc.kind == "image" and len(pages) == doc.page_count == 1
        return doc, pages[0]


@pytest.mark.parametrize(
    "fmt, mime, save",
    [
        ("PNG", "image/png", {}),
        ("TIFF", "image/tiff", {"compression": "tiff_lzw"}),
        ("BMP", "image/bmp", {}),
        ("WEBP", "image/webp", {"lossless": True}),
    ],
)
def test_lossless_formats_round_trip_exactly(rng, fmt, mime, save):
    img = random_rgb(rng, 37, 23)
    doc, page = only_page(encoded(img, fmt, **save))
    assert doc.media_type == mime
    assert page.kind == "page" and page.index == 0 and page.source_size == (37, 23)
    np.testing.assert_array_equal(np.asarray(page.image), np.asarray(img))


def test_jpeg(rng):
    img = smooth_rgb(rng, 64, 40)
    doc, page = only_page(encoded(img, "JPEG", quality=95, dpi=(300, 300)))
    assert doc.media_type == "image/jpeg" and page.dpi == 300
    # lossy: within a few levels of the original on smooth content
    diff = np.abs(np.asarray(page.image, dtype=np.int16) - np.asarray(img, dtype=np.int16))
    assert diff.mean() < 3


def test_gif_first_frame_only(rng):
    frames = [smooth_rgb(rng, 30, 20).quantize(16) for _ in range(3)]
    data = encoded(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=100)
    doc, page = only_page(data)
    assert doc.media_type == "image/gif" and doc.metadata["frames_in_file"] == 3
    np.testing.assert_array_equal(np.asarray(page.image), np.asarray(frames[0].convert("RGB")))


def test_apng_first_frame_only(rng):
    frames = [random_rgb(rng, 12, 9) for _ in range(3)]
    data = png_bytes(frames[0], save_all=True, append_images=frames[1:], duration=100)
    doc, page = only_page(data)
    assert doc.media_type == "image/apng" and doc.metadata["frames_in_file"] == 3
    np.testing.assert_array_equal(np.asarray(page.image), np.asarray(frames[0]))


def test_animated_webp_first_frame_only(rng):
    frames = [random_rgb(rng, 14, 10) for _ in range(3)]  # lossless: the first frame comes back exactly
    data = encoded(frames[0], "WEBP", save_all=True, append_images=frames[1:], duration=100, lossless=True)
    doc, page = only_page(data)
    assert doc.media_type == "image/webp" and doc.metadata["frames_in_file"] == 3
    np.testing.assert_array_equal(np.asarray(page.image), np.asarray(frames[0]))


def test_heic(rng):
    img = smooth_rgb(rng, 64, 48)
    doc, page = only_page(encoded(img, "HEIF", quality=95))
    assert doc.media_type == "image/heic" and doc.metadata["format"] == "HEIF"
    diff = np.abs(np.asarray(page.image, dtype=np.int16) - np.asarray(img, dtype=np.int16))
    assert diff.mean() < 6  # lossy HEVC on smooth content


def test_heic_orientation_applied_once(rng):
    img = smooth_rgb(rng, 64, 48)
    exif = Image.Exif()
    exif[0x0112] = 6
    _, page = only_page(encoded(img, "HEIF", quality=95, exif=exif.tobytes()))
    assert page.image.size == (48, 64)  # rotated once (a second rotation would give 64 x 48 back)
    expected = np.rot90(np.asarray(img, dtype=np.int16), k=-1)
    assert np.abs(np.asarray(page.image, dtype=np.int16) - expected).mean() < 6


def test_multi_frame_tiff_is_pages(rng):
    frames = [random_rgb(rng, 20 + i, 10) for i in range(3)]
    data = encoded(frames[0], "TIFF", save_all=True, append_images=frames[1:])
    with open_media(data) as doc:
        assert doc.page_count == 3
        pages = list(doc.pages())
    assert [p.index for p in pages] == [0, 1, 2]
    for page, frame in zip(pages, frames):
        np.testing.assert_array_equal(np.asarray(page.image), np.asarray(frame))


def test_tiff_with_a_damaged_last_page_keeps_the_others(rng):
    frames = [random_rgb(rng, 40, 30) for _ in range(3)]
    data = encoded(frames[0], "TIFF", save_all=True, append_images=frames[1:])
    with open_media(data[:-200]) as doc:
        pages = list(doc.pages())
    assert [p.ok for p in pages] == [True, True, False]
    assert isinstance(pages[2].error, CorruptMediaError) and "page 3" in str(pages[2].error)


def test_tiff_page_limit(rng):
    frames = [random_rgb(rng, 8, 8) for _ in range(4)]
    data = encoded(frames[0], "TIFF", save_all=True, append_images=frames[1:])
    with pytest.raises(LimitExceededError, match="has 4 pages; the limit is 2"):
        open_media(data, limits=MediaLimits(max_pages=2))


# What a viewer does to the stored pixels for each EXIF orientation, written with numpy (independent of Pillow).
DISPLAY = {
    1: lambda a: a,
    2: lambda a: a[:, ::-1],
    3: lambda a: a[::-1, ::-1],
    4: lambda a: a[::-1, :],
    5: lambda a: a.transpose(1, 0, 2),
    6: lambda a: np.rot90(a, k=-1),  # 90 degrees clockwise
    7: lambda a: a[::-1, ::-1].transpose(1, 0, 2),
    8: lambda a: np.rot90(a, k=1),
}


@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_orientation_applied(rng, orientation):
    stored = random_rgb(rng, 7, 4)
    exif = Image.Exif()
    exif[0x0112] = orientation
    doc, page = only_page(png_bytes(stored, exif=exif.tobytes()))
    expected = DISPLAY[orientation](np.asarray(stored))
    np.testing.assert_array_equal(np.asarray(page.image), expected)
    assert page.source_size == (expected.shape[1], expected.shape[0])


def test_cmyk_becomes_rgb(rng):
    cmyk = Image.fromarray(rng.integers(0, 256, (6, 9, 4), dtype=np.uint8), "CMYK")
    _, page = only_page(encoded(cmyk, "TIFF"))
    assert page.image.mode == "RGB"
    # no ICC profile: Pillow's documented conversion applies
    np.testing.assert_array_equal(np.asarray(page.image), np.asarray(cmyk.convert("RGB")))


def over_white(rgb: np.ndarray, alpha: np.ndarray) -> np.ndarray:
    a = alpha.astype(np.float64)[..., None] / 255.0
    return rgb.astype(np.float64) * a + 255.0 * (1 - a)


def test_rgba_composited_over_white(rng):
    a = rng.integers(0, 256, (5, 8, 4), dtype=np.uint8)
    _, page = only_page(png_bytes(Image.fromarray(a, "RGBA")))
    np.testing.assert_allclose(np.asarray(page.image), over_white(a[..., :3], a[..., 3]), atol=1.0)


def test_la_composited_over_white(rng):
    a = rng.integers(0, 256, (5, 8, 2), dtype=np.uint8)
    _, page = only_page(png_bytes(Image.fromarray(a, "LA")))
    expected = over_white(np.repeat(a[..., :1], 3, axis=-1), a[..., 1])
    np.testing.assert_allclose(np.asarray(page.image), expected, atol=1.0)


def test_palette_with_transparency_is_white_where_transparent(rng):
    p = Image.new("P", (6, 4), 0)
    p.putpalette([10, 20, 30, 200, 100, 50] + [0] * 762)
    p.putpixel((1, 1), 1)
    _, page = only_page(png_bytes(p, transparency=0))
    a = np.asarray(page.image)
    assert tuple(a[1, 1]) == (200, 100, 50)
    assert (a[0, 0] == 255).all()


def test_sixteen_bit_grey_is_scaled_not_clipped(rng):
    values = rng.integers(0, 65536, (5, 7), dtype=np.uint16)
    img = Image.fromarray(values)
    assert img.mode == "I;16"
    _, page = only_page(png_bytes(img))
    expected = (values >> 8).astype(np.uint8)
    np.testing.assert_array_equal(np.asarray(page.image), np.repeat(expected[..., None], 3, axis=-1))


def test_bilevel_tiff(rng):
    bits = rng.integers(0, 2, (16, 24), dtype=np.uint8) * 255
    img = Image.fromarray(bits, "L").convert("1")
    _, page = only_page(encoded(img, "TIFF", compression="group4"))
    np.testing.assert_array_equal(np.asarray(page.image)[..., 0], bits)


def test_png_claiming_100k_by_100k_is_a_bomb():
    with pytest.raises(LimitExceededError, match="decompression bomb"):
        open_media(png_header_only(100_000, 100_000), name="huge.png")


def test_our_pixel_limit_applies_below_pillows(rng):
    data = png_bytes(random_rgb(rng, 50, 40))
    with pytest.raises(LimitExceededError, match=r"50 x 40 = 2,000 pixels, above MediaLimits.max_image_pixels"):
        open_media(data, limits=MediaLimits(max_image_pixels=1999))


def test_truncated_jpeg_is_corrupt(rng):
    data = encoded(random_rgb(rng, 120, 90), "JPEG", quality=90)
    with pytest.raises(CorruptMediaError, match="photo.jpg cannot be decoded .*truncated"):
        open_media(data[: len(data) // 2], name="photo.jpg")


def test_large_images_are_downscaled_to_the_page_pixel_cap(rng):
    img = smooth_rgb(rng, 400, 300)
    for data in (png_bytes(img), encoded(img, "JPEG", quality=90)):
        _, page = only_page(data, limits=MediaLimits(max_page_pixels=10_000))
        w, h = page.image.size
        assert w * h <= 10_000
        assert w / h == pytest.approx(4 / 3, rel=0.03)
        assert page.source_size == (400, 300)


def test_photos_are_capped_at_the_photo_pixel_default(rng):
    # 2400 x 1800 (4.32 MP, a phone photo's aspect) is above the 3.1 MP photo default: 2048 x 1536 out (+-1 pixel
    # of rounding), which keeps an A4 sheet filling 86 % of the long side at 150 dpi (MediaLimits.max_photo_pixels)
    img = smooth_rgb(rng, 2400, 1800)
    assert MediaLimits().max_photo_pixels == 2048 * 1536
    for data in (png_bytes(img), encoded(img, "JPEG", quality=90)):
        _, page = only_page(data)
        w, h = page.image.size
        assert w * h <= 2048 * 1536
        assert abs(w - 2048) <= 1 and abs(h - 1536) <= 1
        assert page.source_size == (2400, 1800)


def test_the_photo_cap_is_a_setting_and_the_lower_cap_wins(rng):
    img = smooth_rgb(rng, 2400, 1800)
    _, page = only_page(png_bytes(img), limits=MediaLimits(max_photo_pixels=5_000_000))
    assert page.image.size == (2400, 1800)  # under a raised photo cap: untouched
    _, page = only_page(png_bytes(img), limits=MediaLimits(max_photo_pixels=5_000_000, max_page_pixels=1_000_000))
    assert page.image.size[0] * page.image.size[1] <= 1_000_000


@pytest.mark.parametrize("fmt", ["ICO", "PSD"])
def test_formats_pillow_reads_but_we_do_not_accept(rng, fmt):
    if fmt == "PSD":
        # Pillow cannot write PSD; a minimal header is enough for type detection
        data = (b"8BPS\x00\x01" + b"\x00" * 6 + b"\x00\x03" + b"\x00\x00\x00\x10" * 2 + b"\x00\x08\x00\x03"
                + b"\x00" * 64)
    else:
        data = encoded(random_rgb(rng, 16, 16), fmt)
    with pytest.raises(UnsupportedMediaError, match="which is not accepted"):
        open_media(data)


def test_32_bit_integer_tiff_in_16_bit_range_is_scaled(rng):
    values = rng.integers(0, 65536, (4, 6)).astype(np.int32)
    _, page = only_page(encoded(Image.fromarray(values, "I"), "TIFF"))
    expected = (values >> 8).astype(np.uint8)
    np.testing.assert_array_equal(np.asarray(page.image)[..., 0], expected)


def test_float_tiff_is_stretched_to_full_range(rng):
    values = rng.normal(0.3, 0.1, (4, 6)).astype(np.float32)
    _, page = only_page(encoded(Image.fromarray(values, "F"), "TIFF"))
    expected = np.round((values - values.min()) * 255.0 / (values.max() - values.min()))
    np.testing.assert_allclose(np.asarray(page.image)[..., 0], expected, atol=1)

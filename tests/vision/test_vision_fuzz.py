"""Damaged inputs never escape as anything but MediaError: random byte flips, truncations and zeroed blocks of
every kind (fresh random damage each run). Pages that do come out are RGB images or carry a MediaError."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from vision_media_factory import encoded, gradient_frames, pdf_bytes, random_words, smooth_rgb, write_video

from vision import MediaError, MediaLimits, open_media


def damage(data: bytes, rng: np.random.Generator) -> bytes:
    b = bytearray(data)
    op = int(rng.integers(0, 3))
    if op == 0:
        for _ in range(int(rng.integers(1, 20))):
            b[int(rng.integers(0, len(b)))] = int(rng.integers(0, 256))
    elif op == 1:
        b = b[: int(rng.integers(1, len(b)))]
    else:
        start = int(rng.integers(0, len(b)))
        stop = min(len(b), start + int(rng.integers(1, 500)))
        b[start:stop] = bytes(stop - start)
    return bytes(b)


def check(data: bytes) -> None:
    try:
        with open_media(data, limits=MediaLimits(decode_timeout_s=30)) as doc:
            for page in doc.pages():
                assert page.error is None or isinstance(page.error, MediaError)
                assert page.image is None or page.image.mode == "RGB"
                _ = page.text
    except MediaError:
        pass


def still_inputs(rng: np.random.Generator) -> dict[str, bytes]:
    img = smooth_rgb(rng, 60, 40)
    frames = [smooth_rgb(rng, 30, 20) for _ in range(3)]
    return {
        "pdf": pdf_bytes([random_words(rng) for _ in range(3)]),
        "jpeg": encoded(img, "JPEG"),
        "png": encoded(img.convert("RGBA"), "PNG"),
        "tiff": encoded(frames[0], "TIFF", save_all=True, append_images=frames[1:], compression="tiff_lzw"),
        "webp": encoded(img, "WEBP"),
        "gif": encoded(img, "GIF"),
        "heic": encoded(img, "HEIF"),
    }


@pytest.mark.filterwarnings("ignore::UserWarning")  # Pillow warns about the damage; we only check what escapes
@pytest.mark.parametrize("kind", ["pdf", "jpeg", "png", "tiff", "webp", "gif", "heic"])
def test_damaged_still_media(kind):
    rng = np.random.default_rng()
    data = still_inputs(rng)[kind]
    for _ in range(25):
        check(damage(data, rng))


def test_damaged_video(tmp_path: Path):
    rng = np.random.default_rng()
    data = write_video(tmp_path / "v.mp4", gradient_frames(rng, 20), fps=10, gop=5).read_bytes()
    for _ in range(6):
        check(damage(data, rng))

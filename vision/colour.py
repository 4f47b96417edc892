"""Normalise any Pillow image mode to 8-bit RGB.

Pillow's plain `convert("RGB")` is wrong for several modes we meet in scans: 16-bit greyscale is clipped at 255
instead of scaled (a 16-bit scan turns almost white), transparent pixels become black (a PNG logo on a transparent
background turns into a black box) and CMYK ignores the embedded ICC profile. This module handles those cases.
"""

from __future__ import annotations

import io

import numpy as np
from PIL import Image, ImageCms

_SRGB = ImageCms.createProfile("sRGB")
_WHITE = (255, 255, 255, 255)


def _over_white(img: Image.Image) -> Image.Image:
    # Documents are printed on white paper: transparent areas are paper, not ink.
    rgba = img.convert("RGBA")
    background = Image.new("RGBA", rgba.size, _WHITE)
    return Image.alpha_composite(background, rgba).convert("RGB")


def _cmyk_to_rgb(img: Image.Image) -> Image.Image:
    icc = img.info.get("icc_profile")
    if icc:
        try:
            source = ImageCms.ImageCmsProfile(io.BytesIO(icc))
            converted = ImageCms.profileToProfile(img, source, _SRGB, outputMode="RGB")
            if converted is not None:  # None only with inPlace=True
                return converted
        except (ImageCms.PyCMSError, OSError, ValueError):
            pass  # a broken profile is common; the plain conversion is still a usable picture
    return img.convert("RGB")


def _grey_array_to_rgb(values: np.ndarray, sixteen_bit: bool) -> Image.Image:
    if sixteen_bit:
        grey = (values.astype(np.uint32) >> 8).astype(np.uint8)
    else:  # 32-bit int or float with no known range: stretch what is there to 0..255
        values = values.astype(np.float64)
        lo, hi = float(values.min()), float(values.max())
        scale = 255.0 / (hi - lo) if hi > lo else 0.0
        grey = np.clip((values - lo) * scale, 0, 255).round().astype(np.uint8)
    return Image.fromarray(grey, mode="L").convert("RGB")


def to_rgb(img: Image.Image) -> Image.Image:
    """Return an 8-bit RGB version of `img` (the same object when it already is RGB)."""
    mode = img.mode
    if mode == "RGB":
        return img
    if mode in ("RGBA", "LA", "RGBa", "PA"):
        return _over_white(img)
    if mode == "P":
        return _over_white(img) if "transparency" in img.info else img.convert("RGB")
    if mode == "CMYK":
        return _cmyk_to_rgb(img)
    if mode.startswith("I;16"):
        return _grey_array_to_rgb(np.asarray(img), sixteen_bit=True)
    if mode == "I":
        values = np.asarray(img)
        in_16_bit_range = values.size > 0 and values.min() >= 0 and values.max() <= 65535
        return _grey_array_to_rgb(values, sixteen_bit=in_16_bit_range)
    if mode == "F":
        return _grey_array_to_rgb(np.asarray(img), sixteen_bit=False)
    if mode == "LAB":
        rgb = ImageCms.applyTransform(
            img, ImageCms.buildTransform(ImageCms.createProfile("LAB"), _SRGB, "LAB", "RGB")
        )
        if rgb is not None:  # None only with inPlace=True
            return rgb
    return img.convert("RGB")  # 1, L, RGBX, YCbCr, HSV: Pillow's conversion is correct

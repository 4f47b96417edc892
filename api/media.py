"""Media of chat requests: `data:` URLs opened by `vision` (the one door for images and videos), paid for out of a
per-request budget before any pixel is decoded.

Only inline data is accepted (gpu_engine.data_url: no server-side fetches). An image's size is read from its
header (`vision.image_size`) and charged to the request's budget before it is decoded, in vision's isolated render
process (`vision.open_isolated`, like a document's pages): Pillow holds the GIL while it decodes, so in this process
a slow image would stall every thread, the event loop included; there it costs at most
`ApiLimits.image_decode_timeout_s` (a crash or the memory limit costs a 400). A video is probed by vision's isolated
decoder process, its frames are planned with the engine's sampling rule (`gpu_engine.frame_sampling`) and charged,
and only then decoded (in that process, so a crashing decoder costs a 400, not the server). The engine then gets
decoded frames with their timestamps and samples nothing again.
Called on a worker thread (see openai_compat): nothing here runs on the event loop.
"""
from __future__ import annotations

import os
import re
import tempfile
from dataclasses import dataclass, replace

from PIL import Image

from gpu_engine.data_url import DataUrlError, parse_data_url
from gpu_engine.frame_sampling import QwenFrameSampler
from vision import (
    CorruptMediaError,
    LimitExceededError,
    MediaLimits,
    MediaPage,
    RenderOptions,
    UnsupportedMediaError,
    image_size,
    open_isolated,
    open_media,
)
from vision import MediaError as VisionError

from .errors import ApiError, BodyTooLarge

MAX_IMAGE_PIXELS = 50_000_000  # about 7000 x 7000 per image; larger images are refused, not decoded
# What vision may spend on one chat part (the data: URL's size cap is set per request): a video decodes in its
# isolated process for at most a minute, and images and frames come out at most 4 Mpx (the model's processor
# shrinks them further).
CHAT_MEDIA_LIMITS = MediaLimits(max_image_pixels=MAX_IMAGE_PIXELS, max_page_pixels=4_000_000, decode_timeout_s=60.0)

# Beyond the image's own decode budget: starting a render process when none is warm (seconds when overloaded).
RENDER_START_ALLOWANCE_S = 30.0

_PATH = re.compile(r"(?<![\w.])(?:/[\w.@+-]+){2,}/?")
_ADDRESS = re.compile(r"\b0x[0-9a-fA-F]{6,}\b")


def public_text(text: str) -> str:
    """`text` without server paths or Python object addresses (what an error may say to any client)."""
    return _ADDRESS.sub("(address)", _PATH.sub("(server path)", text))


class MediaError(ApiError):
    def __init__(self, code: str, detail: str, status: int = 400) -> None:
        super().__init__(status, code, public_text(detail))


class MediaBudgetExceeded(ApiError):
    def __init__(self, detail: str) -> None:
        super().__init__(413, "media_budget_exceeded", detail)


@dataclass
class MediaBudget:
    """What one chat request may decode, charged before decoding: media parts (an image, or one video frame) and
    decoded pixels (each image at its header size, each video frame at the size it will come out)."""

    max_parts: int
    max_pixels: int
    parts: int = 0
    pixels: int = 0

    def charge(self, what: str, parts: int, pixels: int) -> None:
        if self.parts + parts > self.max_parts:
            raise ApiError(400, "too_many_media_parts",
                           f"{what} would bring this request to {self.parts + parts} images/video frames; at most "
                           f"{self.max_parts} per request (a video counts each sampled frame: lower its fps or "
                           "trim it).")
        if self.pixels + pixels > self.max_pixels:
            raise MediaBudgetExceeded(
                f"{what} would bring this request to {self.pixels + pixels:,} decoded pixels; at most "
                f"{self.max_pixels:,} per request. Send fewer or smaller images (or a shorter/lower-fps video).")
        self.parts += parts
        self.pixels += pixels


def _payload(url: str, max_bytes: int) -> bytes:
    try:
        return parse_data_url(url, max_bytes).data
    except DataUrlError as exc:
        if exc.reason == "too_large":
            raise BodyTooLarge(max_bytes) from exc
        code = "remote_url_refused" if exc.reason == "remote" else "invalid_media_url"
        raise MediaError(code, str(exc)) from exc


def _vision_limits(max_bytes: int) -> MediaLimits:
    return replace(CHAT_MEDIA_LIMITS, max_file_bytes=max_bytes)


def _refusal(kind: str, what: str, exc: VisionError) -> MediaError:
    # The isolated decoder's last words may quote its own stack: keep our sentence, not its stderr.
    detail = str(exc).split(" Decoder said:", 1)[0]
    if isinstance(exc, LimitExceededError):
        return MediaError(f"{kind}_too_large", f"{what}: {detail}")
    if isinstance(exc, (UnsupportedMediaError, CorruptMediaError)):
        return MediaError(f"invalid_{kind}", f"{what}: {detail}")
    return MediaError(f"invalid_{kind}", f"{what} could not be read: {detail}")


def decode_image(url: str, what: str, max_bytes: int, budget: MediaBudget, timeout_s: float) -> Image.Image:
    """A decoded RGB image from a data: URL, charged to `budget` (from its header) before it is decoded in a
    render process, within `timeout_s` (see the module docstring)."""
    data = _payload(url, max_bytes)
    try:
        size = image_size(data, name=what)
        if size.pixels > MAX_IMAGE_PIXELS:
            raise MediaError("image_too_large", f"{what} is {size.width}x{size.height} pixels; the limit is "
                                                f"{MAX_IMAGE_PIXELS:,} pixels per image. Downscale it.")
        budget.charge(what, 1, size.pixels)
        page = _decode_isolated(data, what, replace(_vision_limits(max_bytes), page_render_timeout_s=timeout_s,
                                                    document_render_timeout_s=timeout_s + RENDER_START_ALLOWANCE_S))
    except VisionError as exc:
        raise _refusal("image", what, exc) from exc
    if page.image is None:
        raise _refusal("image", what, page.error) if page.error is not None else \
            MediaError("invalid_image", f"{what} decoded to nothing; the file is damaged.")
    return page.image


def _decode_isolated(data: bytes, what: str, limits: MediaLimits) -> MediaPage:
    """The image's one page, decoded by a render process (which reads a file: a private temporary one, removed
    afterwards)."""
    fd, path = tempfile.mkstemp(prefix="docpipe-chat-", suffix=".img")  # mode 0600
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        with open_isolated(path, limits=limits, name=what, text=False) as doc:
            return next(iter(doc.pages()))
    finally:
        os.unlink(path)


@dataclass(frozen=True)
class VideoFrames:
    """A video's sampled frames, decoded, and the time (seconds) each one is shown at."""

    frames: list[Image.Image]
    timestamps: list[float]


def decode_video(url: str, what: str, fps: float, max_bytes: int, budget: MediaBudget) -> VideoFrames:
    """The frames the model sees of a data: URL video (`fps` frames per second, the engine's rule), charged to
    `budget` from the probe before any frame is decoded. Decoding runs in vision's isolated process."""
    data = _payload(url, max_bytes)
    options = RenderOptions(frame_sampler=QwenFrameSampler(fps=fps))
    try:
        with open_media(data, limits=_vision_limits(max_bytes), options=options, name=what) as doc:
            if doc.kind != "video":
                raise MediaError("invalid_video", f"{what} is {doc.media_type}, not a video (checked by content).")
            width, height = doc.metadata["width"], doc.metadata["height"]
            per_frame = min(width * height, CHAT_MEDIA_LIMITS.max_page_pixels)  # the decoder downscales to it
            budget.charge(f"{what} ({doc.page_count} frames at {fps:g} fps)", doc.page_count,
                          doc.page_count * per_frame)
            pages = [page for page in doc.pages() if page.image is not None]
    except VisionError as exc:
        raise _refusal("video", what, exc) from exc
    if not pages:
        raise MediaError("invalid_video", f"{what}: none of its frames could be decoded; the file is damaged.")
    return VideoFrames([p.image for p in pages if p.image is not None], [float(p.timestamp or 0.0) for p in pages])

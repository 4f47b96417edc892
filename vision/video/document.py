"""`VideoDocument`: a probed video whose pages are Qwen-sampled frames, decoded lazily in an isolated process.

- Probe (in the child): container, codec, size, fps, frame count, duration, rotation; a container without a video
  stream is `NoVideoStreamError`; longer than `MediaLimits.max_video_seconds` is `LimitExceededError`.
- Sampling: `RenderOptions.frame_sampler(total_frames, fps)` (every frame when None), padded to an even count
  by repeating the last frame (`pad_frames_to`). `page_count` is that planned count.
- One decoder child (see isolate.py) probes at open and decodes on the first `pages()`; it is stopped when the
  frames are done, on `close()`, or when the document is garbage-collected.
- Decoding: only the sampled frames are converted (and only the stretches of stream that contain them are
  decoded: the child seeks when a keyframe lies between two targets). Frames are downscaled to
  `MediaLimits.max_page_pixels` in the child and rotated upright here using the display-matrix rotation.
- `frames_at(timestamps)` decodes arbitrary frames (no sampling, dedupe or padding) for callers that choose their
  own.
- Frame index -> time assumes a constant frame rate (`timestamp = index / fps`), which is also how Qwen's processor
  computes frame timestamps; for variable-rate files the frame nearest that time is used.
- If the stream ends before a planned frame (a truncated file whose header promised more), that frame comes out as
  a page with `error` set. A decoder crash or timeout mid-way raises from `pages()`.
"""

from __future__ import annotations

import os
import tempfile
import weakref
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from PIL import Image

from ..document import MediaDocument
from ..errors import (
    CorruptMediaError,
    LimitExceededError,
    MediaError,
    NoVideoStreamError,
)
from ..limits import MediaLimits, RenderOptions
from ..page import MediaPage
from . import isolate
from .dedupe import NearDuplicateFilter
from .sampling import pad_indices

_TRANSPOSE = {90: Image.Transpose.ROTATE_90, 180: Image.Transpose.ROTATE_180, 270: Image.Transpose.ROTATE_270}


def upright(image: Image.Image, rotation: int) -> Image.Image:
    """Apply a display-matrix rotation (degrees counter-clockwise, as FFmpeg/PyAV report it)."""
    degrees = rotation % 360
    if degrees == 0:
        return image
    if degrees in _TRANSPOSE:
        return image.transpose(_TRANSPOSE[degrees])
    return image.rotate(degrees, expand=True, fillcolor=(255, 255, 255))


def _release(resources: dict[str, Any]) -> None:
    """Stop the decoder child and delete our temporary copy (runs on close() or garbage collection)."""
    child = resources.pop("child", None)
    if child is not None:
        child.close()
    temp = resources.pop("temp", None)
    if temp is not None:
        try:
            os.unlink(temp)
        except FileNotFoundError:
            pass


class VideoDocument(MediaDocument):
    kind = "video"

    def __init__(
        self, source: bytes | Path, *, media_type: str, name: str, limits: MediaLimits, options: RenderOptions
    ) -> None:
        self.media_type = media_type
        self._name = name
        self._limits = limits
        self._options = options
        # Everything that must be released lives in one dict, so a finalizer can release it without holding self.
        self._resources: dict[str, Any] = {}
        self._release = weakref.finalize(self, _release, self._resources)
        if isinstance(source, Path):
            self._path = str(source)
        else:  # the decoder child reads a file; bytes go to a private temporary file removed on close/GC
            fd, self._path = tempfile.mkstemp(prefix="docpipe-video-")
            self._resources["temp"] = self._path
            with os.fdopen(fd, "wb") as f:
                f.write(source)
        try:
            self._resources["child"] = self._new_child()
            info = self._probe()
        except BaseException:
            self.close()
            raise
        self._info = info
        self._failure = ""
        fps = info["fps"]
        total = info["frames"]
        plan = list(range(total)) if options.frame_sampler is None else list(options.frame_sampler(total, fps))
        if not plan or any(not 0 <= i < total for i in plan):
            self.close()
            raise ValueError(f"RenderOptions.frame_sampler gave {len(plan)} frame indices for a {total}-frame video; "
                             f"it must give at least one, each in 0..{total - 1}")
        self._plan = pad_indices(sorted(int(i) for i in plan), options.pad_frames_to)
        rotation = info["rotation"] % 360
        w, h = info["width"], info["height"]
        self._display_size = (h, w) if rotation in (90, 270) else (w, h)
        self.metadata: dict[str, Any] = {
            "container": info["container"],
            "codec": info["codec"],
            "width": self._display_size[0],
            "height": self._display_size[1],
            "fps": fps,
            "total_frames": info["frames"],
            "duration": info["duration"],
            "rotation": info["rotation"],
            "streams": info["streams"],
            "frame_indices": self._plan,
            "dedupe_frames": options.dedupe_frames,
        }

    def _new_child(self) -> isolate.DecoderProcess:
        return isolate.DecoderProcess(timeout_s=self._limits.decode_timeout_s,
                                      memory_bytes=self._limits.decode_memory_bytes, name=self._name)

    def _probe(self) -> dict[str, Any]:
        info: dict[str, Any] | None = None
        for header, _ in self._resources["child"].request({"op": "probe", "path": self._path}):
            if header["type"] == "error" and header["kind"] == "no_video":
                found = ", ".join(f"{s['type']} ({s['codec']})" for s in header["streams"]) or "no streams at all"
                raise NoVideoStreamError(
                    f"{self._name} is a {self.media_type} container without a video stream (found: {found}); "
                    f"only videos are accepted — for audio-only files there is nothing to read."
                )
            if header["type"] == "probe":
                info = header
        if info is None:
            raise CorruptMediaError(f"{self._name}: the video probe returned nothing; the file is damaged.")
        if info["fps"] <= 0 or info["frames"] <= 0:
            raise CorruptMediaError(
                f"{self._name} does not state a frame rate or frame count; re-encode it (e.g. to H.264 MP4)."
            )
        if info["duration"] > self._limits.max_video_seconds:
            raise LimitExceededError(
                f"{self._name} lasts {info['duration']:.1f} s; the limit is {self._limits.max_video_seconds:g} s "
                f"(MediaLimits.max_video_seconds). Trim the video or raise the limit."
            )
        return info

    @property
    def page_count(self) -> int:
        return len(self._plan)

    def _frame_page(self, header: dict[str, Any], payload: bytearray) -> MediaPage:
        image = Image.frombytes("RGB", (header["width"], header["height"]), payload)
        return MediaPage(
            index=0,  # set by pages(), which knows the output position
            kind="frame",
            image=upright(image, header["rotation"]),
            source_size=self._display_size,
            timestamp=header["index"] / self._info["fps"],
            frame_index=header["index"],
        )

    def _decoded(self, indices: list[int]) -> Iterator[tuple[int, MediaPage | None]]:
        """(source index, page or None when the stream ended before it) in ascending source order."""
        if self._release.alive is False:
            raise MediaError(f"{self._name} was closed; open it again to read its frames.")
        # The probe's child is reused for the first decode; a second pages() call starts a fresh one.
        child = self._resources.pop("child", None) or self._new_child()
        self._resources["child"] = child  # so close() stops it even while we are suspended mid-stream
        request = {"op": "decode", "path": self._path, "indices": sorted(set(indices)),
                   "fps": self._info["fps"], "start": self._info["start"],
                   "max_pixels": self._limits.max_page_pixels}
        try:
            for header, payload in child.request(request):
                if header["type"] == "frame":
                    yield header["index"], self._frame_page(header, payload)
                elif header["type"] == "done":
                    self._failure = header["failure"]
                    for missing in header["missing"]:
                        yield missing, None
        finally:
            child.close()
            if self._resources.get("child") is child:
                del self._resources["child"]

    def _missing(self, source_index: int) -> MediaPage:
        return MediaPage(
            index=0, kind="frame", image=None, source_size=self._display_size,
            timestamp=source_index / self._info["fps"], frame_index=source_index,
            error=CorruptMediaError(
                f"frame {source_index} of {self._name} cannot be decoded ({self._failure}); the file is "
                f"truncated or damaged from here on — the earlier frames are fine. Upload it again."
            ),
        )

    def frames_at(self, timestamps: Sequence[float]) -> Iterator[MediaPage]:
        """Decode only the frames shown at `timestamps` (seconds from the start; frame = round(t * fps), clamped
        to the clip). Yields one page per distinct frame, in time order, without sampling, dedupe or padding —
        for callers (e.g. an engine processor) that choose their own frames."""
        fps, last = self._info["fps"], self._info["frames"] - 1
        indices = sorted({min(max(round(t * fps), 0), last) for t in timestamps})
        for position, (source_index, page) in enumerate(self._decoded(indices)):
            page = page if page is not None else self._missing(source_index)
            page.index = position
            yield page

    def pages(self) -> Iterator[MediaPage]:
        dedupe = NearDuplicateFilter(self._options.dedupe_max_distance) if self._options.dedupe_frames else None
        count = 0
        last: MediaPage | None = None
        for source_index, page in self._decoded(self._plan):
            if page is None:
                page = self._missing(source_index)
            elif dedupe is not None and page.image is not None and not dedupe.keep(page.image):
                continue
            page.index = count
            count += 1
            last = page
            yield page
        multiple = self._options.pad_frames_to
        while last is not None and multiple > 1 and count % multiple:
            # Qwen pads the temporal dimension by repeating the last frame; yield that frame again.
            yield MediaPage(index=count, kind="frame", image=last.image, source_size=last.source_size,
                            timestamp=last.timestamp, frame_index=last.frame_index, error=last.error)
            count += 1

    def close(self) -> None:
        self._release()

"""Video files in, RGB frames out (PyAV). Only the frames the processor samples are converted to pixels.

The engine decodes its own videos (it may not import our vision/ package). Frame index i is the i-th frame in
presentation order, which is what the processor's sampling and timestamps count in.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np


class VideoError(ValueError):
    """A video cannot be opened, has no video stream, or lacks frames it claims to have."""


@dataclass(frozen=True)
class VideoInfo:
    total_frames: int
    fps: float
    width: int
    height: int

    @property
    def duration(self) -> float:
        return self.total_frames / self.fps


def _open(path: Path):  # -> av.container.InputContainer
    import av  # local import: only video inputs need PyAV

    if not path.is_file():
        raise VideoError(f"video file not found: {path}")
    try:
        container = av.open(str(path))
    except (av.error.FFmpegError, OSError, UnicodeDecodeError) as exc:
        raise VideoError(f"cannot open video {path}: {exc}") from exc
    if not container.streams.video:
        container.close()
        raise VideoError(f"{path} has no video stream")
    return container


def probe_video(path: str | Path) -> VideoInfo:
    """Frame count, frame rate and size of the first video stream (frame count from packets if the header lacks it)."""
    import av

    path = Path(path)
    container = _open(path)
    try:
        stream = container.streams.video[0]
        rate = stream.average_rate or stream.guessed_rate or stream.base_rate
        if not rate or float(rate) <= 0:
            raise VideoError(f"{path}: the video stream has no frame rate")
        total = int(stream.frames or 0)
        if total <= 0:  # some containers do not store a count: count packets that carry a frame (no decoding)
            total = sum(1 for packet in container.demux(stream) if packet.size > 0)
        if total <= 0:
            raise VideoError(f"{path}: the video stream has no frames")
        return VideoInfo(total_frames=total, fps=float(rate), width=stream.width, height=stream.height)
    except av.error.FFmpegError as exc:
        raise VideoError(f"cannot read video {path}: {exc}") from exc
    finally:
        container.close()


def read_video_frames(path: str | Path, indices: Sequence[int]) -> list[np.ndarray]:
    """RGB uint8 frames [H, W, 3] at the given 0-based frame indices (in the order asked, repeats allowed).

    Decodes sequentially up to the last wanted index (frame-accurate, unlike keyframe seeking) and converts only
    the wanted frames to RGB.
    """
    import av

    path = Path(path)
    wanted = sorted(set(int(i) for i in indices))
    if not wanted:
        return []
    if wanted[0] < 0:
        raise VideoError(f"{path}: negative frame index {wanted[0]}")
    found: dict[int, np.ndarray] = {}
    container = _open(path)
    try:
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        last = wanted[-1]
        wanted_set = set(wanted)
        for index, frame in enumerate(container.decode(stream)):
            if index in wanted_set:
                found[index] = frame.to_ndarray(format="rgb24")
            if index >= last:
                break
    except av.error.FFmpegError as exc:
        raise VideoError(f"cannot decode video {path}: {exc}") from exc
    finally:
        container.close()
    missing = [i for i in wanted if i not in found]
    if missing:
        raise VideoError(f"{path}: frames {missing[:5]} could not be decoded (video shorter than its header says?)")
    return [found[int(i)] for i in indices]

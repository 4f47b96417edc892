"""Isolated video decoder process. Run as a script by `isolate.py`, never imported by the parent.

It is a standalone file (imports only the standard library, numpy and PyAV) so that it starts without our package
on `sys.path`. A damaged stream may crash FFmpeg's decoders (PyAV issue 2344: SIGSEGV on truncated H.264); here a
crash only kills this process, and the parent turns it into `DecoderCrashedError`.

Protocol: JSON request lines on stdin (op "probe" or "decode"), served in order until stdin closes. Replies on
stdout, each a 4-byte big-endian header length, a JSON header, then `nbytes` raw bytes (RGB24 pixels for frames).
Header "type": probe | error (each ends a request), frame (many) then done (ends a decode).
"""

from __future__ import annotations

import bisect
import json
import math
import os
import struct
import sys
from typing import Any, BinaryIO

import av

SEEK_MIN_GAP_S = 0.5  # never seek for targets this close: decoding forward is cheaper


def send(out: BinaryIO, header: dict[str, Any], payload: bytes = b"") -> None:
    header["nbytes"] = len(payload)
    raw = json.dumps(header).encode()
    out.write(struct.pack(">I", len(raw)) + raw)
    if payload:
        out.write(payload)
    out.flush()


def fit(width: int, height: int, max_pixels: int) -> tuple[int, int]:
    if width * height <= max_pixels:
        return width, height
    scale = math.sqrt(max_pixels / (width * height))
    # even sizes keep swscale's chroma handling exact
    return max(2, int(width * scale) // 2 * 2), max(2, int(height * scale) // 2 * 2)


def rotation_of(frame: Any) -> int:
    """Display-matrix rotation in degrees counter-clockwise (PyAV >= 14 exposes it; older PyAV: none)."""
    return int(round(getattr(frame, "rotation", 0) or 0))


def stream_fps(stream: Any) -> float:
    rate = stream.average_rate or stream.guessed_rate or stream.base_rate
    return float(rate) if rate else 0.0


def probe(container: Any) -> dict[str, Any]:
    streams = [{"type": s.type, "codec": s.codec_context.name if s.codec_context else None} for s in container.streams]
    if not container.streams.video:
        return {"type": "error", "kind": "no_video", "message": "no video stream", "streams": streams}
    stream = container.streams.video[0]
    fps = stream_fps(stream)
    if stream.duration is not None and stream.time_base is not None:
        duration = float(stream.duration * stream.time_base)
    elif container.duration is not None:
        duration = container.duration / av.time_base
    else:
        duration = 0.0
    start = float(stream.start_time * stream.time_base) if stream.start_time is not None else 0.0
    first = next(container.decode(stream), None)  # rotation lives in frame side data; one frame proves decodability
    if first is None:
        return {"type": "error", "kind": "corrupt", "message": "the video stream contains no decodable frame"}
    frames = int(stream.frames) or int(round(duration * fps))
    return {
        "type": "probe",
        "container": container.format.name,
        "codec": stream.codec_context.name,
        "width": first.width,
        "height": first.height,
        "fps": fps,
        "frames": frames,
        "frames_from_header": bool(stream.frames),
        "duration": duration,
        "start": start,
        "rotation": rotation_of(first),
        "streams": streams,
    }


def keyframe_times(stream: Any) -> list[float]:
    """Estimated presentation times of the keyframes. The index stores decode timestamps; with B-frames these run
    a constant reorder delay behind presentation times, which we estimate from the first entry."""
    try:
        entries = [e for e in stream.index_entries]
    except (AttributeError, av.FFmpegError):
        return []
    if not entries or stream.start_time is None:
        return []
    delay = float((stream.start_time - entries[0].timestamp) * stream.time_base)
    return sorted(float(e.timestamp * stream.time_base) + max(delay, 0.0) for e in entries if e.is_keyframe)


def decode(container: Any, request: dict[str, Any], out: BinaryIO) -> None:
    stream = container.streams.video[0]
    stream.thread_type = "AUTO"
    # Frame threads each hold decoded frames: a small fixed count keeps memory predictable on many-core hosts.
    stream.codec_context.thread_count = min(4, os.cpu_count() or 1)
    fps, start = request["fps"], request["start"]
    targets: list[int] = sorted(set(request["indices"]))
    keys = keyframe_times(stream)
    frames = None
    position = -1  # index of the last decoded frame
    sought_for = -1  # the target we last seeked for: never seek twice for one target (a seek may land early)
    sent = 0
    failure = ""
    while targets:
        target = targets[0]
        target_time = start + target / fps
        # Seek only when a keyframe lies between where we are and the target; otherwise decode forward.
        at = bisect.bisect_right(keys, target_time + 1e-6)
        last_key = keys[at - 1] if at else None
        current_time = start + position / fps
        ahead = (target != sought_for and last_key is not None and last_key > current_time + 1e-6
                 and target_time - current_time > SEEK_MIN_GAP_S)
        if frames is None or ahead:
            if ahead:
                container.seek(int(target_time / stream.time_base), stream=stream, backward=True)
                sought_for = target
            frames = container.decode(stream)
        try:
            frame = next(frames, None)
        except av.FFmpegError as exc:  # damage mid-stream: report the frames we could not reach, keep the rest
            failure = f"{type(exc).__name__}: {exc}"
            break
        if frame is None:
            failure = "the stream ends before this frame"
            break
        position = round((frame.time - start) * fps) if frame.time is not None else position + 1
        if position < target:
            continue
        width, height = fit(frame.width, frame.height, request["max_pixels"])
        # one conversion even when this frame stands for several targets (frames skipped in a variable-rate file)
        pixels = frame.reformat(width=width, height=height, format="rgb24").to_ndarray().tobytes()
        rotation = rotation_of(frame)
        while targets and targets[0] <= position:
            index = targets.pop(0)
            send(out, {"type": "frame", "index": index, "time": frame.time, "width": width, "height": height,
                       "rotation": rotation}, pixels)
            sent += 1
    send(out, {"type": "done", "sent": sent, "missing": targets, "failure": failure if targets else ""})


def handle(request: dict[str, Any], out: BinaryIO) -> None:
    path = request["path"]
    try:
        with av.open(path, mode="r") as container:
            if request["op"] == "probe":
                send(out, probe(container))
            else:
                decode(container, request, out)
    except (av.FFmpegError, ValueError, OSError, StopIteration, IndexError) as exc:
        # FFmpeg quotes the path; the parent's name for the file is the one a person knows
        message = f"{type(exc).__name__}: {exc}".replace(repr(path), "the file").replace(path, "the file")
        send(out, {"type": "error", "kind": "corrupt", "message": message})
    except MemoryError:
        send(out, {"type": "error", "kind": "memory", "message": "decoder ran out of its memory limit"})


def main() -> int:
    av.logging.set_level(av.logging.PANIC)  # damage is reported through our protocol, not FFmpeg's log
    out = sys.stdout.buffer
    # One request per line (a probe, later a decode of the same file) until the parent closes stdin.
    while line := sys.stdin.readline():
        handle(json.loads(line), out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

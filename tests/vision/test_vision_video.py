"""Video input: probe, Qwen-sampled frames equal to transformers' PyAV loader, rotation, damaged and odd files,
near-duplicate removal, and the isolation of the decoder process (crash, hang, memory limit)."""

from __future__ import annotations

import os
import subprocess
import sys
from functools import partial
from pathlib import Path

import numpy as np
import pytest
from vision_media_factory import document_like, gradient_frames, write_audio_only_mp4, write_video

from gpu_engine.frame_sampling import QwenFrameSampler
from vision import (
    CorruptMediaError,
    DecoderCrashedError,
    DecodeTimeoutError,
    LimitExceededError,
    MediaError,
    MediaLimits,
    NoVideoStreamError,
    RenderOptions,
    open_media,
)
from vision.video import isolate

HERE = Path(__file__).resolve().parent
MISBEHAVING = HERE / "vision_misbehaving_worker.py"
QWEN = RenderOptions(frame_sampler=QwenFrameSampler())  # the plan docpipe uses (Settings.render_options)


def hf_frames(path: Path, fps: float = 2.0, min_frames: int = 4, max_frames: int = 768):
    """transformers' own PyAV loader with Qwen3-VL's sampler: the reference frames and indices."""
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
    from transformers.video_utils import load_video

    processor = Qwen3VLVideoProcessor(min_frames=min_frames, max_frames=max_frames)
    return load_video(str(path), backend="pyav", sample_indices_fn=partial(processor.sample_frames, fps=fps))


def test_probe_metadata_and_planned_count(tmp_path, rng):
    path = write_video(tmp_path / "v.mp4", gradient_frames(rng, 30), fps=10)
    with open_media(path, options=QWEN) as doc:
        assert (doc.kind, doc.media_type) == ("video", "video/mp4")
        m = doc.metadata
        assert (m["codec"], m["width"], m["height"], m["fps"], m["total_frames"]) == ("h264", 64, 48, 10.0, 30)
        assert m["duration"] == pytest.approx(3.0, abs=0.05)
        assert m["rotation"] == 0
        assert doc.page_count == 6 == len(m["frame_indices"])  # 3 s at 2 fps


@pytest.mark.parametrize("gop", [None, 7])  # one keyframe, or a keyframe every 7 frames (the child seeks)
def test_frames_equal_transformers_pyav_loader(tmp_path, rng, gop):
    path = write_video(tmp_path / "v.mp4", gradient_frames(rng, 75), fps=15, gop=gop)
    video, meta = hf_frames(path)
    with open_media(path, options=QWEN) as doc:
        pages = list(doc.pages())
    assert [p.frame_index for p in pages] == list(meta.frames_indices)
    assert len(pages) % 2 == 0
    for page, frame, index in zip(pages, video, meta.frames_indices):
        assert page.kind == "frame" and page.ok
        assert page.timestamp == pytest.approx(index / 15)
        np.testing.assert_array_equal(np.asarray(page.image), frame)


def test_odd_count_padded_by_repeating_the_last_frame(tmp_path, rng):
    path = write_video(tmp_path / "v.mp4", gradient_frames(rng, 25), fps=10)  # 2.5 s -> 5 frames -> pad to 6
    with open_media(path, options=QWEN) as doc:
        pages = list(doc.pages())
    assert QwenFrameSampler()(25, 10.0) == [0, 6, 12, 18, 24]
    assert [p.frame_index for p in pages] == [0, 6, 12, 18, 24, 24]
    assert [p.index for p in pages] == list(range(6))
    assert pages[-1].image is pages[-2].image


@pytest.mark.parametrize("fmt, codec, mime", [("matroska", "libx264", "video/x-matroska"),
                                              ("webm", "libvpx", "video/webm"),
                                              ("mov", "libx264", "video/quicktime")])
def test_other_containers(tmp_path, rng, fmt, codec, mime):
    path = write_video(tmp_path / "v.bin", gradient_frames(rng, 20), fps=10, codec=codec, fmt=fmt)
    with open_media(path, options=QWEN) as doc:
        assert doc.media_type == mime
        pages = list(doc.pages())
    assert len(pages) == 4 and all(p.ok for p in pages)


def test_display_rotation_is_applied(tmp_path, rng):
    frame = np.zeros((32, 64, 3), np.uint8)
    frame[:, :8] = 255  # a white bar along the left edge of the stored frame
    path = write_video(tmp_path / "v.mp4", [frame] * 10, fps=10, rotation=90)
    with open_media(path, options=QWEN) as doc:
        assert doc.metadata["rotation"] == 90
        assert (doc.metadata["width"], doc.metadata["height"]) == (32, 64)
        page = next(doc.pages())
    assert page.image.size == (32, 64) and page.source_size == (32, 64)
    a = np.asarray(page.image.convert("L"), dtype=np.float64)
    # rotated 90 degrees counter-clockwise for display: the left edge becomes the bottom edge
    assert a[-6:, :].mean() > 200 and a[:-10, :].mean() < 30


def test_truncated_mp4_is_corrupt(tmp_path, rng):
    data = write_video(tmp_path / "v.mp4", gradient_frames(rng, 30), fps=10).read_bytes()
    with pytest.raises(CorruptMediaError, match="clip.mp4 cannot be decoded as video .*moov atom not found") as e:
        open_media(data[: len(data) // 2], name="clip.mp4", options=QWEN)
    assert "docpipe-video-" not in str(e.value)  # our temporary file's name never leaks into messages


def test_truncated_faststart_mp4_keeps_the_frames_before_the_damage(tmp_path, rng):
    data = write_video(tmp_path / "v.mp4", gradient_frames(rng, 30), fps=10, gop=5, faststart=True).read_bytes()
    with open_media(data[: int(len(data) * 0.8)], options=QWEN) as doc:
        pages = list(doc.pages())
    assert len(pages) == doc.page_count == 6
    assert pages[0].ok and pages[1].ok
    broken = [p for p in pages if not p.ok]
    assert broken and all(isinstance(p.error, CorruptMediaError) for p in broken)
    assert "earlier frames are fine" in str(broken[0].error)


def test_mp4_without_video_stream(tmp_path):
    path = write_audio_only_mp4(tmp_path / "voice.mp4")
    with pytest.raises(NoVideoStreamError, match=r"voice.mp4 is a video/mp4 container without a video stream "
                                                 r"\(found: audio \(aac\)\)"):
        open_media(path, options=QWEN)


def test_duration_limit(tmp_path, rng):
    path = write_video(tmp_path / "v.mp4", gradient_frames(rng, 30), fps=10)
    with pytest.raises(LimitExceededError, match=r"lasts 3.0 s; the limit is 1 s"):
        open_media(path, limits=MediaLimits(max_video_seconds=1), options=QWEN)


def test_frames_downscaled_to_pixel_cap(tmp_path, rng):
    path = write_video(tmp_path / "v.mp4", gradient_frames(rng, 10, w=128, h=96), fps=10)
    with open_media(path, limits=MediaLimits(max_page_pixels=3000), options=QWEN) as doc:
        page = next(doc.pages())
    assert page.image.width * page.image.height <= 3000 and page.source_size == (128, 96)


def test_near_duplicate_removal(tmp_path, rng):
    a, b = document_like(rng), document_like(rng)
    frames = [np.clip(x.astype(np.int16) + rng.integers(-3, 4, x.shape), 0, 255).astype(np.uint8)
              for x in [a] * 20 + [b] * 20]  # two pages, each held still for 2 s, with sensor noise
    path = write_video(tmp_path / "v.mp4", frames, fps=10)
    with open_media(path, options=QWEN) as doc:
        assert len(list(doc.pages())) == 8  # off by default
    with open_media(path, options=RenderOptions(frame_sampler=QwenFrameSampler(), dedupe_frames=True)) as doc:
        kept = list(doc.pages())
    assert [p.frame_index for p in kept] == [0, 22]
    assert [p.index for p in kept] == [0, 1]


def misbehaving(tmp_path: Path, mode: str) -> Path:
    script = tmp_path / f"{mode}.py"
    script.write_text(f"import runpy, sys\nsys.argv = ['x', {mode!r}]\nrunpy.run_path({str(MISBEHAVING)!r})\n")
    return script


def test_decoder_segfault_becomes_decoder_crashed_error(tmp_path):
    with pytest.raises(DecoderCrashedError, match="was killed by SIGSEGV while reading clip.mp4"):
        list(isolate.run({"op": "probe"}, timeout_s=10, memory_bytes=2**30, name="clip.mp4",
                         script=misbehaving(tmp_path, "segfault")))


def test_hanging_decoder_is_killed_after_the_time_limit(tmp_path):
    with pytest.raises(DecodeTimeoutError, match=r"took longer than 1 s \(MediaLimits.decode_timeout_s\)"):
        list(isolate.run({"op": "probe"}, timeout_s=1, memory_bytes=2**30, name="clip.mp4",
                         script=misbehaving(tmp_path, "hang")))


def test_half_message_then_exit_is_a_crash(tmp_path):
    with pytest.raises(DecoderCrashedError, match="exited with status 0"):
        list(isolate.run({"op": "probe"}, timeout_s=10, memory_bytes=2**30, name="clip.mp4",
                         script=misbehaving(tmp_path, "garbage")))


def test_real_decoder_under_a_tiny_memory_limit_fails_cleanly(tmp_path, rng):
    path = write_video(tmp_path / "v.mp4", gradient_frames(rng, 10), fps=10)
    with pytest.raises(DecoderCrashedError, match="video decoder .* while reading v.mp4"):
        open_media(path, limits=MediaLimits(decode_memory_bytes=48 * 2**20), options=QWEN)


def worker_children() -> list[int]:
    pids = []
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        pids += [int(p) for p in (task / "children").read_text().split()]
    return [p for p in pids if "_worker.py" in Path(f"/proc/{p}/cmdline").read_bytes().decode(errors="replace")]


def test_stopping_early_reaps_the_decoder(tmp_path, rng):
    path = write_video(tmp_path / "v.mp4", gradient_frames(rng, 60, w=320, h=240), fps=10)
    with open_media(path, options=QWEN) as doc:
        it = doc.pages()
        next(it)
        assert worker_children()  # the child is streaming the remaining frames
        it.close()
    assert worker_children() == []


def test_bytes_input_temp_file_removed_on_close(tmp_path, rng):
    data = write_video(tmp_path / "v.mp4", gradient_frames(rng, 10), fps=10).read_bytes()
    doc = open_media(data, options=QWEN)
    temp = Path(doc._path)
    assert temp.exists()
    doc.close()
    assert not temp.exists()


def test_worker_runs_without_our_package_on_the_path(tmp_path, rng):
    # The child is started by file path; it must not need `vision` importable (e.g. from another cwd).
    path = write_video(tmp_path / "v.mp4", gradient_frames(rng, 10), fps=10)
    request = f'{{"op": "probe", "path": "{path}"}}\n'
    out = subprocess.run([sys.executable, "-I", str(isolate.WORKER)], input=request.encode(), capture_output=True,
                         cwd=tmp_path, timeout=60)
    assert out.returncode == 0 and b'"type": "probe"' in out.stdout


def test_probe_child_is_released_on_close_and_on_garbage_collection(tmp_path, rng):
    import gc

    path = write_video(tmp_path / "v.mp4", gradient_frames(rng, 10), fps=10)
    doc = open_media(path, options=QWEN)
    assert worker_children()  # kept for the decode
    doc.close()
    assert worker_children() == []
    doc = open_media(path, options=QWEN)
    del doc
    gc.collect()
    assert worker_children() == []


def test_close_while_streaming_stops_the_decoder_and_refuses_more(tmp_path, rng):
    path = write_video(tmp_path / "v.mp4", gradient_frames(rng, 60, w=320, h=240), fps=10)
    doc = open_media(path, options=QWEN)
    it = doc.pages()
    next(it)
    doc.close()
    assert worker_children() == []
    with pytest.raises(MediaError, match="was closed while its frames were being read"):
        list(it)
    with pytest.raises(MediaError, match="was closed; open it again"):
        next(doc.pages())


def test_pages_can_be_iterated_twice(tmp_path, rng):
    path = write_video(tmp_path / "v.mp4", gradient_frames(rng, 20), fps=10)
    with open_media(path, options=QWEN) as doc:
        first = [p.frame_index for p in doc.pages()]
        second = [p.frame_index for p in doc.pages()]
    assert first == second == [0, 6, 13, 19]


def test_frames_at_requested_timestamps(tmp_path, rng):
    import av

    path = write_video(tmp_path / "v.mp4", gradient_frames(rng, 40), fps=10, gop=8)
    with av.open(str(path)) as container:  # independent reference: every frame, decoded in order
        reference = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    with open_media(path, options=QWEN) as doc:
        pages = list(doc.frames_at([2.5, 0.0, 1.04, 99.0, -1.0]))
    assert [p.frame_index for p in pages] == [0, 10, 25, 39]  # sorted, distinct, clamped to the clip
    assert [p.index for p in pages] == [0, 1, 2, 3]
    for page in pages:
        np.testing.assert_array_equal(np.asarray(page.image), reference[page.frame_index])
        assert page.timestamp == pytest.approx(page.frame_index / 10)

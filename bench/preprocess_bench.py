"""Host-side image preprocessing per vision item, stage by stage, on one thread and on several (issue #14).

    OMP_NUM_THREADS=1 python bench/preprocess_bench.py [--repeats 5] [--threads 1 2 4]
        [--out bench/results/preprocess_bench.json] [--before FILE]

Inputs, as the product hands them to the engine (pipeline/extraction.py passes PIL images and frame lists):
- page: an A4 page rendered at the pipeline's 150 dpi (1240x1755 RGB), resized to 1248x1760 by the processor;
- photo: a phone JPEG at the product's 2048x1536 photo cap with EXIF orientation 6, decoded by the engine's
  media_io (the API path: bytes or a data: URL);
- video: 8 sampled frames of 960x540 (4 s at 2 fps), 4 frame groups; times are given per frame group.
Processor parameters are Qwen3.5's (patch 16, temporal patch 2, merge 2, the checkpoints' pixel budgets).

Each stage is timed on its own (best of --repeats, in this thread's CPU time and in wall time) with the bytes it
produces; `total` runs the whole public call. Threads: N threads each preprocess the same number of fresh copies at
once (wall time); `speedup` is items/s over one thread's -- meaningful only with N idle cores (the JSON keeps
cpu_count and loadavg). `python_share`: how fast a pure-Python counting thread runs next to one preprocessing
thread, over its speed alone, beside the same measure for a C call known to release the GIL (sha256 of 64 MB) and
for pure Python (holds it): near the first when the stages release the GIL (numpy, Pillow and hashlib do so on
large buffers). On a loaded machine both references drop; compare with them. `--before FILE` copies the rows of
an earlier run (e.g. of an older commit) into the output under "before", for a before/after table.
"""
from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import platform
import subprocess
import sys
import threading
import time
import tracemalloc
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
from PIL import Image  # noqa: E402

from gpu_engine import media_io, preprocessing  # noqa: E402
from gpu_engine.frame_resize import resize_like_torch_uint8  # noqa: E402

QWEN = {"patch_size": 16, "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5] * 3,
        "image_std": [0.5] * 3, "rescale_factor": 1 / 255}
IMAGE_CFG = {**QWEN, "size": {"shortest_edge": 65_536, "longest_edge": 16_777_216}}
VIDEO_CFG = {**QWEN, "size": {"shortest_edge": 4_096, "longest_edge": 25_165_824}, "fps": 2.0}


# ----------------------------------------------------------------------------------------------------- inputs


def a4_page(rng: np.random.Generator) -> Image.Image:
    """White A4 at 150 dpi with dark "text lines" (what the PDF renderer hands over: a PIL RGB image)."""
    arr = np.full((1755, 1240, 3), 255, np.uint8)
    for _ in range(60):
        y, x = int(rng.integers(80, 1680)), int(rng.integers(80, 600))
        arr[y:y + 14, x:x + int(rng.integers(100, 560))] = rng.integers(0, 90, 3, dtype=np.uint8)
    return Image.fromarray(arr)


def phone_jpeg(rng: np.random.Generator) -> bytes:
    """2048x1536 JPEG, quality 90, EXIF orientation 6, a shaded scene with noise (the photo cap's size)."""
    h, w = 1536, 2048
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    base = (90 + 60 * np.sin(xx / 300) + 40 * np.cos(yy / 210)).clip(0, 230)
    arr = np.stack([base, base * 0.9, base * 0.8], axis=-1).astype(np.uint8)
    arr += rng.integers(0, 12, arr.shape, dtype=np.uint8)
    out = io.BytesIO()
    exif = Image.Exif()
    exif[0x0112] = 6
    Image.fromarray(arr).save(out, format="JPEG", quality=90, exif=exif)
    return out.getvalue()


def video_clip(rng: np.random.Generator, n: int = 8) -> list[np.ndarray]:
    return [rng.integers(0, 256, (540, 960, 3), dtype=np.uint8) for _ in range(n)]


# ----------------------------------------------------------------------------------------------------- timing


def best_s(fn: Callable[[], Any], repeats: int) -> tuple[float, float, Any]:
    """Best wall seconds and best CPU seconds of this thread (time.thread_time: what the work costs, unlike wall
    time hardly changed by other processes on a shared machine) over `repeats` calls, and the last result."""
    wall, cpu, out = float("inf"), float("inf"), None
    for _ in range(repeats):
        t, c = time.perf_counter(), time.thread_time()
        out = fn()
        cpu = min(cpu, time.thread_time() - c)
        wall = min(wall, time.perf_counter() - t)
    return wall, cpu, out


def nbytes(value: Any) -> int:
    if isinstance(value, np.ndarray):
        return int(value.nbytes)
    if isinstance(value, Image.Image):
        return value.width * value.height * len(value.getbands())
    if isinstance(value, (bytes, str)):
        return len(value)
    return int(getattr(value, "pixel_values", np.empty(0)).nbytes)


def peak_bytes(fn: Callable[[], Any]) -> int:
    """Peak bytes numpy allocated during `fn` (tracemalloc sees numpy's buffers; Pillow's are not counted)."""
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def stage_rows(kind: str, stages: list[tuple[str, Callable[[], Any]]], repeats: int, per: int = 1) -> list[dict]:
    rows = []
    for name, fn in stages:
        wall, cpu, out = best_s(fn, repeats)
        rows.append({"input": kind, "stage": name, "cpu_ms": round(1e3 * cpu / per, 2),
                     "wall_ms": round(1e3 * wall / per, 2), "out_bytes": nbytes(out) // per})
    return rows


def one_image_stages(kind: str, load: Callable[[], Image.Image], repeats: int) -> list[dict]:
    ip = preprocessing.ImageProcessor.from_dict(IMAGE_CFG)
    p = ip.params
    image = load()
    h, w = ip.target_size(image.height, image.width)
    resized = preprocessing._resize_rgb(image, h, w)
    hwc = np.asarray(resized, dtype=np.uint8)[None]
    grid = (1, h // p.patch_size, w // p.patch_size)
    stages: list[tuple[str, Callable[[], Any]]] = [("decode+exif", load)] if kind == "photo" else []
    stages += [
        ("resize", lambda: preprocessing._resize_rgb(image, h, w)),
        ("to_uint8", lambda: np.asarray(resized, dtype=np.uint8)),
        ("normalise+patchify", lambda: p.patches(hwc, still=True)),
        ("hash", lambda: preprocessing.hash_pixels(hwc, grid, p.fingerprint("image"))),
        ("total", lambda: ip.preprocess(load())),
    ]
    return stage_rows(kind, stages, repeats)


def image_stages(page: Image.Image, jpeg: bytes, repeats: int) -> tuple[list[dict], dict[str, Callable[[], Any]]]:
    """Stage rows of the page and the photo, and each one's whole preprocessing call (load included)."""
    ip = preprocessing.ImageProcessor.from_dict(IMAGE_CFG)
    loads: dict[str, Callable[[], Image.Image]] = {"page": lambda: page, "photo": lambda: media_io.load_image(jpeg)}
    rows = [row for kind, load in loads.items() for row in one_image_stages(kind, load, repeats)]
    return rows, {"page": lambda: ip.preprocess(page), "photo": lambda: ip.preprocess(media_io.load_image(jpeg))}


def video_stages(frames: list[np.ndarray], repeats: int) -> tuple[list[dict], Callable[[], Any]]:
    vp = preprocessing.VideoProcessor.from_dict(VIDEO_CFG)
    p = vp.params
    times = [i / 2.0 for i in range(len(frames))]
    groups = len(frames) // p.temporal_patch_size
    h, w = vp.target_size(len(frames), *frames[0].shape[:2])
    hwc = np.stack([resize_like_torch_uint8(f, h, w) for f in frames])
    grid = (1, h // p.patch_size, w // p.patch_size)
    tp = p.temporal_patch_size
    stages: list[tuple[str, Callable[[], Any]]] = [
        ("resize", lambda: np.stack([resize_like_torch_uint8(f, h, w) for f in frames])),
        ("normalise+patchify", lambda: p.patches(hwc)),
        ("hash", lambda: "".join(preprocessing.hash_pixels(hwc[g * tp:(g + 1) * tp], grid, p.fingerprint("video"))
                                 for g in range(groups))),
        ("total", lambda: vp.preprocess(frames, times)),
    ]
    rows = stage_rows("video (per frame group)", stages, repeats, per=groups)
    return rows, lambda: vp.preprocess(frames, times)


def thread_rows(kind: str, fn: Callable[[], Any], threads: list[int], items: int) -> list[dict]:
    rows, base = [], None
    for n in threads:
        def work() -> None:
            for _ in range(items):
                fn()
        pool = [threading.Thread(target=work) for _ in range(n)]
        t = time.perf_counter()
        for th in pool:
            th.start()
        for th in pool:
            th.join()
        rate = n * items / (time.perf_counter() - t)
        base = base or rate
        rows.append({"input": kind, "threads": n, "items_per_s": round(rate, 2), "speedup": round(rate / base, 2)})
    return rows


def python_share(fn: Callable[[], Any], seconds: float = 1.5) -> float:
    """Counting rate of a pure-Python thread next to a thread running `fn` in a loop, over its rate alone."""
    def count(stop: threading.Event, out: list[int]) -> None:
        n = 0
        while not stop.is_set():
            n += 1
        out.append(n)

    def rate(with_work: bool) -> float:
        stop, out = threading.Event(), list[int]()
        counter = threading.Thread(target=count, args=(stop, out))
        busy = threading.Event()

        def work() -> None:
            while not busy.is_set():
                fn()
        worker = threading.Thread(target=work)
        if with_work:
            worker.start()
        counter.start()
        time.sleep(seconds)
        stop.set()
        busy.set()
        counter.join()
        if with_work:
            worker.join()
        return out[0] / seconds

    alone = rate(False)
    return round(rate(True) / alone, 2)


def table(rows: list[dict], cols: list[str]) -> str:
    widths = [max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in cols]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths))]
    lines += ["  ".join(str(r.get(c, "")).ljust(w) for c, w in zip(cols, widths)) for r in rows]
    return "\n".join(lines)


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--thread-items", type=int, default=4, help="items per thread in the threads rows")
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/preprocess_bench.json")
    parser.add_argument("--gil-seconds", type=float, default=1.5, help="window of each python_share measure")
    parser.add_argument("--before", type=Path, help="an earlier run's JSON, copied under 'before'")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.thread_items < 1 or min(args.threads) < 1 or args.gil_seconds <= 0:
        parser.error("--repeats, --thread-items, --threads and --gil-seconds must be positive")

    rng = np.random.default_rng(0)
    page, jpeg, frames = a4_page(rng), phone_jpeg(rng), video_clip(rng)
    rows, totals = image_stages(page, jpeg, args.repeats)
    video_rows, video_total = video_stages(frames, args.repeats)
    rows += video_rows
    print(table(rows, ["input", "stage", "cpu_ms", "wall_ms", "out_bytes"]), flush=True)

    memory = [{"input": kind, "pixel_values_bytes": nbytes(fn()), "numpy_peak_bytes": peak_bytes(fn)}
              for kind, fn in (*totals.items(), ("video (whole clip)", video_total))]
    print("\n" + table(memory, ["input", "pixel_values_bytes", "numpy_peak_bytes"]), flush=True)

    threads = []
    for kind, fn in (*totals.items(), ("video", video_total)):
        threads += thread_rows(kind, fn, args.threads, args.thread_items)
    # References on the same (possibly busy) machine: a C call that releases the GIL (sha256 of 64 MB) and pure
    # Python that holds it; a stage's share near the first means it releases the GIL.
    big = np.zeros(64 << 20, np.uint8)
    references: dict[str, Callable[[], Any]] = {
        "ref_releases_gil": lambda: hashlib.sha256(big.data).digest(), "ref_holds_gil": lambda: sum(range(200_000))}
    share = {kind: python_share(fn, args.gil_seconds)
             for kind, fn in (*totals.items(), ("video", video_total), *references.items())}
    print("\n" + table(threads, ["input", "threads", "items_per_s", "speedup"]), flush=True)
    print(f"\npython_share (speed of a pure-Python thread beside it, over alone): {share}", flush=True)

    result: dict[str, Any] = {
        "bench": "preprocess_bench", "date_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "git_commit": git_commit(), "device": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(), "loadavg": os.getloadavg(), "python": platform.python_version(),
        "numpy": np.__version__, "pillow": Image.__version__, "repeats": args.repeats,
        "stages": rows, "memory": memory, "threads": threads, "python_share": share,
    }
    if args.before:
        result["before"] = json.loads(args.before.read_text())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

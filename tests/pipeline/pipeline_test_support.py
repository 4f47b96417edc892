"""Helpers shared by the pipeline tests (fixtures live in conftest.py)."""
from __future__ import annotations

import io
import os
import secrets
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

REPO = Path(__file__).resolve().parents[2]
SAMPLES = REPO / "samples"
PG_ADMIN_URL = os.environ.get("DOCPIPE_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")

# Small answers and a short wait: the bundled tiny model runs on 2 shared cores.
FAST = {"stable_seconds": 0.0, "max_tokens": 256, "video_max_frames": 8, "engine_max_num_seqs": 4}


def sample_files() -> list[Path]:
    from pipeline.cli import sample_files as pick

    return pick(SAMPLES) if SAMPLES.is_dir() else []


def make_own_inputs(folder: Path) -> list[Path]:
    """Small inputs of every kind, for when samples/ is not there yet."""
    import pymupdf as fitz
    from PIL import Image, ImageDraw

    folder.mkdir(parents=True, exist_ok=True)
    pdf = fitz.open()
    for n in range(2):
        page = pdf.new_page(width=300, height=400)
        page.insert_text((30, 60), f"INVOICE 2024-{n:03d}  Total 12.50 EUR", fontsize=10)
    pdf.save(folder / "invoice.pdf")
    image = Image.new("RGB", (240, 320), "white")
    ImageDraw.Draw(image).text((20, 20), "RECEIPT 9.99", fill="black")
    image.save(folder / "receipt.jpg", quality=90)
    frames = [Image.new("RGB", (160, 120), (40 * i, 80, 160)) for i in range(3)]
    frames[0].save(folder / "form.tif", save_all=True, append_images=frames[1:])
    _write_video(folder / "clip.mp4")
    return sorted(folder.iterdir())


def _write_video(path: Path, seconds: float = 2.0, fps: int = 8) -> None:
    import av
    import numpy as np

    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = 128, 96, "yuv420p"
        for i in range(int(seconds * fps)):
            arr = np.full((96, 128, 3), (i * 9) % 255, dtype=np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(arr, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def png_bytes(width: int = 64, height: int = 48, colour: tuple[int, int, int] | None = None) -> bytes:
    """A fresh random-coloured PNG (fresh content = a new document every time)."""
    from PIL import Image

    colour = colour or tuple(secrets.randbelow(256) for _ in range(3))  # type: ignore[assignment]  # an RGB 3-tuple
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), colour).save(buffer, "PNG")
    return buffer.getvalue()


T = TypeVar("T")


def run_at_once(calls: list[Callable[[], T]]) -> tuple[list[T], list[BaseException]]:
    """Run every call on its own thread, all released together by a barrier (to provoke races); their results
    and whatever they raised, collected so that the test asserts on them in the main thread."""
    barrier = threading.Barrier(len(calls))
    results: list[T] = []
    errors: list[BaseException] = []

    def one(call: Callable[[], T]) -> None:
        barrier.wait()
        try:
            results.append(call())
        except BaseException as exc:  # collected and reported by the caller
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(call,)) for call in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, errors


def cli_env(data_dir: Path) -> dict[str, str]:
    """DOCPIPE_* variables for a `docpipe` CLI run: the fast settings and a data dir of its own."""
    values = {f"DOCPIPE_{k.upper()}": str(v) for k, v in FAST.items()}
    values["DOCPIPE_DATA_DIR"] = str(data_dir)
    return values


def invoke_cli(env: dict[str, str], *args: str) -> Any:
    """`docpipe <args>` in-process with exactly `env`'s variables; exceptions propagate."""
    from typer.testing import CliRunner

    from pipeline.cli import app

    return CliRunner().invoke(app, list(args), env=env, catch_exceptions=False)


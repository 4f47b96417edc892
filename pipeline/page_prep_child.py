"""The work of one page-preparation process (pipeline.page_prep): messages in, a ProcessedPrompt's parts out.

A child builds the checkpoint's prompt processor once (gpu_engine.processor.Processor, as the engine builds its
own), then answers tasks on its pipe until told to stop or the pipe closes (the parent is gone):

    ("prep", messages, pixel_path)  ->  ("ok", PreparedParts) | ("refused", reason) | ("no_space", reason)
                                        | ("error", "ExceptionType: message")

The page images arrive as PNG bytes (pipeline.extraction.PngImage) and are decoded here as the job thread would
decode them (extraction.load_png), so the result equals the in-process one value for value. The float32 pixels of
every vision item are written into one file at `pixel_path` (the parent names it, in /dev/shm), which the parent
maps, copies out and unlinks: the ~53 MB of a page never go through the pipe.
"""
from __future__ import annotations

import errno
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np


@dataclass(frozen=True)
class ItemParts:
    """One VisionItem without its pixels: where they lie in the pixel file (bytes) and their shape."""

    kind: str
    grid_thw: tuple[int, int, int]
    token_start: int
    num_tokens: int
    content_hash: str
    timestamp: float | None
    offset: int
    shape: tuple[int, ...]


@dataclass(frozen=True)
class PreparedParts:
    token_ids: np.ndarray
    positions: np.ndarray
    rope_delta: int
    items: list[ItemParts]
    pixel_bytes: int  # size of the pixel file; 0 = no vision items, no file


class NoSpaceError(OSError):
    """The pixel file could not be allocated (the shared-memory folder is full)."""


def build_prepare(model_dir: Path) -> Any:
    """The engine's own `prepare` for the checkpoint (LoadedModel.prepare: Processor.from_pretrained with the
    model config, generation prompt on, thinking off)."""
    from gpu_engine.config import ModelConfig
    from gpu_engine.processor import Processor

    processor = Processor.from_pretrained(model_dir, ModelConfig.from_pretrained(model_dir))
    return processor.prepare


def prepare_parts(prepare: Any, messages: list[dict[str, Any]], pixel_path: str) -> PreparedParts:
    """Decode the messages' PNG pages, run the processor, write the pixels to `pixel_path`. A processor error is
    raised as the engine raises it (gpu_engine RequestError "cannot prepare the messages: ...")."""
    from gpu_engine.prompts import processed_prompt

    from .extraction import decode_pngs

    prompt = processed_prompt(decode_pngs(messages), prepare)
    items, offset = [], 0
    for item in prompt.vision_items:
        items.append(ItemParts(item.kind, item.grid_thw, item.token_start, item.num_tokens, item.content_hash,
                               item.timestamp, offset, tuple(item.pixel_values.shape)))
        offset += item.pixel_values.size * 4
    if offset:
        _write_pixels(pixel_path, [(p, it.pixel_values) for p, it in zip(items, prompt.vision_items)])
    return PreparedParts(prompt.token_ids, prompt.positions, prompt.rope_delta, items, offset)


def _write_pixels(path: str, parts: list[tuple[ItemParts, np.ndarray]]) -> None:
    """pwrite, not a mapping: a full tmpfs is ENOSPC here (never a SIGBUS at a page's first touch), and tmpfs
    takes the bytes without a page fault per 4 KB (2x faster than fallocate + mmap + copy)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        for part, pixels in parts:
            data = np.ascontiguousarray(pixels, np.float32).data.cast("B")
            done = 0
            while done < len(data):
                try:
                    done += os.pwrite(fd, data[done:], part.offset + done)
                except OSError as exc:
                    if exc.errno in (errno.ENOSPC, errno.EFBIG, errno.ENOMEM):
                        raise NoSpaceError(exc.errno, f"cannot write {len(data) / 1e6:.0f} MB of pixels in "
                                           f"{Path(path).parent}: {exc.strerror}") from exc
                    raise
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)


def _warm_up(prepare: Any) -> None:
    """One blank page through the processor before "ready": the first use of the template, tokenizer and the
    big allocations (a first page took 3x a later one) is paid at start, not by a job's first page."""
    from PIL import Image

    page = Image.new("RGB", (1240, 1754), "white")  # an A4 page at 150 dpi: the allocations of a real one
    try:
        prepare([{"role": "user", "content": [{"type": "image", "image": page}, {"type": "text", "text": "a"}]}])
    except Exception:  # a processor that refuses this page still serves real ones: their errors say what is wrong
        pass


def child_main(conn: Any, model_dir: str) -> None:
    """A child process's loop. Ends on ("stop",), or when the parent's end closes (the parent is gone)."""
    from gpu_engine.errors import RequestError

    try:
        prepare = build_prepare(Path(model_dir))
    except Exception as exc:  # the parent reports it: the pool cannot start
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    _warm_up(prepare)
    conn.send(("ready", os.getpid()))
    while True:
        try:
            task = conn.recv()
        except (EOFError, OSError):
            return
        if task[0] == "stop":
            return
        _, messages, pixel_path = task
        try:
            reply: tuple[Any, ...] = ("ok", prepare_parts(prepare, messages, pixel_path))
        except RequestError as exc:
            reply = ("refused", str(exc))
        except NoSpaceError as exc:
            reply = ("no_space", str(exc))
        except Exception as exc:  # a damaged PNG blob, a failed write: the job's error, as in the job thread
            reply = ("error", f"{type(exc).__name__}: {exc}")
        conn.send(reply)


def main(argv: list[str]) -> None:
    """`python -m pipeline.page_prep_child FD MODEL_DIR`: FD is this end of the parent's socket pair."""
    from multiprocessing.connection import Connection

    conn = Connection(int(argv[0]))
    try:
        child_main(conn, argv[1])
    finally:
        conn.close()


if __name__ == "__main__":
    import sys

    from pipeline.page_prep_child import main as module_main  # the module by its name: its classes pickle so

    module_main(sys.argv[1:])

"""A file whose name is not UTF-8 (legal on Linux) is ingested under a storable name instead of stopping the
folder intake with UnicodeEncodeError (SQLite) or a DataError (PostgreSQL)."""
from __future__ import annotations

import io
import os
import random
from collections.abc import Callable
from pathlib import Path

import pytest
from PIL import Image

from pipeline.context import Pipeline
from pipeline.ingest import create_batch
from pipeline.models import Batch
from pipeline.storable_text import storable, storable_name
from pipeline.walk import iter_folder


def _png() -> bytes:
    buf = io.BytesIO()
    Image.frombytes("RGB", (8, 8), random.randbytes(8 * 8 * 3)).save(buf, "PNG")
    return buf.getvalue()


def test_storable_name_keeps_what_it_can() -> None:
    assert storable_name("Rechnung März.pdf") == "Rechnung März.pdf"
    assert storable_name(os.fsdecode(b"bad\xffname.png")) == "bad\ufffdname.png"
    assert storable_name("a\x00b\ud800c") == "ab\ufffdc"
    assert storable(storable_name(os.fsdecode(b"\xc3(\x80\xff")))


def test_a_folder_with_a_non_utf8_file_name_is_ingested(database_url: str, tmp_path: Path,
                                                         make_pipeline: Callable[..., Pipeline]) -> None:
    folder = tmp_path / "in"
    folder.mkdir()
    raw = os.path.join(os.fsencode(folder), b"scan-\xff\xfe.png")
    try:
        with open(raw, "wb") as f:
            f.write(_png())
    except OSError as exc:  # a file system that insists on UTF-8 names cannot hold the case at all
        pytest.skip(f"this file system refuses non-UTF-8 names: {exc}")
    (folder / "plain.png").write_bytes(_png())
    p = make_pipeline(database_url)
    batch_id = create_batch(p, f"folder:{os.fsdecode(raw)}")
    outcomes = list(iter_folder(p, folder, batch_id=batch_id, stable_seconds=0))
    assert sorted((o.name, o.outcome) for o in outcomes) == [("plain.png", "new"), ("scan-\ufffd\ufffd.png", "new")]
    with p.db.read_session() as s:
        source = s.get(Batch, batch_id).source  # type: ignore[union-attr]  # the batch exists
    assert source.endswith("scan-\ufffd\ufffd.png")

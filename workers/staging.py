"""The staging area of queued intakes: `<data_dir>/incoming/<stage id>/` holds the submitted file and `meta.json`.

`docpipe submit` (and `enqueue_ingest`) copy the file here before publishing the ingest message, and the ingest
task deletes the folder once the document is in the database. Until then the folder, not the broker message, is
the record that the file was submitted: the reconciler sends the ingest again for folders whose message is gone.
The data dir must therefore be shared by submitters and ingest workers (it already is for the blob store).
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import BinaryIO

_CHUNK = 1 << 20
META = "meta.json"


class StagingError(ValueError):
    """A staged intake folder is missing or unreadable."""


@dataclass
class StagedFile:
    stage_id: str
    name: str  # the name as submitted (shown to users, never used as a path)
    schema: str | None
    batch_id: int | None
    created: float

    def folder(self, data_dir: Path) -> Path:
        return incoming_dir(data_dir) / self.stage_id

    def payload_path(self, data_dir: Path) -> Path:
        return self.folder(data_dir) / "payload"


def incoming_dir(data_dir: Path) -> Path:
    return Path(data_dir) / "incoming"


def stage(data_dir: Path, source: Path | bytes | BinaryIO, *, name: str, schema: str | None,
          batch_id: int | None) -> StagedFile:
    """Copy the input into a new stage folder, atomically: the folder appears complete or not at all."""
    root = incoming_dir(data_dir)
    root.mkdir(parents=True, exist_ok=True)
    staged = StagedFile(uuid.uuid4().hex, name, schema, batch_id, time.time())
    work = Path(tempfile.mkdtemp(prefix=".stage-", dir=root))  # hidden until renamed
    try:
        with open(work / "payload", "wb") as out:
            if isinstance(source, (bytes, bytearray)):
                out.write(source)
            elif isinstance(source, (str, os.PathLike)):
                with open(source, "rb") as f:
                    shutil.copyfileobj(f, out, _CHUNK)
            else:
                shutil.copyfileobj(source, out, _CHUNK)
            out.flush()
            os.fsync(out.fileno())
        (work / META).write_text(json.dumps(asdict(staged)))
        os.replace(work, root / staged.stage_id)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return staged


def load(data_dir: Path, stage_id: str) -> StagedFile:
    meta = incoming_dir(data_dir) / stage_id / META
    try:
        return StagedFile(**json.loads(meta.read_text()))
    except FileNotFoundError:
        raise StagingError(f"staged intake {stage_id} is gone (already ingested, or the data dir differs "
                           f"between the submitter and this worker: {data_dir})") from None
    except (ValueError, TypeError) as exc:
        raise StagingError(f"staged intake {stage_id} has an unreadable {META}: {exc}") from None


def remove(data_dir: Path, stage_id: str) -> None:
    shutil.rmtree(incoming_dir(data_dir) / stage_id, ignore_errors=True)


def pending(data_dir: Path, older_than_s: float) -> list[StagedFile]:
    """Stage folders created more than `older_than_s` seconds ago (their message may be lost)."""
    root = incoming_dir(data_dir)
    if not root.is_dir():
        return []
    cutoff = time.time() - older_than_s
    out = []
    for entry in sorted(root.iterdir()):
        if entry.name.startswith(".") or not entry.is_dir():
            continue
        try:
            staged = load(data_dir, entry.name)
        except StagingError:
            continue
        if staged.created <= cutoff:
            out.append(staged)
    return out

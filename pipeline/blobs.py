"""Content-addressed blob store on disk: a blob's name is the sha256 of its bytes (`blobs/ab/cdef...`).

Writes are atomic (temporary file in the same directory, fsync, rename), so a reader never sees half a file and a
crash leaves at worst an orphaned temporary file. Originals are always fsynced; derived blobs may skip it. Writing
the same bytes twice is a no-op: storage dedupes itself.
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

_KEY = re.compile(r"^[0-9a-f]{64}$")
_CHUNK = 1 << 20


class BlobNotFoundError(KeyError):
    def __init__(self, key: str) -> None:
        super().__init__(f"blob {key} is not in the store (deleted by retention, or the data dir changed)")


class BlobStore:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def path(self, key: str) -> Path:
        if not _KEY.match(key):
            raise ValueError(f"not a blob key (64 lowercase hex digits): {key!r}")
        return self.root / key[:2] / key[2:]

    def exists(self, key: str) -> bool:
        return self.path(key).is_file()

    def put_bytes(self, data: bytes, *, durable: bool = True) -> str:
        """Store bytes under their sha256. `durable=False` skips the fsync: for derived data (rendered pages) that
        can be made again from a durable original, where an fsync per page would cost more than the rendering."""
        key = hashlib.sha256(data).hexdigest()
        if not self._touch(key):
            self._write(key, [data], durable=durable)
        return key

    def put_stream(self, stream: BinaryIO, *, max_bytes: int | None = None) -> tuple[str, int]:
        """Store a stream without holding it in memory; returns (key, size). Stops with ValueError past max_bytes
        (counted on bytes actually read, never on what a client claimed)."""
        self.root.mkdir(parents=True, exist_ok=True)
        digest = hashlib.sha256()
        size = 0
        fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".incoming-")
        try:
            with os.fdopen(fd, "wb") as out:
                while chunk := stream.read(_CHUNK):
                    size += len(chunk)
                    if max_bytes is not None and size > max_bytes:
                        raise ValueError(f"input is larger than the limit of {max_bytes} bytes")
                    digest.update(chunk)
                    out.write(chunk)
                out.flush()
                os.fsync(out.fileno())
            key = digest.hexdigest()
            target = self.path(key)
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(tmp, target)  # same bytes already there: replacing is harmless
            return key, size
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def put_hashed(self, data: bytes, key: str) -> None:
        """Store bytes whose sha256 (`key`) the caller computed while receiving them (an upload held in memory):
        no second hashing pass; fsynced, as every original is."""
        if not self._touch(key):
            self._write(key, [data], durable=True)

    def adopt(self, path: Path, key: str) -> None:
        """Move a finished file whose sha256 (`key`) the caller computed while writing it into the store: no copy,
        no second hashing pass (an upload spooled next to the store). The file is fsynced first, as every
        original is. Falls back to a copy when `path` is on another file system; `path` is gone afterwards."""
        target = self.path(key)
        if self._touch(key):
            Path(path).unlink(missing_ok=True)  # same bytes already stored
            return
        with open(path, "rb+") as f:
            # fdatasync: the data and the size that reads need are on disk before the caller answers; timestamps
            # may follow (fsync would also journal them, for nothing an upload's durability depends on).
            os.fdatasync(f.fileno())
        try:
            try:
                os.replace(path, target)
            except FileNotFoundError:  # the first blob of this prefix: make its folder (once, not per file)
                target.parent.mkdir(parents=True, exist_ok=True)
                os.replace(path, target)
        except OSError:  # another file system: copy atomically, then drop the spooled file
            fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".tmp-")
            try:
                with os.fdopen(fd, "wb") as out, open(path, "rb") as src:
                    shutil.copyfileobj(src, out, _CHUNK)
                    out.flush()
                    os.fsync(out.fileno())
                os.replace(tmp, target)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
            Path(path).unlink(missing_ok=True)

    def put_file(self, path: Path) -> tuple[str, int]:
        with open(path, "rb") as f:
            return self.put_stream(f)

    def get_bytes(self, key: str) -> bytes:
        try:
            return self.path(key).read_bytes()
        except FileNotFoundError:
            raise BlobNotFoundError(key) from None

    def _touch(self, key: str) -> bool:
        """True when the blob exists; its mtime is set to now, so a sweep (`keys_older_than`) running before the
        caller's row names it does not take it."""
        try:
            os.utime(self.path(key))
            return True
        except FileNotFoundError:
            return False

    def keys_older_than(self, seconds: float) -> Iterator[str]:
        """Keys of the blobs last written more than `seconds` ago (a sweep must spare blobs an intake or a render
        has just written and not yet named in a row). Leftover temporary files that old are removed on the way."""
        cutoff = time.time() - seconds
        if not self.root.is_dir():
            return
        for folder in sorted(self.root.iterdir()):
            if folder.name.startswith(".incoming-") and _older(folder, cutoff):
                folder.unlink(missing_ok=True)
            if not (folder.is_dir() and len(folder.name) == 2):
                continue
            for entry in folder.iterdir():
                if not _older(entry, cutoff):
                    continue
                if entry.name.startswith(".tmp-"):
                    entry.unlink(missing_ok=True)
                elif _KEY.match(folder.name + entry.name):
                    yield folder.name + entry.name

    def delete(self, key: str) -> bool:
        try:
            self.path(key).unlink()
            return True
        except FileNotFoundError:
            return False

    def _write(self, key: str, parts: list[bytes], *, durable: bool = True) -> None:
        target = self.path(key)
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as out:
                for part in parts:
                    out.write(part)
                out.flush()
                if durable:
                    os.fsync(out.fileno())
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


def _older(path: Path, cutoff: float) -> bool:
    try:
        return path.stat().st_mtime < cutoff
    except FileNotFoundError:
        return False

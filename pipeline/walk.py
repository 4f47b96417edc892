"""Folder walks: which files under a folder are ready (size and mtime stable), which of them are documents (not
plain-text notes beside the scans), and their intake one file at a time through `ingest.ingest_file`."""
from __future__ import annotations

import mimetypes
import os
import time
from pathlib import Path
from typing import Callable, Iterator

from vision.sniff import ACCEPTED, SNIFF_BYTES, is_plain_text

from .context import Pipeline
from .ingest import IngestOutcome, ingest_file, schema_ref
from .tenancy import DEFAULT_TENANT

# Folders a watch-folder run moves processed files into; never ingested themselves.
EXCLUDED_DIRS = frozenset({"done", "failed"})


class TextFileFilter:
    """Folder walks leave out plain-text files (READMEs, scripts, notes): their content is text, so no page can
    come from them, and their name does not claim a media type. A text file named `invoice.pdf` is a damaged
    document, not a note, and still fails with its reason; so does any file named on the command line. The names
    left out are kept for the report."""

    def __init__(self) -> None:
        self.skipped: list[Path] = []

    def __call__(self, path: Path) -> bool:
        if mimetypes.guess_type(path.name)[0] in ACCEPTED:
            return True
        try:
            with path.open("rb") as f:
                head = f.read(SNIFF_BYTES)
        except OSError:
            return True  # unreadable: let intake report it with its reason
        if is_plain_text(head):
            self.skipped.append(path)
            return False
        return True


def _snapshot(folder: Path, excluded: frozenset[str]) -> dict[Path, tuple[int, int]]:
    found: dict[Path, tuple[int, int]] = {}
    for root, dirs, files in os.walk(folder):
        here = Path(root)
        # skip hidden folders and, at the top, the done/ and failed/ folders files are moved into
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and not (here == folder and d in excluded))
        for fname in sorted(files):
            if fname.startswith("."):
                continue  # hidden and partial files (.part, editors' temp files) are not documents
            path = here / fname
            try:
                st = path.stat()
            except FileNotFoundError:
                continue
            found[path] = (st.st_size, st.st_mtime_ns)
    return found


def stable_files(folder: Path, stable_seconds: float, excluded: frozenset[str] = EXCLUDED_DIRS
                 ) -> tuple[list[Path], list[Path]]:
    """(stable, unstable) files under `folder`: a file is stable when its size and mtime did not change over
    `stable_seconds` (waits once, and only if some file was modified more recently than that)."""
    first = _snapshot(folder, excluded)
    now_ns = time.time_ns()
    young = [p for p, (_, mtime) in first.items() if now_ns - mtime < stable_seconds * 1e9]
    if not young:
        return sorted(first), []
    time.sleep(stable_seconds)
    second = _snapshot(folder, excluded)
    stable = sorted(p for p, sig in first.items() if second.get(p) == sig)
    unstable = sorted(p for p in first if second.get(p) != first[p])
    return stable, unstable


def iter_folder(
    p: Pipeline,
    folder: str | os.PathLike[str],
    *,
    schema: str | None = None,
    batch_id: int | None = None,
    stable_seconds: float | None = None,
    include: Callable[[Path], bool] | None = None,
) -> Iterator[IngestOutcome]:
    """Ingest every stable file under `folder` (recursively, hidden files skipped, `include` filters paths), one
    outcome per file, yielded as each is read (callers can start a file's job while the next is read; `list()` it
    for all of them). Argument errors (not a folder, unknown schema) are raised by the call itself."""
    intakes = folder_intakes(p, folder, schema=schema, batch_id=batch_id, stable_seconds=stable_seconds,
                             include=include)
    return (intake() for intake in intakes)


def folder_intakes(
    p: Pipeline,
    folder: str | os.PathLike[str],
    *,
    schema: str | None = None,
    batch_id: int | None = None,
    stable_seconds: float | None = None,
    include: Callable[[Path], bool] | None = None,
) -> list[Callable[[], IngestOutcome]]:
    """iter_folder's files as one intake call each, in its order, not yet run (so a caller can run several at
    once: each renders in a process of its own)."""
    root = Path(folder)
    if not root.is_dir():
        raise NotADirectoryError(f"{root} is not a folder")
    if schema is not None:
        schema_ref(p, schema, DEFAULT_TENANT)
    wait = p.settings.stable_seconds if stable_seconds is None else stable_seconds
    stable, unstable = stable_files(root, wait)
    if include is not None:
        stable = [f for f in stable if include(f)]
        unstable = [f for f in unstable if include(f)]

    def intake(path: Path) -> Callable[[], IngestOutcome]:
        return lambda: ingest_file(p, path, name=str(path.relative_to(root)), schema=schema, batch_id=batch_id)

    def unstable_file(path: Path) -> Callable[[], IngestOutcome]:
        return lambda: IngestOutcome(str(path.relative_to(root)), "unstable")

    return [intake(path) for path in stable] + [unstable_file(path) for path in unstable]

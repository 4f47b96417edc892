"""What a folder walk hands to intake: every file but plain text (READMEs, scripts, notes next to the scans)."""
from __future__ import annotations

import mimetypes
from pathlib import Path

from vision.sniff import ACCEPTED, SNIFF_BYTES, is_plain_text


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

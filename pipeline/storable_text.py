"""The one rule for client text that reaches the database: what both SQLite and PostgreSQL can store.

PostgreSQL text (and its JSON type) cannot hold NUL (U+0000), and neither database driver can encode a lone UTF-16
surrogate (which JSON's `\\ud800` escape can carry) as UTF-8. Text that breaks either rule is refused where it is
written (`check_storable`), treated as matching nothing where it is looked up (`storable`), and cleaned where
refusing would lose a file for a cosmetic reason (`storable_name` for every document name, `clean_display_name`
for uploaded file names).
"""
from __future__ import annotations

import unicodedata

from .errors import UnstorableTextError

NUL = "\x00"


def text_problem(value: str) -> str | None:
    """Why `value` cannot be stored, in words; None when it can."""
    if NUL in value:
        return "contains a NUL character (\\u0000), which the database cannot store; remove it"
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        return (f"contains a lone UTF-16 surrogate ({value[exc.start]!r} at position {exc.start}), which is not "
                "valid Unicode text; send the character itself or a complete surrogate pair")
    return None


def storable(value: str) -> bool:
    """True when the database can store (and so could ever have stored) `value`."""
    return text_problem(value) is None


def check_storable(value: str, what: str) -> str:
    """`value` unchanged, or UnstorableTextError naming `what` (a field name a person recognises)."""
    problem = text_problem(value)
    if problem is not None:
        raise UnstorableTextError(what, problem)
    return value


def storable_name(value: str) -> str:
    """A document or batch item name (a path under a watched folder, an upload's name) the database can store:
    a lone surrogate, which is how Python spells a file name byte that is not UTF-8, becomes U+FFFD, and NUL is
    dropped; everything else is kept, so names stay as recognisable as the file system allows."""
    if storable(value):
        return value
    return "".join("\ufffd" if 0xD800 <= ord(ch) <= 0xDFFF else ch for ch in value if ch != NUL)


def clean_display_name(value: str) -> str:
    """A file name for display and storage: control characters (NUL among them) and lone surrogates dropped."""
    return "".join(ch for ch in value if unicodedata.category(ch) not in ("Cc", "Cs"))

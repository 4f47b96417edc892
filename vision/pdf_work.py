"""How much drawing a PDF page asks for, counted from its structure before MuPDF draws it.

MuPDF's cost per page grows with the operators it interprets, and a form XObject is interpreted every time it is
drawn: a form that draws another form ten times, nested six deep, is a few hundred bytes that cost a million
operators ("billion laughs" for PDF). MuPDF cannot be interrupted from Python while it draws (it holds the GIL),
so we count first: each content stream's operators plus, for each `Do` of a form XObject, that form's own count.
Counts are memoised per form, so the walk costs one read of each stream, whatever the nesting.

The count is an estimate from above: words inside strings and inline image data count as operators too. It only
has to tell "a busy page" (10^5) from "an attack" (10^7 and up); the render time budget catches the rest (patterns,
Type 3 fonts, shadings drawn slowly).
"""
from __future__ import annotations

import re

import pymupdf

# An operator: a bare word of letters (and * ' "), not a /Name; PDF operators are at most three characters.
_OPERATOR = re.compile(rb"(?<![A-Za-z0-9/*'\".#_-])[A-Za-z'\"][A-Za-z*'\"]{0,2}(?![A-Za-z0-9*'\"_.#-])")
_DRAW_FORM = re.compile(rb"/([^\s/\[\]()<>{}%]+)\s+Do\b")
_REFERENCE = re.compile(r"/([^\s/\[\]()<>{}%]+)\s+(\d+)\s+0\s+R")
_INHERIT_DEPTH = 8  # page-tree levels searched for inherited /Resources


class DrawWork:
    """Drawing operators per page of one open MuPDF document (forms memoised across pages). Caller holds the
    MuPDF lock."""

    def __init__(self, doc: pymupdf.Document) -> None:
        self._doc = doc
        self._forms: dict[int, int] = {}  # form xref -> expanded operator count
        self._busy: set[int] = set()  # forms being counted: a form that draws itself (MuPDF stops it) counts once

    def page(self, page: pymupdf.Page) -> int:
        xobjects = self._page_xobjects(page.xref)
        return sum(self._stream(xref, xobjects) for xref in page.get_contents())

    def _stream(self, xref: int, xobjects: dict[str, int]) -> int:
        try:
            data = self._doc.xref_stream(xref) or b""
        except Exception:  # noqa: BLE001 — an unreadable stream draws nothing; MuPDF reports it when rendering
            return 0
        total = len(_OPERATOR.findall(data))
        for match in _DRAW_FORM.finditer(data):
            target = xobjects.get(match.group(1).decode("latin-1"))
            if target is not None:
                total += self._form(target, xobjects)
        return total

    def _form(self, xref: int, inherited: dict[str, int]) -> int:
        if xref in self._forms:
            return self._forms[xref]
        if xref in self._busy or self._doc.xref_get_key(xref, "Subtype")[1] != "/Form":
            return 0  # an image (drawn once, counted as its Do) or a cycle
        self._busy.add(xref)
        try:
            own = self._xobjects(xref)
            count = self._stream(xref, own if own is not None else inherited)
        finally:
            self._busy.discard(xref)
        self._forms[xref] = count
        return count

    def _page_xobjects(self, xref: int) -> dict[str, int]:
        key = "Resources/XObject"
        for _ in range(_INHERIT_DEPTH):
            found = self._xobjects_at(xref, key)
            if found is not None:
                return found
            if self._doc.xref_get_key(xref, "Resources")[0] != "null":
                return {}  # resources without forms
            kind, parent = self._doc.xref_get_key(xref, "Parent")
            if kind != "xref":
                return {}
            xref = int(parent.split()[0])
        return {}

    def _xobjects(self, xref: int) -> dict[str, int] | None:
        return self._xobjects_at(xref, "Resources/XObject")

    def _xobjects_at(self, xref: int, key: str) -> dict[str, int] | None:
        kind, value = self._doc.xref_get_key(xref, key)
        if kind == "xref":
            value = self._doc.xref_object(int(value.split()[0]), compressed=True)
        elif kind != "dict":
            return None
        return {name: int(number) for name, number in _REFERENCE.findall(value)}

"""Reading a finished pipeline run back from its SQLite file, judging it, and comparing two runs.

Read with the standard library's sqlite3 (not the pipeline's own queries), so the check does not trust the code
it checks. A run passes when every expected file became exactly one document, whose one job succeeded with exactly
one merged result row and one ok result row per page.
"""
from __future__ import annotations

import json
import sqlite3
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePath
from typing import Any


@dataclass
class UnitRow:
    unit: str
    ok: bool
    raw_text: str | None
    data: Any
    error: str | None
    completion_tokens: int


@dataclass
class DocRow:
    name: str  # the file's base name (in-process runs store the path given, `submit` the name)
    document_id: int
    status: str
    page_count: int
    error: str | None
    jobs: list[dict[str, Any]] = field(default_factory=list)  # id, state, attempts, error
    merged: list[UnitRow] = field(default_factory=list)  # the job's "document" result rows (exactly one expected)
    units: list[UnitRow] = field(default_factory=list)  # page / video rows of the job


def _json(value: Any) -> Any:
    return json.loads(value) if isinstance(value, str) else value


def read_run(db_path: Path) -> list[DocRow]:
    """Every document of a run with its jobs and result rows."""
    con = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)
    try:
        con.row_factory = sqlite3.Row
        docs = []
        for d in con.execute("SELECT id, original_name, status, page_count, error FROM documents ORDER BY id"):
            doc = DocRow(PurePath(d["original_name"]).name, d["id"], d["status"], d["page_count"] or 0, d["error"])
            for j in con.execute("SELECT id, state, attempts, error FROM jobs WHERE document_id = ? ORDER BY id",
                                 (d["id"],)):
                doc.jobs.append(dict(j))
                for r in con.execute("SELECT unit, ok, raw_text, data, error, completion_tokens FROM results "
                                     "WHERE job_id = ? ORDER BY page_index, id", (j["id"],)):
                    row = UnitRow(r["unit"], bool(r["ok"]), r["raw_text"], _json(r["data"]), r["error"],
                                  r["completion_tokens"] or 0)
                    (doc.merged if row.unit == "document" else doc.units).append(row)
            docs.append(doc)
        return docs
    finally:
        con.close()


def problems(docs: list[DocRow], expected: list[str]) -> list[str]:
    """Why a run is not a pass (empty list: it is). `expected` are the base names of the files sent."""
    found: dict[str, list[DocRow]] = {}
    for doc in docs:
        found.setdefault(doc.name, []).append(doc)
    out = [f"{name}: no document" for name in expected if name not in found]
    out += [f"{name}: not sent, yet a document exists" for name in found if name not in expected]
    for name, rows in found.items():
        if len(rows) != 1:
            out.append(f"{name}: {len(rows)} documents, expected 1")
        for doc in rows:
            out += [f"{name}: {p}" for p in _document_problems(doc)]
    return out


def _document_problems(doc: DocRow) -> list[str]:
    out = []
    if doc.status == "failed":
        out.append(f"document failed: {doc.error}")
    if len(doc.jobs) != 1:
        return out + [f"{len(doc.jobs)} jobs, expected 1"]
    job = doc.jobs[0]
    if job["state"] != "succeeded":
        out.append(f"job {job['id']} is {job['state']}: {job['error']}")
    if len(doc.merged) != 1:
        out.append(f"{len(doc.merged)} merged result rows, expected exactly 1")
    elif not doc.merged[0].ok:
        out.append(f"merged result not ok: {doc.merged[0].error}")
    if len(doc.units) != max(doc.page_count, 1):
        out.append(f"{len(doc.units)} unit results for {doc.page_count} page(s)")
    out += [f"{u.unit} failed: {u.error}" for u in doc.units if not u.ok]
    return out


@dataclass
class DocComparison:
    name: str
    merged_equal: bool
    units_equal: int  # units whose raw model text is identical
    units_total: int
    first_difference: str | None  # "unit: char N" of the first unit whose text differs


def first_difference(a: str, b: str) -> int | None:
    """Index of the first differing character (the shorter length if one is a prefix); None if equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def compare_runs(a: list[DocRow], b: list[DocRow]) -> list[DocComparison]:
    """Per file present in both runs: is the merged JSON the same, and how many units produced the same text."""
    by_name = {d.name: d for d in b}
    out = []
    for doc in a:
        other = by_name.get(doc.name)
        if other is None:
            continue
        merged_equal = (len(doc.merged) == len(other.merged) == 1
                        and _canonical(doc.merged[0].data) == _canonical(other.merged[0].data))
        units_b = {u.unit: u for u in other.units}
        equal, first = 0, None
        for unit in doc.units:
            peer = units_b.get(unit.unit)
            at = first_difference(unit.raw_text or "", peer.raw_text or "") if peer is not None else 0
            if at is None:
                equal += 1
            elif first is None:
                first = f"{unit.unit}: char {at}"
        out.append(DocComparison(doc.name, merged_equal, equal, len(doc.units), first))
    return out


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False)


def comparison_json(rows: list[DocComparison]) -> list[dict[str, Any]]:
    return [asdict(r) for r in rows]


def merged_preview(docs: list[DocRow], width: int = 100) -> dict[str, str]:
    """The merged JSON of each document, cut to `width` characters (for the summary)."""
    out = {}
    for doc in docs:
        text = _canonical(doc.merged[0].data) if doc.merged else "-"
        out[doc.name] = text[:width] + ("…" if len(text) > width else "")
    return out
